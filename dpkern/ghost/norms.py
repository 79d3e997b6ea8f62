"""Per-sample squared gradient norms without per-sample gradients (ghost clipping).

The PyTorch reference (the spec in code) of every per-layer norm that
:mod:`dpkern.ghost` computes. Each parameter's per-sample gradient is described by its
*uses* in the forward pass (one module may use it several times, several modules may
share it); a use is one of three forms, all in the parameter's own orientation:

- :class:`OuterUse` -- ``grad_i = sum_t out[i, t] (x) inp[i, t]``, shape ``[P0, P1]``:
  a Linear weight (``out`` = output gradient G ``[B, T, p]``, ``inp`` = input A
  ``[B, T, d]``) or a transformers ``Conv1D`` weight (stored transposed, ``[d, p]``: there
  ``out`` = A and ``inp`` = G). Several such uses of one parameter are concatenated along
  T, which is exact: ``sum_u G_u^T A_u = [G_1; G_2]^T [A_1; A_2]``.
- :class:`IndexUse` -- ``grad_i[v] = sum_{t: ids[i, t] = v} g[i, t]``: an Embedding
  (``padding_idx`` tokens already zeroed in ``g``: their row gets no gradient).
- :class:`RowsUse` -- the per-sample gradient itself, ``[B, *shape]``, for parameters
  whose per-sample gradients are tiny (biases: ``sum_t g_t``; LayerNorm/RMSNorm weights
  and biases) or, opt-in, for layer types the wrapper does not cover.

The norms (all exact; accumulated in float32, or in float64 when an input is float64, as
for a float64 model; never TF32). Every per-parameter squared norm is clamped at 0
(:func:`clamp_norm_sq`): the Gram path and the tied cross term are sums whose terms
cancel, so float rounding can make a tiny squared norm slightly negative, which ``sqrt``
would turn into a NaN (a finite sample reported non-finite); NaN and +-Inf stay as they
are (a non-finite sample stays one).

- OuterUse, Gram path: ``||G_i^T A_i||^2 = sum((A_i A_i^T) o (G_i G_i^T))`` -- two T x T
  Grams per sample, ~2 B T^2 (d + p) flops; instantiation path: form ``G_i^T A_i``
  (``[p, d]``, chunk of samples at a time) and square it, ~2 B T d p flops.
  **Rule** (:func:`outer_method`): Gram when ``T (d + p) <= d p`` (fewer flops), else
  instantiate. T = 1 (2-D input) is ``||a||^2 ||g||^2``.
- IndexUse: ``sum_v ||sum_{t: x_t = v} g_t||^2`` by a segment sum over the distinct
  (sample, token) pairs (``torch.unique`` + an accumulating ``index_put_``): O(B T d) time and memory, no
  one-hot, no ``B x V x d`` tensor.
- Tied weights (an Embedding and an output Linear sharing ``[V, d]``): the norm of the
  SUM of the uses, ``||E_i||^2 + ||L_i||^2 + 2 <E_i, L_i>``, where
  ``<E_i, L_i> = sum_{t, s} out[i, s, x_t] <g_t, inp[i, s]>`` needs a ``T_e x T_l`` Gram
  and a ``T_l x T_e`` gather of the output gradient (:func:`index_outer_cross`), never a
  ``V x d`` tensor.
- RowsUse: ``||rows_i||^2``. A parameter that mixes RowsUse with other forms is
  instantiated whole (exact; memory ``B x numel`` for that parameter only).

Sources: Goodfellow 2015 (per-example norms from A and G, 2-D case); Li et al. 2022
"Large language models can be strong differentially private learners" (ghost clipping for
sequences, arXiv 2110.05679); Bu et al. 2023 "Differentially private optimization on
large model at small cost" (book-keeping and the per-layer Gram/instantiation choice,
arXiv 2210.00038).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "OuterUse",
    "IndexUse",
    "RowsUse",
    "acc_dtype",
    "add_rows_at",
    "add_sample_rows",
    "clamp_norm_sq",
    "outer_method",
    "outer_norm_sq",
    "index_norm_sq",
    "index_outer_cross",
    "rows_norm_sq",
    "layer_norm_rows",
    "rms_norm_rows",
    "param_norm_sq",
    "instantiate",
    "no_tf32",
    "DEFAULT_CHUNK_BYTES",
]

#: Temporary memory per chunk of samples (Gram tiles or instantiated gradients).
DEFAULT_CHUNK_BYTES = 64 * 2**20


@dataclass
class OuterUse:
    """``grad_i = sum_t out[i, t] (x) inp[i, t]``; ``out [B, T, P0]``, ``inp [B, T, P1]``."""

    out: Tensor
    inp: Tensor


@dataclass
class IndexUse:
    """``grad_i[v] = sum_{t: ids[i, t] = v} g[i, t]``; ``ids [B, T]`` int64 in [0, V),
    ``g [B, T, P1]`` (padding tokens zeroed); ``num_rows`` = V."""

    ids: Tensor
    g: Tensor
    num_rows: int


@dataclass
class RowsUse:
    """An instantiated per-sample gradient ``rows [B, *param.shape]``."""

    rows: Tensor


@contextlib.contextmanager
def no_tf32():
    """Disable TF32 for CUDA matmuls inside the block (restored after): an under-estimated
    norm would let a sample's clipped gradient exceed C."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def add_rows_at(dst: Tensor, index: Tensor, src: Tensor) -> Tensor:
    """``dst[index[j]] += src[j]`` in place (``dst [N, P]``, ``index [M]`` int64,
    ``src [M, P]``), repeated indices summed: ``index_add_`` on CPU (10-20x faster there
    than an accumulating ``index_put_`` in torch 2.13, e.g. 28 us against 463 us for 1024
    rows of 128 into 257; deterministic: it adds in index order), an accumulating
    ``index_put_`` elsewhere (deterministic on CUDA, where ``index_add_`` uses atomics)."""
    if dst.device.type == "cpu":
        return dst.index_add_(0, index, src)
    return dst.index_put_((index,), src, accumulate=True)


