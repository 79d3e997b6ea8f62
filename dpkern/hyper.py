"""Hyper-parameters: one small frozen dataclass per update rule, validated on construction.

Each dataclass's ``rule`` names its entry in the rule registry (:mod:`dpkern.rules`).

These travel unchanged from the front-ends (``dpkern.optim``, ``dpkern.functional``) to
every backend, so a backend never re-validates and never sees a long argument list.
Every invalid value is a ``ValueError`` naming the parameter and its value (SPEC section 9).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Union

from .keys import NoiseKey, as_key

VARIANCE_ESTIMATES = ("unbiased", "paper", "code")


def _bad(name: str, value, why: str) -> ValueError:
    return ValueError(f"invalid {name}={value!r}: {why}")


def _finite(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, value, "expected a real number")
    if not math.isfinite(value):
        raise _bad(name, value, "expected a finite number")
    return float(value)


def check_nonnegative(name: str, value) -> float:
    if _finite(name, value) < 0:
        raise _bad(name, value, "must be >= 0")
    return float(value)


def check_positive(name: str, value) -> float:
    if _finite(name, value) <= 0:
        raise _bad(name, value, "must be > 0")
    return float(value)


def check_update_rms_clip(value) -> float | None:
    """``update_rms_clip`` (SPEC 10.9): None (off) or a finite float > 0."""
    if value is None:
        return None
    return check_positive("update_rms_clip", value)


def check_beta(name: str, value) -> float:
    if not 0.0 <= _finite(name, value) < 1.0:
        raise _bad(name, value, "must be in [0, 1)")
    return float(value)


def check_betas(betas) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise _bad("betas", betas, "expected a pair (beta1, beta2)")
    return check_beta("betas[0]", betas[0]), check_beta("betas[1]", betas[1])


@dataclass(frozen=True)
class _Base:
    rule: ClassVar[str]
    lr: float

    def __post_init__(self):
        check_nonnegative("lr", self.lr)


@dataclass(frozen=True)
class SGDHyper(_Base):
    """DP-SGD (SPEC 5.1): torch.optim.SGD's momentum, dampening, nesterov, coupled L2."""

    rule: ClassVar[str] = "sgd"
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_nonnegative("momentum", self.momentum)
        check_nonnegative("dampening", self.dampening)
        check_nonnegative("weight_decay", self.weight_decay)
        if not isinstance(self.nesterov, bool):
            raise _bad("nesterov", self.nesterov, "expected a bool")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise _bad("nesterov", self.nesterov, "requires momentum > 0 and dampening = 0")


@dataclass(frozen=True)
class _AdamBase(_Base):
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        check_beta("betas[0]", self.beta1)
        check_beta("betas[1]", self.beta2)
        check_nonnegative("weight_decay", getattr(self, "weight_decay", 0.0))


@dataclass(frozen=True)
class AdamHyper(_AdamBase):
    """DP-Adam (SPEC 5.2): coupled L2 weight decay, denominator sqrt(v_hat) + eps."""

    rule: ClassVar[str] = "adam"
    eps: float = 1e-8

    def __post_init__(self):
        super().__post_init__()
        check_positive("eps", self.eps)


@dataclass(frozen=True)
class AdamBCHyper(_AdamBase):
    """DP-AdamBC (SPEC 5.3): denominator sqrt(max(v_hat - phi_hat, gamma))."""

    rule: ClassVar[str] = "adam_bc"
    gamma: float = 1e-8

    def __post_init__(self):
        super().__post_init__()
        check_positive("gamma", self.gamma)


@dataclass(frozen=True)
class AdamWHyper(AdamHyper):
    """DP-AdamW (SPEC 5.4): decoupled weight decay p <- p (1 - lr wd) first;
    ``update_rms_clip``: the update's RMS over the model clipped (SPEC 10.9)."""

    rule: ClassVar[str] = "adamw"
    weight_decay: float = 1e-2
    update_rms_clip: float | None = None

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "update_rms_clip", check_update_rms_clip(self.update_rms_clip))


@dataclass(frozen=True)
class AdamWBCHyper(AdamBCHyper):
    """DP-AdamW-BC (SPEC 5.5): DP-AdamW with the DP-AdamBC denominator."""

    rule: ClassVar[str] = "adamw_bc"
    weight_decay: float = 1e-2
    update_rms_clip: float | None = None

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "update_rms_clip", check_update_rms_clip(self.update_rms_clip))


