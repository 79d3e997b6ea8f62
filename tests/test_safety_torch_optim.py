"""torch.optim behaviour that users rely on, and checkpoints that cannot lie: per-parameter
steps, refused param-group options, foreign state_dicts, hook order, the constructor's
privacy arguments kept at load, the base class that is not a wrapper, the docs.

Each test fails on the code before the fix (dpkern 0.1.0 as of 2026-11-30)."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
from torch import nn

import dpkern
from dpkern.accounting import PrivacyAccountant

CLASSES = [
    dpkern.DPSGD,
    dpkern.DPAdam,
    dpkern.DPAdamBC,
    dpkern.DPAdamW,
    dpkern.DPAdamWBC,
    dpkern.DPMacAdam,
]
BIG_C = 1e6  # clipping never active: the DP step is the plain step on the mean gradient


def _exact(cls, params, **kw):
    """A dpkern optimizer with no noise and no clipping (B_e = 1: g_hat = the gradient)."""
    return cls(
        params,
        **kw,
        max_grad_norm=BIG_C,
        noise_multiplier=0.0,
        expected_batch_size=1.0,
        backend="torch",
        seed=0,
    )


def _grads(params, k):
    g = torch.Generator().manual_seed(100 + k)
    return [torch.randn(p.shape, generator=g) for p in params]


def _twin_step(dp_opt, twin, dp_params, twin_params, k):
    for p, q, g in zip(dp_params, twin_params, _grads(dp_params, k)):
        if p.requires_grad:
            p.grad_sample = g.unsqueeze(0)  # B = 1: the sample's gradient is the gradient
            q.grad = g.clone()
        else:
            q.grad = None
    dp_opt.step()
    twin.step()


def _pair(seed=0, n=3):
    g = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn(4, 3, generator=g)) for _ in range(n)]
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    return ps, qs


# -- 12. parameters added or unfrozen later get their own step ---------------------------
TWINS = [
    (dpkern.DPAdam, torch.optim.Adam, {"lr": 0.1}),
    (dpkern.DPAdamW, torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.1}),
    (dpkern.DPSGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.5}),
]


@pytest.mark.parametrize("cls,twin_cls,kw", TWINS, ids=lambda x: getattr(x, "__name__", ""))
def test_group_added_after_five_steps_follows_torch_optim(cls, twin_cls, kw):
    ps, qs = _pair()
    opt, twin = _exact(cls, [ps[0]], **kw), twin_cls([qs[0]], **kw)
    for k in range(5):
        _twin_step(opt, twin, ps[:1], qs[:1], k)
    opt.add_param_group({"params": [ps[1]]})
    twin.add_param_group({"params": [qs[1]]})
    for k in range(5, 8):
        _twin_step(opt, twin, ps[:2], qs[:2], k)
        for p, q in zip(ps[:2], qs[:2]):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert int(opt.state[ps[1]]["step"]) == 3 and opt.dp_step == 8


@pytest.mark.parametrize("cls,twin_cls,kw", TWINS[:2], ids=lambda x: getattr(x, "__name__", ""))
def test_frozen_then_unfrozen_parameter_follows_torch_optim(cls, twin_cls, kw):
    ps, qs = _pair()
    opt, twin = _exact(cls, ps[:2], **kw), twin_cls(qs[:2], **kw)
    ps[1].requires_grad_(False)
    for k in range(4):
        _twin_step(opt, twin, ps[:2], qs[:2], k)
    ps[1].requires_grad_(True)
    for k in range(4, 7):
        _twin_step(opt, twin, ps[:2], qs[:2], k)
    for p, q in zip(ps[:2], qs[:2]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert [int(opt.state[p]["step"]) for p in ps[:2]] == [7, 3]


def test_bc_noise_variance_is_per_parameter():
    ps, _ = _pair()
    opt = dpkern.DPAdamBC(
        [ps[0]],
        lr=0.1,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=2.0,
        backend="torch",
        seed=1,
    )
    for k in range(3):
        ps[0].grad_sample = torch.randn(2, 4, 3)
        opt.step()
    opt.add_param_group({"params": [ps[1]]})
    for p in ps[:2]:
        p.grad_sample = torch.randn(2, 4, 3)
    opt.step()
    Phi, b2 = (1.0 * 1.0 / 2.0) ** 2, 0.999
    phi_new = float(opt.state[ps[1]]["noise_var_avg"])
    assert phi_new == pytest.approx((1 - b2) * Phi, rel=1e-6)  # its first phi update
    assert float(opt.state[ps[0]]["noise_var_avg"]) == pytest.approx((1 - b2**4) * Phi, rel=1e-5)


def test_macadam_refuses_a_late_parameter_group():
    ps, _ = _pair()
    opt = dpkern.DPMacAdam(
        [ps[0]], noise_multiplier=1.0, expected_batch_size=2.0, backend="torch", seed=1
    )
    ps[0].grad_sample = torch.randn(2, 4, 3)
    opt.step()
    opt.add_param_group({"params": [ps[1]]})
    for p in ps[:2]:
        p.grad_sample = torch.randn(2, 4, 3)
    before = [p.detach().clone() for p in ps[:2]]
    with pytest.raises(ValueError, match="one step count for all parameters"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, ps[:2]))


def test_format_1_checkpoint_gives_every_parameter_the_global_step():
    ps, _ = _pair(n=1)
    opt = _exact(dpkern.DPAdam, ps, lr=0.1)
    for k in range(3):
        ps[0].grad_sample = torch.randn(1, 4, 3)
        opt.step()
    sd = opt.state_dict()
    for st in sd["state"].values():
        del st["step"]  # as saved by dpkern 0.1.0
    sd["dp"].pop("format")
    new = _exact(dpkern.DPAdam, ps, lr=0.1)
    new.load_state_dict(sd)
    assert int(new.state[ps[0]]["step"]) == 3


# -- 11. options in a param group that the class does not implement ----------------------
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    "option,value,why",
    [
        ("amsgrad", True, "dpkern refuses it rather than ignore it"),
        ("maximize", True, "dpkern refuses it rather than ignore it"),
        ("fused", True, "dpkern refuses it rather than ignore it"),
        ("foreach", None, "foreach=None is torch.optim's default: omit it"),
    ],
)
def test_unsupported_constructor_option_is_a_value_error(cls, option, value, why):
    """A torch.optim constructor option the class lacks: ValueError saying so, naming the
    class's options (before: Python's bare 'unexpected keyword argument' TypeError)."""
    ps, _ = _pair()
    taken = inspect.signature(cls.__init__).parameters
    kw = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2.0)
    kw = {k: v for k, v in kw.items() if k in taken}  # (DP-MacAdam: no max_grad_norm)
    if option in taken:
        pytest.skip(f"{cls.__name__} takes {option}")
    with pytest.raises(ValueError, match=f"{cls.__name__} has no option {option!r}: {why}"):
        cls(ps[:1], **kw, **{option: value})
    with pytest.raises(TypeError, match="unexpected keyword"):  # a typo stays a TypeError
        cls(ps[:1], **kw, lrr=0.1)


# -- 11. options in a param group that the class does not implement ----------------------
@pytest.mark.parametrize(
    "option,value",
    [
        ("maximize", True),
        ("amsgrad", True),
        ("decoupled_weight_decay", True),
        ("foreach", True),
        ("noise_multiplier", 0.1),
        ("nesterov", True),
    ],
)
def test_unsupported_param_group_option_is_refused(option, value):
    ps, _ = _pair()
    with pytest.raises(ValueError, match=f"{option!r} is not supported by DPAdamW"):
        dpkern.DPAdamW(
            [{"params": ps[:1], option: value}],
            max_grad_norm=1.0,
            noise_multiplier=1.0,
            expected_batch_size=2.0,
        )
    opt = dpkern.DPAdamW(ps[:1], max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2.0)
    with pytest.raises(ValueError, match="not supported"):
        opt.add_param_group({"params": ps[1:2], option: value})
    assert len(opt.param_groups) == 1
    opt.param_groups[0][option] = value  # set after construction: refused at the step
    ps[0].grad_sample = torch.randn(2, 4, 3)
    before = ps[0].detach().clone()
    with pytest.raises(ValueError, match="not supported"):
        opt.step()
    assert torch.equal(before, ps[0]) and opt.dp_step == 0


def test_scheduler_and_user_keys_in_a_param_group_are_accepted():
    ps, _ = _pair()
    opt = dpkern.DPSGD(
        [{"params": ps[:1], "name": "encoder"}],
        lr=0.1,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=2.0,
        backend="torch",
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=4)
    ps[0].grad_sample = torch.randn(2, 4, 3)
    opt.step()
    sched.step()
    assert "initial_lr" in opt.param_groups[0]


# -- 13. foreign state_dicts -----------------------------------------------------------
def test_torch_optim_state_dict_is_refused():
    ps, qs = _pair(n=1)
    twin = torch.optim.Adam(qs)
    qs[0].grad = torch.randn(4, 3)
    twin.step()
    opt = _exact(dpkern.DPAdam, ps)
    with pytest.raises(ValueError, match="not a dpkern optimizer's state_dict"):
        opt.load_state_dict(twin.state_dict())
    assert not opt.state


def test_opacus_dp_optimizer_state_dict_is_refused():
    from opacus.optimizers import DPOptimizer as OpacusDPOptimizer

    ps, qs = _pair(n=1)
    wrapped = OpacusDPOptimizer(
        torch.optim.Adam(qs), noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=2
    )
    opt = _exact(dpkern.DPAdam, ps)
    with pytest.raises(ValueError, match="Opacus DPOptimizer"):
        opt.load_state_dict(wrapped.state_dict())


# -- 14. load_state_dict hooks run in torch.optim's order ------------------------------------
def test_load_state_dict_hooks_see_and_keep_the_loaded_state():
    ps, _ = _pair(n=1)
    a = _exact(dpkern.DPAdam, ps)
    ps[0].grad_sample = torch.randn(1, 4, 3)
    a.step()
    sd = a.state_dict()
    b = _exact(dpkern.DPAdam, ps)
    seen = {}

    def pre(opt, state_dict):
        seen["pre"] = state_dict["dp"]["step"]
        state_dict = dict(state_dict)
        state_dict["param_groups"] = [{**g, "lr": 0.5} for g in state_dict["param_groups"]]
        return state_dict

    def post(opt):
        seen["post_state"] = int(opt.state[ps[0]]["step"])
        opt.state[ps[0]]["tag"] = "written by the hook"

    b.register_load_state_dict_pre_hook(pre)
    b.register_load_state_dict_post_hook(post)
    b.load_state_dict(sd)
    assert seen == {"pre": 1, "post_state": 1}
    assert b.state[ps[0]]["tag"] == "written by the hook"
    assert b.param_groups[0]["lr"] == 0.5 and b.param_groups[0]["params"] == [ps[0]]


# -- 7. the constructor's privacy arguments are kept -------------------------------------
def test_load_state_dict_keeps_the_constructors_privacy_arguments():
    ps, _ = _pair(n=1)
    a = dpkern.DPAdamW(ps, max_grad_norm=1.0, noise_multiplier=0.5, expected_batch_size=8.0)
    ps[0].grad_sample = torch.randn(2, 4, 3)
    a.step()
    b = dpkern.DPAdamW(ps, max_grad_norm=2.0, noise_multiplier=1.3, expected_batch_size=16.0)
    b.load_state_dict(a.state_dict())  # a resume that recalibrated sigma
    assert (b.max_grad_norm, b.noise_multiplier, b.expected_batch_size) == (2.0, 1.3, 16.0)


# -- 3. no data-dependent statistic in a state_dict ---------------------------------------
def _keys(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield str(k)
            yield from _keys(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _keys(v)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_state_dict_holds_no_sample_counts(cls):
    ps, _ = _pair(n=1)
    kw = {} if cls is dpkern.DPMacAdam else {"max_grad_norm": 0.1}
    opt = cls(ps, noise_multiplier=1.0, expected_batch_size=2.0, seed=3, **kw)
    ps[0].grad_sample = torch.randn(5, 4, 3)
    opt.step()
    assert opt.stats["samples"] == 5  # in memory
    keys = set(_keys(opt.state_dict()))
    assert not keys & {"stats", "samples", "clipped_samples", "nonfinite_samples"}


# -- 18. the base class is not Opacus' wrapper -------------------------------------------
def test_dpoptimizer_is_not_a_wrapper():
    model = nn.Linear(3, 2)
    inner = torch.optim.AdamW(model.parameters())
    for call in (
        lambda: dpkern.DPOptimizer(
            inner, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=8
        ),
        lambda: dpkern.DPOptimizer(optimizer=inner, noise_multiplier=1.0),
        lambda: dpkern.DPAdamW(
            inner, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8
        ),
    ):
        with pytest.raises(TypeError, match=r"not a wrapper.*dpkern\.DPAdamW\(model\.parameters"):
            call()


# -- 20. the docs -------------------------------------------------------------------------
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_class_docstrings_explain_the_dp_options_and_cite_the_source(cls):
    doc = inspect.getdoc(cls)
    options = ["noise_multiplier", "expected_batch_size", "seed", "backend", "nonfinite"]
    if cls is not dpkern.DPMacAdam:
        options.append("max_grad_norm")
    for word in options + [
        "grad_sample",
        "p.grad",
        "NOT private",
        "Source:",
        "SPEC",
        "math::",
        "Args:",
        "Raises:",
        "State:",
    ]:
        assert word in doc, f"{cls.__name__}'s docstring lacks {word!r}"
    assert "arXiv" in doc or "Abadi" in doc


def test_spec_resolves_for_an_installed_package():
    out = subprocess.run(
        [sys.executable, "-m", "dpkern.spec"], capture_output=True, text=True, check=True
    ).stdout
    assert "dpkern noise stream v1" in out and "## 5. The optimizers" in out


def test_privacy_accountant_methods_have_docstrings():
    for name, member in inspect.getmembers(PrivacyAccountant):
        if name.startswith("_") and name != "__init__":
            continue
        if callable(member) or isinstance(member, property):
            doc = inspect.getdoc(member)
            assert doc and len(doc) > 40, f"PrivacyAccountant.{name} has no docstring"


def test_torch_optim_options_at_their_off_value_are_accepted():
    ps, _ = _pair(n=1)
    opt = dpkern.DPAdamW(
        [{"params": ps, "amsgrad": False, "maximize": False, "foreach": None}],
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=2.0,
    )
    assert opt.param_groups[0]["amsgrad"] is False


def test_repr_shows_the_privacy_settings():
    ps, _ = _pair(n=1)
    text = repr(
        dpkern.DPSGD(ps, max_grad_norm=0.5, noise_multiplier=1.25, expected_batch_size=8.0, seed=3)
    )
    for word in (
        "max_grad_norm: 0.5",
        "noise_multiplier: 1.25",
        "expected_batch_size: 8.0",
        "not private",
    ):
        assert word in text
