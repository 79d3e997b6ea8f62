"""Stochastic rounding of bfloat16 parameters (SPEC 3.2): the rounding stream against an
independent Philox, the rounding rule (special values, unbiasedness), the option through
every backend (the same bf16 bits for the same float32 result, fp32 / fp16 untouched, off
= round to nearest even), and the optimizers' option (validation, state_dict).

The Triton column (``-m triton``) runs under TRITON_INTERPRET=1 or on a CUDA machine."""

from __future__ import annotations

import copy
import dataclasses
import math
import struct

import pytest
import torch

import dpkern
from dpkern import functional as F
from dpkern import rules
from dpkern.backends import resolve
from dpkern.backends import reference as ref
from dpkern.hyper import (
    ROUNDING_STREAM,
    AdafactorHyper,
    AdamWHyper,
    DPStep,
    LionHyper,
    SGDHyper,
)

from conftest import (
    backend_device,
    backend_params,
    case_seed,
    random_states,
    require_backend,
    run_step,
)

KEY = 0xDEADBEEF12345678
M32 = 0xFFFFFFFF


@pytest.fixture(params=backend_params(("torch", "cpp", "triton")))
def backend(request):
    """Every backend, the reference included (the fused ones skipped when unavailable)."""
    return require_backend(request.param)


def _module(name):
    return resolve(name, backend_device(name))


# ---------------------------------------------------------------------------------------
# An independent Philox-4x32-10 on Python ints (Salmon et al. 2011), and SPEC 3.2 in ints
# ---------------------------------------------------------------------------------------
def philox(c: tuple[int, int, int, int], key: int) -> tuple[int, int, int, int]:
    c0, c1, c2, c3 = c
    k0, k1 = key & M32, key >> 32
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


def rho_of(key: int, step: int, j: int) -> int:
    """SPEC 3.2's rounding bits of element j at step t, from the text."""
    k = j >> 1
    counter = (k & M32, k >> 32, step & M32, (ROUNDING_STREAM << 16) | ((step >> 32) & 0xFFFF))
    r = philox(counter, key)
    return (r[0] if j % 2 == 0 else r[2]) >> 16


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bf16_sr_bits(x: float, rho: int) -> int:
    """SPEC 3.2 on a (non-NaN) float32 value: (bits(x) + rho) >> 16."""
    return (f32_bits(x) + rho) >> 16


def bf16_bits(t: torch.Tensor) -> list[int]:
    return [v & 0xFFFF for v in t.cpu().view(torch.int16).reshape(-1).tolist()]


def test_independent_philox_known_answer():
    assert philox((0, 0, 0, 0), 0) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    # and the reference's tensor version agrees on a random counter
    c = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)
    got = ref.philox4x32_10(*(torch.tensor([w]) for w in c), 0xA4093822299F31D0)
    assert tuple(int(w) for w in got) == philox(c, 0xA4093822299F31D0)


@pytest.mark.parametrize(
    "key,step,offset,numel",
    [(KEY, 1, 0, 9), (0, 7, 1, 8), (2**64 - 1, 2**33 + 5, 2**32 - 3, 7), (5, 2, 2**40 + 1, 5)],
)
def test_rounding_bits_match_independent_philox(backend, key, step, offset, numel):
    be = _module(backend)
    got = be.rounding_bits(numel, key=key, step=step, offset=offset, device=backend_device(backend))
    assert got.dtype == torch.int64 and got.shape == (numel,)
    assert got.cpu().tolist() == [rho_of(key, step, offset + i) for i in range(numel)]


def test_rounding_stream_is_not_the_noise_stream():
    index = torch.arange(0, 64)
    words0 = ref.philox_words(index, key=KEY, step=3, stream=0)
    words2 = ref.philox_words(index, key=KEY, step=3, stream=ROUNDING_STREAM)
    assert not torch.equal(words0, words2)
    rho = ref.rounding_bits(64, key=KEY, step=3)
    assert torch.equal(rho, torch.where(index % 2 == 0, words2[:, 0], words2[:, 2]) >> 16)


# ---------------------------------------------------------------------------------------
# The rounding rule
# ---------------------------------------------------------------------------------------
BF16_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7F0000))[0]
SPECIALS = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    1.0 + 2**-9,
    -(1.0 + 2**-9),
    math.inf,
    -math.inf,
    BF16_MAX,
    -BF16_MAX,
    struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0],  # float32 max: may become inf
    struct.unpack("<f", struct.pack("<I", 0xFF7F8000))[0],
    1e-40,  # subnormal
    -1e-42,
    2**-133,
    struct.unpack("<f", struct.pack("<I", 0x007FFFFF))[0],  # largest subnormal
    3.14159,
    -2.71828e-20,
    6.0e37,
]


