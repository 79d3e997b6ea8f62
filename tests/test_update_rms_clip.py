"""``update_rms_clip`` (SPEC 10.9): the update direction's RMS over the whole model clipped
to d_u, on DP-AdamW, DP-AdamW-BC and DP-Adafactor.

The ground truth is a small float64 model written here from the SPEC text (it shares no
update code with dpkern; only the noise stream z comes from dpkern, pinned elsewhere by
known-answer vectors). Inputs are fresh random draws (conftest's per-run seed), never zeros.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings

import pytest
import torch

import dpkern
from dpkern import functional as F
from dpkern.functional import gaussian_noise

from conftest import backend_device, case_seed, require_backend

SHAPES = [(5, 3), (7,), (2, 3, 4), (1,), (3, 1)]  # odd sizes, 1-D, 3-D, single elements
CLASSES = {"adamw": dpkern.DPAdamW, "adamw_bc": dpkern.DPAdamWBC, "adafactor": dpkern.DPAdafactor}
KW = {
    "adamw": dict(lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1),
    "adamw_bc": dict(lr=0.05, betas=(0.8, 0.9), gamma=1e-2, weight_decay=0.1),
    "adafactor": dict(lr=0.05, d=4.0, weight_decay=0.1),
}
PRIV = dict(max_grad_norm=1.5, noise_multiplier=0.8, expected_batch_size=3.0)
SEED = 0x5EED1234


def _draw(seed, B, dtype=torch.float32):
    g = torch.Generator().manual_seed(case_seed(seed))
    params = [torch.randn(s, generator=g).to(dtype) for s in SHAPES]
    gss = [[2 * torch.randn((B, *s), generator=g) for s in SHAPES] for _ in range(3)]
    return params, gss


def _optimizer(rule, params, backend="torch", **extra):
    kw = {**KW[rule], **extra}
    return CLASSES[rule](params, **kw, **PRIV, seed=SEED, backend=backend)


def _run(rule, params, gss, steps, backend="torch", **extra):
    """params (copies, as leaves) after ``steps`` steps, and the optimizer."""
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = _optimizer(rule, ps, backend, **extra)
    for k in range(steps):
        for p, gs in zip(ps, gss[k], strict=True):
            p.grad_sample = gs.to(p.dtype).clone()
        opt.step()
    return [p.detach().clone() for p in ps], opt


# ---------------------------------------------------------------------------------------
# The float64 model of SPEC 10.9 (with 2, 4, 5.4, 5.5, 10.7 for the rules)
# ---------------------------------------------------------------------------------------
class Model:
    def __init__(self, rule, params, d_u, lr_of=None):
        self.rule, self.d_u = rule, d_u
        self.h = KW[rule]
        self.lr_of = lr_of or (lambda k: self.h["lr"])
        self.p = [p.double().clone() for p in params]
        self.st = [{} for _ in params]
        self.t, self.phi, self.scales = 0, 0.0, []

    def _g_hats(self, grads):
        C, sigma, Be = PRIV["max_grad_norm"], PRIV["noise_multiplier"], PRIV["expected_batch_size"]
        B = grads[0].shape[0]
        n2 = sum(g.double().flatten(1).square().sum(1) for g in grads)
        c = torch.clamp(C / (n2.sqrt() + 1e-6), max=1.0)
        out, off = [], 0
        for g, p in zip(grads, self.p, strict=True):
            z = gaussian_noise(p.numel(), key=SEED, step=self.t, offset=off).double()
            S = (c.reshape(B, *[1] * p.dim()) * g.double()).sum(0)
            out.append((S + sigma * C * z.reshape(p.shape)) / Be)
            off += p.numel()
        return out, (sigma * C / Be) ** 2

    def _adam_dir(self, k, g, Phi):
        (b1, b2), st, t = self.h["betas"], self.st[k], self.t
        st["m"] = b1 * st.get("m", 0.0) + (1 - b1) * g
        st["v"] = b2 * st.get("v", 0.0) + (1 - b2) * g * g
        m_hat, v_hat = st["m"] / (1 - b1**t), st["v"] / (1 - b2**t)
        if self.rule == "adamw_bc":
            phi_hat = self.phi / (1 - b2**t)
            return m_hat / torch.sqrt(torch.clamp(v_hat - phi_hat, min=self.h["gamma"])), 1.0
        return m_hat / (v_hat.sqrt() + self.h["eps"]), 1.0

    def _adafactor_dir(self, k, g, Phi):
        h, st, t, p = self.h, self.st[k], self.t, self.p[k]
        w, rho, eps1 = t**-0.8, min(h["lr"], t**-0.5), 2.0**-23
        alpha = max(1e-3, float(p.square().mean().sqrt())) * rho
        g2 = g * g
        if p.dim() >= 2:
            st["r"] = (1 - w) * st.get("r", 0.0) + w * g2.mean(-1)
            st["c"] = (1 - w) * st.get("c", 0.0) + w * g2.mean(-2)
            mean = torch.clamp(st["r"].mean(-1), min=eps1)
            V = st["r"].unsqueeze(-1) * st["c"].unsqueeze(-2) / mean[..., None, None]
        else:
            st["r"] = V = (1 - w) * st.get("r", 0.0) + w * g2
        u = g / torch.sqrt(torch.clamp(V, min=eps1 * eps1))
        u = u / max(1.0, float(u.square().mean().sqrt()) / h["d"])  # Adafactor's own clip
        return u, alpha

    def step(self, grads):
        self.t += 1
        g_hats, Phi = self._g_hats(grads)
        if self.rule == "adamw_bc":
            self.phi = self.h["betas"][1] * self.phi + (1 - self.h["betas"][1]) * Phi
        direction = self._adafactor_dir if self.rule == "adafactor" else self._adam_dir
        dirs = [direction(k, g, Phi) for k, g in enumerate(g_hats)]
        n = sum(p.numel() for p in self.p)
        rms = math.sqrt(sum(float(u.square().sum()) for u, _ in dirs) / n)
        s = 1.0 / max(1.0, rms / self.d_u) if self.d_u is not None else 1.0
        self.scales.append(s)
        for k, (u, step_size) in enumerate(dirs):
            lr = self.lr_of(k)
            size = step_size if self.rule == "adafactor" else lr
            self.p[k] = self.p[k] * (1 - lr * self.h["weight_decay"]) - size * s * u
        return rms


def _rms_of(rule, params, gss):
    """The model's RMS of U at the first step (to place d_u above or below it)."""
    m = Model(rule, params, None)
    return m.step(gss[0])


# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("B", [0, 1, 3])
@pytest.mark.parametrize("rule", list(CLASSES))
def test_reference_matches_the_model(rule, B):
    params, gss = _draw(10 + B, B)
    d_u = 0.3 * _rms_of(rule, params, gss)  # active at step 1 (and later, checked below)
    got, _ = _run(rule, params, gss, 3, update_rms_clip=d_u)
    model = Model(rule, params, d_u)
    for k in range(3):
        model.step(gss[k])
    assert max(model.scales) < 0.9, model.scales  # the clip acted at every step
    for a, b in zip(got, model.p, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rule", list(CLASSES))
def test_bf16_parameters_match_the_model(rule):
    params, gss = _draw(20, 3, torch.bfloat16)
    d_u = 0.3 * _rms_of(rule, params, gss)
    got, _ = _run(rule, params, gss, 1, update_rms_clip=d_u)
    model = Model(rule, params, d_u)
    # The model sees the gradients the optimizer saw: rounded to the parameters' bf16. Fed
    # the float32 draws instead, DP-AdamW-BC elements near the gamma floor of
    # sqrt(max(v_hat - phi_hat, gamma)) moved by ~5 % (21 of 900 draws failed).
    model.step([g.to(torch.bfloat16) for g in gss[0]])
    assert model.scales[0] < 0.9
    for a, b in zip(got, model.p, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), b, rtol=1e-2, atol=1e-2)


