"""Ghost clipping reads each operation's arguments by role, however they are passed.

- A parameter (or the activation) passed by keyword (``F.linear(x, weight=W)``,
  ``torch.addmm(b, x, mat2=W)``, ...) gives the exact per-sample norm of the one-sample
  autograd loop, or is refused: it is never left out of the norm.
- A recorded call's parameter that the applied rule gives no use is a ValueError naming
  the parameter and the operation (the safeguard behind every rule).
- ``instantiate_unsupported=True`` slices per sample only the module arguments that are
  proven batch-led (LEAD), whatever their shape: a position table with T == B is passed
  whole (exact), and a sample-dependent argument in another layout is refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpkern.ghost import rules as rules_mod
from dpkern.ghost.capture import Capture
from conftest import case_seed

pytest.importorskip("transformers")  # (test_ghost's helpers need it at import)
from test_ghost import assert_norms_match  # noqa: E402

B, K, N = 4, 6, 3


class Call(nn.Module):
    """A module whose forward is ``fn(self, x)``, with parameters of the given shapes."""

    def __init__(self, fn, **shapes):
        super().__init__()
        self.fn = fn
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.randn(*shape)))

    def forward(self, x):
        return self.fn(self, x)


def sq(m, x):
    return m(x).double().square().flatten(1).sum(1)


def _emb_fn(m, ids):
    return F.embedding(input=ids, weight=m.E, padding_idx=0)


def _pos_fn(m, ids):
    h = F.embedding(ids, weight=m.E)
    pos = F.embedding(torch.arange(ids.shape[1]), weight=m.P)  # pending: no batch
    return torch.add(h, other=pos, alpha=2.0)


def _bn_fn(m, x):
    rm, rv = torch.linspace(-1, 1, K), torch.linspace(0.5, 2, K)
    return F.batch_norm(x, rm, rv, weight=m.w, bias=m.b, training=False, eps=1e-3)


#: name -> (forward, parameter shapes, input maker)
CASES = {
    "linear(x, weight=, bias=)": (
        lambda m, x: F.linear(x, weight=m.W, bias=m.b),
        {"W": (N, K), "b": (N,)},
        lambda: torch.randn(B, K),
    ),
    "linear(input=, weight=, bias=)": (
        lambda m, x: F.linear(input=x, weight=m.W, bias=m.b),
        {"W": (N, K), "b": (N,)},
        lambda: torch.randn(B, 5, K),
    ),
    "linear(x, W, bias=)": (
        lambda m, x: F.linear(x, m.W, bias=m.b),
        {"W": (N, K), "b": (N,)},
        lambda: torch.randn(B, K),
    ),
    "addmm(b, x, mat2=)": (
        lambda m, x: torch.addmm(m.b, x, mat2=m.W),
        {"W": (K, N), "b": (N,)},
        lambda: torch.randn(B, K),
    ),
    "addmm(input=, mat1=, mat2=, beta, alpha)": (
        lambda m, x: torch.addmm(input=m.b, mat1=x, mat2=m.W, beta=2.0, alpha=0.5),
        {"W": (K, N), "b": (N,)},
        lambda: torch.randn(B, K),
    ),
    "b.addmm(x, mat2=)": (
        lambda m, x: m.b.addmm(x, mat2=m.W),
        {"W": (K, N), "b": (N,)},
        lambda: torch.randn(B, K),
    ),
    "matmul(x, other=)": (
        lambda m, x: torch.matmul(x, other=m.W),
        {"W": (K, N)},
        lambda: torch.randn(B, 5, K),
    ),
    "mm(x, mat2=)": (
        lambda m, x: torch.mm(x, mat2=m.W),
        {"W": (K, N)},
        lambda: torch.randn(B, K),
    ),
    "mul(x, other=)": (
        lambda m, x: torch.mul(x, other=m.w),
        {"w": (K,)},
        lambda: torch.randn(B, 5, K),
    ),
    "add(x, other=, alpha=)": (
        lambda m, x: torch.add(x, other=m.b, alpha=3.0).tanh(),
        {"b": (K,)},
        lambda: torch.randn(B, K),
    ),
    "sub(x, other=, alpha=)": (
        lambda m, x: torch.sub(x, other=m.b, alpha=2.0).tanh(),
        {"b": (K,)},
        lambda: torch.randn(B, K),
    ),
    "embedding(input=, weight=, padding_idx=)": (
        _emb_fn,
        {"E": (7, N)},
        lambda: torch.randint(0, 7, (B, 5)),
    ),
    "embedding + add(h, other=pos, alpha=)": (
        _pos_fn,
        {"E": (7, N), "P": (5, N)},
        lambda: torch.randint(0, 7, (B, 5)),
    ),
    "layer_norm(x, shape, weight=, bias=, eps=)": (
        lambda m, x: F.layer_norm(x, (K,), weight=m.w, bias=m.b, eps=1e-3),
        {"w": (K,), "b": (K,)},
        lambda: torch.randn(B, 5, K),
    ),
    "layer_norm(input=, normalized_shape=, bias=)": (
        lambda m, x: F.layer_norm(input=x, normalized_shape=(K,), bias=m.b),
        {"b": (K,)},
        lambda: torch.randn(B, 5, K),
    ),
    "batch_norm eval (weight=, bias=)": (_bn_fn, {"w": (K,), "b": (K,)}, lambda: torch.randn(B, K)),
}
if hasattr(F, "rms_norm"):
    CASES["rms_norm(x, shape, weight=, eps=)"] = (
        lambda m, x: F.rms_norm(x, (K,), weight=m.w, eps=1e-4),
        {"w": (K,)},
        lambda: torch.randn(B, 5, K),
    )


@pytest.mark.parametrize("k,name", list(enumerate(CASES)), ids=list(CASES))
def test_keyword_arguments_give_exact_norms(k, name):
    torch.manual_seed(case_seed(k))
    fn, shapes, make = CASES[name]
    model = Call(fn, **shapes)
    assert_norms_match(model, sq, make())


def _ghost_backward(model, loss_of, x, **kw):
    cap = Capture(model, [p for p in model.parameters() if p.requires_grad], **kw)
    cap.attach()
    try:
        return cap.backward(loss_of(model, x), early=False)
    finally:
        cap.detach()


def test_a_parameter_without_a_use_from_its_rule_is_an_error(monkeypatch):
    """The safeguard: a rule that gives no use to a parameter its call lists (here a
    broken linear rule that forgets the bias) is a ValueError naming both."""

    def no_bias(fa, args, kwargs):
        w = fa.get(1)
        return lambda G, ins: [rules_mod._outer(w, G, ins[0])]

    broken = dataclasses.replace(rules_mod.RULES[F.linear], uses=no_bias)
    for f in [f for f, r in rules_mod.RULES.items() if r.name == "linear"]:
        monkeypatch.setitem(rules_mod.RULES, f, broken)
    torch.manual_seed(case_seed(100))
    model = Call(lambda m, x: F.linear(x, weight=m.W, bias=m.b), W=(N, K), b=(N,))
    with pytest.raises(
        ValueError, match=r"linear in Call gives no per-sample use to b \(shape \(3,\)\)"
    ):
        _ghost_backward(model, sq, torch.randn(B, K))


def test_a_parameter_in_an_argument_no_rule_covers_is_refused():
    """``F.linear(P, x)``: the parameter is the linear's input, not its weight."""
    torch.manual_seed(case_seed(101))
    model = Call(lambda m, x: F.linear(m.P, weight=x).sum(0), P=(N, K))
    with pytest.raises(ValueError, match=r"no rule .*P \(shape \(3, 6\)\)"):
        _ghost_backward(model, lambda m, x: m(x).square(), torch.randn(B, K))