@pytest.mark.parametrize("offset", [0, 3, 2**32 - 1])
def test_special_values_bit_exact(backend, offset):
    dev = backend_device(backend)
    be = _module(backend)
    reps = 40  # each value at several elements: several rounding bits
    vals = [v for v in SPECIALS for _ in range(reps)] + [math.nan, -math.nan]
    x = torch.tensor(vals, dtype=torch.float32)
    out = be.stochastic_round_bf16(x.to(dev), key=KEY, step=11, offset=offset)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    bits = bf16_bits(out)
    for i, v in enumerate(vals):
        if math.isnan(v):
            assert math.isnan(float(out[i])) and bits[i] & 0x0040, "a quiet NaN"
            continue
        want = bf16_sr_bits(v, rho_of(KEY, 11, offset + i))
        assert bits[i] == want, (v, i)
        r = float(out[i])
        if math.isinf(v):
            assert r == v
        elif abs(v) <= BF16_MAX:
            assert math.isfinite(r)  # only beyond the largest bf16 may round to inf
        if float(torch.tensor(v).to(torch.bfloat16)) == v:
            assert r == v and math.copysign(1, r) == math.copysign(1, v)  # exact stays
    # float32 max rounds up to inf for some elements and down to BF16_MAX for others
    fmax = [float(out[i]) for i, v in enumerate(vals) if v == SPECIALS[10]]
    assert set(fmax) <= {BF16_MAX, math.inf}


@pytest.mark.parametrize("frac", [1 / 65536, 0.25, 0.5, 0.7, 65535 / 65536])
@pytest.mark.parametrize("base", [1.0, -3.0, 2**-130])  # normal, negative, subnormal
def test_rounds_up_with_probability_equal_to_fractional_position(backend, frac, base):
    """x between two bf16 neighbours lo < hi (in magnitude) rounds to hi with probability
    (x - lo) / (hi - lo): the count of 'up' over n elements is Binomial(n, frac)."""
    dev = backend_device(backend)
    be = _module(backend)
    lo_bits = f32_bits(base) & 0xFFFF0000
    x_bits = lo_bits + int(round(frac * 65536))
    x = struct.unpack("<f", struct.pack("<I", x_bits))[0]
    n = 20000
    out = be.stochastic_round_bf16(torch.full((n,), x, device=dev), key=KEY, step=5, offset=17)
    up = sum(b == (lo_bits >> 16) + 1 for b in bf16_bits(out))
    down = sum(b == lo_bits >> 16 for b in bf16_bits(out))
    assert up + down == n
    p = (x_bits - lo_bits) / 65536
    sd = math.sqrt(n * p * (1 - p))
    assert abs(up - n * p) <= 5 * sd + 1, (up, n * p)


def test_mean_over_steps_is_x():
    """Rounding a fixed x at many steps (one element): the mean is x, within the binomial
    tolerance; round to nearest would be biased by the whole distance to the nearest."""
    for x in [1.0 + 2**-11, -(1.0 + 3 * 2**-12), 0.1, 7.3e-39]:
        xt = torch.tensor([x])
        lo = float(xt.to(torch.bfloat16))
        n = 3000
        vals = torch.stack(
            [ref.stochastic_round_bf16(xt, key=KEY, step=t, offset=12345) for t in range(1, n + 1)]
        ).double()
        lo_mag = struct.unpack("<f", struct.pack("<I", f32_bits(abs(x)) & 0xFFFF0000))[0]
        hi_mag = struct.unpack("<f", struct.pack("<I", (f32_bits(abs(x)) & 0xFFFF0000) + 0x10000))[
            0
        ]
        ulp = hi_mag - lo_mag
        p = (abs(x) - lo_mag) / ulp
        tol = 5 * ulp * math.sqrt(p * (1 - p) / n)
        assert abs(float(vals.mean()) - x) <= tol, (x, float(vals.mean()), lo)
        assert set(vals.abs().flatten().tolist()) <= {lo_mag, hi_mag}


# ---------------------------------------------------------------------------------------
# The option through the backends' step
# ---------------------------------------------------------------------------------------
SHAPES = [(), (1,), (7,), (3, 5), (33, 17), (1031,), (4, 16)]
HYPERS = {
    "adamw": AdamWHyper(lr=1e-3, weight_decay=0.1),
    "sgd": SGDHyper(lr=3e-3, momentum=0.9, weight_decay=0.01),
    "lion": LionHyper(lr=1e-3, weight_decay=0.1),
    "adafactor": AdafactorHyper(lr=1e-2, weight_decay=0.1, d=1.2),
}


