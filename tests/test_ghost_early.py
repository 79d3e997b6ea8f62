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
    """Form every eligible parameter during the backward (whatever the cost model says);
    yields the list of the choices made (one per backward: proof that it was used)."""
    real, made = plan_mod.plan_early, []

    def every(params, uses, B, keep_bytes=None):
        made.append([bool(u) for u in uses])
        return made[-1]

    plan_mod.plan_early = every
    try:
        yield made
    finally:
        plan_mod.plan_early = real


def _backward(model, params, loss_of, x, early=True):
    cap = Capture(model, params)
    cap.attach()
    try:
        return cap.backward(loss_of(model, x), early=early)
    finally:
        cap.detach()


def _poison_formed_blocks(monkeypatch):
    """Formed blocks start as NaN (they are not zeroed: every member's first use writes
    it, :meth:`Formed.finish` zeroes the members that got none)."""
    real = plan_mod.Formed.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.buf.fill_(float("nan"))

    monkeypatch.setattr(plan_mod.Formed, "__init__", init)


@pytest.mark.parametrize("forced", [True, False], ids=["every", "cost-model"])
@pytest.mark.parametrize("case", range(3), ids=["lowrank", "gpt2", "seq"])
def test_formed_norms_and_sums_equal_the_loop(case, forced, monkeypatch):
    name, model, loss_of, x = _cases()[case]
    params, ref = loop_grads(model, loss_of, x)
    _poison_formed_blocks(monkeypatch)
    with every_param_early() if forced else contextlib.nullcontext([]) as made:
        B, uses, _, formed = _backward(model, params, loss_of, x)
    if forced:
        assert made, "the forced choice was not asked for"
        assert {k for k, _, _ in formed.members} == {k for k, c in enumerate(made[-1]) if c}
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


def test_cost_model_forms_the_low_rank_pair(monkeypatch):
    """LoRA shapes (T > r): the pair's per-sample gradients (B x r x d) are formed during the
    backward; the layer whose output never reaches the loss gets a zero row."""
    _, model, loss_of, x = _cases()[0]
    _poison_formed_blocks(monkeypatch)
    params = list(model.parameters())
    B, uses, _, formed = _backward(model, params, loss_of, x)
    formed_names = {n for n, p in model.named_parameters() if id(p) in formed.slot}
    assert {"a.weight", "b.weight", "unused.weight"} <= formed_names
    assert "inp.bias" not in formed_names  # a bias alone saves nothing
    k = next(k for k, p in enumerate(params) if p is model.unused.weight)
    row = next((o, n) for j, o, n in formed.members if j == k)
    block = formed.finish()
    assert torch.equal(block[:, row[0] : row[0] + row[1]], torch.zeros(B, row[1]))


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


class Adapters(nn.Module):
    """A frozen stack with LoRA-shaped pairs beside each layer, a trainable norm (its
    output's gradient is requested) and head; only the first pair's input (the model input)
    needs no grad. ``leak``: the first layer's
    output is scaled by a tensor that requires grad but is no parameter (nor an input)."""

    def __init__(self, d=24, r=2, n=3, leak=False, input_grads=False):
        super().__init__()
        self.base = nn.ModuleList(nn.Linear(d, d) for _ in range(n)).requires_grad_(False)
        self.a = nn.ModuleList(nn.Linear(d, r, bias=False) for _ in range(n))
        self.b = nn.ModuleList(nn.Linear(r, d, bias=False) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3)
        self.scale = torch.ones(d, requires_grad=True) if leak else None
        self.input_grads = input_grads

    def forward(self, x):
        h = x
        if self.input_grads:  # as transformers' enable_input_require_grads hook does
            h = (x * 1.0).requires_grad_(True)
        for k, (base, a, b) in enumerate(zip(self.base, self.a, self.b)):
            h = torch.tanh(base(h) + b(a(h)))
            if k == 0 and self.scale is not None:
                h = h.detach() * self.scale  # the pairs above now hang on `scale` alone
        return self.head(self.norm(h))


def _requested(monkeypatch):
    """The tensors the ghost backward asks autograd for, per call."""
    asked, real = [], torch.autograd.grad

    def spy(outputs, inputs, *a, **kw):
        asked.append([x for x in inputs if isinstance(x, torch.Tensor)])
        return real(outputs, inputs, *a, **kw)

    monkeypatch.setattr(torch.autograd, "grad", spy)
    return asked


