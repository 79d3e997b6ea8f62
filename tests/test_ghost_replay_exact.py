"""``instantiate_unsupported=True`` replays each recorded call of a module without ghost
rules one sample at a time. The replay must compute exactly what the recorded call did,
or the call is refused (ValueError naming the module, with ``verify="off"`` too), never a
wrong per-sample norm in silence:

- hooks: a user forward pre-hook or forward hook on an instantiated module (or a global
  one) is refused (a replay through it applies it twice, one without it misses it);
  hooks on ruled modules stay exact;
- side channels: a tensor computed from the module's parameters inside its call that
  reaches the loss other than through the call's output (kept as an attribute, the output
  detached) is refused; a ruled use of its parameter outside its call stays exact;
- randomness: a random draw during the call (dropout in training mode, ``torch.rand*``,
  ``bernoulli``...) cannot be replayed per sample (other draws): refused, naming the
  module. Dropout in eval mode, and dropout outside instantiated modules, stay exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpkern.ghost import GhostClipping
from dpkern.ghost.capture import Capture
from conftest import case_seed

pytest.importorskip("transformers")  # (test_ghost's helpers need it at import)
from test_ghost import RTOL, assert_norms_match, loop_grads, clip_only_optimizer, sq  # noqa: E402
from dpkern.ghost.norms import param_norm_sq  # noqa: E402

D = 4


class Unruled(nn.Module):
    """Owns ``w``, consumed by einsum (no ghost rule): gets the per-sample pass.
    ``extra(self, h, u)``: more of the forward (u = the einsum's result)."""

    def __init__(self, extra=None):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.extra = extra

    def forward(self, h):
        u = torch.einsum("bd,de->be", torch.tanh(h), self.w)
        return self.extra(self, h, u) if self.extra is not None else u


class Outer(nn.Module):
    """``lin`` (ruled) -> ``m`` -> ``after(self, h, y)`` (default: ``y + h``)."""

    def __init__(self, m, after=None):
        super().__init__()
        self.lin, self.m, self.after = nn.Linear(3, D), m, after

    def forward(self, x):
        h = self.lin(x)
        y = self.m(h)
        return self.after(self, h, y) if self.after is not None else y + h


def _norms(model, x, setup=None):
    """Ghost norms (instantiate_unsupported) of every parameter; ``setup(model)`` runs
    after the capture's hooks are attached (a hook registered after them)."""
    params = list(model.parameters())
    cap = Capture(model, params, instantiate_unsupported=True)
    cap.attach()
    try:
        if setup is not None:
            setup(model)
        B, uses, _, _ = cap.backward(sq(model, x), early=False)
    finally:
        cap.detach()
    return [param_norm_sq(u, p.shape, B) if u else torch.zeros(B) for p, u in zip(params, uses)]


def _assert_exact(model, x, setup=None):
    """Ghost norms == the one-sample-at-a-time autograd loop (hooks of ``setup`` on)."""
    ghost = _norms(model, x, setup)
    params, ref = loop_grads(model, sq, x)
    for p, r, g in zip(params, ref, ghost):
        want = r.reshape(r.shape[0], -1).square().sum(1)
        torch.testing.assert_close(g.double(), want, rtol=RTOL, atol=1e-12)


def _refused(model, x, match, setup=None):
    with pytest.raises(ValueError, match=match):
        _norms(model, x, setup)


# -- controls --------------------------------------------------------------------------------
def test_control_plain_instantiated_module_is_exact():
    torch.manual_seed(case_seed(900))
    assert_norms_match(Outer(Unruled()), sq, torch.randn(5, 3), instantiate_unsupported=True)


# -- hooks -----------------------------------------------------------------------------------
def _triple_out(mod, args, out):
    return out * 3


@pytest.mark.parametrize("when", ["before", "after"])
def test_forward_hook_on_an_instantiated_module_is_refused(when):
    """Registered before the capture attaches or after it: its operations run in the
    module's call but after the recorded output (a replay through it differs)."""
    torch.manual_seed(case_seed(901 + (when == "after")))
    model = Outer(Unruled())
    if when == "before":
        model.m.register_forward_hook(_triple_out)
    _refused(
        model,
        torch.randn(4, 3),
        r"(?s)\bm \(Unruled\).*forward hook",
        setup=(lambda mdl: mdl.m.register_forward_hook(_triple_out)) if when == "after" else None,
    )


def test_control_forward_hook_on_a_ruled_module_is_exact():
    torch.manual_seed(case_seed(907))
    model = Outer(Unruled())
    model.lin.register_forward_hook(_triple_out)
    model.lin.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    _assert_exact(model, torch.randn(5, 3))


@pytest.mark.parametrize("when", ["before", "after"])
def test_forward_pre_hook_on_an_instantiated_module_is_refused(when):
    """A pre-hook doubling the argument would be applied twice by a replay through the
    module's call (and one setting state the forward reads cannot be replayed)."""
    torch.manual_seed(case_seed(903))
    model = Outer(Unruled())

    def hook(mdl):
        mdl.m.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))

    if when == "before":
        hook(model)
    _refused(
        model,
        torch.randn(4, 3),
        r"(?s)\bm \(Unruled\).*pre-hook",
        setup=hook if when == "after" else None,
    )


