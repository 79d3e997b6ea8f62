"""DP-RMSprop (SPEC 10.1): torch.optim.RMSprop's twin on every backend, the noise bias
correction (phi's recursion under a noise schedule, the floored denominator, the unbiased
second moment it claims), checkpoints and validation."""

from __future__ import annotations

import copy

import pytest
import torch

import dpkern
from dpkern import rules
from dpkern import functional as F
from dpkern.hyper import RMSpropHyper

from test_reference_spec import build, compare, make_grads, set_grad_samples
from twin import fresh_seed, need_backend, twin_run

SHAPES = [(7,), (5, 3), (3, 4, 5)]
# torch.optim.RMSprop's options, each on its own and together (plus the correction with
# sigma = 0, where phi = 0 and the denominator is torch's wherever v > gamma)
TWIN_OPTIONS = {
    "defaults": {},
    "alpha_eps": dict(alpha=0.9, eps=1e-6),
    "weight_decay": dict(weight_decay=0.1),
    "momentum": dict(momentum=0.9),
    "centered": dict(centered=True),
    "all": dict(alpha=0.95, eps=1e-7, weight_decay=0.05, momentum=0.7, centered=True),
    # gamma far below the smallest v (1 - alpha) g^2 of a non-zero g: the floor is not hit
    "bc_sigma0": dict(noise_bias_correction=True, gamma=1e-30, momentum=0.5, weight_decay=0.01),
}


def _twin_run(backend, options, shapes=SHAPES, steps=5, B=6):
    """DPRMSprop (sigma = 0, C huge) and torch.optim.RMSprop on the mean gradient, every
    state torch keeps (the DP optimizer keeps the same ones, and phi)."""
    # the momentum buffer sums terms g / (sqrt(v) + eps) of order 1/sqrt(1 - alpha) that
    # cancel: float32 rounding of those terms (~1e-6) is absolute there. Each term also
    # carries the relative rounding of the mean gradient g, unbounded where the B samples'
    # sum cancels (g ~ 3e-3 from O(1) samples: 1.9e-5 off, seed 3591406495, cpp): the
    # samples get a shared +-2 shift, which keeps |g| away from 0 (offset, twin.feed)
    twin_run(dpkern.DPRMSprop, torch.optim.RMSprop, options, backend, shapes=shapes,
             steps=steps, B=B, lrs=(0.01, 0.003), split=len(shapes) // 2 + 1,
             state_atol={"momentum_buffer": 1e-5}, check_step=True, offset=2.0)  # fmt: skip


@pytest.mark.parametrize("options", list(TWIN_OPTIONS.values()), ids=list(TWIN_OPTIONS))
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_torch_optim_twin(backend, options):
    _twin_run(backend, options)


@pytest.mark.triton
@pytest.mark.parametrize("options", [TWIN_OPTIONS["all"], TWIN_OPTIONS["bc_sigma0"]])
def test_torch_optim_twin_triton(options):
    _twin_run("triton", options, shapes=[(7,), (3, 5)], steps=2, B=3)


def test_states_are_allocated_only_where_used():
    for options, names in [
        ({}, {"square_avg"}),
        (dict(momentum=0.9), {"square_avg", "momentum_buffer"}),
        (dict(centered=True), {"square_avg", "grad_avg"}),
        (dict(noise_bias_correction=True), {"square_avg", "noise_var_avg"}),
    ]:
        p = torch.nn.Parameter(torch.randn(4))
        opt = dpkern.DPRMSprop(
            [p], **options, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2
        )
        p.grad_sample = torch.randn(2, 4)
        opt.step()
        assert set(opt.state[p]) == names | {"step"}, options
        assert all(v.dtype == torch.float32 for v in opt.state[p].values())


# ---------------------------------------------------------------------------------------
# The noise bias correction
# ---------------------------------------------------------------------------------------
SCHEDULE = [(1.0, 1.0, 4.0), (2.5, 0.5, 3.0), (0.5, 2.0, 6.0), (0.0, 1.0, 4.0), (1.5, 1.0, 5.0)]


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_phi_recursion_follows_a_noise_schedule(backend):
    """phi_t = alpha phi_{t-1} + (1 - alpha) (sigma_t C_t / B_e,t)^2, by hand, per group
    alpha; a parameter group added later starts its own phi at its first step."""
    need_backend(backend)
    ps = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3, 2))]
    late = torch.nn.Parameter(torch.randn(4))
    alphas = (0.8, 0.95)
    opt = dpkern.DPRMSprop(
        [dict(params=ps[:1], alpha=alphas[0]), dict(params=ps[1:], alpha=alphas[1])],
        lr=1e-3,
        noise_bias_correction=True,
        gamma=1e-3,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        seed=fresh_seed(),
        backend=backend,
    )
    phi, phi_late = [0.0, 0.0], 0.0
    for t, (sigma, C, B_e) in enumerate(SCHEDULE, start=1):
        if t == 3:
            opt.add_param_group(dict(params=[late], alpha=0.5))
        opt.noise_multiplier, opt.max_grad_norm, opt.expected_batch_size = sigma, C, B_e
        Phi = (sigma * C / B_e) ** 2
        for p in [*ps, late][: 3 if t >= 3 else 2]:
            p.grad_sample = torch.randn(3, *p.shape)
        opt.step()
        for i, alpha in enumerate(alphas):
            phi[i] = alpha * phi[i] + (1 - alpha) * Phi
            assert float(opt.state[ps[i]]["noise_var_avg"]) == pytest.approx(phi[i], rel=1e-6)
        if t >= 3:
            phi_late = 0.5 * phi_late + 0.5 * Phi
            assert float(opt.state[late]["noise_var_avg"]) == pytest.approx(phi_late, rel=1e-6)
            assert float(opt.state[late]["step"]) == t - 2