@dataclass(frozen=True)
class MacAdamHyper(_AdamBase):
    """DP-MacAdam (SPEC section 7). No weight decay; gamma is added outside the sqrt."""

    rule: ClassVar[str] = "macadam"
    gamma: float = 1e-8
    h1: float = 1e-9
    h2: float = 1e-6
    variance_estimate: str = "unbiased"

    def __post_init__(self):
        super().__post_init__()
        check_positive("gamma", self.gamma)
        check_positive("h1", self.h1)
        check_positive("h2", self.h2)
        if self.h1 > self.h2:
            raise _bad("h1", self.h1, f"must be <= h2={self.h2!r}")
        if self.variance_estimate not in VARIANCE_ESTIMATES:
            raise _bad(
                "variance_estimate", self.variance_estimate, f"expected one of {VARIANCE_ESTIMATES}"
            )


# --------------------------------------------------------------------------------------
# Schedule-free DP-SGD and DP-AdamW (SPEC 10.8)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _ScheduleFreeBase(_Base):
    """The schedule-free options (``schedulefree``'s) and the group's running scalars.

    ``weight_sum`` and ``lr_max`` are not options but the group's averaging state before
    this step, kept in the param group as the package keeps them (0.0 and -1.0 before the
    first step); :func:`dpkern.rules.schedule_free_scalars` derives the step's scalars."""

    weight_decay: float = 0.0
    warmup_steps: int = 0
    r: float = 0.0
    weight_lr_power: float = 2.0
    noise_bias_correction: bool = False
    weight_sum: float = 0.0
    lr_max: float = -1.0

    def __post_init__(self):
        super().__post_init__()
        check_nonnegative("weight_decay", self.weight_decay)
        if (
            isinstance(self.warmup_steps, bool)
            or not isinstance(self.warmup_steps, int)
            or self.warmup_steps < 0
        ):
            raise _bad("warmup_steps", self.warmup_steps, "expected an int >= 0")
        check_nonnegative("r", self.r)
        check_nonnegative("weight_lr_power", self.weight_lr_power)
        if not isinstance(self.noise_bias_correction, bool):
            raise _bad("noise_bias_correction", self.noise_bias_correction, "expected a bool")
        check_nonnegative("weight_sum", self.weight_sum)
        if _finite("lr_max", self.lr_max) != -1.0 and self.lr_max < 0:
            raise _bad("lr_max", self.lr_max, "must be -1 (before the first step) or >= 0")


@dataclass(frozen=True)
class SGDScheduleFreeHyper(_ScheduleFreeBase):
    """Schedule-free DP-SGD (SPEC 10.8): schedulefree.SGDScheduleFree on g_hat."""

    rule: ClassVar[str] = "sgd_schedule_free"
    momentum: float = 0.9

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 < _finite("momentum", self.momentum) < 1.0:
            raise _bad("momentum", self.momentum, "must be in (0, 1)")
        if self.noise_bias_correction:
            raise _bad(
                "noise_bias_correction",
                self.noise_bias_correction,
                "schedule-free SGD keeps no second moment to correct",
            )


@dataclass(frozen=True)
class AdamWScheduleFreeHyper(_ScheduleFreeBase):
    """Schedule-free DP-AdamW (SPEC 10.8): schedulefree.AdamWScheduleFree on g_hat; with
    noise_bias_correction, the denominator sqrt(max(v_hat - phi_hat, gamma))."""

    rule: ClassVar[str] = "adamw_schedule_free"
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    gamma: float = 1e-8

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 < _finite("betas[0]", self.beta1) < 1.0:
            raise _bad("betas[0]", self.beta1, "must be in (0, 1) (eval() divides by it)")
        check_beta("betas[1]", self.beta2)
        check_positive("eps", self.eps)
        check_positive("gamma", self.gamma)


