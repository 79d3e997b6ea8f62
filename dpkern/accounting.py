"""Privacy accounting on Google's dp-accounting (RDP and PLD), never home-made (SPEC 8).

The mechanism is DP-SGD's: T self-compositions of the Poisson-subsampled Gaussian with
sampling rate q and noise multiplier sigma, under add/remove-one neighbouring datasets.

- :func:`get_epsilon` -- epsilon spent after ``steps`` steps at ``delta``;
- :func:`get_noise_multiplier` -- the smallest sigma (within ``tol``) for which the target
  (epsilon, delta) holds after ``steps`` steps;
- :class:`PrivacyAccountant` -- a running history for training loops with changing sigma
  or q (noise schedules, resume), with ``state_dict`` round-trips;
- :func:`truncation_delta` -- the delta cost of the noise stream's 11.6 sigma tail bound
  (SPEC section 3), which :meth:`PrivacyAccountant.get_privacy_spent` adds to delta.

RDP uses Opacus' (and TF Privacy's) grid of orders, so epsilons agree with Opacus'
``RDPAccountant`` (to 1e-3 relative wherever epsilon <= 12; for larger epsilons
dp-accounting drops low orders whose series does not converge and reports a larger,
still valid, epsilon); PLD is tighter.
"""
from __future__ import annotations

import math

import dp_accounting
from dp_accounting import pld, rdp

from .hyper import check_nonnegative, check_positive

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
        dp_accounting.PoissonSampledDpEvent(sample_rate,
                                            dp_accounting.GaussianDpEvent(noise_multiplier)),
        steps)


def get_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
                accountant: str = "rdp") -> float:
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


def get_noise_multiplier(target_epsilon: float, target_delta: float, sample_rate: float,
                         steps: int, accountant: str = "rdp", *, tol: float = 1e-3) -> float:
    """The noise multiplier sigma such that ``steps`` steps at rate q spend at most
    ``target_epsilon`` at ``target_delta`` (and sigma - tol would spend more).

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
        raise ValueError(f"no noise_multiplier <= {MAX_NOISE_MULTIPLIER:g} reaches "
                         f"epsilon={target_epsilon!r} at delta={target_delta!r} with "
                         f"sample_rate={q!r} and steps={T!r}")
    return float(dp_accounting.calibrate_dp_mechanism(
        lambda: _fresh(accountant), lambda s: dpsgd_event(s, q, T), target_epsilon,
        target_delta, dp_accounting.ExplicitBracketInterval(0.0, MAX_NOISE_MULTIPLIER),
        tol=tol))


def truncation_delta(steps: int, numel: int) -> float:
    """delta cost of the noise stream's bounded tail: T * ceil(d / 2) * 2**-96 (SPEC 3)."""
    return _check_steps(steps) * math.ceil(numel / 2) * 2.0**-96


class PrivacyAccountant:
    """A running DP-SGD privacy ledger: ``step(noise_multiplier, sample_rate)`` after each
    optimizer step, ``get_epsilon(delta)`` at any time. History is a list of
    ``[noise_multiplier, sample_rate, steps]`` runs (consecutive equal steps merged), so
    noise schedules and resumed runs account exactly.

    Like Opacus' accountants, it is separate from the optimizer: the training loop calls
    ``step`` (Opacus' optimizer/accountant separation)."""

    def __init__(self, accountant: str = "rdp"):
        self.accountant = _check_accountant(accountant)
        self.history: list[list] = []

    @property
    def steps(self) -> int:
        return sum(run[2] for run in self.history)

    def step(self, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        check_nonnegative("noise_multiplier", noise_multiplier)
        _check_rate(sample_rate)
        _check_steps(num_steps)
        if self.history and self.history[-1][:2] == [noise_multiplier, sample_rate]:
            self.history[-1][2] += num_steps
        else:
            self.history.append([float(noise_multiplier), float(sample_rate), num_steps])

    def get_epsilon(self, delta: float) -> float:
        _check_delta("delta", delta)
        runs = [r for r in self.history if r[1] > 0 and r[2] > 0]
        if not runs:
            return 0.0
        if any(r[0] == 0.0 for r in runs):
            return math.inf
        acc = _fresh(self.accountant)
        for sigma, q, T in runs:
            acc.compose(dpsgd_event(sigma, q, T))
        return float(acc.get_epsilon(delta))

    def get_privacy_spent(self, delta: float, numel: int) -> tuple[float, float]:
        """(epsilon, delta + truncation_delta(steps, numel)): what to report for a model of
        ``numel`` noised coordinates (SPEC section 3)."""
        return self.get_epsilon(delta), delta + truncation_delta(self.steps, numel)

    def state_dict(self) -> dict:
        return {"accountant": self.accountant, "history": [list(r) for r in self.history]}

    def load_state_dict(self, state: dict) -> None:
        acc = _check_accountant(state.get("accountant", "rdp"))
        history = [[float(s), float(q), int(T)] for s, q, T in state.get("history", [])]
        self.accountant, self.history = acc, history
