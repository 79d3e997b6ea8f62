"""``instantiate_unsupported=True``: the per-sample pass of a module (one of its parameters
has no ghost rule) replays each of its recorded calls on each sample, and the ruled
records of its parameters are dropped. So EVERY call of it in the recorded forward must be
replayable, or the uses of its parameters in the calls left out are missing from the
per-sample norm (under-clipping). A call that cannot be replayed (an output that is not one
tensor: a tuple, a dict; the model's own call; an argument changed in place during or
after the call) is a ValueError naming the module and why, with or without the first-step
check; calls that can (tensor outputs, also one changed in place later, or one made under
no_grad) keep the exact norms of the one-sample-at-a-time autograd loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpkern.ghost import GhostClipping
from dpkern.ghost.capture import Capture
from conftest import case_seed

pytest.importorskip("transformers")  # (test_ghost's helpers need it at import)
from test_ghost import assert_norms_match, clip_only_optimizer, sq  # noqa: E402

D = 4


class Unruled(nn.Module):
    """Owns ``w``, consumed by einsum (no ghost rule): gets the per-sample pass. ``out``
    picks what the call returns: the tensor, a tuple or a dict holding it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / D**0.5)

    def forward(self, h, out="tensor"):
        y = 2 * torch.einsum("bd,de->be", torch.tanh(2 * h), self.w)  # (not a view)
        if out == "tuple":
            return y, y.detach()
        if out == "dict":
            return {"y": y}
        return y


class Twice(nn.Module):
    """Calls ``m`` twice: the ``first`` call returns what ``first`` says, the second what
    ``second`` says; ``after``: what the model then does to the first call's output or
    input (``"mul_out"``: scales the output in place, ``"mul_in"``: the input)."""

    def __init__(self, first="tensor", second="tensor", after=None):
        super().__init__()
        self.lin = nn.Linear(3, D)
        self.m = Unruled()
        self.first, self.second, self.after = first, second, after

    def forward(self, x):
        h = self.lin(x)
        y = _pick(self.m(h, out=self.first))
        if self.after == "mul_out":
            y.mul_(3)
        elif self.after == "mul_in":
            h.mul_(3)
        elif self.after == "no_grad":
            with torch.no_grad():
                y = y + self.m(h)
        z = _pick(self.m(h.cos(), out=self.second))
        return y + z + h


def _pick(out):
    return out[0] if isinstance(out, tuple) else out["y"] if isinstance(out, dict) else out


def _capture_backward(model, x):
    cap = Capture(model, list(model.parameters()), instantiate_unsupported=True)
    cap.attach()
    try:
        return cap.backward(sq(model, x), early=False)
    finally:
        cap.detach()


@pytest.mark.parametrize("after", [None, "mul_out", "no_grad"])
def test_two_tensor_calls_keep_exact_norms(after):
    """Controls: two calls returning a tensor are both replayed (also when the model then
    scales the first output in place, or makes a third call under no_grad)."""
    torch.manual_seed(case_seed(600 + [None, "mul_out", "no_grad"].index(after)))
    assert_norms_match(Twice(after=after), sq, torch.randn(5, 3), instantiate_unsupported=True)


NON_TENSOR = [
    ("tensor", "tuple", "tuple"),
    ("tuple", "tensor", "tuple"),
    ("tensor", "dict", "dict"),
    ("dict", "tensor", "dict"),
]


@pytest.mark.parametrize("first,second,kind", NON_TENSOR)
def test_a_call_with_a_non_tensor_output_is_refused_by_the_capture(first, second, kind):
    torch.manual_seed(case_seed(610))
    with pytest.raises(ValueError, match=rf"(?s)\bm \(Unruled\).*returned a {kind}.*per-sample"):
        _capture_backward(Twice(first, second), torch.randn(4, 3))


@pytest.mark.parametrize("verify", ["off", "first"])
@pytest.mark.parametrize("first,second,kind", NON_TENSOR[:2])
def test_a_call_with_a_non_tensor_output_is_refused_by_ghost_clipping(first, second, kind, verify):
    torch.manual_seed(case_seed(620))
    model = Twice(first, second)
    with GhostClipping(
        model, clip_only_optimizer(model), verify=verify, instantiate_unsupported=True
    ) as gc:
        with pytest.raises(ValueError, match=rf"(?s)\bm \(Unruled\).*returned a {kind}"):
            gc.clipped_sums(sq(model, torch.randn(4, 3)))


def test_an_argument_changed_in_place_after_the_call_is_refused():
    """The replay would read the changed values (the recorded arguments share storage)."""
    torch.manual_seed(case_seed(630))
    with pytest.raises(ValueError, match=r"(?s)\bm \(Unruled\).*argument 0 .*in place"):
        _capture_backward(Twice(after="mul_in"), torch.randn(4, 3))


class InPlace(nn.Module):
    """Changes its own input in place before using it (a replay would do it twice)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / D**0.5)

    def forward(self, h):
        h.mul_(2)
        return torch.einsum("bd,de->be", h, self.w).tanh()


def test_an_argument_changed_in_place_during_the_call_is_refused():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.m = nn.Linear(3, D), InPlace()

        def forward(self, x):
            return self.m(self.lin(x) + 0)

    torch.manual_seed(case_seed(631))
    with pytest.raises(ValueError, match=r"(?s)\bm \(InPlace\).*argument 0 .*in place"):
        _capture_backward(Outer(), torch.randn(4, 3))


def test_the_model_itself_with_a_parameter_without_a_rule_says_so():
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.w = nn.Linear(3, D), nn.Parameter(torch.randn(D, D))

        def forward(self, x):
            return torch.einsum("bd,de->be", self.lin(x), self.w)

    torch.manual_seed(case_seed(632))
    with pytest.raises(ValueError, match=r"(?s)\bRoot \(Root\).*the model itself"):
        _capture_backward(Root(), torch.randn(4, 3))


class ViewOut(nn.Module):
    """Returns a view of an internal result; the model then scales it in place."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / D**0.5)

    def forward(self, h):
        return torch.einsum("bd,de->be", torch.tanh(h), self.w).view(-1, D)


def test_a_view_output_changed_in_place_later_is_refused():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.m = nn.Linear(3, D), ViewOut()

        def forward(self, x):
            return self.m(self.lin(x)).mul_(3)

    torch.manual_seed(case_seed(633))
    assert ViewOut()(torch.randn(4, D))._base is not None
    with pytest.raises(ValueError, match=r"(?s)\bm \(ViewOut\).*output \(a view.*in place"):
        _capture_backward(Outer(), torch.randn(4, 3))
