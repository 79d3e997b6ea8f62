"""Private fine-tuning of a causal language model (the main job).

Trains a causal LM on text with a DP optimizer of dpkern: Poisson-sampled batches of
fixed-length blocks, per-sample gradients (torch.func, or Opacus' GradSampleModule),
clipping + Gaussian noise + update in one fused step, and an accountant (dp-accounting)
that reports the epsilon spent. The noise multiplier sigma is calibrated so that the
target epsilon is reached exactly at the end of training.

Defaults: a small byte-level GPT-2 (2 layers, width 128, block 64, ~0.44 M parameters)
built in code, trained on CPython's pydoc_data help pages (~465 kB of English prose,
offline), 150 steps of DP-AdamW (lr 5e-3) at an expected batch of 128 blocks
(micro-batches of 64), epsilon = 8, delta = 1/N^1.1 (N = training blocks), C = 1.
About 45 s on 2 idle CPU cores; validation perplexity goes from about 240 to about 14.

Privacy unit: one block of --block-size tokens (adding or removing one block of the
training text). Losses shown on the progress bar and saved in metrics.json are computed
on the private data without noise: they are for the operator, not for publication. No
exact data-dependent count (samples drawn, clipped or non-finite) is written or shown:
throughput is that of the expected batch.

Seeds: --seed fixes the model init, the Poisson sampling and dropout; the noise key stays
secret (os.urandom, never saved) unless --noise-seed is given, which makes the noise
reproducible and the run NOT private (whoever knows the key can subtract the noise): its
outputs say "not private: the noise key is known" instead of claiming an epsilon.

Output: --out DIR is written file by file (each file complete before it replaces the
old one); files dpkern did not write are kept. --overwrite replaces only a dpkern run
directory, never the current directory or one that holds --data or --model. SIGINT and
SIGTERM (a preemption) stop at the next step boundary: checkpoint, one line, exit code
130 / 143 (with --nproc too); --resume DIR continues.

examples:
  dpkern finetune                                    # the default run described above
  dpkern finetune --data notes.jsonl --epsilon 3 --out run1
  dpkern finetune --model ./my-gpt2 --data notes.txt --steps 500 --out run2
  dpkern finetune --resume run2 --steps 800 --epsilon 4   # continue (sigma recalibrated)
  dpkern finetune --nproc 4 --out run3               # data-parallel, 4 processes
  dpkern finetune --nproc 4 --fsdp --out run4        # the same, parameters sharded (FSDP2)

Data parallelism (--nproc N > 1): N worker processes (torch.multiprocessing, file://
rendezvous in a temp dir; gloo on CPU, NCCL on CUDA with rank r on cuda:r) build the same
model and data; rank 0's parameters are broadcast. Each rank Poisson-samples its shard of
the training blocks with the global rate q (dpkern.distributed.DistributedPoissonSampler),
and dpkern.distributed.DistributedDPOptimizer all-reduces the clipped sums once per step
and adds the same noise on every rank (secure key drawn on rank 0 and broadcast), so the
mechanism, sigma and the accounting are those of the single-process run. Only rank 0
shows progress and writes --out. The sampled batches differ from a single-process run
with the same --seed (a different sampler), so the two runs are not equal.

--fsdp (with --nproc N): parameters, gradients and optimizer state are sharded over the N
processes (FSDP2 fully_shard, one unit per transformer block plus the root) instead of
replicated: each rank keeps 1/N of the model and of the optimizer state between steps
and draws the noise of its shard at the shard's global indices, so the step is the DDP
step. Clipping is ghost clipping (the book-kept clipped sums are reduce-scattered);
every rank runs the same number of micro-batches (a rank without samples runs a
placeholder whose loss is dropped). Checkpoints gather the full model and optimizer
state, so --resume works with or without --fsdp.

Modules: this one (options, validation, the plan, the job), training.py (the loop,
metrics, summary), parallel.py (--nproc workers), rundir.py (run directories and
checkpoint files), stop.py (SIGINT / SIGTERM).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import models
from .rundir import FILES, UsageError, check_out, load_checkpoint
from .stop import StopSignals

OPTIMIZERS = ("dp-sgd", "dp-adam", "dp-adambc", "dp-adamw", "dp-adamw-bc", "dp-macadam")
GRAD_SAMPLE_MODES = ("functorch", "opacus")
CLIPPING_MODES = ("ghost", "per-sample")

#: Defaults of the run plan (kept in one place; the help text is built from it).
DEFAULTS = {
    "block_size": 64,
    "val_fraction": 0.1,
    "optimizer": "dp-adamw",
    "lr": 5e-3,
    "weight_decay": None,  # None = the optimizer's own default
    "epsilon": 8.0,
    "delta": None,  # None = 1 / N**1.1
    "accountant": "rdp",
    "max_grad_norm": 1.0,
    "batch_size": 128,
    "steps": 150,
}
DEFAULT_MICRO_BATCH = 64
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
)
#: What every output of a run with --noise-seed says in place of an epsilon claim.
NOT_PRIVATE = "not private: the noise key is known"
__all__ = ["FILES", "NOT_PRIVATE", "UsageError", "add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the options of ``dpkern finetune`` on ``parser``."""
    d = DEFAULTS
    g = parser.add_argument_group("model and data")
    g.add_argument(
        "--model",
        metavar="DIR",
        help="local Hugging Face causal LM directory "
        "(loaded offline; its tokenizer if present, else byte-level ids). Default: "
        "a byte-level GPT-2 built in code (2 layers, width 128, 4 heads)",
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
        help=f"tokens per training example (the privacy unit) (default {d['block_size']})",
    )
    g.add_argument(
        "--val-fraction",
        type=float,
        metavar="F",
        help=f"blocks held out for validation (default {d['val_fraction']})",
    )
    g = parser.add_argument_group("privacy")
    g.add_argument(
        "--epsilon",
        type=float,
        help=f"target epsilon at the end of training (default {d['epsilon']:g})",
    )
    g.add_argument(
        "--delta", type=float, help="target delta (default 1/N^1.1, N = number of training blocks)"
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
        help=f"expected logical batch under Poisson sampling (default {d['batch_size']})",
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
    g.add_argument("--lr", type=float, help=f"learning rate (default {d['lr']:g})")
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
        help="how per-sample gradients are "
        "clipped: ghost (dpkern.ghost: norms from activations and output "
        "gradients, no per-sample gradients in memory) or per-sample "
        "(materialised, see --grad-sample). Default: ghost when it covers every "
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
    g.add_argument("--quiet", action="store_true", help="no progress bar")


# -- validation -------------------------------------------------------------------------


def _require(cond: bool, option: str, message: str) -> None:
    if not cond:
        raise UsageError(option, message)


def _check_numbers(args) -> None:
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
    ):
        _require(
            finite(getattr(args, opt)),
            "--" + opt.replace("_", "-"),
            f"{getattr(args, opt)} is not a finite number",
        )
    _require(
        args.epsilon is None or args.epsilon > 0, "--epsilon", f"must be > 0, got {args.epsilon}"
    )
    _require(
        args.delta is None or 0 < args.delta < 1, "--delta", f"must be in (0, 1), got {args.delta}"
    )
    _require(args.lr is None or args.lr >= 0, "--lr", f"must be >= 0, got {args.lr}")
    _require(
        args.weight_decay is None or args.weight_decay >= 0,
        "--weight-decay",
        f"must be >= 0, got {args.weight_decay}",
    )
    _require(
        args.max_grad_norm is None or args.max_grad_norm > 0,
        "--max-grad-norm",
        f"must be > 0, got {args.max_grad_norm}",
    )
    _require(
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
    ):
        v = getattr(args, opt)
        _require(v is None or v >= low, "--" + opt.replace("_", "-"), f"must be >= {low}, got {v}")
    _require(args.epochs is None or args.epochs > 0, "--epochs", f"must be > 0, got {args.epochs}")
    for opt in ("seed", "noise_seed"):
        v = getattr(args, opt, None)
        _require(
            v is None or 0 <= v < 2**63,
            "--" + opt.replace("_", "-"),
            f"must be in [0, 2**63), got {v}",
        )


