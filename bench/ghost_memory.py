"""Peak extra memory of the ghost bench's candidates (:mod:`bench.ghost`), measured in a
fresh process on CPU.

The CPU measure is a peak-RSS delta (:func:`bench.harness.peak_extra_bytes`) with glibc's
mmap threshold pinned low (:func:`bench.harness.pin_malloc_threshold`), so that freed
temporaries go back to the OS. Pinned only after the timings (pinning slows allocation), the
heap the timings grew stays fragmented and every small allocation of the measured step can
fault in a page of it: the same ghost step of the Llama-style model at 16 x 64 then reads
82 MiB instead of 36 MiB. So :func:`peaks` measures every case in a child process that pins
the threshold before building anything (``python -m bench.ghost_memory SPEC``, the spec and
the result as JSON); CUDA peaks (``max_memory_allocated``) are measured in-process.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def measure_here(layers, e2e, device, *, sigma, clip, model_kw) -> tuple[list, list]:
    """``(layer_peaks, e2e_peaks)`` in this process: one {candidate: bytes or None} per
    layer case (``"BxTxDxP"`` or LayerCase) and per e2e case ``(model, block, batch)``.
    On CPU this pins glibc's mmap threshold for the rest of the process."""
    from . import ghost as GB
    from .harness import pin_malloc_threshold

    device = torch.device(device)
    if device.type == "cpu":
        pin_malloc_threshold()
    layer_peaks = []
    for case in layers:
        case = case if isinstance(case, GB.LayerCase) else GB.parse_layer(case)
        layer_peaks.append(GB._peaks(GB.layer_candidates(case, device), device))
    e2e_peaks = []
    for model, block, batch in e2e:
        cands, _, _ = GB.e2e_candidates(
            block, batch, device, sigma=sigma, clip=clip, model_kw=model_kw.get(model), model=model
        )
        e2e_peaks.append(GB._peaks(cands, device))
        del cands
        gc.collect()
    return layer_peaks, e2e_peaks


def peaks(layers, e2e, device, *, sigma, clip, model_kw) -> tuple[list, list, str | None]:
    """``(layer_peaks, e2e_peaks, note)``: as :func:`measure_here`, on CPU in a fresh
    process (the same torch threads); ``note`` is None, or says why the fresh process
    failed and the peaks were measured in this one instead."""
    device = torch.device(device)
    if device.type != "cpu":
        return (*measure_here(layers, e2e, device, sigma=sigma, clip=clip, model_kw=model_kw), None)
    spec = {
        "layers": [c if isinstance(c, str) else f"{c.B}x{c.T}x{c.d}x{c.p}" for c in layers],
        "e2e": [list(c) for c in e2e],
        "sigma": sigma,
        "clip": clip,
        "model_kw": model_kw,
        "threads": torch.get_num_threads(),
    }
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(
        [sys.executable, "-m", "bench.ghost_memory", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        res = json.loads(lines[-1])
        return res["layers"], res["e2e"], None
    why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    layer_peaks, e2e_peaks = measure_here(
        layers, e2e, device, sigma=sigma, clip=clip, model_kw=model_kw
    )
    return layer_peaks, e2e_peaks, f"peak memory measured after the timings ({why})"


def main(argv=None) -> None:
    spec = json.loads((argv if argv is not None else sys.argv[1:])[0])
    torch.set_num_threads(int(spec["threads"]))
    layer_peaks, e2e_peaks = measure_here(
        spec["layers"],
        [tuple(c) for c in spec["e2e"]],
        "cpu",
        sigma=spec["sigma"],
        clip=spec["clip"],
        model_kw=spec["model_kw"],
    )
    print(json.dumps({"layers": layer_peaks, "e2e": e2e_peaks}))


if __name__ == "__main__":
    main()
