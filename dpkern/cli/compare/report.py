"""The outputs of ``dpkern compare``: the learning rate chosen per cell on the validation
split, the CSV files, the markdown table and the plot."""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

from .tasks import Task

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


_INT_FIELDS = ("seed", "steps")
_STR_FIELDS = ("task", "optimizer")


def read_runs(paths) -> list[dict]:
    """The rows of earlier ``runs.csv`` files (:data:`CSV_RUN_FIELDS`), concatenated, with
    numbers parsed. Raises ValueError (a missing file or column, more than one task or
    delta, or the same optimizer / epsilon / seed / lr in two rows)."""
    rows, seen = [], {}
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"--from-runs: {path}: no such file")
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            missing = [f for f in CSV_RUN_FIELDS if f not in (reader.fieldnames or ())]
            if missing:
                raise ValueError(f"--from-runs: {path}: not a runs.csv (no {', '.join(missing)})")
            for line, raw in enumerate(reader, start=2):
                r = {}
                for f in CSV_RUN_FIELDS:
                    v = raw[f]
                    r[f] = v if f in _STR_FIELDS else int(v) if f in _INT_FIELDS else float(v)
                key = (r["optimizer"], r["epsilon"], r["seed"], r["lr"])
                if key in seen:
                    raise ValueError(
                        f"--from-runs: {path}:{line}: optimizer {key[0]}, epsilon {key[1]:g}, "
                        f"seed {key[2]}, lr {key[3]:g} is also in {seen[key]}"
                    )
                seen[key] = f"{path}:{line}"
                rows.append(r)
    if not rows:
        raise ValueError("--from-runs: no runs in " + ", ".join(map(str, paths)))
    for field in ("task", "delta"):
        values = sorted({r[field] for r in rows}, key=str)
        if len(values) > 1:
            raise ValueError(f"--from-runs: the runs mix {field}s {values}: one report each")
    return rows


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


def _eps_table(names, epss, text) -> list[str]:
    """A markdown table, one row per optimizer and one column per epsilon; ``text(n, e)``
    gives a cell (None: empty)."""
    lines = [
        "| optimizer | " + " | ".join(f"ε = {_fmt_eps(e)}" for e in epss) + " |",
        "|---|" + "---:|" * len(epss),
    ]
    for n in names:
        cells = [text(n, e) or "" for e in epss]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


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

    def metric(n, e):
        r = cell.get((n, e))
        if r is None:
            return None
        txt = (  # one seed has no spread: say so rather than print ± 0.00
            f"{r['test_mean']:.2f} ± {r['test_std']:.2f}"
            if r["seeds"] > 1
            else f"{r['test_mean']:.2f} (1 seed)"
        )
        return f"**{txt}**" if r["test_mean"] == best[e] else txt

    def chosen(n, e):
        r = cell.get((n, e))
        return None if r is None else f"{r['lr']:g} / {r['epsilon_spent_max']:.3f}"

    lines = [header] if header else []
    lines += [f"{task.metric}, mean ± std over seeds (lr chosen on the validation split)", ""]
    lines += _eps_table(names, epss, metric)
    lines += ["", f"chosen learning rate / largest ε spent over seeds (δ = {delta:g})", ""]
    lines += _eps_table(names, epss, chosen)
    return "\n".join(lines) + "\n"


