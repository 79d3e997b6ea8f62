"""dpkern's optimizers (backend="torch") against an independent model of SPEC.md.

The model, ``tests/spec_model.py``, is a float64 transcription of SPEC sections 2, 4, 5
and 7 written from the SPEC text alone; only the noise z comes from dpkern (pinned by the
known-answer vectors elsewhere). Each case runs several steps (bias corrections, MacAdam's
t >= 2 scale update) over several parameter groups with different lr, odd shapes, a
scalar, 40 small tensors, a frozen parameter and a parameter without grad_sample, with a
batch size sequence that includes B = 1 and B = 0. Inputs are fresh random numbers; the
seed is in every failure message.

Also: the torch.optim twins (sigma = 0, huge C: DP-x == x on the mean gradient), DP-AdamBC's
phi_hat == Phi, DP-MacAdam's kappa_t and scale rule read off the optimizer's own state,
and gradient accumulation == one step on the concatenated batch.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from dpkern import rules
from dpkern.optim import DPAdam, DPAdamBC, DPAdamW, DPAdamWBC, DPMacAdam, DPSGD

from spec_model import SpecOptimizer, kappa

CLASSES = {name: spec.optimizer_class() for name, spec in rules.RULES.items()}

# name -> (rule, hyper-parameters shared by all groups, class kwargs)
CONFIGS = {
    "sgd": ("sgd", {}, {}),
    "sgd_momentum_dampening_wd": ("sgd", dict(momentum=0.9, dampening=0.3, weight_decay=0.05), {}),
    "sgd_nesterov_wd": ("sgd", dict(momentum=0.8, nesterov=True, weight_decay=0.02), {}),
    "adam": ("adam", {}, {}),
    "adam_wd_betas_eps": ("adam", dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1), {}),
    "adam_bc": ("adam_bc", dict(betas=(0.9, 0.99)), {}),
    "adam_bc_wd_gamma": ("adam_bc", dict(gamma=1e-4, weight_decay=0.05), {}),
    "adamw": ("adamw", dict(weight_decay=0.1), {}),
    "adamw_defaults": ("adamw", {}, {}),
    "adamw_bc": ("adamw_bc", dict(weight_decay=0.1, gamma=1e-6, betas=(0.85, 0.995)), {}),
    "macadam_defaults": ("macadam", {}, {}),
    "macadam_unbiased": ("macadam", dict(h1=1e-12, h2=1e3), {}),
    "macadam_paper": ("macadam", dict(h1=1e-12, h2=1e3, variance_estimate="paper"), {}),
    "macadam_code": (
        "macadam",
        dict(h1=1e-12, h2=1e3, variance_estimate="code", betas=(0.8, 0.99), gamma=1e-6),
        {},
    ),
    "macadam_b_init": ("macadam", dict(h1=1e-10, h2=1e2), dict(b_init=0.05)),
    # SPEC 10.8
    "sgd_schedule_free": ("sgd_schedule_free", {}, {}),
    "sgd_schedule_free_wd_warmup": (
        "sgd_schedule_free",
        dict(momentum=0.8, weight_decay=0.05, warmup_steps=3, r=0.5, weight_lr_power=1.0),
        {},
    ),
    "adamw_schedule_free": ("adamw_schedule_free", {}, {}),
    "adamw_schedule_free_wd_warmup": (
        "adamw_schedule_free",
        dict(betas=(0.85, 0.99), eps=1e-6, weight_decay=0.05, warmup_steps=2, r=1.0),
        {},
    ),
    "adamw_schedule_free_bc": (
        "adamw_schedule_free",
        dict(noise_bias_correction=True, gamma=1e-4, weight_decay=0.02, warmup_steps=2),
        {},
    ),
    "rmsprop": ("rmsprop", {}, {}),
    "rmsprop_wd_momentum": (
        "rmsprop",
        dict(alpha=0.9, eps=1e-6, weight_decay=0.05, momentum=0.8),
        {},
    ),
    "rmsprop_centered": ("rmsprop", dict(centered=True, momentum=0.5, alpha=0.95), {}),
    "rmsprop_bc": ("rmsprop", dict(noise_bias_correction=True, gamma=1e-4, alpha=0.9), {}),
    "adagrad": ("adagrad", {}, {}),
    "adagrad_decay_wd_init": (
        "adagrad",
        dict(lr_decay=0.1, weight_decay=0.05, initial_accumulator_value=0.3),
        {},
    ),
    "adagrad_bc": (
        "adagrad",
        dict(noise_bias_correction=True, gamma=1e-4, initial_accumulator_value=0.1),
        {},
    ),
    "adadelta": ("adadelta", {}, {}),
    "adadelta_wd_rho_eps": ("adadelta", dict(weight_decay=0.05, rho=0.8, eps=1e-5), {}),
    "adadelta_bc": ("adadelta", dict(noise_bias_correction=True, gamma=1e-4, rho=0.85), {}),
    "ademamix": ("ademamix", {}, {}),
    "ademamix_wd_warmup": (
        "ademamix",
        dict(weight_decay=0.1, t_alpha_beta3=3, betas=(0.8, 0.99, 0.999), alpha=2.0),
        {},
    ),
    "ademamix_bc": (
        "ademamix",
        dict(noise_bias_correction=True, gamma=1e-4, weight_decay=0.05, t_alpha_beta3=2),
        {},
    ),
    "radam": ("radam", {}, {}),
    "radam_wd_betas_eps": ("radam", dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1), {}),
    "radam_decoupled_bc": (
        "radam",
        dict(weight_decay=0.1, decoupled_weight_decay=True, noise_bias_correction=True, gamma=1e-6),
        {},
    ),
    "lion": ("lion", {}, {}),
    "lion_wd_betas": ("lion", dict(betas=(0.95, 0.98), weight_decay=0.3), {}),
    # SPEC 10.7
    "adafactor": ("adafactor", {}, {}),
    "adafactor_wd_d_eps": (
        "adafactor",
        dict(weight_decay=0.1, d=1.5, eps=(1e-4, 1e-2), beta2_decay=-0.6),
        {},
    ),
    "adafactor_bc": ("adafactor", dict(noise_bias_correction=True, gamma=1e-3), {}),
}
LRS = (0.05, 0.02, 0.1)  # one per parameter group
SGD_LRS = (0.2, 0.1, 0.3)

# Parameter layout: (shape, kind), kind "train" | "frozen" | "nogs" (no grad_sample ever).
LAYOUT = [
    [((), "train"), ((7,), "train"), ((4,), "frozen"), ((3, 5), "train"), ((6,), "nogs")],
    [((33, 17), "train"), ((2, 1, 3), "frozen")],
    [((1 + k % 3,), "train") for k in range(40)],  # many small tensors
]
BATCHES = (4, 1, 0, 5)  # B per step: B = 1 and an empty batch (B = 0) included
C = 0.7  # not 1, so that sigma and sigma * C differ


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def tol(dtype):
    """fp32: rtol 1e-5. bf16: 2^-7 relative, i.e. the parameters may differ by one bf16
    rounding (2^-8) each way where float32 and float64 land on opposite sides of a tie
    (per step: the bf16 test re-syncs the model to the optimizer's parameters after each
    comparison, since such splits in successive steps add up)."""
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-6)
    return dict(rtol=2.0**-7, atol=1e-4)


def make_params(layout, dtype, gen):
    """nn.Parameters for a layout; returns (groups of params, trainable list, nogs set)."""
    groups, trainable, nogs = [], [], set()
    for grp in layout:
        ps = []
        for shape, kind in grp:
            p = torch.nn.Parameter(
                torch.randn(shape, generator=gen).to(dtype), requires_grad=kind != "frozen"
            )
            ps.append(p)
            if kind != "frozen":
                trainable.append(p)
            if kind == "nogs":
                nogs.add(len(trainable) - 1)
        groups.append(ps)
    return groups, trainable, nogs


def make_grads(trainable, nogs, B, gen, dtype, scale=1.0):
    """Per-sample gradients, per-sample norms spread over [0.1, 10] x scale (some clipped)."""
    d = sum(p.numel() for p in trainable)
    s = scale * torch.exp(torch.empty(B).uniform_(math.log(0.1), math.log(10.0), generator=gen))
    out = []
    for k, p in enumerate(trainable):
        if k in nogs:
            out.append(None)
        else:
            g = torch.randn((B, *p.shape), generator=gen)
            out.append((g * s.reshape(B, *([1] * p.dim())) / math.sqrt(d)).to(dtype))
    return out


def set_grad_samples(trainable, grads):
    for p, g in zip(trainable, grads):
        p.grad_sample = g


def build(config, dtype, sigma, seed, *, layout=LAYOUT, B_e=4.0, lrs=None):
    """dpkern optimizer (backend torch, seed=) and the SPEC model on the same start."""
    rule, hyper, cls_kwargs = CONFIGS[config]
    gen = torch.Generator().manual_seed(seed)
    groups, trainable, nogs = make_params(layout, dtype, gen)
    lrs = lrs or (SGD_LRS if rule == "sgd" else LRS)
    pgroups = [dict(params=ps, lr=lr, **hyper) for ps, lr in zip(groups, lrs)]
    privacy = dict(noise_multiplier=sigma, expected_batch_size=B_e)
    if rule != "macadam":
        privacy["max_grad_norm"] = C
    opt = CLASSES[rule](pgroups, seed=seed, backend="torch", **privacy, **cls_kwargs)
    if hasattr(opt, "train"):  # schedule-free (SPEC 10.8): train mode before stepping
        opt.train()
    model = SpecOptimizer(
        rule,
        [dict(g) for g in pgroups],
        max_grad_norm=C,
        noise_multiplier=sigma,
        expected_batch_size=B_e,
        key=seed,
        b_init=cls_kwargs.get("b_init"),
    )
    if hasattr(opt, "train"):
        model.train()
    return opt, model, trainable, nogs, gen


STATE_CHECKS = {
    "sgd": ("momentum_buffer",),
    "adam": ("exp_avg", "exp_avg_sq"),
    "adam_bc": ("exp_avg", "exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq"),
    "adamw_bc": ("exp_avg", "exp_avg_sq"),
    "macadam": ("exp_avg", "exp_avg_sq", "exp_var", "scale"),
    "sgd_schedule_free": ("z",),
    "adamw_schedule_free": ("z", "exp_avg_sq"),
    "rmsprop": ("square_avg", "momentum_buffer", "grad_avg"),
    "adagrad": ("sum",),
    "adadelta": ("square_avg", "acc_delta", "acc_delta_noise_var"),
    "ademamix": ("exp_avg", "exp_avg_slow", "exp_avg_sq"),
    "radam": ("exp_avg", "exp_avg_sq"),
    "lion": ("exp_avg",),
    "adafactor": ("row_var", "col_var"),
}


def assert_close_with_slack(actual, expected, *, rtol, atol, slack=None, msg=""):
    """|actual - expected| <= atol + rtol |expected| + slack, elementwise (float64)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, msg
    allowed = atol + rtol * expected.abs() + (0 if slack is None else slack)
    excess = (actual - expected).abs() - allowed
    if actual.numel() and not bool((excess <= 0).all()):
        i = int(excess.reshape(-1).argmax())
        raise AssertionError(
            f"{msg}: {int((excess > 0).sum())}/{actual.numel()} elements differ; worst at "
            f"flat index {i}: {float(actual.reshape(-1)[i])!r} vs "
            f"{float(expected.reshape(-1)[i])!r} (allowed {float(allowed.reshape(-1)[i]):.3g})"
        )


