"""The rows and tables of :mod:`bench.report`: one summary row per dpkern backend of a case
(medians, ratios against the baselines and the floor, the bandwidth floor), the speed
targets checked against them, the markdown of docs/BENCHMARKS.md and the plot."""

from __future__ import annotations

from pathlib import Path

from . import MI, format_size
from .harness import PATHS, bytes_floor, steal_note
from .report_cases import TARGETS, Case


def summarize(
    case: Case,
    d_actual: int,
    n_tensors: int,
    medians: dict[str, float],
    peaks: dict[str, int | None],
    bandwidth: float,
) -> list[dict]:
    """One row per dpkern backend of a case: medians (seconds), ratios baseline/dpkern
    and AdamW-alone/dpkern, and the bandwidth floor (seconds) for the bytes that must move."""
    floor_s = bytes_floor(case.path, d_actual, case.batch) / bandwidth
    rows = []
    for name, t in medians.items():
        role, variant = name.split(":")
        if role != "dpkern":
            continue
        row = dict(
            path=case.path,
            layout=case.layout,
            d=d_actual,
            tensors=n_tensors,
            batch=case.batch,
            backend=variant,
            dpkern_s=t,
            bw_floor_s=floor_s,
            bw_fraction=floor_s / t,
            dpkern_peak_bytes=peaks.get(name),
        )
        for v in ("foreach", "fused"):
            for role2, key in (("baseline", "baseline"), ("floor", "adamw")):
                other = medians.get(f"{role2}:{v}")
                row[f"{key}_{v}_s"] = other
                row[f"{key}_{v}_ratio"] = other / t if other else None
            row[f"baseline_{v}_peak_bytes"] = peaks.get(f"baseline:{v}")
        rows.append(row)
    return rows


def check_targets(summary: list[dict], fused_backends: list[str]) -> list[dict]:
    """Issue 4's speed targets as rows: measured ratio (baseline foreach / dpkern) per
    fused backend, or why there is none."""
    out = []
    names = fused_backends or ["cpp"]
    for tg in TARGETS:
        for be in names:
            row = dict(
                target=tg["name"],
                backend=be,
                layout=tg["layout"],
                d=tg["d"],
                batch=tg["batch"],
                required=tg["required"],
                measured=None,
                met=None,
                note="",
            )
            if be not in fused_backends:
                row["note"] = f"backend {be!r} not available (not built / not importable)"
            else:
                hits = [
                    r
                    for r in summary
                    if r["backend"] == be
                    and r["path"] == tg["path"]
                    and r["layout"] == tg["layout"]
                    and r["batch"] == tg["batch"]
                    and tg["d"] - 4 * 1024 <= r["d"] <= tg["d"]
                ]  # gpt2: d minus < h
                if not hits:
                    row["note"] = "case not in this run's grid"
                elif hits[0]["baseline_foreach_ratio"] is None:
                    row["note"] = "baseline skipped (memory)"
                else:
                    row["measured"] = hits[0]["baseline_foreach_ratio"]
                    row["met"] = row["measured"] >= tg["required"]
            out.append(row)
    return out


def _ms(s):
    return "–" if s is None else (f"{s * 1e3:.3g}" if s * 1e3 < 100 else f"{s * 1e3:.0f}")


def _x(r):
    return "–" if r is None else f"{r:.2f}×"


def _mib(b):
    if b is None:
        return "–"
    return f"{b / MI:.0f}" if b >= 10 * MI else f"{b / MI:.1f}"


BASELINE_NAMES = {
    "noise": "torch.randn",
    "summed": "normal+add+div+AdamW",
    "per_sample": "Opacus DPOptimizer+AdamW",
}