# -- the run plan -------------------------------------------------------------------------


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


def _plan_from_args(args, saved: dict | None) -> Plan:
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


# -- model, data, per-sample gradients ----------------------------------------------------


def _load_model(plan: Plan, args):
    if args.resume:
        source, option = args.resume, "--resume"
    elif plan.model is not None:
        source, option = plan.model, "--model"
    else:
        return models.default_model(plan.block_size, seed=plan.seed), None
    try:
        model, tokenizer = models.load_model(
            source, "eager" if args.grad_sample == "functorch" else None
        )
    except ValueError as exc:
        raise UsageError(option, str(exc)) from None
    ctx = models.context_length(model)
    if ctx is not None and plan.block_size > ctx:
        raise UsageError(
            "--block-size", f"{plan.block_size} exceeds the model's context length {ctx}"
        )
    return model, tokenizer


def _load_blocks(plan: Plan, tokenizer, block_size_given: bool):
    """(train blocks, validation blocks, bytes of text, tokens of text)."""
    from .. import data

    try:
        text = data.read_text(plan.data) if plan.data is not None else data.default_text()
    except (OSError, ValueError) as exc:
        msg = (
            exc.strerror + f": {plan.data}"
            if isinstance(exc, OSError) and exc.strerror
            else str(exc)
        )
        raise UsageError("--data", msg) from None
    if tokenizer is None:
        ids = data.byte_encode(text)
    else:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
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
    return train, val, len(text.encode("utf-8")), ids.numel()


