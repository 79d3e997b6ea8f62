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
from .checkpoint import BASE_DIR, UsageError, check_out, is_run_dir, load_checkpoint
from .clipping import FSDP_NEEDS_GHOST, Ghost, PerSample, choose_clipping
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


#: Said when --model DIR is an earlier run's output: this run's ledger starts at zero.
EARLIER_RUN_NOTE = (
    "dpkern finetune: note: --model DIR is the output of an earlier dpkern finetune run; "
    "this run accounts its own epsilon from zero: if the two runs' data overlap, the "
    "final model's privacy is the composition of both (the epsilons add up at most); "
    "--resume DIR continues that run's ledger instead"
)


def load_model(plan: Plan, args):
    """(model, tokenizer or None): the built-in model (--arch), a --model DIR, or the
    resumed checkpoint's; then --bf16 (weights cast to bfloat16), --gradient-checkpointing
    and --lora (a new adapter, or saved adapters trained further: the checkpoint's, or a
    LoRA run's given as --model with --lora). A LoRA run given as --model without --lora
    is the model it trained, its adapters merged into the base (models.load_model).
    Nothing is on the device yet."""
    attn = "eager" if args.grad_sample == "functorch" else None
    adapter = None  # saved LoRA adapters to train further, on their base
    if args.resume and plan.lora is not None:  # the base, then the saved adapter
        adapter, option = Path(args.resume), "--resume"
        source = adapter / BASE_DIR if plan.model is None else lora_base(plan.model, option)
    elif args.resume:
        source, option = args.resume, "--resume"
    elif plan.model is not None and plan.lora is not None and models.is_adapter_dir(plan.model):
        adapter, option = Path(plan.model), "--model"
        continue_lora(plan, args)
        source = lora_base(plan.model, option)
    elif plan.model is not None:
        source, option = plan.model, "--model"
    else:
        source = option = None
    if source is None:
        model, tokenizer = (
            models.default_model(plan.block_size, seed=plan.seed, arch=plan.arch),
            None,
        )
    else:
        try:
            model, tokenizer = models.load_model(source, attn)
        except ValueError as exc:
            what = (
                "the base model this LoRA run was trained on"
                + (" (its --model DIR)" if plan.model is not None and args.resume else "")
                + ": "
                if adapter is not None
                else ""
            )
            raise UsageError(option, what + str(exc)) from None
    if not args.resume and plan.model is not None and is_run_dir(Path(plan.model)):
        print(EARLIER_RUN_NOTE, file=sys.stderr)
    ctx = models.context_length(model)
    if ctx is not None and plan.block_size > ctx:
        raise UsageError(
            "--block-size", f"{plan.block_size} exceeds the model's context length {ctx}"
        )
    if plan.bf16:
        model.to(torch.bfloat16)
    if getattr(args, "gradient_checkpointing", False):
        try:
            models.enable_checkpointing(model)
        except ValueError as exc:
            raise UsageError("--gradient-checkpointing", str(exc)) from None
    if adapter is not None:
        try:
            model = models.load_lora(model, adapter, dropout=plan.lora_dropout)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UsageError(
                option, f"{adapter}: the LoRA adapter does not load: {first}"
            ) from None
    elif plan.lora is not None:
        try:
            model = models.add_lora(model, plan.lora, plan.lora_alpha, plan.lora_dropout)
        except ValueError as exc:
            raise UsageError("--lora", str(exc)) from None
    return model, tokenizer


def lora_base(path: str, option: str) -> str:
    """The base model directory of the LoRA run (or peft adapter directory) ``path``
    (models.base_of); a plain model directory is its own. UsageError naming ``option``
    when it cannot be found."""
    try:
        return str(models.base_of(path))
    except ValueError as exc:
        raise UsageError(option, str(exc)) from None


def continue_lora(plan: Plan, args) -> None:
    """--model DIR of a LoRA run with --lora R: DIR's adapters are trained further. They
    keep their rank and alpha (a different --lora or --lora-alpha is refused: that would
    be new adapters, which DIR's trained ones are not); --lora-dropout may change. The
    plan takes their alpha and dropout."""
    try:
        config = models.adapter_config(plan.model)
    except ValueError as exc:
        raise UsageError("--model", str(exc)) from None
    r, alpha = config.get("r"), config.get("lora_alpha", 8)  # (peft's default alpha)
    if plan.lora != r:
        raise UsageError(
            "--lora",
            f"{plan.model} holds LoRA adapters of rank {r}: pass --lora {r} to train them "
            "further, or leave --lora out to fine-tune every weight of the model they "
            "make (the adapters merged into their base)",
        )
    if args.lora_alpha is not None and args.lora_alpha != alpha:
        raise UsageError(
            "--lora-alpha",
            f"{plan.model}'s adapters were trained with alpha {alpha:g}: leave --lora-alpha "
            "out to train them further with it",
        )
    plan.lora_alpha = float(alpha)
    if args.lora_dropout is None:
        plan.lora_dropout = float(config.get("lora_dropout") or 0.0)


