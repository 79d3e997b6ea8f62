"""Opacus interop: a model wrapped in Opacus' GradSampleModule works unchanged, and with
the same grad_samples, C and sigma = 0 dpkern's step equals Opacus' DPOptimizer's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dpkern
from dpkern.grad_sample import compute_grad_sample

opacus = pytest.importorskip("opacus")
from opacus import GradSampleModule  # noqa: E402
from opacus.optimizers import DPOptimizer  # noqa: E402


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _data(B=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 6, generator=g) * 3, torch.randint(0, 3, (B,), generator=g)


@pytest.mark.parametrize("twin", ["adamw", "sgd"])
def test_dpkern_on_gradsamplemodule_equals_opacus_dpoptimizer(twin):
    C, B = 0.5, 8
    m_opacus, m_dpkern = GradSampleModule(_net()), GradSampleModule(_net())
    if twin == "adamw":
        o_opacus = DPOptimizer(
            torch.optim.AdamW(m_opacus.parameters(), lr=0.05, weight_decay=0.1),
            noise_multiplier=0.0,
            max_grad_norm=C,
            expected_batch_size=B,
        )
        o_dpkern = dpkern.DPAdamW(
            m_dpkern.parameters(),
            lr=0.05,
            weight_decay=0.1,
            max_grad_norm=C,
            noise_multiplier=0.0,
            expected_batch_size=B,
            backend="torch",
            seed=0,
        )
    else:
        o_opacus = DPOptimizer(
            torch.optim.SGD(m_opacus.parameters(), lr=0.3, momentum=0.9),
            noise_multiplier=0.0,
            max_grad_norm=C,
            expected_batch_size=B,
        )
        o_dpkern = dpkern.DPSGD(
            m_dpkern.parameters(),
            lr=0.3,
            momentum=0.9,
            max_grad_norm=C,
            noise_multiplier=0.0,
            expected_batch_size=B,
            backend="torch",
            seed=0,
        )
    for step in range(3):
        x, y = _data(B, seed=step)
        for model, opt in [(m_opacus, o_opacus), (m_dpkern, o_dpkern)]:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    for a, b in zip(m_opacus.parameters(), m_dpkern.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    o_dpkern.zero_grad()
    assert all(getattr(p, "grad_sample", None) is None for p in m_dpkern.parameters())


def test_compute_grad_sample_matches_opacus_grad_samples():
    x, y = _data(5)
    wrapped = GradSampleModule(_net(), loss_reduction="sum")
    F.cross_entropy(wrapped(x), y, reduction="sum").backward()
    plain = _net()
    compute_grad_sample(plain, F.cross_entropy, x, y)
    for a, b in zip(wrapped.parameters(), plain.parameters()):
        torch.testing.assert_close(b.grad_sample, a.grad_sample, rtol=1e-5, atol=1e-6)


# -- Opacus' make_private over a dpkern optimizer is refused (item 9) --------------------------
from dpkern.interop import SUPPORTED_PATH, opacus_wrapper, refuse_opacus_wrapper  # noqa: E402


def _private(opt_cls, seed=0, **kw):
    """make_private over a dpkern optimizer: (model, Opacus wrapper, loader, dpkern opt, net)."""
    from opacus import PrivacyEngine

    net = _net(seed)
    opt = opt_cls(
        net.parameters(),
        lr=0.05,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=8,
        backend="torch",
        seed=0,
    )
    x, y = _data(64, seed=seed)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    model, wrapper, loader = PrivacyEngine().make_private(
        module=net, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, **kw
    )
    return model, wrapper, loader, opt, net


def _first_batch(loader):
    for x, y in loader:
        if len(x):
            return x, y
    raise AssertionError("no non-empty batch")


def _assert_refused(exc_info, opt_name):
    msg = str(exc_info.value)
    assert f"dpkern.{opt_name}" in msg and "Opacus" in msg
    assert "twice" in msg and "epsilon" in msg
    for must in (
        "opacus.GradSampleModule(model)",
        "dpkern.accounting.PrivacyAccountant",
        "without make_private",
        "accountant.step(noise_multiplier",
    ):
        assert must in msg, must


@pytest.mark.parametrize("opt_cls", [dpkern.DPAdamW, dpkern.DPSGD])
@pytest.mark.parametrize("method", ["zero_grad", "step"])
def test_refuse_opacus_wrapper_finds_the_wrapper_on_the_stack(opt_cls, method, monkeypatch):
    """Unit test of the detection (passes before wiring): the dpkern method that Opacus'
    wrapper calls (here replaced on the instance by one that only runs the check) sees the
    wrapper on the call stack and raises, before any dpkern state changes."""
    model, wrapper, loader, opt, net = _private(opt_cls)
    seen = []

    def guarded(*args, **kwargs):
        seen.append(opacus_wrapper(opt))
        refuse_opacus_wrapper(opt)
        raise AssertionError("not refused")

    monkeypatch.setattr(opt, method, guarded)
    x, y = _first_batch(loader)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match="wrapped by Opacus' DPOptimizer") as exc_info:
        if method == "zero_grad":
            wrapper.zero_grad()
        else:
            F.cross_entropy(model(x), y).backward()
            wrapper.step()
    assert seen == [wrapper]
    _assert_refused(exc_info, opt_cls.__name__)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert opt.dp_step == 0


def test_refuse_opacus_wrapper_is_silent_on_the_supported_path():
    """GradSampleModule + dpkern optimizer (no make_private), also next to an Opacus
    DPOptimizer over another model: no wrapper, no p.summed_grad."""
    m_dpkern, m_opacus = GradSampleModule(_net()), GradSampleModule(_net())
    o_dpkern = dpkern.DPSGD(
        m_dpkern.parameters(),
        lr=0.1,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=8,
        backend="torch",
        seed=0,
    )
    o_opacus = DPOptimizer(
        torch.optim.SGD(m_opacus.parameters(), lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=8,
    )
    x, y = _data()
    for model, opt in [(m_opacus, o_opacus), (m_dpkern, o_dpkern)]:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        refuse_opacus_wrapper(o_dpkern)  # before, between and after the two steps
        opt.step()
    assert opacus_wrapper(o_dpkern) is None
    assert all(p.summed_grad is not None for p in m_opacus.parameters())
    refuse_opacus_wrapper(o_dpkern)
    assert o_dpkern.dp_step == 1


def test_refuse_opacus_wrapper_on_opacus_clipped_params():
    """A parameter holding Opacus' clipped sum p.summed_grad: an Opacus optimizer clips it."""
    net = _net()
    opt = dpkern.DPSGD(
        net.parameters(),
        lr=0.1,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=8,
        backend="torch",
        seed=0,
    )
    params = list(net.parameters())
    params[2].summed_grad = None  # what DPOptimizer.__init__ leaves: not refused
    refuse_opacus_wrapper(opt)
    params[2].summed_grad = torch.zeros_like(params[2])
    with pytest.raises(ValueError, match=r"summed_grad \(group 0, position 2, shape \(3, 5\)\)"):
        refuse_opacus_wrapper(opt)
    params[2].requires_grad_(False)  # frozen: not the optimizer's
    refuse_opacus_wrapper(opt)
    assert "GradSampleModule" in SUPPORTED_PATH


