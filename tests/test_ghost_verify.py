"""The first-step check of ghost clipping (dpkern.ghost.verify): exact per-sample norms of
a few samples by ordinary autograd against the ghost norms.

Models where ghost clipping is exact pass (and the check really ran); models where it is
silently wrong with the rule-based capture (a Linear subclass with an extra trainable
term, position ids without a batch dimension, a tied head written as a matmul) are
refused naming the parameter, before anything reaches the optimizer; so is a wrong ghost
norm injected into the norm computation (no capture rule can foresee it).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dpkern
import dpkern.ghost.plan as plan_mod
from dpkern.ghost import GhostClipping
from dpkern.ghost.verify import (
    RTOL,
    RTOL_LOW_PRECISION,
    Verifier,
    default_rtol,
    disagreement,
    pick_rows,
)

from conftest import case_seed


def sgd(model, B=4, **kw):
    return dpkern.DPSGD(
        [p for p in model.parameters() if p.requires_grad],
        lr=0.1,
        max_grad_norm=kw.pop("clip", 1.0),
        noise_multiplier=1.0,
        expected_batch_size=B,
        seed=0,
        **kw,
    )


def untouched(opt) -> bool:
    return opt.stats["samples"] == 0 and all(not b.any() for b in opt.clipped_sum_buffers())


class Mlp(nn.Module):
    """Embedding -> LayerNorm -> Linear -> tanh -> Linear, tokens [B, T]."""

    def __init__(self, V=11, d=8):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, ids):
        return self.out(torch.tanh(self.fc(self.ln(self.emb(ids)))))


def mlp_loss(model, ids):
    return model(ids).square().sum((1, 2))


def loop_norms_sq(model, loss_of, x) -> torch.Tensor:
    """Per-example loop (one sample at a time, float64 norms): [B]."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(x.shape[0]):
        gs = torch.autograd.grad(loss_of(model, x[i : i + 1]).sum(), params, allow_unused=True)
        out.append(sum(g.double().square().sum() for g in gs if g is not None))
    return torch.stack(out)


# -- models where ghost clipping is exact: the check passes, once -----------------------------
def test_pick_rows():
    assert pick_rows(0) == [] and pick_rows(1) == [0] and pick_rows(3) == [0, 1, 2]
    assert pick_rows(4) == [0, 1, 2, 3] and pick_rows(16) == [0, 5, 10, 15]
    assert pick_rows(1000) == [0, 333, 666, 999]


def test_exact_model_passes_once():
    torch.manual_seed(case_seed(1))
    model = Mlp()
    opt = sgd(model)
    ids = torch.randint(0, 11, (6, 5))
    with GhostClipping(model, opt) as gc:
        assert gc.verify == "first" and not gc.verified and gc.verify_seconds == 0.0
        gc.backward(mlp_loss(model, ids))
        assert gc.verified and gc.verify_seconds > 0 and gc._verifier.checks == 1
        spent = gc.verify_seconds
        gc.backward(mlp_loss(model, ids))  # "first": never again
        assert gc.verify_seconds == spent and gc._verifier.checks == 1
    assert opt.stats["samples"] == 12


def test_default_gpt2_passes():
    pytest.importorskip("transformers")
    from dpkern.models import CausalLMLogits, default_model, token_loss

    torch.manual_seed(case_seed(2))
    net = CausalLMLogits(default_model(16, n_embd=32, n_layer=2, n_head=2))
    opt = sgd(net, B=5)
    ids = torch.randint(0, 257, (5, 16))
    with GhostClipping(net, opt) as gc:
        gc.backward(token_loss(net(ids), ids))
    assert gc.verified and gc.verify_seconds > 0 and opt.stats["samples"] == 5


def test_bfloat16_model_passes_at_the_low_precision_tolerance():
    torch.manual_seed(case_seed(3))
    model = Mlp().to(torch.bfloat16)
    opt = sgd(model)
    assert default_rtol(opt.trainable_params()) == RTOL_LOW_PRECISION
    assert default_rtol(Mlp().parameters()) == RTOL
    with GhostClipping(model, opt) as gc:
        gc.backward(mlp_loss(model, torch.randint(0, 11, (4, 5))).float())
    assert gc.verified


