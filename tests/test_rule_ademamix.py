"""DP-AdEMAMix (SPEC 10.6) against the paper's Algorithm 1 written here in float64 (there
is no packaged twin), its alpha / beta3 schedulers, the noise bias correction (phi by hand
under a noise schedule, the denominator's max(v_hat - phi_hat, gamma), what it removes),
checkpoints and errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import dpkern
from dpkern import rules
from dpkern.functional import gaussian_noise
from dpkern.hyper import AdEMAMixHyper

from twin import fresh_seed, need_backend, twin_run

SHAPES = [(7,), (5, 3), (3, 4, 5)]
F64 = torch.float64


class Algorithm1:
    """Pagliardini, Ablin, Grangier 2024 (arXiv 2409.03137), Algorithm 1, in float64, with
    the schedulers of their Section 3 (written from the paper, not from dpkern)."""

    def __init__(self, params, lr, betas=(0.9, 0.999, 0.9999), alpha=5.0, eps=1e-8, wd=0.0,
                 T=None):  # fmt: skip
        self.theta = [p.detach().to(F64).clone() for p in params]
        self.m1 = [torch.zeros_like(x) for x in self.theta]
        self.m2 = [torch.zeros_like(x) for x in self.theta]
        self.nu = [torch.zeros_like(x) for x in self.theta]
        self.lr, self.betas, self.alpha, self.eps, self.wd, self.T = lr, betas, alpha, eps, wd, T
        self.t = 0

    def schedules(self, t):
        b1, _, b3 = self.betas
        if not self.T:
            return self.alpha, b3
        alpha_t = min(t * self.alpha / self.T, self.alpha)
        a = t / self.T
        beta3_t = min(
            math.exp(math.log(b1) * math.log(b3) / ((1 - a) * math.log(b3) + a * math.log(b1))),
            b3,
        )
        return alpha_t, beta3_t

    def step(self, grads):
        self.t += 1
        t, (b1, b2, _) = self.t, self.betas
        alpha_t, beta3_t = self.schedules(t)
        for k, g in enumerate(grads):
            g = g.to(F64)
            self.m1[k] = b1 * self.m1[k] + (1 - b1) * g
            self.m2[k] = beta3_t * self.m2[k] + (1 - beta3_t) * g
            self.nu[k] = b2 * self.nu[k] + (1 - b2) * g * g
            m1_hat = self.m1[k] / (1 - b1**t)
            nu_hat = self.nu[k] / (1 - b2**t)
            theta = self.theta[k]
            update = (m1_hat + alpha_t * self.m2[k]) / (nu_hat.sqrt() + self.eps)
            self.theta[k] = theta - self.lr * (update + self.wd * theta)


OPTIONS = {
    "defaults": {},
    "weight_decay": dict(weight_decay=0.1),
    "betas_alpha_eps": dict(betas=(0.8, 0.99, 0.995), alpha=2.0, eps=1e-6),
    "warmup": dict(t_alpha_beta3=4, weight_decay=0.05),  # t < T and t >= T
}


class Algorithm1Twin:
    """Algorithm1 as the twin harness drives an optimizer: it steps on the .grad of its
    (float64) parameters, which then hold theta, and keeps m1, m2, nu as state under
    DP-AdEMAMix's names."""

    def __init__(self, groups, lr, weight_decay=0.0, t_alpha_beta3=None, **kw):
        self.params = [q for g in groups for q in g["params"]]
        self.ref = Algorithm1(self.params, lr, **kw, wd=weight_decay, T=t_alpha_beta3)

    def step(self):
        self.ref.step([q.grad for q in self.params])
        with torch.no_grad():
            for q, theta in zip(self.params, self.ref.theta):
                q.copy_(theta)

    @property
    def state(self):
        r = self.ref
        return {
            q: dict(exp_avg=r.m1[k], exp_avg_slow=r.m2[k], exp_avg_sq=r.nu[k])
            for k, q in enumerate(self.params)
        }


def _twin_run(backend, options, *, correct=False, shapes=SHAPES, steps=6, B=6):
    return twin_run(dpkern.DPAdEMAMix, Algorithm1Twin,
                    {"lr": 0.01, **options, "noise_bias_correction": correct}, backend,
                    shapes=shapes, steps=steps, B=B, twin_dtype=F64,
                    states=("exp_avg", "exp_avg_slow", "exp_avg_sq"),
                    state_atol={"exp_avg_sq": 1e-8})  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_algorithm_1_twin(backend, option):
    _twin_run(backend, OPTIONS[option])


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_correction_at_sigma_zero_is_algorithm_1(backend):
    """sigma = 0: phi = 0 and max(v_hat, gamma) = v_hat (gamma far below any v_hat of a
    random gradient: the default 1e-8 is above g^2 for |g| < 1e-4, about one run in 60)."""
    dp, params = _twin_run(backend, dict(weight_decay=0.1, gamma=1e-30), correct=True)
    assert all(float(dp.state[p]["noise_var_avg"]) == 0.0 for p in params)


