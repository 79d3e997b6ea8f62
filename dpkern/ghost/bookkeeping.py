"""Book-keeping: the clipped sum ``sum_i c_i grad_i`` of one parameter from its uses, without
per-sample gradients (Bu et al. 2023, "Differentially private optimization on large model
at small cost", arXiv 2210.00038, book-keeping; SPEC section 2's ``S_p``).

- OuterUse (Linear / Conv1D weight): ``sum_i c_i out_i^T inp_i = (c o out)^T inp`` over the
  flattened ``B*T`` rows -- one GEMM;
- IndexUse (Embedding): a scaled index-add (:func:`.norms.add_rows_at`: ``index_add_`` on
  CPU, an accumulating ``index_put_``, deterministic, on CUDA) of the scaled token gradients
  ``c_i g_{i,t}`` into row ``ids[i, t]`` (padding tokens were zeroed when the use was recorded);
- RowsUse (biases, LayerNorm/RMSNorm, opt-in instantiated layers): ``sum_i c_i rows_i``.

Samples whose clip factor is zero because their gradient is not finite (``nonfinite="zero"``)
are zeroed with ``torch.where`` before any product, so a NaN never reaches the sum.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .norms import IndexUse, OuterUse, RowsUse, add_rows_at

__all__ = ["clipped_sum"]


def _scale(x: Tensor, c: Tensor, drop: Tensor | None) -> Tensor:
    """``c_i * x[i]`` in float32, rows in ``drop`` set to exactly 0."""
    cb = c.view(-1, *([1] * (x.dim() - 1)))
    y = x.float() * cb
    if drop is not None:
        y = torch.where(drop.view_as(cb), torch.zeros((), dtype=y.dtype, device=y.device), y)
    return y


def _zero_rows(x: Tensor, drop: Tensor | None) -> Tensor:
    if drop is None:
        return x
    return torch.where(
        drop.view(-1, *([1] * (x.dim() - 1))), torch.zeros((), dtype=x.dtype, device=x.device), x
    )


def clipped_sum(uses: list, shape, c: Tensor, drop: Tensor | None = None) -> Tensor:
    """``sum_i c_i grad_i`` of one parameter, float32 tensor of ``shape``.

    Args:
        uses: the parameter's OuterUse / IndexUse / RowsUse entries (:mod:`.norms`).
        shape: the parameter's shape.
        c: float32 ``[B]`` clip factors (``min(1, C / (n_i + 1e-6))``).
        drop: optional bool ``[B]``: samples to leave out entirely (non-finite).
    Returns: float32 tensor of ``shape`` on the uses' device.
    Raises: ValueError for an empty ``uses``."""
    if not uses:
        raise ValueError("clipped_sum: no use of the parameter")
    total = None
    for u in uses:
        if isinstance(u, OuterUse):
            out = u.out if u.out.dim() == 3 else u.out.unsqueeze(1)
            inp = u.inp if u.inp.dim() == 3 else u.inp.unsqueeze(1)
            o = _scale(out, c, drop).reshape(-1, out.shape[-1])
            x = _zero_rows(inp, drop).reshape(-1, inp.shape[-1]).float()
            s = o.transpose(0, 1) @ x
        elif isinstance(u, IndexUse):
            B, T, P1 = u.g.shape
            s = torch.zeros(u.num_rows, P1, dtype=torch.float32, device=u.g.device)
            add_rows_at(s, u.ids.reshape(-1).long(), _scale(u.g, c, drop).reshape(B * T, P1))
        elif isinstance(u, RowsUse):
            s = _scale(u.rows, c, drop).sum(0)
        else:
            raise TypeError(f"clipped_sum: unknown use {type(u).__name__}")
        s = s.reshape(shape)
        total = s if total is None else total.add_(s)
    return total
