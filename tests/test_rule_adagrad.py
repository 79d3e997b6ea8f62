"""DP-Adagrad (SPEC 10.2): torch.optim.Adagrad's twin on every backend, the cumulative
noise bias correction (phi under a noise schedule, the floored denominator, the unbiased
accumulator, and that learning does not stall with it), initial_accumulator_value,
checkpoints and validation."""

from __future__ import annotations

import copy

import pytest
import torch

import dpkern
from dpkern import rules
from dpkern import functional as F
from dpkern.hyper import AdagradHyper

from test_reference_spec import build, compare, make_grads, set_grad_samples
from twin import fresh_seed, need_backend, twin_run

SHAPES = [(7,), (5, 3), (3, 4, 5)]
# torch.optim.Adagrad's options, each on its own and together (plus the correction with
# sigma = 0, where phi = 0 and the denominator is torch's wherever sum > gamma)
TWIN_OPTIONS = {
    "defaults": {},
    "lr_decay": dict(lr_decay=0.2),
    "weight_decay": dict(weight_decay=0.1),
    "initial_accumulator_value": dict(initial_accumulator_value=0.5),
    "eps": dict(eps=1e-6),
    "all": dict(lr_decay=0.1, weight_decay=0.05, initial_accumulator_value=0.2, eps=1e-7),
    "bc_sigma0": dict(noise_bias_correction=True, initial_accumulator_value=0.1, lr_decay=0.1),
}


def _twin_run(backend, options, shapes=SHAPES, steps=5, B=6):
    """DPAdagrad (sigma = 0, C huge) and torch.optim.Adagrad on the mean gradient."""
    twin_run(dpkern.DPAdagrad, torch.optim.Adagrad, options, backend, shapes=shapes,
             steps=steps, B=B, lrs=(0.1, 0.03), split=len(shapes) // 2 + 1, states=("sum",),
             check_step=True)  # fmt: skip


@pytest.mark.parametrize("options", list(TWIN_OPTIONS.values()), ids=list(TWIN_OPTIONS))
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_torch_optim_twin(backend, options):
    _twin_run(backend, options)


@pytest.mark.triton
@pytest.mark.parametrize("options", [TWIN_OPTIONS["all"], TWIN_OPTIONS["bc_sigma0"]])
def test_torch_optim_twin_triton(options):
    _twin_run("triton", options, shapes=[(7,), (3, 5)], steps=2, B=3)


def test_initial_accumulator_value_per_group_and_late_parameters():
    """sum starts at the group's initial_accumulator_value, also for a group added later
    (at its own first step); phi is not started at it (it is deterministic, SPEC 10.2)."""
    p, q = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(2, 3))
    opt = dpkern.DPAdagrad(
        [p],
        initial_accumulator_value=0.25,
        noise_bias_correction=True,
        max_grad_norm=1e6,
        noise_multiplier=0.0,
        expected_batch_size=2,
    )
    p.grad_sample = torch.randn(2, 4)
    g = p.grad_sample.mean(0)
    opt.step()
    torch.testing.assert_close(opt.state[p]["sum"], 0.25 + g * g)
    assert float(opt.state[p]["noise_var_avg"]) == 0.0
    opt.add_param_group(dict(params=[q], initial_accumulator_value=2.0))
    p.grad_sample, q.grad_sample = torch.randn(2, 4), torch.randn(2, 2, 3)
    gq = q.grad_sample.mean(0)
    opt.step()
    torch.testing.assert_close(opt.state[q]["sum"], 2.0 + gq * gq)
    assert float(opt.state[q]["step"]) == 1.0 and float(opt.state[p]["step"]) == 2.0


# ---------------------------------------------------------------------------------------
# The noise bias correction
# ---------------------------------------------------------------------------------------
SCHEDULE = [(1.0, 1.0, 4.0), (2.5, 0.5, 3.0), (0.5, 2.0, 6.0), (0.0, 1.0, 4.0), (1.5, 1.0, 5.0)]


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_phi_is_the_cumulative_noise_variance_under_a_schedule(backend):
    """phi_t = phi_{t-1} + (sigma_t C_t / B_e,t)^2, by hand; a parameter group added later
    starts its own phi at its first step."""
    need_backend(backend)
    p, late = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3, 2))
    opt = dpkern.DPAdagrad(
        [p],
        noise_bias_correction=True,
        gamma=1e-2,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        seed=fresh_seed(),
        backend=backend,
    )
    phi, phi_late = 0.0, 0.0
    for t, (sigma, C, B_e) in enumerate(SCHEDULE, start=1):
        if t == 3:
            opt.add_param_group(dict(params=[late]))
        opt.noise_multiplier, opt.max_grad_norm, opt.expected_batch_size = sigma, C, B_e
        Phi = (sigma * C / B_e) ** 2
        for x in [p, late][: 2 if t >= 3 else 1]:
            x.grad_sample = torch.randn(3, *x.shape)
        opt.step()
        phi += Phi
        assert float(opt.state[p]["noise_var_avg"]) == pytest.approx(phi, rel=1e-6)
        if t >= 3:
            phi_late += Phi
            assert float(opt.state[late]["noise_var_avg"]) == pytest.approx(phi_late, rel=1e-6)