@pytest.mark.parametrize("opt_cls", [dpkern.DPAdamW, dpkern.DPSGD, dpkern.DPAdam])
def test_make_private_over_dpkern_optimizer_is_refused_at_first_use(opt_cls):
    """make_private(optimizer=dpkern.DPAdamW(...)) ran, noising twice while Opacus reported
    epsilon for its own mechanism. The first zero_grad() of a usual loop (before any
    clipping or noise) and any step() raise ValueError; parameters and the dpkern
    optimizer are unchanged."""
    model, wrapper, loader, opt, net = _private(opt_cls)
    x, y = _first_batch(loader)
    before = [p.detach().clone() for p in net.parameters()]
    state = {k: v for k, v in opt.state_dict().items() if k != "dp"}
    refused = []
    for call in ("zero_grad", "step"):
        try:
            if call == "zero_grad":
                wrapper.zero_grad()
            else:
                F.cross_entropy(model(x), y).backward()
                wrapper.step()
        except ValueError as exc:
            refused.append(call)
            assert "wrapped by Opacus" in str(exc) and "GradSampleModule" in str(exc)
    assert refused == ["zero_grad", "step"], refused
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert opt.dp_step == 0 and opt.stats["steps"] == 0
    assert {k: v for k, v in opt.state_dict().items() if k != "dp"} == state