def _encode(tokenizer, text: str) -> torch.Tensor:
    from ... import data

    if tokenizer is None:
        return data.byte_encode(text)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def _data_error(plan: Plan, exc: Exception) -> UsageError:
    msg = exc.strerror + f": {plan.data}" if isinstance(exc, OSError) and exc.strerror else str(exc)
    field = plan.user_field is not None and f'"{plan.user_field}"' in msg
    return UsageError("--user-field" if field else "--data", msg)


def load_blocks(plan: Plan, tokenizer, block_size_given: bool):
    """(train blocks, validation blocks, bytes of text, tokens of text, units): ``units``
    is None for block-level privacy, else the unit of each training block."""
    from ... import data

    if plan.privacy_unit != "block":
        return _load_unit_blocks(plan, tokenizer)
    try:
        text = data.read_text(plan.data) if plan.data is not None else data.default_text()
    except (OSError, ValueError) as exc:
        raise _data_error(plan, exc) from None
    ids = _encode(tokenizer, text)
    blocks = data.make_blocks(ids, plan.block_size)
    try:
        train, val = data.split_blocks(blocks, plan.val_fraction)
    except ValueError as exc:
        if block_size_given and ids.numel() >= 4:  # a smaller block size would do
            raise UsageError(
                "--block-size",
                f"{plan.block_size} is too large for the data: "
                f"its {ids.numel():,} tokens make {blocks.shape[0]} block(s), at "
                "least 2 are needed (one to train on, one to validate)",
            ) from None
        raise UsageError(
            "--data", f"{exc} at --block-size {plan.block_size} ({ids.numel()} tokens)"
        ) from None
    return train, val, len(text.encode("utf-8")), ids.numel(), None


def _load_unit_blocks(plan: Plan, tokenizer):
    """Documents or users: each unit's text cut into blocks of its own; whole units held
    out for validation; the training units numbered 0 .. U-1 in order."""
    from ... import data

    try:
        docs = (
            data.read_documents(plan.data, user_field=plan.user_field)
            if plan.data is not None
            else data.default_documents()
        )
    except (OSError, ValueError) as exc:
        raise _data_error(plan, exc) from None
    texts, _ = data.group_units(docs)
    ids = [_encode(tokenizer, t) for t in texts]
    blocks, unit_of = data.make_unit_blocks(ids, plan.block_size)
    n_tokens = sum(x.numel() for x in ids)
    try:
        train_idx, val_idx = data.split_units(unit_of, plan.val_fraction)
    except ValueError as exc:
        raise UsageError(
            "--data",
            f"{str(exc).replace('unit(s)', unit_name(plan) + '(s)')} at --block-size "
            f"{plan.block_size} ({len(texts)} {unit_name(plan, len(texts))}, "
            f"{n_tokens} tokens; a {unit_name(plan, 1)} shorter than a block has none)",
        ) from None
    units = torch.unique(unit_of[train_idx], return_inverse=True)[1]
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return blocks[train_idx], blocks[val_idx], n_bytes, n_tokens, units