def test_global_forward_hook_is_refused():
    torch.manual_seed(case_seed(905))
    h = nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: out * 3 if isinstance(mod, Unruled) else None
    )
    try:
        _refused(Outer(Unruled()), torch.randn(4, 3), r"(?s)\bm \(Unruled\).*global forward hook")
    finally:
        h.remove()


def test_forward_pre_hook_is_refused_by_ghost_clipping_with_verify_off():
    torch.manual_seed(case_seed(906))
    model = Outer(Unruled())
    model.m.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    opt = clip_only_optimizer(model)
    with GhostClipping(model, opt, verify="off", instantiate_unsupported=True) as gc:
        with pytest.raises(ValueError, match=r"(?s)\bm \(Unruled\).*pre-hook"):
            gc.clipped_sums(sq(model, torch.randn(4, 3)))


# -- side channels ---------------------------------------------------------------------------
def _keep_param_tensor(self, h, u):
    self.last = (2 * self.w).sin()  # from the weight, kept outside the output
    return u


def _keep_input_tensor(self, h, u):
    self.last = h.sin()  # from the input only
    return u


def _use_last(self, h, y):
    return y + h * self.m.last.sum()


def test_side_channel_from_the_weight_is_refused():
    torch.manual_seed(case_seed(910))
    _refused(
        Outer(Unruled(_keep_param_tensor), _use_last),
        torch.randn(4, 3),
        r"(?s)\bm \(Unruled\).*other than through (its|the call's) output",
    )


def test_side_channel_from_an_intermediate_of_the_output_is_refused():
    """An intermediate that the output also depends on, kept and used outside."""

    def keep(self, h, u):
        self.last = u
        return u.tanh()

    torch.manual_seed(case_seed(911))
    _refused(
        Outer(Unruled(keep), lambda s, h, y: y + s.m.last),
        torch.randn(4, 3),
        r"(?s)\bm \(Unruled\).*other than through (its|the call's) output",
    )


def test_side_channel_refused_by_ghost_clipping_with_verify_off():
    torch.manual_seed(case_seed(912))
    model = Outer(Unruled(_keep_param_tensor), _use_last)
    with GhostClipping(
        model, clip_only_optimizer(model), verify="off", instantiate_unsupported=True
    ) as gc:
        with pytest.raises(ValueError, match=r"(?s)\bm \(Unruled\)"):
            gc.clipped_sums(sq(model, torch.randn(4, 3)))


def test_control_ruled_use_of_the_parameter_outside_its_module_is_exact():
    """(Kept as its own record; an unruled use there: refused by ops, see
    test_ghost_outside_use.)"""
    torch.manual_seed(case_seed(913))
    model = Outer(Unruled(), lambda s, h, y: y + h @ s.m.w)
    assert_norms_match(model, sq, torch.randn(5, 3), instantiate_unsupported=True)


