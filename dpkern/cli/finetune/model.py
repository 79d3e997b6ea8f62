"""The model a ``dpkern finetune`` run trains: the built-in one (--arch), a --model DIR
(a LoRA run's directory included), or the resumed checkpoint's; then --bf16,
--gradient-checkpointing and --lora (:func:`load_model`, called by
:func:`.job.prepare`)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ... import models
from .checkpoint import BASE_DIR, UsageError, is_run_dir
from .plan import Plan

#: Said when --model DIR is an earlier run's output: this run's ledger starts at zero.
EARLIER_RUN_NOTE = (
    "dpkern finetune: note: --model DIR is the output of an earlier {what}; "
    "this run accounts its own epsilon from zero: if the two runs' data overlap, the "
    "final model's privacy is the composition of both (the epsilons add up at most); "
    "--resume DIR continues that run's ledger instead"
)


#: Said instead when that earlier run was not private (--noise-seed, a seeded DPTrainer).
EARLIER_SEEDED_NOTE = (
    "dpkern finetune: note: --model DIR is the output of an earlier {what} that was not "
    "private (a known noise seed): the model it trained has no privacy guarantee for that "
    "run's data, whatever this run spends; this run's epsilon covers only its own data"
)


def earlier_run_note(path: Path) -> str | None:
    """The note for --model ``path`` when it is an earlier private run's output (a dpkern
    finetune run directory, or a directory DPTrainer's ``save_model`` wrote), or None."""
    from ...integrations.transformers.records import PRIVACY_FILE, earlier_record_private
    from .checkpoint import _read_run_config

    if is_run_dir(path):
        what = "dpkern finetune run"
        private = (_read_run_config(path) or {}).get("noise_seed") is None
    else:
        what = f"DPTrainer run (its {PRIVACY_FILE})"
        private = earlier_record_private(str(path))
        if private is None:
            return None
    return (EARLIER_RUN_NOTE if private else EARLIER_SEEDED_NOTE).format(what=what)


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
    if not args.resume and plan.model is not None:
        note = earlier_run_note(Path(plan.model))
        if note is not None:
            print(note, file=sys.stderr)
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