def markdown_table(summary: list[dict]) -> str:
    """The docs/BENCHMARKS.md table: medians in ms, speed-up = baseline / dpkern (> 1: dpkern faster)."""
    head = (
        "| path | layout | d | B | backend | dpkern ms | baseline | foreach ms | "
        "speed-up | fused ms | speed-up | AdamW alone ms (foreach/fused) | bw floor ms "
        "| peak extra MiB (dpkern / foreach / fused) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in summary:
        tensors = "1 tensor" if r["layout"] == "tensor" else f"GPT-2-like, {r['tensors']} t."
        lines.append(
            f"| {r['path']} | {tensors} | {format_size(r['d'])} | {r['batch'] or '–'} | "
            f"{r['backend']} | {_ms(r['dpkern_s'])} | {BASELINE_NAMES[r['path']]} | "
            f"{_ms(r['baseline_foreach_s'])} | {_x(r['baseline_foreach_ratio'])} | "
            f"{_ms(r['baseline_fused_s'])} | {_x(r['baseline_fused_ratio'])} | "
            f"{_ms(r['adamw_foreach_s'])} / {_ms(r['adamw_fused_s'])} | "
            f"{_ms(r['bw_floor_s'])} | {_mib(r['dpkern_peak_bytes'])} / "
            f"{_mib(r['baseline_foreach_peak_bytes'])} / "
            f"{_mib(r['baseline_fused_peak_bytes'])} |"
        )
    return "\n".join(lines)


def markdown_targets(targets: list[dict]) -> str:
    lines = [
        "| target | backend | case | required | measured | met |",
        "|---|---|---|---|---|---|",
    ]
    for t in targets:
        case = f"d={format_size(t['d'])}" + (f", B={t['batch']}" if t["batch"] else "")
        case += ", GPT-2-like" if t["layout"] == "gpt2" else ", 1 tensor"
        measured = _x(t["measured"]) if t["measured"] is not None else t["note"]
        met = "–" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(
            f"| {t['target']} | {t['backend']} | {case} | ≥ {t['required']}× | {measured} | {met} |"
        )
    return "\n".join(lines)


def render_markdown(results: dict) -> str:
    """The docs/BENCHMARKS.md block of a run (``results.json`` contents): how it was measured, the
    table and the speed targets."""
    info, bw, cfg = results["machine"], results["bandwidth"], results["config"]
    ghost_md = ""
    if results.get("ghost"):  # python -m bench.report --ghost
        from .ghost import markdown as ghost_markdown

        ghost_md = "\n\n" + ghost_markdown(results["ghost"])
    return (
        f"Command: `{results['command']}` — {info['cpu']}, {info['cores']} cores, "
        f"{info['torch_threads']} thread(s), torch {info['torch']}, dpkern "
        f"{info['dpkern']} ({info['git_commit']}), {info['date']}; load average "
        f"{info['loadavg'][0]:.1f} -> {info.get('loadavg_end', float('nan')):.1f}; "
        f"{steal_note(info.get('cpu_steal'))}; "
        f"copy bandwidth {bw['bytes_per_s'] / 1e9:.1f} GB/s; medians of "
        f"{cfg['repeats']} alternating repeats; speed-up = baseline / dpkern.\n\n"
        + markdown_table(results["summary"])
        + "\n\n"
        + markdown_targets(results["targets"])
        + ghost_md
    )


def plot(timings: list[dict], bandwidth: float, path: Path) -> None:
    """Time vs d per path (log-log): one panel per path (per-sample at the largest B), a
    colour per candidate, solid for one tensor and dashed for the GPT-2-like layout, and
    the bandwidth floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [p for p in PATHS if any(t["path"] == p for t in timings)]
    if not paths:
        return
    fig, axes = plt.subplots(1, len(paths), figsize=(5 * len(paths), 4), squeeze=False)
    for ax, p in zip(axes[0], paths):
        rows = [t for t in timings if t["path"] == p]
        bmax = max(t["batch"] for t in rows)
        rows = [t for t in rows if t["batch"] == bmax]
        cands = sorted({t["candidate"] for t in rows})
        for cand, lay in sorted({(t["candidate"], t["layout"]) for t in rows}):
            pts = sorted(
                (t["d"], t["median_s"] * 1e3)
                for t in rows
                if t["candidate"] == cand and t["layout"] == lay
            )
            ax.plot(
                *zip(*pts),
                "o-" if lay == "tensor" else "s--",
                markersize=4,
                color=f"C{cands.index(cand)}",
                label=f"{cand} ({lay})",
            )
        ds = sorted({t["d"] for t in rows})
        ax.plot(
            ds,
            [bytes_floor(p, d, bmax) / bandwidth * 1e3 for d in ds],
            "k:",
            label="bandwidth floor",
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("d (coordinates)")
        ax.set_ylabel("median ms per call")
        ax.set_title(p + (f" (B={bmax})" if bmax else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