@dataclass(frozen=True)
class RMSpropHyper(_Base):
    """DP-RMSprop (SPEC 10.1): torch.optim.RMSprop on g_hat (coupled L2, eps outside the
    sqrt), optionally with the noise bias correction sqrt(max(v - phi, gamma)) + eps."""

    rule: ClassVar[str] = "rmsprop"
    alpha: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False
    noise_bias_correction: bool = False
    gamma: float = 1e-8

    def __post_init__(self):
        super().__post_init__()
        check_beta("alpha", self.alpha)
        check_positive("eps", self.eps)
        check_nonnegative("weight_decay", self.weight_decay)
        check_nonnegative("momentum", self.momentum)
        check_positive("gamma", self.gamma)
        for name in ("centered", "noise_bias_correction"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "expected a bool")
        if self.centered and self.noise_bias_correction:
            raise _bad(
                "centered",
                self.centered,
                "centered=True with noise_bias_correction=True is not supported: the noise "
                "in the centred second moment has no exact known correction (SPEC 10.1)",
            )


@dataclass(frozen=True)
class AdagradHyper(_Base):
    """DP-Adagrad (SPEC 10.2): torch.optim.Adagrad on g_hat (coupled L2, lr decay, eps
    outside the sqrt), optionally with sqrt(max(sum - phi, gamma)) + eps, phi cumulative."""

    rule: ClassVar[str] = "adagrad"
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    noise_bias_correction: bool = False
    gamma: float = 1e-8

    def __post_init__(self):
        super().__post_init__()
        check_nonnegative("lr_decay", self.lr_decay)
        check_nonnegative("weight_decay", self.weight_decay)
        check_nonnegative("initial_accumulator_value", self.initial_accumulator_value)
        check_positive("eps", self.eps)
        check_positive("gamma", self.gamma)
        if not isinstance(self.noise_bias_correction, bool):
            raise _bad("noise_bias_correction", self.noise_bias_correction, "expected a bool")


# --------------------------------------------------------------------------------------
# DP-Adadelta (SPEC 10.5)
# --------------------------------------------------------------------------------------
def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise _bad(name, value, "expected a bool")
    return value


@dataclass(frozen=True)
class AdadeltaHyper(_Base):
    """DP-Adadelta (SPEC 10.5): torch.optim.Adadelta on g_hat (coupled L2), optionally with
    the noise variance removed from both EMAs (``noise_bias_correction``)."""

    rule: ClassVar[str] = "adadelta"
    lr: float = 1.0
    rho: float = 0.9
    eps: float = 1e-6
    weight_decay: float = 0.0
    noise_bias_correction: bool = False
    gamma: float = 1e-8

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= _finite("rho", self.rho) <= 1.0:  # torch.optim.Adadelta's range
            raise _bad("rho", self.rho, "must be in [0, 1]")
        check_positive("eps", self.eps)
        check_nonnegative("weight_decay", self.weight_decay)
        check_bool("noise_bias_correction", self.noise_bias_correction)
        check_positive("gamma", self.gamma)


# --------------------------------------------------------------------------------------
# DP-AdEMAMix (SPEC 10.6)
# --------------------------------------------------------------------------------------
def check_betas3(betas) -> tuple[float, float, float]:
    """AdEMAMix's ``betas`` triple (beta1, beta2, beta3), each in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 3:
        raise _bad("betas", betas, "expected a triple (beta1, beta2, beta3)")
    return tuple(check_beta(f"betas[{i}]", b) for i, b in enumerate(betas))


@dataclass(frozen=True)
class AdEMAMixHyper(_AdamBase):
    """DP-AdEMAMix (SPEC 10.6): Pagliardini et al. 2024, Algorithm 1 on g_hat, decoupled
    weight decay; ``t_alpha_beta3`` steps of warm-up for alpha and beta3 (None or 0: none,
    stored as 0); optionally DP-AdamBC's correction of the second moment."""

    rule: ClassVar[str] = "ademamix"
    beta3: float = 0.9999
    alpha: float = 5.0
    eps: float = 1e-8
    t_alpha_beta3: int | None = None
    noise_bias_correction: bool = False
    gamma: float = 1e-8

    def __post_init__(self):
        super().__post_init__()
        check_beta("betas[2]", self.beta3)
        check_nonnegative("alpha", self.alpha)
        check_positive("eps", self.eps)
        check_bool("noise_bias_correction", self.noise_bias_correction)
        check_positive("gamma", self.gamma)
        T = self.t_alpha_beta3
        if T is None:
            T = 0
        if isinstance(T, bool) or not isinstance(T, int) or not 0 <= T < 2**48:
            raise _bad("t_alpha_beta3", self.t_alpha_beta3, "expected None or an int >= 0")
        if T and (self.beta1 == 0 or self.beta3 == 0):
            # the beta3 scheduler interpolates log(beta1) and log(beta3)
            raise _bad(
                "t_alpha_beta3",
                T,
                f"the beta3 warm-up needs betas[0] > 0 and betas[2] > 0, got "
                f"({self.beta1!r}, {self.beta2!r}, {self.beta3!r})",
            )
        object.__setattr__(self, "t_alpha_beta3", T)  # None and 0 both mean no warm-up