def _pyplot():
    """matplotlib.pyplot on the Agg backend, its font-manager chatter (the font cache
    built on first use, findfont fallbacks) kept off the user's terminal."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(summary: list[dict], task: Task, path: Path) -> None:
    """metric vs epsilon per optimizer (mean with ± std error bars) as a PNG."""
    plt = _pyplot()

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


def sensitivity(rows: list[dict], higher_is_better: bool) -> list[dict]:
    """Learning-rate sensitivity per (optimizer, epsilon), on the VALIDATION metric (the
    test split plays no part): for every lr of the grid the mean over seeds, and
    ``spread`` = best - worst of those means (in the metric's units, >= 0: how much a
    wrong choice within the grid costs; the grids span x30). Rows: optimizer, epsilon,
    lr_best, spread, points (sorted [(lr, mean), ...]), in input order."""
    groups: dict[tuple, dict[float, list[float]]] = {}
    for r in rows:
        key = (r["optimizer"], r["epsilon"])
        groups.setdefault(key, {}).setdefault(r["lr"], []).append(r["val_metric"])
    out = []
    for (name, eps), by_lr in groups.items():
        pts = sorted((lr, statistics.fmean(v)) for lr, v in by_lr.items())
        finite = [m for _, m in pts if math.isfinite(m)]
        pick = max if higher_is_better else min
        best = pick(finite) if finite else math.nan
        worst = (min if higher_is_better else max)(finite) if finite else math.nan
        if len(finite) < len(pts):  # a diverged lr is the worst outcome there is
            worst = -math.inf if higher_is_better else math.inf
        lr_best = next((lr for lr, m in pts if m == best), math.nan)
        out.append(
            dict(
                optimizer=name,
                epsilon=eps,
                lr_best=lr_best,
                spread=abs(best - worst),
                points=pts,
            )
        )
    return out


def sensitivity_table(sens: list[dict], task: Task) -> str:
    """Markdown: per optimizer and epsilon, best - worst validation mean over its grid
    (the lr ratio the grid spans in the header)."""
    names = list(dict.fromkeys(r["optimizer"] for r in sens))
    epss = sorted({r["epsilon"] for r in sens})
    cell = {(r["optimizer"], r["epsilon"]): r for r in sens}
    spans = [r["points"][-1][0] / r["points"][0][0] for r in sens if len(r["points"]) > 1]
    span = (
        f"a x{min(spans):.0f}-x{max(spans):.0f} range of lr"
        if spans
        else "one lr per optimizer: nothing measured, 0 by construction"
    )
    metric = task.metric.removeprefix("test ")
    lines = [
        f"learning-rate sensitivity: best - worst mean over seeds of the {metric} on the "
        f"validation split across each optimizer's grid ({span}); smaller is flatter",
        "",
    ]

    def edge(r):  # the best lr at the smallest / largest of the grid
        lrs = [lr for lr, _ in r["points"]]
        if len(lrs) > 1 and r["lr_best"] == lrs[0]:
            return " ↓"
        return " ↑" if len(lrs) > 1 and r["lr_best"] == lrs[-1] else ""

    def spread(n, e):
        r = cell.get((n, e))
        if r is None:
            return None
        x = r["spread"]  # a run that diverged to a huge perplexity: its order of magnitude
        return (f"{x:.2f}" if not math.isfinite(x) or x < 1e4 else f"{x:.1e}") + edge(r)

    lines += _eps_table(names, epss, spread)
    edges = sum(bool(edge(r)) for r in sens)
    if edges:
        lines += [
            "",
            f"↓ / ↑: the best lr is the smallest / largest of the grid ({edges} cell(s)): "
            "the grid may not bracket that optimizer's best lr there",
        ]
    return "\n".join(lines) + "\n"


def plot_sensitivity(sens: list[dict], task: Task, path: Path) -> None:
    """Validation metric vs lr / (the cell's best lr), log x, one panel per epsilon, one
    line per optimizer, as a PNG."""
    plt = _pyplot()

    epss = sorted({r["epsilon"] for r in sens})
    fig, axes = plt.subplots(
        1, len(epss), figsize=(4.2 * len(epss), 4), dpi=120, sharey=True, squeeze=False
    )
    for ax, eps in zip(axes[0], epss):
        for r in (r for r in sens if r["epsilon"] == eps):
            xs = [lr / r["lr_best"] for lr, _ in r["points"]]
            ax.plot(xs, [m for _, m in r["points"]], marker="o", ms=3, label=r["optimizer"])
        ax.set_xscale("log")
        ax.set_xlabel("lr / best lr of the grid")
        ax.set_title(f"ε = {_fmt_eps(eps)}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"validation {task.metric.removeprefix('test ')}")
    axes[0][-1].legend(fontsize=6, ncol=2)
    fig.suptitle(f"dpkern compare --task {task.name}: learning-rate sensitivity")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