def test_formed_weights_reached_through_their_input_skip_their_summed_gradient(monkeypatch):
    """A formed weight whose activation requires grad is not requested from autograd (its
    summed gradient, a GEMM as large as the non-private step's, would be thrown away): the
    backward reaches its node through that activation. Only the first pair's weight, whose
    input needs no grad, is requested; the norms and sums still equal the loop's."""
    torch.manual_seed(case_seed(71))
    model, x = Adapters(), torch.randn(4, 16, 24)
    loss_of = lowrank_loss
    params, ref = loop_grads(model, loss_of, x)
    asked = _requested(monkeypatch)
    with every_param_early():
        B, uses, _, formed = _backward(model, params, loss_of, x)
    formed_ids = {id(params[k]) for k, _, _ in formed.members}
    assert {id(m.weight) for m in [*model.a, *model.b]} <= formed_ids
    (inputs,) = asked
    assert {id(t) for t in inputs} & formed_ids == {id(model.a[0].weight)}
    plan = Plan(params, uses, B, formed=formed)
    c = torch.rand(B) + 0.1
    for p, n, s, r in zip(params, plan.each(), plan.sums(c), ref):
        torch.testing.assert_close(
            n.double(), r.reshape(B, -1).square().sum(1), rtol=RTOL, atol=1e-9
        )
        want = torch.einsum("b,b...->...", c.double(), r)
        atol = 16 * torch.finfo(torch.float32).eps * max(1.0, float(r.abs().max()))
        torch.testing.assert_close(s.double(), want, rtol=RTOL, atol=atol)


@pytest.mark.parametrize("how", ["uncovered-parameter", "input", "requires_grad_"])
def test_tensors_outside_the_parameters_that_require_grad_are_requested(how, monkeypatch):
    """A model parameter requiring grad that the optimizer does not hold, an input that
    requires grad, or a tensor made to require grad in the forward (transformers'
    enable_input_require_grads) could be all an activation depends on: that tensor is
    requested from the backward (so every use hanging on it is reached), the formed
    weights reached through their inputs still are not, and the norms are exact."""
    torch.manual_seed(case_seed(72))
    model = Adapters(input_grads=how == "requires_grad_")
    x = torch.randn(4, 16, 24)
    params = [p for p in model.parameters() if p.requires_grad]
    if how == "uncovered-parameter":
        params = [p for p in params if p is not model.head.bias]
    elif how == "input":
        x.requires_grad_(True)
    asked = _requested(monkeypatch)
    with every_param_early():
        B, uses, _, formed = _backward(model, params, lowrank_loss, x)
    (inputs,) = asked
    formed_ids = {id(params[k]) for k, _, _ in formed.members}
    got_formed = {id(t) for t in inputs} & formed_ids
    if how == "uncovered-parameter":
        assert any(t is model.head.bias for t in inputs)
        assert got_formed == {id(model.a[0].weight)}  # its input needs no grad
    elif how == "input":
        assert any(t is x for t in inputs) and not got_formed
    else:
        made = [t for t in inputs if t.is_leaf and t.shape == x.shape and id(t) not in formed_ids]
        assert len(made) == 1 and not got_formed
    want = [
        r.reshape(B, -1).square().sum(1) for r in loop_grads(model, lowrank_loss, x.detach())[1]
    ]
    got = Plan(params, uses, B, formed=formed).each()
    by_id = {id(p): n for p, n in zip(params, got)}
    for p, w in zip([p for p in model.parameters() if p.requires_grad], want):
        if id(p) in by_id:
            torch.testing.assert_close(by_id[id(p)].double(), w, rtol=RTOL, atol=1e-9)


def test_a_use_the_backward_skips_is_refused_and_the_next_step_is_exact():
    """An activation hanging only on a tensor that requires grad outside the parameters
    and the inputs (invisible to the closed-world check) leaves its formed use's node out
    of the backward: the step raises (nothing added to the optimizer) and the next one
    requests every formed weight, exactly."""
    torch.manual_seed(case_seed(73))
    model, x = Adapters(leak=True), torch.randn(4, 16, 24)
    params = [p for p in model.parameters() if p.requires_grad]
    kw = dict(lr=0.05, max_grad_norm=1e3, noise_multiplier=0.0, expected_batch_size=4.0)
    opt = dpkern.DPAdamW(params, **kw, seed=3, backend="torch")
    before = [p.detach().clone() for p in params]
    gc_ = dpkern.ghost.GhostClipping(model, opt, verify="off").attach()
    with every_param_early():
        with pytest.raises(RuntimeError, match=r"skipped the use\(s\) of a\.1\.weight"):
            gc_.backward(lowrank_loss(model, x))
        with pytest.raises(ValueError, match="never computed"):
            opt.step()  # nothing was accumulated
        assert all(torch.equal(p, q) for p, q in zip(params, before))
        _, norms = gc_.clipped_sums(lowrank_loss(model, x))
    gc_.detach()
    ref = loop_grads(model, lowrank_loss, x)[1]
    want = sum(r.reshape(4, -1).square().sum(1) for r in ref).sqrt()
    torch.testing.assert_close(norms.double(), want, rtol=RTOL, atol=1e-9)
