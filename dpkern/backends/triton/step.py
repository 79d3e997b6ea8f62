"""Pass 2: clip + sum + noise + moment update + parameter update in one kernel, for the six
update rules (SPEC sections 4, 5, 7); gradient accumulation; DP-MacAdam's scale update.

One program owns one block of one parameter (multi-tensor launch, see ``_common``) and:
  1. loads the block of the parameter, its states and (if any) the accumulated sum;
  2. reads the per-sample column once: for each row i, c_i * x_i (x = grad_sample row, or
     the whitened row (g_i - m_hat)/b for DP-MacAdam), skipping rows with c_i == 0
     without reading them (so a NaN in a zeroed row never reaches the sum);
  3. draws the noise of its block in registers (``noise.tile_normals``);
  4. forms g_hat = (S + noise_std z) / B_e and applies the update rule in float32;
  5. stores the parameter (one rounding to its dtype) and the states.
Each input byte is read once and each output byte written once; the only temporaries
are the tables and, for DP-MacAdam, one float64 partial sum per block.

Update-rule formulas follow ``reference.py`` operation by operation so that float32
rounding agrees closely. The rows are summed in order i = 0, 1, ..., whatever the block
size, so every element-wise result is bit-identical across configurations.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..reference import STATE_NAMES, macadam_kappa
from . import _common as C
from .noise import tile_normals

# RULE codes (constexpr): the update rule family compiled into a kernel
SGD, ADAM, MACADAM, ACCUMULATE = 0, 1, 2, 3
_RULE_CODE = {
    "sgd": SGD,
    "adam": ADAM,
    "adam_bc": ADAM,
    "adamw": ADAM,
    "adamw_bc": ADAM,
    "macadam": MACADAM,
}
_VARIANCE_CODE = {"unbiased": 0, "paper": 1, "code": 2}


@triton.jit
def _clipped_sum(
    g_ptr,
    has_g,
    clip_ptr,
    B,
    numel,
    offs,
    inb,
    m_hat_prev,
    scale,
    WHITEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """sum_i c_i x_i over the block, rows added in order i = 0, 1, ... (ROWS rows unrolled
    so that their loads are in flight together; rows past B have c = 0 and add +0.0);
    rows with c_i == 0 are not read."""
    acc = tl.zeros([BLOCK], tl.float32)
    for i0 in range(0, B, ROWS):
        for j in tl.static_range(ROWS):
            c = tl.load(clip_ptr + (i0 + j), mask=i0 + j < B, other=0.0)
            keep = c != 0
            ld = (inb & (has_g & keep)) != 0  # "!= 0": the interpreter widens bool & scalar-bool
            x = tl.load(g_ptr + (i0 + j) * numel + offs, mask=ld, other=0.0).to(tl.float32)
            if WHITEN:
                x = (x - m_hat_prev) / scale
            acc += tl.where(keep, c * x, 0.0)
    return acc


@triton.jit(do_not_specialize=["B", "slot0", "key_lo", "key_hi", "c2", "c3"])
def _step_kernel(
    table,
    chunks,
    clip_ptr,
    partial,
    B,
    slot0,
    key_lo,
    key_hi,
    c2,
    c3,
    noise_std,
    batch_e,
    lr,
    wd,
    momentum,
    one_m_damp,
    decay,
    beta1,
    beta2,
    one_m_b1,
    one_m_b2,
    bc1,
    bc2,
    bc1_prev,
    eps,
    phi_hat,
    kappa,
    noise_var,
    h1,
    h2,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    RULE: tl.constexpr,
    HAS_GS: tl.constexpr,
    HAS_NOISE: tl.constexpr,
    ALIGNED: tl.constexpr,
    COUPLED_WD: tl.constexpr,
    DECOUPLED: tl.constexpr,
    BC: tl.constexpr,
    MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    FIRST: tl.constexpr,
    HAS_PREV: tl.constexpr,
    VARIANCE: tl.constexpr,
    RET_SUM: tl.constexpr,
    WHITEN: tl.constexpr,
    LOAD_M: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    pid = tl.program_id(0)
    row, blk = C.chunk_row(table, chunks, pid)
    numel = C.row_numel(row, ALIGNED)
    if ALIGNED:  # aligned groups have even noise offsets: no phase shift
        e0 = blk * BLOCK
        offs = e0 + tl.arange(0, BLOCK)
        inb = offs < numel
    else:  # the tile starts one element early when the tensor's first index is odd
        e0 = blk * BLOCK - tl.load(row + C.COL_PHASE)
        offs = e0 + tl.arange(0, BLOCK)
        inb = (offs >= 0) & (offs < numel)
    s_ptr = C.typed_ptr(row, C.COL_S0, tl.float32, ALIGNED)  # momentum_buffer / exp_avg
    if LOAD_M:
        m_prev = tl.load(s_ptr + offs, mask=inb, other=0.0)
    else:
        m_prev = tl.zeros([BLOCK], tl.float32)
    if WHITEN:  # DP-MacAdam: m_hat_{t-1} and b enter the whitening
        b_ptr = C.typed_ptr(row, C.COL_S0 + 3, tl.float32, ALIGNED)  # scale
        scale = tl.load(b_ptr + offs, mask=inb, other=1.0)
        if HAS_PREV:
            m_hat_prev = m_prev / bc1_prev
        else:
            m_hat_prev = tl.zeros([BLOCK], tl.float32)
    else:
        scale = 1.0
        m_hat_prev = 0.0

    # S = summed + sum_i c_i x_i (reference order)
    sum_addr = tl.load(row + C.COL_SUM)
    sum_ptr = C.typed_ptr(row, C.COL_SUM, tl.float32, ALIGNED)
    S = tl.load(sum_ptr + offs, mask=(inb & (sum_addr != 0)) != 0, other=0.0)
    if HAS_GS:
        g_ptr = C.typed_ptr(row, C.COL_G, G_DTYPE, ALIGNED)
        has_g = tl.load(row + C.COL_G) != 0
        S = S + _clipped_sum(
            g_ptr, has_g, clip_ptr, B, numel, offs, inb, m_hat_prev, scale, WHITEN, BLOCK, ROWS
        )
    if RULE == 3:  # ACCUMULATE: the buffer is the summed column
        tl.store(sum_ptr + offs, S, mask=inb)
    else:
        if HAS_NOISE:
            z = tile_normals(
                tl.load(row + C.COL_NOFF) + e0, key_lo, key_hi, c2, c3, BLOCK, LIBDEVICE
            )
            S = S + noise_std * z
        g = S / batch_e
        p_ptr = C.typed_ptr(row, C.COL_P, P_DTYPE, ALIGNED)
        p = tl.load(p_ptr + offs, mask=inb, other=0.0).to(tl.float32)
        if RULE == 0:  # SGD (SPEC 5.1)
            if COUPLED_WD:
                g = g + wd * p
            if MOMENTUM:
                if FIRST:
                    buf = g
                else:
                    buf = m_prev * momentum + one_m_damp * g
                tl.store(s_ptr + offs, buf, mask=inb)
                if NESTEROV:
                    g = g + momentum * buf
                else:
                    g = buf
            p = p - lr * g
        else:  # the Adam family and MacAdam
            v_ptr = C.typed_ptr(row, C.COL_S0 + 1, tl.float32, ALIGNED)
            v = tl.load(v_ptr + offs, mask=inb, other=0.0)
            if RULE == 2:
                g = scale * g + m_hat_prev  # back to gradient scale
            elif DECOUPLED:
                p = p * decay
            elif COUPLED_WD:
                g = g + wd * p
            m = m_prev * beta1 + one_m_b1 * g
            v = v * beta2 + one_m_b2 * g * g
            tl.store(s_ptr + offs, m, mask=inb)
            tl.store(v_ptr + offs, v, mask=inb)
            m_hat = m / bc1
            v_hat = v / bc2
            if BC:
                denom = tl.math.sqrt_rn(tl.maximum(v_hat - phi_hat, eps))
            else:
                denom = tl.math.sqrt_rn(v_hat) + eps  # eps is gamma for MacAdam
            p = p - lr * m_hat / denom
            if RULE == 2:
                S_ptr = C.typed_ptr(row, C.COL_S0 + 2, tl.float32, ALIGNED)  # exp_var
                if VARIANCE == 0:
                    u = (g - m_hat_prev) * (g - m_hat)
                elif VARIANCE == 1:
                    u = (g - m_hat) * (g - m_hat)
                else:
                    u = (g - m_hat_prev) * (g - m_hat_prev)
                var = tl.load(S_ptr + offs, mask=inb, other=0.0) * beta1 + one_m_b1 * u
                tl.store(S_ptr + offs, var, mask=inb)
                if RET_SUM:
                    s_hat = _macadam_variance(var, scale, kappa, noise_var, h1, h2)
                    r = tl.where(inb, tl.math.sqrt_rn(s_hat), 0.0).to(tl.float64)
                    tl.store(partial + slot0 + pid, tl.sum(r, axis=0))
        tl.store(p_ptr + offs, C.to_dtype_rne(p, P_DTYPE, C.EMULATE_RNE), mask=inb)


@triton.jit
def _macadam_variance(var, scale, kappa, noise_var, h1, h2):
    """S_hat = clamp(S / kappa_t - b^2 sigma^2 / B_e^2, h1, h2) (SPEC section 7)."""
    return tl.minimum(tl.maximum(var / kappa - scale * scale * noise_var, h1), h2)


@triton.jit
def _scale_kernel(
    table, chunks, kappa, noise_var, h1, h2, root, ALIGNED: tl.constexpr, BLOCK: tl.constexpr
):
    """b <- S_hat^(1/4) * root, root = (sum_j S_hat_j^(1/2))^(1/2) (SPEC section 7)."""
    row, blk = C.chunk_row(table, chunks, tl.program_id(0))
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    inb = offs < C.row_numel(row, ALIGNED)
    S_ptr = C.typed_ptr(row, C.COL_S0 + 2, tl.float32, ALIGNED)
    b_ptr = C.typed_ptr(row, C.COL_S0 + 3, tl.float32, ALIGNED)
    s_hat = _macadam_variance(
        tl.load(S_ptr + offs, mask=inb, other=1.0),
        tl.load(b_ptr + offs, mask=inb, other=1.0),
        kappa,
        noise_var,
        h1,
        h2,
    )
    tl.store(b_ptr + offs, tl.math.sqrt_rn(tl.math.sqrt_rn(s_hat)) * root, mask=inb)


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------
def _scalars(hyper, dp) -> dict:
    """Float scalars of the kernel, computed in Python (double) as the reference does."""
    t, h = dp.step, hyper
    beta1 = getattr(h, "beta1", 0.0)
    beta2 = getattr(h, "beta2", 0.0)
    wd = getattr(h, "weight_decay", 0.0)
    be = dp.expected_batch_size
    return dict(
        noise_std=dp.noise_std,
        batch_e=be,
        lr=h.lr,
        wd=wd,
        momentum=getattr(h, "momentum", 0.0),
        one_m_damp=1 - getattr(h, "dampening", 0.0),
        decay=1 - h.lr * wd,
        beta1=beta1,
        beta2=beta2,
        one_m_b1=1 - beta1,
        one_m_b2=1 - beta2,
        bc1=1 - beta1**t,
        bc2=1 - beta2**t,
        bc1_prev=(1 - beta1 ** (t - 1)) if t > 1 else 1.0,
        # eps slot: eps (Adam), gamma (BC variants: the floor inside the sqrt; MacAdam: outside)
        eps=getattr(h, "eps", getattr(h, "gamma", 1.0)),
        phi_hat=dp.noise_var_avg / (1 - beta2**t),
        kappa=macadam_kappa(beta1, t) if t > 1 else 1.0,
        noise_var=(dp.noise_std / be) ** 2,
        h1=getattr(h, "h1", 0.0),
        h2=getattr(h, "h2", 0.0),
    )


def _flags(hyper, dp) -> dict:
    rule, t = hyper.rule, dp.step
    return dict(
        RULE=_RULE_CODE[rule],
        COUPLED_WD=rule in ("sgd", "adam", "adam_bc") and hyper.weight_decay != 0,
        DECOUPLED=rule in ("adamw", "adamw_bc"),
        BC=rule in ("adam_bc", "adamw_bc"),
        MOMENTUM=rule == "sgd" and hyper.momentum != 0,
        NESTEROV=rule == "sgd" and hyper.nesterov,
        FIRST=t == 1,
        HAS_PREV=t > 1,
        VARIANCE=_VARIANCE_CODE[getattr(hyper, "variance_estimate", "unbiased")],
        RET_SUM=rule == "macadam" and t >= 2,
        WHITEN=rule == "macadam",
        # the first state (momentum buffer / exp_avg) is read unless SGD overwrites it
        LOAD_M=rule != "sgd" or (hyper.momentum != 0 and t > 1),
    )


def _launch(
    hyper, dp, params, grad_samples, clip_factors, summed, states, offsets, accumulate_only: bool
) -> float:
    dev = C.first_device(params, *states.values(), summed)
    if dev is None:
        return 0.0  # no tensors at all
    C.check_device(dev)
    cfg = C.config()
    names = STATE_NAMES[hyper.rule]
    macadam = hyper.rule == "macadam"
    has_gs = clip_factors is not None
    inplace = C.InPlace()
    entries = []
    for k, p in enumerate(params):
        gs = C.readonly(grad_samples[k]) if has_gs else None
        if accumulate_only:
            if gs is None and not macadam:
                continue  # nothing to add
            bufs = (None, gs, inplace(summed[k]))
            bufs += tuple(C.readonly(states[n][k]) for n in names) if macadam else ()
            entries.append(C.Entry(k, summed[k].numel(), 0, bufs))
        else:
            bufs = (inplace(p), gs, C.readonly(summed[k]))
            bufs += tuple(inplace(states[n][k]) for n in names)
            entries.append(C.Entry(k, p.numel(), int(offsets[k]), bufs))
    block = cfg.step_block
    launches = C.plan(entries, typed=(0, 1), chunk=block, device=dev)
    flags = _flags(hyper, dp)
    if accumulate_only:
        flags.update(RULE=ACCUMULATE, RET_SUM=False, LOAD_M=macadam and dp.step > 1)
    scalars = _scalars(hyper, dp)
    clip = C.readonly(clip_factors.to(torch.float32)) if has_gs else None
    B = clip.shape[0] if has_gs else 0
    n_total = sum(ln.n_chunks for ln in launches)
    partial = C.empty((max(n_total, 1),), torch.float64, dev) if flags["RET_SUM"] else None
    slot0 = 0
    for ln in launches:
        _step_kernel[(ln.n_chunks,)](
            ln.table,
            ln.chunks,
            clip if has_gs else ln.table,
            partial if partial is not None else ln.table,
            B,
            slot0,
            *C.key_words(dp.key),
            *C.step_words(dp.noise_step, dp.stream),
            **scalars,
            P_DTYPE=C.tl_dtype(ln.dtypes[0]),
            G_DTYPE=C.tl_dtype(ln.dtypes[1]),
            HAS_GS=has_gs,
            HAS_NOISE=dp.noise_std != 0,
            ALIGNED=ln.aligned,
            ROWS=cfg.rows_unroll,
            BLOCK=block,
            LIBDEVICE=C.LIBDEVICE,
            num_warps=cfg.num_warps,
            **flags,
        )
        slot0 += ln.n_chunks
    inplace.finish()
    if partial is None:
        return 0.0
    return float(partial[:n_total].sum()) if n_total else 0.0


def step(hyper, dp, params, grad_samples, clip_factors, summed, states, offsets) -> float:
    """One DP step of one parameter group, in place on ``params`` and ``states``
    (see ``reference.step``). Returns DP-MacAdam's partial sum of sqrt(S_hat_j)."""
    return _launch(
        hyper,
        dp,
        params,
        grad_samples,
        clip_factors,
        summed,
        states,
        offsets,
        accumulate_only=False,
    )


