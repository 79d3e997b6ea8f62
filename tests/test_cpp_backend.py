"""C++-specific checks of backend="cpp" (dpkern._C); parity with the reference for every
entry point lives in test_backend_parity.py.

Thread-count and Philox-path invariance (bit for bit), chunking invariance of the noise,
the transform at its extremes, bad buffers rejected before any write, many small tensors,
odd sizes around the block grid, float64 and non-contiguous inputs."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("dpkern._C")

from dpkern import _C  # noqa: E402
from dpkern.backends import cpp  # noqa: E402
from dpkern.backends import reference as ref  # noqa: E402
from dpkern.hyper import (
    AdamBCHyper,
    AdamWHyper,
    DPStep,
    MacAdamHyper,  # noqa: E402
    SGDHyper,
)

from conftest import load_vectors, random_states, run_step  # noqa: E402

KEY = 0x0123456789ABCDEF
HYPERS = {
    "sgd": SGDHyper(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam_bc": AdamBCHyper(lr=1e-2, weight_decay=0.01, gamma=1e-2),
    "adamw": AdamWHyper(lr=1e-2, weight_decay=0.1),
    "macadam": MacAdamHyper(lr=1e-2, h1=1e-2, h2=10.0),
}
# For comparisons with the reference at 1e-5: the same rules away from their ill-conditioned
# clamps (v_hat - phi_hat ~ gamma, S / kappa - b^2 sigma^2 / B_e^2 ~ h1), where one ulp of
# difference in z or in a sum is amplified without bound.
WELL_CONDITIONED = dict(
    HYPERS,
    adam_bc=AdamBCHyper(lr=1e-2, weight_decay=0.01, gamma=1e-2),
    macadam=MacAdamHyper(lr=1e-2, h1=1e-2, h2=10.0),
)


@pytest.fixture
def threads():
    """Set the kernels' thread count; restored to the default afterwards."""
    yield _C.set_num_threads
    _C.set_num_threads(0)


def make_case(rule, shapes, B, *, dtype=torch.float32, t=3, seed=0, first_offset=5):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(s, generator=g)  # noqa: E731
    params = [rnd(*s).to(dtype) for s in shapes]
    grad_samples = [None if k % 5 == 3 else rnd(B, *s).to(dtype) for k, s in enumerate(shapes)]
    clip = torch.rand(B, generator=g) + 0.1
    summed = [rnd(*s) if k % 2 else None for k, s in enumerate(shapes)]
    states = random_states(rule, shapes, rnd)
    offsets, off = [], first_offset
    for p in params:
        offsets.append(off)
        off += p.numel()
    dp = DPStep(key=KEY, step=t, noise_std=0.7, expected_batch_size=6.0, noise_var_avg=0.05)
    return params, grad_samples, clip, summed, states, offsets, dp


def assert_identical(a, b):
    pa, sa, oa = a
    pb, sb, ob = b
    assert oa == ob
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
    for name in sa:
        for x, y in zip(sa[name], sb[name]):
            assert torch.equal(x, y), name


def assert_close_to_reference(got, want, rtol=1e-5, atol=1e-6):
    for x, y in zip(got[0], want[0]):
        torch.testing.assert_close(x.float(), y.float(), rtol=rtol, atol=atol)
    for name in want[1]:
        for x, y in zip(got[1][name], want[1][name]):
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=name)
    assert got[2] == pytest.approx(want[2], rel=1e-4)


# ---------------------------------------------------------------------------------------
# The noise stream
# ---------------------------------------------------------------------------------------
def test_philox_known_answer():
    words = cpp.philox_words(torch.zeros(1, dtype=torch.int64), key=0, step=0)
    assert words[0].tolist() == load_vectors()["philox4x32_10_zero_kat"]