def test_groups_with_different_lr_share_one_rms():
    params, gss = _draw(30, 3)
    rms = _rms_of("adamw", params, gss)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    lrs = [0.05, 0.05, 0.01, 0.01, 0.01]
    groups = [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.01}]
    opt = dpkern.DPAdamW(groups, **KW["adamw"], update_rms_clip=0.3 * rms, **PRIV, seed=SEED,
                         backend="torch")  # fmt: skip
    model = Model("adamw", params, 0.3 * rms, lr_of=lambda k: lrs[k])
    for k in range(2):
        for p, gs in zip(ps, gss[k], strict=True):
            p.grad_sample = gs.clone()
        opt.step()
        model.step(gss[k])
    assert model.scales[0] < 0.9
    for a, b in zip(ps, model.p, strict=True):
        torch.testing.assert_close(a.detach().double(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rule", ["adamw", "adamw_bc"])
def test_clipped_update_has_rms_d_u(rule):
    """With wd = 0 the applied step divided by lr is s U: its RMS over the model is d_u."""
    params, gss = _draw(40, 3)
    d_u = 0.25 * _rms_of(rule, params, gss)
    got, _ = _run(rule, params, gss, 1, update_rms_clip=d_u, weight_decay=0.0)
    off, _ = _run(rule, params, gss, 1, weight_decay=0.0)
    delta = torch.cat([(p - q).flatten() for p, q in zip(params, got, strict=True)]) / 0.05
    delta_off = torch.cat([(p - q).flatten() for p, q in zip(params, off, strict=True)]) / 0.05
    rms = lambda x: float(x.double().square().mean().sqrt())
    assert rms(delta) == pytest.approx(d_u, rel=1e-4)
    assert rms(delta_off) == pytest.approx(4 * d_u, rel=1e-4)  # the clip changed the step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", list(CLASSES))
def test_inactive_clip_is_the_unclipped_step_bit_for_bit(rule, dtype):
    params, gss = _draw(50, 3, dtype)
    d_u = 10 * _rms_of(rule, params, gss)
    on, opt_on = _run(rule, params, gss, 3, update_rms_clip=d_u)
    off, opt_off = _run(rule, params, gss, 3)
    for a, b in zip(on, off, strict=True):
        assert torch.equal(a, b)
    for p_on, p_off in zip(opt_on.trainable_params(), opt_off.trainable_params(), strict=True):
        for name, x in opt_off.state[p_off].items():
            assert torch.equal(opt_on.state[p_on][name], x), name


@pytest.mark.parametrize("rule", list(CLASSES))
def test_states_and_noise_untouched_by_an_active_clip(rule):
    params, gss = _draw(60, 3)
    d_u = 0.2 * _rms_of(rule, params, gss)
    on, opt_on = _run(rule, params, gss, 1, update_rms_clip=d_u)
    off, opt_off = _run(rule, params, gss, 1)
    assert not any(torch.equal(a, b) for a, b in zip(on, off, strict=True))
    for p_on, p_off in zip(opt_on.trainable_params(), opt_off.trainable_params(), strict=True):
        for name, x in opt_off.state[p_off].items():
            assert torch.equal(opt_on.state[p_on][name], x), name


def test_noiseless_unclipped_is_torch_adamw():
    g = torch.Generator().manual_seed(case_seed(70))
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    kw = dict(lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    opt = dpkern.DPAdamW(ps, **kw, update_rms_clip=1e6, max_grad_norm=1e9,
                         noise_multiplier=0.0, expected_batch_size=1.0, seed=0,
                         backend="torch")  # fmt: skip
    twin = torch.optim.AdamW(qs, **kw)
    for _ in range(4):
        for p, q in zip(ps, qs, strict=True):
            grad = torch.randn(p.shape, generator=g)
            p.grad_sample, q.grad = grad.unsqueeze(0), grad.clone()
        opt.step()
        twin.step()
    for p, q in zip(ps, qs, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", list(CLASSES))
def test_the_docstring_entry_is_an_argument_like_the_others(rule):
    import inspect

    lines = inspect.getdoc(CLASSES[rule]).splitlines()
    (entry,) = [ln for ln in lines if ln.lstrip().startswith("update_rms_clip (")]
    (decay,) = [ln for ln in lines if ln.lstrip().startswith("weight_decay (")]
    indent = len(entry) - len(entry.lstrip())
    assert indent == len(decay) - len(decay.lstrip()) == 4, entry


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "1"])
@pytest.mark.parametrize("rule", list(CLASSES))
def test_bad_values_are_refused(rule, bad):
    ps = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(ValueError, match="update_rms_clip"):
        _optimizer(rule, ps, update_rms_clip=bad)
    opt = _optimizer(rule, ps)
    with pytest.raises(ValueError, match="update_rms_clip"):
        opt.add_param_group(
            {"params": [torch.nn.Parameter(torch.randn(2))], "update_rms_clip": bad}
        )
    assert len(opt.param_groups) == 1


def test_groups_that_differ_are_refused_before_anything_changes():
    params, gss = _draw(80, 2)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = dpkern.DPAdamW([{"params": ps[:2]}, {"params": ps[2:], "update_rms_clip": 0.5}],
                         **KW["adamw"], **PRIV, seed=SEED, backend="torch")  # fmt: skip
    for p, gs in zip(ps, gss[0], strict=True):
        p.grad_sample = gs.clone()
    with pytest.raises(ValueError, match="update_rms_clip"):
        opt.step()
    assert opt.dp_step == 0 and not opt.state
    for p, q in zip(ps, params, strict=True):
        assert torch.equal(p.detach(), q)


@pytest.mark.parametrize("rule", list(CLASSES))
def test_state_dict_round_trip(rule):
    params, gss = _draw(90, 3)
    d_u = 0.3 * _rms_of(rule, params, gss)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = _optimizer(rule, ps, update_rms_clip=d_u)
    for p, gs in zip(ps, gss[0], strict=True):
        p.grad_sample = gs.clone()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert sd["param_groups"][0]["update_rms_clip"] == d_u
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = _optimizer(rule, qs)  # constructed without the option: the checkpoint's wins
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["update_rms_clip"] == d_u
    for o, xs in ((opt, ps), (opt2, qs)):
        for x, gs in zip(xs, gss[1], strict=True):
            x.grad_sample = gs.clone()
        o.step()
    for p, q in zip(ps, qs, strict=True):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------------------------
# Fused backends against the reference (functional layer, two groups)
# ---------------------------------------------------------------------------------------
def _functional_case(rule, B, dtype, device, seed, d_u):
    g = torch.Generator().manual_seed(case_seed(seed))
    params = [torch.randn(s, generator=g).to(dtype).to(device) for s in SHAPES]
    gss = [(2 * torch.randn((B, *s), generator=g)).to(dtype).to(device) for s in SHAPES]
    if rule == "adafactor":  # row_var / col_var as the registry shapes them (>= 0)
        states = {
            st.name: [0.1 * torch.rand(st.shape_for(s), generator=g).to(device) for s in SHAPES]
            for st in dpkern.rules.get(rule).kernel_states
        }
    else:
        states = {
            "exp_avg": [0.1 * torch.randn(s, generator=g).to(device) for s in SHAPES],
            "exp_avg_sq": [0.1 * torch.rand(s, generator=g).to(device) for s in SHAPES],
        }
    offsets = [0]
    for s in SHAPES[:-1]:
        offsets.append(offsets[-1] + math.prod(s))
    hyper_cls = {
        "adamw": dpkern.hyper.AdamWHyper,
        "adamw_bc": dpkern.hyper.AdamWBCHyper,
        "adafactor": dpkern.hyper.AdafactorHyper,
    }[rule]
    groups = []
    for lo, hi, lr, t, d in ((0, 2, 0.05, 3, 1.0), (2, len(SHAPES), 0.01, 2, 4.0)):
        # DP-Adafactor's own clip by d: active in the first group (d = 1), not in the second
        extra = dict(d=d) if rule == "adafactor" else {}
        hyper = hyper_cls(lr=lr, weight_decay=0.1, update_rms_clip=d_u, **extra)
        sl = slice(lo, hi)
        groups.append(
            F.Group(hyper, params[sl], gss[sl], [None] * (hi - lo),
                    {n: v[sl] for n, v in states.items()}, offsets[sl],
                    [f"p{k}" for k in range(lo, hi)], noise_var_avg=0.01, step=t)
        )  # fmt: skip
    return groups


def _functional_rms(groups) -> float:
    """The reference's RMS of U over the groups (pass A on copies)."""
    from dpkern.backends import reference as ref

    groups = copy.deepcopy(groups)
    be, pass1 = F.prepare_step(groups, step=4, max_grad_norm=PRIV["max_grad_norm"],
                               backend="torch")  # fmt: skip
    total = 0.0
    for grp in groups:
        dp = dpkern.hyper.DPStep(key=SEED, step=grp.step, noise_step=4, noise_std=1.2,
                                 expected_batch_size=3.0, noise_var_avg=grp.noise_var_avg)  # fmt: skip
        total += ref.rms_clip_moments(grp.hyper, dp, grp.params, grp.grad_samples,
                                      pass1.clip_factors, grp.summed, grp.states,
                                      grp.offsets)[0]  # fmt: skip
    return math.sqrt(total / sum(p.numel() for grp in groups for p in grp.params))


def _state_slack(before, want, got, gi):
    """Per element of group ``gi``'s parameters: the part of a float32 parameter difference
    that the two runs' moment differences explain (the moments are checked on their own,
    to 1e-5). An Adam-type step is lr s m_hat / D, s = min(1, d_u / rms(U)), U = m_hat / D:
    U's relative error is |dm| / |m| + |dD| / D, with dD / D = |dv| / (2 |v - phi|) (phi 0 for
    DP-AdamW; 0 where DP-AdamW-BC floors the denominator at gamma), and s's is the U^2-weighted
    mean of those. A cancelling m (|m| << its terms) floored at sqrt(gamma) = 1e-4 makes a
    step of ~lr d_u sqrt(n) with the m error's relative size: 1.4e-5 on a 1.75 step seen once
    in ~40 runs. A wrong formula or index moves a parameter by O(step), which no moment
    difference of 1e-5 explains. Zero for DP-Adafactor (factored states: the plain bound)."""
    grp, gw, gg = before[gi], want[gi], got[gi]
    if "exp_avg" not in gw.states:
        return [torch.zeros(()) for _ in gw.params]
    h = grp.hyper
    bc2 = 1 - h.beta2**grp.step
    phi = grp.noise_var_avg if h.rule == "adamw_bc" else 0.0
    steps, rels = [], []
    for k, (p0, p1) in enumerate(zip(grp.params, gw.params, strict=True)):
        m, dm = gw.states["exp_avg"][k], (gg.states["exp_avg"][k] - gw.states["exp_avg"][k])
        v, dv = (
            gw.states["exp_avg_sq"][k],
            (gg.states["exp_avg_sq"][k] - gw.states["exp_avg_sq"][k]),
        )
        rel_d = dv.abs() / (2 * (v - phi).abs().clamp_min(1e-30))
        if h.rule == "adamw_bc":
            rel_d = torch.where(v - phi > h.gamma * bc2, rel_d, 0.0)
        rels.append(dm.abs() / m.abs().clamp_min(1e-30) + rel_d)
        steps.append((p0.float() * (1 - h.lr * h.weight_decay) - p1.float()).abs())  # lr s |U|
    w = torch.cat([x.flatten() for x in steps]) ** 2
    rel_s = float((w * torch.cat([r.flatten() for r in rels])).sum() / w.sum().clamp_min(1e-30))
    return [4 * st * (r + rel_s) for st, r in zip(steps, rels, strict=True)]


def _run_functional(groups, backend):
    groups = copy.deepcopy(groups)
    F.dp_step_groups(groups, key=SEED, step=4, **PRIV, backend=backend)
    return groups


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rule", "B"),
    [("adamw", 0), ("adamw", 3), ("adamw_bc", 0), ("adamw_bc", 3), ("adafactor", 0),
     ("adafactor", 1)],
)  # fmt: skip
def test_fused_backend_matches_the_reference(fused_backend, rule, B, dtype):
    device = backend_device(fused_backend)
    rms = _functional_rms(_functional_case(rule, B, dtype, device, 100 + B, 1.0))
    for d_u, active in ((0.5 * rms, True), (2 * rms, False)):
        groups = _functional_case(rule, B, dtype, device, 100 + B, d_u)
        want = _run_functional(groups, "torch")
        got = _run_functional(groups, fused_backend)
        off = _run_functional(
            [
                dataclasses.replace(g, hyper=dataclasses.replace(g.hyper, update_rms_clip=None))
                for g in groups
            ],
            fused_backend,
        )
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
        same = []
        for gi, (gw, gg, go) in enumerate(zip(want, got, off, strict=True)):
            slack = _state_slack(groups, want, got, gi) if dtype == torch.float32 else None
            for k, (a, b, c) in enumerate(zip(gg.params, gw.params, go.params, strict=True)):
                a, b = a.float().cpu(), b.float().cpu()
                if slack is not None:  # what the (checked) state differences explain
                    bad = (a - b).abs() > tol["atol"] + tol["rtol"] * b.abs() + slack[k]
                    assert not bad.any(), (gi, k, bad.nonzero().tolist(), (a - b).abs().max())
                else:
                    torch.testing.assert_close(a, b, **tol)
                same.append(torch.equal(gg.params[k], c))
            for name in gw.states:
                for a, b, c in zip(gg.states[name], gw.states[name], go.states[name], strict=True):
                    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-5, atol=1e-6)
                    assert torch.equal(a, c), name  # the states of the unclipped fused run
        assert all(same) != active  # active: the step changed; inactive: bit for bit


