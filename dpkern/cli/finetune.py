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
on the private data without noise: they are for the operator, not for publication.

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
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import models

OPTIMIZERS = ("dp-sgd", "dp-adam", "dp-adambc", "dp-adamw", "dp-adamw-bc", "dp-macadam")
GRAD_SAMPLE_MODES = ("functorch", "opacus")
CLIPPING_MODES = ("ghost", "per-sample")

#: Defaults of the run plan (kept in one place; the help text is built from it).
DEFAULTS = {
    "block_size": 64,
    "val_fraction": 0.1,
    "optimizer": "dp-adamw",
    "lr": 5e-3,
    "weight_decay": None,        # None = the optimizer's own default
    "epsilon": 8.0,
    "delta": None,               # None = 1 / N**1.1
    "accountant": "rdp",
    "max_grad_norm": 1.0,
    "batch_size": 128,
    "steps": 150,
}
DEFAULT_MICRO_BATCH = 64
#: Options that define the run plan: taken from the checkpoint on --resume.
PLAN_OPTIONS = ("model", "block_size", "val_fraction", "optimizer", "lr", "weight_decay",
                "delta", "accountant", "max_grad_norm", "batch_size", "seed")
FILES = {"run": "run_config.json", "metrics": "metrics.json", "trainer": "trainer_state.pt"}