def test_transform_cases():
    cases = load_vectors()["transform_cases"]
    words = torch.tensor([c["r0_r1_r2_r3"] for c in cases], dtype=torch.int64)
    z = cpp.normal_from_words(words)
    for (even, odd), c in zip(z.tolist(), cases):
        for got, want in ((even, c["z_even"]), (odd, c["z_odd"])):
            assert abs(got - want) <= max(2e-6, 1e-6 * abs(want)), c


def _z_float64(words: torch.Tensor) -> torch.Tensor:
    """SPEC section 3 with U, V and theta in float32 as written, ln / log1p / sqrt / cos /
    sin in float64: the values the float32 transform approximates. [n, 4] -> [n, 2]."""
    r0, r1, r2, r3 = words.unbind(1)
    f32, m = torch.float32, 0xFFFFFFFF

    def uniform(a, b, c):
        return ((a.to(f32) * 2.0**-32 + b.to(f32) * 2.0**-64) + c.to(f32) * 2.0**-96) + 2.0**-97

    U, V = uniform(r0, r1, r3).double(), uniform(m - r0, m - r1, m - r3).double()
    L = torch.where(r0 < 2**31, -torch.log(U), -torch.log1p(-V))
    theta = (ref.TWO_PI_F32 * (r2.to(f32) * 2.0**-32)).double()
    R = torch.sqrt(2 * L)
    return torch.stack([R * torch.cos(theta), R * torch.sin(theta)], dim=1)