@pytest.mark.parametrize("rule", list(CLASSES))
def test_fused_backends_implement_every_rule_with_the_option(fused_backend, rule):
    """Every rule with ``update_rms_clip`` runs it fused: explicitly, and under "auto"
    without the reference fallback's warning."""
    module = dpkern.backends.resolve(fused_backend, backend_device(fused_backend))
    assert module.supports_rms_clip(rule)
    params, gss = _draw(110, 2)
    device = backend_device(fused_backend)
    backends = [fused_backend] + (["auto"] if fused_backend == "cpp" else [])
    for backend in backends:
        ps = [torch.nn.Parameter(p.clone().to(device)) for p in params]
        opt = _optimizer(rule, ps, backend, update_rms_clip=0.1)
        for p, gs in zip(ps, gss[0], strict=True):
            p.grad_sample = gs.to(device).clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        assert opt.dp_step == 1
        assert not any("update_rms_clip" in str(w.message) for w in caught), backend


def test_fused_backends_refuse_a_rule_without_the_option(fused_backend):
    """The backend's pass A refuses a rule it has no update_rms_clip for (DP-Adam: the
    option is not one of its hyper-parameters), before anything changes."""
    device = backend_device(fused_backend)
    module = dpkern.backends.resolve(fused_backend, device)
    assert not module.supports_rms_clip("adam")
    p = torch.randn(3, 2, device=device)
    states = {"exp_avg": [torch.zeros_like(p)], "exp_avg_sq": [torch.zeros_like(p)]}
    dp = dpkern.hyper.DPStep(key=SEED, step=1, noise_step=1, noise_std=1.0,
                             expected_batch_size=2.0)  # fmt: skip
    before = p.clone()
    with pytest.raises(NotImplementedError, match=f"backend='{fused_backend}'.*update_rms_clip"):
        module.rms_clip_moments(dpkern.hyper.AdamHyper(lr=1e-3), dp, [p], [None], None,
                                [torch.ones_like(p)], states, [0])  # fmt: skip
    assert torch.equal(p, before)


