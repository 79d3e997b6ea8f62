"""Per-sample gradients formed during the backward (dpkern.ghost.plan.plan_early / Formed):
each use is added as its output gradient arrives and its activation is let go. The formed
norms and clipped sums equal a per-example loop's (no dpkern), whichever parameters are
formed (mixed uses, shared weights, a recorded output that never reaches the loss), the
cost model forms LoRA-shaped layers, and the activations are really freed."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import dpkern
import dpkern.ghost.plan as plan_mod
from dpkern.ghost.capture import Capture
from dpkern.ghost.plan import Plan

from conftest import case_seed

pytest.importorskip("transformers")
from test_ghost import loop_grads  # noqa: E402
from test_ghost_plan import _cases as plan_cases  # noqa: E402

RTOL = 1e-5


class LowRank(nn.Module):
    """A full layer, then a LoRA-shaped pair used twice (shared weights: two uses each),
    and a recorded layer whose output never reaches the loss."""

    def __init__(self, d=24, r=2):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.a = nn.Linear(d, r, bias=False)
        self.b = nn.Linear(r, d, bias=False)
        self.unused = nn.Linear(d, r, bias=False)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h + self.b(self.a(h))
        h = h + self.b(self.a(torch.tanh(h)))
        self.unused(h)
        return h


def lowrank_loss(model, x):
    return model(x).square().sum((1, 2))


def _cases():
    torch.manual_seed(case_seed(70))
    low = ("lowrank", LowRank(), lowrank_loss, torch.randn(3, 16, 5))
    return [low, *plan_cases()]  # + the tied GPT-2 and Seq (embedding, norms, linear)


@contextlib.contextmanager
def every_param_early():
    """Form every eligible parameter during the backward (whatever the cost model says)."""
    real = plan_mod.plan_early
    plan_mod.plan_early = lambda params, uses, B, keep_bytes=None: [bool(u) for u in uses]
    try:
        yield
    finally:
        plan_mod.plan_early = real


def _backward(model, params, loss_of, x, early=True):
    cap = Capture(model, params)
    cap.attach()
    try:
        return cap.backward(loss_of(model, x), early=early)
    finally:
        cap.detach()


@pytest.mark.parametrize("forced", [True, False], ids=["every", "cost-model"])
@pytest.mark.parametrize("case", range(3), ids=["lowrank", "gpt2", "seq"])
def test_formed_norms_and_sums_equal_the_loop(case, forced):
    name, model, loss_of, x = _cases()[case]
    params, ref = loop_grads(model, loss_of, x)
    with every_param_early() if forced else contextlib.nullcontext():
        B, uses, _, formed = _backward(model, params, loss_of, x)
    if forced or name == "lowrank":
        assert formed is not None and formed.members
        for k, _, _ in formed.members:
            assert uses[k] == []  # nothing of a formed parameter is held
    plan = Plan(params, uses, B, formed=formed)
    names = {id(p): n for n, p in model.named_parameters()}
    for p, n, r in zip(params, plan.each(), ref):
        want = r.reshape(B, -1).square().sum(1)
        torch.testing.assert_close(
            n.double(), want, rtol=RTOL, atol=1e-9, msg=lambda m: f"{names[id(p)]}: {m}"
        )
    c = torch.rand(B) + 0.1
    for p, s, r in zip(params, plan.sums(c), ref):
        want_s = torch.einsum("b,b...->...", c.double(), r)
        atol = 16 * torch.finfo(torch.float32).eps * max(1.0, float(r.abs().max()))
        torch.testing.assert_close(s.double(), want_s, rtol=RTOL, atol=atol)


def test_cost_model_forms_the_low_rank_pair():
    """LoRA shapes (T > r): the pair's per-sample gradients (B x r x d) are formed during the
    backward; the layer whose output never reaches the loss gets a zero row."""
    _, model, loss_of, x = _cases()[0]
    params = list(model.parameters())
    B, uses, _, formed = _backward(model, params, loss_of, x)
    formed_names = {n for n, p in model.named_parameters() if id(p) in formed.slot}
    assert {"a.weight", "b.weight", "unused.weight"} <= formed_names
    assert "inp.bias" not in formed_names  # a bias alone saves nothing
    k = next(k for k, p in enumerate(params) if p is model.unused.weight)
    row = next((o, n) for j, o, n in formed.members if j == k)
    assert torch.equal(formed.buf[:, row[0] : row[0] + row[1]], torch.zeros(B, row[1]))


def test_activations_of_formed_layers_are_freed_in_the_backward():
    """With early formation, nothing the backward returns refers to the storage of the
    formed layers' inputs (nor their output gradients); without it, their uses hold them
    to the end of the backward."""
    _, model, loss_of, x = _cases()[0]
    params = list(model.parameters())
    for early in (False, True):
        ptrs = []
        handle = model.a.register_forward_pre_hook(
            lambda m, a: ptrs.append(a[0].untyped_storage().data_ptr())
        )
        try:
            B, uses, _, formed = _backward(model, params, loss_of, x, early=early)
        finally:
            handle.remove()
        held = {
            t.untyped_storage().data_ptr()
            for us in uses
            for u in us
            for t in vars(u).values()
            if isinstance(t, torch.Tensor)
        }
        assert len(ptrs) == 2
        assert any(p in held for p in ptrs) != early, (early, ptrs, held)
        k = next(k for k, p in enumerate(params) if p is model.b.weight)
        assert (uses[k] == []) == early  # b's output gradients [B, T, d] are not held


def test_ghost_step_with_formed_layers_equals_per_sample_step():
    """The whole DP step (GhostClipping + DPAdamW) with the pair formed early equals the
    per-sample path's step, noise included."""
    _, model, loss_of, x = _cases()[0]
    twin = LowRank()
    twin.load_state_dict(model.state_dict())
    kw = dict(lr=0.05, max_grad_norm=0.5, noise_multiplier=0.7, expected_batch_size=3.0)
    opt = dpkern.DPAdamW(model.parameters(), **kw, seed=11, backend="torch")
    opt2 = dpkern.DPAdamW(twin.parameters(), **kw, seed=11, backend="torch")
    with dpkern.ghost.GhostClipping(model, opt, verify="first") as gc_:
        gc_.backward(loss_of(model, x))
    opt.step()
    from dpkern.grad_sample import compute_grad_sample

    compute_grad_sample(twin, lambda out: out.square().sum(), x)
    opt2.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