def _check_batch_fits(plan: Plan, n: int, n_tokens: int, block_size_given: bool) -> None:
    """The expected batch must not exceed the training blocks. Blamed on --block-size when
    the user chose it and a smaller one would give enough blocks, else on --batch-size."""
    if plan.batch_size <= n:
        return
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


def _warn_delta(delta: float | None, n: int) -> None:
    """--delta should be well below 1/N: a mechanism that publishes one random example in
    full is (0, 1/N)-DP. A warning, not an error (one line on stderr)."""
    if delta is not None and delta >= 1.0 / n:
        print(
            f"dpkern finetune: warning: --delta {delta:g} is not well below 1/N = "
            f"{1.0 / n:.3g} (N = {n:,} training blocks): such a delta allows leaking "
            "whole examples; the default is 1/N^1.1",
            file=sys.stderr,
        )


class _PerSample:
    """Sets ``p.grad_sample`` for a micro-batch and returns its per-sample losses."""

    def __init__(self, net, mode: str):
        self.mode = mode
        self.net = net
        if mode == "opacus":
            from opacus import GradSampleModule

            self.gsm = GradSampleModule(net, batch_first=True, loss_reduction="sum")

    def __call__(self, ids):
        from ..grad_sample import compute_grad_sample

        if self.mode == "functorch" or ids.shape[0] == 0:
            return compute_grad_sample(self.net, models.sample_loss, ids, ids)
        with warnings.catch_warnings():  # integer inputs: torch notes the hook sees no input grads
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            losses = models.token_loss(self.gsm(ids), ids)
            losses.sum().backward()
        for p in self.net.parameters():
            p.grad = None
        return losses.detach()


_FSDP_NEEDS_GHOST = (
    "needs ghost clipping (dp-macadam and --clipping per-sample materialise "
    "per-sample gradients, which the finetune job does not shard)"
)


def _choose_clipping(args, plan: Plan, net, params) -> str:
    """--clipping: ghost by default where dpkern.ghost covers every trainable layer;
    dp-macadam (whitened clipping) and --grad-sample opacus need per-sample gradients."""
    from ..ghost import supports

    _require(
        not getattr(args, "fsdp", False)
        or (plan.optimizer != "dp-macadam" and args.clipping != "per-sample"),
        "--fsdp",
        _FSDP_NEEDS_GHOST,
    )
    if plan.optimizer == "dp-macadam":
        _require(
            args.clipping != "ghost",
            "--clipping",
            "ghost clipping cannot serve "
            "dp-macadam (it clips whitened per-sample gradients); use per-sample",
        )
        if args.clipping is None:
            print(
                "dpkern finetune: note: dp-macadam clips whitened per-sample gradients: "
                "using --clipping per-sample",
                file=sys.stderr,
            )
        return "per-sample"
    ok, uncovered = supports(net, params)
    why = "ghost clipping does not cover " + ", ".join(uncovered) if not ok else None
    if (
        why is None
        and args.clipping != "per-sample"
        and args.grad_sample != "opacus"
        and not getattr(args, "fsdp", False)
    ):
        why = _ghost_probe(net, params, plan.block_size)
    if args.clipping == "ghost":
        _require(why is None, "--clipping", why or "")
        return "ghost"
    if args.clipping is None and args.grad_sample != "opacus":
        if why is None:
            return "ghost"
        print(f"dpkern finetune: note: {why}: using --clipping per-sample", file=sys.stderr)
    return "per-sample"