def compare(opt, model, trainable, dtype, msg, states=True):
    """Parameters (and states, which must be float32) of dpkern vs the model."""
    t = tol(dtype)
    for k, (p, q, slack) in enumerate(zip(trainable, model.params(), model.slacks())):
        assert p.dtype == dtype
        assert_close_with_slack(p, q, **t, slack=slack, msg=f"{msg}: param {k} {tuple(p.shape)}")
        if not states:
            continue
        st, ref, ref_slack = opt.state[p], model.state(k), model.state_slack(k)
        names = STATE_CHECKS[model.rule]
        if model.rule == "sgd" and all(g["momentum"] == 0 for g in opt.param_groups):
            names = ()
        if model.rule == "rmsprop":  # momentum_buffer / grad_avg only where used (SPEC 10.1)
            h = opt.param_groups[0]
            names = tuple(
                n for n, used in zip(names, (True, h["momentum"] > 0, h["centered"])) if used
            )
        if "acc_delta_noise_var" in names and not opt.param_groups[0]["noise_bias_correction"]:
            names = ("square_avg", "acc_delta")  # psi is kept with the correction only
        for name in names:
            assert st[name].dtype == torch.float32, (msg, name)
            assert st[name].shape == ref[name].shape, (msg, name)
            # states may carry the bf16 rounding of the parameters they were built from
            assert_close_with_slack(
                st[name],
                ref[name],
                rtol=t["rtol"] * 10,
                atol=t["atol"],
                slack=ref_slack[name],
                msg=f"{msg}: {name} of param {k}",
            )


