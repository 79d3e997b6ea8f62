"""DP-RAdam (SPEC 10.3): torch.optim.RAdam's twin on every backend, the rectified steps
(rho_t > 5, from t = 6) on the fused backends, the noise bias correction (phi by hand
under a noise schedule, the max(v_hat - phi_hat, gamma) denominator, a warm-up that the
noise in v cannot reach, an unbiased second moment), checkpoints and validation.

The generic tables (test_backend_parity, test_optim_backends, test_reference_spec) run
DP-RAdam too, but their 1 - 4 steps are all warm-up steps; the rectified ones are here."""

from __future__ import annotations

import copy

import pytest
import torch

import dpkern
from dpkern import rules
from dpkern.backends import reference as ref
from dpkern.backends import resolve
from dpkern.hyper import RAdamHyper

from conftest import backend_device, case_seed, run_step
from test_backend_parity import assert_close, make_case
from twin import need_backend, twin_run

SHAPES = [(7,), (5, 3), (3, 4, 5)]
TWIN_OPTIONS = {
    "defaults": {},
    "coupled_wd": dict(weight_decay=0.1),
    "decoupled_wd": dict(weight_decay=0.1, decoupled_weight_decay=True),
    "betas_eps_wd": dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
}


# ---------------------------------------------------------------------------------------
# The twin: sigma = 0 and a huge C make g_hat the mean gradient
# ---------------------------------------------------------------------------------------
def _twin(backend, options, steps, shapes, seed):
    twin_run(dpkern.DPRAdam, torch.optim.RAdam, options, backend, shapes=shapes, steps=steps,
             B=5, seed=seed, lrs=(0.01, 0.03), states=("exp_avg", "exp_avg_sq"),
             check_step=True)  # fmt: skip
    assert rules.radam_rectification(options.get("betas", (0.9, 0.999))[1], steps) is not None


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("option", list(TWIN_OPTIONS))
def test_twin_torch_optim_radam(backend, option):
    """12 steps: the warm-up (t <= 5) and the rectified steps, two groups, odd shapes."""
    _twin(backend, TWIN_OPTIONS[option], 12, SHAPES, case_seed(1 + len(option)))


@pytest.mark.triton
@pytest.mark.parametrize("option", ["coupled_wd", "decoupled_wd"])
def test_twin_torch_optim_radam_triton(option):
    _twin("triton", TWIN_OPTIONS[option], 7, SHAPES[:2], case_seed(2))


