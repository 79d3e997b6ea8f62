"""The options of ``dpkern compare`` (argparse, each value checked as it is parsed)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from ... import rules
from ...accounting import ACCOUNTANTS
from ...backends import BACKENDS
from .tasks import EPOCHS, TASKS
from .training import OPTIMIZERS


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


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
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
    parser.add_argument(
        "--task",
        choices=sorted(TASKS),
        default="digits",
        help="the benchmark, see above (default: digits)",
    )
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
        metavar="N",
        help="N seeds per cell: --first-seed .. --first-seed+N-1; a seed fixes the init, "
        "the sampling AND the noise key (not private, see above) (default: 3)",
    )
    parser.add_argument(
        "--first-seed",
        type=_nonnegative_int,
        default=0,
        help="the first seed (default 0): --first-seed 1 --seeds 2 runs seeds 1 and 2, "
        "to add to earlier runs with --from-runs",
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
        "grid per optimizer, see OPTIMIZERS in dpkern/cli/compare/training.py)",
    )
    parser.add_argument(
        "--epochs",
        type=_positive_float,
        default=None,
        help="expected passes over the training set (default: "
        + ", ".join(f"{e:g} for {name}" for name, (e, _) in EPOCHS.items())
        + ")",
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=64,
        help="expected (Poisson) batch size (default: 64)",
    )
    parser.add_argument(
        "--delta",
        type=_unit_interval,
        default=1e-5,
        help="the delta of (epsilon, delta)-DP, in (0, 1), well below 1/N (default: 1e-5)",
    )
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
    parser.add_argument(
        "--accountant",
        choices=ACCOUNTANTS,
        default="rdp",
        help="the accountant that calibrates sigma and reports epsilon spent (default: rdp)",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="the optimizers' kernels (default: auto)",
    )
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
        help="where runs.csv, summary.csv, table.md, plot.png and lr_sensitivity.png go "
        "(default: ./compare_results)",
    )
    parser.add_argument(
        "--from-runs",
        nargs="+",
        type=Path,
        metavar="CSV",
        help="train nothing: rebuild summary.csv, table.md and the plots in --out-dir from "
        "the runs.csv of earlier runs (several files are concatenated, e.g. runs of "
        "different optimizers with the same settings); the other options are ignored "
        "(a warning names those given)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test in seconds: first epsilon, one seed, two optimizers, one learning "
        "rate (the middle of each grid), and the task's short run unless --epochs is given: "
        + ", ".join(f"{name} {q:g} epoch" for name, (_, q) in EPOCHS.items())
        + " (a few steps)",
    )


def ignored_by_from_runs(args: argparse.Namespace) -> list[str]:
    """The options of ``args`` that --from-runs ignores and that were given (a value other
    than the default), e.g. ``["--epsilons", "--quick"]``; --out-dir is used, not listed."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return [
        "--" + dest.replace("_", "-")
        for dest, default in vars(parser.parse_args([])).items()
        if dest not in ("from_runs", "out_dir") and getattr(args, dest, default) != default
    ]
