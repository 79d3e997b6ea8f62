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
        o_opacus = DPOptimizer(torch.optim.AdamW(m_opacus.parameters(), lr=0.05,
                                                 weight_decay=0.1),
                               noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=B)
        o_dpkern = dpkern.DPAdamW(m_dpkern.parameters(), lr=0.05, weight_decay=0.1,
                                  max_grad_norm=C, noise_multiplier=0.0,
                                  expected_batch_size=B, backend="torch", seed=0)
    else:
        o_opacus = DPOptimizer(torch.optim.SGD(m_opacus.parameters(), lr=0.3, momentum=0.9),
                               noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=B)
        o_dpkern = dpkern.DPSGD(m_dpkern.parameters(), lr=0.3, momentum=0.9, max_grad_norm=C,
                                noise_multiplier=0.0, expected_batch_size=B, backend="torch",
                                seed=0)
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
