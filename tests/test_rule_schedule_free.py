"""Schedule-free DP-SGD and DP-AdamW (SPEC 10.8): DPSGDScheduleFree, DPAdamWScheduleFree.

- twins: with sigma = 0 and no clipping, the parameter trajectory, the eval-mode x, the
  states and the group scalars equal ``schedulefree``'s SGDScheduleFree / AdamWScheduleFree
  (float32 tolerance) over several steps, with train / eval switches between steps, on the
  reference and the C++ backend (a tiny Triton case under ``-m triton``);
- the noise bias correction: phi against a hand computation with sigma changing between
  steps, the update with sqrt(max(v_hat - phi_hat, gamma)) by hand, and its claimed
  benefit (it follows a noise schedule, which subtracting the current Phi_t does not);
- train / eval: a step in eval mode is refused and changes nothing; checkpoints resume
  exactly in train and in eval mode; a parameter joining a group late is refused;
- validation: every bad hyper-parameter is a ValueError naming it.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import dpkern
from dpkern import rules
from dpkern.functional import gaussian_noise
from dpkern.hyper import AdamWScheduleFreeHyper, SGDScheduleFreeHyper

from conftest import case_seed
from twin import feed, need_backend, twin_pair, twin_run

schedulefree = pytest.importorskip("schedulefree")

SHAPES = [(7,), (5, 3), (3, 4, 5)]
B = 4
SWAPS = (2, 3, 5)  # eval() / train() after these steps

SGD_OPTIONS = {
    "defaults": {},
    "wd_warmup_r_power": dict(
        momentum=0.8, weight_decay=0.05, warmup_steps=3, r=0.5, weight_lr_power=1.0
    ),
    "long_warmup_no_weighting": dict(momentum=0.5, warmup_steps=10, weight_lr_power=0.0),
}
ADAMW_OPTIONS = {
    "defaults": {},
    "betas_eps_wd_warmup_r": dict(
        betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, warmup_steps=3, r=1.0
    ),
    "long_warmup_no_weighting": dict(betas=(0.95, 0.9), warmup_steps=10, weight_lr_power=0.0),
}
TWIN_CASES = [("sgd", k) for k in SGD_OPTIONS] + [("adamw", k) for k in ADAMW_OPTIONS]


#: kind: (dpkern class, schedulefree class, (lr of the first group, the constructor's lr))
KINDS = {
    "sgd": (dpkern.DPSGDScheduleFree, schedulefree.SGDScheduleFree, (0.3, 0.5)),
    "adamw": (dpkern.DPAdamWScheduleFree, schedulefree.AdamWScheduleFree, (0.03, 0.01)),
}


def _same_group_scalars(dp, a, twin, b, t, msg):
    for g, h in zip(dp.param_groups, twin.param_groups, strict=True):
        assert g["train_mode"] == h["train_mode"] and g["k"] == h["k"], msg
        for name in ("weight_sum", "lr_max", "scheduled_lr"):
            assert g[name] == pytest.approx(h[name], rel=1e-12), (msg, name)


def _twin_run(kind, option, backend, steps=6, shapes=SHAPES):
    """The parameters (y), the states and the group scalars after every step and around
    the eval() / train() switches after SWAPS; the eval-mode x at the end. Two param
    groups with different lr."""
    seed = case_seed(len(kind) * 100 + len(option) * 10 + len(backend))
    options = (SGD_OPTIONS if kind == "sgd" else ADAMW_OPTIONS)[option]
    dp_cls, twin_cls, (lr0, lr) = KINDS[kind]
    twin_run(dp_cls, twin_cls, {"lr": lr, **options}, backend, shapes=shapes, steps=steps, B=B,
             seed=seed, lrs=(lr0, None), swaps=SWAPS, check=_same_group_scalars)  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("kind,option", TWIN_CASES, ids=[f"{k}-{o}" for k, o in TWIN_CASES])
def test_twin_trajectory_and_eval_x(kind, option, backend):
    _twin_run(kind, option, backend)


@pytest.mark.triton
@pytest.mark.parametrize(
    "kind,option", [("sgd", "wd_warmup_r_power"), ("adamw", "betas_eps_wd_warmup_r")]
)
def test_twin_triton(kind, option):
    _twin_run(kind, option, "triton", steps=4, shapes=[(3,), (2, 3)])


def test_reference_twin_is_bit_exact():
    """The reference mirrors schedulefree op by op (torch.lerp, add_ with alpha): equal bits."""
    dp_cls, twin_cls, (lr0, lr) = KINDS["adamw"]
    options = {"lr": lr, **ADAMW_OPTIONS["betas_eps_wd_warmup_r"]}
    dp, a, twin, b, gen = twin_pair(dp_cls, twin_cls, options, "torch", shapes=SHAPES, B=B,
                                    seed=3, lrs=(lr0, None))  # fmt: skip
    dp.train()
    twin.train()
    for _ in range(4):
        feed(a, b, gen, B)
        dp.step()
        twin.step()
    dp.eval()
    twin.eval()
    for p, q in zip(a, b):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------------------------
# The noise bias correction (DP-AdamW only)
# ---------------------------------------------------------------------------------------
SCHEDULE = [(1.0, 1.0, 4.0), (2.5, 0.5, 3.0), (0.3, 2.0, 6.0), (0.0, 1.0, 4.0), (1.2, 0.8, 5.0)]


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_phi_recursion_and_corrected_denominator_by_hand(backend):
    """phi_t = beta2 phi + (1 - beta2) (sigma_t C_t / B_e,t)^2 with sigma, C, B_e changing
    between steps, and y, z, v by hand in float64 from the noise of SPEC section 3, with
    the denominator sqrt(max(v_hat - phi_hat, gamma)) (the floor active in some
    coordinates, not in others)."""
    need_backend(backend)
    seed = case_seed(11)
    gen = torch.Generator().manual_seed(seed)
    n, beta1, beta2, gamma, wd, lr = 301, 0.9, 0.95, 2e-3, 0.05, 0.02
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    opt = dpkern.DPAdamWScheduleFree(
        [p], lr=lr, betas=(beta1, beta2), weight_decay=wd, warmup_steps=2, r=0.5,
        noise_bias_correction=True, gamma=gamma, max_grad_norm=1.0, noise_multiplier=1.0,
        expected_batch_size=4.0, seed=seed, backend=backend,
    )  # fmt: skip
    opt.train()
    y = p.detach().double().clone()
    z, v, phi = y.clone(), torch.zeros(n, dtype=torch.float64), 0.0
    phi_kept = 0.0
    weight_sum, lr_max = 0.0, -1.0
    floored = unfloored = 0
    for t, (sigma, Cn, B_e) in enumerate(SCHEDULE, start=1):
        opt.noise_multiplier, opt.max_grad_norm, opt.expected_batch_size = sigma, Cn, B_e
        g = 0.3 * Cn * torch.randn(n, generator=gen) / math.sqrt(n)  # norm < C: unclipped
        p.grad_sample = g[None]
        opt.step()
        noise = gaussian_noise(n, key=seed, step=t, backend="torch").double()
        g_hat = (g.double() + sigma * Cn * noise) / B_e
        Phi = (sigma * Cn / B_e) ** 2
        stored = float(opt.state[p]["noise_var_avg"])  # float32, like every state
        assert stored == pytest.approx(beta2 * phi_kept + (1 - beta2) * Phi, rel=2**-23, abs=0)
        phi = beta2 * phi + (1 - beta2) * Phi
        assert stored == pytest.approx(phi, rel=1e-6, abs=0)
        phi_kept = stored
        v = beta2 * v + (1 - beta2) * g_hat**2
        radicand = v / (1 - beta2**t) - phi / (1 - beta2**t)
        floored += int((radicand < gamma).sum())
        unfloored += int((radicand > gamma).sum())
        u = g_hat / torch.sqrt(torch.clamp(radicand, min=gamma)) + wd * y
        lr_t = lr * min(1.0, t / 2)
        lr_max = max(lr_t, lr_max)
        w = t**0.5 * lr_max**2
        weight_sum += w
        c = w / weight_sum
        y = (1 - c) * y + c * z + lr_t * (beta1 * (1 - c) - 1) * u
        z = z - lr_t * u
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"].double(), v, rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(opt.state[p]["z"].double(), z, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(p.detach().double(), y, rtol=1e-4, atol=1e-6)
    assert floored > 0 and unfloored > 0


def test_correction_follows_a_noise_schedule():
    """The claimed benefit: with sigma changing between steps, v_hat - phi_hat estimates the
    noiseless second moment g^2 (phi follows the noise that entered v), while subtracting
    the current Phi_t is off by 2-5 g^2. Monte Carlo over 640k coordinates, lr = 0 so
    the gradient stays g; |bias| within 20% of g^2. The standard error of the mean of
    v_hat is about Phi sqrt(2 / n) = 16 g^2 * 0.0018 = 0.028 g^2 at t = 1, so 20% is 7
    standard errors (at 40k coordinates it was 1.8: a failure in 13 runs)."""
    n, g0, Cn, beta2 = 640_000, 0.01, 16.0, 0.5  # per-sample norm 8 < C: unclipped
    p = torch.nn.Parameter(torch.zeros(n))
    opt = dpkern.DPAdamWScheduleFree(
        [p], lr=0.0, betas=(0.9, beta2), noise_bias_correction=True, max_grad_norm=Cn,
        noise_multiplier=0.0025, expected_batch_size=1.0, seed=case_seed(12), backend="torch",
    )  # fmt: skip
    opt.train()
    for t, sigma in enumerate([0.0025, 0.000625, 0.000625], start=1):  # sigma C as before
        opt.noise_multiplier = sigma
        p.grad_sample = torch.full((1, n), g0)
        opt.step()
        v_hat = opt.state[p]["exp_avg_sq"].double() / (1 - beta2**t)
        phi_hat = float(opt.state[p]["noise_var_avg"]) / (1 - beta2**t)
        Phi_t = (sigma * Cn) ** 2
        corrected, constant = float((v_hat - phi_hat).mean()), float((v_hat - Phi_t).mean())
        assert abs(corrected - g0**2) < 0.2 * g0**2, (t, corrected)
        if t >= 2:
            assert abs(constant - g0**2) > 1.5 * g0**2, (t, constant)  # 5 and 2.1 g^2


def test_correction_off_keeps_no_phi_and_sgd_refuses_it():
    p = torch.nn.Parameter(torch.randn(3))
    kw = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2.0, seed=1)
    opt = dpkern.DPAdamWScheduleFree([p], **kw)
    opt.train()
    p.grad_sample = torch.randn(2, 3)
    opt.step()
    assert set(opt.state[p]) == {"z", "exp_avg_sq", "step"}
    with pytest.raises(ValueError, match="noise_bias_correction"):
        dpkern.DPSGDScheduleFree([p], noise_bias_correction=True, **kw)
    assert rules.get("adamw_schedule_free").corrects(AdamWScheduleFreeHyper(lr=1.0,
           noise_bias_correction=True))  # fmt: skip
    assert not rules.get("sgd_schedule_free").corrects(SGDScheduleFreeHyper(lr=1.0))


# ---------------------------------------------------------------------------------------
# train / eval, checkpoints, late parameters
# ---------------------------------------------------------------------------------------
CLASSES = [dpkern.DPSGDScheduleFree, dpkern.DPAdamWScheduleFree]
PRIVACY = dict(max_grad_norm=1.0, noise_multiplier=0.7, expected_batch_size=3.0)


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _step(opt, params, gen):
    for p in params:
        p.grad_sample = torch.randn((3, *p.shape), generator=gen)
    opt.step()


@pytest.mark.parametrize("cls", CLASSES)
def test_step_in_eval_mode_is_refused_and_changes_nothing(cls):
    params = _params()
    opt = cls(params, lr=0.01, warmup_steps=2, seed=3, backend="torch", **PRIVACY)
    gen = torch.Generator().manual_seed(1)
    with pytest.raises(RuntimeError, match=r"not in train mode.*optimizer.train\(\)"):
        _step(opt, params, gen)  # a fresh optimizer is in eval mode, as schedulefree's
    assert not opt.state and opt.dp_step == 0 and params[0].grad_sample is not None
    opt.train()
    opt.step()  # the same grad_sample, not consumed by the refused step
    _step(opt, params, gen)
    opt.eval()
    before = ([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()))
    for p in params:
        p.grad_sample = torch.randn((3, *p.shape), generator=gen)
    for call in (opt.step, opt.accumulate, opt.check_inputs):
        with pytest.raises(RuntimeError, match="not in train mode"):
            call()
    for p, q in zip(params, before[0]):
        assert torch.equal(p, q)
    after = opt.state_dict()
    assert after["param_groups"] == before[1]["param_groups"] and opt.dp_step == 2
    for k, st in before[1]["state"].items():
        for name, val in st.items():
            assert torch.equal(after["state"][k][name], val)
    opt.train()
    opt.step()
    assert opt.dp_step == 3 and opt.param_groups[0]["k"] == 3


@pytest.mark.parametrize("cls", CLASSES)
def test_eval_train_round_trip_and_x(cls):
    """eval() sets p = (y - (1 - beta) z) / beta, train() back to y (float32 rounding);
    a second eval() / train() is a no-op; a frozen parameter with z is swapped too."""
    params = _params()
    opt = cls(params, lr=0.05, seed=3, backend="torch", **PRIVACY)
    opt.train()
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        _step(opt, params, gen)
    beta = opt._beta(opt.param_groups[0])
    y = [p.detach().clone() for p in params]
    opt.eval()
    opt.eval()
    for p, yy in zip(params, y):
        x = (yy.double() - (1 - beta) * opt.state[p]["z"].double()) / beta
        torch.testing.assert_close(p.detach().double(), x, rtol=1e-5, atol=1e-6)
    opt.train()
    opt.train()
    for p, yy in zip(params, y):
        torch.testing.assert_close(p.detach(), yy, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("cls", CLASSES)
def test_state_dict_resume_is_exact_in_train_and_eval_mode(cls, mode):
    """Save after 2 steps (in train mode, or in eval mode with the model holding x, as
    schedulefree recommends), load into a fresh optimizer and fresh parameters: the next
    steps equal the uninterrupted run's, bit for bit (seeded noise); the group scalars
    (k, weight_sum, lr_max, train_mode) come back with the param groups."""
    kw = dict(lr=0.05, warmup_steps=3, r=0.5, weight_decay=0.01, seed=7, backend="torch")
    if cls is dpkern.DPAdamWScheduleFree:
        kw.update(noise_bias_correction=True, gamma=1e-3)
    pa = _params()
    a = cls(pa, **kw, **PRIVACY)
    a.train()
    ga = torch.Generator().manual_seed(5)
    for _ in range(2):
        _step(a, pa, ga)
    if mode == "eval":
        a.eval()
    sd = copy.deepcopy(a.state_dict())
    saved_params = [p.detach().clone() for p in pa]
    assert sd["param_groups"][0]["k"] == 2 and sd["param_groups"][0]["train_mode"] == (
        mode == "train"
    )
    pb = [torch.nn.Parameter(p.clone()) for p in saved_params]
    b = cls(pb, **{**kw, "seed": 1}, **PRIVACY)
    b.load_state_dict(sd)
    assert b.state_dict()["param_groups"] == sd["param_groups"]
    gb = copy.deepcopy(ga)
    if mode == "eval":
        a.train()
        b.train()
    for _ in range(2):
        _step(a, pa, ga)
        _step(b, pb, gb)
        for x, y in zip(pa, pb):
            assert torch.equal(x, y)
    a.eval()
    b.eval()
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)


@pytest.mark.parametrize("cls", CLASSES)
def test_load_rejects_bad_group_scalars(cls):
    params = _params()
    opt = cls(params, seed=1, backend="torch", **PRIVACY)
    sd = opt.state_dict()
    for key, value in (("k", -1), ("k", 1.5), ("train_mode", "yes"), ("weight_sum", -1.0)):
        bad = copy.deepcopy(sd)
        bad["param_groups"][0][key] = value
        with pytest.raises(ValueError, match=key):
            opt.load_state_dict(bad)
    assert opt.param_groups[0]["k"] == 0 and opt.param_groups[0]["train_mode"] is False


@pytest.mark.parametrize("cls", CLASSES)
def test_a_parameter_joining_a_group_late_is_refused(cls):
    params = _params()
    params[1].requires_grad_(False)
    opt = cls(params, lr=0.05, seed=1, backend="torch", **PRIVACY)
    opt.train()
    gen = torch.Generator().manual_seed(0)
    live = [params[0], params[2]]
    _step(opt, live, gen)
    params[1].requires_grad_(True)
    with pytest.raises(ValueError, match="joins a group after its first step"):
        _step(opt, params, gen)
    assert opt.dp_step == 1 and opt.param_groups[0]["k"] == 1
    late = torch.nn.Parameter(torch.randn(4))
    params[1].requires_grad_(False)
    opt.add_param_group({"params": [late]})  # its own group: its own averaging
    opt.train()  # the new group starts in eval mode, as schedulefree's
    _step(opt, live + [late], gen)
    assert [g["k"] for g in opt.param_groups] == [2, 1]


# ---------------------------------------------------------------------------------------
# Validation and the registry
# ---------------------------------------------------------------------------------------
BAD = {
    dpkern.DPSGDScheduleFree: [
        ("momentum", 0.0), ("momentum", 1.0), ("noise_bias_correction", True),
    ],
    dpkern.DPAdamWScheduleFree: [
        ("betas", (0.0, 0.9)), ("betas", (0.9, 1.0)), ("eps", 0.0), ("gamma", -1.0),
        ("noise_bias_correction", "yes"),
    ],
}  # fmt: skip
COMMON_BAD = [
    ("lr", -0.1), ("weight_decay", -1.0), ("warmup_steps", -1), ("warmup_steps", 1.5),
    ("warmup_steps", True), ("r", -0.5), ("r", float("inf")), ("weight_lr_power", -2.0),
]  # fmt: skip


@pytest.mark.parametrize("cls", CLASSES)
def test_bad_hyper_parameters_are_value_errors_naming_them(cls):
    for name, value in COMMON_BAD + BAD[cls]:
        with pytest.raises(ValueError, match=name.split("[")[0]):
            cls(_params(), **{name: value}, **PRIVACY)
    with pytest.raises(ValueError, match="lr_max"):
        SGDScheduleFreeHyper(lr=1.0, lr_max=-0.5)
    with pytest.raises(ValueError, match="weight_sum"):
        AdamWScheduleFreeHyper(lr=1.0, weight_sum=float("nan"))


def test_registry_entries():
    sgd, adamw = rules.get("sgd_schedule_free"), rules.get("adamw_schedule_free")
    assert (sgd.cli_name, adamw.cli_name) == ("dp-sgd-schedulefree", "dp-adamw-schedulefree")
    assert sgd.section == adamw.section == "10.8"
    assert sgd.fsdp and adamw.fsdp  # every state parameter-shaped or a scalar
    assert not sgd.second_moment and adamw.second_moment and adamw.noise_bias_correction
    assert sgd.kernel_state_names == ("z",) and adamw.kernel_state_names == ("z", "exp_avg_sq")
    assert len(sgd.lr_grid) == len(adamw.lr_grid) == 4
    assert dpkern.DPSGDScheduleFree is dpkern.optim.DPSGDScheduleFree
    h = AdamWScheduleFreeHyper(lr=0.01, warmup_steps=4, r=1.0, weight_sum=0.5, lr_max=0.002)
    lr, lr_max, weight_sum, c = rules.schedule_free_scalars(h, 2)
    assert (lr, lr_max) == (0.005, 0.005)
    assert weight_sum == pytest.approx(0.5 + 2 * 0.005**2) and c == pytest.approx(
        2 * 0.005**2 / weight_sum
    )
    zero = SGDScheduleFreeHyper(lr=0.0)  # w_t = 0 and W_t = 0: c_t = 0, as schedulefree
    assert rules.schedule_free_scalars(zero, 1)[3] == 0.0


def test_functional_dp_step_runs_the_rule():
    """dpkern.functional.dp_step with the hyper dataclass (the caller keeps weight_sum and
    lr_max): z starts at p at step 1, and c_1 = 1 makes y = z - lr (1 - ...) u."""
    p = torch.randn(5)
    states = {"z": [torch.zeros(5)]}
    gs = torch.randn(2, 5)
    h = SGDScheduleFreeHyper(lr=0.1)
    before = p.clone()
    dpkern.functional.dp_step(
        h, [p], [gs], states, step=1, key=3, max_grad_norm=1e6, noise_multiplier=0.0,
        expected_batch_size=2.0, backend="torch",
    )  # fmt: skip
    g = gs.mean(0)
    torch.testing.assert_close(states["z"][0], before - 0.1 * g)
    torch.testing.assert_close(p, before + 0.1 * (0.9 * 0 - 1) * g)
