"""The job of ``dpkern finetune``: every check and the objects a run trains with (model,
data, optimizer, accountant, clipping), built by :func:`prepare` before anything is
written. Deterministic given the options (the model init in secure mode aside), so that
data-parallel workers rebuild the same job."""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ... import models
from .blocks import fixed_shape, load_blocks
from .checkpoint import UsageError, check_out, load_checkpoint
from .checks import check_device, check_memory_options, check_nproc
from .clipping import FSDP_NEEDS_GHOST, Ghost, PerSample, choose_clipping
from .model import lora_base, load_model
from .options import DEFAULT_MICRO_BATCH, check_numbers, require
from .plan import (
    Plan,
    calibrate_extension,
    check_batch_fits,
    check_units,
    plan_from_args,
    saved_plan,
    unit_name,
    warn_delta,
)


@dataclass
class Job:
    """What one run trains with, built by :func:`prepare` (every check passed). ``out``
    is None on ranks that do not write; ``done``: steps already taken (a resumed run);
    ``steps``: the total at the end; ``micro``: the micro-batch size; ``delta``: the
    Gaussian mechanism's delta, sigma's calibration target (the target delta less the
    fixed-shape truncation's charge at the target epsilon, so the reported total stays
    within the target); ``target_delta``: the user's delta; ``numel``: trainable parameters (the LoRA adapters' with --lora: what the norms and
    the noise cover); ``total_params``: all of the model's; ``old_metrics``: the resumed
    checkpoint's metrics.json ({} for a new run); ``units``: None (each block its own
    privacy unit) or int64 ``[len(train)]``, the unit of each training block (0 .. U-1)."""

    plan: Plan
    out: Path | None
    model: torch.nn.Module
    tokenizer: Any
    net: torch.nn.Module
    optimizer: Any
    accountant: Any
    per_sample: Any
    train: torch.Tensor
    val: torch.Tensor
    n_bytes: int
    done: int
    steps: int
    micro: int
    delta: float
    numel: int
    device: torch.device
    old_metrics: dict
    units: torch.Tensor | None = None
    target_delta: float | None = None
    total_params: int = 0


def make_optimizer(plan: Plan, params, backend: str, sigma: float):
    from ... import rules

    spec = rules.by_cli_name(plan.optimizer)
    cls, options = spec.optimizer_class(), spec.optimizer_options()
    kw = {
        "lr": plan.lr,
        "noise_multiplier": sigma,
        "expected_batch_size": plan.batch_size,
        "seed": plan.noise_seed,
        "backend": backend,
        "stochastic_rounding": plan.stochastic_rounding,
    }  # None: a secret key (os.urandom)
    if plan.weight_decay is not None:
        if "weight_decay" not in options:
            raise UsageError("--weight-decay", f"{plan.optimizer} has no weight decay")
        kw["weight_decay"] = plan.weight_decay
    if "max_grad_norm" in options:  # not for whitening rules (their bound adapts)
        kw["max_grad_norm"] = plan.max_grad_norm
    try:
        opt = cls(params, **kw)
    except ValueError as exc:
        raise UsageError("--optimizer", f"{plan.optimizer}: {exc}") from None
    if hasattr(opt, "train"):  # schedule-free (SPEC 10.8): the parameters hold y
        opt.train()
    return opt


