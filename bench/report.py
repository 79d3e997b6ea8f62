"""Side-by-side report: each dpkern path against the baselines users would otherwise run.

    python -m bench.report                 # default grid, < 10 minutes on a 2-core CPU
    python -m bench.report --full          # d up to 64M, B up to 32 (minutes to hours)
    python -m bench.report --device cuda   # triton + reference on a GPU

Measured in one process, per case (path x layout x d x B), alternating the candidates
(the order rotates every repeat, so drift hits all of them alike), reporting medians:

- per-sample path: ``dpkern.DPAdamW.step()`` on ``p.grad_sample`` vs Opacus' own
  ``DPOptimizer`` wrapping ``torch.optim.AdamW`` (foreach, and fused where the device has
  it) on the same grad_samples, sigma, C, B;
- summed path: ``dpkern.functional.dp_adamw(summed_grads=...)`` vs
  ``p.grad.add_(torch.normal(0, sigma C)).div_(B)`` + ``torch.optim.AdamW(...).step()``;
- noise: ``dpkern.functional.gaussian_noise`` vs ``torch.randn`` of the same size;
- the non-private floor: ``torch.optim.AdamW.step()`` alone on the same parameters;
- the memory-bandwidth floor: bytes that must move (SPEC: 2 B d sizeof(grad) + 24 d for
  the per-sample path, 28 d for the summed path, 4 d for noise) / this machine's copy
  bandwidth measured on buffers larger than the last-level cache;
- peak extra memory of one step (beyond inputs and optimizer states): CPU: peak RSS
  (``VmHWM`` after resetting it through ``/proc/self/clear_refs``) minus RSS before the
  step, measured after all timings with glibc's mmap threshold pinned low so freed
  temporaries are returned to the OS; CUDA: ``torch.cuda.max_memory_allocated`` delta.

Ratios are baseline time / dpkern time (> 1: dpkern is faster). Results go to
``bench/results/<UTC date-time>/`` (git-ignored scratch) or ``--out``: ``results.json`` (machine, versions, date, every
median), ``timings.csv``, ``summary.csv``, ``targets.csv``, ``results.png`` and
``results.md``, the markdown block printed at the end, which README.md shows. The run
committed to the repository is written with ``--out bench/results``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import statistics
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

import dpkern
from dpkern import functional as F

from . import (
    LAYOUTS,
    MI,
    available_backends,
    format_size,
    layout_shapes,
    make_grad_samples,
    make_params,
    parse_size,
)
from .harness import (
    BYTES_F32,
    KEY,
    LR,
    PATHS,
    RESULTS_DIR,
    WEIGHT_DECAY,
    Candidate,
    bytes_floor,
    copy_bandwidth,
    cpu_ticks,
    load_average,
    machine_info,
    meminfo_kib,
    peak_extra_bytes,
    pin_malloc_threshold,
    set_threads,
    steal_note,
    steal_share,
    time_alternating,
    write_csv,
)


# The speed targets of the fused backends (first set for the C++ CPU backend); checked for
# every fused backend.
TARGETS = (
    dict(
        name="noise generation vs torch.randn",
        path="noise",
        layout="tensor",
        d=16 * MI,
        batch=0,
        required=3.0,
    ),
    dict(
        name="summed DP-AdamW step vs torch.normal+add+div+AdamW(foreach)",
        path="summed",
        layout="tensor",
        d=16 * MI,
        batch=0,
        required=3.0,
    ),
    dict(
        name="per-sample DP-AdamW step (GPT-2-like tensors) vs Opacus DPOptimizer+AdamW(foreach)",
        path="per_sample",
        layout="gpt2",
        d=4 * MI,
        batch=16,
        required=1.5,
    ),
)


# --------------------------------------------------------------------------------------
# Cases and candidates
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One measurement point: ``path`` in PATHS, ``layout`` in LAYOUTS, d coordinates
    requested (the GPT-2-like layout holds slightly fewer), batch B (0 for noise)."""

    path: str
    layout: str
    d: int
    batch: int