@pytest.mark.parametrize("config", ["adagrad_bc", "adagrad_decay_wd_init"])
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


def _floored_case(backend):
    """One functional step with sigma = 0 and a given phi_t: some coordinates have
    sum_t - phi_t < gamma (floored), the others not; clr with lr_decay at t = 4."""
    dev = need_backend(backend)
    gen = torch.Generator().manual_seed(fresh_seed())
    h = AdagradHyper(
        lr=0.1, lr_decay=0.5, weight_decay=0.02, noise_bias_correction=True, gamma=0.05
    )
    phi, t = 2.0, 4
    p = torch.randn(257, generator=gen)
    gs = torch.randn((4, 257), generator=gen)
    s0 = torch.rand(257, generator=gen) * 3.0  # sum_t - phi on both sides of gamma
    g = gs.mean(0) + 0.02 * p
    s = s0 + g * g
    d = s - phi
    std = torch.sqrt(torch.where(d < h.gamma, torch.full_like(d, h.gamma), d)) + h.eps
    want = p - (0.1 / (1 + (t - 1) * 0.5)) * (g / std)
    params, states = [p.clone().to(dev)], {"sum": [s0.clone().to(dev)]}
    F.dp_step(
        h,
        params,
        [gs.to(dev)],
        states,
        step=t,
        key=1,
        max_grad_norm=1e6,
        noise_multiplier=0.0,
        expected_batch_size=4.0,
        noise_var_avg=phi,
        backend=backend,
    )
    assert bool((d < h.gamma).any()) and bool((d > h.gamma).any())
    torch.testing.assert_close(params[0].cpu(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(states["sum"][0].cpu(), s, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_corrected_denominator_is_floored_at_gamma(backend):
    _floored_case(backend)


@pytest.mark.triton
def test_corrected_denominator_is_floored_at_gamma_triton():
    _floored_case("triton")


def test_corrected_accumulator_is_unbiased():
    """E[sum_t] = s_0 + sum_s E[g°_s^2] + phi_t: with lr = 0 (fixed gradients), over d
    coordinates mean(sum_t - phi_t) matches the sigma = 0 run's sum within a few standard
    errors, while mean(sum_t) overshoots by phi_t = sum_s Phi_s."""
    d, B, T = 8000, 4, 10
    gen = torch.Generator().manual_seed(fresh_seed())
    g_fixed = torch.randn(d, generator=gen) * 0.3
    sigmas = [2.0 if t % 2 else 0.5 for t in range(T)]

    def run(scale):
        p = torch.nn.Parameter(torch.zeros(d))
        opt = dpkern.DPAdagrad(
            [p],
            lr=0.0,
            initial_accumulator_value=0.1,
            noise_bias_correction=True,
            max_grad_norm=1e6,
            noise_multiplier=0.0,
            expected_batch_size=B,
            seed=fresh_seed(),
            backend="torch",
        )
        for sigma in sigmas:
            opt.noise_multiplier = scale * sigma / 1e6 * B  # sigma C / B_e = sigma
            p.grad_sample = g_fixed.expand(B, d).clone()
            opt.step()
        return opt.state[p]["sum"].double(), float(opt.state[p]["noise_var_avg"])

    s_clean, _ = run(0.0)
    s_noisy, phi = run(1.0)
    assert phi == pytest.approx(sum(s**2 for s in sigmas), rel=1e-6)
    var = sum(4 * g_fixed.double().square().mean() * s**2 + 2 * s**4 for s in sigmas)
    stderr = float(var.sqrt()) / d**0.5
    assert abs(float((s_noisy - phi - s_clean).mean())) < 5 * stderr
    assert float((s_noisy - s_clean).mean()) == pytest.approx(phi, abs=5 * stderr)


def _quadratic(backend, correct, T, d=2000, sigma=2.0, lr=0.1, gamma=1.0):
    """DP-Adagrad on f(x) = ||x||^2 / 2 from x = 1 (no clipping), Phi = sigma^2. Returns,
    at steps T/4 and T, the median effective step clr / d_t over the coordinates and the
    mean of x over the coordinates (the noise averages out of it: the signal's progress)."""
    B = 10
    x = torch.nn.Parameter(torch.ones(d))
    opt = dpkern.DPAdagrad(
        [x],
        lr=lr,
        noise_bias_correction=correct,
        gamma=gamma,
        max_grad_norm=1e3,
        noise_multiplier=sigma * B / 1e3,
        expected_batch_size=B,
        seed=fresh_seed(),
        backend=backend,
    )
    out = {}
    for t in range(1, T + 1):
        x.grad_sample = x.detach().expand(B, d).clone()  # per-sample gradient x, norm < C
        opt.step()
        if t in (T // 4, T):
            s = opt.state[x]["sum"]
            if correct:
                s = torch.clamp(s - float(opt.state[x]["noise_var_avg"]), min=gamma)
            out[t] = (float((lr / (s.sqrt() + 1e-10)).median()), float(x.detach().mean()))
    return out


def test_learning_does_not_stall_with_the_correction(backend="torch"):
    """Without the correction the accumulator absorbs t Phi and the effective step
    shrinks like lr / sqrt(t Phi) (halving from T/4 to T); with it the step stays several
    times larger and the signal reaches the optimum (mean x ~ 0) while the uncorrected
    run is still far from it."""
    need_backend(backend)
    T, sigma, lr = 200, 2.0, 0.1
    plain = _quadratic(backend, False, T, sigma=sigma, lr=lr)
    fixed = _quadratic(backend, True, T, sigma=sigma, lr=lr)
    (eff_q, mean_q), (eff_T, mean_T) = plain[T // 4], plain[T]
    assert eff_T == pytest.approx(lr / (T * sigma**2) ** 0.5, rel=0.15)  # 1 / sqrt(t Phi)
    assert eff_T / eff_q == pytest.approx(0.5, rel=0.15)
    assert fixed[T][0] > 3 * eff_T and fixed[T // 4][0] > 3 * eff_q
    assert mean_q > 0.3 and mean_T > 0.1  # the uncorrected run crawls
    assert abs(fixed[T // 4][1]) < 0.4 * mean_q and abs(fixed[T][1]) < 0.2 * mean_T


# ---------------------------------------------------------------------------------------
# Checkpoints, validation, the registry
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options",
    [
        dict(lr_decay=0.1, weight_decay=0.01, initial_accumulator_value=0.3),
        dict(noise_bias_correction=True, gamma=1e-3),
    ],
    ids=["decay_init", "bc"],
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
        lr=0.05,
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
    opt_a = dpkern.DPAdagrad(a, **kw)
    steps(opt_a, a, grads[:2])
    sd = copy.deepcopy(opt_a.state_dict())
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = dpkern.DPAdagrad(b, **{**kw, "seed": seed ^ 1, "initial_accumulator_value": 9.0})
    opt_b.load_state_dict(sd)  # the checkpoint's groups (and sums) replace the constructor's
    steps(opt_a, a, grads[2:])
    steps(opt_b, b, grads[2:])
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for name, val in opt_a.state[p].items():
            assert torch.equal(val, opt_b.state[q][name]), name


BAD = [
    ("lr", -0.1),
    ("lr_decay", -0.1),
    ("weight_decay", -1.0),
    ("initial_accumulator_value", -0.5),
    ("initial_accumulator_value", float("inf")),
    ("eps", 0.0),
    ("gamma", -1e-8),
    ("noise_bias_correction", 1),
]


@pytest.mark.parametrize("name,value", BAD)
def test_invalid_hyper_parameters_are_value_errors(name, value):
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=name):
        dpkern.DPAdagrad(
            [p], **{name: value}, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2
        )


def test_registry_entry():
    spec = rules.get("adagrad")
    assert spec.cli_name == "dp-adagrad" and spec.optimizer_class() is dpkern.DPAdagrad
    assert dpkern.optim.DPAdagrad is dpkern.DPAdagrad and "DPAdagrad" in dpkern.__all__
    assert spec.section == "10.2" and len(spec.lr_grid) == 4
    assert spec.fsdp  # element-wise sum and a per-parameter phi: FSDP2 can shard it
    assert spec.state("sum").initial_value(AdagradHyper(lr=1.0, initial_accumulator_value=3.0)) == 3
    assert spec.kernel_state_names == ("sum",)
