"""The accounted mechanism on dp-accounting: DP-SGD's T compositions of the
Poisson-subsampled Gaussian (:func:`dpsgd_event`), epsilon for a noise multiplier
(:func:`get_epsilon`) and the noise multiplier for a target (:func:`get_noise_multiplier`);
the argument checks the package shares."""

from __future__ import annotations

import logging
import math
import numbers

import dp_accounting
from dp_accounting import pld, rdp

from ..hyper import check_nonnegative, check_positive


class _QuietExcludedOrders(logging.Filter):
    """dp-accounting warns (absl, once per order and call) when the series of an RDP
    order below 2 does not converge and leaves that order out. The epsilon stays a valid
    upper bound (a minimum over fewer orders is never smaller), and a calibration logs
    dozens of these lines: they are dropped; every other absl message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ("failed to converge" in msg and "Excluding this order" in msg)


logging.getLogger("absl").addFilter(_QuietExcludedOrders())

ACCOUNTANTS = ("rdp", "pld")
RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
MAX_NOISE_MULTIPLIER = 1e6


def _check_rate(sample_rate) -> float:
    if not 0.0 <= check_nonnegative("sample_rate", sample_rate) <= 1.0:
        raise ValueError(f"invalid sample_rate={sample_rate!r}: must be in [0, 1]")
    return float(sample_rate)


def _check_delta(name, delta) -> float:
    if not 0.0 < check_positive(name, delta) < 1.0:
        raise ValueError(f"invalid {name}={delta!r}: must be in (0, 1)")
    return float(delta)


def _check_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"invalid steps={steps!r}: expected an int >= 0")
    return steps


def _check_count(name, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"invalid {name}={value!r}: expected an int >= 0")
    return int(value)


def _check_accountant(accountant) -> str:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"invalid accountant={accountant!r}: expected one of {ACCOUNTANTS}")
    return accountant


def _fresh(accountant: str):
    if accountant == "rdp":
        return rdp.RdpAccountant(orders=list(RDP_ORDERS))
    return pld.PLDAccountant(value_discretization_interval=1e-4)


def dpsgd_event(noise_multiplier: float, sample_rate: float, steps: int) -> dp_accounting.DpEvent:
    """The DpEvent of ``steps`` Poisson-subsampled Gaussian steps (Abadi et al. 2016)."""
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
        ),
        steps,
    )


def get_epsilon(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp"
) -> float:
    """Epsilon spent by ``steps`` DP-SGD steps (Poisson rate q, noise multiplier sigma).

    Args: noise_multiplier sigma >= 0; sample_rate q in [0, 1]; steps >= 0;
    delta in (0, 1); accountant "rdp" (Mironov 2017, conversion of Balle et al. 2020)
    or "pld" (privacy loss distributions, Koskela et al. 2020; Doroshenko et al. 2022).
    Returns: epsilon (float; ``inf`` when sigma = 0 and q > 0 and steps > 0).
    Raises: ValueError on arguments out of range."""
    check_nonnegative("noise_multiplier", noise_multiplier)
    q, T = _check_rate(sample_rate), _check_steps(steps)
    _check_delta("delta", delta)
    _check_accountant(accountant)
    if T == 0 or q == 0.0:
        return 0.0
    if noise_multiplier == 0.0:
        return math.inf
    acc = _fresh(accountant)
    acc.compose(dpsgd_event(noise_multiplier, q, T))
    return float(acc.get_epsilon(delta))


def get_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    *,
    tol: float = 1e-3,
) -> float:
    """The noise multiplier sigma such that ``steps`` steps at rate q spend at most
    ``target_epsilon`` at ``target_delta`` (and sigma - tol would spend more).

    Args: target_epsilon > 0; target_delta in (0, 1); sample_rate q in [0, 1]; steps >= 0;
    accountant "rdp" or "pld" (as :func:`get_epsilon`); tol > 0, the bracket width of
    dp-accounting's ``calibrate_dp_mechanism`` (bisection over [0, 1e6]).
    Returns: sigma (float >= 0; 0.0 when steps = 0 or q = 0).
    Raises: ValueError on arguments out of range, or when no sigma <= 1e6 reaches the
    target (budget too small for that many steps)."""
    check_positive("target_epsilon", target_epsilon)
    _check_delta("target_delta", target_delta)
    q, T = _check_rate(sample_rate), _check_steps(steps)
    check_positive("tol", tol)
    _check_accountant(accountant)
    if T == 0 or q == 0.0:
        return 0.0
    if get_epsilon(MAX_NOISE_MULTIPLIER, q, T, target_delta, accountant) > target_epsilon:
        raise ValueError(
            f"no noise_multiplier <= {MAX_NOISE_MULTIPLIER:g} reaches "
            f"epsilon={target_epsilon!r} at delta={target_delta!r} with "
            f"sample_rate={q!r} and steps={T!r}"
        )
    return float(
        dp_accounting.calibrate_dp_mechanism(
            lambda: _fresh(accountant),
            lambda s: dpsgd_event(s, q, T),
            target_epsilon,
            target_delta,
            dp_accounting.ExplicitBracketInterval(0.0, MAX_NOISE_MULTIPLIER),
            tol=tol,
        )
    )
