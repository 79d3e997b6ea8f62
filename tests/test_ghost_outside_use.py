"""``instantiate_unsupported=True``: a parameter consumed by an operation without a ghost
rule gets its per-sample gradients from a per-sample pass over its own module's forward.
A use of it by such an operation OUTSIDE that module's call (a parent's
``torch.einsum(..., self.child.w)``) is not in that pass: it is refused, with or without
the first-step check, never left out of the norm. Uses the pass does replay (inside the
module's call, also through a helper submodule) and rule-covered uses anywhere keep the
exact norms of the one-sample-at-a-time autograd loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpkern.ghost import GhostClipping
from dpkern.ghost.capture import Capture
from conftest import case_seed

pytest.importorskip("transformers")  # (test_ghost's helpers need it at import)
from test_ghost import assert_norms_match, clip_only_optimizer, sq  # noqa: E402

D, K = 5, 4


class Helper(nn.Module):
    """No parameters: applies the weight it is given (inside its caller's call)."""

    def __init__(self, ruled: bool):
        super().__init__()
        self.ruled = ruled

    def forward(self, h, w):
        return h @ w if self.ruled else torch.einsum("bd,dk->bk", h, w)


class Child(nn.Module):
    """Owns ``w``, consumed by einsum (no ghost rule): instantiated per sample."""

    def __init__(self, helper: str | None = None):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, K) / D**0.5)
        self.helper = None if helper is None else Helper(helper == "ruled")

    def forward(self, h):
        y = torch.einsum("bd,dk->bk", h, self.w).tanh()
        if self.helper is not None:
            y = y + self.helper(h.sin(), self.w).cos()
        return y


class Parent(nn.Module):
    """Calls ``child(h)`` and, by ``how``, also uses ``child.w`` in its own forward."""

    def __init__(self, how: str, helper: str | None = None):
        super().__init__()
        self.lin = nn.Linear(3, D)
        self.child = Child(helper)
        self.how = how

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        y = self.child(h)
        w = self.child.w
        if self.how == "einsum":  # no rule, outside child's call
            y = y + torch.einsum("bd,dk->bk", h, w).sin()
        elif self.how == "exp":  # no rule (exp of the weight), then a plain matmul
            y = y + (h @ w.exp()).sin()
        elif self.how == "ruled":  # matmul: a rule covers it
            y = y + (h @ w).sin()
        return y


OUTSIDE = r"(?s)child\.w .*{op} in Parent.*outside .*forward.*per-sample pass"


@pytest.mark.parametrize("how,op", [("einsum", "einsum"), ("exp", "exp")])
@pytest.mark.parametrize("verify", ["off", "first"])
def test_unruled_use_outside_the_instantiated_module_is_refused(how, op, verify):
    torch.manual_seed(case_seed(400 + (how == "exp")))
    model = Parent(how)
    with GhostClipping(
        model, clip_only_optimizer(model), verify=verify, instantiate_unsupported=True
    ) as gc:
        with pytest.raises(ValueError, match=OUTSIDE.format(op=op)):
            gc.clipped_sums(sq(model, torch.randn(4, 3)))


def test_unruled_use_outside_is_refused_by_the_capture_itself():
    torch.manual_seed(case_seed(402))
    model = Parent("einsum")
    cap = Capture(model, list(model.parameters()), instantiate_unsupported=True)
    cap.attach()
    try:
        with pytest.raises(ValueError, match=OUTSIDE.format(op="einsum")):
            cap.backward(sq(model, torch.randn(4, 3)), early=False)
    finally:
        cap.detach()


@pytest.mark.parametrize(
    "how,helper",
    [
        ("inside", None),  # only in its own module: instantiated, exact
        ("ruled", None),  # a ruled use outside + the unruled one inside
        ("inside", "unruled"),  # unruled, through a helper inside the owner's call
        ("inside", "ruled"),  # ruled, through a helper inside the owner's call
        ("ruled", "ruled"),
    ],
)
def test_uses_the_per_sample_pass_or_a_rule_covers_keep_exact_norms(how, helper):
    torch.manual_seed(case_seed(410 + 3 * (how == "ruled") + len(helper or "")))
    assert_norms_match(Parent(how, helper), sq, torch.randn(5, 3), instantiate_unsupported=True)


class Head(nn.Module):
    """Owns ``w`` (linear: ruled) and ``s`` (exp: no rule, so Head is instantiated when
    ``unruled``); also uses the parameters of ``other``, a submodule it never calls."""

    def __init__(self, how: str, unruled: bool = True, exp_first: bool = False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(K, D) / D**0.5)
        self.s = nn.Parameter(torch.randn(K) / 2)
        self.other = nn.Linear(D, K)
        self.how, self.unruled, self.exp_first = how, unruled, exp_first

    def forward(self, h):
        scale = lambda: self.s.exp() if self.unruled else self.s  # noqa: E731
        s = scale() if self.exp_first else None
        if self.how == "foreign":  # a ruled use of other.weight, outside other's call
            y = F.linear(h, self.w) + h @ self.other.weight.T
        else:  # "mixed": one ruled use of Head's w and other's bias
            y = F.linear(h, self.w, self.other.bias)
        return y * (s if s is not None else scale())


class Outer(nn.Module):
    def __init__(self, head: Head):
        super().__init__()
        self.lin, self.head = nn.Linear(3, D), head

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("unruled", [True, False])
def test_ruled_use_of_a_foreign_parameter_in_an_instantiated_module_is_kept(unruled):
    """The record of ``h @ other.weight.T`` made in Head's call is not Head's to replay
    (other.weight is not Head's own): it counts even when Head is instantiated."""
    torch.manual_seed(case_seed(420 + unruled))
    model = Outer(Head("foreign", unruled))
    assert_norms_match(model, sq, torch.randn(5, 3), instantiate_unsupported=True)


@pytest.mark.parametrize("exp_first", [True, False])
def test_one_ruled_use_of_parameters_of_an_instantiated_and_another_module_is_refused(
    exp_first,
):
    torch.manual_seed(case_seed(422 + exp_first))
    model = Outer(Head("mixed", exp_first=exp_first))
    cap = Capture(model, list(model.parameters()), instantiate_unsupported=True)
    cap.attach()
    try:
        with pytest.raises(ValueError, match=r"(?s)linear in head .*other\.bias.*per-sample pass"):
            cap.backward(sq(model, torch.randn(4, 3)), early=False)
    finally:
        cap.detach()


def test_one_ruled_use_of_parameters_of_two_modules_keeps_exact_norms_without_a_pass():
    torch.manual_seed(case_seed(424))
    model = Outer(Head("mixed", unruled=False))
    assert_norms_match(model, sq, torch.randn(5, 3), instantiate_unsupported=True)


def test_unruled_use_inside_nested_calls_of_two_owners_is_refused():
    """A parameter registered in Parent and in its child: both get the per-sample pass,
    and the child's call, nested in Parent's, would be replayed by both."""
    torch.manual_seed(case_seed(425))
    model = Parent("inside")
    model.tied = model.child.w
    cap = Capture(model, list(model.parameters()), instantiate_unsupported=True)
    cap.attach()
    try:
        with pytest.raises(ValueError, match=r"(?s)tied .*einsum in child.*nested calls"):
            cap.backward(sq(model, torch.randn(4, 3)), early=False)
    finally:
        cap.detach()
