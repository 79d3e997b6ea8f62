"""Privacy units of several examples: map keys to unit ids, sum per-sample gradients per unit.

With a privacy unit of several examples (a user, a document cut into blocks), the
sensitivity argument of DP-SGD (SPEC section 2) holds for units, not examples: each unit's
examples in a step are summed first, and the sum is clipped to C as one row. Removing or
adding a unit then moves the clipped sum by at most C, however many examples it has.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Sequence

import torch
from torch import Tensor

__all__ = ["group_grad_samples", "unit_ids_from_keys"]


def unit_ids_from_keys(keys: Iterable[Hashable]) -> tuple[Tensor, list]:
    """Unit ids for per-example keys (user names, document ids): the first distinct key is
    unit 0, the next unit 1, and so on.

    Args:
        keys: one hashable key per example.
    Returns:
        ``(unit_ids, names)``: int64 ``[N]`` unit ids, and the keys in unit order
        (``names[unit_ids[i]] == keys[i]``).
    Raises:
        ValueError: a key that is None or unhashable (the message gives its position)."""
    ids, names, index = [], [], {}
    for i, k in enumerate(keys):
        if k is None:
            raise ValueError(f"unit key of example {i} is None")
        try:
            u = index.setdefault(k, len(index))
        except TypeError:
            raise ValueError(
                f"unit key of example {i} is not hashable ({type(k).__name__})"
            ) from None
        if u == len(names):
            names.append(k)
        ids.append(u)
    return torch.tensor(ids, dtype=torch.int64), names


def group_grad_samples(
    grad_samples: Sequence[Tensor | None], unit_ids: Tensor
) -> list[Tensor | None]:
    """Sum per-sample gradients over the rows of each privacy unit.

    Row i of every ``grad_samples[k]`` belongs to unit ``unit_ids[i]``; rows with a
    negative id (padding of a fixed-shape batch) are dropped. The result has one row per
    distinct unit, in ascending unit id: feed it to the optimizer (``p.grad_sample =
    grouped[k]``), which then clips the norm of each unit's summed gradient
    ||sum_{i in u} g_i|| to C -- user-level (or document-level) DP-SGD, with the
    optimizer's B the number of units and its ``expected_batch_size`` q times the number of
    units. Sums are accumulated in float32 (float64 stays float64) and returned in that
    dtype; the order of summation within a unit is the row order.

    Args:
        grad_samples: per parameter, None (unused: stays None) or a tensor ``[B, *shape]``.
        unit_ids: int64 ``[B]`` (any integer dtype), the unit of each row, -1 for padding.
    Returns:
        list of None or ``[U_b, *shape]`` tensors, U_b the number of distinct units
        (ids >= 0) in ``unit_ids``; ``torch.unique(unit_ids[unit_ids >= 0])`` lists them.
    Raises:
        ValueError: ``unit_ids`` not a 1-D integer tensor, or a tensor whose first
            dimension is not B.
    """
    if (
        not isinstance(unit_ids, Tensor)
        or unit_ids.dim() != 1
        or unit_ids.is_floating_point()
        or unit_ids.dtype == torch.bool
    ):
        raise ValueError("group_grad_samples: unit_ids must be a 1-D integer tensor [B]")
    B = unit_ids.shape[0]
    keep = unit_ids >= 0
    units, inverse = torch.unique(unit_ids[keep], return_inverse=True)
    out: list[Tensor | None] = []
    for k, g in enumerate(grad_samples):
        if g is None:
            out.append(None)
            continue
        if not isinstance(g, Tensor) or g.dim() < 1 or g.shape[0] != B:
            shape = list(g.shape) if isinstance(g, Tensor) else type(g).__name__
            raise ValueError(
                f"group_grad_samples: grad_samples[{k}] has shape {shape}, expected "
                f"[{B}, ...] (one row per unit id)"
            )
        dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
        summed = torch.zeros((units.numel(), *g.shape[1:]), dtype=dtype, device=g.device)
        summed.index_add_(0, inverse.to(g.device), g[keep.to(g.device)].to(dtype))
        out.append(summed)
    return out
