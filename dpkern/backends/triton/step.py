"""Pass 2: clip + sum + noise + moment update + parameter update in one kernel, for every
update rule of ``rules.py`` (SPEC sections 4, 5, 7); gradient accumulation; DP-MacAdam's
scale update.

One program owns one block of one parameter (multi-tensor launch, see ``_common``) and,
in the shared prologue of ``_step_kernel``:
  1. loads the block of the accumulated sum and (if the rule reads it) its first state;
  2. reads the per-sample column once: for each row i, c_i * x_i (x = grad_sample row, or
     the whitened row (g_i - m_hat)/b for a whitening rule, DP-MacAdam), skipping rows with
     c_i == 0 without reading them (so a NaN in a zeroed row never reaches the sum);
  3. draws the noise of its block in registers (``noise.tile_normals``);
  4. forms g_hat = (S + noise_std z) / B_e and loads the parameter;
then the rule's ``update_<name>`` (``rules.update``) updates the states and the parameter
in float32, and the prologue's epilogue stores the parameter (one rounding to its dtype:
to nearest even, or for bf16 with ``dp.stochastic_rounding`` stochastically with the
rounding stream's bits of the tile, SPEC 3.2).
Each input byte is read once and each output byte written once; the only temporaries
are the tables and, for DP-MacAdam, one float64 partial sum per block. A rule with a tensor
phase (DP-Adafactor, ``rules.TENSOR_PASSES``) instead stores g_hat into an fp32 scratch per
parameter, and its passes (row / column / tensor reductions, then the update) follow.

The rows are summed in order i = 0, 1, ..., whatever the block size, so every
element-wise result is bit-identical across configurations.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from ... import rules as registry
from . import _common as C
from . import rules as R
from ...hyper import ROUNDING_STREAM
from .noise import tile_normals, tile_rounding_bits


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


@triton.jit(do_not_specialize=["B", "slot0", "key_lo", "key_hi", "c2", "c3", "c3_round"])
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
    c3_round,
    noise_std,
    batch_e,
    bc1_prev,
    s0,
    s1,
    s2,
    s3,
    s4,
    s5,
    s6,
    s7,
    s8,
    s9,
    s10,
    s11,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    RULE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    HAS_GS: tl.constexpr,
    HAS_NOISE: tl.constexpr,
    ALIGNED: tl.constexpr,
    WHITEN: tl.constexpr,
    SCALE_COL: tl.constexpr,
    HAS_PREV: tl.constexpr,
    LOAD_M: tl.constexpr,
    SR: tl.constexpr,
    STORE_P: tl.constexpr,
    F0: tl.constexpr,
    F1: tl.constexpr,
    F2: tl.constexpr,
    F3: tl.constexpr,
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
    if LOAD_M:  # the first state (momentum_buffer / exp_avg)
        m_prev = tl.load(
            C.typed_ptr(row, C.COL_S0, tl.float32, ALIGNED) + offs, mask=inb, other=0.0
        )
    else:
        m_prev = tl.zeros([BLOCK], tl.float32)
    if WHITEN:  # DP-MacAdam: m_hat_{t-1} (of the first state) and b enter the whitening
        b_ptr = C.typed_ptr(row, C.COL_S0 + SCALE_COL, tl.float32, ALIGNED)  # scale
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
    if ACCUMULATE:  # the buffer is the summed column
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
        p = R.update(
            RULE,
            row,
            offs,
            inb,
            p,
            g,
            m_prev,
            m_hat_prev,
            scale,
            partial,
            slot0 + pid,
            s0,
            s1,
            s2,
            s3,
            s4,
            s5,
            s6,
            s7,
            s8,
            s9,
            s10,
            s11,
            F0,
            F1,
            F2,
            F3,
            ALIGNED,
        )
        if STORE_P:  # (not in update_rms_clip's pass A, SPEC 10.9: p is unchanged there)
            if SR:  # bf16, stochastic rounding (SPEC 3.2): the tile's bits, laid out as z's
                rho = tile_rounding_bits(
                    tl.load(row + C.COL_NOFF) + e0, key_lo, key_hi, c2, c3_round, BLOCK
                )
                tl.store(p_ptr + offs, C.to_bf16_sr(p, rho), mask=inb)
            else:
                tl.store(p_ptr + offs, C.to_dtype_rne(p, P_DTYPE, C.EMULATE_RNE), mask=inb)


@triton.jit
def _scale_kernel(
    table, chunks, kappa, noise_var, h1, h2, root, ALIGNED: tl.constexpr, BLOCK: tl.constexpr
):
    """b <- S_hat^(1/4) * root, root = (sum_j S_hat_j^(1/2))^(1/2) (SPEC section 7)."""
    row, blk = C.chunk_row(table, chunks, tl.program_id(0))
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    inb = offs < C.row_numel(row, ALIGNED)
    S_ptr = C.typed_ptr(row, C.COL_S0 + R.EXP_VAR, tl.float32, ALIGNED)
    b_ptr = C.typed_ptr(row, C.COL_S0 + R.SCALE, tl.float32, ALIGNED)
    s_hat = R.macadam_variance(
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
def _launch(
    hyper,
    dp,
    params,
    grad_samples,
    clip_factors,
    summed,
    states,
    offsets,
    accumulate_only: bool,
    rms_a: bool = False,
    tensor_out: list | None = None,
) -> float:
    """The fused step. ``rms_a``: update_rms_clip's pass A (SPEC 10.9); a rule with a
    tensor phase then appends (param index, g_hat / U scratch, noise offset, its tensor
    phase's result) per parameter to ``tensor_out``, for pass B."""
    args = R.kernel_args(hyper, dp)  # NotImplementedError for a rule without a kernel
    # a rule with a tensor phase (DP-Adafactor): the kernel stores g_hat into a scratch
    tensor_pass = None if accumulate_only else R.TENSOR_PASSES.get(hyper.rule)
    if rms_a and tensor_pass is None:  # pass A: F0 = RMS_A, one sum of U^2 per program
        args = dataclasses.replace(args, flags=(1, *args.flags[1:]), reduces=True)
    dev = C.first_device(params, *states.values(), summed)
    if dev is None:
        return 0.0  # no tensors at all
    C.check_device(dev)
    cfg = C.config()
    spec = registry.of(hyper)
    names = R.STATES[hyper.rule]  # the kernel's slot order, by name
    whiten = spec.whitening
    has_gs = clip_factors is not None
    inplace = C.InPlace()
    entries = []
    for k, p in enumerate(params):
        gs = C.readonly(grad_samples[k]) if has_gs else None
        if accumulate_only:
            if gs is None and not whiten:
                continue  # nothing to add
            bufs = (None, gs, inplace(summed[k]))
            bufs += tuple(C.readonly(states[n][k]) for n in names) if whiten else ()
            entries.append(C.Entry(k, summed[k].numel(), 0, bufs))
        else:
            bufs = (inplace(p), gs, C.readonly(summed[k]))
            bufs += tuple(inplace(states[n][k]) for n in names)
            if tensor_pass is not None:  # the fp32 scratch of g_hat, slot R.GHAT
                bufs += (C.empty(p.shape, torch.float32, p.device),)
            factors = registry.factor_sizes(p.shape)
            entries.append(C.Entry(k, p.numel(), int(offsets[k]), bufs, factors))
    block = cfg.step_block
    launches = C.plan(entries, typed=(0, 1), chunk=block, device=dev)
    reduces = args.reduces and not accumulate_only
    sr = dp.stochastic_rounding and not accumulate_only
    t = dp.step
    clip = C.readonly(clip_factors.to(torch.float32)) if has_gs else None
    B = clip.shape[0] if has_gs else 0
    n_total = sum(ln.n_chunks for ln in launches)
    partial = C.empty((max(n_total, 1),), torch.float64, dev) if reduces else None
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
            C.step_words(dp.noise_step, ROUNDING_STREAM)[1],  # c3 of the rounding stream
            dp.noise_std,
            dp.expected_batch_size,
            (1 - hyper.beta1 ** (t - 1)) if whiten and t > 1 else 1.0,  # bc1_prev
            *args.scalars,
            P_DTYPE=C.tl_dtype(ln.dtypes[0]),
            G_DTYPE=C.tl_dtype(ln.dtypes[1]),
            RULE=args.code,
            ACCUMULATE=accumulate_only,
            HAS_GS=has_gs,
            HAS_NOISE=dp.noise_std != 0,
            ALIGNED=ln.aligned,
            WHITEN=whiten,
            SCALE_COL=names.index("scale") if whiten else 0,
            HAS_PREV=t > 1,
            # the first state: read by the update (or, when accumulating, by the whitening)
            LOAD_M=(whiten and t > 1) if accumulate_only else args.load_first,
            SR=sr and ln.dtypes[0] == torch.bfloat16 and not rms_a,
            STORE_P=not rms_a,
            F0=args.flags[0],
            F1=args.flags[1],
            F2=args.flags[2],
            F3=args.flags[3],
            ROWS=cfg.rows_unroll,
            BLOCK=block,
            LIBDEVICE=C.LIBDEVICE,
            num_warps=cfg.num_warps,
        )
        slot0 += ln.n_chunks
    if tensor_pass is not None:
        noffs = [e.noise_offset for e in entries]
        done = tensor_pass(hyper, dp, [e.bufs for e in entries], noffs, apply=not rms_a)
        if rms_a:  # pass A: the sum over the group of ||U_hat||^2 / denom^2 (SPEC 10.9)
            inplace.finish()
            total = 0.0
            for e, noff, res in zip(entries, noffs, done, strict=True):
                if res is not None:
                    total += res[2] / (res[1] * res[1])
                    tensor_out.append((e.index, e.bufs[-1], noff, res))
            return total
    inplace.finish()
    if partial is None:
        return 0.0
    return float(partial[:n_total].sum()) if n_total else 0.0


