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
    """DP-AdamW (SPEC 5.4): decoupled weight decay p <- p (1 - lr wd) first."""

    rule: ClassVar[str] = "adamw"
    weight_decay: float = 1e-2


@dataclass(frozen=True)
class AdamWBCHyper(AdamBCHyper):
    """DP-AdamW-BC (SPEC 5.5): DP-AdamW with the DP-AdamBC denominator."""

    rule: ClassVar[str] = "adamw_bc"
    weight_decay: float = 1e-2


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

    def __post_init__(self):
        super().__post_init__()
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
    """

    key: NoiseKey = field(repr=False)
    step: int
    noise_std: float
    expected_batch_size: float
    stream: int = 0
    noise_var_avg: float = 0.0
    noise_step: int | None = None

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
        check_nonnegative("noise_std", self.noise_std)
        check_positive("expected_batch_size", self.expected_batch_size)
