"""Counter-based Poisson sampling (SPEC 3.1): the stream, exact rates, frequencies, ranks,
resumes, fixed shapes and their truncation, privacy units, keys, bad input."""

from __future__ import annotations

import copy
import hashlib
import math
import pickle
import time
from fractions import Fraction

import pytest
import torch

from dpkern import sampling as S
from dpkern.sampling import PoissonBatchSampler

from conftest import load_vectors


# -- the stream: known answers, the seed derivation, the exact comparison ----------------------
def test_sampling_words_match_the_shared_philox_vectors():
    """u_i comes from the Philox words of pair i >> 1 under stream 1 (the shared vectors
    hold a stream-1 case: independent known answers)."""
    cases = [c for c in load_vectors()["cases"] if c["stream"] == S.SAMPLING_STREAM]
    assert cases
    for case in cases:
        key = S.SamplingKey(int(case["key"]))
        step = int(case["step"])
        index = torch.tensor([int(i) for i in case["index"]])
        hi, lo = S.sampling_words(index, key=key, step=step)
        for i, h, low, words in zip(index.tolist(), hi, lo, case["philox_r0_r1_r2_r3"]):
            r0, r1, r2, r3 = words
            assert (int(h), int(low)) == ((r0, r1) if i % 2 == 0 else (r2, r3))


def test_seed_derivation_is_blake2b_and_differs_from_the_noise_key():
    for seed in (0, 1, 11, 2**63 - 1, 2**64 - 1):
        want = hashlib.blake2b(
            seed.to_bytes(8, "little"), digest_size=8, person=b"dpkern-sample-v1"
        ).digest()
        key = S.sampling_key(seed)
        assert key._value == int.from_bytes(want, "little") and key.seeded
        assert key._value != seed  # a --noise-seed of the same value is the seed itself
    assert S.sampling_key(None)._value != S.sampling_key(None)._value  # os.urandom
    for bad in (-1, 2**64, 1.5, True, "3"):
        with pytest.raises(ValueError, match="seed"):
            S.sampling_key(bad)


@pytest.mark.parametrize(
    "q", [1.0, 0.5, 0.1, 0.01, 1 / 3, 2**-60, 5e-324, 0.9999999999999999, 0.123456789]
)
def test_rate_threshold_is_exact_and_never_above_q(q):
    t = S.rate_threshold(q)
    assert t == math.floor(Fraction(q) * 2**64)
    assert Fraction(q) - Fraction(1, 2**64) < Fraction(t, 2**64) <= Fraction(q)
    # a float32 compare (torch.rand() < q) runs at float32(q), e.g. 2**-24-ish above q
    if q == 0.1:
        f32 = Fraction(float(torch.tensor(q, dtype=torch.float32)))
        assert f32 > Fraction(q) >= Fraction(t, 2**64)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.0000000000000002, 2, math.nan, math.inf, "0.1"])
def test_rate_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="sample_rate"):
        S.rate_threshold(bad)
    with pytest.raises(ValueError, match="sample_rate"):
        PoissonBatchSampler(10, bad, 3)


def test_inclusion_is_an_integer_compare_at_the_threshold():
    """A unit whose word equals the threshold is out, one below it is in: exact."""
    key = S.sampling_key(5)
    index = torch.arange(0, 1000)
    hi, lo = S.sampling_words(index, key=key, step=3)
    u = [(h << 32) | low for h, low in zip(hi.tolist(), lo.tolist())]
    for i in (0, 1, 17, 998, 999):
        at = S.inclusion_mask(index, key=key, step=3, threshold=u[i])
        above = S.inclusion_mask(index, key=key, step=3, threshold=u[i] + 1)
        assert not at[i] and above[i]
        assert at.tolist() == [x < u[i] for x in u]
        # the range path (one Philox call per pair) agrees with the indexed path
        assert torch.equal(at, S.inclusion_mask(range(0, 1000), key=key, step=3, threshold=u[i]))
    assert S.inclusion_mask(index, key=key, step=3, sample_rate=1.0).all()  # q = 1: all
    odd = S.inclusion_mask(range(7, 500), key=key, step=3, threshold=u[17])
    assert odd.tolist() == [x < u[17] for x in u[7:500]]