@pytest.mark.parametrize(
    "dtype,sigma",
    [(torch.float32, 0.0), (torch.float32, 1.3), (torch.bfloat16, 1.3)],
    ids=["fp32-sigma0", "fp32-sigma1.3", "bf16-sigma1.3"],
)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_optimizer_matches_spec(config, sigma, dtype):
    """Every class over 4 steps (B = 4, 1, 0, 5), 3 groups, frozen and unused params."""
    seed = fresh_seed()
    opt, model, trainable, nogs, gen = build(config, dtype, sigma, seed)
    frozen = [p for g in opt.param_groups for p in g["params"] if not p.requires_grad]
    frozen_before = [p.detach().clone() for p in frozen]
    nogs_moved = False  # checked per step: DP-Lion's +-lr sign steps may cancel over all 4
    for t, B in enumerate(BATCHES, start=1):
        grads = make_grads(trainable, nogs, B, gen, dtype)
        set_grad_samples(trainable, grads)
        nogs_before = trainable[min(nogs)].detach().clone()
        opt.step()
        nogs_moved = nogs_moved or not torch.equal(trainable[min(nogs)], nogs_before)
        model.step(grads)
        assert opt.dp_step == t
        compare(opt, model, trainable, dtype, f"{config} sigma={sigma} seed={seed} t={t} B={B}")
        if dtype == torch.bfloat16:  # each step from the same start: one-ulp splits of a
            model.sync_params(trainable)  # tie would otherwise add up over the 4 steps
    for p, before in zip(frozen, frozen_before):  # frozen: skipped entirely
        assert torch.equal(p, before) and p not in opt.state
    # (DP-Adadelta's first steps move by about lr sqrt(eps): below a bf16 ulp)
    tiny = model.rule == "adadelta" and dtype == torch.bfloat16
    if not tiny and (
        sigma > 0 or (dtype == torch.float32 and opt.param_groups[0].get("weight_decay", 0) > 0)
    ):
        # a parameter with no grad_sample is still noised / decayed / updated
        assert nogs_moved, f"{config} seed={seed}: a parameter without grad_sample never moved"


