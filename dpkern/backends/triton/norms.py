"""Pass 1: per-sample gradient norms over all parameters (SPEC sections 2 and 7).

Stage 1 (``_sq_partial_kernel``): one multi-tensor launch per dtype/alignment group (see
``_common``); each program owns ``ITERS`` blocks of one tensor and, for every sample row b,
writes the sum of squares of its block to ``partial[b, slot]``. Every grad_sample byte
is read exactly once; for DP-MacAdam the program loads m_hat and b of its block once and
reuses them for all B rows (w_i = (g_i - m_hat) / b is never stored).
Stage 2 (``_sum_rows_kernel``): one program per sample adds its row of partial sums in a
fixed order and writes sqrt. No atomics anywhere: the result is deterministic, and equal
across runs with the same configuration (block sizes change the rounding only).

The partial buffer holds B x ceil(d / norm_block) floats (0.1% of the bytes read for
norm_block=1024 and fp32 grad_samples).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common as C


@triton.jit(do_not_specialize=["B", "n_slots", "slot0", "bc1"])
def _sq_partial_kernel(
    table,
    chunks,
    partial,
    B,
    n_slots,
    slot0,
    bc1,
    G_DTYPE: tl.constexpr,
    WHITEN: tl.constexpr,
    HAS_PREV: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    row, blk = C.chunk_row(table, chunks, pid)
    numel = C.row_numel(row, ALIGNED)
    has_g = tl.load(row + C.COL_G) != 0
    row_stride = n_slots.to(tl.int64)  # partial is [B, n_slots]
    g_ptr = C.typed_ptr(row, C.COL_G, G_DTYPE, ALIGNED)
    m_ptr = C.typed_ptr(row, C.COL_S0, tl.float32, ALIGNED)  # exp_avg
    b_ptr = C.typed_ptr(row, C.COL_S0 + 1, tl.float32, ALIGNED)  # scale
    for it in tl.static_range(ITERS):
        offs = (blk * ITERS + it) * BLOCK + tl.arange(0, BLOCK)
        inb = offs < numel
        load_g = (inb & has_g) != 0  # "!= 0": the interpreter widens bool & scalar-bool
        if WHITEN:
            scale = tl.load(b_ptr + offs, mask=inb, other=1.0)
            if HAS_PREV:
                m_hat = tl.load(m_ptr + offs, mask=inb, other=0.0) / bc1
            else:
                m_hat = tl.zeros([BLOCK], tl.float32)
        slot = slot0 + pid * ITERS + it
        for b0 in range(0, B, ROWS):  # ROWS rows unrolled: their loads in flight together
            for j in tl.static_range(ROWS):
                ld = (load_g & (b0 + j < B)) != 0
                x = tl.load(g_ptr + (b0 + j) * numel + offs, mask=ld, other=0.0).to(tl.float32)
                if WHITEN:
                    x = tl.where(inb, (x - m_hat) / scale, 0.0)
                tl.store(
                    partial + (b0 + j) * row_stride + slot, tl.sum(x * x, axis=0), mask=b0 + j < B
                )


@triton.jit(do_not_specialize=["n_slots"])
def _sum_rows_kernel(partial, out, n_slots, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float32)
    for s0 in range(0, n_slots, BLOCK):
        offs = s0 + tl.arange(0, BLOCK)
        acc += tl.load(partial + b * n_slots + offs, mask=offs < n_slots, other=0.0)
    tl.store(out + b, tl.math.sqrt_rn(tl.sum(acc, axis=0)))


def norms(
    grad_samples,
    batch_size: int,
    device,
    exp_avgs=None,
    scales=None,
    bias_correction1: float = 0.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """sqrt(sum_p ||x_p[i]||^2) for each row i, x = grad_sample or (for DP-MacAdam, when
    ``exp_avgs``/``scales`` are given) its whitened rows. ``out``: optional float32 [B]."""
    dev = C.check_device(device)
    if out is None:
        out = C.empty((batch_size,), torch.float32, dev)
    if batch_size == 0:
        return out
    whiten = exp_avgs is not None
    cfg = C.config()
    entries = []
    for k, gs in enumerate(grad_samples):
        if whiten:
            m, b = exp_avgs[k], scales[k]
            entries.append(
                C.Entry(k, m.numel(), 0, (None, C.readonly(gs), None, C.readonly(m), C.readonly(b)))
            )
        elif gs is not None:
            entries.append(C.Entry(k, gs[0].numel(), 0, (None, C.readonly(gs))))
    launches = C.plan(entries, typed=(1,), chunk=cfg.norm_block * cfg.norm_iters, device=dev)
    n_slots = sum(ln.n_chunks for ln in launches) * cfg.norm_iters
    partial = C.empty((batch_size, max(n_slots, 1)), torch.float32, dev)
    if n_slots == 0:
        partial.zero_()
    slot0 = 0
    for ln in launches:
        _sq_partial_kernel[(ln.n_chunks,)](
            ln.table,
            ln.chunks,
            partial,
            batch_size,
            n_slots,
            slot0,
            float(bias_correction1),
            G_DTYPE=C.tl_dtype(ln.dtypes[0]),
            WHITEN=whiten,
            HAS_PREV=bias_correction1 > 0,
            ALIGNED=ln.aligned,
            BLOCK=cfg.norm_block,
            ITERS=cfg.norm_iters,
            ROWS=cfg.rows_unroll,
            num_warps=cfg.num_warps,
        )
        slot0 += ln.n_chunks * cfg.norm_iters
    _sum_rows_kernel[(batch_size,)](
        partial, out, max(n_slots, 1), BLOCK=cfg.reduce_block, num_warps=cfg.num_warps
    )
    return out


def per_sample_norms(grad_samples, batch_size: int, device) -> torch.Tensor:
    """n_i = sqrt(sum_p ||grad_sample_p[i]||^2), fp32 accumulation: float32 ``[B]``."""
    return norms(grad_samples, batch_size, device)


def whitened_norms(
    grad_samples, exp_avgs, scales, bias_correction1: float, batch_size: int, device
) -> torch.Tensor:
    """||w_i|| over all coordinates, w_i = (g_i - m_hat_{t-1}) / b (DP-MacAdam pass 1)."""
    return norms(grad_samples, batch_size, device, exp_avgs, scales, bias_correction1)
