"""The training loop of ``dpkern finetune``: Poisson-sampled steps, checkpoints (at
--save-every, at a SIGINT / SIGTERM step boundary, at the end), metrics.json and the
summary. Nothing exact and data-dependent (samples drawn, clipped, non-finite) is written
or shown; a run with --noise-seed says it is not private instead of claiming an epsilon.
The progress bar's epsilon is recomputed at most every ``options.EPS_REFRESH_S`` seconds
(an accountant's epsilon can be slow), so it may lag a few steps, and always at the last
step (the end, or a stop): the final bar's epsilon is exact."""

from __future__ import annotations

import math
import sys
import time

import torch

from ... import models
from ..stop import StopSignals
from .checkpoint import write_checkpoint
from .clipping import unit_chunks
from .options import EPS_REFRESH_S
from .plan import NOT_PRIVATE, run_record
from .summary import print_summary


class _BarEpsilon:
    """The progress bar's epsilon: the accountant's at ``delta``, recomputed by
    :meth:`at` when the step count changed and either ``interval`` seconds passed since
    the last computation or the step is final (the last step, or a stop), so the final
    bar shows the exact epsilon and the cost stays bounded."""

    def __init__(self, accountant, delta: float, step: int, interval: float):
        self.accountant, self.delta, self.interval = accountant, delta, interval
        self.value, self.step, self.time = None, step, -math.inf

    def at(self, step: int, final: bool = False) -> float:
        now = time.perf_counter()
        fresh = step == self.step and self.value is not None
        if not fresh and (final or now - self.time >= self.interval):
            self.value, self.step, self.time = self.accountant.get_epsilon(self.delta), step, now
        return self.value


