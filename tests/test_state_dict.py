"""state_dict()/load_state_dict() round-trips exactly, with SPEC section 3's key handling."""

from __future__ import annotations

import copy

import pytest
import torch

import dpkern
from dpkern.keys import reveal

CLASSES = [
    dpkern.DPSGD,
    dpkern.DPAdam,
    dpkern.DPAdamBC,
    dpkern.DPAdamW,
    dpkern.DPAdamWBC,
    dpkern.DPMacAdam,
    dpkern.DPSGDScheduleFree,
    dpkern.DPAdamWScheduleFree,
    dpkern.DPRMSprop,
    dpkern.DPAdagrad,
    dpkern.DPAdadelta,
    dpkern.DPAdEMAMix,
    dpkern.DPRAdam,
    dpkern.DPLion,
    dpkern.DPAdafactor,
]


def _opt(cls, params, **kw):
    kw = {"lr": 0.01, "noise_multiplier": 0.8, "expected_batch_size": 3.0, "backend": "torch", **kw}
    if cls is dpkern.DPSGD:
        kw["momentum"] = 0.9
    if cls is not dpkern.DPMacAdam:
        kw["max_grad_norm"] = 1.5
    opt = cls(params, **kw)
    if hasattr(opt, "train"):  # schedule-free (SPEC 10.8): train mode before stepping
        opt.train()
    return opt


def _params(dtype=torch.float32):
    torch.manual_seed(4)
    return [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in [(6, 5), (5,), (1,)]]


def _steps(opt, params, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad_sample = torch.randn((3, *p.shape), generator=g).to(p.dtype)
        opt.step()


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_exact_and_resume_is_bit_identical_in_seeded_mode(cls, dtype):
    pa = _params(dtype)
    a = _opt(cls, pa, seed=99)
    _steps(a, pa, 3, seed=1)
    sd = copy.deepcopy(a.state_dict())
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    b = _opt(cls, pb, seed=1)
    b.load_state_dict(sd)
    sb = b.state_dict()
    assert sb["dp"] == sd["dp"] and sb["param_groups"] == sd["param_groups"]
    for k, st in sd["state"].items():
        for name, val in st.items():
            assert sb["state"][k][name].dtype == torch.float32  # fp32 even for bf16 params
            assert torch.equal(sb["state"][k][name], val)
    _steps(a, pa, 2, seed=2)
    _steps(b, pb, 2, seed=2)
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
    assert b.dp_step == 5


def test_secure_checkpoint_has_no_key_and_resume_differs_only_in_noise():
    pa = _params()
    a = _opt(dpkern.DPAdamW, pa)
    _steps(a, pa, 2, seed=1)
    sd = a.state_dict()
    assert set(sd["dp"]) == {
        "step",
        "max_grad_norm",
        "noise_multiplier",
        "expected_batch_size",
        "stochastic_rounding",
        "format",
    }
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    b = _opt(dpkern.DPAdamW, pb)
    b.load_state_dict(sd)
    assert b.dp_step == 2 and reveal(b._key) != reveal(a._key)


def test_load_rejects_a_mismatched_checkpoint_and_changes_nothing():
    pa = _params()
    a = _opt(dpkern.DPAdam, pa, seed=3)
    _steps(a, pa, 1, seed=1)
    sd = a.state_dict()
    other = [
        torch.nn.Parameter(torch.randn(2, 2)),
        torch.nn.Parameter(torch.randn(5)),
        torch.nn.Parameter(torch.randn(1)),
    ]
    b = _opt(dpkern.DPAdam, other, seed=3)
    _steps(b, other, 1, seed=2)
    before = copy.deepcopy(b.state_dict())
    with pytest.raises(ValueError, match="shape"):
        b.load_state_dict(sd)
    bad = copy.deepcopy(sd)
    bad["param_groups"][0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr"):
        a.load_state_dict(bad)
    after = b.state_dict()
    assert after["dp"] == before["dp"]
    for k in before["state"]:
        for name in before["state"][k]:
            assert torch.equal(after["state"][k][name], before["state"][k][name])


def test_accumulation_buffers_are_not_saved():
    pa = _params()
    a = _opt(dpkern.DPAdamW, pa, seed=1)
    for p in pa:
        p.grad_sample = torch.randn(3, *p.shape)
    a.accumulate()
    assert len(a._accum) == 3
    assert "accum" not in str(a.state_dict()) and a.state_dict()["state"] == {}
