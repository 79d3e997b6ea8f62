"""Compare the DP optimizers on real data at several privacy budgets.

For every optimizer x epsilon x seed x learning rate of a small per-optimizer grid:
Poisson sampling, a noise multiplier calibrated so that the whole run spends at most the
target epsilon (dp-accounting, RDP by default), per-sample gradients with torch.func,
one dpkern optimizer; then the metric on a validation split and on a test split.
Per optimizer and epsilon the learning rate with the best MEAN VALIDATION metric over
seeds is chosen (the test split is never looked at for that), and the table reports the
test metric of those runs as mean +- std over seeds, as the papers' tables do.

Tasks:
  digits  scikit-learn's bundled handwritten digits (1797 8x8 images, offline), a small
          CNN with GroupNorm (no BatchNorm: DP forbids cross-sample operations), fixed
          stratified 70/15/15 train/validation/test split; metric: test accuracy (%).
  text    the finetune job's model and data (dpkern.models / dpkern.data): a byte-level
          GPT-2 on CPython's help pages, blocks as the privacy unit; metric: held-out
          perplexity (lower is better).

Outputs in --out-dir: runs.csv (every training run, epsilon spent included),
summary.csv (one row per optimizer x epsilon), table.md (mean +- std over seeds) and
plot.png (metric vs epsilon per optimizer).

Privacy note: epsilon is that of ONE training run. Choosing the learning rate among
several runs on the same private data spends more (Papernot & Steinke, ICLR 2022); like
the papers being reproduced, this tool does not account for it. And each run's noise key
is its seed (finetune's --noise-seed semantics, so that the optimizers at one seed see the
same noise draws): the runs are not private (the noise key is known), and the epsilons
are those the runs would spend with a secret key. The output says so.

Optimizer names are finetune's, the command-line names of the rule registry
(:mod:`dpkern.rules`): dp-sgd, dp-adam, dp-adambc, dp-adamw, dp-adamw-bc, dp-macadam; each
rule's learning-rate grid is its ``RuleSpec.lr_grid``. The command echoed at the top of
table.md is the one that ran (rerunning it runs the same grid).

Example:  dpkern compare --task digits --epsilons 1 3 7 --seeds 3 --optimizers all
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.nn.functional as TF
from torch import Tensor, nn

from .. import rules
from ..accounting import ACCOUNTANTS, PrivacyAccountant, get_noise_multiplier
from ..backends import BACKENDS
from ..grad_sample import compute_grad_sample
from ..sampling import PoissonBatchSampler

# name (finetune's) -> (class, learning-rate grid; the third value is --quick's), from the
# registry: the grids (RuleSpec.lr_grid) bracket the best values of a 5-point sweep at
# epsilon 1 and 7 on digits (seed 0).
OPTIMIZERS: dict[str, tuple[type, tuple[float, ...]]] = {
    spec.cli_name: (spec.optimizer_class(), spec.lr_grid)
    for spec in rules.RULES.values()
    if spec.lr_grid
}
# --weight-decay applies to the rules with decoupled decay only
DECOUPLED = tuple(s.cli_name for s in rules.RULES.values() if s.decoupled_decay)
QUICK_OPTIMIZERS = ("dp-sgd", "dp-adamw")
#: Said in every output: each run's noise key is its seed.
NOISE_NOTE = (
    "not private: the noise key is known (each run's noise key is its seed, the "
    "same for every optimizer; the epsilons are those the runs would spend with a "
    "secret key)"
)
CSV_RUN_FIELDS = (
    "task",
    "optimizer",
    "epsilon",
    "seed",
    "lr",
    "noise_multiplier",
    "sample_rate",
    "steps",
    "epsilon_spent",
    "delta",
    "val_metric",
    "test_metric",
    "seconds",
    "cpu_seconds",
)
CSV_SUMMARY_FIELDS = (
    "task",
    "optimizer",
    "epsilon",
    "lr",
    "seeds",
    "test_mean",
    "test_std",
    "val_mean",
    "epsilon_spent_max",
    "noise_multiplier",
    "steps",
)


# --------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------
@dataclass
class Task:
    """One benchmark: data splits, a model factory, a per-sample loss and the metric.

    ``train`` is a tuple of tensors whose first dimension indexes the privacy unit (one
    image, one text block); ``loss_fn(output, *targets)`` is the loss of ONE sample as
    :func:`dpkern.grad_sample.compute_grad_sample` calls it; ``evaluate(model, split)``
    returns the metric (a float) on ``split`` ("val" or "test")."""

    name: str
    metric: str
    higher_is_better: bool
    train: tuple[Tensor, ...]
    make_model: Callable[[int], nn.Module]
    loss_fn: Callable
    evaluate: Callable[[nn.Module, str], float]
    epochs: float = 15.0  # default expected passes over the training set
    quick_epochs: float = 1.0  # --quick's

    @property
    def num_train(self) -> int:
        return int(self.train[0].shape[0])


class DigitsCNN(nn.Module):
    """A small CNN for 8x8 digits (about 6.2 k parameters): two conv 3x3 -> GroupNorm ->
    tanh -> max-pool stages, then a linear classifier. Input float32 ``[B, 1, 8, 8]`` in
    [0, 1]; output logits ``[B, 10]``. GroupNorm, never BatchNorm (per-sample), and tanh
    (bounded activations help under DP: Papernot et al., AAAI 2021)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.GroupNorm(4, 16),
            nn.Tanh(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.GroupNorm(4, 32),
            nn.Tanh(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 2 * 2, 10),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def digits_splits(split_seed: int = 0) -> dict[str, tuple[Tensor, Tensor]]:
    """scikit-learn's ``load_digits`` as {"train", "val", "test"} -> (x float32
    ``[N, 1, 8, 8]`` scaled to [0, 1], y int64 ``[N]``): a stratified 70/15/15 split,
    fixed by ``split_seed`` (public: it is not part of the private randomness)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    idx = list(range(len(y)))
    train, rest = train_test_split(idx, test_size=0.3, random_state=split_seed, stratify=y)
    val, test = train_test_split(rest, test_size=0.5, random_state=split_seed, stratify=y[rest])
    xt = torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    yt = torch.tensor(y, dtype=torch.long)
    return {
        name: (xt[ids], yt[ids]) for name, ids in (("train", train), ("val", val), ("test", test))
    }


def digits_task() -> Task:
    """The digits task: :class:`DigitsCNN`, cross-entropy, accuracy in %."""
    splits = digits_splits()

    def make_model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return DigitsCNN()

    @torch.no_grad()
    def evaluate(model: nn.Module, split: str) -> float:
        x, y = splits[split]
        model.eval()
        return 100.0 * (model(x).argmax(1) == y).float().mean().item()

    return Task(
        "digits", "test accuracy (%)", True, splits["train"], make_model, TF.cross_entropy, evaluate
    )


TEXT_BLOCK_SIZE = 64  # the finetune job's default block (the privacy unit)
TEXT_VAL_FRACTION = 0.1  # held out by dpkern.data.split_blocks, then halved: val | test


def text_task() -> Task:
    """The text task: the finetune job's default byte-level GPT-2 (dpkern.models) on its
    default corpus (dpkern.data: CPython's help pages), blocks of 64 bytes as the privacy
    unit, its per-block next-token loss; the held-out 10% of blocks is halved into
    validation and test. Metric: perplexity per byte, exp(mean loss), lower is better."""
    from .. import data, models

    blocks = data.make_blocks(data.byte_encode(data.default_text()), TEXT_BLOCK_SIZE)
    train, held = data.split_blocks(blocks, TEXT_VAL_FRACTION)
    half = held.shape[0] // 2
    splits = {"val": held[:half], "test": held[half:]}

    def make_model(seed: int) -> nn.Module:
        return models.CausalLMLogits(models.default_model(TEXT_BLOCK_SIZE, seed=seed))

    def evaluate(model: nn.Module, split: str) -> float:
        return math.exp(models.evaluate(model, splits[split], 64, torch.device("cpu")))

    # sample_loss(logits, ids) gets the block as input and as target: train = (ids, ids)
    return Task(
        "text",
        "held-out perplexity (per byte)",
        False,
        (train, train),
        make_model,
        models.sample_loss,
        evaluate,
        epochs=1.0,
        quick_epochs=0.05,
    )


TASKS = {"digits": digits_task, "text": text_task}


# --------------------------------------------------------------------------------------
# One training run
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs besides the task (picklable for worker processes)."""

    task: str
    optimizer: str
    epsilon: float
    seed: int
    lr: float
    noise_multiplier: float
    sample_rate: float
    steps: int
    delta: float
    max_grad_norm: float
    weight_decay: float
    backend: str
    accountant: str


def make_optimizer(name: str, params, cfg: RunConfig, expected_batch_size: float):
    """The dpkern optimizer ``name`` (a key of :data:`OPTIMIZERS`) for ``cfg``; noise key =
    the run's seed (finetune's --noise-seed: reproducible and NOT private, so two
    optimizers at the same seed see the same noise draws). DP-MacAdam has no clipping
    bound to set (it adapts it)."""
    cls, _ = OPTIMIZERS[name]
    options = rules.by_cli_name(name).optimizer_options()
    kw = dict(
        lr=cfg.lr,
        noise_multiplier=cfg.noise_multiplier,
        expected_batch_size=expected_batch_size,
        seed=cfg.seed,
        backend=cfg.backend,
    )
    if "max_grad_norm" in options:  # not for whitening rules (DP-MacAdam)
        kw["max_grad_norm"] = cfg.max_grad_norm
    if name in DECOUPLED:
        kw["weight_decay"] = cfg.weight_decay
    return cls(params, **kw)


_TASK_CACHE: dict[str, Task] = {}


def _task(name: str) -> Task:
    if name not in _TASK_CACHE:
        _TASK_CACHE[name] = TASKS[name]()
    return _TASK_CACHE[name]


def train_one(cfg: RunConfig) -> dict:
    """Train one model privately and measure it.

    Returns a row of :data:`CSV_RUN_FIELDS` (val_metric, test_metric, epsilon_spent from a
    :class:`~dpkern.accounting.PrivacyAccountant` stepped once per optimizer step).
    Raises: RuntimeError when the accountant reports more than the target epsilon."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small models: several threads per run cost more than they give
    try:
        return _train_one(cfg)
    finally:
        torch.set_num_threads(threads)


def _train_one(cfg: RunConfig) -> dict:
    task = _task(cfg.task)
    t0, c0 = time.perf_counter(), time.process_time()
    model = task.make_model(cfg.seed)
    model.train()
    n = task.num_train
    opt = make_optimizer(
        cfg.optimizer, [p for p in model.parameters() if p.requires_grad], cfg, cfg.sample_rate * n
    )
    if hasattr(opt, "train"):  # schedule-free (SPEC 10.8): train at y, evaluate at x
        opt.train()
    accountant = PrivacyAccountant(cfg.accountant)
    sampler = PoissonBatchSampler(n, cfg.sample_rate, cfg.steps, seed=cfg.seed)
    for batch in sampler:
        ids = torch.tensor(batch, dtype=torch.long)
        compute_grad_sample(
            model, task.loss_fn, task.train[0][ids], *[t[ids] for t in task.train[1:]]
        )
        opt.step()
        opt.zero_grad()
        accountant.step(cfg.noise_multiplier, cfg.sample_rate)
    if hasattr(opt, "eval"):
        opt.eval()
    spent = accountant.get_epsilon(cfg.delta)
    if spent > cfg.epsilon:
        raise RuntimeError(
            f"{cfg.optimizer} seed {cfg.seed}: spent epsilon {spent:.4f} > target {cfg.epsilon}"
        )
    return dict(
        task=cfg.task,
        optimizer=cfg.optimizer,
        epsilon=cfg.epsilon,
        seed=cfg.seed,
        lr=cfg.lr,
        noise_multiplier=cfg.noise_multiplier,
        sample_rate=cfg.sample_rate,
        steps=cfg.steps,
        epsilon_spent=spent,
        delta=cfg.delta,
        val_metric=task.evaluate(model, "val"),
        test_metric=task.evaluate(model, "test"),
        seconds=time.perf_counter() - t0,
        cpu_seconds=time.process_time() - c0,
    )


# --------------------------------------------------------------------------------------
# Selection and reporting
# --------------------------------------------------------------------------------------
def select(rows: list[dict], higher_is_better: bool) -> list[dict]:
    """Per (optimizer, epsilon): the learning rate with the best mean ``val_metric`` over
    seeds (ties -> the smaller lr), and the ``test_metric`` mean and std (sample std,
    ddof=1; 0 for one seed) of the runs at that lr. The test metric plays no part in the
    choice. Returns rows of :data:`CSV_SUMMARY_FIELDS`, in input order of first appearance."""
    groups: dict[tuple, dict[float, list[dict]]] = {}
    for r in rows:
        groups.setdefault((r["optimizer"], r["epsilon"]), {}).setdefault(r["lr"], []).append(r)
    sign = 1.0 if higher_is_better else -1.0
    out = []
    for (name, eps), by_lr in groups.items():

        def score(lr):
            vals = [r["val_metric"] for r in by_lr[lr]]
            mean = statistics.fmean(vals)
            return (sign * mean if math.isfinite(mean) else -math.inf, -lr)

        lr = max(by_lr, key=score)
        runs = by_lr[lr]
        tests = [r["test_metric"] for r in runs]
        out.append(
            dict(
                task=runs[0]["task"],
                optimizer=name,
                epsilon=eps,
                lr=lr,
                seeds=len(runs),
                test_mean=statistics.fmean(tests),
                test_std=statistics.stdev(tests) if len(tests) > 1 else 0.0,
                val_mean=statistics.fmean(r["val_metric"] for r in runs),
                epsilon_spent_max=max(r["epsilon_spent"] for r in runs),
                noise_multiplier=runs[0]["noise_multiplier"],
                steps=runs[0]["steps"],
            )
        )
    return out


def _fmt_time(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _fmt_eps(eps: float) -> str:
    return f"{eps:g}"


def markdown_table(summary: list[dict], task: Task, delta: float, header: str = "") -> str:
    """The papers' table: one row per optimizer, one column per epsilon, cells
    ``mean ± std`` of the test metric over seeds (best mean per column in bold), then the
    chosen learning rates and the largest epsilon spent per cell."""
    names = list(dict.fromkeys(r["optimizer"] for r in summary))
    epss = sorted({r["epsilon"] for r in summary})
    cell = {(r["optimizer"], r["epsilon"]): r for r in summary}
    best = {}
    for e in epss:
        means = [cell[n, e]["test_mean"] for n in names if (n, e) in cell]
        best[e] = max(means) if task.higher_is_better else min(means)
    lines = [header] if header else []
    lines += [
        f"{task.metric}, mean ± std over seeds (lr chosen on the validation split)",
        "",
        "| optimizer | " + " | ".join(f"ε = {_fmt_eps(e)}" for e in epss) + " |",
        "|---|" + "---:|" * len(epss),
    ]
    for n in names:
        cells = []
        for e in epss:
            r = cell.get((n, e))
            if r is None:
                cells.append("")
                continue
            txt = f"{r['test_mean']:.2f} ± {r['test_std']:.2f}"
            cells.append(f"**{txt}**" if r["test_mean"] == best[e] else txt)
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", f"chosen learning rate / largest ε spent over seeds (δ = {delta:g})", ""]
    lines += [
        "| optimizer | " + " | ".join(f"ε = {_fmt_eps(e)}" for e in epss) + " |",
        "|---|" + "---:|" * len(epss),
    ]
    for n in names:
        cells = [
            f"{cell[n, e]['lr']:g} / {cell[n, e]['epsilon_spent_max']:.3f}"
            if (n, e) in cell
            else ""
            for e in epss
        ]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], task: Task, path: Path) -> None:
    """metric vs epsilon per optimizer (mean with ± std error bars) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for n in dict.fromkeys(r["optimizer"] for r in summary):
        pts = sorted(
            (r["epsilon"], r["test_mean"], r["test_std"]) for r in summary if r["optimizer"] == n
        )
        ax.errorbar(
            [p[0] for p in pts],
            [p[1] for p in pts],
            yerr=[p[2] for p in pts],
            marker="o",
            capsize=3,
            label=n,
        )
    ax.set_xlabel("ε (target, δ fixed)")
    ax.set_ylabel(task.metric)
    ax.set_title(f"dpkern compare --task {task.name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_csv(path: Path, rows, fields) -> list[dict]:
    """Write ``rows`` (any iterable of dicts) to ``path`` as CSV with columns ``fields``,
    flushing each row as it comes (a long run keeps what it finished); returns the rows."""
    done = []
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(fields), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
            fh.flush()
            done.append(r)
    return done


def _results(configs: list[RunConfig], jobs: int):
    """train_one over ``configs``, in order, in ``jobs`` worker processes (1 = in-process)."""
    if jobs > 1:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            yield from pool.map(train_one, configs)
    else:
        for cfg in configs:
            yield train_one(cfg)


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------
def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _unit_interval(text: str) -> float:
    value = _positive_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}")
    return value


def _optimizer_name(text: str) -> str:
    if text != "all" and text not in OPTIMIZERS:
        raise argparse.ArgumentTypeError(
            f"unknown optimizer {text!r}: expected 'all' or one of {', '.join(OPTIMIZERS)}"
        )
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``dpkern compare`` (see the module docstring)."""
    parser.add_argument("--task", choices=sorted(TASKS), default="digits")
    parser.add_argument(
        "--epsilons",
        type=_positive_float,
        nargs="+",
        default=[1.0, 3.0, 7.0],
        metavar="EPS",
        help="target epsilons (default: 1 3 7)",
    )
    parser.add_argument(
        "--seeds",
        type=_positive_int,
        default=3,
        help="seeds per cell, 0..N-1; a seed fixes the init, the sampling "
        "AND the noise key (not private, see above) (default: 3)",
    )
    parser.add_argument(
        "--optimizers",
        type=_optimizer_name,
        nargs="+",
        default=["all"],
        metavar="NAME",
        help=f"'all' or some of: {', '.join(OPTIMIZERS)}",
    )
    parser.add_argument(
        "--lrs",
        type=_positive_float,
        nargs="+",
        default=None,
        metavar="LR",
        help="one learning-rate grid for every optimizer (default: a "
        "grid per optimizer, see OPTIMIZERS in dpkern/cli/compare.py)",
    )
    parser.add_argument(
        "--epochs",
        type=_positive_float,
        default=None,
        help="expected passes over the training set (default: 15 for digits, 1 for text)",
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=64,
        help="expected (Poisson) batch size (default: 64)",
    )
    parser.add_argument("--delta", type=_unit_interval, default=1e-5)
    parser.add_argument(
        "--max-grad-norm",
        type=_positive_float,
        default=1.0,
        help="clipping bound C (not used by "
        + ", ".join(s.title for s in rules.RULES.values() if s.whitening)
        + "; default: 1)",
    )
    parser.add_argument(
        "--weight-decay",
        type=float,
        default=1e-2,
        help="decoupled weight decay of "
        + ", ".join(s.title for s in rules.RULES.values() if s.decoupled_decay)
        + " (default: 0.01, torch.optim.AdamW's)",
    )
    parser.add_argument("--accountant", choices=ACCOUNTANTS, default="rdp")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument(
        "--jobs",
        type=_positive_int,
        default=os.cpu_count() or 1,
        help="training runs in parallel, one CPU thread each (default: the number of CPUs)",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("compare_results"),
        help="where runs.csv, summary.csv, table.md and plot.png go (default ./compare_results)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test in seconds: first epsilon, one seed, two optimizers, "
        "one learning rate, one epoch",
    )


def plan(args: argparse.Namespace, task: Task) -> list[RunConfig]:
    """All training runs of ``args`` (the grid, with sigma calibrated per epsilon).

    Raises: ValueError when no noise multiplier reaches an epsilon (see
    :func:`dpkern.accounting.get_noise_multiplier`)."""
    names = list(OPTIMIZERS) if "all" in args.optimizers else list(dict.fromkeys(args.optimizers))
    epsilons, seeds = list(dict.fromkeys(args.epsilons)), range(args.seeds)
    epochs = args.epochs or task.epochs
    if args.quick:
        epsilons, seeds, epochs = epsilons[:1], range(1), args.epochs or task.quick_epochs
        if len(names) > 2:
            names = [n for n in names if n in QUICK_OPTIMIZERS] or names[:2]
    q = min(1.0, args.batch_size / task.num_train)
    steps = max(1, round(epochs / q))
    out = []
    for eps in epsilons:
        sigma = get_noise_multiplier(eps, args.delta, q, steps, args.accountant)
        for name in names:
            grid = args.lrs or OPTIMIZERS[name][1]
            if args.quick:
                grid = [grid[len(grid) // 2]]
            for lr in grid:
                for seed in seeds:
                    out.append(
                        RunConfig(
                            args.task,
                            name,
                            eps,
                            seed,
                            lr,
                            sigma,
                            q,
                            steps,
                            args.delta,
                            args.max_grad_norm,
                            args.weight_decay,
                            args.backend,
                            args.accountant,
                        )
                    )
    return out


def _num(x: float) -> str:
    """``x`` as short as it reads back exactly."""
    short = f"{x:g}"
    return short if float(short) == x else repr(float(x))


def command_line(args: argparse.Namespace, task: Task, configs: list[RunConfig]) -> str:
    """The ``dpkern compare`` command that runs exactly ``configs`` (the plan of ``args``):
    the epsilons, seeds and optimizers that ran (with --quick: its subset) and every other
    option that changes a result, each value printed so that it reads back exactly."""
    parts = [
        "dpkern",
        "compare",
        "--task",
        args.task,
        "--epsilons",
        *(_num(e) for e in dict.fromkeys(c.epsilon for c in configs)),
        "--seeds",
        str(len({c.seed for c in configs})),
        "--optimizers",
        *dict.fromkeys(c.optimizer for c in configs),
    ]
    if args.epochs is not None or not args.quick:  # (--quick alone: the task's quick epochs)
        parts += ["--epochs", _num(args.epochs or task.epochs)]
    parts += [
        "--batch-size",
        str(args.batch_size),
        "--delta",
        _num(args.delta),
        "--max-grad-norm",
        _num(args.max_grad_norm),
        "--weight-decay",
        _num(args.weight_decay),
    ]
    if args.lrs:
        parts += ["--lrs", *(_num(lr) for lr in args.lrs)]
    parts += ["--accountant", args.accountant, "--backend", args.backend]
    if args.quick:  # (picks the middle of each learning-rate grid)
        parts.append("--quick")
    return " ".join(shlex.quote(p) for p in parts)


def run(args: argparse.Namespace) -> int:
    """Run the comparison; write runs.csv, summary.csv, table.md and plot.png into
    ``args.out_dir`` and print the table. Returns 0, or 2 with a one-line error."""
    from tqdm import tqdm

    try:
        task = _task(args.task)
        configs = plan(args, task)
    except (RuntimeError, ValueError) as exc:
        print(f"dpkern compare: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # scikit-learn (digits) or transformers (text) missing
        print(
            f"dpkern compare: error: --task {args.task} needs {exc.name}: "
            "pip install 'dpkern[compare]'",
            file=sys.stderr,
        )
        return 2
    if args.delta >= 1.0 / task.num_train:
        print(
            f"dpkern compare: warning: --delta {args.delta:g} is not well below 1/N = "
            f"{1.0 / task.num_train:.3g} (N = {task.num_train:,} training examples): such "
            "a delta allows leaking whole examples",
            file=sys.stderr,
        )
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = 1 if args.quick else min(args.jobs, len(configs))  # in-process: starts at once
    t0 = time.perf_counter()
    rows = write_csv(
        out / "runs.csv",
        tqdm(
            _results(configs, jobs),
            total=len(configs),
            unit="run",
            desc=f"compare {args.task}",
            file=sys.stderr,
        ),
        CSV_RUN_FIELDS,
    )
    wall = time.perf_counter() - t0
    summary = select(rows, task.higher_is_better)
    write_csv(out / "summary.csv", summary, CSV_SUMMARY_FIELDS)
    cfg0 = configs[0]
    cpu = sum(r["cpu_seconds"] for r in rows)
    header = (
        f"`{command_line(args, task, configs)}`\n\n{len(rows)} runs in "
        f"{_fmt_time(wall)} wall ({_fmt_time(cpu)} CPU, {jobs} job(s)), "
        f"{len({c.seed for c in configs})} seed(s), {cfg0.steps} steps at sample "
        f"rate {cfg0.sample_rate:.4g} (expected batch {cfg0.sample_rate * task.num_train:.0f}"
        f" of {task.num_train}), δ = {args.delta:g}, {args.accountant.upper()} "
        f"accountant\n\nPrivacy: {NOISE_NOTE}.\n"
    )
    table = markdown_table(summary, task, args.delta, header)
    (out / "table.md").write_text(table)
    written = [out / "runs.csv", out / "summary.csv", out / "table.md"]
    try:
        plot(summary, task, out / "plot.png")
        written.append(out / "plot.png")
    except ImportError:
        print(
            "dpkern compare: note: matplotlib is not installed: no plot "
            "(pip install 'dpkern[compare]')",
            file=sys.stderr,
        )
    print(table)
    print("wrote " + ", ".join(map(str, written)))
    return 0