def _case(rule, B, dtype, seed, *, noise_std=0.7, t=3, sr=True, device="cpu"):
    g = torch.Generator().manual_seed(case_seed(seed))
    rnd = lambda *s: torch.randn(s, generator=g)
    # bf16 values (so that fp32 copies hold the same numbers), any storage dtype
    params = [rnd(*s).to(torch.bfloat16).to(dtype).to(device) for s in SHAPES]
    grad_samples = [None if k == 2 else (3 * rnd(B, *s)).to(device) for k, s in enumerate(SHAPES)]
    clip = (torch.rand(B, generator=g) + 0.1).to(device)
    summed = [(rnd(*s).to(device) if k % 2 else None) for k, s in enumerate(SHAPES)]
    states = {n: [x.to(device) for x in v] for n, v in random_states(rule, SHAPES, rnd).items()}
    offsets, off = [], 2**32 - 40 + 1  # odd, and crossing 2**32
    for s in SHAPES:
        offsets.append(off)
        off += int(torch.Size(s).numel())
    dp = DPStep(
        key=KEY,
        step=t,
        noise_step=t + 4,
        noise_std=noise_std,
        expected_batch_size=6.0,
        noise_var_avg=0.05,
        stochastic_rounding=sr,
    )
    return params, grad_samples, clip, summed, states, offsets, dp


def _with(case, *, dtype=None, sr=None):
    params, gs, clip, summed, states, offsets, dp = copy.deepcopy(case)
    if dtype is not None:
        params = [p.to(dtype) for p in params]
    if sr is not None:
        dp = dataclasses.replace(dp, stochastic_rounding=sr)
    return params, gs, clip, summed, states, offsets, dp


