"""The options of ``dpkern finetune``: defaults, the argparse groups, and their checks
(one-line UsageError naming the option; nothing is written before they pass)."""

from __future__ import annotations

import argparse
import math

from ... import models, rules
from .checkpoint import FILES, UsageError


#: --optimizer choices: the command-line names of the rule registry (dpkern.rules).
OPTIMIZERS = tuple(spec.cli_name for spec in rules.RULES.values())


GRAD_SAMPLE_MODES = ("functorch", "opacus")


CLIPPING_MODES = ("ghost", "per-sample")


PRIVACY_UNITS = ("block", "document", "user")


#: Defaults of the run plan (kept in one place; the help text is built from it).
DEFAULTS = {
    "block_size": 64,
    "val_fraction": 0.1,
    "optimizer": "dp-adamw",
    "lr": None,  # None = the optimizer's own (default_lr: RuleSpec.finetune_lr)
    "weight_decay": None,  # None = the optimizer's own default
    "epsilon": 8.0,
    "delta": None,  # None = 1 / N**1.1
    "accountant": "rdp",
    "max_grad_norm": 1.0,
    "batch_size": 128,
    "steps": 150,
    "privacy_unit": "block",
    "arch": "gpt2",
    "bf16": False,
    "stochastic_rounding": False,
}


def default_lr(optimizer: str) -> float:
    """The default --lr of ``optimizer`` (a --optimizer name): its rule's
    ``finetune_lr`` (dpkern.rules). Raises UsageError for a rule without one."""
    lr = rules.by_cli_name(optimizer).finetune_lr
    if lr is None:
        raise UsageError("--lr", f"{optimizer} has no default learning rate: pass --lr")
    return float(lr)


def _lr_help() -> str:
    known = [s for s in rules.RULES.values() if s.finetune_lr is not None]
    return (
        "learning rate (default: the optimizer's own, "
        + ", ".join(f"{s.cli_name} {s.finetune_lr:g}" for s in known)
        + ")"
    )


DEFAULT_MICRO_BATCH = 64


#: Seconds between two epsilon computations for the progress bar (the accountant's epsilon
#: can be slow); the bar's last step (the end, or a stop) is always recomputed: exact.
EPS_REFRESH_S = 5.0