def prepare(args) -> Job:
    """Validate everything and build the :class:`Job`.

    Raises UsageError on bad input. Deterministic given args (the model init in secure
    mode aside), so that data-parallel workers rebuild the same job."""
    check_numbers(args)
    saved = trainer_state = old_metrics = None
    if args.resume:
        saved, trainer_state, old_metrics = load_checkpoint(Path(args.resume))
        saved = saved_plan(saved, trainer_state)
    plan = plan_from_args(args, saved)
    check_units(plan)
    require(
        getattr(args, "nproc", 1) == 1
        or plan.max_batch_size is None
        or plan.privacy_unit == "block",
        "--max-batch-size",
        f"fixed shapes over --nproc ranks need units of one block; --privacy-unit "
        f"{plan.privacy_unit} keeps a unit's blocks on one rank (use variable batches)",
    )
    protected = {"--data": plan.data, "--model": plan.model, "--resume": args.resume}
    if plan.model is not None and models.is_adapter_dir(plan.model):  # (a LoRA run's)
        option = "--resume" if args.resume else "--model"
        protected["the base of --model"] = lora_base(plan.model, option)
    out = check_out(args.out, overwrite=args.overwrite, resume=args.resume, protected=protected)
    if args.grad_sample == "opacus":
        try:
            import opacus  # noqa: F401
        except ImportError:
            raise UsageError(
                "--grad-sample", "opacus is not installed (pip install 'dpkern[opacus]')"
            ) from None
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as exc:
        raise UsageError("--device", str(exc)) from None
    check_device(device)
    check_nproc(args, device)
    check_memory_options(args, plan)
    from ... import backends

    if args.backend != "auto":
        try:
            backends.resolve(args.backend, device)
        except (RuntimeError, ValueError) as exc:
            raise UsageError("--backend", str(exc)) from None

    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise UsageError(
            "--model" if getattr(args, "model", None) else None,
            "the finetune job needs transformers, which is not "
            "installed (pip install 'dpkern[llm]')",
        ) from None
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's RDP series notes
    model, tokenizer = load_model(plan, args)
    block_size_given = args.block_size is not None and saved is None
    train, val, n_bytes, n_tokens, units = load_blocks(plan, tokenizer, block_size_given)
    n_blocks = train.shape[0]
    n = n_blocks if units is None else int(units.max()) + 1  # training units
    if saved is not None:
        # (with units of several blocks only the unit count is saved: block counts move
        # with one unit's size, see plan.run_record)
        have = {"n_train": n_blocks, "n_val": val.shape[0], "n_units": n}
        want = dict(have, n_units=saved.get("n_units") or saved.get("n_train"))
        want.update({k: saved[k] for k in ("n_train", "n_val") if saved.get(k) is not None})
        if have != want:
            what = "blocks" if units is None else unit_name(plan, n)
            key = "n_train" if units is None else "n_units"
            raise UsageError(
                "--data",
                f"gives {have[key]} training {what}, the checkpoint was trained on "
                f"{want[key]}: not the same data",
            )
    check_batch_fits(plan, n, n_tokens, block_size_given)
    q = plan.batch_size / n
    delta = plan.delta if plan.delta is not None else 1.0 / n**1.1
    steps = (
        plan.steps
        if plan.steps is not None
        else max(1, math.ceil(plan.epochs * n / plan.batch_size))
    )
    done = int(trainer_state["step"]) if trainer_state else 0

    from ...accounting import PrivacyAccountant, get_noise_multiplier, overflow_delta

    target_delta = delta
    if plan.max_batch_size is not None:
        # Fixed shapes cost (1 + e^eps) sum_t P_t[overflow] in delta (at most a tenth of
        # it): sigma is calibrated for what is left, so the reported total stays within.
        plan.sample_rate = q
        plan.batch_overflow_probability = fixed_shape(plan, n_blocks, units, steps, delta)
        delta -= overflow_delta(steps * plan.batch_overflow_probability, plan.epsilon)
    accountant = PrivacyAccountant(plan.accountant)
    if trainer_state:
        accountant.load_state_dict(trainer_state["accountant"])
    if saved is None:
        try:
            sigma = get_noise_multiplier(plan.epsilon, delta, q, steps, plan.accountant)
        except ValueError as exc:
            raise UsageError("--epsilon", f"budget too small: {exc}") from None
    else:
        require(steps >= done, "--steps", f"{steps} is below the checkpoint's step {done}")
        require(
            steps > done,
            "--steps",
            f"the checkpoint already finished its {done} steps; pass a larger --steps to continue",
        )
        if steps == saved.get("steps") and plan.epsilon == saved.get("epsilon"):
            sigma = float(saved["noise_multiplier"])  # an interrupted run: same plan
        else:
            sigma = calibrate_extension(
                accountant.history,
                q,
                steps - done,
                plan.epsilon,
                delta,
                plan.accountant,
                guess=float(saved["noise_multiplier"]),
            )
            changed = (
                [f"steps {saved.get('steps')} -> {steps}"] if steps != saved.get("steps") else []
            )
            if plan.epsilon != saved.get("epsilon"):
                old_eps = saved.get("epsilon")
                old_eps = f"{old_eps:g}" if isinstance(old_eps, (int, float)) else old_eps
                changed.append(f"epsilon {old_eps} -> {plan.epsilon:g}")
            print(
                f"dpkern finetune: note: the plan changed on resume ({', '.join(changed)}): "
                f"sigma recalibrated {float(saved['noise_multiplier']):.4g} -> {sigma:.4g} for "
                f"the {steps - done} steps left, so that the whole run spends at most epsilon "
                f"{plan.epsilon:g}",
                file=sys.stderr,
            )
    plan.steps, plan.epochs = steps, None
    plan.n_train, plan.n_val, plan.sample_rate = n_blocks, val.shape[0], q
    plan.noise_multiplier, plan.n_units = sigma, n
    plan.tokenizer = "bytes" if tokenizer is None else "hf"

    model.to(device)
    net = models.CausalLMLogits(model, explicit_positions=args.grad_sample == "opacus")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(plan, params, args.backend, sigma)
    if trainer_state:
        try:
            optimizer.load_state_dict(trainer_state["optimizer"])
        except (ValueError, KeyError) as exc:
            raise UsageError("--resume", f"optimizer state does not fit: {exc}") from None
        optimizer.noise_multiplier = sigma
    micro = args.micro_batch_size or DEFAULT_MICRO_BATCH
    args.clipping = choose_clipping(args, plan, net, params)
    require(
        not getattr(args, "fsdp", False) or args.clipping == "ghost", "--fsdp", FSDP_NEEDS_GHOST
    )
    checkpointing = bool(getattr(args, "gradient_checkpointing", False))
    if args.clipping == "per-sample" and checkpointing:
        print(
            "dpkern finetune: note: --gradient-checkpointing with per-sample clipping "
            "computes per-sample gradients one sample at a time (torch.func cannot "
            "transform the recomputed blocks): slower; ghost clipping is not affected",
            file=sys.stderr,
        )
    per_sample = (
        Ghost(net, optimizer)
        if args.clipping == "ghost"
        else PerSample(net, args.grad_sample, loop=checkpointing)
    )
    numel = sum(p.numel() for p in params)
    warn_delta(plan.delta, n, f"training {unit_name(plan, n)}")  # (last: input errors first)
    return Job(
        plan=plan,
        out=out,
        model=model,
        tokenizer=tokenizer,
        net=net,
        optimizer=optimizer,
        accountant=accountant,
        per_sample=per_sample,
        train=train,
        val=val,
        n_bytes=n_bytes,
        done=done,
        steps=steps,
        micro=micro,
        delta=delta,
        target_delta=target_delta,
        numel=numel,
        total_params=sum(p.numel() for p in model.parameters()),
        device=device,
        old_metrics=old_metrics or {},
        units=units,
    )
