"""Fused Triton ghost-norm kernel for the Linear Gram path.

For each sample i, ``||out_i^T inp_i||_F^2 = sum_{s,t} (out_s . out_t)(inp_s . inp_t)``
(:func:`dpkern.ghost.norms.outer_norm_sq`, Gram path). Program ``(i, S)`` owns the row tile
S of sample i and walks the column tiles U >= S (the Grams are symmetric: off-diagonal tile
pairs count twice). For each pair it accumulates both ``BLOCK_T x BLOCK_T`` Gram tiles in
fp32 registers over the feature dimensions (``tl.dot`` with ``input_precision="ieee"``: no
TF32, which would under-estimate norms and let a sample exceed C), multiplies them
elementwise and adds the product into a register accumulator. No T x T matrix is ever
written: each program stores one float, ``partial[i, S]``, and a second stage sums each
row of ``partial`` in a fixed order. No atomics: deterministic, run to run.

The result is clamped at 0 (:func:`dpkern.ghost.norms.clamp_norm_sq`): the Gram sum's terms
cancel, so float32 rounding can make a tiny squared norm slightly negative, and its square
root would be a NaN (a finite sample reported non-finite). NaN / Inf are kept. Float64
inputs are not narrowed to the kernel's float32: they take the float64 reference
(:func:`dpkern.ghost.norms.outer_norm_sq`, Gram path).

``input_precision="ieee"`` is accepted by Triton 3.0 and later (3.6 in the GPU image, 3.9
here); the deprecated ``allow_tf32=False`` is not used. On CPU tensors the kernel runs only
under ``TRITON_INTERPRET=1`` (tests); ``dpkern.ghost`` uses it for CUDA tensors.

Source: the Gram identity of Li et al. 2022 (arXiv 2110.05679, ghost clipping for
sequences); the tiling is dpkern's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .norms import clamp_norm_sq, outer_norm_sq

__all__ = ["gram_norm_sq", "BLOCK_T", "BLOCK_K"]

BLOCK_T = 32  # tokens per Gram tile side
BLOCK_K = 32  # features per step of the inner products


@triton.jit
def _gram_tile(
    x_ptr, stride_t, stride_k, rows_s, rows_u, T, K, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr
):
    """fp32 tile ``X[rows_s] @ X[rows_u]^T`` of one sample (x_ptr at its row 0)."""
    acc = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kin = ks < K
        a = tl.load(
            x_ptr + rows_s[:, None] * stride_t + ks[None, :] * stride_k,
            mask=(rows_s[:, None] < T) & kin[None, :],
            other=0.0,
        ).to(tl.float32)
        b = tl.load(
            x_ptr + rows_u[None, :] * stride_t + ks[:, None] * stride_k,
            mask=(rows_u[None, :] < T) & kin[:, None],
            other=0.0,
        ).to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def _ghost_norm_kernel(
    o_ptr,
    x_ptr,
    partial,
    T,
    P0,
    P1,
    so_b,
    so_t,
    so_k,
    sx_b,
    sx_t,
    sx_k,
    n_tiles,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    s_tile = tl.program_id(1)
    o_base = o_ptr + i * so_b
    x_base = x_ptr + i * sx_b
    rows_s = (s_tile * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
    for u_tile in range(s_tile, n_tiles):
        rows_u = (u_tile * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        go = _gram_tile(o_base, so_t, so_k, rows_s, rows_u, T, P0, BLOCK_T, BLOCK_K)
        gx = _gram_tile(x_base, sx_t, sx_k, rows_s, rows_u, T, P1, BLOCK_T, BLOCK_K)
        w = tl.where(u_tile == s_tile, 1.0, 2.0)
        acc += w * (go * gx)
    tl.store(partial + i * n_tiles + s_tile, tl.sum(tl.sum(acc, axis=1), axis=0))


@triton.jit
def _sum_rows_kernel(partial, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s0 in range(0, n, BLOCK):
        offs = s0 + tl.arange(0, BLOCK)
        acc += tl.load(partial + i * n + offs, mask=offs < n, other=0.0)
    tl.store(out + i, tl.sum(acc, axis=0))


def gram_norm_sq(
    out: torch.Tensor, inp: torch.Tensor, *, block_t: int = BLOCK_T, block_k: int = BLOCK_K
) -> torch.Tensor:
    """Per-sample ``||sum_t out[i,t] (x) inp[i,t]||_F^2`` by the fused Gram kernel.

    Args:
        out: ``[B, T, P0]``, inp: ``[B, T, P1]``: float32/float16/bfloat16, same device
            (CUDA, or CPU under ``TRITON_INTERPRET=1``), any strides. Float64 inputs are
            computed by the float64 PyTorch reference instead (no kernel).
        block_t, block_k: tile sizes (powers of two >= 16).
    Returns: float32 ``[B]`` (fp32 accumulation, no TF32; deterministic), float64 for
        float64 inputs; >= 0 or non-finite (rounding negatives clamped to 0).
    Raises: ValueError for mismatched shapes or bad tile sizes.
    """
    if out.dim() != 3 or inp.dim() != 3 or out.shape[:2] != inp.shape[:2]:
        raise ValueError(
            f"gram_norm_sq: expected [B, T, P0] and [B, T, P1], got "
            f"{tuple(out.shape)} and {tuple(inp.shape)}"
        )
    for name, v in (("block_t", block_t), ("block_k", block_k)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"gram_norm_sq: {name}={v} must be a power of two >= 16")
    if out.dtype == torch.float64 or inp.dtype == torch.float64:
        return outer_norm_sq(out, inp, method="gram")
    B, T, P0 = out.shape
    P1 = inp.shape[2]
    res = torch.zeros(B, dtype=torch.float32, device=out.device)
    if B == 0 or T == 0:
        return res
    n_tiles = triton.cdiv(T, block_t)
    partial = torch.empty(B, n_tiles, dtype=torch.float32, device=out.device)
    _ghost_norm_kernel[(B, n_tiles)](
        out,
        inp,
        partial,
        T,
        P0,
        P1,
        *out.stride(),
        *inp.stride(),
        n_tiles,
        BLOCK_T=block_t,
        BLOCK_K=block_k,
    )
    _sum_rows_kernel[(B,)](
        partial, res, n_tiles, BLOCK=max(16, triton.next_power_of_2(min(n_tiles, 1024)))
    )
    return clamp_norm_sq(res)