# ---------------------------------------------------------------------------------------
# The fused backends against the reference in the rectified branch
# ---------------------------------------------------------------------------------------
RECT_HYPERS = {
    "radam": RAdamHyper(lr=1e-2, weight_decay=0.01),
    "radam_decoupled": RAdamHyper(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    # gamma well above 0: sqrt(max(v_hat - phi_hat, gamma)) turns a 1-ulp difference of z
    # into a large relative one where v_hat - phi_hat ~ 0 (test_backend_parity's HYPERS)
    "radam_bc": RAdamHyper(lr=1e-2, weight_decay=0.01, noise_bias_correction=True, gamma=1e-2),
    "radam_bc_decoupled": RAdamHyper(
        lr=1e-2,
        beta1=0.8,
        beta2=0.99,
        weight_decay=0.1,
        decoupled_weight_decay=True,
        noise_bias_correction=True,
        gamma=1e-2,
    ),
}
RECT_CASES = [(name, t, 4, torch.float32) for name in RECT_HYPERS for t in (6, 11)] + [
    ("radam", 6, 0, torch.bfloat16),
    ("radam_bc", 7, 1, torch.bfloat16),
    ("radam_bc_decoupled", 9, 1, torch.float16),
]


@pytest.mark.parametrize(
    "name,t,B,dtype", RECT_CASES, ids=[f"{n}-t{t}-B{b}-{str(d)[6:]}" for n, t, b, d in RECT_CASES]
)
def test_rectified_step_matches_reference(fused_backend, name, t, B, dtype):
    hyper = RECT_HYPERS[name]
    assert rules.radam_rectification(hyper.beta2, t) is not None  # the rectified branch
    dev = backend_device(fused_backend)
    be = resolve(fused_backend, dev)
    case = make_case("radam", B, dtype, dev, seed=t * 10 + B, t=t)
    want_p, want_s, _ = run_step(ref, hyper, case)
    got_p, got_s, _ = run_step(be, hyper, case)
    for k, (a, b) in enumerate(zip(got_p, want_p)):
        assert a.dtype == dtype
        assert_close(a, b, dtype, f"param {k}")
    for sname in want_s:
        for k, (a, b) in enumerate(zip(got_s[sname], want_s[sname])):
            assert_close(a, b, torch.float32 if dtype == torch.float32 else dtype, sname)


def _trajectory(backend, device, steps=8):
    """Two groups (one corrected, one not), a frozen and an unused parameter, an
    accumulated micro-batch, an empty batch and a noise schedule, through t = 8."""
    gen = torch.Generator().manual_seed(case_seed(3))
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in SHAPES]
    frozen = torch.randn(4, generator=gen).to(device)
    params.append(torch.nn.Parameter(frozen, requires_grad=False))
    opt = dpkern.DPRAdam(
        [
            dict(params=params[:2], noise_bias_correction=True, gamma=1e-2),
            dict(params=params[2:], lr=0.02, weight_decay=0.1, decoupled_weight_decay=True),
        ],
        lr=0.05,
        betas=(0.9, 0.99),
        max_grad_norm=2.0,
        noise_multiplier=0.6,
        expected_batch_size=5.0,
        seed=2025,
        backend=backend,
    )
    for t in range(1, steps + 1):
        opt.noise_multiplier = (0.6, 1.2, 0.3)[t % 3]
        for micro, B in enumerate([3, 2] if t == 4 else [0 if t == 5 else 4]):
            for k, p in enumerate(params[:3]):
                if k == 1 and t == 2:
                    continue  # unused this step
                p.grad_sample = (2 * torch.randn((B, *p.shape), generator=gen)).to(device)
            if micro == 0 and t == 4:
                opt.accumulate()
        opt.step()
        opt.zero_grad()
    return params, opt


def test_trajectory_through_rectification_matches_reference(fused_backend):
    device = backend_device(fused_backend)
    want_p, want_o = _trajectory("torch", device)
    got_p, got_o = _trajectory(fused_backend, device)
    for a, b in zip(got_p, want_p):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for q, p in zip(got_p[:3], want_p[:3]):
        assert got_o.state[q].keys() == want_o.state[p].keys()
        for name, val in want_o.state[p].items():
            torch.testing.assert_close(got_o.state[q][name], val, rtol=1e-4, atol=1e-5)
    assert "noise_var_avg" in want_o.state[want_p[0]]
    assert "noise_var_avg" not in want_o.state[want_p[2]]


# ---------------------------------------------------------------------------------------
# Noise bias correction
# ---------------------------------------------------------------------------------------
SCHEDULE = [  # (sigma, C, B_e) per step: phi follows Phi_t
    (1.0, 1.0, 4.0),
    (2.0, 0.5, 3.0),
    (0.5, 2.0, 6.0),
    (0.0, 1.0, 4.0),
    (3.0, 1.0, 8.0),
    (1.5, 0.8, 5.0),
    (1.0, 1.0, 2.0),
    (0.7, 1.3, 4.0),
]


def _set(opt, sigma, C, B_e):
    opt.noise_multiplier, opt.max_grad_norm, opt.expected_batch_size = sigma, C, B_e


