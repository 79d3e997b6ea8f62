"""The grid and the candidates of :mod:`bench.report`: the speed targets, the cases (path x
layout x d x B) and, per case, the callables timed side by side (dpkern's backends, the
baselines users would otherwise run, the non-private AdamW floor)."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

import dpkern
from dpkern import functional as F

from . import MI, layout_shapes, make_grad_samples, make_params
from .harness import KEY, LR, PATHS, WEIGHT_DECAY, Candidate

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