@pytest.mark.triton
def test_algorithm_1_twin_triton():
    _twin_run("triton", OPTIONS["warmup"], shapes=[(3,), (2, 3)], steps=2, B=3)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_alpha_zero_is_torch_adamw(backend):
    """alpha = 0 drops the slow EMA: AdEMAMix is then AdamW (decoupled decay)."""
    adamw = lambda groups, betas, alpha, **kw: torch.optim.AdamW(groups, betas=betas[:2], **kw)
    options = dict(lr=0.01, betas=(0.9, 0.99, 0.999), alpha=0.0, weight_decay=0.1)
    twin_run(dpkern.DPAdEMAMix, adamw, options, backend, shapes=SHAPES, steps=4, B=4,
             states=("exp_avg", "exp_avg_sq"), check_step=True)  # fmt: skip


def test_schedulers():
    """alpha_t linear to alpha; beta3_t from beta1 to beta3 with 1 / ln(beta3_t) linear
    in t (the paper's log-space form); constant from T on, and without a warm-up."""
    h = AdEMAMixHyper(lr=1e-3, beta1=0.9, beta3=0.9999, alpha=8.0, t_alpha_beta3=100)
    inv = lambda b: 1 / math.log(b)  # noqa: E731
    for t in (1, 25, 50, 99):
        alpha_t, beta3_t = rules.ademamix_schedule(h, t)
        assert alpha_t == pytest.approx(8.0 * t / 100)
        a = t / 100
        assert inv(beta3_t) == pytest.approx((1 - a) * inv(0.9) + a * inv(0.9999), rel=1e-12)
        assert 0.9 < beta3_t < 0.9999
    for t in (100, 101, 10**6):
        assert rules.ademamix_schedule(h, t) == (8.0, 0.9999)
    plain = AdEMAMixHyper(lr=1e-3)
    assert plain.t_alpha_beta3 == 0 and AdEMAMixHyper(lr=1e-3, t_alpha_beta3=None) == plain
    assert rules.ademamix_schedule(plain, 1) == (5.0, 0.9999)


# ---------------------------------------------------------------------------------------
# The correction
# ---------------------------------------------------------------------------------------
SCHEDULE = [(1.0, 1.0, 4.0), (2.0, 0.5, 3.0), (0.5, 2.0, 6.0), (0.0, 1.0, 4.0), (1.5, 1.0, 2.0)]


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_phi_and_denominator_by_hand_with_a_noise_schedule(backend):
    """phi_t = beta2 phi + (1 - beta2) Phi_t with Phi_t = (sigma_t C_t / B_e,t)^2, and the
    step with sqrt(max(v_hat - phi_hat, gamma)) + eps, by hand in float64 (the floor is hit:
    noise-dominated coordinates)."""
    need_backend(backend)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    b1, b2, b3, alpha, eps, gamma, lr, wd, T = 0.8, 0.9, 0.95, 3.0, 1e-6, 1e-3, 0.01, 0.1, 3
    p = torch.nn.Parameter(torch.randn(9, generator=gen))
    opt = dpkern.DPAdEMAMix(
        [p],
        lr=lr,
        betas=(b1, b2, b3),
        alpha=alpha,
        eps=eps,
        weight_decay=wd,
        t_alpha_beta3=T,
        noise_bias_correction=True,
        gamma=gamma,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        seed=seed,
        backend=backend,
    )
    ref = Algorithm1([p], lr, (b1, b2, b3), alpha, eps, wd, T)
    theta, m1, m2, nu = ref.theta[0], ref.m1[0], ref.m2[0], ref.nu[0]
    phi, floored = 0.0, 0
    for t, (sigma, C, B_e) in enumerate(SCHEDULE, start=1):
        opt.noise_multiplier, opt.max_grad_norm, opt.expected_batch_size = sigma, C, B_e
        gs = 0.01 * torch.randn((2, 9), generator=gen)  # no clipping
        p.grad_sample = gs.clone()
        opt.step()
        z = gaussian_noise(9, key=seed, step=t, backend="torch").double()
        g = (gs.double().sum(0) + sigma * C * z) / B_e
        Phi = (sigma * C / B_e) ** 2
        phi = b2 * phi + (1 - b2) * Phi
        alpha_t, beta3_t = ref.schedules(t)
        m1 = b1 * m1 + (1 - b1) * g
        m2 = beta3_t * m2 + (1 - beta3_t) * g
        nu = b2 * nu + (1 - b2) * g * g
        corrected = nu / (1 - b2**t) - phi / (1 - b2**t)
        floored += int((corrected < gamma).sum())
        denom = torch.sqrt(torch.clamp(corrected, min=gamma)) + eps
        theta = theta - lr * ((m1 / (1 - b1**t) + alpha_t * m2) / denom + wd * theta)
        st, msg = opt.state[p], f"seed={seed} t={t}"
        assert float(st["noise_var_avg"]) == pytest.approx(phi, rel=1e-6), msg
        torch.testing.assert_close(st["exp_avg_sq"].double(), nu, rtol=1e-5, atol=1e-9, msg=msg)
        torch.testing.assert_close(p.detach().double(), theta, rtol=1e-4, atol=1e-6, msg=msg)
    assert floored > 0