@pytest.mark.parametrize("config", ["rmsprop_bc", "rmsprop_wd_momentum"])
def test_noise_schedule_matches_the_spec_model(config):
    seed = fresh_seed()
    opt, model, trainable, nogs, gen = build(config, torch.float32, 1.0, seed)
    for t, (sigma, C, B_e) in enumerate(SCHEDULE, start=1):
        opt.noise_multiplier, opt.max_grad_norm, opt.expected_batch_size = sigma, C, B_e
        model.set_privacy(noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=B_e)
        grads = make_grads(trainable, nogs, 3, gen, torch.float32)
        set_grad_samples(trainable, grads)
        opt.step()
        model.step(grads)
        compare(opt, model, trainable, torch.float32, f"{config} seed={seed} t={t}")


def _floored_case(backend, momentum):
    """One functional step with sigma = 0 and a given phi_t: some coordinates have
    v_t - phi_t < gamma (floored), the others not."""
    dev = need_backend(backend)
    gen = torch.Generator().manual_seed(fresh_seed())
    h = RMSpropHyper(lr=0.1, alpha=0.9, momentum=momentum, noise_bias_correction=True, gamma=0.05)
    phi = 0.3
    p = torch.randn(257, generator=gen)
    gs = torch.randn((4, 257), generator=gen)
    v0 = torch.rand(257, generator=gen) * 0.6  # v_t - phi on both sides of gamma
    buf0 = torch.randn(257, generator=gen)
    g = gs.mean(0)
    v = 0.9 * v0 + 0.1 * g * g
    d = v - phi
    avg = torch.sqrt(torch.where(d < h.gamma, torch.full_like(d, h.gamma), d)) + h.eps
    if momentum:
        want = p - h.lr * (momentum * buf0 + g / avg)
    else:
        want = p - h.lr * g / avg
    params = [p.clone().to(dev)]
    states = {
        "square_avg": [v0.clone().to(dev)],
        "momentum_buffer": [buf0.clone().to(dev) if momentum else None],
        "grad_avg": [None],
    }
    F.dp_step(
        h,
        params,
        [gs.to(dev)],
        states,
        step=4,
        key=1,
        max_grad_norm=1e6,
        noise_multiplier=0.0,
        expected_batch_size=4.0,
        noise_var_avg=phi,
        backend=backend,
    )
    assert bool((d < h.gamma).any()) and bool((d > h.gamma).any())
    torch.testing.assert_close(params[0].cpu(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(states["square_avg"][0].cpu(), v, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("momentum", [0.0, 0.8])
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_corrected_denominator_is_floored_at_gamma(backend, momentum):
    _floored_case(backend, momentum)


@pytest.mark.triton
def test_corrected_denominator_is_floored_at_gamma_triton():
    _floored_case("triton", 0.8)


def test_corrected_second_moment_is_unbiased_under_a_noise_schedule():
    """The claim of SPEC 10.1: E[v_t] = v°_t + phi_t (v° the noiseless EMA along the run).
    With lr = 0 the gradients are fixed, v°_t is the sigma = 0 run's v, and over d
    coordinates mean(v_t - phi_t) is within a few standard errors of mean(v°_t), while
    mean(v_t) overshoots by phi_t (a constant subtraction would miss the schedule)."""
    d, B, alpha, T = 8000, 4, 0.9, 12
    gen = torch.Generator().manual_seed(fresh_seed())
    g_fixed = torch.randn(d, generator=gen) * 0.3
    sigmas = [3.0 if t % 3 else 0.5 for t in range(T)]  # the noise changes between steps

    def run(sigma_scale):
        p = torch.nn.Parameter(torch.zeros(d))
        opt = dpkern.DPRMSprop(
            [p],
            lr=0.0,
            alpha=alpha,
            noise_bias_correction=True,
            max_grad_norm=1e6,
            noise_multiplier=0.0,
            expected_batch_size=B,
            seed=fresh_seed(),
            backend="torch",
        )
        for sigma in sigmas:
            opt.noise_multiplier = sigma_scale * sigma / 1e6 * B  # sigma C / B_e = sigma
            p.grad_sample = g_fixed.expand(B, d).clone()
            opt.step()
        return opt.state[p]["square_avg"].double(), float(opt.state[p]["noise_var_avg"])

    v_clean, phi_clean = run(0.0)
    v_noisy, phi = run(1.0)
    assert phi_clean == 0.0
    want_phi = 0.0
    for sigma in sigmas:
        want_phi = alpha * want_phi + (1 - alpha) * sigma**2
    assert phi == pytest.approx(want_phi, rel=1e-6)
    # per-coordinate variance of v_t - v°_t: sum_s w_s^2 (4 g^2 Phi_s + 2 Phi_s^2)
    w = [(1 - alpha) * alpha ** (T - 1 - s) for s in range(T)]
    var = sum(
        wi**2 * (4 * g_fixed.double().square().mean() * s**2 + 2 * s**4) for wi, s in zip(w, sigmas)
    )
    stderr = float(var.sqrt()) / d**0.5
    bias_corrected = float((v_noisy - phi - v_clean).mean())
    bias_raw = float((v_noisy - v_clean).mean())
    assert abs(bias_corrected) < 5 * stderr, (bias_corrected, stderr)
    assert bias_raw == pytest.approx(want_phi, abs=5 * stderr)
    assert want_phi > 50 * stderr  # the test can tell the two apart


# ---------------------------------------------------------------------------------------
# Checkpoints, validation, the registry
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options",
    [dict(momentum=0.9, centered=True, weight_decay=0.01), dict(noise_bias_correction=True)],
    ids=["momentum_centered", "bc"],
)
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_state_dict_round_trip(backend, options):
    """Saved after 2 steps and loaded into a fresh optimizer, the next step equals the
    uninterrupted run's (seeded mode: the same noise)."""
    need_backend(backend)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn((3, *s), generator=gen) for s in SHAPES] for _ in range(3)]
    kw = dict(
        lr=0.01,
        **options,
        max_grad_norm=1.0,
        noise_multiplier=0.7,
        expected_batch_size=3.0,
        seed=seed,
        backend=backend,
    )

    def steps(opt, params, batches):
        for batch in batches:
            for p, g in zip(params, batch):
                p.grad_sample = g.clone()
            opt.step()

    a = [torch.nn.Parameter(x.clone()) for x in init]
    opt_a = dpkern.DPRMSprop(a, **kw)
    steps(opt_a, a, grads[:2])
    sd = copy.deepcopy(opt_a.state_dict())
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = dpkern.DPRMSprop(b, **{**kw, "seed": seed ^ 1})
    opt_b.load_state_dict(sd)
    steps(opt_a, a, grads[2:])
    steps(opt_b, b, grads[2:])
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for name, val in opt_a.state[p].items():
            assert torch.equal(val, opt_b.state[q][name]), name


