"""The reference backend: SPEC.md written as plain PyTorch, for clarity, never for speed.

Every other backend (``dpkern.backends.triton``, ``dpkern.backends.cpp``) implements the
same functions under the same names and is tested against this module:

- :func:`philox_words`, :func:`gaussian_noise`, :func:`normal_from_words` -- the noise
  stream v1 (SPEC section 3); :func:`rounding_bits`, :func:`stochastic_round_bf16` -- the
  rounding stream (SPEC section 3.2);
- :func:`per_sample_norms`, :func:`whitened_norms` -- pass 1 (SPEC sections 2 and 7);
- :func:`accumulate` -- fold one micro-batch's clipped sum into fp32 buffers (SPEC section 2);
- :func:`step` -- pass 2: clip + sum + noise + moment update + parameter update (SPEC
  sections 4, 5 and 7), through one ``update_<name>`` function per rule of the registry
  (:mod:`dpkern.rules`), named like the Triton (``triton/rules.py``) and C++
  (``csrc/rules.h``) ones;
- :func:`macadam_update_scale` -- DP-MacAdam's global scale update (SPEC section 7), run
  after :func:`step` once the global sum it returned is known;
- :func:`rms_clip_moments`, :func:`rms_clip_apply`, :func:`supports_rms_clip` --
  ``update_rms_clip``'s two passes (SPEC 10.9), around the caller's global reduction.

Conventions shared by all backends
----------------------------------
- ``grad_samples[k]`` is ``None`` (parameter unused this step: a zero per-sample gradient)
  or a tensor of shape ``[B, *params[k].shape]`` in any float dtype.
- ``clip_factors`` is a float32 ``[B]`` tensor; a factor of exactly 0 means "this row
  contributes nothing" (it was non-finite and ``nonfinite="zero"``), so ``0 * NaN`` never
  reaches a sum.
- ``summed[k]`` is ``None`` or an fp32 tensor shaped like ``params[k]``: the clipped sum
  accumulated from earlier micro-batches of the same logical batch.
- ``offsets[k]`` is the global flat index of the first element of ``params[k]`` in the
  noise stream (SPEC section 3); a Python int, may exceed 2**32.
- ``states`` maps each kernel state of the rule (``RuleSpec.kernel_states``, torch.optim's
  names) to one fp32 tensor per parameter, shaped as its ``StateSpec`` says (``None``
  where the hyper-parameters do not need it). Parameters may be fp32, bf16 or fp16: the
  update is computed in fp32 and rounded once on store (to nearest even; bf16
  stochastically with ``dp.stochastic_rounding``, SPEC 3.2).
- Backends hold no policy: inputs were validated by the caller (``dpkern.optim`` /
  ``dpkern.functional``); nothing here raises on user input.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import rules
from ..hyper import ROUNDING_STREAM, DPStep, Hyper
from ..keys import reveal

# --------------------------------------------------------------------------------------
# Noise stream v1 (SPEC section 3)
# --------------------------------------------------------------------------------------
_MASK32 = 0xFFFFFFFF
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
TWO_PI_F32 = float(torch.tensor(2 * math.pi, dtype=torch.float32))


def _mulhilo32(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product a*b, a < 2**32 constant, b int64 < 2**32.

    Computed without int64 overflow by splitting b into 16-bit halves."""
    b_lo = b & 0xFFFF
    b_hi = b >> 16
    lo_part = a * b_lo  # < 2**48
    hi_part = a * b_hi  # < 2**48; contributes hi_part << 16
    mid = lo_part + ((hi_part & 0xFFFF) << 16)  # < 2**49
    lo = mid & _MASK32
    hi = (hi_part >> 16) + (mid >> 32)
    return hi & _MASK32, lo


