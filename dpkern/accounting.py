"""Privacy accounting on Google's dp-accounting (RDP and PLD), never home-made (SPEC 8).

The mechanism is DP-SGD's: T self-compositions of the Poisson-subsampled Gaussian with
sampling rate q and noise multiplier sigma, under add/remove-one neighbouring datasets.

- :func:`get_epsilon` -- epsilon spent after ``steps`` steps at ``delta``;
- :func:`get_noise_multiplier` -- the smallest sigma (within ``tol``) for which the target
  (epsilon, delta) holds after ``steps`` steps;
- :class:`PrivacyAccountant` -- a running history for training loops with changing sigma
  or q (noise schedules, resume), with ``state_dict`` round-trips;
- :func:`truncation_delta` -- the delta cost of the noise stream's 11.6 sigma tail bound
  (SPEC section 3), which :meth:`PrivacyAccountant.get_privacy_spent` adds to delta;
- :func:`batch_overflow_probability` -- the probability that a Poisson batch exceeds a
  fixed batch shape B_max (truncated Poisson sampling, SPEC section 8), whose delta cost
  :meth:`PrivacyAccountant.get_privacy_spent` adds too (:func:`overflow_delta`);
- :meth:`PrivacyAccountant.epsilon_curve` -- epsilon at several deltas, one composition.

RDP uses Opacus' (and TF Privacy's) grid of orders, so epsilons agree with Opacus'
``RDPAccountant`` (to 1e-3 relative wherever epsilon <= 12; for larger epsilons
dp-accounting drops low orders whose series does not converge and reports a larger,
still valid, epsilon); PLD is tighter.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping

import dp_accounting
from dp_accounting import pld, rdp

from .hyper import check_nonnegative, check_positive


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


def truncation_delta(steps: int, numel: int) -> float:
    """delta cost of the noise stream's bounded tail: T * ceil(d / 2) * 2**-96 (SPEC 3).

    Args:
        steps: optimizer steps T (int >= 0).
        numel: noised coordinates d per step (int >= 0; the model's trainable numel).
    Returns: the additive delta (float), e.g. < 1e-14 for 1e4 steps of a 7e10-parameter model.
    Raises: ValueError if ``steps`` or ``numel`` is not an int >= 0."""
    return _check_steps(steps) * math.ceil(_check_count("numel", numel) / 2) * 2.0**-96


def _binomial_pieces(m: int, q: float, J: int):
    """pmf of Binomial(m, q) at 0..J (float64 numpy) and P[X > J], each term computed
    directly (Boost's binomial via scipy: no 1 - cdf cancellation)."""
    import numpy as np
    from scipy import stats

    J = min(J, m)
    j = np.arange(J + 1)
    pmf = stats.binom.pmf(j, m, q)
    tail = float(stats.binom.sf(J, m, q)) if J < m else 0.0
    return pmf, tail


def batch_overflow_probability(
    unit_rows: Mapping[int, int] | int,
    sample_rate: float,
    max_batch_size: int,
    *,
    neighbour_rows: int = 1,
) -> float:
    """P[the Poisson batch has more than B_max rows], for the worst neighbouring dataset.

    Each unit is in the batch independently with probability q and brings its rows; the
    batch's row count is S = sum_s s * Binomial(m_s, q) over the classes of m_s units of
    s rows. The neighbouring dataset with the most rows has one more unit of
    ``neighbour_rows`` k rows (every neighbour's S is stochastically at most that one's),
    so this returns ``P[S + k * Bernoulli(q) > B_max]``: for units of one example,
    ``P[Binomial(N + 1, q) > B_max]``.

    Computed in float64 without cancellation: the pmf of each class from Boost's
    binomial (scipy), convolved over [0, B_max] with the mass beyond B_max summed
    directly (never 1 - cdf), then multiplied by (1 + 1e-9) to cover rounding, so the
    result is an upper bound to within float64 underflow (terms below 1e-300 vanish).
    Cost: one class is closed-form; further classes O(B_max^2 / s) each.

    Args:
        unit_rows: ``{rows s: number of units m_s with s rows}`` (ints >= 1), or an int N
            (N units of one row).
        sample_rate: q in [0, 1].
        max_batch_size: B_max (int >= 0).
        neighbour_rows: k, the rows of the neighbour's extra unit (int >= 0; 0 = this
            dataset itself).
    Returns: the probability (float in [0, 1]).
    Raises: ValueError on arguments out of range."""
    import numpy as np

    q = _check_rate(sample_rate)
    B = _check_count("max_batch_size", max_batch_size)
    k = _check_count("neighbour_rows", neighbour_rows)
    if isinstance(unit_rows, numbers.Integral) and not isinstance(unit_rows, bool):
        unit_rows = {1: _check_count("unit_rows", unit_rows)}
    if not isinstance(unit_rows, Mapping):
        raise ValueError(
            f"invalid unit_rows={unit_rows!r}: expected an int or a dict {{rows: units}}"
        )
    classes: dict[int, int] = {}
    for s, m in unit_rows.items():
        s, m = _check_count("unit_rows size", s), _check_count("unit_rows count", m)
        if s == 0:
            raise ValueError("invalid unit_rows: a size of 0 rows")
        if m:
            classes[s] = classes.get(s, 0) + m
    if k:
        classes[k] = classes.get(k, 0) + 1
    if not classes or q == 0.0:
        return 0.0
    order = sorted(classes)  # the smallest unit first: the only class with a long pmf
    s0 = order[0]
    pmf0, overflow = _binomial_pieces(classes[s0], q, B // s0)
    cur = np.zeros(B + 1)
    cur[: s0 * (len(pmf0) - 1) + 1 : s0] = pmf0
    for s in order[1:]:
        pmf, tail = _binomial_pieces(classes[s], q, B // s)
        suffix = np.cumsum(cur[::-1])[::-1]  # suffix[i] = sum_{x >= i} cur[x]
        new = np.zeros(B + 1)
        over = overflow + tail * float(suffix[0])
        for j, p in enumerate(pmf.tolist()):
            if p == 0.0:
                continue
            shift = s * j
            new[shift:] += p * cur[: B + 1 - shift]
            if shift:
                over += p * float(suffix[B + 1 - shift])
        cur, overflow = new, over
    return min(1.0, overflow * (1.0 + 1e-9))


def overflow_delta(overflow: float, epsilon: float) -> float:
    """delta cost of truncating Poisson batches: (1 + e^epsilon) * P[overflow].

    With the same randomness the truncated run equals the Poisson run except on the
    event E that some step's batch overflows, so each output distribution is within
    total variation P[E] <= sum_t P_t[overflow] of its Poisson twin, on both neighbouring
    datasets; an (epsilon, delta) guarantee of the Poisson run then gives
    ``P[M'(D) in A] <= e^eps P[M'(D') in A] + delta + P_D[E] + e^eps P_D'[E]``.

    Args:
        overflow: sum over steps of :func:`batch_overflow_probability` (float >= 0).
        epsilon: the epsilon of the guarantee (float >= 0, may be ``inf``).
    Returns: the additive delta (float; 0.0 when ``overflow`` is 0).
    Raises: ValueError if ``overflow`` is negative or not finite."""
    if not math.isfinite(check_nonnegative("overflow", overflow)):
        raise ValueError(f"invalid overflow={overflow!r}: expected a finite number >= 0")
    if overflow == 0.0:
        return 0.0
    if epsilon > 700:  # e^eps overflows a float: the bound is vacuous anyway
        return 1.0
    return min(1.0, (1.0 + math.exp(epsilon)) * overflow)


#: The keys of :meth:`PrivacyAccountant.state_dict` (``"batch_overflow"`` may be absent
#: in checkpoints of dpkern before fixed-shape batches: it then counts as 0).
STATE_KEYS = ("accountant", "history", "batch_overflow")
_REQUIRED_KEYS = ("accountant", "history")


def _check_run(k: int, run) -> list:
    """``history[k]`` as ``[float sigma, float q, int steps]``, or ValueError naming it."""
    where = f"history[{k}]"
    if not isinstance(run, (list, tuple)) or len(run) != 3:
        raise ValueError(
            f"invalid {where}={run!r}: expected [noise_multiplier, sample_rate, steps]"
        )
    sigma, q, T = run
    for name, v in (("noise_multiplier", sigma), ("sample_rate", q)):
        try:
            finite = (
                not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(float(v))
            )
        except OverflowError:  # an int beyond float range
            finite = False
        if not finite:
            raise ValueError(f"invalid {where} {name}={v!r}: expected a finite real number")
    if sigma < 0:
        raise ValueError(f"invalid {where} noise_multiplier={sigma!r}: must be >= 0")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"invalid {where} sample_rate={q!r}: must be in [0, 1]")
    if isinstance(T, bool) or not isinstance(T, numbers.Integral) or T < 0:
        raise ValueError(f"invalid {where} steps={T!r}: expected an int >= 0")
    return [float(sigma), float(q), int(T)]


class PrivacyAccountant:
    """A running privacy ledger of DP-SGD training: the (epsilon, delta) spent so far.

    The mechanism accounted is DP-SGD's (Abadi et al. 2016): each step is one Poisson-
    subsampled Gaussian mechanism, every sample is in the batch independently with
    probability ``sample_rate`` q, and Gaussian noise of standard deviation
    ``noise_multiplier * max_grad_norm`` is added to the sum of per-sample gradients
    clipped to ``max_grad_norm`` (SPEC sections 2-4); neighbouring datasets differ by
    adding or removing one privacy unit (an example, or a user's or document's examples
    clipped together as one row; SPEC section 8). Steps compose adaptively. Fixed-shape
    batches (Poisson batches truncated to B_max rows) are charged in delta: record each
    step's ``overflow_probability`` and :meth:`get_privacy_spent` adds
    ``(1 + e^epsilon) * sum_t P_t[overflow]`` (Chua et al. 2024, "Scalable DP-SGD:
    Shuffling vs. Poisson Subsampling").

    Call :meth:`step` once after each optimizer step (or once per run of equal steps)
    and :meth:`get_epsilon` at any time. Like Opacus' accountants it is separate from the
    optimizer: the training loop steps it, so noise schedules (a different sigma per
    step), changing sample rates and resumed runs account exactly.

    The epsilons are computed by Google's dp-accounting, never by dpkern itself:

    - ``"rdp"``: Renyi DP (Mironov 2017, "Renyi differential privacy", arXiv 1702.07476)
      of the sampled Gaussian (Mironov, Talwar & Zhang 2019, arXiv 1908.10530), summed
      over the steps at each order of :data:`RDP_ORDERS` (Opacus' and TF Privacy's grid),
      converted to (epsilon, delta) by the bound of Balle et al. 2020, "Hypothesis testing
      interpretations and Renyi differential privacy" (arXiv 1905.09982, Theorem 21;
      dp-accounting's ``RdpAccountant``). Agrees with Opacus' ``RDPAccountant``.
    - ``"pld"``: privacy loss distributions (Meiser & Mohammadi 2018; Koskela et al. 2020;
      Doroshenko et al. 2022, "Connect the dots", arXiv 2207.04380; dp-accounting's
      ``PLDAccountant``, pessimistic discretisation at interval 1e-4): a tighter valid
      epsilon than RDP.

    Args:
        accountant: ``"rdp"`` (default) or ``"pld"``; fixed for the ledger's life (a
            checkpoint resumes only into an accountant of the same kind).
    Raises:
        ValueError: an unknown ``accountant``.

    Attributes:
        accountant (str): ``"rdp"`` or ``"pld"``.
        history (list): the ledger, a list of runs ``[noise_multiplier, sample_rate,
            steps]`` (float, float, int) in training order; consecutive steps with equal
            sigma and q are merged into one run. Treat it as read-only: use :meth:`step`
            and :meth:`load_state_dict` to change it.
        batch_overflow (float): the sum over steps of the probability that a fixed-shape
            batch overflowed B_max (0.0 for plain Poisson sampling); read-only too.

    Example::

        acc = PrivacyAccountant("rdp")
        for batch in loader:
            ...; optimizer.step()
            acc.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=q)
        eps, delta = acc.get_privacy_spent(1e-5, numel=n_trainable)
    """

    def __init__(self, accountant: str = "rdp"):
        self.accountant = _check_accountant(accountant)
        self.history: list[list] = []
        self.batch_overflow = 0.0

    @property
    def steps(self) -> int:
        """Steps accounted so far (int >= 0): the sum of the runs' step counts."""
        return sum(run[2] for run in self.history)

    def step(
        self,
        noise_multiplier: float,
        sample_rate: float,
        num_steps: int = 1,
        *,
        overflow_probability: float = 0.0,
    ) -> None:
        """Record ``num_steps`` DP-SGD steps at noise multiplier sigma and sample rate q.

        Args:
            noise_multiplier: sigma, the noise standard deviation divided by the clipping
                bound ``max_grad_norm`` (dimensionless, finite, >= 0; 0 means no noise:
                epsilon becomes infinite once q > 0).
            sample_rate: q, each unit's probability of being in the batch (Poisson
                sampling; expected batch size / number of units), in [0, 1].
            num_steps: how many such steps (int >= 0; default 1).
            overflow_probability: for fixed-shape (truncated Poisson) batches, each step's
                probability that the Poisson batch exceeded B_max
                (``PoissonBatchSampler.overflow_probability``, from
                :func:`batch_overflow_probability`); 0 (default) for plain Poisson.
                Summed into :attr:`batch_overflow`, charged to delta by
                :meth:`get_privacy_spent`.
        Raises:
            ValueError: an argument out of range; the ledger is then unchanged."""
        check_nonnegative("noise_multiplier", noise_multiplier)
        _check_rate(sample_rate)
        _check_steps(num_steps)
        if not 0.0 <= check_nonnegative("overflow_probability", overflow_probability) <= 1.0:
            raise ValueError(
                f"invalid overflow_probability={overflow_probability!r}: must be in [0, 1]"
            )
        if self.history and self.history[-1][:2] == [noise_multiplier, sample_rate]:
            self.history[-1][2] += num_steps
        else:
            self.history.append([float(noise_multiplier), float(sample_rate), num_steps])
        self.batch_overflow += num_steps * float(overflow_probability)

    def _composed(self):
        """The dp-accounting accountant of every run, or 0.0 / inf when trivial."""
        runs = [r for r in self.history if r[1] > 0 and r[2] > 0]
        if not runs:
            return 0.0
        if any(r[0] == 0.0 for r in runs):
            return math.inf
        acc = _fresh(self.accountant)
        for sigma, q, T in runs:
            acc.compose(dpsgd_event(sigma, q, T))
        return acc

    def get_epsilon(self, delta: float) -> float:
        """The epsilon spent by every step recorded so far, at ``delta``.

        The runs are composed as dp-accounting ``DpEvent``s (one
        ``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)``
        per run) in this accountant's kind (see the class doc: RDP or PLD).

        Args:
            delta: target delta, in (0, 1) (commonly below 1 / dataset size).
        Returns:
            epsilon (float >= 0): 0.0 when no step with q > 0 was recorded; ``inf`` if a
            step with sigma = 0 and q > 0 was.
        Raises:
            ValueError: ``delta`` outside (0, 1)."""
        _check_delta("delta", delta)
        acc = self._composed()
        return acc if isinstance(acc, float) else float(acc.get_epsilon(delta))

    def epsilon_curve(self, deltas) -> list[float]:
        """epsilon at each delta of ``deltas``: the privacy curve eps(delta) of the steps
        recorded so far, from one composition (as :meth:`get_epsilon` at each delta).

        Args:
            deltas: an iterable of deltas, each in (0, 1).
        Returns:
            list of epsilons (floats), one per delta, in order; non-increasing in delta.
        Raises:
            ValueError: a delta outside (0, 1)."""
        deltas = [_check_delta("delta", d) for d in deltas]
        acc = self._composed()
        if isinstance(acc, float):
            return [acc] * len(deltas)
        return [float(acc.get_epsilon(d)) for d in deltas]

    def get_privacy_spent(self, delta: float, numel: int) -> tuple[float, float]:
        """What to report: ``(epsilon, total_delta)``, epsilon at ``delta`` and

            total_delta = delta + truncation_delta(steps, numel)
                          + overflow_delta(batch_overflow, epsilon)

        dpkern's noise stream bounds each Gaussian draw at about 11.6 sigma (SPEC
        section 3), which costs an additive ``T * ceil(d / 2) * 2**-96`` in delta
        (:func:`truncation_delta`); fixed-shape batches that truncate the Poisson batch
        cost ``(1 + e^epsilon) * sum_t P_t[overflow]`` (:func:`overflow_delta`; 0 without
        ``overflow_probability`` in :meth:`step`). :meth:`privacy_report` itemises them.

        Args:
            delta: target delta of the Gaussian mechanism, in (0, 1).
            numel: noised coordinates per step (int >= 0: the trainable parameters' numel).
        Returns:
            ``(epsilon, total_delta)``: epsilon as :meth:`get_epsilon` at ``delta``;
            total_delta at most 1.
        Raises:
            ValueError: ``delta`` outside (0, 1) or ``numel`` not an int >= 0."""
        report = self.privacy_report(delta, numel)
        return report["epsilon"], report["delta_total"]

    def privacy_report(self, delta: float, numel: int) -> dict:
        """The guarantee, itemised (plain floats, JSON-serialisable).

        Args:
            delta: target delta, in (0, 1).
            numel: noised coordinates per step (int >= 0).
        Returns:
            ``{"epsilon", "delta" (the target), "delta_noise_tail"
            (:func:`truncation_delta`), "delta_batch_truncation" (:func:`overflow_delta`),
            "batch_overflow" (sum over steps of the overflow probability), "delta_total",
            "steps", "accountant"}``.
        Raises:
            ValueError: ``delta`` outside (0, 1) or ``numel`` not an int >= 0."""
        noise_tail = truncation_delta(self.steps, numel)
        eps = self.get_epsilon(delta)
        batch = overflow_delta(self.batch_overflow, eps)
        return {
            "epsilon": eps,
            "delta": delta,
            "delta_noise_tail": noise_tail,
            "delta_batch_truncation": batch,
            "batch_overflow": self.batch_overflow,
            "delta_total": min(1.0, delta + noise_tail + batch),
            "steps": self.steps,
            "accountant": self.accountant,
        }

    def state_dict(self) -> dict:
        """The ledger as a plain dict (picklable and JSON-serialisable), to checkpoint
        next to the model and optimizer and restore with :meth:`load_state_dict`.

        Returns:
            ``{"accountant": "rdp" | "pld", "history": [[sigma, q, steps], ...],
            "batch_overflow": float}``, a copy (later steps do not change it)."""
        return {
            "accountant": self.accountant,
            "history": [list(r) for r in self.history],
            "batch_overflow": self.batch_overflow,
        }

    def load_state_dict(self, state: dict) -> None:
        """Replace the ledger by a checkpoint's (from :meth:`state_dict`).

        The whole dict is validated before anything changes: when it raises, the ledger
        is exactly as it was (losing the spent budget would under-report epsilon).

        Args:
            state: a dict with exactly the keys ``"accountant"`` (this accountant's kind)
                and ``"history"`` (a list of ``[noise_multiplier, sample_rate, steps]``
                runs: sigma a finite real >= 0, q a real in [0, 1], steps an int >= 0).
        Raises:
            ValueError: not a dict; a missing or unknown key; an invalid run (named by its
                index); a checkpoint of the other accountant kind (construct
                ``PrivacyAccountant(accountant=...)`` of the checkpoint's kind to resume
                it)."""
        if not isinstance(state, Mapping):
            raise ValueError(
                f"PrivacyAccountant.load_state_dict: expected a dict with keys "
                f"{list(STATE_KEYS)} (from state_dict()), got "
                f"{type(state).__name__}"
            )
        missing = [k for k in _REQUIRED_KEYS if k not in state]
        unknown = sorted(map(repr, set(state) - set(STATE_KEYS)))
        if missing or unknown:
            raise ValueError(
                "PrivacyAccountant.load_state_dict: "
                + (f"missing key(s) {missing}" if missing else "")
                + ("; " if missing and unknown else "")
                + (f"unknown key(s) [{', '.join(unknown)}]" if unknown else "")
                + f" (expected exactly {list(STATE_KEYS)}, from state_dict())"
            )
        kind = state["accountant"]
        if not isinstance(kind, str) or kind not in ACCOUNTANTS:
            raise ValueError(
                f"PrivacyAccountant.load_state_dict: invalid accountant={kind!r}: "
                f"expected one of {ACCOUNTANTS}"
            )
        if kind != self.accountant:
            raise ValueError(
                f"PrivacyAccountant.load_state_dict: the checkpoint is a "
                f"{kind!r} ledger, this is a {self.accountant!r} accountant; "
                f"construct PrivacyAccountant(accountant={kind!r}) to resume it "
                "(the accountant kind is fixed when it is constructed)"
            )
        runs = state["history"]
        if not isinstance(runs, (list, tuple)):
            raise ValueError(
                f"PrivacyAccountant.load_state_dict: invalid history of type "
                f"{type(runs).__name__}: expected a list of [noise_multiplier, "
                "sample_rate, steps] runs"
            )
        history = [_check_run(k, r) for k, r in enumerate(runs)]
        overflow = state.get("batch_overflow", 0.0)
        try:
            ok = (
                not isinstance(overflow, bool)
                and isinstance(overflow, numbers.Real)
                and math.isfinite(float(overflow))
                and overflow >= 0
            )
        except OverflowError:
            ok = False
        if not ok:
            raise ValueError(
                f"PrivacyAccountant.load_state_dict: invalid batch_overflow={overflow!r}: "
                "expected a finite real >= 0"
            )
        self.history = history
        self.batch_overflow = float(overflow)


def calibrate_extension(
    history,
    sample_rate: float,
    steps: int,
    epsilon: float,
    delta: float,
    accountant: str = "rdp",
    *,
    guess: float = 1.0,
) -> float:
    """The noise multiplier for ``steps`` more steps at rate ``sample_rate`` such that a
    resumed ledger plus them spends at most ``epsilon`` at ``delta`` (a resumed run whose
    plan changed: more steps, a new target).

    Args: history: the ledger (:attr:`PrivacyAccountant.history`, as a state_dict holds
    it); steps >= 1; epsilon > 0, delta in (0, 1); accountant "rdp" or "pld"; guess: a
    starting sigma (the checkpoint's), from which a bracket is doubled or halved.
    Returns: sigma, the upper end of a geometric bisection to 1e-4 relative (it meets the
    target); 1e-3 when even that little noise does.
    Raises: ValueError when no sigma <= MAX_NOISE_MULTIPLIER keeps the target (the ledger
    already spent the budget)."""
    floor = 1e-3

    def spent(sigma):
        acc = PrivacyAccountant(accountant)
        acc.load_state_dict({"accountant": accountant, "history": history})
        acc.step(sigma, sample_rate, steps)
        return acc.get_epsilon(delta)

    hi = min(max(float(guess), floor), MAX_NOISE_MULTIPLIER)
    if spent(hi) > epsilon:  # go up: lo spends too much
        lo = hi
        while True:
            hi = min(lo * 2.0, MAX_NOISE_MULTIPLIER)
            if spent(hi) <= epsilon:
                break
            if hi >= MAX_NOISE_MULTIPLIER:
                raise ValueError(
                    f"the checkpoint already spent the budget: no noise multiplier <= "
                    f"{MAX_NOISE_MULTIPLIER:g} keeps {steps} more steps within "
                    f"epsilon={epsilon:g}"
                )
            lo = hi
    else:  # go down: hi meets the target
        while True:
            lo = max(hi / 2.0, floor)
            if spent(lo) > epsilon:
                break
            if lo <= floor:
                return floor
            hi = lo
    while hi / lo > 1 + 1e-4:  # spent(lo) > epsilon >= spent(hi)
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if spent(mid) <= epsilon else (mid, hi)
    return hi