def test_transform_float32_math_within_spec_tolerance():
    """The vectorised float32 ln / sincos keep z within max(2e-6, 1e-6 |z|) of float64
    (SPEC section 3) for random words and at the edges: U down to 2^-97 (R up to 11.6),
    r0 on both sides of 2^31 (the two branches), V tiny (w == 1 and just below), theta
    near every multiple of pi/2."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    n = 200_000
    words = torch.randint(0, 2**32, (8, n, 4), generator=g, dtype=torch.int64)
    words[1, :, 0] &= 0xFF  # U ~ 2^-32 .. 2^-24
    words[2, :, 0] = 0
    words[2, :, 1] &= 0xFF  # U down to 2^-97
    words[3, :, 0] = 2**31 + (words[3, :, 0] & 0xFFF) - 0x800  # both sides of 2^31
    words[4, :, 0] |= 0xFFFFFF00  # V ~ 2^-32 .. 2^-24
    words[5, :, 0] = 0xFFFFFFFF  # V < 2^-32: w == 1
    quarter = torch.tensor([0, 2**30, 2**31, 3 * 2**30, 2**32 - 1])
    near = quarter[torch.randint(0, 5, (n,), generator=g)] + torch.randint(
        -4096, 4097, (n,), generator=g
    )
    words[6, :, 2] = near.clamp(0, 2**32 - 1)  # cos or sin near 0
    words[7, :, 1:] = 0  # the words' extremes
    words = words.reshape(-1, 4)
    got = cpp.normal_from_words(words).double()
    want = _z_float64(words)
    err = (got - want).abs() / torch.clamp(1e-6 * want.abs(), min=2e-6)
    assert err.max().item() <= 0.5, (err.max().item(), words[err.max(1).values.argmax()].tolist())


def test_noise_thread_and_path_invariance(threads):
    n, offset = 100_003, 2**32 - 777
    threads(1)
    want = cpp.gaussian_noise(n, key=KEY, step=9, offset=offset, stream=3)
    for t in (2, 3):
        threads(t)
        assert torch.equal(cpp.gaussian_noise(n, key=KEY, step=9, offset=offset, stream=3), want)
    best = _C.set_philox_path(-1)
    try:
        for path in range(best + 1):
            assert _C.set_philox_path(path) == path
            assert torch.equal(
                cpp.gaussian_noise(n, key=KEY, step=9, offset=offset, stream=3), want
            ), f"philox path {path}"
    finally:
        _C.set_philox_path(-1)


def test_noise_chunking_invariance():
    """Any slice of the stream, drawn alone, is bit-identical to the same slice of a larger draw."""
    full = cpp.gaussian_noise(10_000, key=KEY, step=2, offset=3)
    for a, b in [(0, 1), (1, 2), (127, 129), (128, 256), (1000, 4099), (9999, 10000), (5, 5)]:
        part = cpp.gaussian_noise(b - a, key=KEY, step=2, offset=3 + a)
        assert torch.equal(part, full[a:b]), (a, b)


def test_noise_large_indices_and_keys():
    for key, step, offset in [(2**64 - 1, 2**48 - 1, 2**63 - 2000), (0, 1, 2**33 + 1)]:
        got = cpp.gaussian_noise(1000, key=key, step=step, offset=offset)
        want = ref.gaussian_noise(1000, key=key, step=step, offset=offset)
        assert ((got - want).abs() <= torch.clamp(1e-6 * want.abs(), min=2e-6)).all()


# ---------------------------------------------------------------------------------------
# Thread-count invariance of every pass
# ---------------------------------------------------------------------------------------
SHAPES = [(2049,), (3, 1000), (), (4096,), (7, 11), (10_000,)]


@pytest.mark.parametrize("name", list(HYPERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_thread_invariance(threads, name, dtype):
    hyper = HYPERS[name]
    case = make_case(hyper.rule, SHAPES, 5, dtype=dtype)
    threads(1)
    want = run_step(cpp, hyper, case)
    for t in (2, 3):
        threads(t)
        assert_identical(run_step(cpp, hyper, case), want)


def test_pass1_and_accumulate_thread_invariance(threads):
    _, gs, clip, _, states, _, dp = make_case("macadam", SHAPES, 6)
    hyper = HYPERS["macadam"]
    results = []
    for t in (1, 2, 3):
        threads(t)
        bufs = [torch.ones(m.shape) for m in states["exp_avg"]]
        cpp.accumulate(hyper, dp, gs, clip, bufs, states)
        results.append(
            (
                cpp.per_sample_norms(gs, 6, "cpu"),
                cpp.whitened_norms(gs, states["exp_avg"], states["scale"], 0.19, 6, "cpu"),
                bufs,
            )
        )
    for r in results[1:]:
        assert torch.equal(r[0], results[0][0]) and torch.equal(r[1], results[0][1])
        assert all(torch.equal(a, b) for a, b in zip(r[2], results[0][2]))


def test_split_parameter_same_result():
    """Splitting a parameter in two (same noise offsets) changes nothing: no dependence on
    where tensors start relative to the block grid."""
    hyper = HYPERS["adamw"]
    params, gs, clip, _, states, _, dp = make_case("adamw", [(5000,)], 4)
    whole = run_step(cpp, hyper, (params, gs, clip, [None], states, [77], dp))
    cut = 1234

    def split(x, dim=0):
        return [x.narrow(dim, 0, cut).clone(), x.narrow(dim, cut, x.shape[dim] - cut).clone()]

    parts = (
        split(params[0]),
        split(gs[0], 1),
        clip,
        [None, None],
        {k: split(v[0]) for k, v in states.items()},
        [77, 77 + cut],
        dp,
    )
    got = run_step(cpp, hyper, parts)
    assert torch.equal(torch.cat(got[0]), whole[0][0])
    for k in states:
        assert torch.equal(torch.cat(got[1][k]), whole[1][k][0])


# ---------------------------------------------------------------------------------------
# Against the reference: many tensors, odd sizes, float64, non-contiguous inputs
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["adamw", "sgd", "macadam"])
def test_many_small_tensors(name):
    g = torch.Generator().manual_seed(1)
    shapes = [
        tuple(
            int(x)
            for x in torch.randint(
                1, 6, (int(torch.randint(0, 3, (1,), generator=g)),), generator=g
            )
        )
        for _ in range(200)
    ]
    hyper = WELL_CONDITIONED[name]
    case = make_case(hyper.rule, shapes, 3, seed=2)
    assert_close_to_reference(run_step(cpp, hyper, case), run_step(ref, hyper, case))


ODD = [(0,), (1,), (2047,), (2048,), (2049,), (127,), (129,), (4097,), (0, 3), (6145,)]


@pytest.mark.parametrize("name", list(HYPERS))
@pytest.mark.parametrize("first_offset", [0, 1, 2047])
def test_odd_sizes(name, first_offset):
    hyper = WELL_CONDITIONED[name]
    case = make_case(hyper.rule, ODD, 2, first_offset=first_offset, seed=first_offset)
    assert_close_to_reference(run_step(cpp, hyper, case), run_step(ref, hyper, case))


def test_float64_params_and_grad_samples():
    hyper = HYPERS["adamw"]
    case = make_case("adamw", [(33, 17), (100,)], 3, dtype=torch.float64)
    got, want = run_step(cpp, hyper, case), run_step(ref, hyper, case)
    assert all(p.dtype == torch.float64 for p in got[0])
    assert_close_to_reference(got, want)
    gs = case[1]
    torch.testing.assert_close(
        cpp.per_sample_norms(gs, 3, "cpu"), ref.per_sample_norms(gs, 3, "cpu")
    )


def test_non_contiguous_grad_samples_are_copied():
    hyper = HYPERS["adamw"]
    params, gs, clip, summed, states, offsets, dp = make_case("adamw", [(20, 30)], 4)
    strided = gs[0].transpose(1, 2).contiguous().transpose(1, 2)  # same values, other layout
    assert not strided.is_contiguous()
    a = run_step(cpp, hyper, (params, gs, clip, summed, states, offsets, dp))
    b = run_step(cpp, hyper, (params, [strided], clip, summed, states, offsets, dp))
    assert_identical(a, b)
    assert torch.equal(
        cpp.per_sample_norms([strided], 4, "cpu"), cpp.per_sample_norms(gs, 4, "cpu")
    )


def test_large_summed_step_matches_reference():
    hyper = HYPERS["adamw"]
    params, _, _, _, states, offsets, dp = make_case("adamw", [(300_001,)], 1)
    case = (params, [None], None, [torch.randn(300_001)], states, offsets, dp)
    assert_close_to_reference(run_step(cpp, hyper, case), run_step(ref, hyper, case))


# ---------------------------------------------------------------------------------------
# Bad buffers: a ValueError naming the tensor, and nothing written
# ---------------------------------------------------------------------------------------
def _bad_cases():
    def transpose_param(c):
        c[0][1] = c[0][1].t()  # (3, 1000) -> non-contiguous (1000, 3)
        c[1][1] = c[1][1].transpose(1, 2)
        for v in c[4].values():
            v[1] = v[1].t().contiguous()

    def f64_state(c):
        c[4]["exp_avg"][0] = c[4]["exp_avg"][0].double()

    def short_state(c):
        c[4]["exp_avg_sq"][3] = c[4]["exp_avg_sq"][3][:-1]

    def strided_state(c):
        c[4]["exp_avg"][3] = torch.randn(4096 * 2)[::2]

    def int_param(c):
        c[0][0] = c[0][0].to(torch.int32)

    def meta_param(c):
        c[0][5] = torch.empty(c[0][5].shape, device="meta")

    def wrong_batch(c):
        c[1][0] = c[1][0][:-1]

    def wrong_shape_grad(c):
        c[1][4] = torch.randn(5, 11, 7)

    def int_grad(c):
        c[1][0] = c[1][0].to(torch.int64)

    def f16_summed(c):
        c[3][1] = c[3][1].half()

    def aliased_state(c):
        c[4]["exp_avg_sq"][2] = c[4]["exp_avg"][2]

    def bad_offset(c):
        c[5][2] = -1

    def short_clip(c):
        c[2] = c[2][:-1]

    return {
        f.__name__: f
        for f in (
            transpose_param,
            f64_state,
            short_state,
            strided_state,
            int_param,
            meta_param,
            wrong_batch,
            wrong_shape_grad,
            int_grad,
            f16_summed,
            aliased_state,
            bad_offset,
            short_clip,
        )
    }


@pytest.mark.parametrize("bad", list(_bad_cases()))
def test_bad_buffers_rejected_before_any_write(bad):
    hyper = HYPERS["adamw"]
    case = [list(x) if isinstance(x, list) else x for x in make_case("adamw", SHAPES, 5)]
    case[4] = {k: list(v) for k, v in case[4].items()}
    _bad_cases()[bad](case)
    params, gs, clip, summed, states, offsets, dp = case
    before = ([p.clone() for p in params], {k: [s.clone() for s in v] for k, v in states.items()})
    with pytest.raises(ValueError) as info:
        cpp.step(hyper, dp, params, gs, clip, summed, states, offsets)
    assert str(info.value)  # a message that names the tensor
    for p, q in zip(params, before[0]):
        if p.device.type == "cpu":
            assert torch.equal(p, q) if p.dtype == q.dtype else True
    for k in states:
        for s, q in zip(states[k], before[1][k]):
            assert torch.equal(s, q)
    # and a later valid step works
    good = make_case("adamw", SHAPES, 5)
    run_step(cpp, hyper, good)


def test_bad_buffer_messages_name_the_tensor():
    hyper = HYPERS["adamw"]
    params, gs, clip, summed, states, offsets, dp = make_case("adamw", SHAPES, 5)
    states["exp_avg_sq"][3] = states["exp_avg_sq"][3][:-1]
    with pytest.raises(ValueError, match=r"states\['exp_avg_sq'\]\[3\].*shape"):
        cpp.step(hyper, dp, params, gs, clip, summed, states, offsets)
    params[1] = params[1].t()
    with pytest.raises(ValueError, match=r"params\[1\].*contiguous"):
        cpp.step(hyper, dp, params, gs, clip, summed, states, offsets)


def test_accumulate_and_scale_reject_bad_buffers():
    hyper = HYPERS["macadam"]
    _, gs, clip, _, states, _, dp = make_case("macadam", SHAPES, 5)
    bufs = [torch.zeros(m.shape) for m in states["exp_avg"]]
    bufs[2] = bufs[2].double()
    with pytest.raises(ValueError, match=r"buffers\[2\]"):
        cpp.accumulate(hyper, dp, gs, clip, bufs, states)
    scales = [s.clone() for s in states["scale"]]
    scales[0] = torch.ones(4096 * 2)[::2] if scales[0].numel() == 4096 else scales[0].t()
    scales[3] = torch.ones(8192)[::2]
    before = [s.clone() for s in scales]
    with pytest.raises(ValueError, match=r"scales\[3\]"):
        cpp.macadam_update_scale(hyper, dp, states["exp_var"], scales, 123.0)
    assert all(torch.equal(a, b) for a, b in zip(scales, before))


def test_no_write_when_numel_zero_and_empty_batch():
    hyper = HYPERS["adamw"]
    case = make_case("adamw", [(0,), (5,)], 0)
    assert_close_to_reference(run_step(cpp, hyper, case), run_step(ref, hyper, case))
    assert cpp.per_sample_norms(case[1], 0, "cpu").shape == (0,)


def test_unknown_rule_code_is_refused_not_run_as_macadam():
    """An update-rule code the extension does not know is a ValueError (its switch used to
    fall through to DP-MacAdam)."""
    from dpkern import _C

    code = max(_C.rule_codes().values()) + 1
    with pytest.raises(ValueError, match=f"unknown update rule code {code}"):
        _C.step({"rule": code, "lr": 0.1}, (1, 1, 0, 0.0, 1.0, 0.0, 1, False), [], 0, 0)