def accumulate(hyper, dp, grad_samples, clip_factors, buffers, states) -> None:
    """buffers[k] += sum_i c_i x_i (x = per-sample gradient, or whitened for MacAdam)."""
    _launch(
        hyper,
        dp,
        [None] * len(buffers),
        grad_samples,
        clip_factors,
        buffers,
        states,
        [0] * len(buffers),
        accumulate_only=True,
    )


def macadam_update_scale(hyper, dp, exp_vars, scales, sqrt_sum: float) -> None:
    """b <- S_hat^(1/4) * (sum_j S_hat_j^(1/2))^(1/2) for every parameter (t >= 2)."""
    if dp.step < 2:
        return
    dev = C.first_device(scales)
    if dev is None:
        return
    C.check_device(dev)
    cfg = C.config()
    inplace = C.InPlace()
    entries = [
        C.Entry(k, b.numel(), 0, (None, None, None, None, None, C.readonly(S), inplace(b)))
        for k, (S, b) in enumerate(zip(exp_vars, scales))
    ]
    s = _scalars(hyper, dp)
    for ln in C.plan(entries, typed=(), chunk=cfg.step_block, device=dev):
        _scale_kernel[(ln.n_chunks,)](
            ln.table,
            ln.chunks,
            s["kappa"],
            s["noise_var"],
            s["h1"],
            s["h2"],
            math.sqrt(sqrt_sum),
            ALIGNED=ln.aligned,
            BLOCK=cfg.step_block,
            num_warps=cfg.num_warps,
        )
    inplace.finish()
