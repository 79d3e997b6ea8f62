"""dpkern.audit.bound: the main theorem of Steinke, Nasr & Jagielski (2023), exact tails.

References: the values of the paper's own p-value and bisection (its appendix code,
transcribed independently below with scipy's binomial), exact rational tails, and the
closed form of delta = 0 with every guess right."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from conftest import case_seed
from dpkern.audit import bound as B

#: (m, r, v) -> the paper's epsilon lower bound at delta = 1e-5, beta = 0.05 (4 decimals),
#: computed with the transcription below (scipy.stats.binom, 30-step bisection).
PAPER_M500 = {
    (500, 500, 500): 5.1010,
    (500, 500, 450): 1.9466,
    (500, 500, 400): 1.1983,
    (500, 500, 300): 0.2514,
    (500, 250, 250): 4.4048,
    (500, 100, 100): 3.4792,
    (500, 100, 90): 1.6285,
    (500, 50, 50): 2.7705,
    (500, 10, 10): 1.0336,
    (1000, 1000, 1000): 5.7823,
}


#: Values printed in the paper (arXiv 2305.08846v1): (m, r, v, delta) -> epsilon at beta = 0.05,
#: printed to 3 decimals: Appendix D's example and Section 7's Figure 11 point.
PRINTED = {
    (1000, 100, 75, 1e-4): 0.673,
    (100000, 1510, 1439, 1e-5): 2.675,
}


@pytest.mark.parametrize("key", sorted(PRINTED))
def test_reproduces_the_values_printed_in_the_paper(key):
    m, r, v, delta = key
    eps = B.epsilon_lower_bound(m, r, v, delta, 0.05)
    assert abs(eps - PRINTED[key]) <= 1e-3  # printed to 3 decimals


def paper_p_value(m, r, v, eps, delta):
    """The paper's p-value: P[Binomial(r, q) >= v] + 2 m delta max_i P[v-i <= Bin < v] / i."""
    from scipy.stats import binom

    q = 1.0 / (1.0 + math.exp(-eps))
    tail = binom.sf(v - 1, r, q)
    i = np.arange(1, v + 1)
    alpha = np.max(np.cumsum(binom.pmf(v - i, r, q)) / i) if v else 0.0
    return min(1.0, tail + 2 * m * delta * alpha)


def paper_epsilon(m, r, v, delta, beta):
    lo, hi = 0.0, 1.0
    while paper_p_value(m, r, v, hi, delta) < beta:
        hi += 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if paper_p_value(m, r, v, mid, delta) < beta else (lo, mid)
    return lo


@pytest.mark.parametrize("mrv", sorted(PAPER_M500))
def test_reproduces_the_papers_reference_values(mrv):
    m, r, v = mrv
    eps = B.epsilon_lower_bound(m, r, v, 1e-5, 0.05)
    assert eps == pytest.approx(PAPER_M500[mrv], abs=1e-4)
    if r <= 100:
        assert eps == pytest.approx(paper_epsilon(m, r, v, 1e-5, 0.05), abs=1e-6)


def test_matches_the_paper_p_value_on_a_grid():
    for m, r, v in [(500, 200, 180), (500, 37, 30), (2000, 600, 480), (50, 50, 41)]:
        for eps in (0.0, 0.3, 1.0, 2.5, 6.0):
            for delta in (0.0, 1e-5, 1e-3):
                ours = B.p_value(m, r, v, eps, delta)
                assert ours == pytest.approx(
                    paper_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-15
                )


def test_delta_zero_all_correct_is_the_closed_form():
    # P[Binomial(r, q) >= r] = q^r < beta  <=>  q > beta^(1/r):  eps = log(q / (1 - q))
    for r in (10, 100, 500):
        q = 0.05 ** (1.0 / r)
        assert B.epsilon_lower_bound(r, r, r, 0.0, 0.05) == pytest.approx(
            math.log(q / (1 - q)), abs=1e-8
        )


def exact_sf(v, r, q: Fraction) -> Fraction:
    return sum(math.comb(r, k) * q**k * (1 - q) ** (r - k) for k in range(v, r + 1))