def test_phi_recursion_by_hand_with_a_noise_schedule():
    """phi_t = beta2 phi_{t-1} + (1 - beta2) (sigma_t C_t / B_e,t)^2, every step (warm-up
    included), per group's beta2; no phi kept where the correction is off."""
    gen = torch.Generator().manual_seed(case_seed(4))
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = dpkern.DPRAdam(
        [
            dict(params=ps[:1], betas=(0.9, 0.95), noise_bias_correction=True),
            dict(params=ps[1:2], betas=(0.8, 0.9), noise_bias_correction=True),
            dict(params=ps[2:]),
        ],
        lr=1e-3,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        seed=7,
        backend="torch",
    )
    phi = {0.95: 0.0, 0.9: 0.0}
    for sigma, C, B_e in SCHEDULE:
        _set(opt, sigma, C, B_e)
        for p in ps:
            p.grad_sample = torch.randn((3, *p.shape), generator=gen)
        opt.step()
        for beta2 in phi:
            phi[beta2] = beta2 * phi[beta2] + (1 - beta2) * (sigma * C / B_e) ** 2
        assert float(opt.state[ps[0]]["noise_var_avg"]) == pytest.approx(phi[0.95], rel=1e-6)
        assert float(opt.state[ps[1]]["noise_var_avg"]) == pytest.approx(phi[0.9], rel=1e-6)
        assert "noise_var_avg" not in opt.state[ps[2]]


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_corrected_denominator_is_max_of_v_hat_minus_phi_hat_and_gamma(backend):
    """Read off the optimizer's own state after each rectified step:
    p_t - p_{t-1} = -lr r_t m_hat / sqrt(max(v_hat - phi_hat, gamma)), with the floor
    active for some coordinates and not for others (noise comparable to the gradient)."""
    need_backend(backend)
    gen = torch.Generator().manual_seed(case_seed(5))
    p = torch.nn.Parameter(torch.zeros(300))
    lr, gamma, (beta1, beta2) = 1e-3, 1e-3, (0.9, 0.99)
    opt = dpkern.DPRAdam(
        [p],
        lr=lr,
        betas=(beta1, beta2),
        gamma=gamma,
        noise_bias_correction=True,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        seed=11,
        backend=backend,
    )
    floored = unfloored = 0
    for t in range(1, 10):
        before = p.detach().double().clone()
        p.grad_sample = 0.02 * torch.randn((4, 300), generator=gen)
        opt.step()
        st = opt.state[p]
        m_hat = st["exp_avg"].double() / (1 - beta1**t)
        v_hat = st["exp_avg_sq"].double() / (1 - beta2**t)
        phi_hat = float(st["noise_var_avg"]) / (1 - beta2**t)
        rect = rules.radam_rectification(beta2, t)
        if rect is None:
            want = before - lr * m_hat
        else:
            diff = v_hat - phi_hat
            floored += int((diff < gamma).sum())
            unfloored += int((diff > gamma).sum())
            want = before - lr * rect * m_hat / torch.clamp(diff, min=gamma).sqrt()
            plain = before - lr * rect * m_hat / (v_hat.sqrt() + 1e-8)  # uncorrected
            assert (plain - want).abs().max() > 1e-4
        torch.testing.assert_close(p.detach().double(), want, rtol=1e-4, atol=1e-8)
    assert floored > 50 and unfloored > 50


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_warm_up_does_not_read_v_so_the_correction_starts_at_the_first_rectified_step(backend):
    """SPEC 10.3's claim: the warm-up steps (rho_t <= 5, t <= 5) are the same with the
    correction on or off, bit for bit, under noise; from t = 6 they differ."""
    device = need_backend(backend)
    gen = torch.Generator().manual_seed(case_seed(6))
    start = [torch.randn(s, generator=gen).to(device) for s in SHAPES]
    runs = []
    for correct in (False, True):
        ps = [torch.nn.Parameter(x.clone()) for x in start]
        opt = dpkern.DPRAdam(
            ps,
            lr=0.01,
            noise_bias_correction=correct,
            max_grad_norm=1.0,
            noise_multiplier=2.0,
            expected_batch_size=4.0,
            seed=12,
            backend=backend,
        )
        runs.append((ps, opt))
    for t in range(1, 8):
        gs = [torch.randn((4, *s), generator=gen).to(device) for s in SHAPES]
        for ps, opt in runs:
            for p, g in zip(ps, gs):
                p.grad_sample = g.clone()
            opt.step()
        same = all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
        assert same == (t <= 5), t
        assert (rules.radam_rectification(0.999, t) is None) == (t <= 5)