def _fixed_shape(plan: Plan, n_blocks: int, units, steps: int, delta: float) -> float:
    """--max-batch-size: check it against the data (a sampler validates it) and return
    the per-step overflow probability; refuse a B_max below the expected batch, or one
    whose truncation would cost more than a tenth of delta at the target epsilon (the
    message gives the smallest B_max that would do)."""
    from ...accounting import overflow_delta
    from ...sampling import PoissonBatchSampler

    def sampler(B_max):
        return PoissonBatchSampler(
            n_blocks,
            plan.sample_rate,
            1,
            seed=0,  # (a throw-away: only the shape is checked)
            units=units,
            max_batch_size=B_max,
            max_unit_size=plan.max_blocks_per_unit,
        )

    rows = n_blocks if units is None or plan.max_blocks_per_unit is None else None
    if rows is None:
        sizes = torch.bincount(units).clamp(max=plan.max_blocks_per_unit)
        rows = int(sizes.sum())
    expected = plan.sample_rate * rows
    require(
        plan.max_batch_size >= expected,
        "--max-batch-size",
        f"{plan.max_batch_size} is below the expected batch of {expected:.1f} blocks: most "
        "steps would be truncated",
    )
    try:
        eta = sampler(plan.max_batch_size).overflow_probability
    except ValueError as exc:
        option = "--max-blocks-per-unit" if "max_unit_size" in str(exc) else "--max-batch-size"
        raise UsageError(option, str(exc).replace("rows", "blocks")) from None

    def cost(B_max, eta=None):
        eta = sampler(B_max).overflow_probability if eta is None else eta
        return overflow_delta(steps * eta, plan.epsilon)

    if cost(plan.max_batch_size, eta) > 0.1 * delta:
        lo, hi = plan.max_batch_size, rows  # cost(hi) = 0: a batch never exceeds all rows
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if cost(mid) <= 0.1 * delta else (mid, hi)
        raise UsageError(
            "--max-batch-size",
            f"{plan.max_batch_size} blocks truncate too often: the truncation would add "
            f"{cost(plan.max_batch_size, eta):.3g} to delta (target {delta:.3g}; "
            f"P[a batch exceeds it] = {eta:.3g} per step, charged (1 + e^epsilon) times "
            f"over {steps} steps); use at least {hi} (the expected batch is "
            f"{expected:.1f} blocks)",
        )
    return eta


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


def check_device(device: torch.device) -> None:
    """Raise UsageError unless this torch can hold data on ``device`` (a CPU-only build
    asked for cuda, a GPU index past the last one, ``meta``), before anything is built."""
    require(device.type != "meta", "--device", "meta tensors hold no data; pick cpu or cuda")
    try:
        torch.zeros(1, device=device)
    except (RuntimeError, AssertionError) as exc:  # (a CPU-only torch asserts for cuda)
        why = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise UsageError("--device", f"{device} is not usable here: {why}") from None


def check_nproc(args, device: torch.device) -> None:
    nproc = getattr(args, "nproc", 1)
    if getattr(args, "fsdp", False):
        require(
            nproc > 1, "--fsdp", "shards over the --nproc processes: pass --nproc N with N >= 2"
        )
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            raise UsageError(
                "--fsdp", f"needs FSDP2 (torch >= 2.6), torch is {torch.__version__}"
            ) from None
    if nproc == 1:
        return
    import torch.distributed as dist

    require(dist.is_available(), "--nproc", "this torch build has no torch.distributed")
    if device.type == "cuda":
        require(
            device.index is None,
            "--device",
            f"{device} names one GPU; with --nproc rank r runs on cuda:r (pass --device cuda)",
        )
        require(
            nproc <= torch.cuda.device_count(),
            "--nproc",
            f"{nproc} processes but only {torch.cuda.device_count()} CUDA devices",
        )
    else:
        require(device.type == "cpu", "--nproc", f"supports cpu and cuda, not {device.type}")


def check_memory_options(args, plan: Plan) -> None:
    """--lora, --bf16, --stochastic-rounding and --gradient-checkpointing against the other
    options."""
    if plan.stochastic_rounding:
        require(
            plan.bf16,
            "--stochastic-rounding",
            "rounds bfloat16 weights: it needs --bf16 (float32 weights are not rounded)",
        )
        require(
            plan.lora is None,
            "--stochastic-rounding",
            "has nothing to round with --lora: the trained LoRA adapters stay float32 "
            "(only the frozen base is bfloat16)",
        )
    if plan.lora is not None:
        try:
            import peft  # noqa: F401
        except ImportError:
            raise UsageError(
                "--lora", "needs peft, which is not installed (pip install 'dpkern[llm]')"
            ) from None
        require(
            not getattr(args, "fsdp", False),
            "--fsdp",
            "is not supported with --lora yet (use --nproc N without --fsdp: the adapters "
            "are small enough to replicate)",
        )
    require(
        not getattr(args, "gradient_checkpointing", False) or args.grad_sample != "opacus",
        "--gradient-checkpointing",
        "cannot be used with --grad-sample opacus: its hooks would record the recomputed "
        "forward of each block a second time (use --grad-sample functorch)",
    )


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
    if saved is not None and (n_blocks, val.shape[0], n) != (
        saved.get("n_train"),
        saved.get("n_val"),
        saved.get("n_units") or saved.get("n_train"),
    ):
        raise UsageError(
            "--data",
            f"gives {n_blocks} training blocks, the checkpoint was trained on "
            f"{saved.get('n_train')}: not the same data",
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
        plan.batch_overflow_probability = _fixed_shape(plan, n_blocks, units, steps, delta)
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