class UsageError(Exception):
    """Bad input: printed as one line naming the option, exit code 2."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the options of ``dpkern finetune`` on ``parser``."""
    d = DEFAULTS
    g = parser.add_argument_group("model and data")
    g.add_argument("--model", metavar="DIR", help="local Hugging Face causal LM directory "
                   "(loaded offline; its tokenizer if present, else byte-level ids). Default: "
                   "a byte-level GPT-2 built in code (2 layers, width 128, 4 heads)")
    g.add_argument("--data", metavar="PATH", help="a UTF-8 .txt file, or .jsonl with a "
                   '"text" field per line. Default: CPython\'s pydoc_data help pages')
    g.add_argument("--block-size", type=int, metavar="T",
                   help=f"tokens per training example (the privacy unit) (default {d['block_size']})")
    g.add_argument("--val-fraction", type=float, metavar="F",
                   help=f"blocks held out for validation (default {d['val_fraction']})")
    g = parser.add_argument_group("privacy")
    g.add_argument("--epsilon", type=float, help=f"target epsilon at the end of training "
                   f"(default {d['epsilon']:g})")
    g.add_argument("--delta", type=float, help="target delta (default 1/N^1.1, N = number "
                   "of training blocks)")
    g.add_argument("--accountant", choices=("rdp", "pld"),
                   help=f"privacy accountant of dp-accounting (default {d['accountant']})")
    g.add_argument("--max-grad-norm", type=float, metavar="C",
                   help=f"per-sample clipping bound (default {d['max_grad_norm']:g}; "
                   "unused by dp-macadam)")
    g.add_argument("--batch-size", type=int, metavar="B", help="expected logical batch "
                   f"under Poisson sampling (default {d['batch_size']})")
    g.add_argument("--micro-batch-size", type=int, metavar="M", help="physical batch; a "
                   "logical batch is accumulated over micro-batches (default 64)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--steps", type=int, help=f"optimizer steps (default {d['steps']})")
    x.add_argument("--epochs", type=float, help="passes over the training blocks "
                   "(steps = ceil(epochs * N / batch size))")
    g = parser.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=OPTIMIZERS, help=f"(default {d['optimizer']})")
    g.add_argument("--lr", type=float, help=f"learning rate (default {d['lr']:g})")
    g.add_argument("--weight-decay", type=float, metavar="WD",
                   help="weight decay (default: the optimizer's own, 0.01 for the AdamW "
                   "family, else 0)")
    g.add_argument("--backend", choices=("auto", "torch", "triton", "cpp"), default="auto",
                   help="dpkern kernel backend (default auto)")
    g.add_argument("--grad-sample", choices=GRAD_SAMPLE_MODES, default="functorch",
                   help="per-sample gradients: dpkern.grad_sample (torch.func) or Opacus' "
                   "GradSampleModule (default functorch)")
    g.add_argument("--clipping", choices=CLIPPING_MODES, help="how per-sample gradients are "
                   "clipped: ghost (dpkern.ghost: norms from activations and output "
                   "gradients, no per-sample gradients in memory) or per-sample "
                   "(materialised, see --grad-sample). Default: ghost when it covers every "
                   "trainable layer, else per-sample; dp-macadam always uses per-sample")
    g.add_argument("--seed", type=int, help="reproducible mode: seeds the noise key, the "
                   "sampler, the model init and dropout. Without it the noise key is secret")
    g.add_argument("--device", help="torch device (default cuda if available, else cpu)")
    g.add_argument("--nproc", type=int, default=1, metavar="N", help="data-parallel worker "
                   "processes (gloo on CPU, NCCL on CUDA: one GPU each); the global expected "
                   "batch is still --batch-size (default 1: a single process)")
    g.add_argument("--fsdp", action="store_true", help="with --nproc N: shard parameters, "
                   "gradients and optimizer state over the processes (FSDP2, one unit per "
                   "transformer block) instead of replicating them (DDP); ghost clipping only")
    g = parser.add_argument_group("output")
    g.add_argument("--out", metavar="DIR", help="write the model (save_pretrained), "
                   f"{FILES['run']}, {FILES['metrics']} and {FILES['trainer']} here")
    g.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    g.add_argument("--resume", metavar="DIR", help="continue the run saved in DIR "
                   "(written back to DIR unless --out is given)")
    g.add_argument("--save-every", type=int, metavar="K", help="also checkpoint to --out "
                   "every K steps")
    g.add_argument("--eval-batch-size", type=int, default=64, metavar="N",
                   help="blocks per validation forward pass (default 64)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


# -- validation -------------------------------------------------------------------------

def _require(cond: bool, option: str, message: str) -> None:
    if not cond:
        raise UsageError(option, message)


def _check_numbers(args) -> None:
    def finite(v):
        return v is None or math.isfinite(v)
    for opt in ("epsilon", "delta", "lr", "weight_decay", "max_grad_norm", "val_fraction",
                "epochs"):
        _require(finite(getattr(args, opt)), "--" + opt.replace("_", "-"),
                 f"{getattr(args, opt)} is not a finite number")
    _require(args.epsilon is None or args.epsilon > 0, "--epsilon",
             f"must be > 0, got {args.epsilon}")
    _require(args.delta is None or 0 < args.delta < 1, "--delta",
             f"must be in (0, 1), got {args.delta}")
    _require(args.lr is None or args.lr >= 0, "--lr", f"must be >= 0, got {args.lr}")
    _require(args.weight_decay is None or args.weight_decay >= 0, "--weight-decay",
             f"must be >= 0, got {args.weight_decay}")
    _require(args.max_grad_norm is None or args.max_grad_norm > 0, "--max-grad-norm",
             f"must be > 0, got {args.max_grad_norm}")
    _require(args.val_fraction is None or 0 < args.val_fraction < 1, "--val-fraction",
             f"must be in (0, 1), got {args.val_fraction}")
    for opt, low in (("batch_size", 1), ("micro_batch_size", 1), ("steps", 1),
                     ("block_size", 2), ("save_every", 1), ("eval_batch_size", 1),
                     ("nproc", 1)):
        v = getattr(args, opt)
        _require(v is None or v >= low, "--" + opt.replace("_", "-"), f"must be >= {low}, got {v}")
    _require(args.epochs is None or args.epochs > 0, "--epochs", f"must be > 0, got {args.epochs}")
    _require(args.seed is None or 0 <= args.seed < 2**63, "--seed",
             f"must be in [0, 2**63), got {args.seed}")


def _check_out(args) -> Path | None:
    """The output directory (resume without --out writes back to the resumed run)."""
    if args.out is None:
        return Path(args.resume) if args.resume else None
    out = Path(args.out)
    same_as_resume = args.resume is not None and out.resolve() == Path(args.resume).resolve()
    if out.exists() and not out.is_dir():
        raise UsageError("--out", f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite and not same_as_resume:
        raise UsageError("--out", f"{out} exists and is not empty; pass --overwrite to replace it")
    return out


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
    tokenizer: str = "bytes"
    n_train: int = 0
    n_val: int = 0
    sample_rate: float = 0.0
    noise_multiplier: float = 0.0


def _plan_from_args(args, saved: dict | None) -> Plan:
    values = {}
    for name in ("model", "data", "block_size", "val_fraction", "optimizer", "lr",
                 "weight_decay", "epsilon", "delta", "accountant", "max_grad_norm",
                 "batch_size", "steps", "epochs", "seed"):
        given = getattr(args, name)
        if saved is not None and name in PLAN_OPTIONS:
            if given is not None and given != saved.get(name) and name != "model":
                raise UsageError("--" + name.replace("_", "-"), "cannot be changed on "
                                 f"--resume (the checkpoint has {saved.get(name)!r})")
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
            source, "eager" if args.grad_sample == "functorch" else None)
    except ValueError as exc:
        raise UsageError(option, str(exc)) from None
    ctx = models.context_length(model)
    if ctx is not None and plan.block_size > ctx:
        raise UsageError("--block-size", f"{plan.block_size} exceeds the model's context "
                         f"length {ctx}")
    return model, tokenizer


def _load_blocks(plan: Plan, tokenizer):

    from .. import data
    try:
        text = data.read_text(plan.data) if plan.data is not None else data.default_text()
    except (OSError, ValueError) as exc:
        msg = exc.strerror + f": {plan.data}" if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UsageError("--data", msg) from None
    if tokenizer is None:
        ids = data.byte_encode(text)
    else:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    blocks = data.make_blocks(ids, plan.block_size)
    try:
        train, val = data.split_blocks(blocks, plan.val_fraction)
    except ValueError as exc:
        raise UsageError("--data", f"{exc} at --block-size {plan.block_size} "
                         f"({ids.numel()} tokens)") from None
    return train, val, len(text.encode("utf-8"))


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


_FSDP_NEEDS_GHOST = ("needs ghost clipping (dp-macadam and --clipping per-sample materialise "
                     "per-sample gradients, which the finetune job does not shard)")


def _choose_clipping(args, plan: Plan, net, params) -> str:
    """--clipping: ghost by default where dpkern.ghost covers every trainable layer;
    dp-macadam (whitened clipping) and --grad-sample opacus need per-sample gradients."""
    from ..ghost import supports
    _require(not getattr(args, "fsdp", False) or (plan.optimizer != "dp-macadam"
                                                    and args.clipping != "per-sample"),
             "--fsdp", _FSDP_NEEDS_GHOST)
    if plan.optimizer == "dp-macadam":
        _require(args.clipping != "ghost", "--clipping", "ghost clipping cannot serve "
                 "dp-macadam (it clips whitened per-sample gradients); use per-sample")
        if args.clipping is None:
            print("dpkern finetune: note: dp-macadam clips whitened per-sample gradients: "
                  "using --clipping per-sample", file=sys.stderr)
        return "per-sample"
    ok, uncovered = supports(net, params)
    if args.clipping == "ghost":
        _require(ok, "--clipping", "ghost clipping does not cover " + ", ".join(uncovered))
        return "ghost"
    if args.clipping is None and ok and args.grad_sample != "opacus":
        return "ghost"
    return "per-sample"


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
    cls = {"dp-sgd": optim.DPSGD, "dp-adam": optim.DPAdam, "dp-adambc": optim.DPAdamBC,
           "dp-adamw": optim.DPAdamW, "dp-adamw-bc": optim.DPAdamWBC,
           "dp-macadam": optim.DPMacAdam}[plan.optimizer]
    kw = dict(lr=plan.lr, noise_multiplier=sigma, expected_batch_size=plan.batch_size,
              seed=plan.seed, backend=backend)
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


def _calibrate_extension(history, sample_rate: float, steps: int, epsilon: float,
                         delta: float, accountant: str) -> float:
    """The noise multiplier for ``steps`` more steps such that the whole history plus them
    spends at most ``epsilon`` (geometric bisection on the PrivacyAccountant, to 1e-4)."""
    from ..accounting import MAX_NOISE_MULTIPLIER, PrivacyAccountant

    def spent(sigma):
        acc = PrivacyAccountant(accountant)
        acc.load_state_dict({"accountant": accountant, "history": history})
        acc.step(sigma, sample_rate, steps)
        return acc.get_epsilon(delta)
    if spent(MAX_NOISE_MULTIPLIER) > epsilon:
        raise UsageError("--epsilon", f"the checkpoint already spent the budget: no noise "
                         f"multiplier <= {MAX_NOISE_MULTIPLIER:g} keeps {steps} more steps "
                         f"within epsilon={epsilon:g}")
    lo, hi = 1e-3, MAX_NOISE_MULTIPLIER
    if spent(lo) <= epsilon:
        return lo
    while hi / lo > 1 + 1e-4:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if spent(mid) <= epsilon else (mid, hi)
    return hi


# -- checkpoints --------------------------------------------------------------------------

def _write_checkpoint(out: Path, model, tokenizer, plan: Plan, metrics: dict, trainer: dict,
                      model_state: dict | None = None) -> None:
    """Write into a fresh sibling directory, then swap it in: a crash never leaves a
    half-written --out, and an existing one is only replaced once the new one is whole.
    ``model_state``: the full state dict of a sharded (FSDP2) model."""
    import dataclasses

    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, state_dict=model_state)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / FILES["run"]).write_text(json.dumps(dataclasses.asdict(plan), indent=2) + "\n")
        (tmp / FILES["metrics"]).write_text(json.dumps(metrics, indent=2) + "\n")
        torch.save(trainer, tmp / FILES["trainer"])
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / "d")
        os.rename(tmp, out)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load_checkpoint(path: Path) -> tuple[dict, dict, dict]:
    if not path.is_dir():
        raise UsageError("--resume", f"{path} is not a directory")
    missing = [f for f in (FILES["run"], FILES["trainer"], "config.json") if not (path / f).is_file()]
    if missing:
        raise UsageError("--resume", f"{path} is not a dpkern finetune checkpoint (missing "
                         f"{', '.join(missing)})")
    try:
        saved = json.loads((path / FILES["run"]).read_text())
        trainer = torch.load(path / FILES["trainer"], map_location="cpu", weights_only=True)
        metrics = json.loads((path / FILES["metrics"]).read_text()) \
            if (path / FILES["metrics"]).is_file() else {}
    except Exception as exc:  # corrupt files: one line, no traceback
        raise UsageError("--resume", f"{path}: unreadable checkpoint ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    return saved, trainer, metrics


# -- the job ------------------------------------------------------------------------------

def _fmt_time(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{int(seconds // 60)} min {seconds % 60:.0f} s"


def run(args: argparse.Namespace) -> int:
    """Run ``dpkern finetune``; returns the exit code (0, or 2 for bad input with a
    one-line error on stderr and nothing written)."""
    try:
        return _run(args)
    except UsageError as exc:
        print(f"dpkern finetune: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    job = _prepare(args)
    if getattr(args, "nproc", 1) > 1:
        del job  # everything is validated: the workers build their own copies
        return _spawn(args)
    return _train_with_warnings(args, job)


def _train_with_warnings(args, job: dict, dist_ctx=None) -> int:
    def show_warning(message, category, filename, lineno, file=None, line=None):
        print(f"dpkern finetune: warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show_warning
        warnings.filterwarnings("ignore", module="opacus")
        return _train(args, **job, dist_ctx=dist_ctx)


def _check_nproc(args, device: torch.device) -> None:
    nproc = getattr(args, "nproc", 1)
    if getattr(args, "fsdp", False):
        _require(nproc > 1, "--fsdp", "shards over the --nproc processes: pass --nproc N "
                 "with N >= 2")
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            raise UsageError("--fsdp", f"needs FSDP2 (torch >= 2.6), torch is "
                             f"{torch.__version__}") from None
    if nproc == 1:
        return
    import torch.distributed as dist
    _require(dist.is_available(), "--nproc", "this torch build has no torch.distributed")
    if device.type == "cuda":
        _require(device.index is None, "--device", f"{device} names one GPU; with --nproc "
                 "rank r runs on cuda:r (pass --device cuda)")
        _require(nproc <= torch.cuda.device_count(), "--nproc", f"{nproc} processes but "
                 f"only {torch.cuda.device_count()} CUDA devices")
    else:
        _require(device.type == "cpu", "--nproc", f"supports cpu and cuda, not {device.type}")


def _prepare(args) -> dict:
    """Validate everything and build the job (the keyword arguments of :func:`_train`).

    Raises UsageError on bad input. Deterministic given args (the model init in secure
    mode aside), so that data-parallel workers rebuild the same job."""
    _check_numbers(args)
    out = _check_out(args)
    saved = trainer_state = old_metrics = None
    if args.resume:
        saved, trainer_state, old_metrics = _load_checkpoint(Path(args.resume))
    plan = _plan_from_args(args, saved)
    if args.grad_sample == "opacus":
        try:
            import opacus  # noqa: F401
        except ImportError:
            raise UsageError("--grad-sample", "opacus is not installed (pip install "
                             "'dpkern[opacus]')") from None
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
        raise UsageError("--model", "the finetune job needs transformers, which is not "
                         "installed (pip install 'dpkern[llm]')") from None
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's RDP series notes
    model, tokenizer = _load_model(plan, args)
    train, val, n_bytes = _load_blocks(plan, tokenizer)
    n = train.shape[0]
    if saved is not None and (n, val.shape[0]) != (saved.get("n_train"), saved.get("n_val")):
        raise UsageError("--data", f"gives {n} training blocks, the checkpoint was trained on "
                         f"{saved.get('n_train')}: not the same data")
    _require(plan.batch_size <= n, "--batch-size", f"{plan.batch_size} is larger than the "
             f"data set ({n} training blocks of {plan.block_size} tokens)")
    q = plan.batch_size / n
    delta = plan.delta if plan.delta is not None else 1.0 / n ** 1.1
    steps = plan.steps if plan.steps is not None else max(1, math.ceil(plan.epochs * n / plan.batch_size))
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
        _require(steps > done, "--steps", f"the checkpoint already finished its {done} "
                 "steps; pass a larger --steps to continue")
        if steps == saved.get("steps") and plan.epsilon == saved.get("epsilon"):
            sigma = float(saved["noise_multiplier"])  # an interrupted run: same plan
        else:
            sigma = _calibrate_extension(accountant.history, q, steps - done, plan.epsilon,
                                         delta, plan.accountant)
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
    _require(not getattr(args, "fsdp", False) or args.clipping == "ghost", "--fsdp",
             _FSDP_NEEDS_GHOST)
    per_sample = (_Ghost(net, optimizer) if args.clipping == "ghost"
                  else _PerSample(net, args.grad_sample))
    numel = sum(p.numel() for p in params)
    return dict(plan=plan, out=out, model=model, tokenizer=tokenizer, net=net,
                optimizer=optimizer, accountant=accountant, per_sample=per_sample,
                train=train, val=val, n_bytes=n_bytes, done=done, steps=steps, micro=micro,
                delta=delta, numel=numel, device=device, old_metrics=old_metrics or {})


# -- data parallelism (--nproc) -----------------------------------------------------------

def _spawn(args) -> int:
    """Run the validated job in ``args.nproc`` worker processes; rank 0's exit code."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    with tempfile.TemporaryDirectory(prefix="dpkern-finetune-") as tmp:
        ctx = mp.start_processes(_worker, args=(args.nproc, tmp, args), nprocs=args.nproc,
                                 join=False, start_method="spawn")
        try:
            while not ctx.join():
                pass
        except KeyboardInterrupt:  # the workers got it too: rank 0 checkpoints and exits
            try:
                while not ctx.join(timeout=60):
                    pass
            except (KeyboardInterrupt, ProcessException):
                pass
        except ProcessException as exc:
            print(f"dpkern finetune: error: a worker process failed: {exc}", file=sys.stderr)
            return 1
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        rc = Path(tmp, "rc0")
        return int(rc.read_text()) if rc.is_file() else 130


def _worker(rank: int, world: int, tmp: str, args) -> None:
    """One data-parallel rank: rebuild the job, join the group, train, record the code."""
    import contextlib
    import io

    import torch.distributed as dist

    from ..distributed import DistributedDPOptimizer

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    args = argparse.Namespace(**vars(args))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        args.device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    args.writes = args.out is not None or args.resume is not None  # rank 0 checkpoints
    if rank != 0:
        args.quiet, args.out = True, None
        if not args.fsdp:  # (FSDP: every rank joins the checkpoint's gathers)
            args.save_every = None
    with contextlib.redirect_stderr(io.StringIO()):  # notes were shown before spawning
        job = _prepare(args)
    if rank != 0:
        job["out"] = None
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{os.path.join(tmp, 'rendezvous')}",
                            rank=rank, world_size=world)
    try:
        with torch.no_grad():  # one model: rank 0's init (secure mode draws it per rank)
            for t in job["model"].state_dict().values():
                dist.broadcast(t, src=0)
        if args.fsdp:
            _shard(job, args, world)
        else:
            job["optimizer"] = DistributedDPOptimizer(job["optimizer"])  # broadcasts the key
        code = _train_with_warnings(args, job, dist_ctx=(rank, world))
        Path(tmp, f"rc{rank}").write_text(str(code))
    finally:
        dist.destroy_process_group()


def _shard(job: dict, args, world: int) -> None:
    """--fsdp: shard the (broadcast) model with FSDP2 -- one unit per transformer block,
    then the root -- and rebuild the optimizer over the DTensor shards (a resumed run's
    full optimizer state is cut to this rank's rows) and ghost clipping over it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..distributed import DistributedDPOptimizer
    model, plan = job["model"], job["plan"]
    full_state = job["optimizer"].state_dict() if job["done"] else None
    job["per_sample"].gc.detach()
    mesh = init_device_mesh(job["device"].type, (world,))
    blocks = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)
                   and len(m)), [])
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = DistributedDPOptimizer(_make_optimizer(plan, params, args.backend,
                                                       plan.noise_multiplier))
    if full_state is not None:
        optimizer.load_state_dict(full_state)
        optimizer.noise_multiplier = plan.noise_multiplier
    job["optimizer"] = optimizer
    job["per_sample"] = _Ghost(job["net"], optimizer, placeholder=job["train"][:1])


def _check_replicas(model, world: int, device) -> None:
    """Every rank must end with the same parameters (same init, same all-reduced sums,
    same noise): compare per-parameter float64 sums across ranks, exactly (a collective).

    Raises DistributedDPError on every rank if the replicas diverged."""
    import torch.distributed as dist

    from ..distributed import DistributedDPError
    sums = torch.stack([p.detach().double().sum() for p in model.parameters()]).to(device)
    rows = [torch.empty_like(sums) for _ in range(world)]
    dist.all_gather(rows, sums)
    bad = [r for r in range(world) if not torch.equal(rows[r], rows[0])]
    if bad:
        raise DistributedDPError(f"model replicas diverged: ranks {bad} differ from rank 0")


# -- training -----------------------------------------------------------------------------

def _train(args, plan, out, model, tokenizer, net, optimizer, accountant, per_sample, train,
           val, n_bytes, done, steps, micro, delta, numel, device, old_metrics,
           dist_ctx=None) -> int:
    """The training loop. ``dist_ctx``: None, or (rank, world size) inside an initialised
    process group with ``optimizer`` a DistributedDPOptimizer."""
    from tqdm import tqdm

    from ..sampling import PoissonBatchSampler

    q, sigma = plan.sample_rate, plan.noise_multiplier
    rank, world = dist_ctx or (0, 1)
    fsdp = bool(getattr(optimizer, "sharded", False))
    writes = getattr(args, "writes", out is not None)  # (FSDP: ranks != 0 join the gathers)
    t_start = time.perf_counter()
    val_before = models.evaluate(net, val, args.eval_batch_size, device)
    sampler_seed = None if plan.seed is None else (plan.seed * 1_000_003 + done) % 2**63
    if plan.seed is not None:  # dropout masks (a --model with dropout): per rank, per resume
        torch.manual_seed((sampler_seed * 1009 + rank + 1) % 2**63)
    if dist_ctx is None:
        sampler = PoissonBatchSampler(train.shape[0], q, steps - done, seed=sampler_seed)
    else:
        from ..distributed import DistributedPoissonSampler
        sampler = DistributedPoissonSampler(train.shape[0], q, steps - done, rank=rank,
                                            num_replicas=world, seed=sampler_seed)
    train_tokens = samples = 0
    train_time = 0.0
    # optimizer statistics over ALL ranks and segments (optimizer.stats counts this rank's
    # samples only; a checkpoint stores these global ones, which a resume starts from)
    stats = dict(optimizer.stats)
    stat_keys = ("samples", "clipped_samples", "nonfinite_samples")
    segment_start = done
    loss_ema = None
    eps_shown, eps_time = accountant.get_epsilon(delta), 0.0
    interrupted = False

    def checkpoint(val_after=None, final=False):
        eps, delta_total = accountant.get_privacy_spent(delta, numel)
        metrics = {
            "step": optimizer.dp_step, "steps": steps, "epsilon": eps,
            "target_epsilon": plan.epsilon, "delta": delta_total, "target_delta": delta,
            "noise_multiplier": sigma, "sample_rate": q, "max_grad_norm": plan.max_grad_norm,
            "expected_batch_size": plan.batch_size, "accountant": plan.accountant,
            "optimizer": plan.optimizer, "backend": args.backend,
            "val_loss_before": val_before, "val_perplexity_before": math.exp(val_before),
            "val_loss_after": val_after,
            "val_perplexity_after": None if val_after is None else math.exp(val_after),
            "val_loss_initial": old_metrics.get("val_loss_initial", val_before),
            "train_loss_ema": loss_ema, "samples": samples, "tokens": train_tokens,
            "train_seconds": train_time, "tokens_per_second": train_tokens / max(train_time, 1e-9),
            "total_seconds": time.perf_counter() - t_start, "num_parameters": numel,
            "n_train_blocks": plan.n_train, "n_val_blocks": plan.n_val,
            "block_size": plan.block_size, "finished": final,
            "optimizer_stats": dict(stats), "nproc": world, "fsdp": fsdp,
            "bytes_per_rank": _resident_bytes(optimizer),
        }
        segment = {"steps": [segment_start, optimizer.dp_step], "nproc": world,
                   "fsdp": fsdp, "samples": samples, "tokens": train_tokens,
                   "train_seconds": train_time}
        metrics["segments"] = _past_segments(old_metrics) + [segment]
        model_state = opt_state = None
        if fsdp and writes:  # collectives: every rank gathers, rank 0 writes
            from ..sharding import is_sharded
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
            opt_state = {**opt_state, "dp": {**opt_state["dp"], "stats": dict(stats)}}
            trainer = {"step": optimizer.dp_step, "optimizer": opt_state,
                       "accountant": accountant.state_dict()}
            _write_checkpoint(out, model, tokenizer, plan, metrics, trainer, model_state)
        return metrics

    net.train()
    bar = tqdm(total=steps, initial=done, desc="dp fine-tuning", unit="step",
               disable=args.quiet, dynamic_ncols=True, file=sys.stderr)
    try:
        for indices in sampler:
            t0 = time.perf_counter()
            before = [optimizer.stats[k] for k in stat_keys]
            batch = train[indices]
            losses = []
            chunks = [batch[i:i + micro] for i in range(0, batch.shape[0], micro)] or [batch]
            if fsdp:  # every rank runs as many micro-batches (forwards are collectives)
                import torch.distributed as dist
                n = torch.tensor([len(chunks)], device=device)
                dist.all_reduce(n, op=dist.ReduceOp.MAX)
                chunks += [batch[:0]] * (int(n) - len(chunks))
            for chunk in chunks:
                losses.append(per_sample(chunk.to(device)))
                if not getattr(per_sample, "accumulates", False):
                    optimizer.accumulate()
            optimizer.step()
            accountant.step(sigma, q)
            count, loss_sum = batch.shape[0], float(torch.cat(losses).sum()) if losses else 0.0
            deltas = [optimizer.stats[k] - b for k, b in zip(stat_keys, before)]
            if dist_ctx is not None:  # global counts and mean loss for the bar and metrics
                import torch.distributed as dist
                t = torch.tensor([count, loss_sum, *deltas], dtype=torch.float64,
                                 device=device)
                dist.all_reduce(t)
                count, loss_sum, deltas = int(t[0]), float(t[1]), [int(x) for x in t[2:]]
            stats["steps"] += 1
            for k, d in zip(stat_keys, deltas):
                stats[k] += d
            train_time += time.perf_counter() - t0
            samples += count
            train_tokens += count * plan.block_size
            if count:
                mean = loss_sum / count
                loss_ema = mean if loss_ema is None else 0.9 * loss_ema + 0.1 * mean
            now = time.perf_counter()
            if now - eps_time > 5.0 or optimizer.dp_step == steps:
                eps_shown, eps_time = accountant.get_epsilon(delta), now
            bar.set_postfix(loss=f"{loss_ema:.3f}" if loss_ema is not None else "-",
                            eps=f"{eps_shown:.2f}",
                            tok_s=f"{train_tokens / max(train_time, 1e-9):.0f}", refresh=False)
            bar.update(1)
            if args.save_every and optimizer.dp_step % args.save_every == 0 \
                    and optimizer.dp_step < steps and (out is not None or fsdp and writes):
                checkpoint()
    except KeyboardInterrupt:
        interrupted = True
    bar.close()
    if interrupted:
        optimizer.zero_grad()  # an unfinished logical batch is dropped (never saved)
        metrics = checkpoint()
        where = f"; resume with --resume {out}" if out is not None else ""
        if rank == 0:
            print(f"dpkern finetune: interrupted at step {optimizer.dp_step}/{steps}, "
                  f"epsilon spent {metrics['epsilon']:.3g}{where}", file=sys.stderr)
        return 130
    if dist_ctx is not None and not fsdp:
        _check_replicas(model, world, device)
    val_after = models.evaluate(net, val, args.eval_batch_size, device)
    metrics = checkpoint(val_after, final=True)
    if rank == 0:
        _print_summary(plan, args, metrics, n_bytes, done, out)
    return 0


def _resident_bytes(optimizer) -> dict:
    """Bytes of parameters and optimizer state this rank keeps between steps (its shards
    under --fsdp, everything otherwise)."""
    from ..sharding import local_shard
    params = optimizer.trainable_params()
    state = sum(v.numel() * v.element_size() for p in params
                for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))
    return {"params": sum(local_shard(p)[0].numel() * p.element_size() for p in params),
            "optimizer_state": state}


def _past_segments(old_metrics: dict) -> list[dict]:
    """The training segments (run, then each resume) before this one, from the resumed
    checkpoint's metrics.json."""
    if not old_metrics:
        return []
    if "segments" in old_metrics:
        return list(old_metrics["segments"])
    return [{"steps": [None, old_metrics.get("step")], "nproc": old_metrics.get("nproc", 1),
             "fsdp": old_metrics.get("fsdp", False), "samples": old_metrics.get("samples"),
             "tokens": old_metrics.get("tokens"),
             "train_seconds": old_metrics.get("train_seconds")}]


def _print_summary(plan, args, m, n_bytes, done, out) -> None:
    model = plan.model or ("(resumed) " + str(args.resume) if args.resume else
                           "built-in byte-level GPT-2")
    data = plan.data or "pydoc_data.topics (CPython help pages)"
    delta_src = "" if plan.delta is not None else " (1/N^1.1)"
    lines = [
        f"dpkern finetune: done in {_fmt_time(m['total_seconds'])}",
        f"  model       {model}: {m['num_parameters'] / 1e6:.2f} M parameters, block {plan.block_size}",
        f"  data        {data}: {n_bytes:,} bytes, {plan.n_train:,} train / {plan.n_val:,} "
        "validation blocks",
        f"  optimizer   {plan.optimizer}, lr {plan.lr:g}, backend {args.backend}, "
        f"clipping {args.clipping}" + (f" (per-sample gradients {args.grad_sample})"
                                        if args.clipping == "per-sample" else ""),
        f"  privacy     epsilon {m['epsilon']:.3f} spent (target {plan.epsilon:g}), "
        f"delta {m['delta']:.3g}{delta_src}, sigma {m['noise_multiplier']:.4g}, "
        f"C {plan.max_grad_norm:g}, q {m['sample_rate']:.4g} (Poisson, expected batch "
        f"{plan.batch_size}), {plan.accountant.upper()} accountant",
        f"  training    steps {done} -> {m['step']}, {m['samples']:,} samples, "
        f"{m['tokens']:,} tokens in {_fmt_time(m['train_seconds'])} "
        f"({m['tokens_per_second']:,.0f} tokens/s)"
        + (f", {m['nproc']} data-parallel processes" if m["nproc"] > 1 else "")
        + (" (FSDP2-sharded)" if m.get("fsdp") else ""),
        f"  validation  loss {m['val_loss_before']:.4f} -> {m['val_loss_after']:.4f}, "
        f"perplexity {m['val_perplexity_before']:.2f} -> {m['val_perplexity_after']:.2f}",
    ]
    if out is not None:
        lines.append(f"  saved       {out}")
    print("\n".join(lines))