def _ghost_probe(net, params, block_size: int) -> str | None:
    """Whether ghost clipping is exact on this model, checked before training: one ghost
    backward with the first-step check (``verify="always"``) on 3 blocks of random token
    ids (never the private data: the answer depends on the model only), through a
    throw-away optimizer that releases nothing. Returns None, or why not (one line)."""
    import dpkern
    from ..ghost import GhostClipping

    vocab = getattr(getattr(net, "model", net), "config", None)
    vocab = getattr(vocab, "vocab_size", models.BYTE_VOCAB)
    gen = torch.Generator().manual_seed(0)
    device = params[0].device
    ids = torch.randint(0, vocab, (3, max(2, min(block_size, 16))), generator=gen).to(device)
    probe = dpkern.DPSGD(
        params,
        lr=0.0,
        max_grad_norm=1e9,
        noise_multiplier=0.0,
        expected_batch_size=3.0,
        backend="torch",
    )
    try:
        with GhostClipping(net, probe, verify="always") as gc:
            gc.clipped_sums(models.token_loss(net(ids), ids))
    except (ValueError, FloatingPointError) as exc:
        first = str(exc).split(". ")[0].split("\n")[0]
        return f"ghost clipping is not exact on this model ({first[:300]})"
    finally:
        for p in params:
            p.grad = None
    return None


class _Ghost:
    """Ghost clipping + book-keeping (dpkern.ghost): one backward per micro-batch adds its
    clipped sum into the optimizer's buffers; returns the per-sample losses."""

    accumulates = True  # the micro-batch is already in the optimizer's buffers

    def __init__(self, net, optimizer, placeholder=None):
        from ..ghost import GhostClipping

        self.gc = GhostClipping(net, optimizer).attach()
        self.net = net
        self.placeholder = placeholder  # FSDP2: one block run by a rank without samples

    def __call__(self, ids):
        if ids.shape[0] == 0 and self.placeholder is not None:
            # FSDP2: the forward's all-gathers are collectives; the loss is dropped
            ph = self.placeholder.to(ids.device)
            self.gc.backward(models.token_loss(self.net(ph), ph)[:0])
            return torch.zeros(0, device=ids.device)
        if ids.shape[0] == 0:
            self.gc.add_empty_batch()
            return torch.zeros(0, device=ids.device)
        losses = models.token_loss(self.net(ids), ids)
        self.gc.backward(losses)
        return losses.detach()


def _make_optimizer(plan: Plan, params, backend: str, sigma: float):
    from .. import optim

    cls = {
        "dp-sgd": optim.DPSGD,
        "dp-adam": optim.DPAdam,
        "dp-adambc": optim.DPAdamBC,
        "dp-adamw": optim.DPAdamW,
        "dp-adamw-bc": optim.DPAdamWBC,
        "dp-macadam": optim.DPMacAdam,
    }[plan.optimizer]
    kw = {
        "lr": plan.lr,
        "noise_multiplier": sigma,
        "expected_batch_size": plan.batch_size,
        "seed": plan.noise_seed,
        "backend": backend,
    }  # None: a secret key (os.urandom)
    if plan.weight_decay is not None:
        if plan.optimizer == "dp-macadam":
            raise UsageError("--weight-decay", "dp-macadam has no weight decay")
        kw["weight_decay"] = plan.weight_decay
    if plan.optimizer != "dp-macadam":
        kw["max_grad_norm"] = plan.max_grad_norm
    try:
        return cls(params, **kw)
    except ValueError as exc:
        raise UsageError("--optimizer", f"{plan.optimizer}: {exc}") from None