def test_phi_hat_removes_the_noise_from_nu_hat():
    """SPEC 10.6's claim: E[nu_hat] - phi_hat is the noiseless bias-corrected second moment
    (constant gradient 0.3 on 40k coordinates, Phi = 0.04 then 0.16; 10% > 15 standard
    errors), while nu_hat alone carries phi_hat (= Phi for constant sigma)."""
    d, b2, gbar = 40_000, 0.9, 0.3
    p = torch.nn.Parameter(torch.zeros(d))
    opt = dpkern.DPAdEMAMix(
        [p],
        lr=1e-3,
        betas=(0.9, b2, 0.99),
        noise_bias_correction=True,
        max_grad_norm=100.0,
        noise_multiplier=0.002,
        expected_batch_size=1.0,
        seed=fresh_seed(),
        backend="torch",
    )
    for t in range(1, 9):
        if t == 4:
            opt.noise_multiplier = 0.004
        p.grad_sample = torch.full((1, d), gbar)
        opt.step()
        bc2 = 1 - b2**t
        nu_hat = float(opt.state[p]["exp_avg_sq"].double().mean()) / bc2
        phi_hat = float(opt.state[p]["noise_var_avg"]) / bc2
        assert nu_hat - phi_hat == pytest.approx(gbar**2, rel=0.1), t
        assert nu_hat > gbar**2 + 0.5 * phi_hat  # uncorrected: the noise is in nu_hat
        if t < 4:
            assert phi_hat == pytest.approx(0.04, rel=1e-6)


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
    torch.manual_seed(0)
    pa = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    kw = dict(
        lr=0.01,
        betas=(0.9, 0.99, 0.999),
        weight_decay=0.1,
        t_alpha_beta3=5,
        noise_bias_correction=correct,
        max_grad_norm=1.0,
        noise_multiplier=0.7,
        expected_batch_size=3.0,
        backend="torch",
    )
    a = dpkern.DPAdEMAMix(pa, seed=5, **kw)
    _run(a, pa, 2, torch.Generator().manual_seed(1))
    sd = copy.deepcopy(a.state_dict())
    assert sd["param_groups"][0]["betas"] == (0.9, 0.99, 0.999)
    for p, q in zip(pa, pb):
        q.data.copy_(p.data)
    b = dpkern.DPAdEMAMix(pb, seed=6, **{**kw, "betas": (0.5, 0.5, 0.5)})
    b.load_state_dict(sd)
    assert b.group_hyper(0) == a.group_hyper(0)
    names = {"exp_avg", "exp_avg_slow", "exp_avg_sq", "step"} | (
        {"noise_var_avg"} if correct else set()
    )
    assert set(b.state[pb[0]]) == names
    _run(a, pa, 1, torch.Generator().manual_seed(2))
    _run(b, pb, 1, torch.Generator().manual_seed(2))
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)
        for name in names:
            assert torch.equal(a.state[p][name], b.state[q][name])


BAD = [
    ("lr", -1.0, "lr"),
    ("betas", (0.9, 0.999), "betas"),
    ("betas", (0.9, 0.999, 1.0), r"betas\[2\]"),
    ("betas", (0.9, -0.1, 0.99), r"betas\[1\]"),
    ("alpha", -1.0, "alpha"),
    ("alpha", math.nan, "alpha"),
    ("eps", 0.0, "eps"),
    ("weight_decay", -0.1, "weight_decay"),
    ("gamma", 0.0, "gamma"),
    ("t_alpha_beta3", -1, "t_alpha_beta3"),
    ("t_alpha_beta3", 2.5, "t_alpha_beta3"),
    ("noise_bias_correction", "yes", "noise_bias_correction"),
]


@pytest.mark.parametrize("name,value,match", BAD)
def test_bad_hyper_parameters_are_value_errors(name, value, match):
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=match):
        dpkern.DPAdEMAMix(
            [p], **{name: value}, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2.0
        )


def test_warmup_needs_positive_beta1_and_beta3():
    p = torch.nn.Parameter(torch.zeros(3))
    kw = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2.0)
    with pytest.raises(ValueError, match="t_alpha_beta3.*betas"):
        dpkern.DPAdEMAMix([p], betas=(0.0, 0.999, 0.9999), t_alpha_beta3=10, **kw)
    with pytest.raises(ValueError, match="t_alpha_beta3.*betas"):
        dpkern.DPAdEMAMix([p], betas=(0.9, 0.999, 0.0), t_alpha_beta3=10, **kw)
    dpkern.DPAdEMAMix([p], betas=(0.0, 0.999, 0.0), **kw)  # no warm-up: fine