def philox4x32_10(c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, key: int) -> tuple[Tensor, ...]:
    """Philox-4x32-10 (Salmon et al., SC'11, "Parallel random numbers: as easy as 1, 2, 3").

    Counter words are int64 tensors holding values in [0, 2**32); ``key`` is a 64-bit int.
    Returns (r0, r1, r2, r3) as int64 tensors in [0, 2**32). Bit-identical to
    ``triton.language.philox(key, c0, c1, c2, c3)`` and to Random123's philox4x32_10."""
    key = reveal(key)
    k0, k1 = key & _MASK32, (key >> 32) & _MASK32
    for _ in range(10):
        hi0, lo0 = _mulhilo32(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W0) & _MASK32, (k1 + PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def noise_counter(index: Tensor, step: int, stream: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox counter words for global element indices ``index`` (int64), SPEC section 3."""
    k = index >> 1
    c0 = k & _MASK32
    c1 = k >> 32
    c2 = torch.full_like(index, step & _MASK32)
    c3 = torch.full_like(index, ((stream & 0xFFFF) << 16) | ((step >> 32) & 0xFFFF))
    return c0, c1, c2, c3


def _radius_angle(r0: Tensor, r1: Tensor, r2: Tensor, r3: Tensor) -> tuple[Tensor, Tensor]:
    """(R, theta) of SPEC section 3 from the words (int64 tensors in [0, 2**32)), float32
    with the exact sum order."""
    f32 = torch.float32

    def uniform(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
        u = a.to(f32) * 2.0**-32 + b.to(f32) * 2.0**-64  # each product is exact
        u = u + c.to(f32) * 2.0**-96
        return u + 2.0**-97

    U = uniform(r0, r1, r3)
    V = uniform(_MASK32 - r0, _MASK32 - r1, _MASK32 - r3)  # 32-bit complement; V = 1 - U
    w = 1.0 - V
    # -ln(U) for small U; for U near 1, -log1p(-V) through log only (Goldberg's trick).
    L_log1p = torch.where(w == 1.0, V, ((-torch.log(w)) * V) / (1.0 - w))
    L = torch.where(r0 < 2**31, -torch.log(U), L_log1p)
    R = torch.sqrt(2.0 * L)
    theta = TWO_PI_F32 * (r2.to(f32) * 2.0**-32)
    return R, theta


def normal_from_words(words: Tensor) -> Tensor:
    """The word -> standard normal transform of SPEC section 3 alone: int64 ``[n, 4]``
    Philox words (r0, r1, r2, r3) in [0, 2**32) -> float32 ``[n, 2]``, the z of lane 0
    (R cos theta) and lane 1 (R sin theta). Same signature in every backend; tests pin
    the transform's extremes (``transform_cases``) with it."""
    R, theta = _radius_angle(*words.to(torch.int64).unbind(1))
    return torch.stack([R * torch.cos(theta), R * torch.sin(theta)], dim=1)


def philox_words(index: Tensor, *, key: int, step: int, stream: int = 0) -> Tensor:
    """The Philox words (r0, r1, r2, r3) of global element indices ``index`` (int64 ``[n]``):
    int64 ``[n, 4]`` holding values in [0, 2**32). Exposed so tests compare integers exactly."""
    return torch.stack(philox4x32_10(*noise_counter(index, step, stream), key), dim=1)


def gaussian_noise(
    numel: int, *, key: int, step: int, offset: int = 0, stream: int = 0, device=None
) -> Tensor:
    """z for global elements ``offset ... offset + numel - 1``: float32 ``[numel]``."""
    index = torch.arange(offset, offset + numel, dtype=torch.int64, device=device)
    R, theta = _radius_angle(*philox4x32_10(*noise_counter(index, step, stream), key))
    return torch.where((index & 1) == 0, R * torch.cos(theta), R * torch.sin(theta))


# --------------------------------------------------------------------------------------
# The rounding stream (SPEC section 3.2): stochastic rounding of bf16 parameters
# --------------------------------------------------------------------------------------
def rounding_bits(numel: int, *, key: int, step: int, offset: int = 0, device=None) -> Tensor:
    """rho_j = w_j >> 16 for global elements ``offset ... offset + numel - 1`` (SPEC 3.2):
    int64 ``[numel]`` in [0, 2**16). w_j is word r0 (lane 0) or r2 (lane 1) of the noise
    stream's counter of j under stream ``ROUNDING_STREAM``."""
    index = torch.arange(offset, offset + numel, dtype=torch.int64, device=device)
    r0, _, r2, _ = philox4x32_10(*noise_counter(index, step, ROUNDING_STREAM), key)
    return torch.where((index & 1) == 0, r0, r2) >> 16


def round_bits_bf16(x: Tensor, rho: Tensor) -> Tensor:
    """float32 ``x`` rounded to bfloat16 with the 16 rounding bits ``rho`` (int64, same
    shape): bits (bits(x) + rho) >> 16 in integers, NaN as round-to-nearest gives it."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & _MASK32
    up = (bits + rho) & 0xFFFF0000  # < 2**32 for every non-NaN x
    up = torch.where(up >= 2**31, up - 2**32, up).to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(x), x, up).to(torch.bfloat16)  # exact: low bits are 0


def stochastic_round_bf16(x: Tensor, *, key: int, step: int, offset: int = 0) -> Tensor:
    """float32 ``x`` (element k at global index ``offset + k`` of its flattening) rounded
    stochastically to bfloat16 at ``step`` (SPEC 3.2): a bfloat16 tensor shaped like x."""
    x = x.detach().to(torch.float32)
    rho = rounding_bits(x.numel(), key=key, step=step, offset=offset, device=x.device)
    return round_bits_bf16(x, rho.reshape(x.shape))


def _store(p: Tensor, p32: Tensor, dp: DPStep, offset: int) -> None:
    """Write the fp32 result into the parameter: one rounding to its dtype, stochastic for
    bf16 with ``dp.stochastic_rounding`` (SPEC 3.2), else to nearest even."""
    if dp.stochastic_rounding and p.dtype == torch.bfloat16:
        p32 = stochastic_round_bf16(p32, key=dp.key, step=dp.noise_step, offset=offset)
    p.detach().copy_(p32)


# --------------------------------------------------------------------------------------
# Pass 1: per-sample norms (SPEC sections 2 and 7)
# --------------------------------------------------------------------------------------
def _rows(x: Tensor) -> Tensor:
    return x.reshape(x.shape[0], x.shape[1:].numel()).float()


def per_sample_norms(grad_samples: list[Tensor | None], batch_size: int, device) -> Tensor:
    """n_i = sqrt(sum_p ||grad_sample_p[i]||^2), fp32 accumulation: float32 ``[B]``."""
    sq = torch.zeros(batch_size, dtype=torch.float32, device=device)
    for gs in grad_samples:
        if gs is not None:
            sq += _rows(gs).square().sum(dim=1)
    return sq.sqrt()


def _whiten(gs: Tensor, exp_avg: Tensor, scale: Tensor, bias_correction1: float) -> Tensor:
    """w_i = (g_i - m_hat_{t-1}) / b for every row i (SPEC section 7); m_hat_0 = 0."""
    m_hat = exp_avg / bias_correction1 if bias_correction1 > 0 else torch.zeros_like(exp_avg)
    return (gs.float() - m_hat) / scale


def whitened_norms(
    grad_samples: list[Tensor | None],
    exp_avgs: list[Tensor],
    scales: list[Tensor],
    bias_correction1: float,
    batch_size: int,
    device,
) -> Tensor:
    """||w_i|| over all coordinates (DP-MacAdam pass 1): float32 ``[B]``.

    ``bias_correction1`` is 1 - beta1**(t-1) (0 at t = 1, where m_hat_0 = 0). A parameter
    without a grad_sample has g_i = 0, so w_i = -m_hat / b for every row."""
    sq = torch.zeros(batch_size, dtype=torch.float32, device=device)
    for gs, m, b in zip(grad_samples, exp_avgs, scales, strict=True):
        if gs is None:
            gs = torch.zeros((batch_size, *m.shape), dtype=torch.float32, device=device)
        sq += _rows(_whiten(gs, m, b, bias_correction1)).square().sum(dim=1)
    return sq.sqrt()


def _clipped_sum(x: Tensor, clip_factors: Tensor) -> Tensor:
    """sum_i c_i x_i in fp32; rows with c_i == 0 contribute exactly nothing (even NaN)."""
    rows = _rows(x)
    keep = (clip_factors != 0).unsqueeze(1)
    rows = torch.where(keep, rows, torch.zeros_like(rows))
    return (clip_factors.unsqueeze(1) * rows).sum(dim=0).reshape(x.shape[1:])


def _contribution(k: int, grad_samples, clip_factors, hyper: Hyper, states, bias_correction1):
    """The clipped per-sample sum of parameter k in the space where noise is added."""
    gs = grad_samples[k]
    if rules.of(hyper).whitening:
        m, b = states["exp_avg"][k], states["scale"][k]
        if gs is None:
            gs = torch.zeros((clip_factors.shape[0], *m.shape), device=m.device)
        return _clipped_sum(_whiten(gs, m, b, bias_correction1), clip_factors)
    if gs is None:
        return None
    return _clipped_sum(gs, clip_factors)


def accumulate(
    hyper: Hyper,
    dp: DPStep,
    grad_samples: list[Tensor | None],
    clip_factors: Tensor,
    buffers: list[Tensor],
    states: dict[str, list[Tensor]],
) -> None:
    """buffers[k] += sum_i c_i x_i (x = per-sample gradient, or whitened for MacAdam).

    ``dp.step`` is the step that the logical batch will end with."""
    bc1 = 1.0 - hyper.beta1 ** (dp.step - 1) if rules.of(hyper).whitening else 1.0
    for k, buf in enumerate(buffers):
        c = _contribution(k, grad_samples, clip_factors, hyper, states, bc1)
        if c is not None:
            buf += c


# --------------------------------------------------------------------------------------
# Pass 2: privatised gradient and the update rules (SPEC sections 4, 5, 7)
# --------------------------------------------------------------------------------------
def step(
    hyper: Hyper,
    dp: DPStep,
    params: list[Tensor],
    grad_samples: list[Tensor | None],
    clip_factors: Tensor | None,
    summed: list[Tensor | None],
    states: dict[str, list[Tensor | None]],
    offsets: list[int],
) -> float:
    """One DP step of one parameter group, in place on ``params`` and ``states``.

    g_hat_p = (S_p + noise_std * z_p) / B_e, S_p = summed_p + sum_i c_i grad_sample_p[i]
    (SPEC section 4), then ``update_<hyper.rule>``. ``clip_factors`` may be None when
    every ``grad_samples`` entry is None (summed-gradient entry point).

    Returns the group's partial sum of sqrt(S_hat_j) for DP-MacAdam (SPEC section 7;
    0.0 at t = 1 and for the other rules)."""
    update = _update_of(hyper.rule)
    sqrt_sum = 0.0
    for k, p, g_hat, state in _g_hats(
        hyper, dp, params, grad_samples, clip_factors, summed, states, offsets
    ):
        p32 = p.detach().float()
        sqrt_sum += update(hyper, dp, p32, g_hat, state)
        _store(p, p32, dp, offsets[k])  # one rounding to the parameter dtype
    return sqrt_sum


def _g_hats(hyper, dp, params, grad_samples, clip_factors, summed, states, offsets):
    """(k, p, g_hat, state) for every parameter of the group: the shared prologue of pass 2
    (clipped sum, + summed, noise; SPEC section 4) and the parameter's kernel states."""
    names = rules.of(hyper).kernel_state_names
    t = dp.step
    bc1_prev = 1.0 - hyper.beta1 ** (t - 1) if rules.of(hyper).whitening else 1.0
    for k, p in enumerate(params):
        S = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if summed[k] is not None:
            S += summed[k]
        if clip_factors is not None:
            c = _contribution(k, grad_samples, clip_factors, hyper, states, bc1_prev)
            if c is not None:
                S += c
        z = gaussian_noise(
            p.numel(),
            key=dp.key,
            step=dp.noise_step,
            offset=offsets[k],
            stream=dp.stream,
            device=p.device,
        ).reshape(p.shape)
        g_hat = (S + dp.noise_std * z) / dp.expected_batch_size
        yield k, p, g_hat, {name: states[name][k] for name in names}


# --------------------------------------------------------------------------------------
# Update RMS clipping over the model (SPEC 10.9): two passes, because the scale is a
# function of every parameter's update direction U. Pass A (rms_clip_moments, one call
# per group) draws the noise, updates the states and returns sum_j U_j^2 (float64); the
# caller reduces it over all groups (and shards), forms s = 1 / max(1, RMS / d_u), and
# pass B (rms_clip_apply) takes the step with U scaled by s.
# --------------------------------------------------------------------------------------
def rms_clip_moments(
    hyper: Hyper,
    dp: DPStep,
    params: list[Tensor],
    grad_samples: list[Tensor | None],
    clip_factors: Tensor | None,
    summed: list[Tensor | None],
    states: dict[str, list[Tensor | None]],
    offsets: list[int],
) -> tuple[float, object]:
    """Pass A of SPEC 10.9 for one group (arguments as :func:`step`): the states are
    updated in place, the parameters are not. Returns (sum over the group of U_j^2, a
    float accumulated in float64; the pending pass B, for :func:`rms_clip_apply`)."""
    moments = _RMS_CLIP_MOMENTS[hyper.rule]
    total, pending = 0.0, []
    for k, p, g_hat, state in _g_hats(
        hyper, dp, params, grad_samples, clip_factors, summed, states, offsets
    ):
        p32 = p.detach().float()
        uu, apply = moments(hyper, dp, p32, g_hat, state)
        total += uu
        pending.append((p, p32, apply, offsets[k]))
    return total, (dp, pending)


def rms_clip_apply(pending, scale: float) -> None:
    """Pass B of SPEC 10.9: each parameter's step with U scaled by ``scale`` (a Python
    float in [0, 1]; 1.0 gives the unclipped step bit for bit), stored once."""
    dp, params = pending
    for p, p32, apply, offset in params:
        apply(p32, scale)
        _store(p, p32, dp, offset)


def supports_rms_clip(rule: str) -> bool:
    """Whether this backend implements ``update_rms_clip`` (SPEC 10.9) for ``rule``."""
    return rule in _RMS_CLIP_MOMENTS


# --------------------------------------------------------------------------------------
# The update rules: update_<name>(hyper, dp, p, g_hat, state) -> float, one per rule of
# dpkern.rules. p is the fp32 parameter (updated in place), g_hat the privatised gradient,
# state the rule's kernel states for this parameter (updated in place). The return value
# is a partial sum of a global reduction (DP-MacAdam), 0.0 for the other rules.
# --------------------------------------------------------------------------------------
def update_sgd(h: Hyper, dp: DPStep, p: Tensor, g: Tensor, state) -> float:
    """torch.optim.SGD on g_hat (SPEC 5.1)."""
    if h.weight_decay != 0:
        g = g + h.weight_decay * p
    if h.momentum != 0:
        buf = state["momentum_buffer"]
        if dp.step == 1:
            buf.copy_(g)
        else:
            buf.mul_(h.momentum).add_((1 - h.dampening) * g)
        g = g + h.momentum * buf if h.nesterov else buf
    p.sub_(h.lr * g)
    return 0.0


def _adam_moments(h: Hyper, t: int, g: Tensor, m: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Update m, v in place; return (m_hat, v_hat)."""
    m.mul_(h.beta1).add_((1 - h.beta1) * g)
    v.mul_(h.beta2).add_((1 - h.beta2) * g * g)
    return m / (1 - h.beta1**t), v / (1 - h.beta2**t)


def _bc_denominator(h: Hyper, dp: DPStep, v_hat: Tensor) -> Tensor:
    """sqrt(max(v_hat - phi_hat, gamma)), phi_hat = phi_t / (1 - beta2^t) (SPEC 5.3)."""
    phi_hat = dp.noise_var_avg / (1 - h.beta2**dp.step)
    return torch.sqrt(torch.clamp(v_hat - phi_hat, min=h.gamma))


def _coupled_decay(h: Hyper, p: Tensor, g: Tensor) -> Tensor:
    """g + wd p (coupled L2, torch.optim.Adam's weight_decay)."""
    return g + h.weight_decay * p if h.weight_decay != 0 else g


def update_adam(h: Hyper, dp: DPStep, p: Tensor, g: Tensor, state) -> float:
    """DP-Adam (SPEC 5.2): coupled L2, p <- p - lr m_hat / (sqrt(v_hat) + eps)."""
    g = _coupled_decay(h, p, g)
    m_hat, v_hat = _adam_moments(h, dp.step, g, state["exp_avg"], state["exp_avg_sq"])
    p.sub_(h.lr * m_hat / (v_hat.sqrt() + h.eps))
    return 0.0


def update_adam_bc(h: Hyper, dp: DPStep, p: Tensor, g: Tensor, state) -> float:
    """DP-AdamBC (SPEC 5.3): coupled L2, p <- p - lr m_hat / sqrt(max(v_hat - phi_hat, gamma))."""
    g = _coupled_decay(h, p, g)
    m_hat, v_hat = _adam_moments(h, dp.step, g, state["exp_avg"], state["exp_avg_sq"])
    p.sub_(h.lr * m_hat / _bc_denominator(h, dp, v_hat))
    return 0.0


def _adamw_direction(h: Hyper, dp: DPStep, g: Tensor, state) -> tuple[Tensor, Tensor]:
    """Update m, v; (m_hat, denominator): sqrt(v_hat) + eps (DP-AdamW), or
    sqrt(max(v_hat - phi_hat, gamma)) (DP-AdamW-BC). The direction is m_hat / denominator."""
    m_hat, v_hat = _adam_moments(h, dp.step, g, state["exp_avg"], state["exp_avg_sq"])
    if h.rule == "adamw_bc":
        return m_hat, _bc_denominator(h, dp, v_hat)
    return m_hat, v_hat.sqrt() + h.eps


def update_adamw(h: Hyper, dp: DPStep, p: Tensor, g: Tensor, state) -> float:
    """DP-AdamW (SPEC 5.4): p <- p (1 - lr wd) first, then DP-Adam's step without decay."""
    p.mul_(1 - h.lr * h.weight_decay)
    m_hat, denom = _adamw_direction(h, dp, g, state)
    p.sub_(h.lr * m_hat / denom)
    return 0.0


def update_adamw_bc(h: Hyper, dp: DPStep, p: Tensor, g: Tensor, state) -> float:
    """DP-AdamW-BC (SPEC 5.5): DP-AdamW with DP-AdamBC's denominator."""
    return update_adamw(h, dp, p, g, state)


def _rms_clip_moments_adamw(h: Hyper, dp: DPStep, p: Tensor, g: Tensor, state):
    """SPEC 10.9, DP-AdamW and DP-AdamW-BC: (sum U^2 with U = m_hat / denominator, the step
    p <- p (1 - lr wd) - ((lr s) m_hat) / denominator as a function of (p, s))."""
    m_hat, denom = _adamw_direction(h, dp, g, state)
    u = m_hat / denom

    def apply(p: Tensor, s: float) -> None:
        p.mul_(1 - h.lr * h.weight_decay)
        p.sub_((h.lr * s) * m_hat / denom)

    return float(_sum64(u * u)), apply


def macadam_variance(h: Hyper, dp: DPStep, exp_var: Tensor, scale: Tensor) -> Tensor:
    """S_hat = clamp(S / kappa_t - b^2 sigma^2 / B_e^2, h1, h2), t >= 2 (SPEC section 7)."""
    kappa = rules.macadam_kappa(h.beta1, dp.step)
    noise_var = scale.square() * (dp.noise_std / dp.expected_batch_size) ** 2
    return torch.clamp(exp_var / kappa - noise_var, min=h.h1, max=h.h2)


def update_macadam(h: Hyper, dp: DPStep, p: Tensor, w_tilde: Tensor, state) -> float:
    """DP-MacAdam (SPEC section 7): w_tilde is the noisy whitened mean. Returns the
    parameter's sum of sqrt(S_hat_j) (t >= 2), for :func:`macadam_update_scale`."""
    t = dp.step
    m, v, S, b = state["exp_avg"], state["exp_avg_sq"], state["exp_var"], state["scale"]
    m_hat_prev = m / (1 - h.beta1 ** (t - 1)) if t > 1 else torch.zeros_like(m)
    g = b * w_tilde + m_hat_prev
    m_hat, v_hat = _adam_moments(h, t, g, m, v)
    p.sub_(h.lr * m_hat / (v_hat.sqrt() + h.gamma))
    if h.variance_estimate == "unbiased":
        u = (g - m_hat_prev) * (g - m_hat)
    elif h.variance_estimate == "paper":
        u = (g - m_hat).square()
    else:  # "code"
        u = (g - m_hat_prev).square()
    S.mul_(h.beta1).add_((1 - h.beta1) * u)
    if t < 2:
        return 0.0
    return float(macadam_variance(h, dp, S, b).sqrt().sum(dtype=torch.float64))


def macadam_update_scale(
    hyper: Hyper, dp: DPStep, exp_vars: list[Tensor], scales: list[Tensor], sqrt_sum: float
) -> None:
    """b <- S_hat^(1/4) * (sum_j S_hat_j^(1/2))^(1/2) for every parameter (t >= 2).

    ``sqrt_sum`` is the global sum returned by :func:`step` over all groups."""
    if dp.step < 2:
        return
    for S, b in zip(exp_vars, scales, strict=True):
        S_hat = macadam_variance(hyper, dp, S, b)
        b.copy_(S_hat.sqrt().sqrt() * math.sqrt(sqrt_sum))


# Schedule-free DP-SGD and DP-AdamW (SPEC 10.8). The parameter holds y (train mode); z is
# the base sequence, set to p at the parameter's first step (schedulefree clones it then).
# The host scalars lr_t and c_t come from rules.schedule_free_scalars.
def _schedule_free_y_z(h: Hyper, lr: float, ckp1: float, beta: float, p, z, g) -> None:
    """y <- lerp(y, z, c_t) + lr_t (beta (1 - c_t) - 1) g;  z <- z - lr_t g (in place)."""
    p.lerp_(z, ckp1)
    p.add_(g, alpha=lr * (beta * (1 - ckp1) - 1))
    z.sub_(g, alpha=lr)


def update_sgd_schedule_free(h: Hyper, dp: DPStep, p: Tensor, g: Tensor, state) -> float:
    """Schedule-free DP-SGD (SPEC 10.8): schedulefree.SGDScheduleFree on g_hat, the weight
    decay coupled at y."""
    lr, _, _, ckp1 = rules.schedule_free_scalars(h, dp.step)
    z = state["z"]
    if dp.step == 1:
        z.copy_(p)
    if h.weight_decay != 0:
        g = g.add(p, alpha=h.weight_decay)
    _schedule_free_y_z(h, lr, ckp1, h.momentum, p, z, g)
    return 0.0


def update_adamw_schedule_free(h: Hyper, dp: DPStep, p: Tensor, g: Tensor, state) -> float:
    """Schedule-free DP-AdamW (SPEC 10.8): schedulefree.AdamWScheduleFree on g_hat; the
    denominator sqrt(v_hat) + eps, or sqrt(max(v_hat - phi_hat, gamma)) with the noise
    bias correction; the weight decay at y, added to the normalised gradient."""
    lr, _, _, ckp1 = rules.schedule_free_scalars(h, dp.step)
    z, v = state["z"], state["exp_avg_sq"]
    if dp.step == 1:
        z.copy_(p)
    v.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    v_hat = v / (1 - h.beta2**dp.step)
    if h.noise_bias_correction:
        denom = _bc_denominator(h, dp, v_hat)
    else:
        denom = v_hat.sqrt() + h.eps
    g = g / denom
    if h.weight_decay != 0:
        g = g.add(p, alpha=h.weight_decay)
    _schedule_free_y_z(h, lr, ckp1, h.beta1, p, z, g)
    return 0.0


def update_rmsprop(h: Hyper, dp: DPStep, p: Tensor, g: Tensor, state) -> float:
    """DP-RMSprop (SPEC 10.1): torch.optim.RMSprop on g_hat, coupled L2;
    p <- p - lr g / (sqrt(v) + eps), or sqrt(v - grad_avg^2) + eps (centered), or
    sqrt(max(v - phi_t, gamma)) + eps (noise bias correction); momentum on g / avg."""
    g = _coupled_decay(h, p, g)
    v = state["square_avg"]
    v.mul_(h.alpha).add_((1 - h.alpha) * g * g)
    if h.centered:
        ga = state["grad_avg"]
        ga.add_((1 - h.alpha) * (g - ga))  # lerp towards g with weight 1 - alpha
        avg = (v - ga * ga).sqrt() + h.eps
    elif h.noise_bias_correction:
        avg = torch.sqrt(torch.clamp(v - dp.noise_var_avg, min=h.gamma)) + h.eps
    else:
        avg = v.sqrt() + h.eps
    if h.momentum > 0:
        buf = state["momentum_buffer"]
        buf.mul_(h.momentum).add_(g / avg)
        p.sub_(h.lr * buf)
    else:
        p.sub_(h.lr * (g / avg))
    return 0.0


def adagrad_lr(h: Hyper, t: int) -> float:
    """clr = lr / (1 + (t - 1) lr_decay) (SPEC 10.2, torch.optim.Adagrad). Python float."""
    return h.lr / (1 + (t - 1) * h.lr_decay)


def update_adagrad(h: Hyper, dp: DPStep, p: Tensor, g: Tensor, state) -> float:
    """DP-Adagrad (SPEC 10.2): torch.optim.Adagrad on g_hat, coupled L2;
    sum <- sum + g^2, p <- p - clr g / (sqrt(sum) + eps), or with the noise bias correction
    sqrt(max(sum - phi_t, gamma)) + eps (phi_t the cumulative noise variance)."""
    g = _coupled_decay(h, p, g)
    acc = state["sum"]
    acc.add_(g * g)
    if h.noise_bias_correction:
        std = torch.sqrt(torch.clamp(acc - dp.noise_var_avg, min=h.gamma)) + h.eps
    else:
        std = acc.sqrt() + h.eps
    p.sub_(adagrad_lr(h, dp.step) * (g / std))
    return 0.0


# --------------------------------------------------------------------------------------
# DP-Adadelta (SPEC 10.5)
# --------------------------------------------------------------------------------------
def update_adadelta(h: Hyper, dp: DPStep, p: Tensor, g: Tensor, state) -> float:
    """torch.optim.Adadelta on g_hat (SPEC 10.5): coupled L2; v = rho v + (1 - rho) g^2;
    coef = sqrt(u + eps) / sqrt(v + eps); delta = coef g; u = rho u + (1 - rho) delta^2;
    p <- p - lr delta. With noise_bias_correction: v - phi_t (floored at gamma) and
    u - psi (floored at 0) in place of v and u, and psi = rho psi + (1 - rho) coef^2 Phi_t."""
    g = _coupled_decay(h, p, g)
    v, u = state["square_avg"], state["acc_delta"]
    v.mul_(h.rho).add_((1 - h.rho) * g * g)
    if h.noise_bias_correction:
        psi = state["acc_delta_noise_var"]
        std = torch.sqrt(torch.clamp(v - dp.noise_var_avg, min=h.gamma) + h.eps)
        num = torch.sqrt(torch.clamp(u - psi, min=0.0) + h.eps)
    else:
        std = torch.sqrt(v + h.eps)
        num = torch.sqrt(u + h.eps)
    coef = num / std
    delta = coef * g
    u.mul_(h.rho).add_((1 - h.rho) * delta * delta)
    if h.noise_bias_correction:  # the noise part of u: Var[delta] = coef^2 Phi_t
        noise_var = (dp.noise_std / dp.expected_batch_size) ** 2
        psi.mul_(h.rho).add_((1 - h.rho) * coef * coef * noise_var)
    p.sub_(h.lr * delta)
    return 0.0


# --------------------------------------------------------------------------------------
# DP-AdEMAMix (SPEC 10.6)
# --------------------------------------------------------------------------------------
def update_ademamix(h: Hyper, dp: DPStep, p: Tensor, g: Tensor, state) -> float:
    """AdEMAMix (Algorithm 1 of arXiv 2409.03137) on g_hat (SPEC 10.6): p <- p (1 - lr wd);
    m1 = b1 m1 + (1 - b1) g; m2 = b3_t m2 + (1 - b3_t) g; v = b2 v + (1 - b2) g^2;
    p <- p - lr (m1_hat + alpha_t m2) / (sqrt(v_hat) + eps), computed as
    p - (A m1 + B m2) / (sqrt(v) + E); with the correction v -> max(v - phi_t, G)."""
    beta3, A, B, E, G = rules.ademamix_scalars(h, dp.step)
    m1, m2, v = state["exp_avg"], state["exp_avg_slow"], state["exp_avg_sq"]
    p.mul_(1 - h.lr * h.weight_decay)
    m1.mul_(h.beta1).add_((1 - h.beta1) * g)
    m2.mul_(beta3).add_((1 - beta3) * g)
    v.mul_(h.beta2).add_((1 - h.beta2) * g * g)
    if h.noise_bias_correction:  # max(v_hat - phi_hat, gamma) times (1 - beta2^t)
        vc = torch.clamp(v - dp.noise_var_avg, min=G)
    else:
        vc = v
    p.sub_((A * m1 + B * m2) / (vc.sqrt() + E))
    return 0.0


# DP-RAdam (SPEC 10.3) ------------------------------------------------------------------
def update_radam(h: Hyper, dp: DPStep, p: Tensor, g: Tensor, state) -> float:
    """DP-RAdam (SPEC 10.3): torch.optim.RAdam on g_hat. Weight decay coupled (g + wd p)
    or decoupled (p <- p (1 - lr wd) first); m, v as Adam; then, by rho_t (a host-side
    function of beta2 and t, :func:`dpkern.rules.radam_rectification`):
    warm-up (rho_t <= 5): p <- p - m_hat lr (v is kept but not read);
    rectified: p <- p - ((m_hat lr) (sqrt(1 - beta2^t) / (sqrt(v) + eps))) r_t, or with
    noise_bias_correction p <- p - ((m_hat lr) r_t) / sqrt(max(v_hat - phi_hat, gamma))."""
    if h.weight_decay != 0:
        if h.decoupled_weight_decay:
            p.mul_(1 - h.lr * h.weight_decay)
        else:
            g = g + h.weight_decay * p
    t = dp.step
    v = state["exp_avg_sq"]
    m_hat, v_hat = _adam_moments(h, t, g, state["exp_avg"], v)
    rect = rules.radam_rectification(h.beta2, t)
    if rect is None:  # warm-up: the un-adapted step
        p.sub_(m_hat * h.lr)
    elif h.noise_bias_correction:
        p.sub_((m_hat * h.lr) * rect / _bc_denominator(h, dp, v_hat))
    else:  # torch.optim.RAdam: eps on sqrt(v), then the reciprocal times sqrt(1 - beta2^t)
        adaptive = (v.sqrt() + h.eps).reciprocal() * (1 - h.beta2**t) ** 0.5
        p.sub_((m_hat * h.lr) * adaptive * rect)
    return 0.0


# DP-Lion (SPEC 10.4) -------------------------------------------------------------------
def update_lion(h: Hyper, dp: DPStep, p: Tensor, g: Tensor, state) -> float:
    """DP-Lion (SPEC 10.4): lion_pytorch.Lion on g_hat. p <- p (1 - lr wd) (decoupled),
    p <- p - lr sign(beta1 m + (1 - beta1) g), m <- beta2 m + (1 - beta2) g; sign(0) = 0
    (torch.sign: also 0 for NaN)."""
    m = state["exp_avg"]
    p.mul_(1 - h.lr * h.weight_decay)
    c = m * h.beta1 + (1 - h.beta1) * g
    p.sub_(h.lr * torch.sign(c))
    m.mul_(h.beta2).add_((1 - h.beta2) * g)
    return 0.0


# --------------------------------------------------------------------------------------
# DP-Adafactor (SPEC 10.7): torch.optim.Adafactor on g_hat, with the optional noise bias
# correction of its factors. Sums are float64 accumulations of float32 terms.
# --------------------------------------------------------------------------------------
def _sum64(x: Tensor, dim=None) -> Tensor:
    x = x.to(torch.float64)
    return x.sum() if dim is None else x.sum(dim=dim)


def adafactor_scalars(h: Hyper, t: int) -> tuple[float, float, float]:
    """(w_t, 1 - w_t, rho_t): the EMA weight t^beta2_decay, its complement and the relative
    step min(lr, 1/sqrt(t)) (Python floats)."""
    w = rules.adafactor_weight(h, t)
    return w, 1 - w, min(h.lr, 1 / t**0.5)


def _lerp(a: Tensor, b: Tensor, w: float, one_m_w: float) -> Tensor:
    """torch.lerp(a, b, w): a + w (b - a) for w < 0.5, else b - (b - a)(1 - w)."""
    return a + w * (b - a) if w < 0.5 else b - (b - a) * one_m_w


def update_adafactor(h: Hyper, dp: DPStep, p: Tensor, g: Tensor, state) -> float:
    """DP-Adafactor (SPEC 10.7): decoupled decay, factored (>= 2-D) or unfactored second
    moment (phi subtracted where V is formed, floored at gamma, when correcting), update
    U = g / sqrt(max(V, eps1^2)) clipped to RMS d, step alpha_t = max(eps2, RMS(p)) rho_t."""
    if p.numel() == 0:
        return 0.0
    alpha, denom, u, _ = _adafactor_direction(h, dp, p, g, state)
    p.mul_(1 - h.lr * h.weight_decay)
    p.sub_((alpha / denom) * u)
    return 0.0


def _rms_clip_moments_adafactor(h: Hyper, dp: DPStep, p: Tensor, g: Tensor, state):
    """SPEC 10.9, DP-Adafactor: U = U_hat / max(1, RMS(U_hat) / d) (after its own clip), so
    sum U^2 = ||U_hat||^2 / max(...)^2; the step p <- p (1 - lr wd) - ((alpha_t / max(...))
    s) U_hat as a function of (p, s)."""
    if p.numel() == 0:
        return 0.0, lambda p, s: None
    alpha, denom, u, uu = _adafactor_direction(h, dp, p, g, state)

    def apply(p: Tensor, s: float) -> None:
        p.mul_(1 - h.lr * h.weight_decay)
        p.sub_(((alpha / denom) * s) * u)

    return uu / (denom * denom), apply


def _adafactor_direction(h: Hyper, dp: DPStep, p: Tensor, g: Tensor, state):
    """Steps 2-3 of SPEC 10.7 on a non-empty parameter (p before the decay, unchanged): the
    states updated; (alpha_t, max(1, RMS(U) / d), U, ||U||^2 as a float64 sum)."""
    n = p.numel()
    w, one_m_w, rho = adafactor_scalars(h, dp.step)
    alpha = max(h.eps2, math.sqrt(float(_sum64(p * p))) / n**0.5) * rho
    correct = rules.of(h).corrects(h)
    row, col = state["row_var"], state["col_var"]
    g2 = g * g
    if p.dim() >= 2:
        R, C = p.shape[-2], p.shape[-1]
        row.copy_(_lerp(row, (_sum64(g2, -1) / C).float(), w, one_m_w))
        col.copy_(_lerp(col, (_sum64(g2, -2) / R).float(), w, one_m_w))
        r, c = row, col
        if correct:
            r = torch.clamp(row - dp.noise_var_avg, min=h.gamma)
            c = torch.clamp(col - dp.noise_var_avg, min=h.gamma)
        mean = torch.clamp((_sum64(r, -1) / R).float(), min=h.eps1)
        v = (r.unsqueeze(-1) * c.unsqueeze(-2)) / mean[..., None, None]
    else:
        row.copy_(_lerp(row, g2, w, one_m_w))
        v = torch.clamp(row - dp.noise_var_avg, min=h.gamma) if correct else row
    u = g / torch.sqrt(torch.clamp(v, min=h.eps1 * h.eps1))
    uu = float(_sum64(u * u))
    denom = max(1.0, math.sqrt(uu) / (n**0.5 * h.d))
    return alpha, denom, u, uu


#: The rules with update_rms_clip (SPEC 10.9): name -> pass A's per-parameter function.
_RMS_CLIP_MOMENTS = {
    "adamw": _rms_clip_moments_adamw,
    "adamw_bc": _rms_clip_moments_adamw,
    "adafactor": _rms_clip_moments_adafactor,
}


def _updates() -> dict:
    """name -> update_<name> for every registered rule (the reference implements all)."""
    out = {}
    for name in rules.RULES:
        fn = globals().get(f"update_{name}")
        if fn is None:
            raise RuntimeError(
                f"dpkern.rules registers {name!r} but dpkern.backends.reference has no "
                f"update_{name}: every rule needs its reference function"
            )
        out[name] = fn
    return out


#: The dispatch: rule name -> its update function (built from the registry).
UPDATES = _updates()


def _update_of(rule: str):
    try:
        return UPDATES[rule]
    except KeyError:
        raise NotImplementedError(
            f"dpkern backend='torch' has no update function for rule {rule!r}"
        ) from None


def supports(rule: str) -> bool:
    """Whether this backend implements the update rule ``rule`` (all registered rules)."""
    return rule in UPDATES