@pytest.mark.parametrize(
    "config",
    [
        "sgd_nesterov_wd",
        "adam_wd_betas_eps",
        "adam_bc",
        "adamw_bc",
        "macadam_unbiased",
        "macadam_code",
        "sgd_schedule_free_wd_warmup",
        "adamw_schedule_free_bc",
        "rmsprop_wd_momentum",
        "adagrad_bc",
        "adadelta_bc",
        "ademamix_bc",
        "adafactor_bc",
    ],
)
def test_gradient_accumulation_equals_concatenated_batch(config):
    """accumulate(mb1) [+ accumulate(mb2)] + step() == step() on cat(mb1, mb2), 3 steps,
    and both equal the SPEC model; the noise is added once per logical batch."""
    seed = fresh_seed()
    opt_a, model, trainable_a, nogs, gen = build(config, torch.float32, 0.9, seed)
    opt_b, _, trainable_b, _, _ = build(config, torch.float32, 0.9, seed)
    for t in range(1, 4):
        mb1 = make_grads(trainable_a, nogs, 3, gen, torch.float32)
        mb2 = make_grads(trainable_a, nogs, 2 if t != 2 else 0, gen, torch.float32)
        set_grad_samples(trainable_a, mb1)
        opt_a.accumulate()
        assert all(getattr(p, "grad_sample", None) is None for p in trainable_a)
        set_grad_samples(trainable_a, mb2)
        if t == 3:  # the last micro-batch may also be folded in by step() itself
            opt_a.step()
        else:
            opt_a.accumulate()
            opt_a.step()
        cat = [None if a is None else torch.cat([a, b]) for a, b in zip(mb1, mb2)]
        set_grad_samples(trainable_b, cat)
        opt_b.step()
        model.accumulate(mb1)
        model.step(mb2)
        msg = f"{config} seed={seed} t={t}"
        for k, (pa, pb, slack) in enumerate(zip(trainable_a, trainable_b, model.slacks())):
            assert_close_with_slack(
                pa, pb, rtol=1e-5, atol=1e-6, slack=2 * slack, msg=f"{msg} param {k}"
            )
        compare(opt_a, model, trainable_a, torch.float32, msg)