# --------------------------------------------------------------------------------------
# DP-RAdam (SPEC 10.3)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RAdamHyper(_AdamBase):
    """DP-RAdam (SPEC 10.3): torch.optim.RAdam's rectified Adam (coupled L2, or decoupled
    decay with ``decoupled_weight_decay``); with ``noise_bias_correction`` the adaptive
    step's denominator is sqrt(max(v_hat - phi_hat, gamma)) (no eps)."""

    rule: ClassVar[str] = "radam"
    eps: float = 1e-8
    decoupled_weight_decay: bool = False
    noise_bias_correction: bool = False
    gamma: float = 1e-8

    def __post_init__(self):
        super().__post_init__()
        check_positive("eps", self.eps)
        check_positive("gamma", self.gamma)
        for name in ("decoupled_weight_decay", "noise_bias_correction"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "expected a bool")


# --------------------------------------------------------------------------------------
# DP-Lion (SPEC 10.4)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LionHyper(_Base):
    """DP-Lion (SPEC 10.4): lion_pytorch.Lion, decoupled decay p <- p (1 - lr wd), the
    update lr sign(beta1 m + (1 - beta1) g). No second moment, so no noise bias
    correction: ``noise_bias_correction`` must be False."""

    rule: ClassVar[str] = "lion"
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.0
    noise_bias_correction: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_beta("betas[0]", self.beta1)
        check_beta("betas[1]", self.beta2)
        check_nonnegative("weight_decay", self.weight_decay)
        if self.noise_bias_correction is not False:
            raise _bad(
                "noise_bias_correction",
                self.noise_bias_correction,
                "DP-Lion keeps no second moment, so there is no noise variance to correct "
                "(only False is accepted)",
            )


#: float32's machine epsilon, Adafactor's eps1 when None (updates are computed in float32).
FLOAT32_EPS = 2.0**-23


@dataclass(frozen=True)
class AdafactorHyper(_Base):
    """DP-Adafactor (SPEC 10.7): torch.optim.Adafactor's arguments (``eps`` split into
    ``eps1``, ``eps2``; ``eps1=None`` becomes float32's epsilon), decoupled weight decay,
    and the noise bias correction of its factored second moment (floor ``gamma``)."""

    rule: ClassVar[str] = "adafactor"
    lr: float = 1e-2
    beta2_decay: float = -0.8
    eps1: float | None = None
    eps2: float = 1e-3
    d: float = 1.0
    weight_decay: float = 0.0
    noise_bias_correction: bool = False
    gamma: float = 1e-8
    update_rms_clip: float | None = None

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "update_rms_clip", check_update_rms_clip(self.update_rms_clip))
        if _finite("beta2_decay", self.beta2_decay) > 0:
            raise _bad("beta2_decay", self.beta2_decay, "must be <= 0")
        if self.eps1 is None:
            object.__setattr__(self, "eps1", FLOAT32_EPS)
        check_nonnegative("eps[0]", self.eps1)
        check_nonnegative("eps[1]", self.eps2)
        if _finite("d", self.d) < 1:
            raise _bad("d", self.d, "must be >= 1")
        check_nonnegative("weight_decay", self.weight_decay)
        if not isinstance(self.noise_bias_correction, bool):
            raise _bad("noise_bias_correction", self.noise_bias_correction, "expected a bool")
        check_positive("gamma", self.gamma)
        for name in ("lr", "beta2_decay", "eps1", "eps2", "d", "weight_decay", "gamma"):
            object.__setattr__(self, name, float(getattr(self, name)))