def test_binomial_tails_are_exact():
    for r, q in [
        (7, Fraction(3, 4)),
        (40, Fraction(1, 2)),
        (120, Fraction(7, 8)),
        (300, Fraction(9, 10)),
    ]:
        for v in sorted({0, 1, r // 3, r // 2, (9 * r) // 10, r - 1, r}):
            exact = exact_sf(v, r, q)
            got = B.binom_sf(v, r, float(q))
            assert got == pytest.approx(float(exact), rel=1e-12, abs=1e-300), (r, q, v)
    # far tails (no normal approximation): exact to relative 1e-12 where they are 1e-40
    exact = exact_sf(290, 300, Fraction(1, 2))
    assert float(exact) < 1e-60
    assert B.binom_sf(290, 300, 0.5) == pytest.approx(float(exact), rel=1e-12)
    assert B.binom_sf(0, 5, 0.3) == 1.0 and B.binom_sf(6, 5, 0.3) == 0.0


def test_p_value_grows_with_eps_and_shrinks_with_v():
    m, r = 1000, 400
    for v in (250, 330, 400):
        ps = [B.p_value(m, r, v, e, 1e-5) for e in np.linspace(0, 8, 81)]
        assert all(a <= b + 1e-15 for a, b in zip(ps, ps[1:]))
    for eps in (0.5, 2.0):
        ps = [B.p_value(m, r, v, eps, 1e-5) for v in range(0, r + 1, 10)]
        assert all(a >= b - 1e-15 for a, b in zip(ps, ps[1:]))


def test_lower_bound_is_rejected_just_below_and_not_above():
    m, r, v, delta, beta = 1000, 200, 170, 1e-5, 0.01
    eps = B.epsilon_lower_bound(m, r, v, delta, beta)
    assert 0 < eps < 10
    assert B.p_value(m, r, v, eps - 1e-6, delta) < beta <= B.p_value(m, r, v, eps + 1e-6, delta)
    assert B.epsilon_lower_bound(m, r, r // 2, delta, beta) == 0.0  # chance level
    assert B.epsilon_lower_bound(m, 0, 0, delta, beta) == 0.0


def test_a_large_delta_term_weakens_the_bound():
    no_delta = B.epsilon_lower_bound(1000, 1000, 1000, 0.0)
    assert B.epsilon_lower_bound(1000, 1000, 1000, 1e-5) < no_delta
    assert B.epsilon_lower_bound(1000, 1000, 1000, 1e-3) < B.epsilon_lower_bound(
        1000, 1000, 1000, 1e-5
    )


def test_guess_sizes_are_fixed_and_union_bounded():
    sizes = B.guess_sizes(1000)
    assert sizes[:6] == [(10, 10), (25, 25), (50, 50), (100, 100), (250, 250), (500, 500)]
    assert sizes[6:] == [(10, 0), (20, 0), (50, 0), (100, 0), (200, 0)]
    assert (0, 0) not in B.guess_sizes(50) and len(B.guess_sizes(50)) == 9
    rng = np.random.default_rng(case_seed(1))
    inc = rng.random(1000) < 0.5
    res = B.lower_bound_from_scores(inc + rng.normal(0, 0.3, 1000), inc, 1e-5, 0.05, generator=rng)
    assert len(res.guesses) == len(B.GUESS_FRACTIONS)
    assert all(g.beta == pytest.approx(0.05 / len(B.GUESS_FRACTIONS)) for g in res.guesses)
    assert res.epsilon == max(g.epsilon for g in res.guesses) == res.best.epsilon
    for g in res.guesses:  # each bound is that of its own counts at the shared level
        assert g.epsilon == B.epsilon_lower_bound(1000, g.r, g.correct, 1e-5, g.beta)
    assert res.epsilon > 1.0


def test_guesses_count_top_in_and_bottom_out_with_random_ties():
    inc = np.array([True] * 50 + [False] * 50)
    scores = np.where(inc, 1.0, 0.0)  # perfectly separated, but with ties inside each class
    res = B.lower_bound_from_scores(scores, inc, 0.0, fractions=((0.5, 0.5),))
    assert res.guesses[0].correct == 100
    counts = {  # all scores tied: the guesses are a random split, their count varies
        B.lower_bound_from_scores(
            np.zeros(100), inc, 0.0, fractions=((0.5, 0.5),), generator=np.random.default_rng(k)
        )
        .guesses[0]
        .correct
        for k in range(20)
    }
    assert len(counts) > 1 and all(c % 2 == 0 for c in counts)  # 2 x (ins guessed in)


def test_randomised_response_is_never_over_claimed():
    """Soundness of the bound itself: eps-DP randomised response on each canary's coin,
    scored by its answer. The bound may exceed the true eps with probability <= beta."""
    rng = np.random.default_rng(case_seed(2))
    eps, m, trials, exceed = 1.5, 1000, 60, 0
    p_true = math.exp(eps) / (1 + math.exp(eps))
    for _ in range(trials):
        inc = rng.random(m) < 0.5
        answer = np.where(rng.random(m) < p_true, inc, ~inc)
        res = B.lower_bound_from_scores(answer.astype(float), inc, 0.0, 0.05, generator=rng)
        exceed += res.epsilon > eps
        assert res.epsilon < eps + 0.5
    assert exceed <= 0.05 * trials + 3  # (expected well below beta: the guess sizes share it)


def test_errors():
    for args in [(10, 11, 3), (10, 5, 6), (10, -1, 0), (10, 5.0, 3)]:
        with pytest.raises(ValueError):
            B.p_value(*args, 1.0, 1e-5)
    with pytest.raises(ValueError, match="delta"):
        B.epsilon_lower_bound(10, 5, 5, 1.5)
    with pytest.raises(ValueError, match="beta"):
        B.epsilon_lower_bound(10, 5, 5, 1e-5, 0.0)
    with pytest.raises(ValueError, match="epsilon"):
        B.p_value(10, 5, 5, -1.0, 0.0)
    with pytest.raises(ValueError, match="shape"):
        B.lower_bound_from_scores(np.zeros(3), np.zeros(4, bool), 1e-5)
    with pytest.raises(ValueError, match="finite"):
        B.lower_bound_from_scores(np.array([0.0, np.nan]), np.zeros(2, bool), 1e-5)