BAD = [
    ("lr", -0.1),
    ("alpha", 1.0),
    ("alpha", -0.1),
    ("eps", 0.0),
    ("weight_decay", -1.0),
    ("momentum", -0.5),
    ("gamma", 0.0),
    ("centered", 1),
    ("noise_bias_correction", "yes"),
]


@pytest.mark.parametrize("name,value", BAD)
def test_invalid_hyper_parameters_are_value_errors(name, value):
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=name):
        dpkern.DPRMSprop(
            [p], **{name: value}, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2
        )


def test_centered_with_the_correction_is_refused():
    """No exact correction of the centred moment exists (SPEC 10.1): refused at
    construction, in an added group, and in a group changed before a step (nothing
    changes)."""
    kw = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2, seed=3)
    p, q = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    with pytest.raises(ValueError, match="centered=True with noise_bias_correction=True"):
        dpkern.DPRMSprop([p], centered=True, noise_bias_correction=True, **kw)
    opt = dpkern.DPRMSprop([p], noise_bias_correction=True, **kw)
    with pytest.raises(ValueError, match="centered"):
        opt.add_param_group(dict(params=[q], centered=True))
    assert len(opt.param_groups) == 1
    p.grad_sample = torch.randn(2, 3)
    opt.step()
    before = (p.detach().clone(), copy.deepcopy(opt.state_dict()["state"]))
    opt.param_groups[0]["centered"] = True
    p.grad_sample = torch.randn(2, 3)
    with pytest.raises(ValueError, match="centered"):
        opt.step()
    assert torch.equal(p, before[0]) and opt.dp_step == 1
    for name, val in before[1][0].items():
        assert torch.equal(opt.state_dict()["state"][0][name], val)
    opt.param_groups[0]["centered"] = False
    assert p.grad_sample is None  # the failed step consumed it (SPEC 9)
    p.grad_sample = torch.randn(2, 3)
    opt.step()
    assert opt.dp_step == 2


def test_registry_entry():
    spec = rules.get("rmsprop")
    assert spec.cli_name == "dp-rmsprop" and spec.optimizer_class() is dpkern.DPRMSprop
    assert dpkern.optim.DPRMSprop is dpkern.DPRMSprop and "DPRMSprop" in dpkern.__all__
    assert spec.section == "10.1" and len(spec.lr_grid) == 4
    assert spec.fsdp  # element-wise states and a per-parameter phi: FSDP2 can shard it
    assert spec.corrects(RMSpropHyper(lr=1.0, noise_bias_correction=True))
    assert not spec.corrects(RMSpropHyper(lr=1.0))
    assert spec.kernel_state_names == ("square_avg", "momentum_buffer", "grad_avg")