# --------------------------------------------------------------------------------------
# torch.optim twins: sigma = 0 and a huge C make the privatised gradient the mean gradient
# --------------------------------------------------------------------------------------
TWINS = {
    "adamw": (DPAdamW, torch.optim.AdamW, dict(weight_decay=0.1, betas=(0.9, 0.99))),
    "sgd": (DPSGD, torch.optim.SGD, dict(momentum=0.9, nesterov=True, weight_decay=0.05)),
    "sgd_dampening": (DPSGD, torch.optim.SGD, dict(momentum=0.7, dampening=0.4, weight_decay=0.01)),
    "adam": (DPAdam, torch.optim.Adam, dict(weight_decay=0.05, eps=1e-7)),
}


@pytest.mark.parametrize("name", list(TWINS))
def test_torch_optim_twin_on_mean_gradient(name):
    dp_cls, twin_cls, hyper = TWINS[name]
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    shapes = [(), (7,), (3, 5), (33, 17)]
    a = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    lrs = (0.03, 0.01)
    dp = dp_cls(
        [dict(params=a[:2], lr=lrs[0]), dict(params=a[2:], lr=lrs[1])],
        **hyper,
        max_grad_norm=1e6,
        noise_multiplier=0.0,
        expected_batch_size=6,
        seed=seed,
        backend="torch",
    )
    tw = twin_cls([dict(params=b[:2], lr=lrs[0]), dict(params=b[2:], lr=lrs[1])], **hyper)
    for t in range(1, 5):
        gs = [torch.randn((6, *s), generator=gen) for s in shapes]
        for p, q, g in zip(a, b, gs):
            p.grad_sample = g
            q.grad = g.mean(0)
        dp.step()
        tw.step()
        for k, (p, q) in enumerate(zip(a, b)):
            torch.testing.assert_close(
                p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} seed={seed} t={t} param {k}\n{m}"
            )
            for sname, val in tw.state[q].items():
                if sname != "step":  # momentum buffers are sums of O(1) gradients that can
                    # cancel to ~1e-3: allow a few float32 ulps of O(1), as for the params
                    # (1 ulp of 1.0 = 1.2e-7 flaked at atol 1e-7)
                    torch.testing.assert_close(dp.state[p][sname], val, rtol=1e-5, atol=1e-6)


