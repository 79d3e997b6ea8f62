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
``results.md``, the markdown block printed at the end, which docs/BENCHMARKS.md shows. The run
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
from pathlib import Path

import torch

from . import (
    LAYOUTS,
    MI,
    available_backends,
    format_size,
    layout_shapes,
    parse_size,
)
from .harness import (
    BYTES_F32,
    PATHS,
    RESULTS_DIR,
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
from .report_cases import (
    DEFAULT_GRID,
    FULL_GRID,
    TARGETS,
    Case,
    adamw_variants,
    build_candidates,
    build_cases,
)
from .report_tables import (
    check_targets,
    markdown_table,
    markdown_targets,
    plot,
    render_markdown,
    summarize,
)

#: What tests reach through this module (the grid and candidates live in
#: :mod:`.report_cases`, the rows and tables in :mod:`.report_tables`).
__all__ = [
    "TARGETS",
    "Case",
    "check_targets",
    "main",
    "markdown_table",
    "markdown_targets",
    "parse_args",
    "set_threads",
    "summarize",
]


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
