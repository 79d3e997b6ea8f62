"""Public building blocks of the functional API: the noise stream, pass 1 (per-sample
norms) and the clip factors (SPEC sections 2 and 3)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .. import backends
from ..hyper import DPStep, check_positive
from ..keys import NoiseKey

NONFINITE_MODES = ("error", "zero")
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CLIP_EPS = 1e-6  # c_i = min(1, C / (n_i + 1e-6)), Opacus' convention (SPEC section 2)
Reduce = Callable[[Tensor], None]  # in-place SUM over the ranks of sharded parameters


def gaussian_noise(
    numel: int,
    *,
    key: NoiseKey | int,
    step: int,
    offset: int = 0,
    stream: int = 0,
    device: torch.device | str | None = None,
    backend: str = "auto",
) -> Tensor:
    """Standard normals of the dpkern noise stream v1 (SPEC section 3).

    Returns a float32 tensor ``[numel]`` holding z_j for global element indices
    j = offset, ..., offset + numel - 1 at (key, step, stream). A pure function of those:
    independent of device, backend, block size or thread count.

    Args:
        numel: number of elements (>= 0).
        key: 64-bit noise key, an int in [0, 2**64).
        step: optimizer step t >= 1 (< 2**48).
        offset: global index of the first element (>= 0, may exceed 2**32).
        stream: 16-bit stream id (0 = gradient noise).
    Raises:
        ValueError: on any argument out of range.
    Source: Salmon et al. 2011 (Philox-4x32-10); Box-Muller radius from 96 bits, SPEC 3.
    """
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"invalid numel={numel!r}: expected an int >= 0")
    if not isinstance(offset, int) or offset < 0 or offset + numel > 2**64:
        raise ValueError(f"invalid offset={offset!r}: expected an int in [0, 2**64 - numel]")
    DPStep(key=key, step=step, noise_std=0.0, expected_batch_size=1.0, stream=stream)
    device = torch.device(device) if device is not None else torch.device("cpu")
    be = backends.resolve(backends.check_name(backend), device)
    return be.gaussian_noise(numel, key=key, step=step, offset=offset, stream=stream, device=device)


def per_sample_norms(grad_samples: Sequence[Tensor | None], *, backend: str = "auto") -> Tensor:
    """Per-sample gradient norms n_i = sqrt(sum_p ||grad_sample_p[i]||^2) (SPEC section 2).

    Args:
        grad_samples: tensors ``[B, *shape_p]`` (any float dtype; ``None`` entries are
            zero gradients), all with the same B and on the same device.
    Returns:
        float32 tensor ``[B]`` (accumulated in float32).
    Raises:
        ValueError: mismatched B, devices, sparse or non-float tensors, or no tensor at all.
    """
    present = [(k, g) for k, g in enumerate(grad_samples) if g is not None]
    if not present:
        raise ValueError("per_sample_norms: no grad_sample tensor given")
    B = _check_rows([(f"grad_samples[{k}]", g) for k, g in present])
    device = present[0][1].device
    return backends.resolve(backends.check_name(backend), device).per_sample_norms(
        list(grad_samples), B, device
    )


def clip_factors(norms: Tensor, max_grad_norm: float) -> Tensor:
    """c_i = min(1, C / (n_i + 1e-6)) (SPEC section 2, Opacus' convention): float32 ``[B]``."""
    check_positive("max_grad_norm", max_grad_norm)
    return torch.clamp(max_grad_norm / (norms.float() + CLIP_EPS), max=1.0)


def _check_rows(named: list[tuple[str, Tensor]]) -> int:
    """Check per-sample gradient tensors share B and a device; return B."""
    B, device = None, None
    for name, g in named:
        if not isinstance(g, Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(g).__name__}")
        if g.is_sparse or g.layout != torch.strided:
            raise ValueError(f"{name}: sparse per-sample gradients are not supported")
        if not g.is_floating_point() or g.dim() == 0:
            raise ValueError(
                f"{name}: expected a floating tensor [B, ...], got "
                f"{g.dtype} of shape {tuple(g.shape)}"
            )
        if B is None:
            B, device = g.shape[0], g.device
        elif g.shape[0] != B:
            raise ValueError(
                f"{name}: batch size {g.shape[0]} differs from {B} "
                "(all grad_sample tensors of one step share B)"
            )
        elif g.device != device:
            raise ValueError(f"{name}: on {g.device}, others on {device}")
    return B
