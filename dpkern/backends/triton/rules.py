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
    ALIGNED: tl.constexpr,
):
    p = p * decay
    m_hat, v_hat = _adam_moments(
        row, offs, inb, g, m_prev, beta1, beta2, one_m_b1, one_m_b2, bc1, bc2, ALIGNED
    )
    return p - lr * m_hat / (tl.math.sqrt_rn(v_hat) + eps)


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
    ALIGNED: tl.constexpr,
):
    p = p * decay
    m_hat, v_hat = _adam_moments(
        row, offs, inb, g, m_prev, beta1, beta2, one_m_b1, one_m_b2, bc1, bc2, ALIGNED
    )
    return p - lr * m_hat / tl.math.sqrt_rn(tl.maximum(v_hat - phi_hat, gamma))


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
        p = update_adamw(row, offs, inb, p, g, m_prev, s0, s1, s2, s3, s4, s5, s6, s7, s8, ALIGNED)
    elif RULE == ADAMW_BC:
        p = update_adamw_bc(
            row, offs, inb, p, g, m_prev, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, ALIGNED
        )
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