# -- inclusion frequencies ----------------------------------------------------------------------
def test_inclusion_frequencies_match_q_to_binomial_tolerance():
    N, q, T = 20_000, 0.03, 40
    sampler = PoissonBatchSampler(N, q, T, seed=7)
    counts = torch.zeros(N, dtype=torch.float64)
    sizes = []
    for batch in sampler:
        counts[batch] += 1
        sizes.append(len(batch))
    total = counts.sum().item()
    sd = math.sqrt(N * T * q * (1 - q))
    assert abs(total - N * T * q) < 5 * sd  # the overall rate
    for lane in (0, 1):  # both words of a Philox call
        n = N // 2
        assert abs(counts[lane::2].sum().item() - n * T * q) < 5 * math.sqrt(n * T * q * (1 - q))
    # each unit's count ~ Binomial(T, q): its variance, and steps independent of each other
    assert counts.var().item() == pytest.approx(T * q * (1 - q), rel=0.1)
    sizes = torch.tensor(sizes, dtype=torch.float64)
    assert sizes.var().item() == pytest.approx(N * q * (1 - q), rel=0.6)
    a, b = list(sampler)[:2]
    both = len(set(a) & set(b))
    assert abs(both - N * q * q) < 5 * math.sqrt(N * q * q) + 1