def test_control_side_channel_from_the_input_only_is_exact():
    torch.manual_seed(case_seed(914))
    model = Outer(Unruled(_keep_input_tensor), lambda s, h, y: y + s.m.last)
    assert_norms_match(model, sq, torch.randn(5, 3), instantiate_unsupported=True)


# -- randomness ------------------------------------------------------------------------------
class Drop(nn.Module):
    """Owns ``w`` (einsum: no rule) with a random op ``kind`` in its forward."""

    def __init__(self, kind="module"):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.kind, self.drop = kind, nn.Dropout(0.5)

    def forward(self, h):
        u = torch.einsum("bd,de->be", torch.tanh(h), self.w)
        k = self.kind
        if k == "module":
            return self.drop(u)
        if k == "functional":
            return F.dropout(u, 0.3, self.training)
        if k == "rand_like":
            return u * (torch.rand_like(u) > 0.5) if self.training else u
        if k == "bernoulli":
            return u * torch.bernoulli(torch.full((D,), 0.5)) if self.training else u
        if k == "randn":
            return u + torch.randn(u.shape) if self.training else u
        raise AssertionError(k)


KINDS = ["module", "functional", "rand_like", "bernoulli", "randn"]


@pytest.mark.parametrize("kind", KINDS)
def test_random_op_in_instantiated_module_is_refused(kind):
    torch.manual_seed(case_seed(920 + KINDS.index(kind)))
    _refused(Outer(Drop(kind)), torch.randn(4, 3), r"(?s)\bm \(Drop\).*random.*eval\(\)")


@pytest.mark.parametrize("verify", ["off", "first"])
def test_dropout_refused_by_ghost_clipping(verify):
    torch.manual_seed(case_seed(930))
    model = Outer(Drop())
    with GhostClipping(
        model, clip_only_optimizer(model), verify=verify, instantiate_unsupported=True
    ) as gc:
        with pytest.raises(ValueError, match=r"(?s)\bm \(Drop\).*random"):
            gc.clipped_sums(sq(model, torch.randn(4, 3)))


@pytest.mark.parametrize("kind", KINDS)
def test_control_random_module_in_eval_mode_is_exact(kind):
    torch.manual_seed(case_seed(935 + KINDS.index(kind)))
    model = Outer(Drop(kind)).eval()
    assert_norms_match(model, sq, torch.randn(5, 3), instantiate_unsupported=True)


def test_control_dropout_outside_instantiated_modules_keeps_its_masks():
    """A ruled model with dropout in training mode: the ghost norms are those of the same
    batched forward (same masks), per sample by autograd; and the masks are drawn."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.drop, self.b = nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 2)
            self.c, self.m = nn.Linear(3, D), Unruled()

        def forward(self, x):
            return self.b(self.drop(self.a(x))).sum(1, keepdim=True) + self.m(self.c(x))

    torch.manual_seed(case_seed(940))
    model, x, seed = Net().train(), torch.randn(5, 3), case_seed(941)
    params = list(model.parameters())
    torch.manual_seed(seed)
    losses = sq(model, x)
    want = []
    for i in range(x.shape[0]):
        gs = torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True)
        want.append(
            torch.stack([torch.zeros(()) if g is None else g.double().square().sum() for g in gs])
        )
    want = torch.stack(want, 1)
    torch.manual_seed(seed)
    ghost = _norms(model, x)
    for w, g in zip(want, ghost):
        torch.testing.assert_close(g.double(), w, rtol=RTOL, atol=1e-12)
    torch.manual_seed(seed)
    with torch.no_grad():
        assert not torch.equal(model(x), model.eval()(x))  # (dropout was active)


def test_side_channel_of_a_call_whose_output_needs_no_grad_is_refused():
    """The output is detached (no replayed call has a graph edge); the weight reaches the
    loss through the kept tensor only."""

    def keep(self, h, u):
        self.last = u
        return u.detach()

    torch.manual_seed(case_seed(915))
    _refused(
        Outer(Unruled(keep), lambda s, h, y: y + s.m.last),
        torch.randn(4, 3),
        r"(?s)\bm \(Unruled\).*other than through the call's output",
    )