def supports(rule: str) -> bool:
    """Whether this backend has a kernel for the update rule ``rule`` (``rules.RULES``)."""
    return R.supports(rule)


def supports_rms_clip(rule: str) -> bool:
    """Whether this backend implements ``update_rms_clip`` (SPEC 10.9) for ``rule``."""
    return rule in _RMS_CLIP_RULES


_RMS_CLIP_RULES = ("adamw", "adamw_bc", "adafactor")


def rms_clip_moments(hyper, dp, params, grad_samples, clip_factors, summed, states, offsets):
    """update_rms_clip's pass A (SPEC 10.9, ``reference.rms_clip_moments``): the fused
    prologue and the moments, no parameter write. Returns (the group's sum of U^2, the
    pending pass B for :func:`rms_clip_apply`)."""
    if not supports_rms_clip(hyper.rule):
        raise NotImplementedError(
            f"dpkern backend='triton' does not implement update_rms_clip for {hyper.rule!r}"
        )
    tensors = [] if hyper.rule in R.TENSOR_PASSES else None
    uu = _launch(
        hyper,
        dp,
        params,
        grad_samples,
        clip_factors,
        summed,
        states,
        offsets,
        accumulate_only=False,
        rms_a=True,
        tensor_out=tensors,
    )
    return uu, (hyper, dp, params, states, offsets, tensors)