def _expected_sr(x32: list[torch.Tensor], offsets, dp) -> list[torch.Tensor]:
    return [
        ref.stochastic_round_bf16(x.cpu(), key=dp.key, step=dp.noise_step, offset=off)
        for x, off in zip(x32, offsets, strict=True)
    ]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal bf16 bits, or both NaN."""
    a, b = a.cpu(), b.cpu()
    return (a.view(torch.int16) == b.view(torch.int16)) | (a.isnan() & b.isnan())


@pytest.mark.parametrize("rule", list(HYPERS))
@pytest.mark.parametrize("B", [0, 1, 3])
def test_step_rounds_its_float32_result_by_the_spec(backend, rule, B):
    """Each backend's bf16 result with the option is SPEC 3.2 applied to that backend's own
    float32 result (the same step on float32 copies of the parameters), with the rounding
    bits of the global element index at the noise step; the states are those of the
    round-to-nearest step."""
    be = _module(backend)
    dev = backend_device(backend)
    hyper = HYPERS[rule]
    case = _case(rule, B, torch.bfloat16, 100 + B, device=dev)
    x32, st32, _ = run_step(be, hyper, _with(case, dtype=torch.float32))
    sr, st_sr, _ = run_step(be, hyper, case)
    rne, st_rne, _ = run_step(be, hyper, _with(case, sr=False))
    for k, (got, want) in enumerate(zip(sr, _expected_sr(x32, case[5], case[6]), strict=True)):
        assert got.dtype == torch.bfloat16
        assert bool(_same_bits(got, want).all()), (rule, k)
    for k, (got, x) in enumerate(zip(rne, x32, strict=True)):  # off: round to nearest even
        assert bool(_same_bits(got, x.to(torch.bfloat16)).all()), (rule, k)
    for name in st_sr:
        for a, b in zip(st_sr[name], st_rne[name], strict=True):
            assert a is None and b is None or torch.equal(a, b)
    # the option makes a difference on some elements (and most results are not exact in bf16)
    assert any(not bool(_same_bits(a, b).all()) for a, b in zip(sr, rne, strict=True))


@pytest.mark.parametrize("rule", ["adamw", "sgd", "adafactor"])
@pytest.mark.parametrize("B", [0, 1])
def test_backends_agree_bit_for_bit(fused_backend, rule, B):
    """The rounding bits are integers: wherever a backend's float32 result is the
    reference's (all but a rare ulp, from the noise's transcendentals, DP-Adafactor's
    float64 sums or a scalar's rounding), its stochastically rounded bf16 bits are too."""
    be = _module(fused_backend)
    dev = backend_device(fused_backend)
    hyper = HYPERS[rule]
    for noise_std in (0.0, 0.7):
        case = _case(rule, B, torch.bfloat16, 200 + B, noise_std=noise_std)
        dcase = _case(rule, B, torch.bfloat16, 200 + B, noise_std=noise_std, device=dev)
        want, _, _ = run_step(ref, hyper, case)
        got, _, _ = run_step(be, hyper, dcase)
        x_ref, _, _ = run_step(ref, hyper, _with(case, dtype=torch.float32))
        x_be, _, _ = run_step(be, hyper, _with(dcase, dtype=torch.float32))
        n = n_same = n_same_x = 0
        for k in range(len(SHAPES)):
            same_x = x_ref[k].view(torch.int32) == x_be[k].cpu().view(torch.int32)
            same = _same_bits(got[k], want[k])
            assert bool(same[same_x].all()), (rule, k)
            n_same += int(same.sum())
            n_same_x += int(same_x.sum())
            n += same.numel()
        # the float32 results differ by an ulp at most (SPEC 6: 1e-5), which moves a
        # stochastically rounded value with probability ~ 2**-16 per ulp
        assert n_same_x >= 0.5 * n and n_same >= 0.99 * n, (n_same_x, n_same, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp32_and_fp16_parameters_are_unaffected(backend, dtype):
    be = _module(backend)
    dev = backend_device(backend)
    for rule in ("adamw", "adafactor"):
        case = _case(rule, 2, dtype, 300, device=dev)
        on, st_on, _ = run_step(be, HYPERS[rule], case)
        off, st_off, _ = run_step(be, HYPERS[rule], _with(case, sr=False))
        for a, b in zip(on, off, strict=True):
            assert a.dtype == dtype and torch.equal(a, b)


def test_nonfinite_parameters(backend):
    """inf stays inf and NaN stays NaN through a step with the option."""
    be = _module(backend)
    dev = backend_device(backend)
    case = _case("sgd", 1, torch.bfloat16, 400, device=dev)
    case[0][5].view(-1)[:4] = torch.tensor([math.inf, -math.inf, math.nan, 1.0])
    out, _, _ = run_step(be, SGDHyper(lr=1e-3), case)  # inf - lr g = inf (no decay)
    p = out[5].float().cpu()
    assert p[0] == math.inf and p[1] == -math.inf and math.isnan(p[2]) and math.isfinite(p[3])


def test_triton_result_independent_of_block_size():
    """The bits of an element do not depend on the tile it falls in (odd offsets: the
    shifted tiles; element counts that are multiples of 16: the aligned launch group)."""
    require_backend("triton")
    from dpkern.backends import triton as tr

    dev = backend_device("triton")
    hyper = HYPERS["adamw"]
    case = _case("adamw", 2, torch.bfloat16, 500, device=dev)
    default, _, _ = run_step(tr, hyper, case)
    with tr.configure(step_block=16, max_tensors_per_launch=2):
        small, _, _ = run_step(tr, hyper, case)
    for a, b in zip(default, small, strict=True):
        assert bool(_same_bits(a, b).all())


test_triton_result_independent_of_block_size = pytest.mark.triton(
    test_triton_result_independent_of_block_size
)


# ---------------------------------------------------------------------------------------
# What the option buys: updates below half an ulp survive on average
# ---------------------------------------------------------------------------------------
def test_sub_ulp_updates_accumulate_on_average(backend):
    """p = 1 (bf16 ulp 2**-7), a constant update of 0.1 ulp per step, no noise: round to
    nearest never moves p; stochastic rounding moves it by 0.1 ulp per step on average."""
    dev = backend_device(backend)
    n, steps, g = 4096, 60, 1.0
    lr = 0.1 * 2**-7
    outs = {}
    for sr in (False, True):
        p = torch.ones(n, dtype=torch.bfloat16, device=dev)
        for t in range(1, steps + 1):
            F.dp_step(
                SGDHyper(lr=lr),
                [p],
                None,
                {"momentum_buffer": [None]},
                summed_grads=[torch.full((n,), g, device=dev)],
                step=t,
                key=KEY,
                max_grad_norm=1.0,
                noise_multiplier=0.0,
                expected_batch_size=1.0,
                backend=backend,
                stochastic_rounding=sr,
            )
        outs[sr] = p.float().cpu()
    assert torch.equal(outs[False], torch.ones(n))
    drift = float(1.0 - outs[True].mean())
    want = steps * lr
    assert abs(drift - want) <= 0.05 * want, (drift, want)


# ---------------------------------------------------------------------------------------
# The optimizers' option
# ---------------------------------------------------------------------------------------
def _opt(cls, params, **kw):
    if not cls.rule.whitening:  # DP-MacAdam has no max_grad_norm (its bound is 1)
        kw["max_grad_norm"] = 1.0
    return cls(params, noise_multiplier=1.0, expected_batch_size=4.0, **kw)


@pytest.mark.parametrize("rule", list(rules.RULES))
def test_every_optimizer_takes_the_option(rule):
    import inspect

    cls = getattr(dpkern, rules.get(rule).optimizer)
    param = inspect.signature(cls.__init__).parameters["stochastic_rounding"]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is False
    p = torch.nn.Parameter(torch.randn(3, 4).to(torch.bfloat16))
    opt = _opt(cls, [p], seed=1, stochastic_rounding=True)
    assert opt.stochastic_rounding is True
    if hasattr(opt, "train"):  # schedule-free: steps run in train mode
        opt.train()
    p.grad_sample = torch.randn(2, 3, 4)
    opt.step()
    with pytest.raises(ValueError, match="stochastic_rounding"):
        _opt(cls, [torch.nn.Parameter(torch.randn(2))], stochastic_rounding=1)


def test_optimizer_step_matches_functional_reference_with_the_option():
    p = torch.nn.Parameter(torch.randn(9, 5).to(torch.bfloat16))
    q = p.detach().clone()
    opt = _opt(dpkern.DPAdamW, [p], lr=1e-3, seed=7, backend="torch", stochastic_rounding=True)
    gs = torch.randn(3, 9, 5)
    p.grad_sample = gs.clone()
    opt.step()
    m, v = torch.zeros(9, 5), torch.zeros(9, 5)
    F.dp_adamw(
        [q],
        [gs],
        [m],
        [v],
        step=1,
        key=7,
        lr=1e-3,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        backend="torch",
        stochastic_rounding=True,
    )
    assert torch.equal(p.detach().view(torch.int16), q.view(torch.int16))


def test_state_dict_round_trip_of_the_option():
    p = torch.nn.Parameter(torch.randn(4).to(torch.bfloat16))
    a = _opt(dpkern.DPSGD, [p], seed=2, stochastic_rounding=True)
    p.grad_sample = torch.randn(2, 4)
    a.step()
    sd = a.state_dict()
    assert sd["dp"]["stochastic_rounding"] is True
    b = _opt(
        dpkern.DPSGD, [torch.nn.Parameter(p.detach().clone())], seed=2, stochastic_rounding=True
    )
    b.load_state_dict(sd)
    assert b.stochastic_rounding is True and b.state_dict() == b.state_dict()
    assert b.state_dict()["dp"] == sd["dp"]
    c = _opt(dpkern.DPSGD, [torch.nn.Parameter(p.detach().clone())], seed=2)
    c.load_state_dict(sd)  # the constructor's option is kept, as the privacy arguments
    assert c.stochastic_rounding is False and c.state_dict()["dp"]["stochastic_rounding"] is False
    old = copy.deepcopy(sd)
    del old["dp"]["stochastic_rounding"]  # a checkpoint written before the option
    c.load_state_dict(old)
    bad = copy.deepcopy(sd)
    bad["dp"]["stochastic_rounding"] = "yes"
    with pytest.raises(ValueError, match="stochastic_rounding"):
        c.load_state_dict(bad)
    d = copy.deepcopy(a)  # reproducible mode pickles: the option travels
    assert d.stochastic_rounding is True
    assert "stochastic_rounding: True" in repr(a)


def test_option_can_change_between_steps_and_is_validated():
    p = torch.nn.Parameter(torch.randn(4).to(torch.bfloat16))
    opt = _opt(dpkern.DPSGD, [p], seed=2)
    opt.stochastic_rounding = True
    with pytest.raises(ValueError, match="stochastic_rounding"):
        opt.stochastic_rounding = "on"
    assert opt.stochastic_rounding is True


def test_dpstep_validation():
    with pytest.raises(ValueError, match="stochastic_rounding"):
        DPStep(key=1, step=1, noise_std=0.0, expected_batch_size=1.0, stochastic_rounding=1)
    with pytest.raises(ValueError, match="rounding stream"):
        DPStep(
            key=1,
            step=1,
            noise_std=0.0,
            expected_batch_size=1.0,
            stream=ROUNDING_STREAM,
            stochastic_rounding=True,
        )
    with pytest.raises(ValueError, match="stochastic_rounding"):
        F.dp_sgd(
            [torch.zeros(2)],
            [torch.zeros(1, 2)],
            None,
            step=1,
            key=1,
            lr=0.1,
            max_grad_norm=1.0,
            noise_multiplier=0.0,
            expected_batch_size=1.0,
            stochastic_rounding="yes",
        )