def test_phi_hat_equals_Phi_at_the_first_rectified_step():
    """phi is advanced through the warm-up: with constant sigma, phi_hat = Phi at every t,
    the first rectified step (t = 6) included -- not the (1 - beta2) Phi / (1 - beta2^6)
    ~ Phi / 6 of a phi started there."""
    sigma, C, B_e, beta2 = 1.7, 0.6, 8.0, 0.999
    p = torch.nn.Parameter(torch.randn(5))
    opt = dpkern.DPRAdam(
        [p],
        noise_bias_correction=True,
        max_grad_norm=C,
        noise_multiplier=sigma,
        expected_batch_size=B_e,
        seed=3,
        backend="torch",
    )
    Phi = (sigma * C / B_e) ** 2
    for t in range(1, 8):
        p.grad_sample = torch.randn(3, 5)
        opt.step()
        phi_hat = float(opt.state[p]["noise_var_avg"]) / (1 - beta2**t)
        assert phi_hat == pytest.approx(Phi, rel=1e-6), t
    assert (1 - beta2) * Phi / (1 - beta2**6) < Phi / 5


def test_corrected_second_moment_is_unbiased_under_a_noise_schedule():
    """The benefit claimed (SPEC 10.3, section 10): v_hat - phi_hat estimates the noiseless
    second moment, also when sigma changes between steps, where v_hat alone and v_hat minus
    the current Phi (a constant subtraction) are far off. Mean over 16384 coordinates (the
    estimate's standard error is ~3% of the target; tolerance 15%)."""
    d, B = 16384, 256
    gen = torch.Generator().manual_seed(case_seed(7))
    u = torch.randn(d, generator=gen)
    u = u / u.norm()  # every sample's gradient is C u after clipping: g_bar = C u B / B_e
    sigmas = [4.0, 3.5, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5]  # Phi from 4x to 1/16 the target
    C, beta2 = 1.0, 0.9
    runs = {}
    for name, noisy in (("noisy", True), ("noiseless", False)):
        p = torch.nn.Parameter(torch.zeros(d))
        opt = dpkern.DPRAdam(
            [p],
            lr=0.0,
            betas=(0.9, beta2),
            noise_bias_correction=True,
            max_grad_norm=C,
            noise_multiplier=1.0,
            expected_batch_size=float(B),
            seed=int(case_seed(8)) % 2**63,
            backend="torch",
        )
        for sigma in sigmas:
            opt.noise_multiplier = sigma if noisy else 0.0
            p.grad_sample = (10.0 * u).expand(B, d).clone()
            opt.step()
        runs[name] = opt.state[p]
    t = len(sigmas)
    v_hat = lambda st: st["exp_avg_sq"].double() / (1 - beta2**t)
    target = float(v_hat(runs["noiseless"]).mean())
    assert target == pytest.approx(C**2 / d, rel=1e-4)
    phi_hat = float(runs["noisy"]["noise_var_avg"]) / (1 - beta2**t)
    raw = float(v_hat(runs["noisy"]).mean())
    corrected = raw - phi_hat
    constant = raw - (sigmas[-1] * C / B) ** 2
    assert corrected == pytest.approx(target, rel=0.15)
    assert abs(raw - target) > 0.5 * target
    assert abs(constant - target) > 0.5 * target


# ---------------------------------------------------------------------------------------
# Checkpoints and validation
# ---------------------------------------------------------------------------------------
def _steps(opt, params, ts, gen):
    for t in ts:
        _set(opt, *SCHEDULE[t % len(SCHEDULE)])
        for p in params:
            p.grad_sample = torch.randn((3, *p.shape), generator=gen)
        opt.step()


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("save_at", [2, 6])
def test_state_dict_round_trip(backend, save_at):
    """Save after `save_at` steps, load into a fresh optimizer: the next steps (through
    the rectified ones) equal the uninterrupted run's, bit for bit (seeded)."""
    need_backend(backend)
    mk = lambda ps: dpkern.DPRAdam(
        [dict(params=ps[:2], noise_bias_correction=True, gamma=1e-4), dict(params=ps[2:])],
        lr=0.01,
        weight_decay=0.05,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        seed=21,
        backend=backend,
    )
    g0 = torch.Generator().manual_seed(case_seed(9))
    start = [torch.randn(s, generator=g0) for s in SHAPES]
    pa = [torch.nn.Parameter(x.clone()) for x in start]
    a = mk(pa)
    _steps(a, pa, range(1, save_at + 1), torch.Generator().manual_seed(1))
    sd = copy.deepcopy(a.state_dict())
    assert all(s in sd["state"][0] for s in ("exp_avg", "exp_avg_sq", "noise_var_avg", "step"))
    assert "noise_var_avg" not in sd["state"][2]
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    b = mk(pb)
    b.load_state_dict(sd)
    for ts in (range(save_at + 1, save_at + 2), range(save_at + 2, 10)):
        _steps(a, pa, ts, torch.Generator().manual_seed(ts[0]))
        _steps(b, pb, ts, torch.Generator().manual_seed(ts[0]))
        for x, y in zip(pa, pb):
            assert torch.equal(x, y)
        for x, y in zip(pa, pb):
            for name, val in a.state[x].items():
                assert torch.equal(b.state[y][name], val), name
    assert b.dp_step == 9