def run_training(args, job, dist_ctx=None, stop: StopSignals | None = None) -> int:
    """The training loop over a prepared :class:`~.job.Job`. ``dist_ctx``: None, or
    (rank, world size) inside an initialised process group with ``job.optimizer`` a
    DistributedDPOptimizer. ``stop``: SIGINT/SIGTERM
    end the loop at a step boundary (every rank at the same one); the job then
    checkpoints and returns 128 + the signal number."""
    plan, out, model, tokenizer, net = job.plan, job.out, job.model, job.tokenizer, job.net
    optimizer, accountant, per_sample = job.optimizer, job.accountant, job.per_sample
    train, val, n_bytes, done, steps = job.train, job.val, job.n_bytes, job.done, job.steps
    micro, delta, numel, device = job.micro, job.delta, job.numel, job.device
    old_metrics = job.old_metrics

    from tqdm import tqdm

    stop = stop or StopSignals()
    q, sigma = plan.sample_rate, plan.noise_multiplier
    private = plan.noise_seed is None
    rank, world = dist_ctx or (0, 1)
    fsdp = bool(getattr(optimizer, "sharded", False))
    writes = getattr(args, "writes", out is not None)  # (FSDP: ranks != 0 join the gathers)
    t_start = time.perf_counter()
    # the Opacus-820 trap: parameters the optimizer does not own (the model moved to
    # another device after the optimizer was built), or that do not move in the first step
    try:
        update_check = None if fsdp else _update_check(model, optimizer)
    except ValueError as exc:
        print(f"dpkern finetune: error: {exc}. Nothing was trained or saved", file=sys.stderr)
        return 1
    val_before = models.evaluate(net, val, args.eval_batch_size, device)
    if plan.seed is not None:  # dropout masks (a --model with dropout): per rank, per resume
        segment_seed = (plan.seed * 1_000_003 + done) % 2**63
        torch.manual_seed((segment_seed * 1009 + rank + 1) % 2**63)
    sampler = _make_sampler(plan, job, steps - done, dist_ctx)
    fixed = plan.max_batch_size is not None
    overflow = plan.batch_overflow_probability if fixed else 0.0
    train_time = 0.0
    segment_start = done
    loss_ema = None
    bar_eps = _BarEpsilon(accountant, delta, done, EPS_REFRESH_S) if private else None

    # Throughput of the EXPECTED batch: the exact count of sampled blocks depends on the
    # data. For block units it is in tokens (B_e blocks of block_size); for documents and
    # users the blocks per unit are private (their total moves with one unit), so it is
    # in units (B_e = q N units, N public as the accountant's), never in blocks.
    per_unit = job.units is not None

    def expected_tokens_per_second():
        if per_unit:
            return None
        tokens = (optimizer.dp_step - segment_start) * plan.batch_size * plan.block_size
        return tokens / max(train_time, 1e-9)

    def expected_units_per_second():
        return (optimizer.dp_step - segment_start) * plan.batch_size / max(train_time, 1e-9)

    def checkpoint(val_after=None, final=False, sample=None):
        report = accountant.privacy_report(delta, numel)
        eps, delta_total = report["epsilon"], report["delta_total"]
        if private:
            privacy = {
                "private": True,
                "epsilon": eps,
                "target_epsilon": plan.epsilon,
                "delta": delta_total,
            }
        else:  # what the run would spend with a secret key: not a claim
            privacy = {
                "private": False,
                "privacy": NOT_PRIVATE,
                "epsilon_if_noise_key_were_secret": eps,
                "epsilon_for_noise_calibration": plan.epsilon,
                "delta_if_noise_key_were_secret": delta_total,
            }
        if getattr(args, "epsilon_curve", False):
            deltas = sorted({delta, *(10.0**-k for k in range(2, 13))})
            curve = [
                {"delta": d, "epsilon": e} for d, e in zip(deltas, accountant.epsilon_curve(deltas))
            ]
            privacy["epsilon_curve" if private else "epsilon_curve_if_noise_key_were_secret"] = (
                curve
            )
        metrics = {
            "step": optimizer.dp_step,
            "steps": steps,
            **privacy,
            "target_delta": job.target_delta,
            "delta_mechanism": delta,
            "noise_multiplier": sigma,
            "sample_rate": q,
            "max_grad_norm": plan.max_grad_norm,
            "expected_batch_size": plan.batch_size,
            "accountant": plan.accountant,
            "optimizer": plan.optimizer,
            "lr": plan.lr,
            "backend": args.backend,
            "backend_resolved": optimizer._backend_line(),
            "val_loss_before": val_before,
            "val_perplexity_before": math.exp(val_before),
            "val_loss_after": val_after,
            "val_perplexity_after": None if val_after is None else math.exp(val_after),
            "val_loss_initial": old_metrics.get("val_loss_initial", val_before),
            # (no training loss: exact on the private data, un-noised; the bar shows it live)
            "train_seconds": train_time,
            "expected_tokens_per_second": expected_tokens_per_second(),
            "expected_units_per_second": expected_units_per_second(),
            "total_seconds": time.perf_counter() - t_start,
            "num_parameters": numel,
            "num_parameters_total": job.total_params,
            "arch": plan.arch,
            "lora": plan.lora,
            "lora_alpha": plan.lora_alpha,
            "lora_dropout": plan.lora_dropout,
            "bf16": plan.bf16,
            "stochastic_rounding": plan.stochastic_rounding,
            "gradient_checkpointing": bool(getattr(args, "gradient_checkpointing", False)),
            "clipping": args.clipping,
            # exact block counts only where the block is the unit (N, public); for
            # documents and users they would publish the private sum of unit sizes
            "n_train_blocks": None if per_unit else plan.n_train,
            "n_val_blocks": None if per_unit else plan.n_val,
            "block_size": plan.block_size,
            "privacy_unit": plan.privacy_unit,
            "n_units": plan.n_units,
            "delta_noise_tail": report["delta_noise_tail"],
            "max_batch_size": plan.max_batch_size,
            "max_blocks_per_unit": plan.max_blocks_per_unit,
            "batch_overflow_probability": overflow,
            "delta_batch_truncation": report["delta_batch_truncation"],
            "finished": final,
            "nproc": world,
            "fsdp": fsdp,
            "bytes_per_rank": _resident_bytes(optimizer),
        }
        if sample is not None:
            metrics["sample_prompt"] = models.SAMPLE_PROMPT
            metrics["sample"] = sample
        segment = {
            "steps": [segment_start, optimizer.dp_step],
            "nproc": world,
            "fsdp": fsdp,
            "train_seconds": train_time,
        }
        metrics["segments"] = _past_segments(old_metrics) + [segment]
        model_state = opt_state = None
        if fsdp and writes:  # collectives: every rank gathers, rank 0 writes
            from ...sharding import is_sharded

            model.reshard()
            # one gather per parameter, so tied weights stay one tensor (the same on
            # every rank: keyed by the module's parameter objects, not by storage)
            owner = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
            full: dict[int, torch.Tensor] = {}
            model_state = {}
            for k, v in model.state_dict().items():
                key = owner.get(k, id(v))
                if is_sharded(v) and key not in full:
                    full[key] = v.full_tensor()
                model_state[k] = full.get(key, v)
            opt_state = optimizer.state_dict(full=True)
        if out is not None:
            opt_state = opt_state if fsdp else optimizer.state_dict()
            # never the optimizer's exact data-dependent counts (optimizer.stats)
            dp_state = {k: v for k, v in opt_state["dp"].items() if k != "stats"}
            trainer = {
                "step": optimizer.dp_step,
                "optimizer": {**opt_state, "dp": dp_state},
                "accountant": accountant.state_dict(),
            }
            write_checkpoint(out, model, tokenizer, run_record(plan), metrics, trainer, model_state)
        return metrics

    net.train()
    bar = tqdm(
        total=steps,
        initial=done,
        desc="dp fine-tuning",
        unit="step",
        disable=args.quiet,
        dynamic_ncols=True,
        file=sys.stderr,
    )
    stopped = dist_ctx is None and stop.requested  # (ranks agree on a stop after a step)
    for sampled in iter(()) if stopped else sampler.batches():
        t0 = time.perf_counter()
        batch = train[sampled.indices]
        mask = sampled.mask if fixed else None
        losses = []
        if job.units is not None:  # whole units per micro-batch, padding dropped
            rows = sampled.mask.nonzero().flatten()
            unit_ids = sampled.unit_ids[rows]
            for a, b in unit_chunks(unit_ids, micro):
                losses.append(per_sample.units(batch[rows[a:b]].to(device), unit_ids[a:b], micro))
                optimizer.accumulate()
            if not losses:
                losses.append(per_sample(batch[:0].to(device)))
                optimizer.accumulate()
        else:
            chunks = [(i, i + micro) for i in range(0, batch.shape[0], micro)] or [(0, 0)]
            if fsdp:  # every rank runs as many micro-batches (forwards are collectives)
                import torch.distributed as dist

                n = torch.tensor([len(chunks)], device=device)
                dist.all_reduce(n, op=dist.ReduceOp.MAX)
                chunks += [(0, 0)] * (int(n) - len(chunks))
            for a, b in chunks:
                chunk_mask = None if mask is None else mask[a:b]
                losses.append(per_sample(batch[a:b].to(device), chunk_mask))
                if not getattr(per_sample, "accumulates", False):
                    optimizer.accumulate()
        optimizer.step()
        accountant.step(sigma, q, overflow_probability=overflow)
        if update_check is not None:
            try:
                update_check.after_step()
            except RuntimeError as exc:
                bar.close()
                print(f"dpkern finetune: error: {exc}{_UPDATE_HINT}", file=sys.stderr)
                return 1
            update_check = None
        count, loss_sum = sampled.num_rows, float(torch.cat(losses).sum()) if losses else 0.0
        stop_now = stop.requested
        if dist_ctx is not None:  # global mean loss for the bar; a stop on any rank is all's
            import torch.distributed as dist

            t = torch.tensor([count, loss_sum, float(stop_now)], dtype=torch.float64, device=device)
            dist.all_reduce(t)
            count, loss_sum, stop_now = int(t[0]), float(t[1]), bool(t[2] > 0)
        train_time += time.perf_counter() - t0
        if count:  # (the un-noised training loss: for the operator only)
            mean = loss_sum / count
            loss_ema = mean if loss_ema is None else 0.9 * loss_ema + 0.1 * mean
        final = optimizer.dp_step >= steps or stop_now
        eps = bar_eps.at(optimizer.dp_step, final) if private else None
        bar.set_postfix(
            loss=f"{loss_ema:.3f}" if loss_ema is not None else "-",
            **({"eps": f"{eps:.2f}"} if private else {}),
            **(
                {"units_s": f"{expected_units_per_second():.1f}"}
                if per_unit
                else {"tok_s": f"{expected_tokens_per_second():.0f}"}
            ),
            refresh=False,
        )
        bar.update(1)
        if stop_now and optimizer.dp_step < steps:
            stopped = True
            break
        if (
            args.save_every
            and optimizer.dp_step % args.save_every == 0
            and optimizer.dp_step < steps
            and (out is not None or fsdp and writes)
        ):
            checkpoint()
    bar.close()
    if stopped:
        optimizer.zero_grad()  # (nothing pending: the loop stops between steps)
        metrics = checkpoint()
        if rank == 0:
            spent = f"epsilon spent {metrics['epsilon']:.3g}" if private else NOT_PRIVATE
            where = (
                f"checkpoint saved, resume with --resume {out}"
                if out is not None
                else "nothing saved (no --out)"
            )
            print(
                f"dpkern finetune: stopped by {stop.name or 'SIGINT'} at step "
                f"{optimizer.dp_step}/{steps}, {spent}; {where}",
                file=sys.stderr,
            )
        return stop.exit_code
    if dist_ctx is not None and not fsdp:
        from .launch import check_replicas

        check_replicas(model, world, device)
    val_after = models.evaluate(net, val, args.eval_batch_size, device)
    # a greedy continuation of a fixed public prompt (every rank: FSDP's forwards are
    # collectives); post-processing of the released model
    sample = models.generate_sample(model, tokenizer)
    metrics = checkpoint(val_after, final=True, sample=sample)
    if rank == 0:
        print_summary(plan, args, metrics, n_bytes, done, out)
    return 0


