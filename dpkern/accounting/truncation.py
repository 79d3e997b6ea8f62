"""Additive delta terms of what dpkern runs beyond the Poisson-subsampled Gaussian: the
noise stream's bounded tail (:func:`truncation_delta`, SPEC 3) and fixed-shape batches
that truncate the Poisson batch (:func:`batch_overflow_probability`,
:func:`overflow_delta`, SPEC 8)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

from ..hyper import check_nonnegative
from .mechanism import _check_count, _check_rate, _check_steps


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
