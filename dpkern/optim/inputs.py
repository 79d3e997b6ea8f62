"""What a DP step consumes: the ``p.grad_sample`` tensors (read as one tensor, refused once
released, marked released after use: a sample's gradient serves one release) and the
clipped sums computed elsewhere (checked before they are added)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..guards import ALREADY_RELEASED
from ..sharding import is_sharded, local_shard

_RELEASED = "_dpkern_released"  # attribute marking a grad_sample tensor already used


def grad_sample_of(p: Tensor, name: str) -> Tensor | None:
    """``p.grad_sample`` as one tensor (Opacus' list of several forward passes is
    concatenated); refuses a tensor that an earlier step or accumulate() consumed."""
    gs = getattr(p, "grad_sample", None)
    parts = list(gs) if isinstance(gs, (list, tuple)) else [gs]
    for x in parts:
        if x is not None and not isinstance(x, Tensor):
            raise ValueError(
                f"{name}: grad_sample is a {type(x).__name__}, expected a "
                "tensor (or Opacus' list of tensors)"
            )
        if x is not None and getattr(x, _RELEASED, False):
            raise ValueError(ALREADY_RELEASED.format(name=name))
    if p.grad is not None and p.grad.is_sparse:
        raise ValueError(f"{name}: sparse gradients are not supported")
    if isinstance(gs, (list, tuple)):
        return torch.cat(parts, dim=0) if parts else None
    return gs


def consume_grad_samples(params) -> None:
    """Mark every parameter's grad_sample as released and detach it."""
    for p in params:
        gs = getattr(p, "grad_sample", None)
        for x in gs if isinstance(gs, (list, tuple)) else [gs]:
            if isinstance(x, Tensor):
                setattr(x, _RELEASED, True)
        if gs is not None:
            p.grad_sample = None


def check_clipped_sums(clipped_sums, params: list[Tensor]) -> list:
    """``clipped_sums`` (one entry per parameter of ``params``, None or a tensor) as a list,
    each tensor replaced by its local shard. Raises: ValueError (wrong count, shape,
    device, non-finite values)."""
    clipped_sums = list(clipped_sums)
    if len(clipped_sums) != len(params):
        raise ValueError(
            f"accumulate_clipped: {len(clipped_sums)} sums for {len(params)} trainable parameters"
        )
    for k, (s, p) in enumerate(zip(clipped_sums, params, strict=True)):
        if s is None:
            continue
        if (
            not isinstance(s, Tensor)
            or s.shape != p.shape
            or s.device != p.device
            or not s.is_floating_point()
            or s.is_sparse
            or is_sharded(s) != is_sharded(p)
        ):
            raise ValueError(
                f"clipped_sums[{k}]: expected a dense float "
                f"{'DTensor' if is_sharded(p) else 'tensor'} of shape "
                f"{tuple(p.shape)} on {p.device}"
            )
        clipped_sums[k] = local_shard(s, f"clipped_sums[{k}]")[0]
    _check_finite(clipped_sums)
    return clipped_sums


def _check_finite(tensors: list) -> None:
    """Raise ValueError naming the first tensor (None entries skipped) with a NaN or an
    infinity. One multi-tensor 2-norm and one host sync per device (NaN and inf propagate
    through it), not one sync per tensor; only when a norm is not finite (a NaN, an inf,
    or finite values above ~1e19 whose squares overflow) are the tensors checked one by
    one, which decides. (The 2-norm, not the max-abs norm: torch's CPU ``_foreach_norm``
    takes 71 us for 20 tensors of 0.4 M floats with ord 2, 742 us with ord inf.)"""
    by_device: dict = {}
    for k, t in enumerate(tensors):
        if t is not None and t.numel():
            by_device.setdefault(t.device, []).append(k)
    for ks in by_device.values():
        peaks = torch._foreach_norm([tensors[k] for k in ks])
        if bool(torch.isfinite(torch.stack([x.float() for x in peaks])).all()):
            continue
        for k in ks:
            if not torch.isfinite(tensors[k]).all():
                raise ValueError(f"clipped_sums[{k}]: non-finite values")