Hyper = Union[  # noqa: UP007 (one member per line)
    SGDHyper,
    AdamHyper,
    AdamBCHyper,
    AdamWHyper,
    AdamWBCHyper,
    MacAdamHyper,
    SGDScheduleFreeHyper,
    AdamWScheduleFreeHyper,
    RMSpropHyper,
    AdagradHyper,
    AdadeltaHyper,
    AdEMAMixHyper,
    RAdamHyper,
    LionHyper,
    AdafactorHyper,
]


def __getattr__(name):
    """``RULES`` and ``HYPER_CLASSES`` moved to the rule registry (:mod:`dpkern.rules`)."""
    if name in ("RULES", "HYPER_CLASSES"):
        import warnings

        from . import rules

        warnings.warn(
            f"dpkern.hyper.{name} is deprecated: use dpkern.rules.RULES",
            DeprecationWarning,
            stacklevel=2,
        )
        if name == "RULES":
            return tuple(rules.RULES)
        return {n: spec.hyper_class for n, spec in rules.RULES.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The Philox stream id of the stochastic rounding of bf16 parameters (SPEC 3.2); 0 is the
#: gradient noise, 1 the sampling stream.
ROUNDING_STREAM = 2


def check_stochastic_rounding(value) -> bool:
    """``stochastic_rounding`` must be a bool (SPEC 9: ValueError naming the value)."""
    if not isinstance(value, bool):
        raise _bad("stochastic_rounding", value, "expected a bool")
    return value


@dataclass(frozen=True)
class DPStep:
    """What one DP step needs besides the update rule's hyper-parameters.

    key: the noise key, a :class:`dpkern.keys.NoiseKey` (an int is wrapped in one);
        backends unwrap it with :func:`dpkern.keys.reveal` at the kernel call only.
    step: t of the update rule, counted from 1: the parameters' own step count
        (``state["step"]``, as in torch.optim), which drives bias corrections and the
        first-step cases (momentum buffer, MacAdam's m_hat_0).
    noise_step: the optimizer's global step, the noise stream's counter (SPEC section 3);
        ``None`` means equal to ``step``. A (key, noise_step) pair serves one release.
    noise_std: standard deviation of the noise added to the clipped sum, sigma * C
        (sigma for DP-MacAdam, whose clip bound is 1 in the whitened space).
    expected_batch_size: B_e, the normaliser (SPEC section 4).
    stream: 16-bit noise stream id (0 = gradient noise).
    noise_var_avg: phi_t, the EMA of Phi = (sigma C / B_e)^2 including this step
        (DP-AdamBC / DP-AdamW-BC, SPEC 5.3); unused by the other rules.
    stochastic_rounding: round bfloat16 parameters stochastically on store, with the
        rounding stream (SPEC 3.2: stream ``ROUNDING_STREAM`` of the noise key at
        ``noise_step``); False (default): round to nearest even. float32 and float16
        parameters are unaffected.
    """

    key: NoiseKey = field(repr=False)
    step: int
    noise_std: float
    expected_batch_size: float
    stream: int = 0
    noise_var_avg: float = 0.0
    noise_step: int | None = None
    stochastic_rounding: bool = False

    def __post_init__(self):
        object.__setattr__(self, "key", as_key(self.key))
        for name in ("step", "noise_step"):
            value = getattr(self, name)
            if value is None and name == "noise_step":
                object.__setattr__(self, name, self.step)
            elif isinstance(value, bool) or not (isinstance(value, int) and 1 <= value < 2**48):
                raise _bad(name, value, "expected an int in [1, 2**48)")
        if not (isinstance(self.stream, int) and 0 <= self.stream < 2**16):
            raise _bad("stream", self.stream, "expected an int in [0, 2**16)")
        check_stochastic_rounding(self.stochastic_rounding)
        if self.stochastic_rounding and self.stream == ROUNDING_STREAM:
            raise _bad(
                "stream",
                self.stream,
                f"stream {ROUNDING_STREAM} is the rounding stream (SPEC 3.2): the noise "
                "cannot use it with stochastic_rounding=True",
            )
        check_nonnegative("noise_std", self.noise_std)
        check_positive("expected_batch_size", self.expected_batch_size)
