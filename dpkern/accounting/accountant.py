"""The running ledger of a training run (:class:`PrivacyAccountant`: changing sigma or q,
fixed-shape truncation, state_dict round-trips) and the recalibration of a resumed run
whose plan changed (:func:`calibrate_extension`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

from ..hyper import check_nonnegative
from .mechanism import (
    ACCOUNTANTS,
    MAX_NOISE_MULTIPLIER,
    _check_accountant,
    _check_delta,
    _check_rate,
    _check_steps,
    _fresh,
    dpsgd_event,
)
from .truncation import overflow_delta, truncation_delta


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