def add_sample_rows(dst: Tensor, u: "IndexUse") -> None:
    """Add the per-sample gradient of embedding use ``u`` into contiguous ``dst``
    ``[B, num_rows * P]`` (sample i's row ``ids[i, t]`` += ``g[i, t]``), in ``dst``'s
    dtype, by one :func:`add_rows_at` over the ``[B * num_rows, P]`` view."""
    B, T, P1 = u.g.shape
    rows = torch.arange(B, device=u.ids.device).unsqueeze(1) * u.num_rows
    index = (rows + u.ids.long()).reshape(-1)
    add_rows_at(dst.view(B * u.num_rows, P1), index, u.g.reshape(B * T, P1).to(dst.dtype))


def acc_dtype(*tensors: Tensor) -> torch.dtype:
    """Accumulation dtype of norms of these tensors: float64 if any of them is float64,
    else float32 (also for bf16 / fp16 inputs), as SPEC section 2's norms."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def clamp_norm_sq(x: Tensor) -> Tensor:
    """Squared norms with finite negatives (float rounding in sums that cancel: Gram
    differences, tied cross terms) set to 0; NaN and +-Inf kept (non-finite samples stay
    non-finite: ``clamp_min`` would turn -Inf into 0). Returns a new tensor."""
    return torch.where(torch.isfinite(x), x.clamp_min(0), x)


def _chunks(B: int, bytes_per_sample: int, chunk_bytes: int):
    step = max(1, chunk_bytes // max(1, bytes_per_sample))
    return [(i, min(B, i + step)) for i in range(0, B, step)]


def outer_method(T: int, d: int, p: int) -> str:
    """``"gram"`` if ``T (d + p) <= d p`` (Gram path ~2BT^2(d+p) flops no more than
    instantiation ~2BTdp), else ``"instantiate"``."""
    return "gram" if T * (d + p) <= d * p else "instantiate"


def outer_norm_sq(
    out: Tensor, inp: Tensor, *, method: str = "auto", chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Tensor:
    """Per-sample ``||sum_t out[i,t] (x) inp[i,t]||_F^2``.

    Args:
        out: ``[B, T, P0]`` (or ``[B, P0]``), any float dtype.
        inp: ``[B, T, P1]`` (or ``[B, P1]``), same B and T.
        method: ``"auto"`` (:func:`outer_method`), ``"gram"`` or ``"instantiate"``.
        chunk_bytes: temporary memory per chunk of samples.
    Returns: ``[B]``, float32 (float64 if an input is float64), >= 0 or non-finite: the
        Gram path's rounding negatives are clamped to 0 (:func:`clamp_norm_sq`).
    Raises: ValueError for mismatched shapes or an unknown method.
    """
    if out.dim() == 2:
        out, inp = out.unsqueeze(1), inp.unsqueeze(1)
    if out.dim() != 3 or inp.dim() != 3 or out.shape[:2] != inp.shape[:2]:
        raise ValueError(
            f"outer_norm_sq: expected [B, T, P0] and [B, T, P1], got "
            f"{tuple(out.shape)} and {tuple(inp.shape)}"
        )
    B, T, P0 = out.shape
    P1 = inp.shape[2]
    if method == "auto":
        method = outer_method(T, P1, P0)
    if method not in ("gram", "instantiate"):
        raise ValueError(f"unknown method={method!r}: expected 'auto', 'gram' or 'instantiate'")
    dt = acc_dtype(out, inp)
    size = torch.finfo(dt).bits // 8
    res = torch.empty(B, dtype=dt, device=out.device)
    with no_tf32():
        if T == 1:
            return out.to(dt).square().sum((1, 2)) * inp.to(dt).square().sum((1, 2))
        if method == "gram":
            for a, b in _chunks(B, 2 * size * T * T, chunk_bytes):
                o, x = out[a:b].to(dt), inp[a:b].to(dt)
                res[a:b] = (torch.bmm(o, o.transpose(1, 2)) * torch.bmm(x, x.transpose(1, 2))).sum(
                    (1, 2)
                )
            return clamp_norm_sq(res)
        for a, b in _chunks(B, size * P0 * P1, chunk_bytes):
            g = torch.bmm(out[a:b].to(dt).transpose(1, 2), inp[a:b].to(dt))
            res[a:b] = g.square().sum((1, 2))
    return res


def _segments(ids: Tensor, num_rows: int):
    """Distinct (sample, token) pairs: (inverse index per token [B*T], sample of each pair)."""
    B = ids.shape[0]
    key = ids.long() + num_rows * torch.arange(B, device=ids.device).unsqueeze(1)
    uniq, inv = torch.unique(key.reshape(-1), return_inverse=True)
    return inv, torch.div(uniq, num_rows, rounding_mode="floor")


def index_norm_sq(ids: Tensor, g: Tensor, num_rows: int) -> Tensor:
    """Per-sample ``sum_v ||sum_{t: ids[i,t] = v} g[i,t]||^2`` (an Embedding's gradient).

    Args: ids ``[B, T]`` integer in [0, num_rows); g ``[B, T, P1]`` (padding tokens
    zeroed by the caller). Returns ``[B]``, float32 (float64 if g is float64).
    Memory O(B T P1): no one-hot."""
    B, T, P1 = g.shape
    dt = acc_dtype(g)
    res = torch.zeros(B, dtype=dt, device=g.device)
    if B == 0 or T == 0:
        return res
    inv, sample = _segments(ids, num_rows)
    sums = torch.zeros(sample.shape[0], P1, dtype=dt, device=g.device)
    add_rows_at(sums, inv, g.reshape(B * T, P1).to(dt))
    return res.index_add_(0, sample, sums.square().sum(1))


def index_outer_cross(
    ids: Tensor, g: Tensor, out: Tensor, inp: Tensor, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Tensor:
    """Per-sample ``<E_i, L_i>`` of an IndexUse ``E`` and an OuterUse ``L`` of one ``[V, P1]``
    parameter: ``sum_{t, s} out[i, s, ids[i, t]] * <g[i, t], inp[i, s]>``.

    Args: ids ``[B, Te]``, g ``[B, Te, P1]``, out ``[B, Tl, V]``, inp ``[B, Tl, P1]``.
    Returns ``[B]``, float32 (float64 if an input is float64); a cross term, so of
    either sign (not clamped). Temporaries: ``[chunk, Te, Tl]`` twice (a Gram and a
    gather), never ``V x P1``."""
    if out.dim() == 2:
        out, inp = out.unsqueeze(1), inp.unsqueeze(1)
    B, Te = ids.shape
    Tl = out.shape[1]
    dt = acc_dtype(g, out, inp)
    size = torch.finfo(dt).bits // 8
    res = torch.empty(B, dtype=dt, device=g.device)
    with no_tf32():
        for a, b in _chunks(B, 2 * size * Te * Tl, chunk_bytes):
            m = torch.bmm(g[a:b].to(dt), inp[a:b].to(dt).transpose(1, 2))  # [b, Te, Tl]
            idx = ids[a:b].long().unsqueeze(1).expand(b - a, Tl, Te)
            gx = out[a:b].gather(2, idx).to(dt)  # [b, Tl, Te]
            res[a:b] = (m * gx.transpose(1, 2)).sum((1, 2))
    return res


def rows_norm_sq(rows: Tensor) -> Tensor:
    """``||rows[i]||^2`` in float32 (float64 for float64 rows): ``[B, ...] -> [B]``."""
    return rows.to(acc_dtype(rows)).square().reshape(rows.shape[0], -1).sum(1)


def _norm_rows(x_hat: Tensor | None, g: Tensor, n_norm: int, has_bias: bool, dt=None):
    dims = tuple(range(1, g.dim() - n_norm))
    gf = g.to(x_hat.dtype if x_hat is not None else dt)
    w = None
    if x_hat is not None:
        w = (gf * x_hat).sum(dims) if dims else gf * x_hat
    b = (gf.sum(dims) if dims else gf) if has_bias else None
    return w, b


def layer_norm_rows(
    x: Tensor,
    g: Tensor,
    normalized_shape,
    eps: float,
    has_bias: bool,
    *,
    has_weight: bool = True,
    stats: tuple[Tensor, Tensor] | None = None,
):
    """Per-sample gradients of a LayerNorm's weight and bias (Ba et al. 2016).

    Args: x the layer's input ``[B, ..., *normalized_shape]``; g its output gradient (same
    shape); has_weight: False when only the bias is wanted (weight_rows is then None);
    stats: the forward's own ``(mean, rstd)`` (``native_layer_norm``'s second and third
    outputs, one per normalized row): ``x_hat = (x - mean) * rstd`` is then formed from
    them instead of normalizing x again. Returns ``(weight_rows, bias_rows or None)``,
    float32 (float64 if x or g is) ``[B, *normalized_shape]``: ``sum over the
    non-normalized dims of g * x_hat`` and ``of g``."""
    shape = tuple(normalized_shape)
    dt = acc_dtype(x, g)
    x_hat = None
    if has_weight:
        lead = tuple(x.shape[: x.dim() - len(shape)]) + (1,) * len(shape)
        if stats is not None and all(t.numel() == math.prod(lead) for t in stats):
            mean, rstd = (t.to(dt).reshape(lead) for t in stats)
            x_hat = (x.to(dt) - mean) * rstd
        else:
            x_hat = torch.nn.functional.layer_norm(x.to(dt), shape, None, None, eps)
    return _norm_rows(x_hat, g, len(shape), has_bias, dt)


def rms_norm_rows(x: Tensor, g: Tensor, normalized_shape, eps) -> Tensor:
    """Per-sample gradient of an RMSNorm's weight (Zhang & Sennrich 2019), float32
    (float64 if x or g is) ``[B, *normalized_shape]``; x, g as in :func:`layer_norm_rows`."""
    shape = tuple(normalized_shape)
    x_hat = torch.nn.functional.rms_norm(x.to(acc_dtype(x, g)), shape, None, eps)
    return _norm_rows(x_hat, g, len(shape), False)[0]


def _cat_outer(uses: list[OuterUse]):
    outs = [u.out if u.out.dim() == 3 else u.out.unsqueeze(1) for u in uses]
    inps = [u.inp if u.inp.dim() == 3 else u.inp.unsqueeze(1) for u in uses]
    if len(uses) == 1:
        return outs[0], inps[0]
    return torch.cat(outs, 1), torch.cat(inps, 1)


def _cat_index(uses: list[IndexUse]):
    if len(uses) == 1:
        return uses[0].ids, uses[0].g
    return torch.cat([u.ids for u in uses], 1), torch.cat([u.g for u in uses], 1)


def instantiate(uses: list, shape, batch_size: int) -> Tensor:
    """The per-sample gradient ``[B, *shape]`` (float32; float64 if a use holds float64
    tensors) of one parameter from its uses (memory B x numel: used only where a
    parameter mixes RowsUse with other forms)."""
    dt = acc_dtype(*_all_tensors(uses))
    res = torch.zeros(batch_size, *shape, dtype=dt, device=next(iter(_tensors(uses))).device)
    for u in uses:
        if isinstance(u, RowsUse):
            res += u.rows.to(dt).reshape(res.shape)
        elif isinstance(u, OuterUse):
            o, x = _cat_outer([u])
            res += torch.bmm(o.to(dt).transpose(1, 2), x.to(dt)).reshape(res.shape)
        else:
            add_sample_rows(res, u)
    return res


def _tensors(uses):
    for u in uses:
        yield u.rows if isinstance(u, RowsUse) else (u.out if isinstance(u, OuterUse) else u.g)


def _all_tensors(uses):
    """Every float tensor of the uses (their accumulation dtype is :func:`acc_dtype`'s)."""
    for u in uses:
        if isinstance(u, RowsUse):
            yield u.rows
        elif isinstance(u, OuterUse):
            yield from (u.out, u.inp)
        else:
            yield u.g


def param_norm_sq(
    uses: list, shape, batch_size: int, *, outer_fn=None, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Tensor:
    """Per-sample squared norm ``[B]`` of one parameter's gradient summed over all its uses
    (cross terms included): float32, or float64 if a use holds float64 tensors (a float64
    model); >= 0 or non-finite (rounding negatives clamped, :func:`clamp_norm_sq`).

    Args:
        uses: OuterUse / IndexUse / RowsUse entries of one parameter of shape ``shape``.
        outer_fn: optional ``fn(out, inp) -> [B]`` replacing :func:`outer_norm_sq` (the
            fused Triton kernel on CUDA); not used for float64 uses (the kernel
            accumulates in float32), which take the float64 reference.
    Raises: ValueError for an empty ``uses``."""
    if not uses:
        raise ValueError("param_norm_sq: no use of the parameter")
    outer = [u for u in uses if isinstance(u, OuterUse)]
    index = [u for u in uses if isinstance(u, IndexUse)]
    rows = [u for u in uses if isinstance(u, RowsUse)]
    dt = acc_dtype(*_all_tensors(uses))
    if rows and (outer or index):
        return rows_norm_sq(instantiate(uses, shape, batch_size))
    if rows:
        total = rows[0].rows.to(dt)
        for u in rows[1:]:
            total = total + u.rows.to(dt)
        return rows_norm_sq(total)
    res = torch.zeros(batch_size, dtype=dt, device=next(_tensors(uses)).device)
    if outer:
        o, x = _cat_outer(outer)
        method = outer_method(o.shape[1], x.shape[2], o.shape[2])
        if outer_fn is not None and method == "gram" and o.shape[1] > 1 and dt != torch.float64:
            res += outer_fn(o, x)
        else:
            res += outer_norm_sq(o, x, method=method, chunk_bytes=chunk_bytes)
    if index:
        ids, g = _cat_index(index)
        res += index_norm_sq(ids, g, index[0].num_rows)
        if outer:
            res += 2.0 * index_outer_cross(ids, g, o, x, chunk_bytes=chunk_bytes)
    return clamp_norm_sq(res)
