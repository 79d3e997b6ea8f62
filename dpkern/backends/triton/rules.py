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
    "radam": ("exp_avg", "exp_avg_sq"),
    "lion": ("exp_avg",),
}
# The slots the update functions use, by state name.
MOMENTUM_BUFFER = tl.constexpr(STATES["sgd"].index("momentum_buffer"))
EXP_AVG = tl.constexpr(STATES["adam"].index("exp_avg"))  # the first state (m_prev)
EXP_AVG_SQ = tl.constexpr(STATES["adam"].index("exp_avg_sq"))
EXP_VAR = tl.constexpr(STATES["macadam"].index("exp_var"))
SCALE = tl.constexpr(STATES["macadam"].index("scale"))
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