def rms_clip_apply(pending, scale: float) -> None:
    """update_rms_clip's pass B (SPEC 10.9), s = ``scale``, no noise drawn: DP-AdamW(-BC)
    p <- p (1 - lr wd) - ((lr s) m_hat) / denom from the stored moments; DP-Adafactor
    p <- p (1 - lr wd) - ((alpha_t / denom) s) U from pass A's U (the step size a double
    rounded once, so s = 1 is the unclipped step bit for bit)."""
    hyper, dp, params, states, offsets, tensors = pending
    if tensors is not None:
        inplace = C.InPlace()
        for k, u, noff, (alpha, denom, _) in tensors:
            R.adafactor_apply(hyper, dp, inplace(params[k]), u, noff, (alpha / denom) * scale)
        inplace.finish()
        return
    dev = C.first_device(params, *states.values())
    if dev is None:
        return
    C.check_device(dev)
    cfg = C.config()
    names = R.STATES[hyper.rule]
    inplace = C.InPlace()
    entries = []
    for k, p in enumerate(params):
        bufs = (inplace(p), None, None) + tuple(C.readonly(states[n][k]) for n in names)
        entries.append(C.Entry(k, p.numel(), int(offsets[k]), bufs))
    t = dp.step
    bc = hyper.rule == "adamw_bc"
    phi_hat = dp.noise_var_avg / (1 - hyper.beta2**t) if bc else 0.0
    c2, c3 = C.step_words(dp.noise_step, ROUNDING_STREAM)
    for ln in C.plan(entries, typed=(0,), chunk=cfg.step_block, device=dev):
        sr = dp.stochastic_rounding and ln.dtypes[0] == torch.bfloat16
        R.rms_apply_kernel[(ln.n_chunks,)](
            ln.table,
            ln.chunks,
            hyper.lr * scale,
            1 - hyper.lr * hyper.weight_decay,
            1 - hyper.beta1**t,
            1 - hyper.beta2**t,
            getattr(hyper, "eps", 0.0),
            getattr(hyper, "gamma", 0.0),
            phi_hat,
            *(C.key_words(dp.key) if sr else (0, 0)),
            c2,
            c3,
            BC=bc,
            P_DTYPE=C.tl_dtype(ln.dtypes[0]),
            SR=sr,
            ALIGNED=ln.aligned,
            BLOCK=cfg.step_block,
            num_warps=cfg.num_warps,
        )
    inplace.finish()


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
    entries = []
    for k, (S, b) in enumerate(zip(exp_vars, scales, strict=True)):
        bufs = [None] * (3 + C.MAX_STATES)  # (param, grad_sample, summed, *states)
        bufs[3 + R.EXP_VAR.value], bufs[3 + R.SCALE.value] = C.readonly(S), inplace(b)
        entries.append(C.Entry(k, b.numel(), 0, tuple(bufs)))
    kappa, noise_var = R.macadam_scalars(hyper, dp)
    for ln in C.plan(entries, typed=(), chunk=cfg.step_block, device=dev):
        _scale_kernel[(ln.n_chunks,)](
            ln.table,
            ln.chunks,
            kappa,
            noise_var,
            hyper.h1,
            hyper.h2,
            math.sqrt(sqrt_sum),
            ALIGNED=ln.aligned,
            BLOCK=cfg.step_block,
            num_warps=cfg.num_warps,
        )
    inplace.finish()