# -- models where ghost clipping is silently wrong with rule-based capture ---------------------
class ScaledLinear(nn.Linear):
    """A Linear subclass whose forward scales its output by a trainable scalar."""

    def __init__(self, d, p):
        super().__init__(d, p)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) * self.scale


class DeltaLinear(nn.Linear):
    """A Linear subclass with a trainable additive weight delta (LoRA-like)."""

    def __init__(self, d, p):
        super().__init__(d, p)
        self.delta = nn.Parameter(torch.randn(p, d) * 0.1)

    def forward(self, x):
        return F.linear(x, self.weight + self.delta, self.bias)


class Layer(nn.Module):
    def __init__(self, layer, d=6):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.layer = layer

    def forward(self, x):
        return self.layer(torch.tanh(self.inp(x)))


class Positions(nn.Module):
    """Position embedding looked up with arange(T), no batch dimension: [T, d] broadcast
    over the batch. With T == B it looks like a batched input."""

    def __init__(self, T, d=6):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.pos = nn.Embedding(T, d)
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x) + self.pos(torch.arange(x.shape[1]))))


class TiedMatmul(nn.Module):
    """Embedding whose weight is also the output head, written ``h @ emb.weight.T``."""

    def __init__(self, V=9, d=6):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.fc = nn.Linear(d, d)

    def forward(self, ids):
        return torch.tanh(self.fc(self.emb(ids))) @ self.emb.weight.T


def seq_loss(model, x):
    return model(x).square().sum((1, 2))


