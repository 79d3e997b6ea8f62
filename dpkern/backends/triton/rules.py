"""The update rules of the Triton backend: one ``@triton.jit`` ``update_<name>`` per rule of
:mod:`dpkern.rules`, named like the reference's (``reference.update_<name>``) and the C++
ones (``csrc/rules.h``), each next to its host side (the scalars and flags it is compiled
and launched with), and the dispatch :func:`update` that the fused kernel of ``step.py``
calls after its shared prologue (clipped sum, noise, g_hat).

An update function gets the table row of its tensor (its states are columns
``COL_S0 + slot``, the slots named below), the block's offsets and mask, the fp32
parameter block ``p``, the privatised gradient ``g``, the first state's block ``m_prev``
(loaded by the prologue when ``load_first``), then its own scalars and flags; it stores its
states and returns the updated ``p``. Formulas follow ``reference.py`` operation by
operation.

Everything is found by name: :data:`RULES` maps a rule's name to its host side and
:data:`STATES` to its state names in slot order (the host puts each buffer in its slot by
name; the names are checked against the registry at import). A registered rule without an
entry here is refused by the backend (``supports``).
"""

from __future__ import annotations

import dataclasses
import struct

import triton
import triton.language as tl

from ... import rules
from . import _common as C
from .noise import rounding_bits_at, tile_rounding_bits

# Rule codes (constexpr): which update function a kernel is compiled with.
SGD = tl.constexpr(0)
ADAM = tl.constexpr(1)
ADAM_BC = tl.constexpr(2)
ADAMW = tl.constexpr(3)
ADAMW_BC = tl.constexpr(4)
MACADAM = tl.constexpr(5)
SGD_SCHEDULE_FREE = tl.constexpr(13)
ADAMW_SCHEDULE_FREE = tl.constexpr(14)
RMSPROP = tl.constexpr(6)
ADAGRAD = tl.constexpr(7)
ADADELTA = tl.constexpr(10)
ADEMAMIX = tl.constexpr(11)
RADAM = tl.constexpr(8)
LION = tl.constexpr(9)
ADAFACTOR = tl.constexpr(12)
# DP-MacAdam's variance term u (constexpr), by name.
UNBIASED, PAPER, CODE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
VARIANCE_CODES = {"unbiased": UNBIASED.value, "paper": PAPER.value, "code": CODE.value}

#: rule name -> its kernel states in slot order (table column COL_S0 + slot).
STATES = {
    "sgd": ("momentum_buffer",),
    "adam": ("exp_avg", "exp_avg_sq"),
    "adam_bc": ("exp_avg", "exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq"),
    "adamw_bc": ("exp_avg", "exp_avg_sq"),
    "macadam": ("exp_avg", "exp_avg_sq", "exp_var", "scale"),
    "sgd_schedule_free": ("z",),
    "adamw_schedule_free": ("z", "exp_avg_sq"),
    "rmsprop": ("square_avg", "momentum_buffer", "grad_avg"),
    "adagrad": ("sum",),
    "adadelta": ("square_avg", "acc_delta", "acc_delta_noise_var"),
    "ademamix": ("exp_avg", "exp_avg_sq", "exp_avg_slow"),
    "radam": ("exp_avg", "exp_avg_sq"),
    "lion": ("exp_avg",),
    "adafactor": ("row_var", "col_var"),
}
# The slots the update functions use, by state name.
MOMENTUM_BUFFER = tl.constexpr(STATES["sgd"].index("momentum_buffer"))
EXP_AVG = tl.constexpr(STATES["adam"].index("exp_avg"))  # the first state (m_prev)
EXP_AVG_SQ = tl.constexpr(STATES["adam"].index("exp_avg_sq"))
EXP_VAR = tl.constexpr(STATES["macadam"].index("exp_var"))
SCALE = tl.constexpr(STATES["macadam"].index("scale"))
SQUARE_AVG = tl.constexpr(STATES["rmsprop"].index("square_avg"))  # the first state (m_prev)
RMS_MOMENTUM_BUFFER = tl.constexpr(STATES["rmsprop"].index("momentum_buffer"))
GRAD_AVG = tl.constexpr(STATES["rmsprop"].index("grad_avg"))
SUM = tl.constexpr(STATES["adagrad"].index("sum"))  # the first state (m_prev)
SQUARE_AVG = tl.constexpr(STATES["adadelta"].index("square_avg"))  # the first state (m_prev)
ACC_DELTA = tl.constexpr(STATES["adadelta"].index("acc_delta"))
ACC_DELTA_NOISE_VAR = tl.constexpr(STATES["adadelta"].index("acc_delta_noise_var"))
EXP_AVG_SLOW = tl.constexpr(STATES["ademamix"].index("exp_avg_slow"))
# DP-Adafactor's fp32 scratch of g_hat: the buffer after its states (step.py puts it there)
GHAT = tl.constexpr(len(STATES["adafactor"]))
N_SCALARS = 12  # float scalars s0 .. s11 of the kernel, meaning set by each rule
N_FLAGS = 4  # constexpr ints F0 .. F3, meaning set by each rule


@dataclasses.dataclass(frozen=True)
class KernelArgs:
    """How one rule's kernel is compiled and launched for one step."""

    code: int
    scalars: tuple  # floats, in the order of update_<name>'s scalar parameters
    flags: tuple  # ints, in the order of update_<name>'s constexpr flags
    load_first: bool  # the prologue loads the first state (m_prev)
    reduces: bool  # the update stores one float64 partial sum per program


