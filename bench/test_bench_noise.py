"""Noise stream v1 (SPEC section 3) per backend vs torch.randn of the same size."""

import pytest
import torch

from bench import parse_size
from bench.conftest import BACKENDS, DEVICE, SIZES, backend_module, run_pedantic, skip_if_slow


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_noise(benchmark, backend, size):
    d = parse_size(size)
    skip_if_slow(backend, d)
    be = backend_module(backend)
    run_pedantic(
        benchmark,
        lambda: be.gaussian_noise(d, key=7, step=1, offset=0, stream=0, device=DEVICE),
        f"noise d={size}",
    )


@pytest.mark.parametrize("size", SIZES)
def test_noise_baseline_randn(benchmark, size):
    d = parse_size(size)
    run_pedantic(benchmark, lambda: torch.randn(d, device=DEVICE), f"noise d={size}")