BAD = [
    ("eps", 0.0),
    ("gamma", 0.0),
    ("gamma", -1e-8),
    ("betas", (1.0, 0.999)),
    ("betas", (0.9, 1.0)),
    ("weight_decay", -0.1),
    ("lr", -1e-3),
    ("decoupled_weight_decay", "yes"),
    ("noise_bias_correction", 1),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_bad_hyper_parameters_are_value_errors_naming_them(name, value):
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=name.split("[")[0]):
        dpkern.DPRAdam(
            [p], **{name: value}, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2
        )
    opt = dpkern.DPRAdam([p], max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2)
    with pytest.raises(ValueError, match=name.split("[")[0]):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], name: value})
    assert len(opt.param_groups) == 1


def test_registry_entry():
    spec = rules.get("radam")
    assert spec.cli_name == "dp-radam" and spec.optimizer == "DPRAdam" and spec.section == "10.3"
    assert dpkern.DPRAdam is dpkern.optim.DPRAdam and spec.fsdp and spec.second_moment
    assert spec.kernel_state_names == ("exp_avg", "exp_avg_sq")
    assert spec.needed_states(RAdamHyper(lr=1.0)) == ("exp_avg", "exp_avg_sq")
    assert "noise_var_avg" in spec.needed_states(RAdamHyper(lr=1.0, noise_bias_correction=True))
    assert spec.corrects(RAdamHyper(lr=1.0, noise_bias_correction=True))
    assert not spec.corrects(RAdamHyper(lr=1.0))
    # torch.optim.RAdam's formula for rho_t and r_t, the branch at rho_t > 5
    assert rules.radam_rectification(0.999, 5) is None
    assert rules.radam_rectification(0.999, 6) == pytest.approx(0.025821, abs=1e-6)
    assert rules.radam_rectification(0.5, 10**6) is None  # rho_inf = 3: never rectified


# ---------------------------------------------------------------------------------------
# Compiled mode without a GPU (what the interpreter never runs): test_triton_backend's
# ahead-of-time sm_90 compilation, for this rule's kernel variants
# ---------------------------------------------------------------------------------------
def _compile_for_sm90(variants: str):
    import os
    import subprocess
    import sys

    from test_triton_backend import _AOT, ROOT

    head = _AOT.split("assert v4(ptx(S._step_kernel, **base))")[0]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    res = subprocess.run(
        [sys.executable, "-c", head + variants + "\nprint('ok')\n"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if res.returncode == 77:
        pytest.skip(res.stdout.strip())
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr[-3000:]


@pytest.mark.triton
def test_kernels_compile_for_sm90_without_a_gpu():
    """Warm-up, rectified, corrected, coupled and decoupled variants; aligned groups keep
    their 16-byte loads."""
    _compile_for_sm90(
        """
for flags in (dict(F0=1), dict(F0=1, F2=1), dict(F1=1, F2=1, F3=1)):
    assert v4(ptx(S._step_kernel, **{**base, "RULE": R.RADAM.value, **flags})) >= 8, flags
ptx(S._step_kernel, **{**base, "RULE": R.RADAM.value, "F2": 1, "F3": 1, "ALIGNED": False,
                       "P_DTYPE": tl.bfloat16, "G_DTYPE": tl.bfloat16})
"""
    )