#: Options that define the run plan: taken from the checkpoint on --resume.
PLAN_OPTIONS = (
    "model",
    "block_size",
    "val_fraction",
    "optimizer",
    "lr",
    "weight_decay",
    "delta",
    "accountant",
    "max_grad_norm",
    "batch_size",
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
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the options of ``dpkern finetune`` on ``parser``."""
    d = DEFAULTS
    g = parser.add_argument_group("model and data")
    g.add_argument(
        "--model",
        metavar="DIR",
        help="local Hugging Face causal LM directory "
        "(loaded offline; its tokenizer if present, else byte-level ids), or the output "
        "of a --lora run (a peft adapter directory): its base with the adapters merged "
        "in, every weight trained; with --lora R (the adapters' rank) the adapters are "
        "trained further instead. Default: "
        "a byte-level GPT-2 built in code (2 layers, width 128, 4 heads)",
    )
    g.add_argument(
        "--arch",
        choices=models.ARCHS,
        help="the built-in model (not with --model): gpt2 (GPT2LMHeadModel: learned "
        "positions, LayerNorm, GELU, tied head) or llama (LlamaForCausalLM: rotary "
        "positions, RMSNorm, SwiGLU, 4 heads / 2 key-value heads, untied head); both "
        f"byte-level with about 0.44 M parameters (default {d['arch']})",
    )
    g.add_argument(
        "--data",
        metavar="PATH",
        help="a UTF-8 .txt file, or .jsonl with a "
        '"text" field per line. Default: CPython\'s pydoc_data help pages',
    )
    g.add_argument(
        "--block-size",
        type=int,
        metavar="T",
        help="tokens per training example (the privacy unit with --privacy-unit block) "
        f"(default {d['block_size']})",
    )
    g.add_argument(
        "--val-fraction",
        type=float,
        metavar="F",
        help="blocks (whole documents or users with --privacy-unit document/user) held "
        f"out for validation (default {d['val_fraction']})",
    )
    g.add_argument(
        "--privacy-unit",
        choices=PRIVACY_UNITS,
        help="what the guarantee protects: one block of --block-size tokens, one "
        "document (a .jsonl line, a default-corpus topic: all of its blocks), or one user "
        "(all lines with the same --user-field value). Units are Poisson-sampled and a "
        "unit's blocks are clipped together (per-sample clipping) "
        f"(default {d['privacy_unit']})",
    )
    g.add_argument(
        "--user-field",
        metavar="NAME",
        help="with --privacy-unit user: the .jsonl field that names each line's user "
        "(a string or an integer on every line)",
    )
    g = parser.add_argument_group("adapters and memory")
    g.add_argument(
        "--lora",
        type=int,
        metavar="R",
        help="train LoRA adapters of rank R (peft) instead of every weight: only they are "
        "clipped, noised and saved (the adapter files; the built-in base goes to "
        "base_model/). Targets: every linear layer for gpt2 and llama, peft's defaults "
        "for the other model types it knows",
    )
    g.add_argument(
        "--lora-alpha",
        type=float,
        metavar="A",
        help="LoRA scaling alpha (the update is alpha/R B A) (default 2R)",
    )
    g.add_argument(
        "--lora-dropout",
        type=float,
        metavar="P",
        help="dropout on the LoRA inputs (default 0)",
    )
    g.add_argument(
        "--bf16",
        action="store_true",
        default=None,
        help="keep the model's weights in bfloat16 (LoRA adapters stay float32); "
        "per-sample norms, clipped sums, noise and optimizer states are float32",
    )
    g.add_argument(
        "--stochastic-rounding",
        action="store_true",
        default=None,
        help="with --bf16: round each bfloat16 weight update stochastically (unbiased) "
        "instead of to nearest, so updates below a bf16 ulp are not lost (SPEC 3.2; "
        "the randomness is Philox stream 2 of the noise key)",
    )
    g.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each block's activations in the backward (use_reentrant=False): "
        "less memory, more time; ghost clipping stays exact (checked on the first step)",
    )
    g = parser.add_argument_group("privacy")
    g.add_argument(
        "--epsilon",
        type=float,
        help=f"target epsilon at the end of training (default {d['epsilon']:g})",
    )
    g.add_argument(
        "--delta",
        type=float,
        help="target delta (default 1/N^1.1, N = number of training units: blocks, "
        "documents or users)",
    )
    g.add_argument(
        "--accountant",
        choices=("rdp", "pld"),
        help=f"privacy accountant of dp-accounting (default {d['accountant']})",
    )
    g.add_argument(
        "--max-grad-norm",
        type=float,
        metavar="C",
        help=f"per-sample clipping bound (default {d['max_grad_norm']:g}; unused by dp-macadam)",
    )
    g.add_argument(
        "--batch-size",
        type=int,
        metavar="B",
        help="expected logical batch under Poisson sampling, in privacy units (blocks, "
        f"documents or users) (default {d['batch_size']})",
    )
    g.add_argument(
        "--max-batch-size",
        type=int,
        metavar="B_MAX",
        help="fixed-shape batches: truncate each Poisson batch to B_MAX blocks and pad it "
        "to B_MAX (padding is masked out of losses, norms and counts); the accountant "
        "adds the truncation's cost to delta and reports it. Default: variable batches",
    )
    g.add_argument(
        "--max-blocks-per-unit",
        type=int,
        metavar="K",
        help="with --privacy-unit document/user: use at most the first K blocks of each "
        "unit (required with --max-batch-size: the truncation term assumes it)",
    )
    g.add_argument(
        "--micro-batch-size",
        type=int,
        metavar="M",
        help="physical batch; a logical batch is accumulated over micro-batches (default 64)",
    )
    x = g.add_mutually_exclusive_group()
    x.add_argument("--steps", type=int, help=f"optimizer steps (default {d['steps']})")
    x.add_argument(
        "--epochs",
        type=float,
        help="passes over the training blocks (steps = ceil(epochs * N / batch size))",
    )
    g = parser.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=OPTIMIZERS, help=f"(default {d['optimizer']})")
    g.add_argument("--lr", type=float, help=_lr_help())
    g.add_argument(
        "--weight-decay",
        type=float,
        metavar="WD",
        help="weight decay (default: the optimizer's own, 0.01 for the AdamW family, else 0)",
    )
    g.add_argument(
        "--backend",
        choices=("auto", "torch", "triton", "cpp"),
        default="auto",
        help="dpkern kernel backend (default auto)",
    )
    g.add_argument(
        "--grad-sample",
        choices=GRAD_SAMPLE_MODES,
        default="functorch",
        help="per-sample gradients: dpkern.grad_sample (torch.func) or Opacus' "
        "GradSampleModule (default functorch)",
    )
    g.add_argument(
        "--clipping",
        choices=CLIPPING_MODES,
        help="how per-sample gradients are clipped: ghost (dpkern.ghost: norms from "
        "activations and output gradients; per-sample gradients only for layers where "
        "they are cheaper, such as small ones and LoRA adapters, within a memory budget) "
        "or per-sample (materialised for every layer, see --grad-sample). Default: ghost "
        "when it covers every "
        "trainable layer, else per-sample; dp-macadam always uses per-sample",
    )
    g.add_argument(
        "--seed",
        type=int,
        help="seeds the model init, the Poisson sampling and "
        "dropout, not the noise (its key stays secret). The accounting assumes "
        "secret sampling: keep the seed (run_config.json records it) as private "
        "as the data",
    )
    g.add_argument(
        "--noise-seed",
        type=int,
        metavar="INT",
        help="the optimizer's noise key "
        "(reproducible noise for research). The run is then NOT private: whoever "
        "knows the key can remove the noise. Default: a secret key from os.urandom",
    )
    g.add_argument("--device", help="torch device (default cuda if available, else cpu)")
    g.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="data-parallel worker "
        "processes (gloo on CPU, NCCL on CUDA: one GPU each); the global expected "
        "batch is still --batch-size (default 1: a single process)",
    )
    g.add_argument(
        "--fsdp",
        action="store_true",
        help="with --nproc N: shard parameters, "
        "gradients and optimizer state over the processes (FSDP2, one unit per "
        "transformer block) instead of replicating them (DDP); ghost clipping only",
    )
    g = parser.add_argument_group("output")
    g.add_argument(
        "--out",
        metavar="DIR",
        help="write the model (save_pretrained), "
        f"{FILES['run']}, {FILES['metrics']} and {FILES['trainer']} here",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out if it "
        "is a dpkern run directory (never the current directory or a parent of it, "
        "nor one holding --data or --model); files dpkern did not write are kept",
    )
    g.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the run saved in DIR (written back to DIR unless --out is given)",
    )
    g.add_argument(
        "--save-every", type=int, metavar="K", help="also checkpoint to --out every K steps"
    )
    g.add_argument(
        "--eval-batch-size",
        type=int,
        default=64,
        metavar="N",
        help="blocks per validation forward pass (default 64)",
    )
    g.add_argument(
        "--epsilon-curve",
        action="store_true",
        help=f"also write epsilon at delta = 1e-2 ... 1e-12 (and the target) to {FILES['metrics']}",
    )
    g.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar (it shows the training loss and the epsilon spent, the "
        f"latter recomputed at most every {EPS_REFRESH_S:g} s, exact at the last step)",
    )


def require(cond: bool, option: str, message: str) -> None:
    if not cond:
        raise UsageError(option, message)


def check_numbers(args) -> None:
    def finite(v):
        return v is None or math.isfinite(v)

    for opt in (
        "epsilon",
        "delta",
        "lr",
        "weight_decay",
        "max_grad_norm",
        "val_fraction",
        "epochs",
        "lora_alpha",
        "lora_dropout",
    ):
        require(
            finite(getattr(args, opt)),
            "--" + opt.replace("_", "-"),
            f"{getattr(args, opt)} is not a finite number",
        )
    require(
        args.epsilon is None or args.epsilon > 0, "--epsilon", f"must be > 0, got {args.epsilon}"
    )
    require(
        args.delta is None or 0 < args.delta < 1, "--delta", f"must be in (0, 1), got {args.delta}"
    )
    require(args.lr is None or args.lr >= 0, "--lr", f"must be >= 0, got {args.lr}")
    require(
        args.weight_decay is None or args.weight_decay >= 0,
        "--weight-decay",
        f"must be >= 0, got {args.weight_decay}",
    )
    require(
        args.max_grad_norm is None or args.max_grad_norm > 0,
        "--max-grad-norm",
        f"must be > 0, got {args.max_grad_norm}",
    )
    require(
        args.val_fraction is None or 0 < args.val_fraction < 1,
        "--val-fraction",
        f"must be in (0, 1), got {args.val_fraction}",
    )
    for opt, low in (
        ("batch_size", 1),
        ("micro_batch_size", 1),
        ("steps", 1),
        ("block_size", 2),
        ("save_every", 1),
        ("eval_batch_size", 1),
        ("nproc", 1),
        ("max_batch_size", 1),
        ("max_blocks_per_unit", 1),
        ("lora", 1),
    ):
        v = getattr(args, opt, None)
        require(v is None or v >= low, "--" + opt.replace("_", "-"), f"must be >= {low}, got {v}")
    require(args.epochs is None or args.epochs > 0, "--epochs", f"must be > 0, got {args.epochs}")
    require(
        args.lora_alpha is None or args.lora_alpha > 0,
        "--lora-alpha",
        f"must be > 0, got {args.lora_alpha}",
    )
    require(
        args.lora_dropout is None or 0 <= args.lora_dropout < 1,
        "--lora-dropout",
        f"must be in [0, 1), got {args.lora_dropout}",
    )
    for opt in ("seed", "noise_seed"):
        v = getattr(args, opt, None)
        require(
            v is None or 0 <= v < 2**63,
            "--" + opt.replace("_", "-"),
            f"must be in [0, 2**63), got {v}",
        )
