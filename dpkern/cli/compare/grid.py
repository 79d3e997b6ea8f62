"""The grid of ``dpkern compare``: every training run of the options (sigma calibrated per
epsilon), and the command line that reruns exactly that grid."""

from __future__ import annotations

import argparse
import shlex

from ...accounting import get_noise_multiplier
from .tasks import Task
from .training import OPTIMIZERS, RunConfig

QUICK_OPTIMIZERS = ("dp-sgd", "dp-adamw")


def plan(args: argparse.Namespace, task: Task) -> list[RunConfig]:
    """All training runs of ``args`` (the grid, with sigma calibrated per epsilon).

    Raises: ValueError when no noise multiplier reaches an epsilon (see
    :func:`dpkern.accounting.get_noise_multiplier`)."""
    names = list(OPTIMIZERS) if "all" in args.optimizers else list(dict.fromkeys(args.optimizers))
    first = getattr(args, "first_seed", 0)
    epsilons, seeds = list(dict.fromkeys(args.epsilons)), range(first, first + args.seeds)
    epochs = args.epochs or task.epochs
    if args.quick:
        epsilons, seeds, epochs = (
            epsilons[:1],
            range(first, first + 1),
            args.epochs or task.quick_epochs,
        )
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
    first = min((c.seed for c in configs), default=0)
    parts = [
        "dpkern",
        "compare",
        "--task",
        args.task,
        "--epsilons",
        *(_num(e) for e in dict.fromkeys(c.epsilon for c in configs)),
        "--seeds",
        str(len({c.seed for c in configs})),
        *(["--first-seed", str(first)] if first else []),
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
