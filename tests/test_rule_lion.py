"""DP-Lion (SPEC 10.4): lion_pytorch.Lion's twin on every backend, sign(0) = sign(NaN) = 0
on every backend, the step of exactly lr per coordinate whatever the noise and the
expected sign of SPEC 10.4, the refused noise bias correction, checkpoints and validation."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import dpkern
from dpkern import rules
from dpkern.backends import reference as ref
from dpkern.backends import resolve
from dpkern.hyper import DPStep, LionHyper

from conftest import backend_device, case_seed, run_step
from twin import need_backend, twin_run

lion_pytorch = pytest.importorskip("lion_pytorch")

SHAPES = [(7,), (5, 3), (3, 4, 5)]
TWIN_OPTIONS = {
    "defaults": {},
    "weight_decay": dict(weight_decay=0.1),
    "betas_wd": dict(betas=(0.95, 0.98), weight_decay=0.3),
}


def _twin(backend, options, steps, shapes, seed):
    """sigma = 0 and a huge C: g_hat is the mean gradient, the twin's .grad."""
    twin_run(dpkern.DPLion, lion_pytorch.Lion, options, backend, shapes=shapes, steps=steps,
             B=5, seed=seed, lrs=(1e-3, 3e-3), states=("exp_avg",))  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("option", list(TWIN_OPTIONS))
def test_twin_lion_pytorch(backend, option):
    _twin(backend, TWIN_OPTIONS[option], 10, SHAPES, case_seed(11 + len(option)))


@pytest.mark.triton
def test_twin_lion_pytorch_triton():
    _twin("triton", TWIN_OPTIONS["betas_wd"], 4, SHAPES[:2], case_seed(12))


# ---------------------------------------------------------------------------------------
# sign semantics, on every backend
# ---------------------------------------------------------------------------------------
def test_sign_of_zero_and_nan_is_zero(fused_backend):
    """c = beta1 m + (1 - beta1) g_hat with g_hat = 0 (no samples, no noise): a coordinate
    with c = +-0 or NaN does not move (torch.sign), the others move by exactly lr."""
    dev = backend_device(fused_backend)
    be = resolve(fused_backend, dev)
    hyper = LionHyper(lr=0.25, weight_decay=0.5)
    m = torch.tensor([float("nan"), 0.0, -0.0, 3.0, -2.0, 1e-30, -1e-30], device=dev)
    p = torch.tensor([1.0, 2.0, -3.0, 4.0, 5.0, 6.0, 7.0], device=dev)
    dp = DPStep(key=5, step=3, noise_std=0.0, expected_batch_size=2.0)
    case = ([p], [None], None, [torch.zeros(7, device=dev)], {"exp_avg": [m]}, [0], dp)
    want_p, want_s, _ = run_step(ref, hyper, case)
    got_p, got_s, _ = run_step(be, hyper, case)
    decay = 1 - 0.25 * 0.5
    sign = torch.tensor([0.0, 0.0, 0.0, 1.0, -1.0, 1.0, -1.0])
    expected = p.cpu() * decay - 0.25 * sign
    torch.testing.assert_close(want_p[0].cpu(), expected, rtol=0, atol=0)
    torch.testing.assert_close(got_p[0].cpu(), expected, rtol=0, atol=0)
    torch.testing.assert_close(
        got_s["exp_avg"][0].cpu(), want_s["exp_avg"][0].cpu(), rtol=0, atol=0, equal_nan=True
    )


# ---------------------------------------------------------------------------------------
# What the noise does (SPEC 10.4)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_every_coordinate_moves_by_exactly_lr_whatever_the_noise(backend):
    """No second moment to inflate: under heavy noise each coordinate moves by lr (wd = 0)."""
    device = need_backend(backend)
    p = torch.nn.Parameter(torch.zeros(1000, device=device))
    opt = dpkern.DPLion(
        [p], lr=2.0**-10, max_grad_norm=1.0, noise_multiplier=50.0, expected_batch_size=4.0,
        seed=int(case_seed(13)) % 2**63, backend=backend,
    )  # fmt: skip
    before = p.detach().clone()
    for _ in range(3):
        p.grad_sample = 1e-3 * torch.randn(4, 1000, device=device)
        opt.step()
        step = (p.detach() - before).abs()
        assert torch.equal(step, torch.full_like(step, 2.0**-10))
        before = p.detach().clone()