def _calibrate_extension(
    history, sample_rate: float, steps: int, epsilon: float, delta: float, accountant: str
) -> float:
    """The noise multiplier for ``steps`` more steps such that the whole history plus them
    spends at most ``epsilon`` (geometric bisection on the PrivacyAccountant, to 1e-4)."""
    from ..accounting import MAX_NOISE_MULTIPLIER, PrivacyAccountant

    def spent(sigma):
        acc = PrivacyAccountant(accountant)
        acc.load_state_dict({"accountant": accountant, "history": history})
        acc.step(sigma, sample_rate, steps)
        return acc.get_epsilon(delta)

    if spent(MAX_NOISE_MULTIPLIER) > epsilon:
        raise UsageError(
            "--epsilon",
            f"the checkpoint already spent the budget: no noise "
            f"multiplier <= {MAX_NOISE_MULTIPLIER:g} keeps {steps} more steps "
            f"within epsilon={epsilon:g}",
        )
    lo, hi = 1e-3, MAX_NOISE_MULTIPLIER
    if spent(lo) <= epsilon:
        return lo
    while hi / lo > 1 + 1e-4:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if spent(mid) <= epsilon else (mid, hi)
    return hi


# -- run_config.json -----------------------------------------------------------------


def _run_record(plan: Plan) -> dict:
    """run_config.json's plan. With --noise-seed the target epsilon is only what sigma was
    calibrated to, and the record says the run is not private."""
    record = dataclasses.asdict(plan)
    if plan.noise_seed is not None:
        record["privacy"] = NOT_PRIVATE
        record["epsilon_for_noise_calibration"] = record.pop("epsilon")
    return record


def _saved_plan(saved: dict, trainer_state: dict) -> dict:
    """The inverse of :func:`_run_record` (a resumed run_config.json). A checkpoint of a
    dpkern before --noise-seed existed used --seed as the noise key (its optimizer state
    holds it): that key is known, so the run continues as a --noise-seed run."""
    saved = dict(saved)
    if "epsilon_for_noise_calibration" in saved:
        saved["epsilon"] = saved.pop("epsilon_for_noise_calibration")
    if "noise_seed" not in saved:
        dp = (trainer_state.get("optimizer") or {}).get("dp") or {}
        saved["noise_seed"] = dp.get("seed")
    return saved


