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
summary.csv (one row per optimizer x epsilon), table.md (mean +- std over seeds, then the
learning-rate sensitivity: best - worst validation mean across each grid), plot.png
(metric vs epsilon per optimizer) and lr_sensitivity.png (validation metric vs lr / best
lr, one panel per epsilon).

Privacy note: epsilon is that of ONE training run. Choosing the learning rate among
several runs on the same private data spends more (Papernot & Steinke, ICLR 2022); like
the papers being reproduced, this tool does not account for it. And each run's noise key
is its seed (finetune's --noise-seed semantics, so that the optimizers at one seed see the
same noise draws): the runs are not private (the noise key is known), and the epsilons
are those the runs would spend with a secret key. The output says so.

Optimizer names are finetune's, the command-line names of the rule registry
(:mod:`dpkern.rules`): dp-sgd, dp-adam, dp-adambc, dp-adamw, dp-adamw-bc, dp-macadam and
the families of SPEC section 10 (dp-rmsprop, dp-adagrad, dp-radam, dp-lion, ...); each
rule's learning-rate grid is its ``RuleSpec.lr_grid``. NAME+bc (dp-rmsprop+bc, ...) runs a
family with noise_bias_correction=True, on its grid divided by 30. The command echoed at the
top of table.md is the one that ran (rerunning it runs the same grid); after --from-runs the
first line is the rebuild command (the runs.csv files hold each run's settings).

Example:  dpkern compare --task digits --epsilons 1 3 7 --seeds 3 --optimizers all
"""


# Layout: tasks.py (the benchmarks), training.py (one training run, the optimizers),
# grid.py (the runs of the options, the command line), report.py (selection, CSV, table,
# plot), options.py (argparse); run() below is the command.

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .grid import QUICK_OPTIMIZERS, command_line, plan
from .options import add_arguments, ignored_by_from_runs
from .report import (
    CSV_RUN_FIELDS,
    CSV_SUMMARY_FIELDS,
    NOISE_NOTE,
    _fmt_time,
    markdown_table,
    plot,
    plot_sensitivity,
    read_runs,
    sensitivity,
    sensitivity_table,
    select,
    write_csv,
)
from .tasks import (
    TASKS,
    TEXT_BLOCK_SIZE,
    TEXT_VAL_FRACTION,
    DigitsCNN,
    MissingExtra,
    Task,
    _task,
    digits_splits,
    digits_task,
    text_task,
)
from .training import DECOUPLED, OPTIMIZERS, RunConfig, _results, make_optimizer, train_one

__all__ = [
    "OPTIMIZERS",
    "DECOUPLED",
    "QUICK_OPTIMIZERS",
    "NOISE_NOTE",
    "CSV_RUN_FIELDS",
    "CSV_SUMMARY_FIELDS",
    "Task",
    "DigitsCNN",
    "digits_splits",
    "digits_task",
    "TEXT_BLOCK_SIZE",
    "TEXT_VAL_FRACTION",
    "text_task",
    "TASKS",
    "RunConfig",
    "make_optimizer",
    "train_one",
    "select",
    "markdown_table",
    "plot",
    "plot_sensitivity",
    "read_runs",
    "sensitivity",
    "sensitivity_table",
    "write_csv",
    "add_arguments",
    "plan",
    "command_line",
    "run",
]


def run(args: argparse.Namespace) -> int:
    """Run the comparison; write runs.csv, summary.csv, table.md and the plots into
    ``args.out_dir`` and print the table. Returns 0, or 2 with a one-line error."""
    from tqdm import tqdm

    if getattr(args, "from_runs", None):
        return _rebuild(args)
    try:
        task = _task(args.task)
        configs = plan(args, task)
    except (RuntimeError, ValueError) as exc:
        print(f"dpkern compare: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # scikit-learn (digits) or transformers (text) missing
        msg = exc if isinstance(exc, MissingExtra) else f"--task {args.task} needs {exc.name}"
        print(f"dpkern compare: error: {msg}", file=sys.stderr)
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
    _report(out, rows, summary, task, args.delta, header, [out / "runs.csv", out / "summary.csv"])
    return 0


def _report(out: Path, rows, summary, task, delta, header, written) -> None:
    """table.md (the results, then the lr sensitivity) and the plots; print the table."""
    sens = sensitivity(rows, task.higher_is_better)
    table = markdown_table(summary, task, delta, header)
    table += "\n" + sensitivity_table(sens, task)
    (out / "table.md").write_text(table)
    written.append(out / "table.md")
    try:
        plot(summary, task, out / "plot.png")
        written.append(out / "plot.png")
        plot_sensitivity(sens, task, out / "lr_sensitivity.png")
        written.append(out / "lr_sensitivity.png")
    except ImportError:
        print(
            "dpkern compare: note: matplotlib is not installed: no plot "
            "(pip install 'dpkern[compare]')",
            file=sys.stderr,
        )
    print(table)
    print("wrote " + ", ".join(map(str, written)))


def _rebuild(args) -> int:
    """``--from-runs``: the report of earlier runs, nothing trained."""
    ignored = ignored_by_from_runs(args)
    if ignored:
        print(
            f"dpkern compare: warning: --from-runs ignores {', '.join(ignored)} (the runs.csv "
            "files hold each run's settings)",
            file=sys.stderr,
        )
    try:
        rows = read_runs(args.from_runs)
        task = _task(rows[0]["task"], training=False)  # (transformers not needed to report)
    except (ValueError, KeyError) as exc:
        print(f"dpkern compare: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(
            f"dpkern compare: error: the {rows[0]['task']} task needs {exc.name}: "
            "pip install 'dpkern[compare]'",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = select(rows, task.higher_is_better)
    write_csv(out / "summary.csv", summary, CSV_SUMMARY_FIELDS)
    delta = rows[0]["delta"]
    cpu = sum(r["cpu_seconds"] for r in rows)
    files = " ".join(str(p) for p in args.from_runs)
    setting = sorted({(r["steps"], r["sample_rate"]) for r in rows})
    steps = ", ".join(f"{s} steps at sample rate {q:.4g}" for s, q in setting)
    header = (
        f"`dpkern compare --from-runs {files} --out-dir {out}`\n\n{len(rows)} runs rebuilt from "
        f"{len(args.from_runs)} file(s) ({_fmt_time(cpu)} CPU in all), "
        f"{len({r['seed'] for r in rows})} seed(s), {steps}, δ = {delta:g}\n\n"
        f"Privacy: {NOISE_NOTE}.\n"
    )
    _report(out, rows, summary, task, delta, header, [out / "summary.csv"])
    return 0