def test_units_are_sampled_as_wholes_at_rate_q():
    units = torch.arange(3000) // 3  # 1000 units of 3 examples
    sampler = PoissonBatchSampler(3000, 0.1, 30, seed=2, units=units)
    hits = torch.zeros(1000)
    for batch in sampler.batches():
        ids = batch.unit_ids
        assert torch.equal(ids, batch.indices // 3)  # grouped by unit, all 3 rows
        assert (torch.bincount(ids, minlength=1000)[ids] == 3).all()
        hits[torch.unique(ids)] += 1
    assert abs(hits.sum().item() - 3000) < 5 * math.sqrt(3000 * 0.9)
    assert sampler.expected_batch_size == pytest.approx(100.0)


# -- the same batches on any number of ranks, and after a resume ------------------------------
@pytest.mark.parametrize("units", [None, "users"])
def test_union_over_ranks_is_the_single_process_batch(units):
    N, q, T = 997, 0.07, 6
    ids = None if units is None else (torch.arange(N) * 7919) % 101  # 101 scattered units
    single = list(PoissonBatchSampler(N, q, T, seed=3, units=ids).batches())
    for W in (1, 2, 3):
        parts = [
            list(PoissonBatchSampler(N, q, T, seed=3, units=ids, rank=r, world_size=W).batches())
            for r in range(W)
        ]
        for t in range(T):
            rows = torch.cat([parts[r][t].indices for r in range(W)])
            assert sorted(rows.tolist()) == sorted(single[t].indices.tolist())
            for r in range(W):  # each rank holds whole units of its own shard
                assert (parts[r][t].unit_ids % W == r).all()


@pytest.mark.parametrize("W", [1, 2, 3])
def test_fixed_shape_over_ranks_interleaves_the_single_process_batch(W):
    N, q, T, B_max = 500, 0.1, 8, 58
    single = list(PoissonBatchSampler(N, q, T, seed=4, max_batch_size=B_max).batches())
    parts = [
        list(
            PoissonBatchSampler(
                N, q, T, seed=4, max_batch_size=B_max, rank=r, world_size=W
            ).batches()
        )
        for r in range(W)
    ]
    L = -(-B_max // W)
    for t in range(T):
        real = single[t].indices[single[t].mask]
        for r in range(W):
            b = parts[r][t]
            assert b.indices.shape == b.mask.shape == b.unit_ids.shape == (L,)
            assert torch.equal(b.indices[b.mask], real[r::W])


def test_resume_continues_the_same_sequence():
    whole = list(PoissonBatchSampler(300, 0.2, 10, seed=9))
    tail = list(PoissonBatchSampler(300, 0.2, 4, seed=9, start_step=7))
    assert tail == whole[6:]
    assert [b.step for b in PoissonBatchSampler(300, 0.2, 3, seed=9, start_step=5).batches()] == [
        5,
        6,
        7,
    ]


def test_each_epoch_draws_new_steps_never_the_same_batches_again():
    """Iterating the sampler again (an epoch loop, Opacus' DPDataLoader habit) continues
    with the next steps: a second pass that replayed steps 1..T would put every example in
    the same batches twice while the accountant counts 2T independent steps."""
    sampler = PoissonBatchSampler(400, 0.1, 5, seed=11)
    loader = torch.utils.data.DataLoader(
        range(400), batch_sampler=sampler, collate_fn=lambda rows: list(rows)
    )
    epochs = [list(loader) for _ in range(3)]
    whole = list(PoissonBatchSampler(400, 0.1, 15, seed=11))
    assert epochs[0] + epochs[1] + epochs[2] == whole
    assert epochs[0] != epochs[1]
    assert sampler.next_step == 16
    steps = [b.step for b in sampler.batches()]
    assert steps == [16, 17, 18, 19, 20]
    # an epoch left early, and two iterations interleaved, never share a step
    s = PoissonBatchSampler(400, 0.1, 4, seed=11)
    first = s.batches()
    a = next(first)
    b = [x.step for x in s.batches()]
    assert a.step == 1 and b == [2, 3, 4, 5]
    assert [x.step for x in first] == [6, 7, 8]
    # a resume that passes next_step continues the sequence
    tail = PoissonBatchSampler(400, 0.1, 3, seed=11, start_step=sampler.next_step)
    assert list(tail) == list(PoissonBatchSampler(400, 0.1, 23, seed=11))[20:]


def test_secure_mode_draws_a_secret_key_and_never_shows_it():
    a, b = PoissonBatchSampler(2000, 0.05, 3), PoissonBatchSampler(2000, 0.05, 3)
    assert list(a) != list(b)
    key = a.key
    assert repr(key) == str(key) == f"{key}" == "SamplingKey(<secret>)"
    assert str(key._value) not in repr(a) and "secret" in repr(a)
    assert repr(S.sampling_key(3)) == "SamplingKey(seeded)"
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(key)
    assert copy.deepcopy(key) is key
    with pytest.raises(AttributeError):
        key._value = 1
    with pytest.raises(ValueError, match="sampling key"):
        S.SamplingKey(-1)
    with pytest.raises(ValueError, match="seed= or key="):
        PoissonBatchSampler(10, 0.5, 2, seed=1, key=key)
    with pytest.raises(ValueError, match="SamplingKey"):
        PoissonBatchSampler(10, 0.5, 2, key=1234)
    shared = PoissonBatchSampler(2000, 0.05, 3, key=key)  # a broadcast key: same batches
    assert list(shared) == [a.batch(t).indices.tolist() for t in (1, 2, 3)]


# -- fixed shapes: truncated Poisson padded to B_max ----------------------------------------
def test_fixed_shape_batches_have_shape_b_max_and_mask_the_padding():
    N, q, B_max = 400, 0.1, 66
    sampler = PoissonBatchSampler(N, q, 30, seed=1, max_batch_size=B_max, pad_index=3)
    plain = list(PoissonBatchSampler(N, q, 30, seed=1))
    for batch, want in zip(sampler.batches(), plain):
        assert batch.indices.shape == batch.mask.shape == batch.unit_ids.shape == (B_max,)
        n = len(want)
        assert n <= B_max and not batch.truncated  # no overflow at these settings
        assert batch.indices[: batch.num_rows].tolist() == want
        assert not batch.mask[n:].any() and batch.mask[:n].all()
        assert (batch.indices[n:] == 3).all() and (batch.unit_ids[n:] == -1).all()
    again = PoissonBatchSampler(N, q, 30, seed=1, max_batch_size=B_max, pad_index=3)
    assert [len(b) for b in again] == [len(b) for b in plain]  # __iter__: real rows only


def test_truncation_keeps_the_smallest_words_as_a_random_subset():
    N, q, B_max = 100, 0.5, 52  # P[Binomial(100, 0.5) > 52] ~ 0.31: frequent overflow
    sampler = PoissonBatchSampler(N, q, 200, seed=5, max_batch_size=B_max)
    plain = PoissonBatchSampler(N, q, 200, seed=5)
    truncated = 0
    hits = torch.zeros(N)
    for batch, full in zip(sampler.batches(), plain):
        kept = batch.indices[batch.mask].tolist()
        assert set(kept) <= set(full)
        if len(full) > B_max:
            truncated += 1
            assert batch.truncated and len(kept) == B_max
            hi, lo = S.sampling_words(torch.tensor(full), key=sampler.key, step=batch.step)
            u = sorted(((h << 32) | low, i) for h, low, i in zip(hi.tolist(), lo.tolist(), full))
            assert kept == sorted(i for _, i in u[:B_max])
            hits[kept] += 1
        else:
            assert kept == full and not batch.truncated
    assert 30 < truncated < 100
    # on truncated steps every example is kept alike (no bias towards low indices)
    assert hits[:50].sum().item() == pytest.approx(hits[50:].sum().item(), rel=0.1)


def test_truncation_of_multi_row_units_keeps_whole_units():
    units = torch.arange(120) // 4  # 30 units of 4 rows
    sampler = PoissonBatchSampler(
        120, 0.5, 100, seed=8, units=units, max_batch_size=66, max_unit_size=4
    )
    seen = False
    for batch in sampler.batches():
        ids = batch.unit_ids[batch.mask]
        assert batch.num_rows <= 66
        assert (torch.bincount(ids, minlength=30)[ids] == 4).all()
        seen |= batch.truncated
    assert seen


def test_max_unit_size_keeps_each_units_first_rows():
    units = torch.tensor([0, 1, 0, 0, 2, 0, 1])
    s = PoissonBatchSampler(7, 1.0, 1, seed=0, units=units, max_unit_size=2)
    (batch,) = s.batches()
    assert batch.indices.tolist() == [0, 2, 1, 6, 4] and batch.unit_ids.tolist() == [0, 0, 1, 1, 2]


def test_fixed_shape_bad_input_is_refused():
    with pytest.raises(ValueError, match="below the expected batch size"):
        PoissonBatchSampler(1000, 0.1, 5, max_batch_size=99)
    PoissonBatchSampler(1000, 0.1, 5, max_batch_size=100)  # the expected batch: allowed
    units = torch.arange(100) // 5
    with pytest.raises(ValueError, match="max_unit_size"):
        PoissonBatchSampler(100, 0.1, 5, units=units, max_batch_size=30)
    with pytest.raises(ValueError, match="max_unit_size"):  # the neighbour's unit is unbounded
        PoissonBatchSampler(100, 0.1, 5, units=torch.arange(100), max_batch_size=30)
    PoissonBatchSampler(100, 0.1, 5, units=torch.arange(100), max_batch_size=30, max_unit_size=1)
    with pytest.raises(ValueError, match="max_unit_size=5: above max_batch_size=4"):
        PoissonBatchSampler(100, 0.01, 5, units=units, max_batch_size=4, max_unit_size=5)
    # the expected batch is bounded from public numbers (20 units x k = 5 rows x q), never
    # from the units' real sizes (here 1 row each: 20 rows would give 2), nor said in them
    small = torch.arange(20)
    with pytest.raises(ValueError, match=r"below the expected batch size 10 \(q \* units"):
        PoissonBatchSampler(20, 0.1, 5, units=small, max_batch_size=9, max_unit_size=5)
    with pytest.raises(ValueError, match="one row only"):
        PoissonBatchSampler(
            100, 0.1, 5, units=units, max_batch_size=30, max_unit_size=5, world_size=2
        )
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_batch_size"):
            PoissonBatchSampler(100, 0.1, 5, max_batch_size=bad)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_samples": 0}, "num_samples"),
        ({"steps": 0}, "steps"),
        ({"start_step": 0}, "start_step"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"world_size": 0}, "world_size"),
        ({"units": [0, 1]}, "one unit id per example"),
        ({"units": [0.5] * 10}, "integer unit ids"),
        ({"units": [-1] + [0] * 9}, ">= 0"),
        ({"units": "abcdefghij"}, "units"),
        ({"pad_index": 10}, "pad_index"),
    ],
)
def test_sampler_validation(kwargs, match):
    args = {"num_samples": 10, "sample_rate": 0.5, "steps": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        PoissonBatchSampler(**args)


# -- the overflow probability against independent binomial tails -------------------------------
def _exact_tail(n: int, q: float, B: int) -> Fraction:
    """P[Binomial(n, q) > B] in exact rational arithmetic (q is a binary fraction)."""
    p = Fraction(q)
    return sum(
        (math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(B + 1, n + 1)), Fraction(0)
    )


def _exact_rows_tail(unit_rows: dict, q: float, B: int, k: int) -> Fraction:
    """P[sum of rows of included units (+ a unit of k rows) > B], exact, by enumeration
    of the row-count distribution (dynamic programming over units)."""
    p = Fraction(q)
    dist = {0: Fraction(1)}
    sizes = [s for s, m in unit_rows.items() for _ in range(m)] + ([k] if k else [])
    for s in sizes:
        new: dict = {}
        for total, mass in dist.items():
            new[total] = new.get(total, 0) + mass * (1 - p)
            new[total + s] = new.get(total + s, 0) + mass * p
        dist = new
    return sum((m for t, m in dist.items() if t > B), Fraction(0))


@pytest.mark.parametrize(
    "N,q,B", [(300, 0.1, 45), (1000, 0.02, 40), (200, 0.5, 120), (50, 1.0, 50)]
)
def test_overflow_probability_matches_an_exact_binomial_tail(N, q, B):
    sampler = PoissonBatchSampler(N, q, 3, seed=0, max_batch_size=B)
    want = _exact_tail(N + 1, q, B)  # the neighbour with one more example
    got = sampler.overflow_probability
    assert got >= float(want) * (1 - 1e-12)
    assert got == pytest.approx(float(want), rel=1e-8, abs=1e-300)


def test_overflow_probability_at_scale_matches_scipy_and_log_space_sum():
    from scipy import stats

    from dpkern.accounting import batch_overflow_probability

    N, q, B = 10**6, 1e-3, 1150  # mean 1000, sd 31.6: about 4.7 sd
    got = batch_overflow_probability(N, q, B)
    assert got == pytest.approx(stats.binom.sf(B, N + 1, q), rel=1e-7)
    # an independent log-space sum of the pmf terms
    logs = [
        math.lgamma(N + 2)
        - math.lgamma(k + 1)
        - math.lgamma(N + 2 - k)
        + k * math.log(q)
        + (N + 1 - k) * math.log1p(-q)
        for k in range(B + 1, B + 400)
    ]
    top = max(logs)
    assert got == pytest.approx(math.exp(top) * sum(math.exp(x - top) for x in logs), rel=1e-6)


@pytest.mark.parametrize(
    "unit_rows,q,B,k",
    [({1: 20, 3: 5, 4: 2}, 0.3, 14, 4), ({2: 15, 5: 3}, 0.5, 25, 5), ({1: 30}, 0.2, 9, 0)],
)
def test_overflow_probability_of_multi_row_units_matches_enumeration(unit_rows, q, B, k):
    from dpkern.accounting import batch_overflow_probability

    got = batch_overflow_probability(unit_rows, q, B, neighbour_rows=k)
    want = float(_exact_rows_tail(unit_rows, q, B, k))
    assert got == pytest.approx(want, rel=1e-8)
    assert got >= want


def test_sampler_overflow_probability_of_units_uses_the_public_bound():
    """Every unit counted at the cap k: the bound depends on N units, q, B_max and k, never
    on the private unit sizes (two datasets of 40 units, sizes differing, same bound),
    and it bounds the exact histogram's probability."""
    from dpkern.accounting import batch_overflow_probability

    units = torch.tensor([0] * 3 + [1] * 2 + list(range(2, 40)))  # sizes 3, 2 and 38 x 1
    s = PoissonBatchSampler(43, 0.25, 4, units=units, max_batch_size=35, max_unit_size=3)
    want = batch_overflow_probability({3: 40}, 0.25, 35, neighbour_rows=3)
    assert s.overflow_probability == want
    exact = batch_overflow_probability({3: 1, 2: 1, 1: 38}, 0.25, 35, neighbour_rows=3)
    assert exact < want
    other = torch.tensor(list(range(40)) + [5, 6, 7])  # sizes 1 x 37 and 3 x 2 ... (40 units)
    s2 = PoissonBatchSampler(43, 0.25, 4, units=other, max_batch_size=35, max_unit_size=3)
    assert s2.num_units == 40 and s2.overflow_probability == want
    assert PoissonBatchSampler(43, 0.25, 4, units=units).overflow_probability == 0.0


# -- speed: a million units per step on a CPU thread --------------------------------------------
def test_a_million_units_per_step_is_fast():
    key = S.sampling_key(1)
    torch.set_num_threads(torch.get_num_threads())
    t0 = time.perf_counter()
    mask = S.inclusion_mask(range(0, 10**6), key=key, step=1, sample_rate=1e-3)
    elapsed = time.perf_counter() - t0
    assert abs(int(mask.sum()) - 1000) < 5 * math.sqrt(1000)
    assert elapsed < 5.0, elapsed  # about 0.15 s on one idle core


def test_padding_rows_never_reach_the_released_sum():
    """The padded batch (static shape, padding rows holding real data of pad_index) gives
    the same noiseless DP-SGD step as the unpadded batch: the mask keeps padding out."""
    import dpkern
    from dpkern.grad_sample import compute_grad_sample

    torch.manual_seed(0)
    x, y = 10 * torch.randn(200, 4), torch.randint(0, 3, (200,))
    fixed = PoissonBatchSampler(200, 0.1, 3, seed=2, max_batch_size=40, pad_index=7)

    def step(indices, unit_ids):
        torch.manual_seed(1)
        net = torch.nn.Linear(4, 3)
        params = list(net.parameters())
        opt = dpkern.DPSGD(
            params,
            lr=1.0,
            max_grad_norm=0.5,
            noise_multiplier=0.0,
            expected_batch_size=1.0,
            backend="torch",
        )
        compute_grad_sample(net, torch.nn.functional.cross_entropy, x[indices], y[indices])
        for p, g in zip(params, S.group_grad_samples([p.grad_sample for p in params], unit_ids)):
            p.grad_sample = g
        opt.step()
        return [p.detach().clone() for p in params], opt.stats["samples"]

    for batch in fixed.batches():
        assert len(batch) == 40 and (batch.indices[~batch.mask] == 7).all()
        padded, n_padded = step(batch.indices, batch.unit_ids)
        real = batch.indices[batch.mask]
        plain, n_plain = step(real, real)
        assert n_padded == n_plain == batch.num_rows  # padding is not counted either
        for a, b in zip(padded, plain):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