# -- instantiate_unsupported: which module arguments are sliced per sample ----------------------
D = 3


class Mix(nn.Module):
    """Owns a parameter used by einsum (no ghost rule)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D))

    def forward(self, x, table, scale=None):
        if table.shape[0] != x.shape[1]:  # (a batch-major flattening of x's shape)
            table = table.view_as(x)
        h = torch.einsum("btd,de->bte", x + table, self.w)
        return h if scale is None else h * scale


class Positions(nn.Module):
    """``mix(x, table[:T])``: a non-batch table whose dim 0 is T (== B in some steps)."""

    def __init__(self, how="positional"):
        super().__init__()
        self.mix, self.how = Mix(), how
        self.register_buffer("table", torch.randn(64, D) * 3)

    def forward(self, x):
        t = self.table[: x.shape[1]]
        if self.how == "keyword":
            return self.mix(x, table=t, scale=torch.tanh(x))  # a LEAD keyword argument
        if self.how == "moved":
            return self.mix(x, x.transpose(0, 1))  # depends on the samples, not LEAD
        if self.how == "flat":
            return self.mix(x, torch.tanh(x).reshape(-1, D))  # FLAT: not sliced by shape
        return self.mix(x, t)


@pytest.mark.parametrize("how", ["positional", "keyword"])
@pytest.mark.parametrize("b,t", [(4, 6), (5, 5), (3, 3)])
def test_instantiated_module_slices_only_batch_arguments(how, b, t):
    torch.manual_seed(case_seed(200 + 10 * b + t))
    model = Positions(how)
    assert_norms_match(model, sq, torch.randn(b, t, D), instantiate_unsupported=True)


@pytest.mark.parametrize("how", ["moved", "flat"])
def test_instantiated_module_refuses_a_sample_dependent_non_batch_argument(how):
    torch.manual_seed(case_seed(300))
    model = Positions(how)
    with pytest.raises(ValueError, match=r"(?s)mix.*depends? on the samples"):
        _ghost_backward(model, sq, torch.randn(4, 4, D), instantiate_unsupported=True)


def test_instantiated_module_with_a_tuple_output_says_so():
    class Rec(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(D, 4, batch_first=True)

        def forward(self, x):
            return self.lstm(x)[0]

    torch.manual_seed(case_seed(301))
    with pytest.raises(ValueError, match=r"(?s)lstm.*tuple"):
        _ghost_backward(Rec(), sq, torch.randn(3, 5, D), instantiate_unsupported=True)
