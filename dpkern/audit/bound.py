"""The epsilon lower bound of a one-run audit (Steinke, Nasr & Jagielski, NeurIPS 2023,
"Privacy Auditing with One (1) Training Run", arXiv 2305.08846).

Setting (the paper's Section 3): m canaries, each included in the training data by an
independent fair coin S_j in {-1, +1}; one run of the (epsilon, delta)-DP mechanism; the
auditor then makes r guesses T_j in {-1, +1} (abstaining on the other m - r canaries)
from the run's output alone, and W counts the correct ones. The paper's main theorem
(as its code, p_value_DP_audit, computes it):

    P[W >= v]  <=  f(v) + 2 m delta * max_{i = 1..m} (f(v - i) - f(v)) / i,
    f(v) = P[Binomial(r, e^eps / (1 + e^eps)) >= v],

for every v (with delta = 0 it is the stochastic domination of W by that binomial). The
observed v therefore rejects "the mechanism is (eps, delta)-DP" at level beta when the
right-hand side is below beta; the lower bound is the largest eps rejected, found by
bisection as in the paper's code (its appendix, get_eps_audit; Appendix D in arXiv v1), here with a scan that keeps the result
conservative should the right-hand side ever fail to grow with eps.

The tails are exact sums of binomial probabilities (log-space, lgamma coefficients; no
normal approximation). For i > v the term (f(v - i) - f(v)) / i is (1 - f(v)) / i, below
the i = v term, so the max runs over i = 1..v.

Guess sizes are fixed before the scores are seen (:data:`GUESS_FRACTIONS`, a function of
m only); trying all of them is paid for by a union bound: each is tested at
beta / (number of sizes), so the reported maximum is a valid lower bound at level beta.
(The paper picks its k+ and k- after looking; fixing them keeps the bound valid.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

#: Guess sizes as fractions of the m canaries, (guessed in, guessed out): the top scores
#: are guessed in and the bottom ones out, both sides (a share of m split evenly) and the
#: top alone (under Poisson sampling many included canaries are never drawn and look
#: excluded, so the bottom guesses are the weaker ones). Fixed in advance; each size is
#: tested at beta / len(GUESS_FRACTIONS) (union bound).
GUESS_FRACTIONS = (
    (0.01, 0.01),
    (0.025, 0.025),
    (0.05, 0.05),
    (0.1, 0.1),
    (0.25, 0.25),
    (0.5, 0.5),
    (0.01, 0.0),
    (0.02, 0.0),
    (0.05, 0.0),
    (0.1, 0.0),
    (0.2, 0.0),
)

#: Search interval of the bisection: eps in [0, EPS_MAX].
EPS_MAX = 64.0


def _check_counts(m: int, r: int, v: int) -> None:
    for name, x in (("m", m), ("r", r), ("v", v)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise ValueError(f"invalid {name}={x!r}: expected an int")
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got m={m}, r={r}, v={v}")


def _check_delta(delta: float) -> float:
    if not (isinstance(delta, (int, float)) and 0.0 <= delta <= 1.0):
        raise ValueError(f"invalid delta={delta!r}: must be in [0, 1]")
    return float(delta)


def _check_beta(beta: float) -> float:
    if not (isinstance(beta, (int, float)) and 0.0 < beta < 1.0):
        raise ValueError(f"invalid beta={beta!r}: must be in (0, 1)")
    return float(beta)


@lru_cache(maxsize=64)
def _log_binom_coef(r: int) -> np.ndarray:
    """log C(r, k) for k = 0..r (read-only)."""
    lg = math.lgamma
    out = np.array([lg(r + 1) - lg(k + 1) - lg(r - k + 1) for k in range(r + 1)])
    out.setflags(write=False)
    return out


def log_q_of_epsilon(epsilon: float) -> tuple[float, float]:
    """(log q, log(1 - q)) for q = e^eps / (1 + e^eps), the accuracy of eps-DP randomised
    response, computed without cancellation."""
    if not epsilon >= 0.0:
        raise ValueError(f"invalid epsilon={epsilon!r}: must be >= 0")
    return -math.log1p(math.exp(-epsilon)), -epsilon - math.log1p(math.exp(-epsilon))


def binom_log_pmf(r: int, log_q: float, log_1mq: float) -> np.ndarray:
    """log P[Binomial(r, q) = k] for k = 0..r, from log q and log(1 - q)."""
    k = np.arange(r + 1, dtype=np.float64)
    return _log_binom_coef(int(r)) + k * log_q + (r - k) * log_1mq


def _sum_exp(logs: np.ndarray) -> float:
    if logs.size == 0:
        return 0.0
    top = float(np.max(logs))
    if top == -math.inf:
        return 0.0
    return math.exp(top) * math.fsum(np.exp(logs - top).tolist())


def binom_sf(v: int, r: int, q: float) -> float:
    """P[Binomial(r, q) >= v], an exact sum of the binomial probabilities (float64)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"invalid q={q!r}: must be in [0, 1]")
    if v <= 0:
        return 1.0
    if v > r:
        return 0.0
    if q in (0.0, 1.0):
        return float(q)
    return min(1.0, _sum_exp(binom_log_pmf(r, math.log(q), math.log1p(-q))[v:]))


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """The right-hand side of the paper's main theorem: an upper bound on P[W >= v] for W
    the correct guesses among r on m canaries of an (epsilon, delta)-DP mechanism (capped at 1).

    Args: m canaries, r guesses, v correct (0 <= v <= r <= m); epsilon >= 0;
    delta in [0, 1].
    Raises: ValueError on arguments out of range."""
    _check_counts(m, r, v)
    delta = _check_delta(delta)
    if v == 0:
        return 1.0
    lp = binom_log_pmf(r, *log_q_of_epsilon(float(epsilon)))
    f_v = min(1.0, _sum_exp(lp[v:]))  # f(v) = P[Binomial >= v]
    if delta == 0.0:
        return f_v
    # (f(v - i) - f(v)) = P[v - i <= Binomial < v] = sum_{j=1..i} pmf(v - j)
    below = np.exp(lp[:v][::-1])  # pmf(v - 1), pmf(v - 2), ..., pmf(0)
    alpha = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(1.0, f_v + 2.0 * m * delta * alpha)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, beta: float = 0.05) -> float:
    """The largest epsilon that v correct guesses out of r (m canaries) reject at level
    beta under the paper's main theorem: with probability >= 1 - beta over the canary coins and the
    mechanism, an (eps, delta)-DP mechanism never yields a bound above eps.

    Returns 0.0 when even eps = 0 is not rejected. Accuracy: 1e-9 in eps.
    Raises: ValueError on arguments out of range."""
    _check_counts(m, r, v)
    delta, beta = _check_delta(delta), _check_beta(beta)

    def rejected(eps: float) -> bool:
        return p_value(m, r, v, eps, delta) < beta

    if not rejected(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while hi < EPS_MAX and rejected(hi):
        lo, hi = hi, min(2.0 * hi, EPS_MAX)
    if rejected(hi):
        return hi
    while hi - lo > 1e-9:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if rejected(mid) else (lo, mid)
    # conservative: every eps below the bound must be rejected (p need not be monotone
    # in eps when 2 m delta is large); stop at the first grid point that is not
    for eps in np.linspace(0.0, lo, 65)[1:]:
        if not rejected(float(eps)):
            return float(np.nextafter(eps, 0.0)) if eps > 0 else 0.0
    return lo


def delta_note(m: int, delta: float, beta: float, fractions=GUESS_FRACTIONS) -> str | None:
    """A note when the main theorem's delta term is not small: 2 m delta against the level
    each guess size is tested at (it then caps the bound; fewer canaries, or auditing a
    smaller delta, sharpens it). None when it is small."""
    share = beta / len(fractions)
    if 2 * m * delta <= 0.1 * share:
        return None
    return (
        f"2 m delta = {2 * m * delta:.3g} is not small against beta / {len(fractions)} = "
        f"{share:.3g}: the delta term of the paper's main theorem weakens this bound (fewer canaries "
        "or a smaller delta (`--delta`, `delta=`) sharpen it)"
    )


@dataclass(frozen=True)
class Guess:
    """One fixed guess size: ``k_in`` top scores guessed included, ``k_out`` bottom ones
    excluded; ``correct`` of the ``r = k_in + k_out`` guesses were right;
    ``epsilon`` is its lower bound at level ``beta`` (the union-bound share)."""

    k_in: int
    k_out: int
    correct: int
    beta: float
    epsilon: float

    @property
    def r(self) -> int:
        return self.k_in + self.k_out


@dataclass(frozen=True)
class Bound:
    """The audit's result: ``epsilon`` (the best lower bound, valid at confidence
    1 - ``beta``) and every fixed guess size that was tried (``guesses``; the best is
    ``best``)."""

    m: int
    delta: float
    beta: float
    epsilon: float
    guesses: tuple[Guess, ...]

    @property
    def best(self) -> Guess:
        return max(self.guesses, key=lambda g: (g.epsilon, -g.r))


def guess_sizes(m: int, fractions=GUESS_FRACTIONS) -> list[tuple[int, int]]:
    """The (k_in, k_out) pairs tried on m canaries: (floor(f_in m), floor(f_out m)) for
    each pair of fractions (sizes with no guess are dropped; they still count in the
    union bound)."""
    sizes = [(int(a * m + 1e-9), int(b * m + 1e-9)) for a, b in fractions]
    return [(a, b) for a, b in sizes if a + b > 0]


def lower_bound_from_scores(
    scores,
    included,
    delta: float,
    beta: float = 0.05,
    *,
    fractions=GUESS_FRACTIONS,
    generator: np.random.Generator | None = None,
) -> Bound:
    """The one-run epsilon lower bound from canary scores (higher = "more likely in").

    Args:
        scores: float array [m], a function of the released output only.
        included: bool array [m], the coins S_j (True = the canary was in the data).
        delta: the delta of the (eps, delta) guarantee being audited.
        beta: 1 - confidence (default 0.05: 95%).
        fractions: guess sizes as (in, out) fractions of m, fixed in advance; each is
            tested at beta / len(fractions) (union bound).
        generator: random tie-breaking (ties are broken by a random permutation, which
            is independent of the coins); default: a fresh ``numpy`` generator.
    Returns: a :class:`Bound`.
    Raises: ValueError (shapes, non-finite scores, arguments out of range)."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    inc = np.asarray(included, dtype=bool).reshape(-1)
    if s.shape != inc.shape:
        raise ValueError(f"scores {s.shape} and included {inc.shape} differ in shape")
    if not np.isfinite(s).all():
        raise ValueError("scores must be finite")
    m = int(s.size)
    delta, beta = _check_delta(delta), _check_beta(beta)
    if not fractions:
        raise ValueError("fractions: at least one guess size is needed")
    rng = generator if generator is not None else np.random.default_rng()
    order = np.lexsort((rng.permutation(m), s))  # ascending score, random among ties
    share = beta / len(fractions)
    guesses = []
    for k_in, k_out in guess_sizes(m, fractions):
        if k_in + k_out > m:
            continue
        v = int(inc[order[m - k_in :]].sum()) + int((~inc[order[:k_out]]).sum())
        eps = epsilon_lower_bound(m, k_in + k_out, v, delta, share)
        guesses.append(Guess(k_in, k_out, v, share, eps))
    eps = max((g.epsilon for g in guesses), default=0.0)
    return Bound(m=m, delta=delta, beta=beta, epsilon=eps, guesses=tuple(guesses))
