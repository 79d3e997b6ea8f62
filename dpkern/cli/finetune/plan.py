"""The run plan of ``dpkern finetune``: everything that defines a run, saved as
run_config.json, restored on --resume; the noise calibration of a resumed run; the checks
of the expected batch and of delta against the data."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import UsageError
from .options import DEFAULTS, PLAN_OPTIONS, default_lr


#: What every output of a run with --noise-seed says in place of an epsilon claim.
from ...keys import NOT_PRIVATE


@dataclass
class Plan:
    """Everything that defines a run (saved as run_config.json)."""

    model: str | None
    data: str | None
    block_size: int
    val_fraction: float
    optimizer: str
    lr: float
    weight_decay: float | None
    epsilon: float
    delta: float | None
    accountant: str
    max_grad_norm: float
    batch_size: int
    steps: int | None
    epochs: float | None
    seed: int | None
    noise_seed: int | None = None
    tokenizer: str = "bytes"
    n_train: int = 0
    n_val: int = 0
    sample_rate: float = 0.0
    noise_multiplier: float = 0.0
    privacy_unit: str = "block"
    user_field: str | None = None
    max_batch_size: int | None = None
    max_blocks_per_unit: int | None = None
    n_units: int = 0
    batch_overflow_probability: float = 0.0
    arch: str | None = "gpt2"  # the built-in model's; None with --model
    lora: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float | None = None
    bf16: bool = False
    stochastic_rounding: bool = False


#: How each privacy unit is named in messages and the summary (singular, plural).
UNIT_NAMES = {
    "block": ("block", "blocks"),
    "document": ("document", "documents"),
    "user": ("user", "users"),
}


def unit_name(plan: Plan, n: int | None = None) -> str:
    """The privacy unit's name, plural unless ``n`` is 1."""
    one, many = UNIT_NAMES[plan.privacy_unit]
    return one if n == 1 else many


def plan_from_args(args, saved: dict | None) -> Plan:
    values = {}
    for name in (
        "model",
        "data",
        "block_size",
        "val_fraction",
        "optimizer",
        "lr",
        "weight_decay",
        "epsilon",
        "delta",
        "accountant",
        "max_grad_norm",
        "batch_size",
        "steps",
        "epochs",
        "seed",
        "noise_seed",
        "privacy_unit",
        "user_field",
        "max_batch_size",
        "max_blocks_per_unit",
        "arch",
        "lora",
        "lora_alpha",
        "lora_dropout",
        "bf16",
        "stochastic_rounding",
    ):
        given = getattr(args, name, None)
        if saved is not None and name in PLAN_OPTIONS:
            if given is not None and given != saved.get(name) and name != "model":
                has = (
                    "a secret noise key"
                    if name == "noise_seed" and saved.get(name) is None
                    else repr(saved.get(name))
                )
                raise UsageError(
                    "--" + name.replace("_", "-"),
                    f"cannot be changed on --resume (the checkpoint has {has})",
                )
            values[name] = saved.get(name)
        elif given is not None:
            values[name] = given
        elif saved is not None and name in ("data", "epsilon", "steps"):
            values[name] = saved.get(name)
        else:
            values[name] = DEFAULTS.get(name)
    if args.model is not None and saved is not None:
        raise UsageError("--model", "cannot be given with --resume (the model is the checkpoint's)")
    if saved is None:
        if args.model is not None:
            if getattr(args, "arch", None) is not None:
                raise UsageError(
                    "--arch", "chooses the built-in model; --model DIR has its own architecture"
                )
            values["arch"] = None
        if values["lora"] is None:
            for name in ("lora_alpha", "lora_dropout"):
                if values[name] is not None:
                    raise UsageError("--" + name.replace("_", "-"), "only with --lora R")
        else:
            if values["lora_alpha"] is None:
                values["lora_alpha"] = 2.0 * values["lora"]
            if values["lora_dropout"] is None:
                values["lora_dropout"] = 0.0
    if values["lr"] is None and saved is None:  # (a resumed run keeps its recorded lr)
        values["lr"] = default_lr(values["optimizer"])
    if values["epochs"] is not None:
        values["steps"] = None
    for name in ("model", "data"):  # absolute, so that --resume works from anywhere
        if getattr(args, name) is not None:
            values[name] = str(Path(getattr(args, name)).absolute())
    if saved is not None:
        values["tokenizer"] = saved.get("tokenizer", "bytes")
        if args.epochs is None and args.steps is None:  # continue the saved plan
            values["steps"], values["epochs"] = saved.get("steps"), None
    return Plan(**values)


def run_record(plan: Plan) -> dict:
    """run_config.json's plan. With --noise-seed the target epsilon is only what sigma was
    calibrated to, and the record says the run is not private. With documents or users
    as units the block counts are left out (None): they move with one unit's size."""
    record = dataclasses.asdict(plan)
    if plan.privacy_unit != "block":  # block counts move with one unit's size: not saved
        record["n_train"] = record["n_val"] = None
    if plan.noise_seed is not None:
        record["privacy"] = NOT_PRIVATE
        record["epsilon_for_noise_calibration"] = record.pop("epsilon")
    return record


