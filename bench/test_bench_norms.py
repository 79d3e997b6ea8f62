"""Pass 1: per-sample gradient norms over all parameters (SPEC section 2) per backend,
vs Opacus' way (a norm per parameter, stacked, then the norm of the stack)."""

import torch

from bench import parse_size
from bench.conftest import (
    DEVICE,
    backend_module,
    per_sample_grid,
    run_pedantic,
    skip_if_slow,
    workload,
)


@per_sample_grid()
def test_norms(benchmark, backend, layout, size, batch):
    d = parse_size(size)
    skip_if_slow(backend, d)
    be = backend_module(backend)
    _, gs, _, _ = workload(layout, d, batch)
    run_pedantic(
        benchmark,
        lambda: be.per_sample_norms(gs, batch, DEVICE),
        f"norms {layout} d={size} B={batch}",
    )


@per_sample_grid(backend=False)
def test_norms_baseline_opacus_style(benchmark, layout, size, batch):
    _, gs, _, _ = workload(layout, parse_size(size), batch)

    def norms():  # opacus.optimizers.DPOptimizer.clip_and_accumulate's norm computation
        per_param = [g.reshape(len(g), -1).norm(2, dim=-1) for g in gs]
        return torch.stack(per_param, dim=1).norm(2, dim=1)

    run_pedantic(benchmark, norms, f"norms {layout} d={size} B={batch}")
