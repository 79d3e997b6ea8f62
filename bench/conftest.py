"""Fixtures of the pytest-benchmark microbenchmarks (not collected by the test command).

    python -m pytest bench --benchmark-only                       # default grid, minutes
    DPKERN_BENCH_FULL=1 python -m pytest bench --benchmark-only   # d up to 64M, B up to 32

Every benchmark is parametrised over the dpkern backends that run here ("torch", the
reference, only up to DPKERN_BENCH_TORCH_MAX_D coordinates, default 1M, as it is slow;
"cpp" when dpkern._C is built; "triton" on CUDA), and benchmarks sharing a
``benchmark.group`` measure the same work, so ``--benchmark-group-by=group`` lines
up each backend with its PyTorch baseline. DPKERN_BENCH_DEVICE=cuda runs on a GPU.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from bench import (
    LAYOUTS,
    available_backends,
    layout_shapes,
    make_grad_samples,
    make_params,
    parse_size,
    synchronize,
)
from dpkern.backends import resolve

FULL = os.environ.get("DPKERN_BENCH_FULL", "0") not in ("", "0")
DEVICE = torch.device(os.environ.get("DPKERN_BENCH_DEVICE", "cpu"))
TORCH_MAX_D = parse_size(os.environ.get("DPKERN_BENCH_TORCH_MAX_D", "1M"))
ROUNDS = int(os.environ.get("DPKERN_BENCH_ROUNDS", "3"))

SIZES = ["1M", "4M", "16M", "64M"] if FULL else ["1M", "16M"]
PER_SAMPLE_SIZES = ["1M", "4M", "16M", "64M"] if FULL else ["1M", "4M"]
BATCHES = [1, 8, 32] if FULL else [1, 8]
BACKENDS = available_backends(DEVICE)


def pytest_collection_modifyitems(items):
    for item in items:  # benchmarks only: never let them run as ordinary tests
        item.add_marker(pytest.mark.benchmark)


def skip_if_slow(backend: str, d: int) -> None:
    if backend == "torch" and d > TORCH_MAX_D:
        pytest.skip(f"reference backend capped at d <= {TORCH_MAX_D} (DPKERN_BENCH_TORCH_MAX_D)")


def backend_module(backend: str):
    return resolve(backend, DEVICE)


@functools.lru_cache(maxsize=1)  # one workload alive at a time (they are large)
def workload(layout: str, d: int, batch: int):
    """(params, grad_samples or None, summed grads, fp32 states m and v) for a case."""
    gen = torch.Generator().manual_seed(d * 131 + batch)
    shapes = layout_shapes(d, layout)
    params = make_params(shapes, DEVICE, generator=gen, requires_grad=False)
    gs = make_grad_samples(params, batch, generator=gen) if batch else None
    summed = [torch.randn(s, generator=gen).to(DEVICE) for s in shapes]
    states = {
        "exp_avg": [torch.zeros_like(p) for p in params],
        "exp_avg_sq": [torch.zeros_like(p) for p in params],
    }
    return params, gs, summed, states


def per_sample_grid(backend: bool = True):
    """Parametrise a benchmark over (backend,) layout, per-sample d and B."""

    def deco(fn):
        fn = pytest.mark.parametrize("batch", BATCHES)(fn)
        fn = pytest.mark.parametrize("size", PER_SAMPLE_SIZES)(fn)
        fn = pytest.mark.parametrize("layout", LAYOUTS)(fn)
        return pytest.mark.parametrize("backend", BACKENDS)(fn) if backend else fn

    return deco


def run_pedantic(benchmark, fn, group: str, *, setup=None):
    """Benchmark ``fn`` (synchronised) for ROUNDS rounds after one warm-up round."""
    benchmark.group = group

    def call():
        fn()
        synchronize(DEVICE)

    return benchmark.pedantic(call, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=1)


__all__ = [
    "BACKENDS",
    "BATCHES",
    "DEVICE",
    "LAYOUTS",
    "PER_SAMPLE_SIZES",
    "SIZES",
    "backend_module",
    "per_sample_grid",
    "run_pedantic",
    "skip_if_slow",
    "workload",
]