def test_expected_sign_under_noise():
    """E[sign(c) | past] = sign(c_bar) erf(|c_bar| / ((1 - beta1) sqrt(2 Phi))) at t = 1
    (m = 0, c_bar = (1 - beta1) g_bar): 20000 coordinates of the same g_bar, mean step
    within 5 standard errors."""
    d, B, C, sigma, B_e = 20000, 8, 1.0, 2.0, 8.0
    g_bar = 0.15  # every sample's gradient: g_bar in each coordinate, unclipped (C huge)
    p = torch.nn.Parameter(torch.zeros(d))
    opt = dpkern.DPLion(
        [p], lr=1.0, max_grad_norm=1e6, noise_multiplier=sigma / 1e6 * C,
        expected_batch_size=B_e, seed=int(case_seed(14)) % 2**63, backend="torch",
    )  # fmt: skip
    p.grad_sample = torch.full((B, d), g_bar)
    opt.step()
    Phi = (sigma * C / B_e) ** 2
    want = math.erf(g_bar / math.sqrt(2 * Phi))  # (1 - beta1) cancels at t = 1
    mean_sign = float(-p.detach().double().mean())
    se = math.sqrt((1 - want**2) / d)
    assert abs(mean_sign - want) < 5 * se, (mean_sign, want)
    assert 0.05 < want < 0.95  # neither saturated nor negligible


# ---------------------------------------------------------------------------------------
# No noise bias correction
# ---------------------------------------------------------------------------------------
def test_noise_bias_correction_true_is_refused():
    p = torch.nn.Parameter(torch.randn(3))
    kw = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2.0)
    with pytest.raises(ValueError, match="noise_bias_correction=True"):
        dpkern.DPLion([p], noise_bias_correction=True, **kw)
    with pytest.raises(ValueError, match="noise_bias_correction"):
        LionHyper(lr=1e-4, noise_bias_correction=True)
    opt = dpkern.DPLion([p], noise_bias_correction=False, **kw)
    nbc = "noise_bias_correction"
    with pytest.raises(ValueError, match="noise_bias_correction"):
        opt.add_param_group({"params": [torch.randn(2, requires_grad=True)], **{nbc: True}})
    assert len(opt.param_groups) == 1
    spec = rules.get("lion")
    assert not spec.noise_bias_correction and not spec.second_moment
    assert not spec.corrects(opt.group_hyper(0))
    assert spec.state_names == ("exp_avg",)  # one state: the least memory of the families


BAD = [
    ("lr", -1e-4),
    ("betas", (1.0, 0.99)),
    ("betas", (0.9, -0.1)),
    ("betas", (0.9,)),
    ("weight_decay", -0.1),
    ("noise_bias_correction", 1),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_bad_hyper_parameters_are_value_errors_naming_them(name, value):
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=name.split("[")[0]):
        dpkern.DPLion(
            [p], **{name: value}, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2
        )


# ---------------------------------------------------------------------------------------
# Checkpoints and the registry
# ---------------------------------------------------------------------------------------
def _steps(opt, params, n, gen):
    for _ in range(n):
        for p in params:
            p.grad_sample = torch.randn((3, *p.shape), generator=gen)
        opt.step()


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_state_dict_round_trip(backend):
    """Save after 2 steps, load into a fresh optimizer: the next step equals the
    uninterrupted run's, bit for bit (seeded)."""
    need_backend(backend)
    mk = lambda ps: dpkern.DPLion(
        [dict(params=ps[:1], lr=3e-3), dict(params=ps[1:])],
        lr=1e-3,
        weight_decay=0.1,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        seed=31,
        backend=backend,
    )
    g0 = torch.Generator().manual_seed(case_seed(15))
    pa = [torch.nn.Parameter(torch.randn(s, generator=g0)) for s in SHAPES]
    a = mk(pa)
    _steps(a, pa, 2, torch.Generator().manual_seed(1))
    sd = copy.deepcopy(a.state_dict())
    assert set(sd["state"][0]) == {"exp_avg", "step"}
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    b = mk(pb)
    b.load_state_dict(sd)
    _steps(a, pa, 1, torch.Generator().manual_seed(2))
    _steps(b, pb, 1, torch.Generator().manual_seed(2))
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
        assert torch.equal(a.state[x]["exp_avg"], b.state[y]["exp_avg"])
    assert b.dp_step == 3


def test_registry_entry():
    spec = rules.get("lion")
    assert spec.cli_name == "dp-lion" and spec.optimizer == "DPLion" and spec.section == "10.4"
    assert dpkern.DPLion is dpkern.optim.DPLion and spec.fsdp and spec.decoupled_decay
    assert spec.lr_grid == (3e-4, 1e-3, 3e-3, 1e-2)


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
    _compile_for_sm90(
        """
assert v4(ptx(S._step_kernel, **{**base, "RULE": R.LION.value})) >= 8
ptx(S._step_kernel, **{**base, "RULE": R.LION.value, "ALIGNED": False,
                       "P_DTYPE": tl.bfloat16, "G_DTYPE": tl.bfloat16})
"""
    )