def test_auto_falls_back_where_a_fused_backend_lacks_the_option(monkeypatch):
    """SPEC 10.9: "auto" runs a rule whose clipped step a fused backend lacks on the
    reference (with a warning); the explicit backend refuses it (simulated: every rule
    with the option is implemented by both fused backends)."""
    from dpkern import backends

    require_backend("cpp")
    module = backends.resolve("cpp", torch.device("cpu"))
    monkeypatch.setattr(module, "supports_rms_clip", lambda rule: False)
    monkeypatch.setattr(backends, "_warned_rules", set())
    cpu = torch.device("cpu")
    with pytest.raises(NotImplementedError, match="update_rms_clip"):
        backends.resolve("cpp", cpu, "adafactor", 0.1)
    with pytest.warns(RuntimeWarning, match="update_rms_clip"):
        assert backends.resolve("auto", cpu, "adafactor", 0.1) is backends.resolve("torch", cpu)


@pytest.mark.parametrize("rule", list(CLASSES))
def test_fused_stochastic_rounding_matches_the_reference(fused_backend, rule):
    device = backend_device(fused_backend)
    groups = _functional_case(rule, 3, torch.bfloat16, device, 120, 0.3)
    runs = {}
    for be in ("torch", fused_backend):
        gs = copy.deepcopy(groups)
        F.dp_step_groups(gs, key=SEED, step=4, **PRIV, backend=be, stochastic_rounding=True)
        runs[be] = gs
    for gw, gg in zip(runs["torch"], runs[fused_backend], strict=True):
        for a, b in zip(gg.params, gw.params, strict=True):  # one bf16 ulp apart at most
            torch.testing.assert_close(a.float().cpu(), b.float().cpu(), rtol=1e-2, atol=1e-3)