def test_sgd_without_momentum_keeps_no_buffer_then_momentum_switched_on():
    """Like torch.optim.SGD: no momentum_buffer while momentum = 0 (no d floats wasted);
    switched on later, the buffer starts from the current gradient (dampening 0)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7,), (3, 5)]
    a = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    dp = DPSGD(
        a,
        lr=0.1,
        weight_decay=0.01,
        max_grad_norm=1e6,
        noise_multiplier=0.0,
        expected_batch_size=4,
        seed=seed,
        backend="torch",
    )
    tw = torch.optim.SGD(b, lr=0.1, weight_decay=0.01)
    for t in range(1, 6):
        if t == 3:
            dp.param_groups[0]["momentum"] = tw.param_groups[0]["momentum"] = 0.9
        for p, q in zip(a, b):
            p.grad_sample = torch.randn((4, *p.shape), generator=gen)
            q.grad = p.grad_sample.mean(0)
        dp.step()
        tw.step()
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"seed={seed} t={t}")
            assert ("momentum_buffer" in dp.state[p]) == (t >= 3)
            if t >= 3:
                torch.testing.assert_close(
                    dp.state[p]["momentum_buffer"],
                    tw.state[q]["momentum_buffer"],
                    rtol=1e-5,
                    atol=1e-7,
                )


# --------------------------------------------------------------------------------------
# DP-AdamBC's noise variance and DP-MacAdam's scale, read off the optimizer's own state
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [DPAdamBC, DPAdamWBC])
def test_adambc_phi_hat_equals_Phi_with_constant_sigma(cls):
    """phi_t = beta2 phi + (1 - beta2) Phi; phi_hat = phi_t / (1 - beta2^t) == Phi."""
    sigma, B_e, Cn = 1.7, 8.0, 0.6
    ps = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3, 2))]
    opt = cls(
        [dict(params=ps[:1], betas=(0.9, 0.95)), dict(params=ps[1:], betas=(0.8, 0.9))],
        lr=1e-3,
        max_grad_norm=Cn,
        noise_multiplier=sigma,
        expected_batch_size=B_e,
        seed=fresh_seed(),
        backend="torch",
    )
    Phi = (sigma * Cn / B_e) ** 2
    for t in range(1, 6):
        for p in ps:
            p.grad_sample = torch.randn(3, *p.shape)
        opt.step()
        for group in opt.param_groups:
            beta2 = group["betas"][1]
            for p in group["params"]:
                phi = float(opt.state[p]["noise_var_avg"])
                assert phi / (1 - beta2**t) == pytest.approx(Phi, rel=1e-6), (t, beta2)


def test_adambc_noise_schedule_uses_the_ema():
    """With sigma, C, B_e changing between steps, phi follows the EMA of Phi_t (SPEC 5.3)."""
    seed = fresh_seed()
    opt, model, trainable, nogs, gen = build("adam_bc_wd_gamma", torch.float32, 1.0, seed)
    for t, (sigma, Cn, B_e) in enumerate(
        [(1.0, 1.0, 4.0), (2.0, 0.5, 3.0), (0.5, 2.0, 6.0), (0.0, 1.0, 4.0)], start=1
    ):
        opt.noise_multiplier, opt.max_grad_norm, opt.expected_batch_size = sigma, Cn, B_e
        model.set_privacy(noise_multiplier=sigma, max_grad_norm=Cn, expected_batch_size=B_e)
        grads = make_grads(trainable, nogs, 3, gen, torch.float32)
        set_grad_samples(trainable, grads)
        opt.step()
        model.step(grads)
        compare(opt, model, trainable, torch.float32, f"schedule seed={seed} t={t}")
        for gi, group in enumerate(opt.param_groups):
            p = next(p for p in group["params"] if p.requires_grad)
            assert float(opt.state[p]["noise_var_avg"]) == pytest.approx(model.phi[gi], rel=1e-6)


@pytest.mark.parametrize("sigma", [0.0, 2.0])
@pytest.mark.parametrize("h", [(1e-12, 1e3), (1e-9, 1e-6)], ids=["wide", "default_clamp"])
def test_macadam_kappa_and_scale_rule(sigma, h):
    """b keeps b_init = 1/d at t = 1; for t >= 2, from the optimizer's own S and previous b:
    S_hat = clamp(S / kappa_t - b^2 sigma^2 / B_e^2, h1, h2), b = S_hat^(1/4) (sum sqrt S_hat)^(1/2)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    shapes = [(), (9,), (4, 6), (2, 3, 5)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    frozen = torch.nn.Parameter(torch.randn(11), requires_grad=False)
    B_e, beta1 = 5.0, 0.85
    opt = DPMacAdam(
        [dict(params=ps[:2] + [frozen]), dict(params=ps[2:], lr=0.02)],
        lr=0.01,
        betas=(beta1, 0.99),
        h1=h[0],
        h2=h[1],
        noise_multiplier=sigma,
        expected_batch_size=B_e,
        seed=seed,
        backend="torch",
    )
    d = sum(p.numel() for p in ps)  # frozen coordinates are not owned for noise or scale
    for t in range(1, 5):
        b_prev = [opt.state[p]["scale"].double().clone() for p in ps] if t > 1 else None
        for p in ps:
            p.grad_sample = torch.randn((4, *p.shape), generator=gen) * 0.3
        opt.step()
        b = [opt.state[p]["scale"].double() for p in ps]
        if t == 1:
            for x in b:
                torch.testing.assert_close(x, torch.full_like(x, 1.0 / d), rtol=1e-7, atol=0)
            continue
        k = kappa(beta1, t)
        assert k == pytest.approx(
            2 * sum(beta1**j for j in range(1, t)) * (1 - beta1) / (1 + beta1)
        )
        parts = [
            (opt.state[p]["exp_var"].double() / k, bp**2 * sigma**2 / B_e**2)
            for p, bp in zip(ps, b_prev)
        ]
        S_hat = [torch.clamp(a - n, h[0], h[1]) for a, n in parts]
        total = sum(float(s.sqrt().sum()) for s in S_hat)
        for x, s, (a, n) in zip(b, S_hat, parts):
            expected = s**0.25 * math.sqrt(total)
            # float32 cancellation in S/kappa - b^2 sigma^2/B_e^2, a quarter of it in b
            cond = (a.abs() + n) / s
            assert_close_with_slack(
                x,
                expected,
                rtol=1e-5,
                atol=0,
                slack=expected * 2.0**-22 * cond,
                msg=f"seed={seed} t={t}",
            )


def test_macadam_kappa_normalises_the_unbiased_variance():
    """SPEC 7's claim behind kappa_t: with the "unbiased" u and i.i.d. g~ of variance V,
    E[S_t] = V kappa_t (Monte Carlo over 200k coordinates; 1% tolerance, > 10 standard errors)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    beta1, n, V = 0.7, 200_000, 2.5
    m = torch.zeros(n, dtype=torch.float64)
    S = torch.zeros(n, dtype=torch.float64)
    for t in range(1, 7):
        g = 3.0 + math.sqrt(V) * torch.randn(n, generator=gen, dtype=torch.float64)
        m_hat_prev = m / (1 - beta1 ** (t - 1)) if t > 1 else torch.zeros(n, dtype=torch.float64)
        m = beta1 * m + (1 - beta1) * g
        m_hat = m / (1 - beta1**t)
        S = beta1 * S + (1 - beta1) * (g - m_hat_prev) * (g - m_hat)
        if t >= 2:
            assert float(S.mean()) / V == pytest.approx(kappa(beta1, t), rel=1e-2), t


def test_macadam_groups_with_different_betas():
    """beta1 is a group hyper-parameter: w_i uses each group's own m_hat_{t-1} both for the
    norm and for the sum (else the clip factor bounds a different vector than the one that
    is summed, and the sensitivity bound 1 is lost). Gradients = a shared mean + small
    per-sample noise and b_init = 8 (no clipping at t = 1), so m_hat_{t-1} matters."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    layout = [[((7,), "train"), ((3, 4), "train")], [((5, 5), "train")]]
    groups, trainable, nogs = make_params(layout, torch.float32, gen)
    pgroups = [
        dict(params=groups[0], lr=0.02, betas=(0.9, 0.999)),
        dict(params=groups[1], lr=0.05, betas=(0.5, 0.99)),
    ]
    hyper = dict(h1=1e-12, h2=1e3)
    opt = DPMacAdam(
        pgroups,
        **hyper,
        b_init=8.0,
        noise_multiplier=0.5,
        expected_batch_size=3.0,
        seed=seed,
        backend="torch",
    )
    model = SpecOptimizer(
        "macadam",
        [{**g, **hyper} for g in pgroups],
        noise_multiplier=0.5,
        expected_batch_size=3.0,
        key=seed,
        b_init=8.0,
    )
    mean = [torch.randn(p.shape, generator=gen) for p in trainable]
    for t in range(1, 4):
        grads = [mu + 0.1 * torch.randn((3, *mu.shape), generator=gen) for mu in mean]
        set_grad_samples(trainable, grads)
        opt.step()
        model.step(grads)
        compare(opt, model, trainable, torch.float32, f"macadam betas seed={seed} t={t}")


def test_macadam_clipped_row_norm_at_most_one_with_per_group_betas():
    """SPEC 7's sensitivity: every summed whitened row c_i w_i has norm <= 1, also when
    the groups have different beta1. Constructed so that group 1's row, whitened with its
    own m_hat_1 = m_1 / (1 - 0.99), has norm ~2.9 while whitening with group 0's
    beta1 = 0.5 would give 0 (recovered from exp_avg with sigma = 0, B_e = 1)."""
    a, b = torch.nn.Parameter(torch.zeros(10)), torch.nn.Parameter(torch.zeros(10))
    opt = DPMacAdam(
        [dict(params=[a], betas=(0.5, 0.99)), dict(params=[b], betas=(0.99, 0.999))],
        lr=0.01,
        b_init=8.0,
        h1=1e-12,
        h2=1e3,
        noise_multiplier=0.0,
        expected_batch_size=1.0,
        seed=fresh_seed(),
        backend="torch",
    )
    a.grad_sample, b.grad_sample = torch.zeros(3, 10), torch.full((3, 10), 2.5)
    opt.step()  # t = 1: ||w_i|| = 0.99, unclipped
    m1, scale = opt.state[b]["exp_avg"].clone(), opt.state[b]["scale"].clone()
    a.grad_sample, b.grad_sample = torch.zeros(1, 10), (m1 / 0.5)[None]
    opt.step()
    g_tilde = (opt.state[b]["exp_avg"] - 0.99 * m1) / (1 - 0.99)
    summed_row = (g_tilde - m1 / (1 - 0.99)) / scale  # = c_1 w_1 (B = B_e = 1, sigma = 0)
    assert float(summed_row.norm()) <= 1.0 + 1e-5


# --------------------------------------------------------------------------------------
# Schedule-free (SPEC 10.8): train / eval swaps against the model, and the noise schedule
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", ["sgd_schedule_free_wd_warmup", "adamw_schedule_free_wd_warmup"])
def test_schedule_free_eval_train_swaps_match_spec(config):
    """x = (y - (1 - beta) z) / beta in eval mode, y back in train mode, between steps."""
    seed = fresh_seed()
    opt, model, trainable, nogs, gen = build(config, torch.float32, 1.1, seed)
    for t, B in enumerate(BATCHES, start=1):
        grads = make_grads(trainable, nogs, B, gen, torch.float32)
        set_grad_samples(trainable, grads)
        opt.step()
        model.step(grads)
        opt.eval()
        model.eval()
        compare(opt, model, trainable, torch.float32, f"{config} eval seed={seed} t={t}")
        opt.train()
        model.train()
        compare(opt, model, trainable, torch.float32, f"{config} train seed={seed} t={t}")


def test_schedule_free_bc_noise_schedule_uses_the_ema():
    """With sigma, C, B_e changing between steps, phi follows the EMA of Phi_t (SPEC 10.8)."""
    seed = fresh_seed()
    opt, model, trainable, nogs, gen = build("adamw_schedule_free_bc", torch.float32, 1.0, seed)
    for t, (sigma, Cn, B_e) in enumerate(
        [(1.0, 1.0, 4.0), (2.0, 0.5, 3.0), (0.5, 2.0, 6.0), (0.0, 1.0, 4.0)], start=1
    ):
        opt.noise_multiplier, opt.max_grad_norm, opt.expected_batch_size = sigma, Cn, B_e
        model.set_privacy(noise_multiplier=sigma, max_grad_norm=Cn, expected_batch_size=B_e)
        grads = make_grads(trainable, nogs, 3, gen, torch.float32)
        set_grad_samples(trainable, grads)
        opt.step()
        model.step(grads)
        compare(opt, model, trainable, torch.float32, f"sf schedule seed={seed} t={t}")
        for gi, group in enumerate(opt.param_groups):
            p = next(p for p in group["params"] if p.requires_grad)
            assert float(opt.state[p]["noise_var_avg"]) == pytest.approx(model.phi[gi], rel=1e-6)


# --------------------------------------------------------------------------------------
# DP-RAdam (SPEC 10.3): past the warm-up (rho_t > 5 from t = 6), with a noise schedule
# --------------------------------------------------------------------------------------
RADAM_SCHEDULE = [(1.3, 0.7, 4.0), (2.0, 0.5, 3.0), (0.7, 1.0, 5.0), (1.3, 0.7, 4.0)]


@pytest.mark.parametrize("config", ["radam", "radam_wd_betas_eps", "radam_decoupled_bc"])
def test_radam_matches_spec_through_the_rectified_steps(config):
    """10 steps (warm-up t <= 5, rectified after), sigma, C and B_e changing between steps
    (phi follows Phi_t); 3 groups, frozen and unused parameters, B = 0 and 1 included."""
    seed = fresh_seed()
    opt, model, trainable, nogs, gen = build(config, torch.float32, 1.3, seed)
    for t in range(1, 11):
        sigma, Cn, B_e = RADAM_SCHEDULE[t % len(RADAM_SCHEDULE)]
        opt.noise_multiplier, opt.max_grad_norm, opt.expected_batch_size = sigma, Cn, B_e
        model.set_privacy(noise_multiplier=sigma, max_grad_norm=Cn, expected_batch_size=B_e)
        grads = make_grads(trainable, nogs, BATCHES[t % len(BATCHES)], gen, torch.float32)
        set_grad_samples(trainable, grads)
        opt.step()
        model.step(grads)
        compare(opt, model, trainable, torch.float32, f"{config} seed={seed} t={t}")
        for gi, group in enumerate(opt.param_groups):
            p = next(p for p in group["params"] if p.requires_grad)
            if group["noise_bias_correction"]:
                assert float(opt.state[p]["noise_var_avg"]) == pytest.approx(
                    model.phi[gi], rel=1e-6
                )
            else:
                assert "noise_var_avg" not in opt.state[p]
