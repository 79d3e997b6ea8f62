"""DP-Adafactor (SPEC 10.7): torch.optim.Adafactor on the privatised gradient, with the
noise bias correction of its factored second moment.

- twin: sigma = 0 and a huge C make the step torch.optim.Adafactor's on the mean gradient
  (every option, odd shapes, several steps), on the reference and on every fused backend;
- phi: the recursion phi_t = (1 - w_t) phi_{t-1} + w_t Phi_t against a hand computation
  with sigma changing between steps; the corrected factors max(x - phi, gamma) in a step
  computed by hand from the SPEC formulas (every backend);
- the claimed benefit: with the correction, the factored estimate r c^T / mean(r) formed
  from the noisy states estimates the noiseless one (uncorrected, it is inflated by phi);
- state_dict round trip, validation, empty parameters, FSDP2 refused.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

import dpkern
from dpkern import backends, rules
from dpkern.backends import reference as ref
from dpkern.distributed.processes import end_worker
from dpkern.hyper import AdafactorHyper, DPStep

from conftest import backend_device, case_seed
from twin import need_backend, twin_run

SHAPES = [(7,), (5, 3), (3, 4, 5), (1, 9), ()]
B = 4
OPTIONS = {
    "defaults": {},
    "weight_decay": dict(weight_decay=0.1),
    "eps_d_decay": dict(eps=(1e-6, 1e-2), d=1.5, beta2_decay=-0.5),
    "big_lr": dict(lr=0.8, weight_decay=0.05),  # rho_t = 1/sqrt(t) binds
    "zero_decay_exponent": dict(beta2_decay=0.0, eps=(0.0, 0.0)),
}


def _fused_or_skip(name):
    need_backend(name)
    if name != "torch" and not backends._load(name)[0].supports("adafactor"):
        pytest.skip(f"backend {name!r} has no adafactor kernel")


def _factored_states(correct, dp, a, twin, b, t, msg):
    """Our (row, col) factors against torch's, the unfactored variance of a < 2-D
    parameter in "row"; phi kept if and only if ``correct``."""
    for k, (p, q) in enumerate(zip(a, b)):
        st, tst = dp.state[p], twin.state[q]
        if p.dim() >= 2:  # torch keeps keepdim shapes (..., R, 1) and (..., 1, C)
            torch.testing.assert_close(st["row_var"], tst["row_var"].squeeze(-1))
            torch.testing.assert_close(st["col_var"], tst["col_var"].squeeze(-2))
        else:  # our "row" state of a < 2-D parameter is torch's unfactored variance
            torch.testing.assert_close(st["row_var"], tst["variance"])
            assert st["col_var"].shape == () and float(st["col_var"]) == 0.0
        assert int(st["step"]) == int(tst["step"]) == t, f"{msg} param {k}"
        assert ("noise_var_avg" in st) == correct, f"{msg} param {k}"


def _twin_run(backend, kw, shapes=SHAPES, steps=5):
    check = functools.partial(_factored_states, kw.get("noise_bias_correction", False))
    twin_run(dpkern.DPAdafactor, torch.optim.Adafactor, kw, backend, shapes=shapes,
             steps=steps, B=B, seed=case_seed(0), lrs=(None, kw.get("lr", 1e-2) / 2), split=2,
             max_grad_norm=1e10, states=(), check=check)  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_twin_is_torch_optim_adafactor(backend, option):
    _fused_or_skip(backend)
    _twin_run(backend, OPTIONS[option])


@pytest.mark.triton
@pytest.mark.parametrize("option", ["defaults", "eps_d_decay"])
def test_twin_triton(option):
    _fused_or_skip("triton")
    _twin_run("triton", OPTIONS[option], shapes=[(7,), (5, 3), (2, 3, 5), ()], steps=2)


def test_twin_with_correction_and_no_noise_is_the_twin():
    """phi = 0 without noise: the floors max(x - 0, gamma) are the only change (inactive
    for factors above gamma)."""
    _twin_run("torch", dict(weight_decay=0.1, noise_bias_correction=True, gamma=1e-30))


# ---------------------------------------------------------------------------------------
# phi and the corrected denominator
# ---------------------------------------------------------------------------------------
def test_phi_recursion_follows_a_changing_sigma():
    p = torch.nn.Parameter(torch.randn(4, 3))
    C, B_e = 0.7, 5.0
    opt = dpkern.DPAdafactor(
        [p], beta2_decay=-0.6, noise_bias_correction=True,
        max_grad_norm=C, noise_multiplier=1.0, expected_batch_size=B_e, seed=3, backend="torch",
    )  # fmt: skip
    phi = 0.0
    for t, sigma in enumerate([1.0, 2.5, 0.0, 0.8, 1.7], start=1):
        opt.noise_multiplier = sigma
        p.grad_sample = torch.randn(3, 4, 3)
        opt.step()
        w = t**-0.6
        phi = (1 - w) * phi + w * (sigma * C / B_e) ** 2
        assert float(opt.state[p]["noise_var_avg"]) == pytest.approx(phi, rel=1e-6)
        if t == 1:
            assert phi == pytest.approx((C / B_e) ** 2)  # w_1 = 1: phi_1 = Phi_1
    spec = rules.get("adafactor")
    h = opt.group_hyper(0)
    assert spec.next_noise_var(h, 0.3, 0.1, 4) == pytest.approx((1 - 4**-0.6) * 0.3 + 4**-0.6 * 0.1)
    assert spec.next_noise_var(AdafactorHyper(), 0.3, 0.1, 4) == 0.0  # not correcting


def _hand_step(h, dp, p, g, row, col):
    """SPEC 10.7 in float64, straight from the formulas (for the correction checks)."""
    p, g, row, col = (x.double() for x in (p, g, row, col))
    t, n = dp.step, p.numel()
    w = t**h.beta2_decay
    rho = min(h.lr, 1 / math.sqrt(t))
    alpha = max(h.eps2, float(p.norm()) / math.sqrt(n)) * rho
    p = p * (1 - h.lr * h.weight_decay)
    phi = dp.noise_var_avg
    fl = lambda x: torch.clamp(x - phi, min=h.gamma) if h.noise_bias_correction else x
    if p.dim() >= 2:
        row = row + w * ((g * g).mean(-1) - row)
        col = col + w * ((g * g).mean(-2) - col)
        r, c = fl(row), fl(col)
        V = r[..., :, None] * c[..., None, :] / torch.clamp(r.mean(-1), min=h.eps1)[..., None, None]
    else:
        row = row + w * (g * g - row)
        V = fl(row)
    U = g / torch.sqrt(torch.clamp(V, min=h.eps1**2))
    step = alpha / max(1.0, float(U.square().mean().sqrt()) / h.d)
    return p - step * U, row, col


@pytest.mark.parametrize(
    "backend", ["torch", "cpp", pytest.param("triton", marks=pytest.mark.triton)]
)
@pytest.mark.parametrize("shape", [(6,), (4, 5), (2, 3, 4)])
@pytest.mark.parametrize("gamma", [1e-8, 0.3])
def test_corrected_factors_are_floored_at_gamma(backend, shape, gamma):
    """One step from random states with phi between the factors' values: the denominator
    uses max(x - phi, gamma) (some entries floored), on every backend."""
    _fused_or_skip(backend)
    dev = backend_device(backend) if backend == "triton" else torch.device("cpu")
    be = backends._load(backend)[0] if backend != "torch" else ref
    gen = torch.Generator().manual_seed(case_seed(11))
    h = AdafactorHyper(lr=0.05, noise_bias_correction=True, gamma=gamma, weight_decay=0.1)
    p = torch.randn(shape, generator=gen)
    S = torch.randn(shape, generator=gen)
    row = torch.rand(rules.state_shape("row", shape), generator=gen)
    col = torch.rand(rules.state_shape("col", shape), generator=gen)
    row.view(-1)[0] = 0.0  # lerp(0, mean g^2, w_3) < phi: floored
    dp = DPStep(key=1, step=3, noise_std=0.0, expected_batch_size=2.0, noise_var_avg=0.4)
    want_p, want_row, want_col = _hand_step(h, dp, p, S / 2.0, row, col)
    params, states = (
        [p.clone().to(dev)],
        {"row_var": [row.clone().to(dev)], "col_var": [col.clone().to(dev)]},
    )
    be.step(h, dp, params, [None], None, [S.to(dev)], states, [0])
    torch.testing.assert_close(params[0].cpu().double(), want_p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(states["row_var"][0].cpu().double(), want_row, rtol=1e-5, atol=1e-7)
    if len(shape) >= 2:
        torch.testing.assert_close(
            states["col_var"][0].cpu().double(), want_col, rtol=1e-5, atol=1e-7
        )
        assert float((want_row - 0.4).min()) < gamma  # the floor is exercised


def test_correction_estimates_the_noiseless_factored_variance():
    """SPEC 10.7's derivation: E[r] - phi and E[c] - phi are the noiseless factors, so
    r~ c~^T / mean(r~) from the noisy run estimates the noiseless factored variance; the
    uncorrected estimate is inflated by about phi. Fixed clipped sums, lr = 0 (the
    parameters never move), 400 steps at sigma with Phi ~ the signal."""
    R, Cc, steps = 16, 12, 400
    gen = torch.Generator().manual_seed(case_seed(5))
    a, b = torch.rand(R, generator=gen) + 0.5, torch.rand(Cc, generator=gen) + 0.5
    g_true = (a[:, None] * b[None, :]).sqrt() * torch.sign(torch.randn(R, Cc, generator=gen))
    B_e, C = 4.0, 1e6
    sigma = 1.0 * B_e / C  # Phi = (sigma C / B_e)^2 = 1 ~ mean(g_true^2)

    def run(noise_multiplier, correct):
        p = torch.nn.Parameter(torch.zeros(R, Cc))
        opt = dpkern.DPAdafactor(
            [p], lr=0.0, noise_bias_correction=correct, max_grad_norm=C,
            noise_multiplier=noise_multiplier, expected_batch_size=B_e, seed=9, backend="torch",
        )  # fmt: skip
        for _ in range(steps):
            opt.accumulate_clipped([g_true * B_e])  # the clipped sum S: g_hat = g_true + noise
            opt.step()
        st, h = opt.state[p], opt.group_hyper(0)
        phi = float(st["noise_var_avg"]) if correct else 0.0
        fl = (lambda x: torch.clamp(x - phi, min=h.gamma)) if correct else (lambda x: x)
        r, c = fl(st["row_var"]), fl(st["col_var"])
        return r[:, None] * c[None, :] / r.mean()

    clean = run(0.0, False)  # the noiseless factored variance (= g_true^2: rank 1)
    torch.testing.assert_close(clean, g_true.square(), rtol=1e-4, atol=1e-6)
    corrected, raw = run(sigma, True), run(sigma, False)
    err = lambda V: float(((V - clean).abs() / clean).median())
    assert err(corrected) < 0.2, err(corrected)
    assert err(raw) > 0.5, err(raw)  # inflated: V ~ (r + phi)(c + phi) / (mean r + phi)


# ---------------------------------------------------------------------------------------
# state_dict, validation, edge cases, data parallelism
# ---------------------------------------------------------------------------------------
def _opt(params, backend="torch", **kw):
    kw = dict(max_grad_norm=1.0, noise_multiplier=0.7, expected_batch_size=3.0, seed=5, **kw)
    return dpkern.DPAdafactor(params, backend=backend, **kw)


def _steps(opt, params, n, gen):
    for _ in range(n):
        for p in params:
            p.grad_sample = torch.randn((3, *p.shape), generator=gen)
        opt.step()


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("correct", [False, True])
def test_state_dict_round_trip_resumes_exactly(backend, correct):
    _fused_or_skip(backend)
    pa = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    a = _opt(pa, backend, noise_bias_correction=correct, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    _steps(a, pa, 2, gen)
    sd = copy.deepcopy(a.state_dict())
    assert all(("noise_var_avg" in st) == correct for st in sd["state"].values())
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    b = _opt(pb, backend, noise_bias_correction=correct, weight_decay=0.1)
    b.load_state_dict(sd)
    assert b.param_groups[0]["eps"] == (None, 1e-3)
    gen_a, gen_b = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    _steps(a, pa, 1, gen_a)
    _steps(b, pb, 1, gen_b)
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
    for x, y in zip(pa, pb):
        for name, val in a.state[x].items():
            assert torch.equal(b.state[y][name], val), name
    bad = copy.deepcopy(sd)
    bad["state"][1]["col_var"] = torch.zeros(5)  # col state of a (5, 3) parameter: (3,)
    with pytest.raises(ValueError, match=r"'col_var' has shape \(5,\), expected \(3,\)"):
        b.load_state_dict(bad)


BAD = [
    ("lr", -1.0),
    ("beta2_decay", 0.5),
    ("eps", 0.0),
    ("eps", (None,)),
    ("eps", (-1.0, 1e-3)),
    ("eps", (None, -1e-3)),
    ("d", 0.5),
    ("weight_decay", -0.1),
    ("gamma", 0.0),
    ("noise_bias_correction", "yes"),
]


@pytest.mark.parametrize("name,value", BAD)
def test_bad_hyper_parameters_are_value_errors_at_construction(name, value):
    with pytest.raises(ValueError, match=name):
        _opt([torch.nn.Parameter(torch.randn(3))], **{name: value})
    if name != "eps":
        with pytest.raises(ValueError, match=name):
            AdafactorHyper(**{name: value})


def test_hyper_defaults_and_group_mapping():
    h = AdafactorHyper()
    assert (h.lr, h.beta2_decay, h.eps1, h.eps2, h.d, h.weight_decay) == (
        1e-2, -0.8, 2.0**-23, 1e-3, 1.0, 0.0,
    )  # fmt: skip
    assert h.eps1 == torch.finfo(torch.float32).eps and not h.noise_bias_correction
    p = torch.nn.Parameter(torch.randn(3))
    opt = _opt([dict(params=[p], eps=(1e-5, 0.1), lr=0.3)])
    assert opt.group_hyper(0) == AdafactorHyper(lr=0.3, eps1=1e-5, eps2=0.1)
    with pytest.raises(ValueError, match="not supported by DPAdafactor"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.randn(2))], momentum=0.9))
    assert rules.get("adafactor").needed_states(h) == ("row_var", "col_var")
    assert "noise_var_avg" in rules.get("adafactor").needed_states(
        AdafactorHyper(noise_bias_correction=True)
    )


def test_failed_step_changes_nothing():
    ps = [torch.nn.Parameter(torch.randn(s)) for s in [(4, 3), (3,)]]
    opt = _opt(ps, noise_bias_correction=True)
    _steps(opt, ps, 1, torch.Generator().manual_seed(0))
    before = ([p.detach().clone() for p in ps], copy.deepcopy(opt.state_dict()))
    ps[0].grad_sample = torch.randn(3, 4, 3)
    ps[1].grad_sample = torch.randn(3, 3)
    ps[1].grad_sample[1, 0] = float("nan")
    with pytest.raises(FloatingPointError):
        opt.step()
    for p, q in zip(ps, before[0]):
        assert torch.equal(p, q)
    after = opt.state_dict()
    for k, st in before[1]["state"].items():
        for name, val in st.items():
            assert torch.equal(after["state"][k][name], val)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_empty_parameters_are_left_alone(backend):
    _fused_or_skip(backend)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in [(2, 0, 3), (0,), (3, 2)]]
    opt = _opt(ps, backend)
    _steps(opt, ps, 2, torch.Generator().manual_seed(0))
    assert ps[0].shape == (2, 0, 3) and opt.state[ps[0]]["row_var"].shape == (2, 0)
    assert opt.state[ps[0]]["col_var"].shape == (2, 3)
    assert torch.isfinite(ps[2]).all() and int(opt.state[ps[0]]["step"]) == 2


def test_fsdp2_shards_are_refused(monkeypatch):
    """The factors are reductions over rows / columns: a coordinate shard cannot update
    its part alone (the registry's fsdp is False); a shard is refused with a clear error
    before anything changes."""
    from dpkern.optim import groups

    spec = rules.get("adafactor")
    assert not spec.fsdp
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = _opt([p])
    monkeypatch.setattr(groups, "local_shard", lambda t, name="": (t.detach()[:2], 0))
    p.grad_sample = torch.randn(3, 4, 3)
    with pytest.raises(ValueError, match="DP-Adafactor keeps states that are not shaped like"):
        opt.step()
    assert not opt.state and opt.dp_step == 0


def test_registry_entry_and_cli():
    from dpkern.cli import compare
    from dpkern.cli.finetune import options

    spec = rules.get("adafactor")
    assert spec.cli_name == "dp-adafactor" and spec.section == "10.7"
    assert spec.optimizer_class() is dpkern.DPAdafactor is dpkern.optim.DPAdafactor
    assert "dp-adafactor" in options.OPTIMIZERS and "dp-adafactor" in compare.OPTIMIZERS
    assert "dp-adafactor" in compare.DECOUPLED and len(spec.lr_grid) == 4
    assert spec.kernel_state_names == ("row_var", "col_var")


# ---------------------------------------------------------------------------------------
# Data parallelism, for real (gloo, 2 processes): DDP equals one process; FSDP2 refused
# ---------------------------------------------------------------------------------------
DIST_BATCH, DIST_SEED = [0, 2, 3, 5, 8, 9, 12], 77


def _dist_opt(params):
    return dpkern.DPAdafactor(
        params, lr=0.05, weight_decay=0.1, noise_bias_correction=True, gamma=1e-3,
        max_grad_norm=0.7, noise_multiplier=0.8, expected_batch_size=6.5, seed=DIST_SEED,
        backend="torch",
    )  # fmt: skip


def _dist_worker(rank, world, tmpdir):
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dpkern.distributed import DistributedDPOptimizer, shard_grad_samples
    from dpkern.grad_sample import compute_grad_sample
    from test_distributed import _ddp, _loss, _net

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method="file://" + os.path.join(tmpdir, "rdv"), rank=rank,
        world_size=world, timeout=timedelta(seconds=120),
    )  # fmt: skip
    try:
        data = torch.load(os.path.join(tmpdir, "data.pt"))
        local = DIST_BATCH[rank::world]
        net = _ddp(_net()).module
        opt = DistributedDPOptimizer(_dist_opt(net.parameters()))
        for _ in range(2):
            compute_grad_sample(net, _loss, data["x"][local], data["y"][local])
            opt.step()
            opt.zero_grad()
        out = {"ddp": [p.detach().clone() for p in net.parameters()]}
        model, replica = _net(), _net()
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        fsdp_opt = _dist_opt(list(model.parameters()))
        compute_grad_sample(replica, _loss, data["x"][local], data["y"][local])
        shard_grad_samples(list(model.parameters()), [p.grad_sample for p in replica.parameters()])
        try:
            fsdp_opt.step()
            out["fsdp"] = None
        except Exception as exc:  # the test checks its type and message
            out["fsdp"] = (type(exc).__name__, str(exc), len(fsdp_opt.state))
        torch.save(out, os.path.join(tmpdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    end_worker()  # (past gloo's occasional abort at interpreter exit)


def test_ddp_equals_one_process_and_fsdp2_is_refused(tmp_path):
    import os

    import torch.multiprocessing as mp

    from dpkern.grad_sample import compute_grad_sample
    from test_distributed import D_IN, D_OUT, N, _loss, _net

    gen = torch.Generator().manual_seed(case_seed(21))
    data = {
        "x": torch.randn(N, D_IN, generator=gen),
        "y": torch.randint(0, D_OUT, (N,), generator=gen),
    }
    torch.save(data, os.path.join(tmp_path, "data.pt"))
    mp.spawn(_dist_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(os.path.join(tmp_path, f"rank{r}.pt")) for r in range(2)]
    net = _net()
    opt = _dist_opt(net.parameters())
    for _ in range(2):
        compute_grad_sample(net, _loss, data["x"][DIST_BATCH], data["y"][DIST_BATCH])
        opt.step()
        opt.zero_grad()
    for r in results:
        for a, b in zip(r["ddp"], net.parameters()):
            torch.testing.assert_close(a, b.detach(), atol=1e-6, rtol=0)
        name, msg, n_states = r["fsdp"]
        assert name == "ValueError" and n_states == 0
        assert "DP-Adafactor keeps states that are not shaped like the parameter" in msg
