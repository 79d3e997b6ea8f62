"""The two routes of a parameter (dpkern.ghost.plan): the kept per-sample gradients equal a
per-example loop's, both routes give the loop's norms and clipped sums (non-finite samples
left out), the cost model picks the Gram route where per-sample gradients would be large,
and the memory budget is respected."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

import dpkern.ghost.plan as plan_mod
from dpkern.ghost.capture import Capture
from dpkern.ghost.norms import IndexUse, OuterUse, RowsUse
from dpkern.ghost.plan import Plan, form_into, plan_routes, route_costs

from conftest import case_seed

pytest.importorskip("transformers")
from test_ghost import Seq, gpt2_loss, loop_grads, seq_loss, tiny_gpt2  # noqa: E402

RTOL = 1e-5


@contextlib.contextmanager
def every_param_kept():
    """Force the kept route for every used parameter (the cost model says kept)."""
    real = plan_mod.route_costs
    plan_mod.route_costs = lambda uses, shape, B: (1.0, 0.0)
    try:
        yield
    finally:
        plan_mod.route_costs = real


def _uses(model, params, loss_of, inputs):
    cap = Capture(model, params)
    cap.attach()
    try:
        return cap.backward(loss_of(model, inputs), early=False)[:2]  # every use returned
    finally:
        cap.detach()


def _cases():
    torch.manual_seed(case_seed(40))
    gpt2 = tiny_gpt2(vocab=17, T=10)  # tied wte <-> lm_head, small vocab: repeated tokens
    seq = Seq()
    with torch.no_grad():
        for m in (seq.ln, seq.rms):
            m.weight.normal_()
    ids_seq = torch.randint(0, 11, (5, 7))
    ids_seq[:, 0] = 2  # padding
    return [
        ("gpt2", gpt2, gpt2_loss, torch.randint(0, 17, (4, 10))),
        ("seq", seq, seq_loss, ids_seq),
    ]


def _atol(ref):
    """fp32 sums that cancel to a small element: 16 float32 ulps of the largest one (a
    fixed 1e-7 failed about 1 run in 3 on the tied GPT-2's embedding, at 2.4e-7)."""
    return 16 * torch.finfo(torch.float32).eps * float(ref.abs().max())


def _formed(uses, shape, B: int, where: str):
    """``form_into`` into its own NaN-filled ``[B, numel]`` buffer (``where="own"``) or a
    column slice of a NaN-filled shared block (``"slice"``, as Plan does); the slice's
    neighbouring columns must stay untouched. Returns the formed ``[B, numel]``."""
    n = math.prod(shape)
    block = torch.full((B, 3 + n + 2), float("nan"))
    got = block[:, 3:-2] if where == "slice" else torch.full((B, n), float("nan"))
    form_into(got, uses, shape)
    if where == "slice":
        assert block[:, :3].isnan().all() and block[:, -2:].isnan().all()
    return got


@pytest.mark.parametrize("case", range(2), ids=["gpt2", "seq"])
def test_kept_per_sample_gradients_equal_the_loop(case):
    name, model, loss_of, x = _cases()[case]
    params, ref = loop_grads(model, loss_of, x)
    B, uses = _uses(model, params, loss_of, x)
    names = {id(p): n for n, p in model.named_parameters()}
    for p, us, r in zip(params, uses, ref):
        got = torch.empty(B, p.numel())
        form_into(got, us, p.shape)
        torch.testing.assert_close(
            got.double(), r.reshape(B, -1), rtol=RTOL, atol=_atol(r), msg=lambda m: names[id(p)] + m
        )
    # into a row-strided block shared with other parameters, as Plan does
    got = _formed(uses[0], params[0].shape, B, "slice")
    torch.testing.assert_close(got.double(), ref[0].reshape(B, -1), rtol=RTOL, atol=_atol(ref[0]))


@pytest.mark.parametrize("where", ["own", "slice"])
@pytest.mark.parametrize("P0,P1", [(2, 7), (7, 2), (5, 5)], ids=["wide", "narrow", "square"])
def test_outer_uses_form_in_either_orientation(P0, P1, where):
    """A weight's per-sample gradient sum_t out (x) inp, two uses added, written as a
    [P0, P1] row-major block whichever GEMM orientation forms it (the wider dimension last:
    a LoRA lora_B [p, r] is formed as its transpose) and into its own buffer or a column
    slice of a shared block (the other columns untouched); against an einsum in float64."""
    torch.manual_seed(case_seed(61))
    B = 3
    uses = [OuterUse(torch.randn(B, T, P0), torch.randn(B, T, P1)) for T in (4, 6)]
    want = sum(torch.einsum("btp,btq->bpq", u.out.double(), u.inp.double()) for u in uses)
    got = _formed(uses, (P0, P1), B, where)
    torch.testing.assert_close(got.double().view(B, P0, P1), want, rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("where", ["own", "slice"])
def test_index_uses_form_per_sample_embedding_rows(where):
    """An embedding's per-sample gradient (repeated ids within a sample summed, two uses
    added) written by an index-add into its own buffer or a column slice of a shared block
    (the other columns untouched); against a loop over samples and tokens in float64."""
    torch.manual_seed(case_seed(62))
    B, V, P = 3, 5, 4
    uses = [IndexUse(torch.randint(0, V, (B, T)), torch.randn(B, T, P), V) for T in (7, 3)]
    want = torch.zeros(B, V, P, dtype=torch.float64)
    for u in uses:
        for i in range(B):
            for t in range(u.ids.shape[1]):
                want[i, u.ids[i, t]] += u.g[i, t].double()
    got = _formed(uses, (V, P), B, where)
    torch.testing.assert_close(got.double().view(B, V, P), want, rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("route", ["ghost", "kept", "auto"])
@pytest.mark.parametrize("case", range(2), ids=["gpt2", "seq"])
def test_routes_give_the_loops_norms_and_sums(case, route):
    name, model, loss_of, x = _cases()[case]
    params, ref = loop_grads(model, loss_of, x)
    B, uses = _uses(model, params, loss_of, x)
    with every_param_kept() if route == "kept" else contextlib.nullcontext():
        plan = Plan(params, uses, B, keep_bytes=0 if route == "ghost" else None)
    assert any(plan.kept) == (route != "ghost")
    if route == "kept":
        assert all(plan.kept)
    each = plan.each()
    for p, n, r in zip(params, each, ref):
        torch.testing.assert_close(n.double(), r.reshape(B, -1).square().sum(1), rtol=RTOL, atol=0)
    want = sum(r.reshape(B, -1).square().sum(1) for r in ref)
    torch.testing.assert_close(plan.norm_sq().double(), want, rtol=RTOL, atol=0)
    torch.testing.assert_close(plan.norm_sq(each).double(), want, rtol=RTOL, atol=0)
    c = torch.rand(B) + 0.1
    drop = torch.zeros(B, dtype=torch.bool)
    drop[1] = True
    for d in (None, drop):
        cc = c if d is None else torch.where(d, 0.0, c)
        for p, s, r in zip(params, plan.sums(cc, d), ref):
            want_s = torch.einsum("b,b...->...", cc.double(), r)
            torch.testing.assert_close(s.double(), want_s, rtol=RTOL, atol=1e-6)
            assert s.dtype == torch.float32 and s.shape == p.shape


def test_dropped_samples_never_reach_the_kept_sums():
    """A NaN sample (nonfinite="zero") is left out of the kept block's sum, not
    multiplied by 0 (0 x NaN = NaN)."""
    lin = nn.Linear(4, 3)
    A = torch.randn(3, 5, 4)
    G = torch.randn(3, 5, 3)
    G[1, 2, 0] = float("nan")
    uses = [[OuterUse(G, A)], [RowsUse(G.sum(1))]]
    with every_param_kept():
        plan = Plan([lin.weight, lin.bias], uses, 3)
    n = plan.norm_sq()
    assert n[1].isnan() and n[[0, 2]].isfinite().all()
    drop = ~n.isfinite()
    sums = plan.sums(torch.where(drop, 0.0, torch.ones(3)), drop)
    keep = torch.tensor([0, 2])
    torch.testing.assert_close(sums[0], torch.einsum("btp,btd->pd", G[keep], A[keep]))
    torch.testing.assert_close(sums[1], G[keep].sum((0, 1)))


def _outer(B, T, d, p):
    return [OuterUse(torch.zeros(B, T, p), torch.zeros(B, T, d))]


def test_cost_model_keeps_small_layers_and_grams_large_ones():
    def kept(uses, shape, B):
        ghost, keep = route_costs(uses, shape, B)
        return keep < ghost

    assert kept(_outer(16, 64, 128, 384), (384, 128), 16)  # GPT-2 default c_attn
    assert kept(_outer(16, 64, 512, 128), (128, 512), 16)
    assert kept(_outer(16, 128, 768, 768), (768, 768), 16)  # long T: Gram costs T^2
    assert not kept(_outer(16, 64, 768, 768), (768, 768), 16)  # wide at short T
    assert not kept(_outer(64, 4, 1024, 1024), (1024, 1024), 64)  # T = 4: Gram is cheap
    assert not kept(_outer(16, 1, 128, 384), (384, 128), 16)  # 2-D input
    assert kept([RowsUse(torch.zeros(16, 128))], (128,), 16)  # biases: a shared block
    big_vocab = [IndexUse(torch.zeros(16, 64, dtype=torch.long), torch.zeros(16, 64, 768), 50257)]
    assert not kept(big_vocab, (50257, 768), 16)


def test_budget_is_respected_largest_saving_per_byte_first():
    B = 16
    params = [nn.Parameter(torch.zeros(384, 128)), nn.Parameter(torch.zeros(128, 128))]
    uses = [_outer(B, 64, 128, 384), _outer(B, 64, 128, 128)]
    sizes = [B * p.numel() * 4 for p in params]
    assert plan_routes(params, uses, B, keep_bytes=sum(sizes)) == [True, True]
    assert plan_routes(params, uses, B, keep_bytes=0) == [False, False]
    one = plan_routes(params, uses, B, keep_bytes=max(sizes))
    assert sum(one) == 1
    costs = [route_costs(u, p.shape, B) for p, u in zip(params, uses)]
    saving = [(g - k) / n for (g, k), n in zip(costs, sizes)]
    assert one[max(range(2), key=lambda k: saving[k])]
    assert plan_routes(params, [[], uses[1]], B) == [False, True]  # unused: no route
    assert plan_routes(params, uses, 0) == [False, False]  # B = 0


def test_layer_norm_rows_from_the_forwards_statistics():
    """The LayerNorm rule takes mean and rstd from the forward (autograd's saved outputs
    of native_layer_norm) instead of normalizing again: the same rows as recomputing,
    also bias-only (no x_hat at all) and through a flattened [B*T, d] input."""
    from dpkern.ghost.norms import layer_norm_rows
    from dpkern.ghost.rules import _layer_norm_stats

    torch.manual_seed(case_seed(41))
    x = torch.randn(3, 5, 8) * 3 + 1
    w = torch.randn(8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    g = torch.randn(3, 5, 8)
    out = nn.functional.layer_norm(x, (8,), w, b, 1e-5)
    stats = _layer_norm_stats(out)
    assert stats is not None and stats[0].shape == stats[1].shape
    ref = layer_norm_rows(x, g, (8,), 1e-5, True)
    got = layer_norm_rows(x, g, (8,), 1e-5, True, stats=stats)
    want_w = torch.einsum("btd,btd->bd", g, nn.functional.layer_norm(x, (8,), eps=1e-5))
    for r, s in zip(ref, got):
        torch.testing.assert_close(s, r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], want_w, rtol=1e-5, atol=1e-6)
    wr, br = layer_norm_rows(x, g, (8,), 1e-5, True, has_weight=False, stats=stats)
    assert wr is None
    torch.testing.assert_close(br, g.sum(1))
    # flattened input, [B*T] statistics: matched by size, reshaped to the samples
    flat = layer_norm_rows(x, g, (8,), 1e-5, True, stats=tuple(t.reshape(15, 1) for t in stats))
    torch.testing.assert_close(flat[0], ref[0], rtol=1e-5, atol=1e-6)
    # statistics of another shape are not used
    odd = layer_norm_rows(x, g, (8,), 1e-5, True, stats=(torch.zeros(4), torch.zeros(4)))
    torch.testing.assert_close(odd[0], ref[0])
    assert _layer_norm_stats(out.detach() * 2) is None
