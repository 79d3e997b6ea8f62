"""DP-Adadelta (SPEC 10.5): torch.optim.Adadelta twin on every backend, the noise bias
correction (phi for square_avg, the per-element psi for acc_delta) against a float64 hand
computation under a noise schedule, what the correction removes, checkpoints, errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import dpkern
from dpkern.functional import gaussian_noise

from twin import fresh_seed, need_backend, twin_run

SHAPES = [(7,), (5, 3), (3, 4, 5)]
TWIN_OPTIONS = {
    "defaults": {},
    "weight_decay": dict(weight_decay=0.1),
    "rho_eps": dict(rho=0.8, eps=1e-5),
    "rho_one": dict(rho=1.0),  # torch's range ends at 1 (v and u stay 0: SGD on lr)
}


def _twin_run(backend, options, *, correct=False, shapes=SHAPES, steps=5, B=6):
    """DPAdadelta (sigma = 0, no clipping, B_e = B) and torch.optim.Adadelta on the mean
    of the same per-sample gradients, two groups (the second with its own lr)."""
    return twin_run(dpkern.DPAdadelta, torch.optim.Adadelta,
                    {**options, "noise_bias_correction": correct}, backend, shapes=shapes,
                    steps=steps, B=B, lrs=(None, 0.5), states=("square_avg", "acc_delta"),
                    state_atol=1e-7, check_step=True)  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("option", list(TWIN_OPTIONS))
def test_torch_optim_adadelta_twin(backend, option):
    _twin_run(backend, TWIN_OPTIONS[option])


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_correction_at_sigma_zero_is_the_twin(backend):
    """sigma = 0: phi = psi = 0; the numerator is torch's exactly, the denominator too
    wherever square_avg >= gamma (O(1) gradients: always after the first step's EMA)."""
    dp, params = _twin_run(backend, dict(weight_decay=0.05), correct=True)
    for p in params:
        assert float(dp.state[p]["noise_var_avg"]) == 0.0
        assert torch.equal(dp.state[p]["acc_delta_noise_var"], torch.zeros_like(p))


@pytest.mark.triton
def test_torch_optim_adadelta_twin_triton():
    _twin_run("triton", dict(weight_decay=0.1), shapes=[(3,), (2, 3)], steps=2, B=3)


# ---------------------------------------------------------------------------------------
# The correction against a float64 hand computation, sigma, C and B_e changing
# ---------------------------------------------------------------------------------------
SCHEDULE = [(1.0, 1.0, 4.0), (2.0, 0.5, 3.0), (0.5, 2.0, 6.0), (0.0, 1.0, 4.0), (1.5, 1.0, 2.0)]


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_phi_and_psi_recursions_by_hand_with_a_noise_schedule(backend):
    need_backend(backend)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    rho, eps, gamma, lr, wd = 0.85, 1e-4, 1e-3, 0.7, 0.02
    p = torch.nn.Parameter(torch.randn(9, generator=gen))
    opt = dpkern.DPAdadelta(
        [p],
        lr=lr,
        rho=rho,
        eps=eps,
        weight_decay=wd,
        noise_bias_correction=True,
        gamma=gamma,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        seed=seed,
        backend=backend,
    )
    f64 = torch.float64
    theta = p.detach().double().clone()
    v, u, psi = (torch.zeros(9, dtype=f64) for _ in range(3))
    phi, floored = 0.0, 0
    for t, (sigma, C, B_e) in enumerate(SCHEDULE, start=1):
        opt.noise_multiplier, opt.max_grad_norm, opt.expected_batch_size = sigma, C, B_e
        gs = 0.01 * torch.randn((2, 9), generator=gen)  # norms << C: no clipping
        p.grad_sample = gs.clone()
        opt.step()
        z = gaussian_noise(9, key=seed, step=t, backend="torch").double()
        g_hat = (gs.double().sum(0) + sigma * C * z) / B_e
        Phi = (sigma * C / B_e) ** 2
        phi = rho * phi + (1 - rho) * Phi
        g = g_hat + wd * theta
        v = rho * v + (1 - rho) * g * g
        floored += int((v - phi < gamma).sum())
        c = torch.sqrt(torch.clamp(u - psi, min=0.0) + eps) / torch.sqrt(
            torch.clamp(v - phi, min=gamma) + eps
        )
        u = rho * u + (1 - rho) * (c * g) ** 2
        psi = rho * psi + (1 - rho) * c * c * Phi
        theta = theta - lr * c * g
        st, msg = opt.state[p], f"seed={seed} t={t}"
        assert float(st["noise_var_avg"]) == pytest.approx(phi, rel=1e-6), msg
        for name, want in (("square_avg", v), ("acc_delta", u), ("acc_delta_noise_var", psi)):
            torch.testing.assert_close(st[name].double(), want, rtol=1e-4, atol=1e-7, msg=msg)
        torch.testing.assert_close(p.detach().double(), theta, rtol=1e-4, atol=1e-6, msg=msg)
    assert floored > 0  # the floor max(v - phi, gamma) was exercised


def test_v_minus_phi_is_the_noiseless_square_avg():
    """SPEC 10.5's claim for square_avg: E[v_t] - phi_t = sum_s (1 - rho) rho^(t-s) g_s^2,
    the EMA without noise (Monte Carlo over 40k coordinates of constant gradient 0.3,
    noise variance Phi = 0.04, then 0.16 from step 4; 10% is > 15 standard errors)."""
    d, rho, gbar = 40_000, 0.9, 0.3
    p = torch.nn.Parameter(torch.zeros(d))
    opt = dpkern.DPAdadelta(
        [p],
        lr=1e-3,
        rho=rho,
        noise_bias_correction=True,
        max_grad_norm=100.0,  # ||g_i|| = 0.3 sqrt(d) = 60: no clipping
        noise_multiplier=0.002,
        expected_batch_size=1.0,
        seed=fresh_seed(),
        backend="torch",
    )
    noiseless = 0.0
    for t in range(1, 9):
        if t == 4:
            opt.noise_multiplier = 0.004  # Phi 0.04 -> 0.16
        p.grad_sample = torch.full((1, d), gbar)
        opt.step()
        noiseless = rho * noiseless + (1 - rho) * gbar**2
        v, phi = opt.state[p]["square_avg"].double(), float(opt.state[p]["noise_var_avg"])
        assert float(v.mean()) - phi == pytest.approx(noiseless, abs=0.1 * noiseless), t
        assert float(v.mean()) > noiseless + 0.5 * phi  # uncorrected: the noise dominates


# ---------------------------------------------------------------------------------------
# Checkpoints and errors
# ---------------------------------------------------------------------------------------
def _run(opt, params, steps, gen):
    for _ in range(steps):
        for p in params:
            p.grad_sample = torch.randn((3, *p.shape), generator=gen)
        opt.step()


@pytest.mark.parametrize("correct", [False, True])
def test_state_dict_round_trip(correct):
    """Save after 2 steps, load into a fresh optimizer: its next step is the uninterrupted
    run's (reproducible mode, so the noise is the same)."""
    torch.manual_seed(0)
    pa = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    kw = dict(
        lr=0.8,
        weight_decay=0.01,
        noise_bias_correction=correct,
        gamma=1e-3,
        max_grad_norm=1.0,
        noise_multiplier=0.7,
        expected_batch_size=3.0,
        backend="torch",
    )
    a = dpkern.DPAdadelta(pa, seed=5, **kw)
    _run(a, pa, 2, torch.Generator().manual_seed(1))
    sd = copy.deepcopy(a.state_dict())
    for p, q in zip(pa, pb):
        q.data.copy_(p.data)
    b = dpkern.DPAdadelta(pb, seed=6, **kw)
    b.load_state_dict(sd)
    names = {"square_avg", "acc_delta", "step"} | (
        {"acc_delta_noise_var", "noise_var_avg"} if correct else set()
    )
    assert set(b.state[pb[0]]) == names
    _run(a, pa, 1, torch.Generator().manual_seed(2))
    _run(b, pb, 1, torch.Generator().manual_seed(2))
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)
        for name in names:
            assert torch.equal(a.state[p][name], b.state[q][name])


BAD = [
    ("lr", -1.0),
    ("rho", 1.5),
    ("rho", -0.1),
    ("eps", 0.0),
    ("weight_decay", -0.1),
    ("gamma", 0.0),
    ("noise_bias_correction", 1),
]


@pytest.mark.parametrize("name,value", BAD)
def test_bad_hyper_parameters_are_value_errors(name, value):
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=name):
        dpkern.DPAdadelta(
            [p],
            **{name: value},
            max_grad_norm=1.0,
            noise_multiplier=1.0,
            expected_batch_size=2.0,
        )
    with pytest.raises(ValueError, match="rho"):  # a param group too
        dpkern.DPAdadelta(
            [dict(params=[p], rho=math.inf)],
            max_grad_norm=1.0,
            noise_multiplier=1.0,
            expected_batch_size=2.0,
        )


def test_other_classes_refuse_adadelta_options():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="'rho' is not supported by DPAdamW"):
        dpkern.DPAdamW(
            [dict(params=[p], rho=0.9)],
            max_grad_norm=1.0,
            noise_multiplier=1.0,
            expected_batch_size=2.0,
        )