# --------------------------------------------------------------------------------------
# DP-SGD (SPEC 5.1)
# --------------------------------------------------------------------------------------
@triton.jit
def update_sgd(
    row,
    offs,
    inb,
    p,
    g,
    m_prev,
    lr,
    wd,
    momentum,
    one_m_damp,
    COUPLED_WD: tl.constexpr,
    MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    FIRST: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    if COUPLED_WD:
        g = g + wd * p
    if MOMENTUM:
        if FIRST:
            buf = g
        else:
            buf = m_prev * momentum + one_m_damp * g
        buf_ptr = C.typed_ptr(row, C.COL_S0 + MOMENTUM_BUFFER, tl.float32, ALIGNED)
        tl.store(buf_ptr + offs, buf, mask=inb)
        if NESTEROV:
            g = g + momentum * buf
        else:
            g = buf
    return p - lr * g


def _host_sgd(h, dp) -> KernelArgs:
    flags = (h.weight_decay != 0, h.momentum != 0, h.nesterov, dp.step == 1)
    scalars = (h.lr, h.weight_decay, h.momentum, 1 - h.dampening)
    load = h.momentum != 0 and dp.step > 1  # buf = g at the first step: not read
    return KernelArgs(SGD.value, scalars, flags, load, False)


# --------------------------------------------------------------------------------------
# The Adam family (SPEC 5.2 - 5.5)
# --------------------------------------------------------------------------------------
@triton.jit
def _adam_moments(row, offs, inb, g, m_prev, beta1, beta2, one_m_b1, one_m_b2, bc1, bc2, ALIGNED):
    """m, v EMAs (stored) and (m_hat, v_hat); m_prev is exp_avg's block."""
    v_ptr = C.typed_ptr(row, C.COL_S0 + EXP_AVG_SQ, tl.float32, ALIGNED)
    v = tl.load(v_ptr + offs, mask=inb, other=0.0)
    m = m_prev * beta1 + one_m_b1 * g
    v = v * beta2 + one_m_b2 * g * g
    tl.store(C.typed_ptr(row, C.COL_S0 + EXP_AVG, tl.float32, ALIGNED) + offs, m, mask=inb)
    tl.store(v_ptr + offs, v, mask=inb)
    return m / bc1, v / bc2


@triton.jit
def update_adam(
    row,
    offs,
    inb,
    p,
    g,
    m_prev,
    lr,
    wd,
    beta1,
    beta2,
    one_m_b1,
    one_m_b2,
    bc1,
    bc2,
    eps,
    COUPLED_WD: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    if COUPLED_WD:
        g = g + wd * p
    m_hat, v_hat = _adam_moments(
        row, offs, inb, g, m_prev, beta1, beta2, one_m_b1, one_m_b2, bc1, bc2, ALIGNED
    )
    return p - lr * m_hat / (tl.math.sqrt_rn(v_hat) + eps)


@triton.jit
def update_adam_bc(
    row,
    offs,
    inb,
    p,
    g,
    m_prev,
    lr,
    wd,
    beta1,
    beta2,
    one_m_b1,
    one_m_b2,
    bc1,
    bc2,
    gamma,
    phi_hat,
    COUPLED_WD: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    if COUPLED_WD:
        g = g + wd * p
    m_hat, v_hat = _adam_moments(
        row, offs, inb, g, m_prev, beta1, beta2, one_m_b1, one_m_b2, bc1, bc2, ALIGNED
    )
    return p - lr * m_hat / tl.math.sqrt_rn(tl.maximum(v_hat - phi_hat, gamma))


@triton.jit
def _rms_partial(partial, slot, inb, u):
    """update_rms_clip's pass A (SPEC 10.9): the program's sum of U^2 (float64 terms of
    float32 squares)."""
    tl.store(partial + slot, tl.sum(tl.where(inb, (u * u).to(tl.float64), 0.0), axis=0))


@triton.jit
def update_adamw(
    row,
    offs,
    inb,
    p,
    g,
    m_prev,
    lr,
    decay,
    beta1,
    beta2,
    one_m_b1,
    one_m_b2,
    bc1,
    bc2,
    eps,
    partial,
    slot,
    RMS_A: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    m_hat, v_hat = _adam_moments(
        row, offs, inb, g, m_prev, beta1, beta2, one_m_b1, one_m_b2, bc1, bc2, ALIGNED
    )
    denom = tl.math.sqrt_rn(v_hat) + eps
    if RMS_A:  # update_rms_clip's pass A: the sum of U^2, the parameter unchanged
        _rms_partial(partial, slot, inb, m_hat / denom)
        out = p
    else:
        out = p * decay - lr * m_hat / denom
    return out


@triton.jit
def update_adamw_bc(
    row,
    offs,
    inb,
    p,
    g,
    m_prev,
    lr,
    decay,
    beta1,
    beta2,
    one_m_b1,
    one_m_b2,
    bc1,
    bc2,
    gamma,
    phi_hat,
    partial,
    slot,
    RMS_A: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    m_hat, v_hat = _adam_moments(
        row, offs, inb, g, m_prev, beta1, beta2, one_m_b1, one_m_b2, bc1, bc2, ALIGNED
    )
    denom = tl.math.sqrt_rn(tl.maximum(v_hat - phi_hat, gamma))
    if RMS_A:
        _rms_partial(partial, slot, inb, m_hat / denom)
        out = p
    else:
        out = p * decay - lr * m_hat / denom
    return out


@triton.jit(do_not_specialize=["key_lo", "key_hi", "c2", "c3"])
def rms_apply_kernel(table, chunks, lr, decay, bc1, bc2, eps, gamma, phi_hat, key_lo, key_hi,
                     c2, c3, BC: tl.constexpr, P_DTYPE: tl.constexpr, SR: tl.constexpr,
                     ALIGNED: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """update_rms_clip's pass B (SPEC 10.9), DP-AdamW / DP-AdamW-BC: p <- p (1 - lr wd) -
    ((lr s) m_hat) / denom from the stored moments (``lr`` holds lr * s), the tiles laid
    out as the step kernel's (the rounding bits of SR alike)."""
    row, blk = C.chunk_row(table, chunks, tl.program_id(0))
    numel = C.row_numel(row, ALIGNED)
    if ALIGNED:
        e0 = blk * BLOCK
        offs = e0 + tl.arange(0, BLOCK)
        inb = offs < numel
    else:
        e0 = blk * BLOCK - tl.load(row + C.COL_PHASE)
        offs = e0 + tl.arange(0, BLOCK)
        inb = (offs >= 0) & (offs < numel)
    p_ptr = C.typed_ptr(row, C.COL_P, P_DTYPE, ALIGNED)
    p = tl.load(p_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    m = tl.load(
        C.typed_ptr(row, C.COL_S0 + EXP_AVG, tl.float32, ALIGNED) + offs, mask=inb, other=0.0
    )
    v = tl.load(C.typed_ptr(row, C.COL_S0 + EXP_AVG_SQ, tl.float32, ALIGNED) + offs, mask=inb,
                other=0.0)  # fmt: skip
    m_hat, v_hat = m / bc1, v / bc2
    if BC:
        denom = tl.math.sqrt_rn(tl.maximum(v_hat - phi_hat, gamma))
    else:
        denom = tl.math.sqrt_rn(v_hat) + eps
    p = p * decay - lr * m_hat / denom
    if SR:
        rho = tile_rounding_bits(tl.load(row + C.COL_NOFF) + e0, key_lo, key_hi, c2, c3, BLOCK)
        tl.store(p_ptr + offs, C.to_bf16_sr(p, rho), mask=inb)
    else:
        tl.store(p_ptr + offs, C.to_dtype_rne(p, P_DTYPE, C.EMULATE_RNE), mask=inb)


def _moment_scalars(h, t) -> tuple:
    b1, b2 = h.beta1, h.beta2
    return (b1, b2, 1 - b1, 1 - b2, 1 - b1**t, 1 - b2**t)


def _phi_hat(h, dp) -> float:
    return dp.noise_var_avg / (1 - h.beta2**dp.step)


def _host_adam(h, dp) -> KernelArgs:
    s = (h.lr, h.weight_decay, *_moment_scalars(h, dp.step), h.eps)
    return KernelArgs(ADAM.value, s, (h.weight_decay != 0,), True, False)


def _host_adam_bc(h, dp) -> KernelArgs:
    s = (h.lr, h.weight_decay, *_moment_scalars(h, dp.step), h.gamma, _phi_hat(h, dp))
    return KernelArgs(ADAM_BC.value, s, (h.weight_decay != 0,), True, False)


def _host_adamw(h, dp) -> KernelArgs:
    s = (h.lr, 1 - h.lr * h.weight_decay, *_moment_scalars(h, dp.step), h.eps)
    return KernelArgs(ADAMW.value, s, (), True, False)


def _host_adamw_bc(h, dp) -> KernelArgs:
    s = (h.lr, 1 - h.lr * h.weight_decay, *_moment_scalars(h, dp.step), h.gamma, _phi_hat(h, dp))
    return KernelArgs(ADAMW_BC.value, s, (), True, False)


# --------------------------------------------------------------------------------------
# DP-MacAdam (SPEC section 7): g is the noisy whitened mean w~; the prologue loaded
# m_hat_prev and the scale b (whitening).
# --------------------------------------------------------------------------------------
@triton.jit
def macadam_variance(var, scale, kappa, noise_var, h1, h2):
    """S_hat = clamp(S / kappa_t - b^2 sigma^2 / B_e^2, h1, h2) (SPEC section 7)."""
    return tl.minimum(tl.maximum(var / kappa - scale * scale * noise_var, h1), h2)


@triton.jit
def update_macadam(
    row,
    offs,
    inb,
    p,
    g,
    m_prev,
    m_hat_prev,
    scale,
    partial,
    slot,
    lr,
    beta1,
    beta2,
    one_m_b1,
    one_m_b2,
    bc1,
    bc2,
    gamma,
    kappa,
    noise_var,
    h1,
    h2,
    VARIANCE: tl.constexpr,
    RET_SUM: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    g = scale * g + m_hat_prev  # back to gradient scale
    m_hat, v_hat = _adam_moments(
        row, offs, inb, g, m_prev, beta1, beta2, one_m_b1, one_m_b2, bc1, bc2, ALIGNED
    )
    p = p - lr * m_hat / (tl.math.sqrt_rn(v_hat) + gamma)
    S_ptr = C.typed_ptr(row, C.COL_S0 + EXP_VAR, tl.float32, ALIGNED)
    if VARIANCE == UNBIASED:
        u = (g - m_hat_prev) * (g - m_hat)
    elif VARIANCE == PAPER:
        u = (g - m_hat) * (g - m_hat)
    else:
        u = (g - m_hat_prev) * (g - m_hat_prev)
    var = tl.load(S_ptr + offs, mask=inb, other=0.0) * beta1 + one_m_b1 * u
    tl.store(S_ptr + offs, var, mask=inb)
    if RET_SUM:
        s_hat = macadam_variance(var, scale, kappa, noise_var, h1, h2)
        r = tl.where(inb, tl.math.sqrt_rn(s_hat), 0.0).to(tl.float64)
        tl.store(partial + slot, tl.sum(r, axis=0))
    return p


def macadam_scalars(h, dp) -> tuple:
    """(kappa_t, sigma^2 / B_e^2) of S_hat (t >= 2; kappa is a stand-in 1.0 at t = 1)."""
    t = dp.step
    kappa = rules.macadam_kappa(h.beta1, t) if t > 1 else 1.0
    return kappa, (dp.noise_std / dp.expected_batch_size) ** 2


def _host_macadam(h, dp) -> KernelArgs:
    s = (h.lr, *_moment_scalars(h, dp.step), h.gamma, *macadam_scalars(h, dp), h.h1, h.h2)
    ret = dp.step >= 2
    return KernelArgs(MACADAM.value, s, (VARIANCE_CODES[h.variance_estimate], ret), True, ret)


# --------------------------------------------------------------------------------------
# Schedule-free DP-SGD and DP-AdamW (SPEC 10.8): p is y; z (the first state, m_prev when
# loaded) is the base sequence, p itself at the parameter's first step. The host computes
# lr_t, c_t and the y coefficient lr_t (beta (1 - c_t) - 1) (rules.schedule_free_scalars).
# --------------------------------------------------------------------------------------
SF_Z = tl.constexpr(STATES["sgd_schedule_free"].index("z"))
SF_EXP_AVG_SQ = tl.constexpr(STATES["adamw_schedule_free"].index("exp_avg_sq"))


@triton.jit
def _schedule_free_y_z(row, offs, inb, p, z, u, lr, y_coef, ckp1, LERP_SMALL, ALIGNED):
    """y <- lerp(y, z, c_t) + y_coef u (torch.lerp's two forms); z <- z - lr u (stored)."""
    if LERP_SMALL:
        y = p + ckp1 * (z - p)
    else:
        y = z - (z - p) * (1.0 - ckp1)
    y = y + y_coef * u
    tl.store(C.typed_ptr(row, C.COL_S0 + SF_Z, tl.float32, ALIGNED) + offs, z - lr * u, mask=inb)
    return y


@triton.jit
def update_sgd_schedule_free(
    row,
    offs,
    inb,
    p,
    g,
    m_prev,
    lr,
    wd,
    y_coef,
    ckp1,
    COUPLED_WD: tl.constexpr,
    FIRST: tl.constexpr,
    LERP_SMALL: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    if FIRST:
        z = p
    else:
        z = m_prev
    if COUPLED_WD:
        g = g + wd * p
    return _schedule_free_y_z(row, offs, inb, p, z, g, lr, y_coef, ckp1, LERP_SMALL, ALIGNED)


@triton.jit
def update_adamw_schedule_free(
    row,
    offs,
    inb,
    p,
    g,
    m_prev,
    lr,
    wd,
    y_coef,
    ckp1,
    beta2,
    one_m_b2,
    bc2,
    eps,
    gamma,
    phi_hat,
    COUPLED_WD: tl.constexpr,
    FIRST: tl.constexpr,
    LERP_SMALL: tl.constexpr,
    BC: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    if FIRST:
        z = p
    else:
        z = m_prev
    v_ptr = C.typed_ptr(row, C.COL_S0 + SF_EXP_AVG_SQ, tl.float32, ALIGNED)
    v = tl.load(v_ptr + offs, mask=inb, other=0.0) * beta2 + one_m_b2 * g * g
    tl.store(v_ptr + offs, v, mask=inb)
    v_hat = v / bc2
    if BC:
        u = g / tl.math.sqrt_rn(tl.maximum(v_hat - phi_hat, gamma))
    else:
        u = g / (tl.math.sqrt_rn(v_hat) + eps)
    if COUPLED_WD:
        u = u + wd * p
    return _schedule_free_y_z(row, offs, inb, p, z, u, lr, y_coef, ckp1, LERP_SMALL, ALIGNED)


def _schedule_free_host(h, dp, beta) -> tuple:
    """(lr_t, y coefficient, c_t) and the flags (decay, first step, c_t < 0.5)."""
    lr, _, _, ckp1 = rules.schedule_free_scalars(h, dp.step)
    scalars = (lr, h.weight_decay, lr * (beta * (1 - ckp1) - 1), ckp1)
    small = abs(struct.unpack("f", struct.pack("f", ckp1))[0]) < 0.5  # torch.lerp's test, fp32
    return scalars, (h.weight_decay != 0, dp.step == 1, small)


def _host_sgd_schedule_free(h, dp) -> KernelArgs:
    scalars, flags = _schedule_free_host(h, dp, h.momentum)
    return KernelArgs(SGD_SCHEDULE_FREE.value, scalars, flags, dp.step > 1, False)


def _host_adamw_schedule_free(h, dp) -> KernelArgs:
    scalars, flags = _schedule_free_host(h, dp, h.beta1)
    bc = rules.of(h).corrects(h)
    phi_hat = _phi_hat(h, dp) if bc else 0.0
    scalars += (h.beta2, 1 - h.beta2, 1 - h.beta2**dp.step, h.eps, h.gamma, phi_hat)
    return KernelArgs(ADAMW_SCHEDULE_FREE.value, scalars, (*flags, bc), dp.step > 1, False)


# --------------------------------------------------------------------------------------
# DP-RMSprop (SPEC 10.1): m_prev is square_avg's block
# --------------------------------------------------------------------------------------
@triton.jit
def update_rmsprop(
    row,
    offs,
    inb,
    p,
    g,
    m_prev,
    lr,
    wd,
    alpha,
    one_m_alpha,
    momentum,
    eps,
    gamma,
    phi,
    COUPLED_WD: tl.constexpr,
    MOMENTUM: tl.constexpr,
    CENTERED: tl.constexpr,
    BC: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    if COUPLED_WD:
        g = g + wd * p
    v = m_prev * alpha + one_m_alpha * g * g
    tl.store(C.typed_ptr(row, C.COL_S0 + SQUARE_AVG, tl.float32, ALIGNED) + offs, v, mask=inb)
    if CENTERED:
        ga_ptr = C.typed_ptr(row, C.COL_S0 + GRAD_AVG, tl.float32, ALIGNED)
        ga = tl.load(ga_ptr + offs, mask=inb, other=0.0)
        ga = ga + one_m_alpha * (g - ga)
        tl.store(ga_ptr + offs, ga, mask=inb)
        avg = tl.math.sqrt_rn(v - ga * ga) + eps
    elif BC:
        avg = tl.math.sqrt_rn(tl.maximum(v - phi, gamma)) + eps
    else:
        avg = tl.math.sqrt_rn(v) + eps
    if MOMENTUM:
        buf_ptr = C.typed_ptr(row, C.COL_S0 + RMS_MOMENTUM_BUFFER, tl.float32, ALIGNED)
        buf = tl.load(buf_ptr + offs, mask=inb, other=0.0) * momentum + g / avg
        tl.store(buf_ptr + offs, buf, mask=inb)
        p = p - lr * buf
    else:
        p = p - lr * (g / avg)
    return p


def _host_rmsprop(h, dp) -> KernelArgs:
    bc = h.noise_bias_correction
    s = (h.lr, h.weight_decay, h.alpha, 1 - h.alpha, h.momentum, h.eps, h.gamma)
    s += (dp.noise_var_avg if bc else 0.0,)
    flags = (h.weight_decay != 0, h.momentum > 0, h.centered, bc)
    return KernelArgs(RMSPROP.value, s, flags, True, False)


# --------------------------------------------------------------------------------------
# DP-Adagrad (SPEC 10.2): m_prev is sum's block; clr = lr / (1 + (t - 1) lr_decay)
# --------------------------------------------------------------------------------------
@triton.jit
def update_adagrad(
    row,
    offs,
    inb,
    p,
    g,
    m_prev,
    clr,
    wd,
    eps,
    gamma,
    phi,
    COUPLED_WD: tl.constexpr,
    BC: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    if COUPLED_WD:
        g = g + wd * p
    acc = m_prev + g * g
    tl.store(C.typed_ptr(row, C.COL_S0 + SUM, tl.float32, ALIGNED) + offs, acc, mask=inb)
    if BC:
        std = tl.math.sqrt_rn(tl.maximum(acc - phi, gamma)) + eps
    else:
        std = tl.math.sqrt_rn(acc) + eps
    return p - clr * (g / std)


def _host_adagrad(h, dp) -> KernelArgs:
    bc = h.noise_bias_correction
    clr = h.lr / (1 + (dp.step - 1) * h.lr_decay)
    s = (clr, h.weight_decay, h.eps, h.gamma, dp.noise_var_avg if bc else 0.0)
    return KernelArgs(ADAGRAD.value, s, (h.weight_decay != 0, bc), True, False)


# --------------------------------------------------------------------------------------
# DP-Adadelta (SPEC 10.5): m_prev is square_avg's block.
# --------------------------------------------------------------------------------------
@triton.jit
def update_adadelta(
    row,
    offs,
    inb,
    p,
    g,
    m_prev,
    lr,
    wd,
    rho,
    one_m_rho,
    eps,
    gamma,
    phi,
    noise_var,
    COUPLED_WD: tl.constexpr,
    BC: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    if COUPLED_WD:
        g = g + wd * p
    v = m_prev * rho + one_m_rho * g * g
    tl.store(C.typed_ptr(row, C.COL_S0 + SQUARE_AVG, tl.float32, ALIGNED) + offs, v, mask=inb)
    u_ptr = C.typed_ptr(row, C.COL_S0 + ACC_DELTA, tl.float32, ALIGNED)
    u = tl.load(u_ptr + offs, mask=inb, other=0.0)
    if BC:
        psi_ptr = C.typed_ptr(row, C.COL_S0 + ACC_DELTA_NOISE_VAR, tl.float32, ALIGNED)
        psi = tl.load(psi_ptr + offs, mask=inb, other=0.0)
        den = tl.math.sqrt_rn(tl.maximum(v - phi, gamma) + eps)
        num = tl.math.sqrt_rn(tl.maximum(u - psi, 0.0) + eps)
    else:
        den = tl.math.sqrt_rn(v + eps)
        num = tl.math.sqrt_rn(u + eps)
    coef = num / den
    delta = coef * g
    tl.store(u_ptr + offs, u * rho + one_m_rho * delta * delta, mask=inb)
    if BC:
        tl.store(psi_ptr + offs, psi * rho + one_m_rho * coef * coef * noise_var, mask=inb)
    return p - lr * delta


def _host_adadelta(h, dp) -> KernelArgs:
    noise_var = (dp.noise_std / dp.expected_batch_size) ** 2  # Phi_t
    s = (h.lr, h.weight_decay, h.rho, 1 - h.rho, h.eps, h.gamma, dp.noise_var_avg, noise_var)
    flags = (h.weight_decay != 0, h.noise_bias_correction)
    return KernelArgs(ADADELTA.value, s, flags, True, False)


# --------------------------------------------------------------------------------------
# DP-AdEMAMix (SPEC 10.6), in reference.update_ademamix's computed form: m_prev is
# exp_avg's block.
# --------------------------------------------------------------------------------------
@triton.jit
def update_ademamix(
    row,
    offs,
    inb,
    p,
    g,
    m_prev,
    decay,
    beta1,
    beta2,
    beta3,
    one_m_b1,
    one_m_b2,
    one_m_b3,
    A,
    B,
    E,
    G,
    phi,
    BC: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    p = p * decay
    v_ptr = C.typed_ptr(row, C.COL_S0 + EXP_AVG_SQ, tl.float32, ALIGNED)
    m2_ptr = C.typed_ptr(row, C.COL_S0 + EXP_AVG_SLOW, tl.float32, ALIGNED)
    m1 = m_prev * beta1 + one_m_b1 * g
    m2 = tl.load(m2_ptr + offs, mask=inb, other=0.0) * beta3 + one_m_b3 * g
    v = tl.load(v_ptr + offs, mask=inb, other=0.0) * beta2 + one_m_b2 * g * g
    tl.store(C.typed_ptr(row, C.COL_S0 + EXP_AVG, tl.float32, ALIGNED) + offs, m1, mask=inb)
    tl.store(m2_ptr + offs, m2, mask=inb)
    tl.store(v_ptr + offs, v, mask=inb)
    if BC:
        vc = tl.maximum(v - phi, G)
    else:
        vc = v
    return p - (A * m1 + B * m2) / (tl.math.sqrt_rn(vc) + E)


def _host_ademamix(h, dp) -> KernelArgs:
    beta3, A, B, E, G = rules.ademamix_scalars(h, dp.step)
    s = (1 - h.lr * h.weight_decay, h.beta1, h.beta2, beta3)
    s += (1 - h.beta1, 1 - h.beta2, 1 - beta3, A, B, E, G, dp.noise_var_avg)
    return KernelArgs(ADEMAMIX.value, s, (h.noise_bias_correction,), True, False)


# --------------------------------------------------------------------------------------
# DP-RAdam (SPEC 10.3): the branch (warm-up or rectified), r_t and sqrt(1 - beta2^t) are
# host-side functions of (beta2, t).
# --------------------------------------------------------------------------------------
@triton.jit
def update_radam(
    row,
    offs,
    inb,
    p,
    g,
    m_prev,
    lr,
    wd_or_decay,
    beta1,
    beta2,
    one_m_b1,
    one_m_b2,
    bc1,
    bc2,
    sqrt_bc2,
    eps_or_gamma,
    rect,
    phi_hat,
    COUPLED_WD: tl.constexpr,
    DECOUPLED_WD: tl.constexpr,
    ADAPTIVE: tl.constexpr,
    BC: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    if COUPLED_WD:
        g = g + wd_or_decay * p
    if DECOUPLED_WD:
        p = p * wd_or_decay
    v_ptr = C.typed_ptr(row, C.COL_S0 + EXP_AVG_SQ, tl.float32, ALIGNED)
    v = tl.load(v_ptr + offs, mask=inb, other=0.0)
    m = m_prev * beta1 + one_m_b1 * g
    v = v * beta2 + one_m_b2 * g * g
    tl.store(C.typed_ptr(row, C.COL_S0 + EXP_AVG, tl.float32, ALIGNED) + offs, m, mask=inb)
    tl.store(v_ptr + offs, v, mask=inb)
    m_hat = m / bc1
    if ADAPTIVE:
        if BC:
            denom = tl.math.sqrt_rn(tl.maximum(v / bc2 - phi_hat, eps_or_gamma))
            p = p - (m_hat * lr) * rect / denom
        else:
            adaptive = (1.0 / (tl.math.sqrt_rn(v) + eps_or_gamma)) * sqrt_bc2
            p = p - (m_hat * lr) * adaptive * rect
    else:
        p = p - m_hat * lr
    return p


def _host_radam(h, dp) -> KernelArgs:
    t = dp.step
    rect = rules.radam_rectification(h.beta2, t)
    decoupled = h.decoupled_weight_decay
    wd = 1 - h.lr * h.weight_decay if decoupled else h.weight_decay
    floor = h.gamma if h.noise_bias_correction else h.eps
    s = (
        h.lr,
        wd,
        *_moment_scalars(h, t),
        (1 - h.beta2**t) ** 0.5,
        floor,
        1.0 if rect is None else rect,
        _phi_hat(h, dp),
    )
    has_wd = h.weight_decay != 0
    flags = (
        has_wd and not decoupled,
        has_wd and decoupled,
        rect is not None,
        h.noise_bias_correction,
    )
    return KernelArgs(RADAM.value, s, flags, True, False)


# --------------------------------------------------------------------------------------
# DP-Lion (SPEC 10.4)
# --------------------------------------------------------------------------------------
@triton.jit
def update_lion(
    row,
    offs,
    inb,
    p,
    g,
    m_prev,
    lr,
    decay,
    beta1,
    beta2,
    one_m_b1,
    one_m_b2,
    ALIGNED: tl.constexpr,
):
    p = p * decay
    c = m_prev * beta1 + one_m_b1 * g
    sign = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))  # torch.sign: 0 for 0 and NaN
    m = m_prev * beta2 + one_m_b2 * g
    tl.store(C.typed_ptr(row, C.COL_S0 + EXP_AVG, tl.float32, ALIGNED) + offs, m, mask=inb)
    return p - lr * sign


def _host_lion(h, dp) -> KernelArgs:
    s = (h.lr, 1 - h.lr * h.weight_decay, h.beta1, h.beta2, 1 - h.beta1, 1 - h.beta2)
    return KernelArgs(LION.value, s, (), True, False)


# --------------------------------------------------------------------------------------
# DP-Adafactor (SPEC 10.7). Reductions over rows, columns and the whole tensor sit between
# g_hat and the update, so the fused kernel's update_adafactor only stores g_hat into an
# fp32 scratch (slot GHAT); then adafactor_tensor_pass runs, per parameter: (1) the row
# sums of g_hat^2 and of p^2 (float64 partials per row) with the row_var update, and the
# column sums with the col_var update; (2) mean(r~) per matrix; (3) U = g / sqrt(max(V,
# eps1^2)) into the scratch, with float64 partials of U^2; (4) the decay and the step. The
# scalars alpha_t and the step size are formed on the host (as torch.optim does).
# --------------------------------------------------------------------------------------
@triton.jit
def update_adafactor(row, offs, inb, p, g, ALIGNED: tl.constexpr):
    g_ptr = C.typed_ptr(row, C.COL_S0 + GHAT, tl.float32, ALIGNED)
    tl.store(g_ptr + offs, g, mask=inb)
    return p


def _host_adafactor(h, dp) -> KernelArgs:
    return KernelArgs(ADAFACTOR.value, (), (), False, False)


@triton.jit
def _af_lerp(a, b, w, one_m_w, LERP_LOW: tl.constexpr):
    """torch.lerp(a, b, w): a + w (b - a) for w < 0.5, else b - (b - a)(1 - w)."""
    if LERP_LOW:
        out = a + w * (b - a)
    else:
        out = b - (b - a) * one_m_w
    return out


@triton.jit
def _af_floor(x, phi, gamma, CORRECT: tl.constexpr):
    """max(x - phi, gamma) with the correction, else x."""
    if CORRECT:
        x = tl.maximum(x - phi, gamma)
    return x


@triton.jit
def _af_vector_kernel(p_ptr, g_ptr, v_ptr, pp_ptr, uu_ptr, n, w, one_m_w, phi, gamma,
                      eps1_sq, LERP_LOW: tl.constexpr, CORRECT: tl.constexpr,
                      BLOCK: tl.constexpr):  # fmt: skip
    """< 2-D: v <- lerp(v, g^2, w); U = g / sqrt(max(v~, eps1^2)) into g; partial sums of
    p^2 and U^2 (float64) per program."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    p = tl.load(p_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=inb, other=0.0)
    v = _af_lerp(tl.load(v_ptr + offs, mask=inb, other=0.0), g * g, w, one_m_w, LERP_LOW)
    tl.store(v_ptr + offs, v, mask=inb)
    u = g / tl.math.sqrt_rn(tl.maximum(_af_floor(v, phi, gamma, CORRECT), eps1_sq))
    tl.store(g_ptr + offs, u, mask=inb)
    tl.store(pp_ptr + pid, tl.sum(tl.where(inb, (p * p).to(tl.float64), 0.0), axis=0))
    tl.store(uu_ptr + pid, tl.sum(tl.where(inb, (u * u).to(tl.float64), 0.0), axis=0))


@triton.jit
def _af_rows_kernel(p_ptr, g_ptr, r_ptr, pp_ptr, C, w, one_m_w, LERP_LOW: tl.constexpr,
                    BLOCK: tl.constexpr):  # fmt: skip
    """One program per row of the trailing matrices: r <- lerp(r, mean_j g^2, w), and the
    row's sum of p^2 (float64)."""
    i = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float64)
    acc_p = tl.zeros([BLOCK], tl.float64)
    for k0 in range(0, C, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        inb = offs < C
        g = tl.load(g_ptr + i * C + offs, mask=inb, other=0.0)
        p = tl.load(p_ptr + i * C + offs, mask=inb, other=0.0).to(tl.float32)
        acc += (g * g).to(tl.float64)
        acc_p += (p * p).to(tl.float64)
    mean = (tl.sum(acc, axis=0) / C).to(tl.float32)
    tl.store(r_ptr + i, _af_lerp(tl.load(r_ptr + i), mean, w, one_m_w, LERP_LOW))
    tl.store(pp_ptr + i, tl.sum(acc_p, axis=0))


@triton.jit
def _af_cols_kernel(g_ptr, c_ptr, R, C, n_cblk, w, one_m_w, LERP_LOW: tl.constexpr,
                    BLOCK: tl.constexpr):  # fmt: skip
    """One program per (matrix, block of columns): c <- lerp(c, mean_i g^2, w)."""
    pid = tl.program_id(0).to(tl.int64)
    mat = pid // n_cblk
    offs = (pid % n_cblk) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < C
    acc = tl.zeros([BLOCK], tl.float64)
    for r in range(0, R):
        g = tl.load(g_ptr + (mat * R + r) * C + offs, mask=inb, other=0.0)
        acc += (g * g).to(tl.float64)
    mean = (acc / R).to(tl.float32)
    c_ptrs = c_ptr + mat * C + offs
    col = _af_lerp(tl.load(c_ptrs, mask=inb, other=0.0), mean, w, one_m_w, LERP_LOW)
    tl.store(c_ptrs, col, mask=inb)


@triton.jit
def _af_mean_kernel(r_ptr, m_ptr, R, phi, gamma, eps1, CORRECT: tl.constexpr,
                    BLOCK: tl.constexpr):  # fmt: skip
    """One program per matrix: max(mean_i r~_i, eps1)."""
    mat = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float64)
    for r0 in range(0, R, BLOCK):
        offs = r0 + tl.arange(0, BLOCK)
        inb = offs < R
        rt = _af_floor(tl.load(r_ptr + mat * R + offs, mask=inb, other=0.0), phi, gamma, CORRECT)
        acc += tl.where(inb, rt.to(tl.float64), 0.0)
    tl.store(m_ptr + mat, tl.maximum((tl.sum(acc, axis=0) / R).to(tl.float32), eps1))


@triton.jit
def _af_update_kernel(g_ptr, r_ptr, c_ptr, m_ptr, uu_ptr, R, C, phi, gamma, eps1_sq,
                      CORRECT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """One program per row: U = g / sqrt(max(r~ c~ / mean, eps1^2)) into g, and the row's
    sum of U^2 (float64)."""
    i = tl.program_id(0).to(tl.int64)
    mat = i // R
    rt = _af_floor(tl.load(r_ptr + i), phi, gamma, CORRECT)
    mean = tl.load(m_ptr + mat)
    acc = tl.zeros([BLOCK], tl.float64)
    for k0 in range(0, C, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        inb = offs < C
        ct = _af_floor(tl.load(c_ptr + mat * C + offs, mask=inb, other=1.0), phi, gamma, CORRECT)
        v = (rt * ct) / mean
        g = tl.load(g_ptr + i * C + offs, mask=inb, other=0.0)
        u = g / tl.math.sqrt_rn(tl.maximum(v, eps1_sq))
        tl.store(g_ptr + i * C + offs, u, mask=inb)
        acc += tl.where(inb, (u * u).to(tl.float64), 0.0)
    tl.store(uu_ptr + i, tl.sum(acc, axis=0))


@triton.jit(do_not_specialize=["noff", "key_lo", "key_hi", "c2", "c3"])
def _af_apply_kernel(p_ptr, u_ptr, n, decay, step, noff, key_lo, key_hi, c2, c3,
                     P_DTYPE: tl.constexpr, SR: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    """p <- p (1 - lr wd) - step U, rounded once to the parameter dtype (stochastically
    with SR: the rounding stream's bits of global indices noff + j, SPEC 3.2)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    p = tl.load(p_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    p = p * decay - step * tl.load(u_ptr + offs, mask=inb, other=0.0)
    if SR:
        rho = rounding_bits_at(noff + offs.to(tl.int64), key_lo, key_hi, c2, c3)
        tl.store(p_ptr + offs, C.to_bf16_sr(p, rho), mask=inb)
    else:
        tl.store(p_ptr + offs, C.to_dtype_rne(p, P_DTYPE, C.EMULATE_RNE), mask=inb)


def adafactor_tensor_pass(h, dp, bufs, offsets, apply: bool = True) -> list:
    """The tensor phase of DP-Adafactor (SPEC 10.7) for each parameter: ``bufs`` holds, per
    parameter, (param, grad_sample, summed, row_var, col_var, g_hat scratch), contiguous;
    ``offsets`` their global noise offsets (the rounding stream's indices, SPEC 3.2).

    Returns, per parameter, (alpha_t, max(1, RMS(U) / d), ||U||^2) (None for an empty one).
    ``apply=False`` is update_rms_clip's pass A (SPEC 10.9): the states updated and U left
    in the scratch, the parameter not written; :func:`adafactor_apply` is then pass B."""
    import math

    import torch

    from ... import rules as registry

    w = registry.adafactor_weight(h, dp.step)
    rho = min(h.lr, 1 / dp.step**0.5)
    correct = registry.of(h).corrects(h)
    phi = float(dp.noise_var_avg)
    low = w < 0.5
    block = C.config().step_block
    out = []
    for (p, _, _, row, col, g), noff in zip(bufs, offsets, strict=True):
        n = p.numel()
        if n == 0:
            out.append(None)
            continue
        dev = p.device
        if p.dim() >= 2:
            Cn, R = p.shape[-1], p.shape[-2]
            L = n // (R * Cn)
            cb = min(block, triton.next_power_of_2(Cn))
            pp = C.empty((L * R,), torch.float64, dev)
            uu = C.empty((L * R,), torch.float64, dev)
            mean = C.empty((L,), torch.float32, dev)
            _af_rows_kernel[(L * R,)](p, g, row, pp, Cn, w, 1 - w, LERP_LOW=low, BLOCK=cb)
            n_cblk = triton.cdiv(Cn, cb)
            _af_cols_kernel[(L * n_cblk,)](g, col, R, Cn, n_cblk, w, 1 - w, LERP_LOW=low, BLOCK=cb)
            rb = min(block, triton.next_power_of_2(R))
            _af_mean_kernel[(L,)](row, mean, R, phi, h.gamma, h.eps1, CORRECT=correct, BLOCK=rb)
            _af_update_kernel[(L * R,)](
                g, row, col, mean, uu, R, Cn, phi, h.gamma, h.eps1 * h.eps1, CORRECT=correct,
                BLOCK=cb,
            )  # fmt: skip
        else:
            nb = triton.cdiv(n, block)
            pp = C.empty((nb,), torch.float64, dev)
            uu = C.empty((nb,), torch.float64, dev)
            _af_vector_kernel[(nb,)](
                p, g, row, pp, uu, n, w, 1 - w, phi, h.gamma, h.eps1 * h.eps1,
                LERP_LOW=low, CORRECT=correct, BLOCK=block,
            )  # fmt: skip
        sum_pp, sum_uu = torch.stack([pp.sum(), uu.sum()]).tolist()
        alpha = max(h.eps2, math.sqrt(sum_pp) / n**0.5) * rho
        denom = max(1.0, math.sqrt(sum_uu) / (n**0.5 * h.d))
        if apply:
            adafactor_apply(h, dp, p, g, noff, alpha / denom)
        out.append((alpha, denom, sum_uu))
    return out


def adafactor_apply(h, dp, p, u, noff: int, step: float) -> None:
    """Step 4 of SPEC 10.7 on one non-empty contiguous parameter: p <- p (1 - lr wd) -
    step U (``step`` a double, rounded once to float32 by the launch)."""
    import torch

    from ...hyper import ROUNDING_STREAM

    block = C.config().step_block
    c2, c3 = C.step_words(dp.noise_step, ROUNDING_STREAM)
    sr = dp.stochastic_rounding and p.dtype == torch.bfloat16
    _af_apply_kernel[(triton.cdiv(p.numel(), block),)](
        p, u, p.numel(), 1 - h.lr * h.weight_decay, step, noff,
        *(C.key_words(dp.key) if sr else (0, 0)), c2, c3,
        P_DTYPE=C.tl_dtype(p.dtype), SR=sr, BLOCK=block,
    )  # fmt: skip


#: rule name -> its tensor phase, run by step.py after the fused kernel stored g_hat in an
#: fp32 scratch per parameter (the buffer after the rule's states, slot GHAT).
TENSOR_PASSES = {
    "adafactor": adafactor_tensor_pass,
}


# --------------------------------------------------------------------------------------
# The dispatch
# --------------------------------------------------------------------------------------
@triton.jit
def update(
    RULE: tl.constexpr,
    row,
    offs,
    inb,
    p,
    g,
    m_prev,
    m_hat_prev,
    scale,
    partial,
    slot,
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
    F0: tl.constexpr,
    F1: tl.constexpr,
    F2: tl.constexpr,
    F3: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """The updated parameter block of rule RULE (each branch maps s*/F* to its names)."""
    if RULE == SGD:
        p = update_sgd(row, offs, inb, p, g, m_prev, s0, s1, s2, s3, F0, F1, F2, F3, ALIGNED)
    elif RULE == ADAM:
        p = update_adam(
            row, offs, inb, p, g, m_prev, s0, s1, s2, s3, s4, s5, s6, s7, s8, F0, ALIGNED
        )
    elif RULE == ADAM_BC:
        p = update_adam_bc(
            row, offs, inb, p, g, m_prev, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, F0, ALIGNED
        )
    elif RULE == ADAMW:
        p = update_adamw(
            row, offs, inb, p, g, m_prev, s0, s1, s2, s3, s4, s5, s6, s7, s8, partial, slot, F0,
            ALIGNED,
        )  # fmt: skip
    elif RULE == ADAMW_BC:
        p = update_adamw_bc(
            row, offs, inb, p, g, m_prev, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, partial, slot,
            F0, ALIGNED,
        )  # fmt: skip
    elif RULE == MACADAM:
        p = update_macadam(
            row,
            offs,
            inb,
            p,
            g,
            m_prev,
            m_hat_prev,
            scale,
            partial,
            slot,
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
            ALIGNED,
        )
    elif RULE == SGD_SCHEDULE_FREE:
        p = update_sgd_schedule_free(
            row, offs, inb, p, g, m_prev, s0, s1, s2, s3, F0, F1, F2, ALIGNED
        )
    elif RULE == ADAMW_SCHEDULE_FREE:
        p = update_adamw_schedule_free(
            row,
            offs,
            inb,
            p,
            g,
            m_prev,
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
            F0,
            F1,
            F2,
            F3,
            ALIGNED,
        )
    elif RULE == RMSPROP:
        p = update_rmsprop(
            row, offs, inb, p, g, m_prev, s0, s1, s2, s3, s4, s5, s6, s7, F0, F1, F2, F3, ALIGNED
        )
    elif RULE == ADAGRAD:
        p = update_adagrad(row, offs, inb, p, g, m_prev, s0, s1, s2, s3, s4, F0, F1, ALIGNED)
    elif RULE == ADADELTA:
        p = update_adadelta(
            row, offs, inb, p, g, m_prev, s0, s1, s2, s3, s4, s5, s6, s7, F0, F1, ALIGNED
        )
    elif RULE == ADEMAMIX:
        p = update_ademamix(
            row,
            offs,
            inb,
            p,
            g,
            m_prev,
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
            ALIGNED,
        )
    elif RULE == RADAM:
        p = update_radam(
            row,
            offs,
            inb,
            p,
            g,
            m_prev,
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
    elif RULE == LION:
        p = update_lion(row, offs, inb, p, g, m_prev, s0, s1, s2, s3, s4, s5, ALIGNED)
    elif RULE == ADAFACTOR:
        p = update_adafactor(row, offs, inb, p, g, ALIGNED)
    else:
        tl.static_assert(False, "dpkern: unknown update rule code")
    return p


#: rule name -> its host side (KernelArgs for a step). Looked up by name only.
RULES = {
    "sgd": _host_sgd,
    "adam": _host_adam,
    "adam_bc": _host_adam_bc,
    "adamw": _host_adamw,
    "adamw_bc": _host_adamw_bc,
    "macadam": _host_macadam,
    "sgd_schedule_free": _host_sgd_schedule_free,
    "adamw_schedule_free": _host_adamw_schedule_free,
    "rmsprop": _host_rmsprop,
    "adagrad": _host_adagrad,
    "adadelta": _host_adadelta,
    "ademamix": _host_ademamix,
    "radam": _host_radam,
    "lion": _host_lion,
    "adafactor": _host_adafactor,
}


def supports(rule: str) -> bool:
    """Whether the Triton backend has a kernel for the update rule ``rule``."""
    return rule in RULES


def kernel_args(hyper, dp) -> KernelArgs:
    """The rule's code, scalars (padded to N_SCALARS floats) and flags (to N_FLAGS ints).

    Raises NotImplementedError for a rule this backend has no kernel for."""
    host = RULES.get(hyper.rule)
    if host is None:
        raise NotImplementedError(
            f"dpkern backend='triton' has no kernel for the update rule {hyper.rule!r} "
            "(use backend='torch' or 'auto')"
        )
    a = host(hyper, dp)
    scalars = tuple(float(x) for x in a.scalars) + (0.0,) * (N_SCALARS - len(a.scalars))
    flags = tuple(int(x) for x in a.flags) + (0,) * (N_FLAGS - len(a.flags))
    return dataclasses.replace(a, scalars=scalars, flags=flags)


def _check_registry() -> None:
    """Every rule here is registered, with the registry's kernel states (by name, in slots
    that fit the table); the first state of a whitening rule is its exp_avg (m_prev)."""
    if set(STATES) != set(RULES):
        raise RuntimeError("dpkern triton/rules.py: RULES and STATES name different rules")
    for name, states in STATES.items():
        spec = rules.get(name)  # ValueError for a name the registry does not know
        if sorted(states) != sorted(spec.kernel_state_names) or len(states) > C.MAX_STATES:
            raise RuntimeError(
                f"dpkern triton/rules.py: rule {name!r} has states {states}, the registry "
                f"{spec.kernel_state_names}"
            )
        if spec.whitening and (states[0] != "exp_avg" or "scale" not in states):
            raise RuntimeError(f"dpkern triton/rules.py: whitening rule {name!r}: states")


_check_registry()
