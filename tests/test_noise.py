"""The noise stream v1 (SPEC section 3) in the reference, through the public functional API."""

from __future__ import annotations

import math

import pytest
import torch

from dpkern import functional as F
from dpkern.backends import reference as ref

from conftest import load_vectors


def test_philox_known_answer_zero_counter_and_key():
    z = torch.zeros(1, dtype=torch.int64)
    words = [int(w) for w in ref.philox4x32_10(z, z, z, z, 0)]
    assert words == load_vectors()["philox4x32_10_zero_kat"]
    assert words == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]  # Random123's KAT


def test_vectors_words_exact_and_z_close():
    vec = load_vectors()
    for case in vec["cases"]:
        key, step, stream = int(case["key"]), int(case["step"]), case["stream"]
        index = torch.tensor([int(i) for i in case["index"]], dtype=torch.int64)
        words = ref.philox_words(index, key=key, step=step, stream=stream)
        assert words.tolist() == case["philox_r0_r1_r2_r3"]
        for i, z in zip(case["index"], case["z"]):
            got = F.gaussian_noise(
                1, key=key, step=step, offset=int(i), stream=stream, backend="torch"
            ).item()
            assert abs(got - z) <= max(2e-6, 1e-6 * abs(z))


def test_transform_cases_extremes():
    for case in load_vectors()["transform_cases"]:
        z = ref.normal_from_words(torch.tensor([case["r0_r1_r2_r3"]], dtype=torch.int64))[0]
        for got, want in zip(z.tolist(), (case["z_even"], case["z_odd"])):
            assert abs(got - want) <= max(2e-6, 1e-6 * abs(want))


def test_tail_reaches_11_6_sigma_and_no_exact_zero_radius():
    zero, top = 0, 2**32 - 1
    r = ref.normal_from_words(torch.tensor([[zero, zero, zero, zero]]))[0, 0].item()  # lane 0
    assert r == pytest.approx(math.sqrt(2 * 97 * math.log(2)), rel=1e-6)  # U = 2**-97
    # U just below 1: radius tiny but positive (no coarse grid near 0)
    R = ref.normal_from_words(torch.tensor([[top, top, zero, top]]))[0, 0].item()  # lane 0
    assert 0 < R < 1e-10


def test_slices_are_consistent_whatever_the_split():
    key, step = 1234567, 9
    whole = F.gaussian_noise(1001, key=key, step=step, offset=2**32 - 500, backend="torch")
    parts = [
        F.gaussian_noise(n, key=key, step=step, offset=2**32 - 500 + o, backend="torch")
        for o, n in [(0, 1), (1, 498), (499, 2), (501, 500)]
    ]
    assert torch.equal(torch.cat(parts), whole)


def test_step_stream_and_key_change_everything():
    base = F.gaussian_noise(4096, key=5, step=3, backend="torch")
    for other in (
        F.gaussian_noise(4096, key=6, step=3, backend="torch"),
        F.gaussian_noise(4096, key=5, step=4, backend="torch"),
        F.gaussian_noise(4096, key=5, step=3, stream=1, backend="torch"),
        F.gaussian_noise(4096, key=5, step=3, offset=4096, backend="torch"),
    ):
        assert (base != other).float().mean() > 0.999
        assert abs(torch.corrcoef(torch.stack([base, other]))[0, 1]) < 0.1


def test_standard_normal_statistics():
    """Mean, variance, tails and independence of 2**20 draws (tolerances ~6 std errors)."""
    n = 2**20
    z = F.gaussian_noise(n, key=2**63 + 17, step=2**33 + 1, offset=2**40, backend="torch").double()
    se = 1 / math.sqrt(n)
    assert abs(z.mean()) < 6 * se
    assert abs(z.var() - 1) < 6 * math.sqrt(2) * se
    assert abs((z**3).mean()) < 6 * math.sqrt(15) * se  # skewness
    assert abs((z**4).mean() - 3) < 6 * math.sqrt(96) * se  # kurtosis
    p_tail = (z.abs() > 3).double().mean()
    assert abs(p_tail - 0.0026998) < 6 * math.sqrt(0.0027 / n)
    # the two lanes of one Philox call are independent (cos and sin of one angle)
    assert abs((z[0::2] * z[1::2]).mean()) < 6 * math.sqrt(2) * se


@pytest.mark.parametrize(
    "bad",
    [
        dict(numel=-1),
        dict(key=-1),
        dict(key=2**64),
        dict(step=0),
        dict(stream=2**16),
        dict(offset=-3),
    ],
)
def test_bad_arguments(bad):
    kw = dict(numel=4, key=1, step=1, offset=0, stream=0)
    kw.update(bad)
    numel = kw.pop("numel")
    with pytest.raises(ValueError):
        F.gaussian_noise(numel, **kw)
