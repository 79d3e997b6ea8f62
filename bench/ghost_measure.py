"""Running the ghost bench (:mod:`bench.ghost`): :func:`measure` times both measurements
(per-layer norms from :mod:`bench.ghost_layers`, the end-to-end step from
:mod:`bench.ghost_e2e`) by alternating their candidates and taking medians, measures the
first-step check's cost, then the peak extra memory of every candidate after all timings
(on CPU in a fresh process, :mod:`bench.ghost_memory`), and returns the summary rows, the
raw timings and the notes. Also the helpers it uses: one timed round of candidates, the
peaks of a list of candidates, and the progress line."""

from __future__ import annotations

import gc
import statistics
import time

import torch

from .ghost_e2e import DEFAULT_BATCHES, DEFAULT_BLOCKS, e2e_candidates, e2e_row, verify_cost
from .ghost_layers import (
    DEFAULT_LAYERS,
    LayerCase,
    check_agree,
    layer_candidates,
    layer_rows,
    parse_layer,
)
from .ghost_models import E2E_MODELS
from .harness import peak_extra_bytes, time_alternating


def measure(
    device="cpu",
    *,
    layers=DEFAULT_LAYERS,
    blocks=DEFAULT_BLOCKS,
    batches=DEFAULT_BATCHES,
    repeats: int = 5,
    warmup: int = 1,
    sigma: float = 1.0,
    clip: float = 1.0,
    memory: bool = True,
    model_kw: dict | None = None,
    models=E2E_MODELS,
    say=lambda *a: None,
) -> dict:
    """Run both measurements; returns {"layers": rows, "e2e": rows, "timings": rows,
    "notes": [str], "elapsed_s"}. ``layers``: LayerCase or 'BxTxDxP' strings;
    ``models``: the e2e models (:data:`E2E_MODELS` names), each on every block and batch;
    ``model_kw``: {model name: its builder's shape arguments} (e.g. tiny models in tests).

    Memory (``memory=True``) is measured after all timings: on CPU in a fresh process
    (:mod:`bench.ghost_memory`: this process's heap after the timings inflates RSS peaks),
    on CUDA in this one. Raises AssertionError when a layer candidate's norms
    disagree with the Gram path, ValueError for an unknown model name."""
    device = torch.device(device)
    started = time.perf_counter()
    cases = [c if isinstance(c, LayerCase) else parse_layer(c) for c in layers]
    model_kw = model_kw or {}
    for model in models:
        if model not in E2E_MODELS:
            raise ValueError(f"unknown e2e model {model!r}: expected one of {E2E_MODELS}")
    timings, notes = [], []
    layer_meds, e2e_meds = [], []
    for case in cases:
        t0 = time.perf_counter()
        cands = layer_candidates(case, device)
        with torch.no_grad():
            check_agree({c.name: c.run() for c in cands}, "dpkern:gram")
        meds = _timed(
            cands,
            repeats,
            device,
            warmup,
            timings,
            dict(kind="layer", B=case.B, T=case.T, d=case.d, p=case.p),
        )
        layer_meds.append((case, meds))
        del cands
        gc.collect()
        say(
            f"layer B={case.B} T={case.T} d={case.d} p={case.p} (rule: {case.rule})  "
            + _fmt(meds)
            + f"  [{time.perf_counter() - t0:.0f}s]"
        )
    for model in models:
        kw = model_kw.get(model)
        for block in blocks:
            for batch in batches:
                t0 = time.perf_counter()
                cands, nts, n_params = e2e_candidates(
                    block, batch, device, sigma=sigma, clip=clip, model_kw=kw, model=model
                )
                notes += [n for n in nts if n not in notes]
                meds = _timed(
                    cands,
                    repeats,
                    device,
                    warmup,
                    timings,
                    dict(kind="e2e", model=model, block=block, B=batch),
                )
                del cands
                gc.collect()
                cost = verify_cost(
                    block, batch, device, sigma=sigma, clip=clip, model_kw=kw, model=model
                )
                e2e_meds.append((model, block, batch, n_params, meds, cost))
                gc.collect()
                say(
                    f"e2e {model} block={block} B={batch}  "
                    + _fmt(meds)
                    + f"  first-step check={cost['verify_s'] * 1e3:.3g}ms"
                    + f"  [{time.perf_counter() - t0:.0f}s]"
                )

    layer_peaks = [{} for _ in layer_meds]
    e2e_peaks = [{} for _ in e2e_meds]
    if memory:
        from .ghost_memory import peaks

        layer_peaks, e2e_peaks, note = peaks(
            [c for c, _ in layer_meds],
            [(mo, b, n) for mo, b, n, *_ in e2e_meds],
            device,
            sigma=sigma,
            clip=clip,
            model_kw=model_kw,
        )
        if note:
            notes.append(note)
        say(f"ghost: peak memory measured [{time.perf_counter() - started:.0f}s so far]")
    peak_of = {("layer", c.B, c.T, c.d, c.p): pk for (c, _), pk in zip(layer_meds, layer_peaks)}
    peak_of.update({("e2e", mo, b, n): pk for (mo, b, n, *_), pk in zip(e2e_meds, e2e_peaks)})
    for t in timings:
        key = (
            (t["kind"], t["B"], t["T"], t["d"], t["p"])
            if t["kind"] == "layer"
            else (t["kind"], t["model"], t["block"], t["B"])
        )
        t["peak_extra_bytes"] = peak_of[key].get(t["candidate"])
    return {
        "layers": [layer_rows(c, m, pk) for (c, m), pk in zip(layer_meds, layer_peaks)],
        "e2e": [
            e2e_row(b, n, np_, m, pk, v, model=mo)
            for (mo, b, n, np_, m, v), pk in zip(e2e_meds, e2e_peaks)
        ],
        "timings": timings,
        "notes": notes,
        "elapsed_s": time.perf_counter() - started,
    }


def _timed(cands, repeats, device, warmup, timings, tags) -> dict[str, float]:
    times = time_alternating(cands, repeats, device, warmup=warmup)
    meds = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        timings.append(
            dict(tags, candidate=k, median_s=meds[k], min_s=min(v), max_s=max(v), repeats=len(v))
        )
    return meds


def _peaks(cands, device) -> dict[str, int | None]:
    time_alternating(cands, 0, device, warmup=1)  # lazily created states exist before
    out = {c.name: peak_extra_bytes(c, device) for c in cands}
    del cands
    gc.collect()
    return out


def _fmt(meds) -> str:
    return "  ".join(f"{k}={v * 1e3:.3g}ms" for k, v in meds.items())