# -- the job ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Run ``dpkern finetune``; returns the exit code: 0; 2 for bad input (a one-line
    error on stderr, nothing written); 130 / 143 when SIGINT / SIGTERM stopped it at a
    step boundary (checkpointed to --out, one line on stderr)."""
    try:
        return _run(args)
    except UsageError as exc:
        print(f"dpkern finetune: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    job = _prepare(args)
    if getattr(args, "nproc", 1) > 1:
        del job  # everything is validated: the workers build their own copies
        from .parallel import spawn

        return spawn(args)
    with StopSignals() as stop:  # SIGINT / SIGTERM: stop at a step boundary
        return _train_with_warnings(args, job, stop=stop)


def _train_with_warnings(args, job: dict, dist_ctx=None, stop: StopSignals | None = None) -> int:
    def show_warning(message, category, filename, lineno, file=None, line=None):
        print(f"dpkern finetune: warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show_warning
        warnings.filterwarnings("ignore", module="opacus")
        from .training import run_training

        return run_training(args, **job, dist_ctx=dist_ctx, stop=stop or StopSignals())


def _check_nproc(args, device: torch.device) -> None:
    nproc = getattr(args, "nproc", 1)
    if getattr(args, "fsdp", False):
        _require(
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

    _require(dist.is_available(), "--nproc", "this torch build has no torch.distributed")
    if device.type == "cuda":
        _require(
            device.index is None,
            "--device",
            f"{device} names one GPU; with --nproc rank r runs on cuda:r (pass --device cuda)",
        )
        _require(
            nproc <= torch.cuda.device_count(),
            "--nproc",
            f"{nproc} processes but only {torch.cuda.device_count()} CUDA devices",
        )
    else:
        _require(device.type == "cpu", "--nproc", f"supports cpu and cuda, not {device.type}")


def _prepare(args) -> dict:
    """Validate everything and build the job (the keyword arguments of :func:`_train`).

    Raises UsageError on bad input. Deterministic given args (the model init in secure
    mode aside), so that data-parallel workers rebuild the same job."""
    _check_numbers(args)
    saved = trainer_state = old_metrics = None
    if args.resume:
        saved, trainer_state, old_metrics = load_checkpoint(Path(args.resume))
        saved = _saved_plan(saved, trainer_state)
    plan = _plan_from_args(args, saved)
    out = check_out(
        args.out,
        overwrite=args.overwrite,
        resume=args.resume,
        protected={"--data": plan.data, "--model": plan.model, "--resume": args.resume},
    )
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
    _check_nproc(args, device)
    from .. import backends

    if args.backend != "auto":
        try:
            backends.resolve(args.backend, device)
        except (RuntimeError, ValueError) as exc:
            raise UsageError("--backend", str(exc)) from None

    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise UsageError(
            "--model",
            "the finetune job needs transformers, which is not "
            "installed (pip install 'dpkern[llm]')",
        ) from None
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's RDP series notes
    model, tokenizer = _load_model(plan, args)
    block_size_given = args.block_size is not None and saved is None
    train, val, n_bytes, n_tokens = _load_blocks(plan, tokenizer, block_size_given)
    n = train.shape[0]
    if saved is not None and (n, val.shape[0]) != (saved.get("n_train"), saved.get("n_val")):
        raise UsageError(
            "--data",
            f"gives {n} training blocks, the checkpoint was trained on "
            f"{saved.get('n_train')}: not the same data",
        )
    _check_batch_fits(plan, n, n_tokens, block_size_given)
    q = plan.batch_size / n
    delta = plan.delta if plan.delta is not None else 1.0 / n**1.1
    steps = (
        plan.steps
        if plan.steps is not None
        else max(1, math.ceil(plan.epochs * n / plan.batch_size))
    )
    done = int(trainer_state["step"]) if trainer_state else 0

    from ..accounting import PrivacyAccountant, get_noise_multiplier

    accountant = PrivacyAccountant(plan.accountant)
    if trainer_state:
        accountant.load_state_dict(trainer_state["accountant"])
    if saved is None:
        try:
            sigma = get_noise_multiplier(plan.epsilon, delta, q, steps, plan.accountant)
        except ValueError as exc:
            raise UsageError("--epsilon", f"budget too small: {exc}") from None
    else:
        _require(steps >= done, "--steps", f"{steps} is below the checkpoint's step {done}")
        _require(
            steps > done,
            "--steps",
            f"the checkpoint already finished its {done} steps; pass a larger --steps to continue",
        )
        if steps == saved.get("steps") and plan.epsilon == saved.get("epsilon"):
            sigma = float(saved["noise_multiplier"])  # an interrupted run: same plan
        else:
            sigma = _calibrate_extension(
                accountant.history, q, steps - done, plan.epsilon, delta, plan.accountant
            )
    plan.steps, plan.epochs = steps, None
    plan.n_train, plan.n_val, plan.sample_rate, plan.noise_multiplier = n, val.shape[0], q, sigma
    plan.tokenizer = "bytes" if tokenizer is None else "hf"

    model.to(device)
    net = models.CausalLMLogits(model, explicit_positions=args.grad_sample == "opacus")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _make_optimizer(plan, params, args.backend, sigma)
    if trainer_state:
        try:
            optimizer.load_state_dict(trainer_state["optimizer"])
        except (ValueError, KeyError) as exc:
            raise UsageError("--resume", f"optimizer state does not fit: {exc}") from None
        optimizer.noise_multiplier = sigma
    micro = args.micro_batch_size or DEFAULT_MICRO_BATCH
    args.clipping = _choose_clipping(args, plan, net, params)
    _require(
        not getattr(args, "fsdp", False) or args.clipping == "ghost", "--fsdp", _FSDP_NEEDS_GHOST
    )
    per_sample = (
        _Ghost(net, optimizer) if args.clipping == "ghost" else _PerSample(net, args.grad_sample)
    )
    numel = sum(p.numel() for p in params)
    _warn_delta(plan.delta, n)  # (last: bad input stays a one-line error)
    return {
        "plan": plan,
        "out": out,
        "model": model,
        "tokenizer": tokenizer,
        "net": net,
        "optimizer": optimizer,
        "accountant": accountant,
        "per_sample": per_sample,
        "train": train,
        "val": val,
        "n_bytes": n_bytes,
        "done": done,
        "steps": steps,
        "micro": micro,
        "delta": delta,
        "numel": numel,
        "device": device,
        "old_metrics": old_metrics or {},
    }