def adamw_variants(device) -> list[str]:
    """torch.optim.AdamW implementations to compare with: foreach, and fused where the
    device and this torch version support it."""
    out = ["foreach"]
    try:
        p = torch.zeros(2, device=device, requires_grad=True)
        p.grad = torch.zeros_like(p)
        torch.optim.AdamW([p], fused=True).step()
        out.append("fused")
    except (RuntimeError, ValueError, TypeError):
        pass
    return out


def _adamw(params, variant: str):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **{variant: True})


def build_candidates(
    case: Case,
    backends: list[str],
    device,
    *,
    sigma: float,
    clip: float,
    adamw: list[str],
    skip_baseline: bool = False,
) -> list[Candidate]:
    """Fresh tensors and the callables to time for ``case`` (each candidate owns its
    parameters and states; per-sample gradients and summed buffers are shared, read-only)."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    shapes = layout_shapes(case.d, case.layout)
    d = sum(math.prod(s) for s in shapes)
    cands: list[Candidate] = []
    if case.path == "noise":
        for be in backends:
            t = iter(range(1, 1 << 40))
            cands.append(
                Candidate(
                    "dpkern",
                    be,
                    lambda be=be, t=t: F.gaussian_noise(
                        d, key=KEY, step=next(t), device=device, backend=be
                    ),
                )
            )
        cands.append(Candidate("baseline", "foreach", lambda: torch.randn(d, device=device)))
        return cands

    base = make_params(shapes, device, generator=gen)

    def params_copy():
        return [p.detach().clone().requires_grad_(True) for p in base]

    B_e = max(case.batch, 1)
    if case.path == "per_sample":
        gs = make_grad_samples(base, case.batch, generator=gen)
        for be in backends:
            ps = params_copy()
            opt = dpkern.DPAdamW(
                ps,
                lr=LR,
                weight_decay=WEIGHT_DECAY,
                max_grad_norm=clip,
                noise_multiplier=sigma,
                expected_batch_size=B_e,
                seed=KEY,
                backend=be,
            )
            cands.append(Candidate("dpkern", be, opt.step, _attach(ps, gs, None)))
        if not skip_baseline:
            from opacus.optimizers import DPOptimizer

            for v in adamw:
                ps = params_copy()
                opt = DPOptimizer(
                    _adamw(ps, v),
                    noise_multiplier=sigma,
                    max_grad_norm=clip,
                    expected_batch_size=B_e,
                )
                cands.append(Candidate("baseline", v, opt.step, _attach(ps, gs, opt)))
    elif case.path == "summed":
        sums = [torch.randn(s, generator=gen).to(device) for s in shapes]
        for be in backends:
            ps = params_copy()
            m = [torch.zeros_like(p) for p in ps]
            v2 = [torch.zeros_like(p) for p in ps]
            t = iter(range(1, 1 << 40))
            cands.append(
                Candidate(
                    "dpkern",
                    be,
                    lambda ps=ps, m=m, v2=v2, be=be, t=t: F.dp_adamw(
                        ps,
                        None,
                        m,
                        v2,
                        step=next(t),
                        key=KEY,
                        lr=LR,
                        weight_decay=WEIGHT_DECAY,
                        max_grad_norm=clip,
                        noise_multiplier=sigma,
                        expected_batch_size=B_e,
                        summed_grads=sums,
                        backend=be,
                    ),
                )
            )
        for v in adamw:
            ps = params_copy()
            for p, s in zip(ps, sums):
                p.grad = s.clone()
            opt = _adamw(ps, v)

            def noisy_step(ps=ps, opt=opt):
                for p in ps:  # what a hand-written DP loop does after clipping + summing
                    p.grad.add_(torch.normal(0.0, sigma * clip, size=p.shape, device=device)).div_(
                        B_e
                    )
                opt.step()

            cands.append(Candidate("baseline", v, noisy_step))
    else:
        raise ValueError(f"invalid path {case.path!r}: expected one of {PATHS}")
    for v in adamw:  # the non-private floor: AdamW alone on the same parameters
        ps = params_copy()
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).mul_(1e-3).to(device)
        cands.append(Candidate("floor", v, _adamw(ps, v).step))
    return cands


def _attach(params, grad_samples, opacus_opt):
    """prepare(): give each parameter its per-sample gradient (a fresh view for Opacus,
    which marks the tensors it consumed, after clearing its summed_grad via zero_grad)."""

    def prepare():
        if opacus_opt is not None:
            opacus_opt.zero_grad(set_to_none=True)
        for p, g in zip(params, grad_samples):
            p.grad_sample = g.view_as(g)

    return prepare


# --------------------------------------------------------------------------------------
# Timing, memory and bandwidth
# --------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------
# Grid, summary, targets, output
# --------------------------------------------------------------------------------------
DEFAULT_GRID = {
    "noise": ["1M", "16M"],
    "summed": ["1M", "16M"],
    "per_sample": ["1M", "4M"],
    "batch": [1, 8, 16],
}
FULL_GRID = {
    "noise": ["1M", "4M", "16M", "64M"],
    "summed": ["1M", "4M", "16M", "64M"],
    "per_sample": ["1M", "4M", "16M", "64M"],
    "batch": [1, 8, 16, 32],
}


def build_cases(paths, layouts, noise_d, summed_d, per_sample_d, batches) -> list[Case]:
    """The grid, in the order it runs (noise is layout-independent: one tensor only)."""
    cases = []
    if "noise" in paths:
        cases += [Case("noise", "tensor", d, 0) for d in noise_d]
    if "summed" in paths:
        cases += [Case("summed", lay, d, 0) for d in summed_d for lay in layouts]
    if "per_sample" in paths:
        cases += [
            Case("per_sample", lay, d, b) for d in per_sample_d for b in batches for lay in layouts
        ]
    return cases


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
    """The README table: medians in ms, speed-up = baseline / dpkern (> 1: dpkern faster)."""
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
    """The README block of a run (``results.json`` contents): how it was measured, the
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


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.report",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--full",
        action="store_true",
        help="the full grid: d up to 64M, "
        "B in {1, 8, 16, 32} (default: a subset that runs in < 10 min)",
    )
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    ap.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    ap.add_argument("--noise-d", nargs="+", help="sizes for the noise path (e.g. 1M 16M)")
    ap.add_argument("--summed-d", nargs="+", help="sizes for the summed path")
    ap.add_argument("--per-sample-d", nargs="+", help="sizes for the per-sample path")
    ap.add_argument("--batch", nargs="+", type=int, help="B for the per-sample path")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per case (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds per case")
    ap.add_argument(
        "--torch-max-d",
        default="1M",
        help="largest d for the (slow) pure-PyTorch reference backend (default 1M; 0 = skip it)",
    )
    ap.add_argument(
        "--torch-max-bd",
        default="1M",
        help="largest B x d for the reference "
        "(B = 1 off the per-sample path; default 1M: per-sample only B = 1, d = 1M)",
    )
    ap.add_argument("--backends", nargs="+", help="dpkern backends (default: all available)")
    ap.add_argument(
        "--threads",
        type=int,
        help="CPU threads for torch and the cpp backend "
        "(default: torch's default, usually one per core)",
    )
    ap.add_argument(
        "--bandwidth-mib",
        type=int,
        help="copy-bandwidth buffer size in MiB (default: 2 x last-level cache, at least 256 MiB)",
    )
    ap.add_argument("--sigma", type=float, default=1.0, help="noise multiplier")
    ap.add_argument("--clip", type=float, default=1.0, help="max_grad_norm C")
    ap.add_argument(
        "--memory-fraction",
        type=float,
        default=0.7,
        help="skip a case (or Opacus) whose estimated memory exceeds this share of MemAvailable",
    )
    ap.add_argument("--no-memory", action="store_true", help="skip peak-memory measurement")
    ap.add_argument(
        "--ghost",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the ghost-clipping part (bench/ghost.py: per-layer norms, "
        "end-to-end GPT-2 DP step; about 30 s; default on)",
    )
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument(
        "--out",
        type=Path,
        help="output folder (default "
        "bench/results/<UTC date-time>/; the committed run: --out bench/results)",
    )
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    if (args.threads is not None and args.threads < 1) or (
        args.bandwidth_mib is not None and args.bandwidth_mib < 1
    ):
        ap.error("--threads and --bandwidth-mib must be >= 1")
    grid = FULL_GRID if args.full else DEFAULT_GRID
    try:
        args.noise_d = [parse_size(s) for s in (args.noise_d or grid["noise"])]
        args.summed_d = [parse_size(s) for s in (args.summed_d or grid["summed"])]
        args.per_sample_d = [parse_size(s) for s in (args.per_sample_d or grid["per_sample"])]
        args.torch_max_d = 0 if str(args.torch_max_d) == "0" else parse_size(args.torch_max_d)
        args.torch_max_bd = 0 if str(args.torch_max_bd) == "0" else parse_size(args.torch_max_bd)
    except ValueError as exc:
        ap.error(str(exc))
    args.batch = args.batch or grid["batch"]
    if args.out is None:
        args.out = RESULTS_DIR / _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    if any(b < 1 for b in args.batch):
        ap.error("--batch values must be >= 1")
    return args


def _estimate_bytes(case: Case, n_backends: int, n_adamw: int) -> tuple[int, int]:
    """(bytes for the case without Opacus, extra bytes Opacus needs): parameters, states
    and gradients per candidate, shared per-sample gradients; Opacus materialises about
    one more B x d copy (its einsum) plus summed_grad and grad."""
    d, B = case.d, case.batch
    if case.path == "noise":
        return 8 * d * (n_backends + 1), 0
    per_cand = 16 * d
    base = per_cand * (n_backends + 2 * n_adamw) + 8 * d
    if case.path == "per_sample":
        return base + B * d * BYTES_F32, B * d * BYTES_F32 + 8 * d
    return base, 0


def main(argv=None) -> dict:
    """Run the report; print the markdown tables; write results under ``--out``.
    Returns the results dict (also written as results.json)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    if args.threads:
        set_threads(args.threads)
    all_backends = available_backends(device)
    names = [b for b in (args.backends or all_backends) if b in all_backends]
    adamw = adamw_variants(device)
    started, ticks = time.perf_counter(), cpu_ticks()
    info = machine_info(device)
    say(
        f"# dpkern report on {info['cpu']} ({info['cores']} cores, torch threads "
        f"{info['torch_threads']}), device {device}; backends {names}; AdamW {adamw}"
    )
    if info["loadavg"][0] > 0.5 * (info["cores"] or 1):
        say(
            f"WARNING: load average {info['loadavg'][0]:.1f} on {info['cores']} cores: other "
            "processes compete for the CPU, timings will be noisy and slow"
        )
    bw = copy_bandwidth(device, nbytes=args.bandwidth_mib * MI if args.bandwidth_mib else None)
    say(
        f"copy bandwidth {bw['bytes_per_s'] / 1e9:.1f} GB/s "
        f"(buffers of {bw['buffer_bytes'] / MI:.0f} MiB)"
    )

    cases = build_cases(
        args.paths, args.layouts, args.noise_d, args.summed_d, args.per_sample_d, args.batch
    )
    avail = (meminfo_kib("MemAvailable") or 1 << 40) * 1024 * args.memory_fraction
    plan = []
    for case in cases:
        bes = [
            b
            for b in names
            if b != "torch"
            or (case.d <= args.torch_max_d and case.d * max(case.batch, 1) <= args.torch_max_bd)
        ]
        need, opacus_extra = _estimate_bytes(case, len(bes), len(adamw))
        if need > avail:
            say(f"skip {case}: needs ~{need / 2**30:.1f} GiB")
            continue
        plan.append((case, bes, need + opacus_extra > avail))

    timings, summary, per_case = [], [], []
    for case, bes, skip_baseline in plan:
        t0 = time.perf_counter()
        cands = build_candidates(
            case,
            bes,
            device,
            sigma=args.sigma,
            clip=args.clip,
            adamw=adamw,
            skip_baseline=skip_baseline,
        )
        shapes = layout_shapes(case.d, case.layout)
        d_actual = sum(math.prod(s) for s in shapes)
        times = time_alternating(cands, args.repeats, device, warmup=args.warmup)
        medians = {k: statistics.median(v) for k, v in times.items()}
        for c in cands:
            ts = times[c.name]
            timings.append(
                dict(
                    path=case.path,
                    layout=case.layout,
                    d=d_actual,
                    tensors=len(shapes),
                    batch=case.batch,
                    candidate=c.name,
                    median_s=medians[c.name],
                    min_s=min(ts),
                    max_s=max(ts),
                    repeats=len(ts),
                )
            )
        per_case.append((case, bes, skip_baseline, d_actual, len(shapes), medians))
        del cands
        gc.collect()
        say(
            f"{case.path:10s} {case.layout:6s} d={format_size(case.d):>4s} B={case.batch:<2d} "
            + "  ".join(f"{k}={v * 1e3:.3g}ms" for k, v in medians.items())
            + f"  [{time.perf_counter() - t0:.0f}s]"
        )

    ghost_res = None
    if args.ghost:  # its timings before the memory phase below (which slows allocation)
        from . import ghost

        ghost_res = ghost.measure(
            device,
            repeats=args.repeats,
            warmup=args.warmup,
            sigma=args.sigma,
            clip=args.clip,
            memory=not args.no_memory,
            say=say,
        )

    peaks_by_case = [{} for _ in per_case]
    if not args.no_memory:  # after all timings: pinning malloc's threshold slows allocation
        if device.type == "cpu":
            pin_malloc_threshold()
        for i, (case, bes, skip_baseline, *_rest) in enumerate(per_case):
            bes = [b for b in bes if b != "torch"]  # the reference is not a speed claim
            cands = build_candidates(
                case,
                bes,
                device,
                sigma=args.sigma,
                clip=args.clip,
                adamw=adamw,
                skip_baseline=skip_baseline,
            )
            time_alternating(cands, 0, device, warmup=1)  # create the states
            peaks_by_case[i] = {c.name: peak_extra_bytes(c, device) for c in cands}
            del cands
            gc.collect()
        say(f"peak memory measured [{time.perf_counter() - started:.0f}s so far]")

    for (case, bes, skip_baseline, d_actual, n_t, medians), peaks in zip(per_case, peaks_by_case):
        summary += summarize(case, d_actual, n_t, medians, peaks, bw["bytes_per_s"])
        for t in timings:
            if (t["path"], t["layout"], t["batch"], t["d"]) == (
                case.path,
                case.layout,
                case.batch,
                d_actual,
            ):
                t["peak_extra_bytes"] = peaks.get(t["candidate"])
    fused = [b for b in names if b != "torch"]
    targets = check_targets(summary, fused if fused or device.type == "cpu" else [])

    command = "python -m bench.report " + " ".join(
        sys.argv[1:] if argv is None else [str(a) for a in argv]
    )
    results = {
        "command": command.strip(),
        "machine": info,
        "bandwidth": bw,
        "config": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"
        },
        "backends": names,
        "adamw_variants": adamw,
        "elapsed_s": time.perf_counter() - started,
        "timings": timings,
        "summary": summary,
        "targets": targets,
    }
    if ghost_res is not None:
        results["ghost"] = ghost_res
        ghost.write(ghost_res, args.out)
    load = load_average()[0]
    results["machine"]["loadavg_end"] = load
    results["machine"]["cpu_steal"] = steal_share(ticks, cpu_ticks())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    write_csv(args.out / "timings.csv", timings)
    write_csv(args.out / "summary.csv", summary)
    write_csv(args.out / "targets.csv", targets)
    if not args.no_plot:
        plot(timings, bw["bytes_per_s"], args.out / "results.png")

    (args.out / "results.md").write_text(render_markdown(results) + "\n")
    say("\n" + render_markdown(results))
    say(
        f"\n(total {results['elapsed_s']:.0f}s; load average at start "
        f"{info['loadavg'][0]:.1f}, at end {load:.1f}; "
        f"{steal_note(results['machine']['cpu_steal'])}; results in {args.out}/)"
    )
    return results


if __name__ == "__main__":
    main()