_UPDATE_HINT = (
    " (dpkern finetune builds its optimizer after moving the model to its device: if "
    "--bf16 is on, the update may be below bfloat16's resolution: raise --lr, add "
    "--stochastic-rounding or drop --bf16). Nothing was saved"
)


def _update_check(model, optimizer):
    """dpkern.integrations.guard.UpdateCheck: the optimizer updates exactly the model's
    trainable parameters (checked now) and each of them moves in the first step (checked
    by ``after_step``)."""
    from ...integrations.guard import UpdateCheck

    return UpdateCheck(model, optimizer)


def _make_sampler(plan, job, steps: int, dist_ctx):
    """The counter-based Poisson sampler of the remaining steps (SPEC 3.1): it starts at
    step done + 1, so a resumed run continues the same sequence of batches. The sampling
    key derives from --seed, or is a secret (os.urandom; rank 0's, broadcast)."""
    kw = {
        "seed": plan.seed,
        "start_step": job.done + 1,
        "units": job.units,
        "max_batch_size": plan.max_batch_size,
        "max_unit_size": plan.max_blocks_per_unit,
    }
    n, q = job.train.shape[0], plan.sample_rate
    if dist_ctx is None:
        from ...sampling import PoissonBatchSampler

        return PoissonBatchSampler(n, q, steps, **kw)
    from ...distributed import DistributedPoissonSampler

    rank, world = dist_ctx
    return DistributedPoissonSampler(n, q, steps, rank=rank, num_replicas=world, **kw)


def _resident_bytes(optimizer) -> dict:
    """Bytes of parameters and optimizer state this rank keeps between steps (its shards
    under --fsdp, everything otherwise)."""
    from ...sharding import local_shard

    params = optimizer.trainable_params()
    state = sum(
        v.numel() * v.element_size()
        for p in params
        for v in optimizer.state.get(p, {}).values()
        if isinstance(v, torch.Tensor)
    )
    return {
        "params": sum(local_shard(p)[0].numel() * p.element_size() for p in params),
        "optimizer_state": state,
    }


_SEGMENT_KEYS = ("steps", "nproc", "fsdp", "train_seconds")


def _past_segments(old_metrics: dict) -> list[dict]:
    """The training segments (run, then each resume) before this one, from the resumed
    checkpoint's metrics.json (exact sample counts of older versions are dropped)."""
    if not old_metrics:
        return []
    if "segments" in old_metrics:
        return [{k: g.get(k) for k in _SEGMENT_KEYS} for g in old_metrics["segments"]]
    return [
        {
            "steps": [None, old_metrics.get("step")],
            "nproc": old_metrics.get("nproc", 1),
            "fsdp": old_metrics.get("fsdp", False),
            "train_seconds": old_metrics.get("train_seconds"),
        }
    ]
