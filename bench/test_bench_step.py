"""Pass 2 (clip + sum + noise + AdamW update, fused) and the summed-gradient step, per
backend, vs torch.optim.AdamW(foreach) alone (the non-private floor)."""

import pytest
import torch

from bench import parse_size
from bench.conftest import (
    BACKENDS,
    DEVICE,
    LAYOUTS,
    SIZES,
    backend_module,
    per_sample_grid,
    run_pedantic,
    skip_if_slow,
    workload,
)
from dpkern.hyper import AdamWHyper, DPStep

HYPER = AdamWHyper(lr=1e-3)


def _offsets(params):
    out, off = [], 0
    for p in params:
        out.append(off)
        off += p.numel()
    return out


def _fused_step(be, params, grad_samples, clip, summed, states):
    step = iter(range(1, 1 << 40))
    offsets = _offsets(params)

    def run():
        dp = DPStep(key=7, step=next(step), noise_std=1.0, expected_batch_size=16.0)
        be.step(HYPER, dp, params, grad_samples, clip, summed, states, offsets)

    return run


@per_sample_grid()
def test_pass2_per_sample_step(benchmark, backend, layout, size, batch):
    d = parse_size(size)
    skip_if_slow(backend, d)
    params, gs, _, states = workload(layout, d, batch)
    clip = torch.rand(batch, device=DEVICE)
    run = _fused_step(backend_module(backend), params, gs, clip, [None] * len(params), states)
    run_pedantic(benchmark, run, f"pass2 {layout} d={size} B={batch}")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_summed_step(benchmark, backend, layout, size):
    d = parse_size(size)
    skip_if_slow(backend, d)
    params, _, summed, states = workload(layout, d, 0)
    run = _fused_step(backend_module(backend), params, [None] * len(params), None, summed, states)
    run_pedantic(benchmark, run, f"summed {layout} d={size}")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_summed_baseline_adamw_alone(benchmark, layout, size):
    params, _, summed, _ = workload(layout, parse_size(size), 0)
    ps = [p.clone().requires_grad_(True) for p in params]
    for p, s in zip(ps, summed):
        p.grad = s
    opt = torch.optim.AdamW(ps, lr=1e-3, foreach=True)
    run_pedantic(benchmark, opt.step, f"summed {layout} d={size}")