def saved_plan(saved: dict, trainer_state: dict) -> dict:
    """The inverse of :func:`run_record` (a resumed run_config.json). A checkpoint of a
    dpkern before --noise-seed existed used --seed as the noise key (its optimizer state
    holds it): that key is known, so the run continues as a --noise-seed run."""
    saved = dict(saved)
    if "epsilon_for_noise_calibration" in saved:
        saved["epsilon"] = saved.pop("epsilon_for_noise_calibration")
    if "noise_seed" not in saved:
        dp = (trainer_state.get("optimizer") or {}).get("dp") or {}
        saved["noise_seed"] = dp.get("seed")
    saved.setdefault("privacy_unit", "block")  # (checkpoints before privacy units)
    for name in ("user_field", "max_batch_size", "max_blocks_per_unit"):
        saved.setdefault(name, None)
    # (checkpoints before --arch, --lora and --bf16: the built-in model was GPT-2)
    saved.setdefault("arch", "gpt2" if saved.get("model") is None else None)
    for name in ("lora", "lora_alpha", "lora_dropout"):
        saved.setdefault(name, None)
    saved.setdefault("bf16", False)
    saved.setdefault("stochastic_rounding", False)  # (checkpoints before it)
    return saved


def check_units(plan: Plan) -> None:
    """The privacy-unit options fit together (UsageError naming the option)."""
    unit = plan.privacy_unit
    if unit == "user" and plan.user_field is None:
        raise UsageError(
            "--user-field",
            "--privacy-unit user needs --user-field NAME (the .jsonl field naming each "
            "line's user)",
        )
    if unit != "user" and plan.user_field is not None:
        raise UsageError("--user-field", f"only with --privacy-unit user, not {unit}")
    if unit != "block" and plan.data is not None and Path(plan.data).suffix.lower() != ".jsonl":
        raise UsageError(
            "--privacy-unit",
            f"{unit} needs a .jsonl --data file (one document per line"
            + (", with a user field" if unit == "user" else "")
            + f"): a {Path(plan.data).suffix or 'plain'} file is a single document",
        )
    if unit == "block" and plan.max_blocks_per_unit is not None:
        raise UsageError(
            "--max-blocks-per-unit", "only with --privacy-unit document or user (a block is one)"
        )
    if unit != "block" and plan.max_batch_size is not None and plan.max_blocks_per_unit is None:
        raise UsageError(
            "--max-blocks-per-unit",
            f"--max-batch-size with --privacy-unit {unit} needs --max-blocks-per-unit K: "
            "the truncation term of the accounting assumes that a neighbouring "
            f"{unit} brings at most K blocks",
        )


def calibrate_extension(history, sample_rate, steps, epsilon, delta, accountant, guess):
    """:func:`dpkern.accounting.calibrate_extension`, its refusal as a --epsilon error."""
    from ...accounting import calibrate_extension as calibrate

    try:
        return calibrate(history, sample_rate, steps, epsilon, delta, accountant, guess=guess)
    except ValueError as exc:
        raise UsageError("--epsilon", str(exc)) from None


def check_batch_fits(plan: Plan, n: int, n_tokens: int, block_size_given: bool) -> None:
    """The expected batch must not exceed the training units. Blamed on --block-size when
    the user chose it and a smaller one would give enough blocks, else on --batch-size."""
    if plan.batch_size <= n:
        return
    if plan.privacy_unit != "block":
        raise UsageError(
            "--batch-size",
            f"{plan.batch_size} is larger than the data set ({n} training "
            f"{unit_name(plan, n)} with a block of {plan.block_size} tokens)",
        )
    blocks_at_2 = n_tokens // 2
    train_at_2 = blocks_at_2 - min(blocks_at_2 - 1, max(1, round(blocks_at_2 * plan.val_fraction)))
    if block_size_given and plan.batch_size <= train_at_2:
        raise UsageError(
            "--block-size",
            f"{plan.block_size} is too large for the data: its "
            f"{n_tokens:,} tokens make {n} training blocks, fewer than the "
            f"expected batch of {plan.batch_size} (--batch-size)",
        )
    raise UsageError(
        "--batch-size",
        f"{plan.batch_size} is larger than the data set ({n} "
        f"training blocks of {plan.block_size} tokens)",
    )


#: Above this delta a guarantee is weak whatever N (the default 1/N^1.1 reaches it for
#: N below about 530 units: a few documents or users).
LARGE_DELTA = 1e-3


def warn_delta(delta: float | None, n: int, units: str = "training blocks") -> None:
    """--delta should be well below 1/N: a mechanism that publishes one random example in
    full is (0, 1/N)-DP. And the default 1/N^1.1 is large for few units (documents,
    users): above :data:`LARGE_DELTA` it is said too. Warnings, not errors (one line on
    stderr each)."""
    if delta is None and n > 0 and 1.0 / n**1.1 > LARGE_DELTA:
        print(
            f"dpkern finetune: warning: the default delta 1/N^1.1 = {1.0 / n**1.1:.3g} "
            f"(N = {n:,} {units}) is large: a guarantee with delta above {LARGE_DELTA:g} "
            "is weak; pass a smaller --delta (sigma grows) or train on more units",
            file=sys.stderr,
        )
    if delta is not None and delta >= 1.0 / n:
        print(
            f"dpkern finetune: warning: --delta {delta:g} is not well below 1/N = "
            f"{1.0 / n:.3g} (N = {n:,} {units}): such a delta allows leaking "
            "whole examples; the default is 1/N^1.1",
            file=sys.stderr,
        )