CASES = {  # name -> (model factory, input factory, the parameter that must be named)
    "linear_subclass_scale": (
        lambda: Layer(ScaledLinear(6, 3)),
        lambda B: torch.randn(B, 5, 4),
        "layer.scale",
    ),
    "linear_subclass_delta": (
        lambda: Layer(DeltaLinear(6, 3)),
        lambda B: torch.randn(B, 5, 4),
        "layer.delta",
    ),
    "positions_T_equals_B": (lambda: Positions(T=4), lambda B: torch.randn(B, 4, 4), "pos.weight"),
    "tied_head_matmul": (TiedMatmul, lambda B: torch.randint(0, 9, (B, 5)), "emb.weight"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_silently_wrong_models_are_refused_or_exact(case):
    """Either GhostClipping refuses (ValueError naming the parameter, the optimizer
    untouched) or its norms equal the per-example loop's: never silently wrong."""
    make, inputs, name = CASES[case]
    torch.manual_seed(case_seed(10))
    model, x = make(), inputs(4)
    opt = sgd(model)
    try:
        with GhostClipping(model, opt) as gc:
            sums, norms = gc.clipped_sums(seq_loss(model, x))
    except ValueError as exc:
        assert name in str(exc), str(exc)
        assert untouched(opt)
        return
    want = loop_norms_sq(model, seq_loss, x).sqrt()
    torch.testing.assert_close(norms.double(), want, rtol=1e-4, atol=1e-7, msg=case)


class DoubleGrad(torch.autograd.Function):
    """Identity forward, gradient times 2: a custom op no ghost rule can know about."""

    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class OddLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, DoubleGrad.apply(self.weight), self.bias)


def test_custom_autograd_function_is_refused_naming_the_parameter():
    torch.manual_seed(case_seed(11))
    model = Layer(OddLinear(6, 3))
    opt = sgd(model)
    x = torch.randn(4, 5, 4)
    with pytest.raises(ValueError, match=r"layer\.weight"):
        with GhostClipping(model, opt) as gc:
            gc.backward(seq_loss(model, x))
    assert untouched(opt)


@pytest.mark.parametrize("couple", ["l * l.mean()", "l / l.sum()"])
def test_losses_coupled_after_the_forward_are_refused_saying_so(couple):
    """A batch statistic in the loss, after the model's forward (outside the capture): the
    first-step check refuses it, and its message names that cause first."""
    torch.manual_seed(case_seed(12))
    model = Mlp()
    opt = sgd(model)
    ids = torch.randint(1, 11, (5, 4))
    with pytest.raises(ValueError, match=r"losses are not per-sample.*l \* l\.mean\(\)"):
        with GhostClipping(model, opt) as gc:
            l = mlp_loss(model, ids)  # noqa: E741
            gc.backward(l * l.mean() if couple == "l * l.mean()" else l / l.sum())
    assert untouched(opt)


def _inject(monkeypatch, shape, factor=1.01, row=None):
    """Make the ghost squared norm of the parameter of ``shape`` wrong by ``factor``
    (in every row, or in ``row`` only): a ghost rule error whatever the capture does,
    on either route of the parameter (ghost or kept, :mod:`dpkern.ghost.plan`)."""
    real = plan_mod.Plan.each

    def wrong(self):
        out = real(self)
        for k, p in enumerate(self.params):
            if out[k] is not None and tuple(p.shape) == tuple(shape):
                out[k] = out[k].clone()
                if row is None:
                    out[k] *= factor
                else:
                    out[k][row] *= factor
        return out

    monkeypatch.setattr(plan_mod.Plan, "each", wrong)


def test_injected_wrong_norm_is_named_with_the_worst_row(monkeypatch):
    torch.manual_seed(case_seed(12))
    model = Mlp()
    opt = sgd(model, B=9)
    _inject(monkeypatch, model.fc.weight.shape, row=8)  # the last row only: it is checked
    with GhostClipping(model, opt) as gc:
        with pytest.raises(ValueError, match=r"ghost clipping verify.*fc\.weight") as info:
            gc.backward(mlp_loss(model, torch.randint(1, 11, (9, 5))))
    msg = str(info.value)
    assert "Worst row 8" in msg and "compute_grad_sample" in msg
    # relative errors only (fc.weight's share of the sample's squared norm, ~1e-2), never
    # a private sample's norm: no number in the message above 1 but the row and counts
    numbers = [float(x) for x in re.findall(r"\d+\.\d+(?:e-?\d+)?", msg)]
    assert numbers and all(x < 1 for x in numbers), numbers
    assert "emb.weight" not in msg and "out.weight" not in msg  # only the wrong one
    assert untouched(opt) and not gc.verified


def test_tolerance_is_relative_to_the_samples_squared_norm(monkeypatch):
    """A 50% error in a parameter holding 1e-7 of the squared norm is rounding-sized;
    1e-3 of the total in a single parameter is not."""
    exact = torch.tensor([[1.0, 1e-7], [2.0, 0.0]], dtype=torch.float64)
    rel, tot = disagreement(exact * torch.tensor([1.0, 1.5]), exact)
    assert (rel <= RTOL).all() and (tot <= RTOL).all()
    rel, tot = disagreement(exact + torch.tensor([0.0, 1e-3]), exact)
    assert (rel[:, 1] > RTOL).all() and (tot > RTOL).all()
    rows = torch.tensor([[4.0, 0.0], [0.0, 0.0]], dtype=torch.float64)  # row 1: no gradient
    rel, _ = disagreement(rows + torch.tensor([[0.0], [1e-17]]), rows)
    assert (rel <= RTOL).all()  # compared at the floor, 1e-12 x the largest row
    rel, _ = disagreement(rows + torch.tensor([[0.0], [1e-15]]), rows)
    assert (rel[1] > RTOL).any()
    torch.manual_seed(case_seed(13))
    model = Mlp()
    _inject(monkeypatch, model.ln.bias.shape, factor=1 + 1e-6)  # rounding-sized: passes
    with GhostClipping(model, sgd(model)) as gc:
        gc.backward(mlp_loss(model, torch.randint(0, 11, (4, 5))))
    assert gc.verified


# -- modes ------------------------------------------------------------------------------------
def test_off_skips_and_always_checks_every_call(monkeypatch):
    torch.manual_seed(case_seed(14))
    model = Mlp()
    ids = torch.randint(0, 11, (4, 5))
    with pytest.raises(ValueError, match="verify"):
        GhostClipping(model, sgd(model), verify="once")
    with GhostClipping(model, sgd(model), verify="always") as gc:
        gc.backward(mlp_loss(model, ids))
        t1 = gc.verify_seconds
        gc.backward(mlp_loss(model, ids))
        assert gc._verifier.checks == 2 and gc.verify_seconds > t1 > 0
        _inject(monkeypatch, model.out.weight.shape, factor=2.0)
        with pytest.raises(ValueError, match=r"out\.weight"):
            gc.backward(mlp_loss(model, ids))  # still checked
    with GhostClipping(model, sgd(model), verify="first") as gc:
        monkeypatch.undo()
        gc.backward(mlp_loss(model, ids))
        _inject(monkeypatch, model.out.weight.shape, factor=2.0)
        gc.backward(mlp_loss(model, ids))  # passed once: not checked again
    opt = sgd(model)
    with GhostClipping(model, opt, verify="off") as gc:
        gc.backward(mlp_loss(model, ids))  # the wrong norm goes through
    assert not gc.verified and gc.verify_seconds == 0 and opt.stats["samples"] == 4


def test_empty_batch_leaves_the_check_for_the_next_call(monkeypatch):
    torch.manual_seed(case_seed(15))
    model = Mlp()
    opt = sgd(model)
    with GhostClipping(model, opt) as gc:
        gc.backward(mlp_loss(model, torch.randint(0, 11, (0, 5))))  # B = 0: nothing to check
        gc.add_empty_batch()
        assert not gc.verified and gc._verifier.checks == 0
        _inject(monkeypatch, model.fc.bias.shape, factor=1.5)
        with pytest.raises(ValueError, match=r"fc\.bias"):
            gc.backward(mlp_loss(model, torch.randint(0, 11, (3, 5))))  # B = 3: checked
        monkeypatch.undo()
        with pytest.warns(UserWarning, match="dropped"):  # the error ended that batch
            opt.zero_grad()
        gc.backward(mlp_loss(model, torch.randint(0, 11, (3, 5))))
        assert gc.verified and opt.stats["samples"] == 3


def test_existing_errors_and_nonfinite_rows():
    torch.manual_seed(case_seed(16))
    model = Mlp()
    ids = torch.randint(0, 11, (4, 5))
    with GhostClipping(model, sgd(model)) as gc:
        with torch.no_grad():
            losses = mlp_loss(model, ids)
        with pytest.raises(ValueError, match="do not require grad"):
            gc.backward(losses)
        with pytest.raises(ValueError, match="shape"):
            gc.backward(mlp_loss(model, ids).unsqueeze(1))
    opt = sgd(model, nonfinite="zero")
    with GhostClipping(model, opt) as gc:
        losses = mlp_loss(model, ids)
        # a NaN sample makes autograd's gradient of every row NaN (0 x NaN in the shared
        # graph): nothing to compare, the check waits for the next batch
        gc.backward(losses * torch.tensor([float("nan"), 1, 1, 1]))
        assert not gc.verified and opt.stats["nonfinite_samples"] == 1
        gc.backward(mlp_loss(model, ids))
        assert gc.verified


def test_sharded_skips_with_one_warning():
    model = Mlp()
    v = Verifier("first", model, list(model.parameters()), sharded=True)
    losses = mlp_loss(model, torch.randint(0, 11, (2, 5)))
    with pytest.warns(UserWarning, match="FSDP2"):
        assert not v.due(losses)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not v.due(losses)


# -- the one-time cost in the benchmark (bench/ghost.py) --------------------------------------
def test_bench_reports_the_one_time_cost():
    pytest.importorskip("transformers")
    from bench import ghost as GB

    cost = GB.verify_cost(8, 2, "cpu", model_kw={"n_embd": 16, "n_layer": 1, "n_head": 2})
    assert 0 < cost["verify_s"] < cost["first_step_s"]
    med = {"floor:nonprivate": 0.01, "dpkern:ghost": 0.02}
    row = GB.e2e_row(8, 2, 100, med, {}, cost)
    assert row["verify_over_ghost"] == pytest.approx(cost["verify_s"] / 0.02)
    md = GB.markdown({"layers": [], "e2e": [row], "notes": []})
    assert "first-step check" in md and f"{row['verify_over_ghost']:.2f}× a ghost step" in md
