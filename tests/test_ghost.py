"""Ghost clipping + book-keeping (dpkern.ghost) against a per-example loop (autograd on one
sample at a time) and against the per-sample path's DP step.

Every per-parameter norm of a GPT-2 (transformers, Conv1D layers, tied wte <-> lm_head,
broadcast position ids) is compared with the loop at fp32 rtol 1e-5; the full ghost DP
step with sigma > 0 and a fixed seed equals compute_grad_sample + optimizer.step().
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from torch import nn

import dpkern
import dpkern.ghost.plan as plan_mod
from dpkern.ghost import GhostClipping, supports
from dpkern.ghost.capture import Capture
from dpkern.ghost.norms import index_norm_sq, outer_method, outer_norm_sq, param_norm_sq
from dpkern.grad_sample import compute_grad_sample
from conftest import case_seed

transformers = pytest.importorskip("transformers")

RTOL = 1e-5


def tiny_gpt2(vocab=53, T=12, d=32, layers=2, seed=None):
    from transformers import GPT2Config, GPT2LMHeadModel

    if seed is not None:
        torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=T,
        n_embd=d,
        n_layer=layers,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
    )
    model = GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    return model


class Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


def token_losses(logits, ids):
    """Summed next-token cross-entropy per sample: float32 [B]."""
    return nn.functional.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none"
    ).sum(1)


def loop_grads(model, loss_of, inputs):
    """Per-example loop: [B, *p.shape] per trainable parameter (float64)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [[] for _ in params]
    for i in range(inputs.shape[0]):
        model.zero_grad(set_to_none=True)
        loss_of(model, inputs[i : i + 1]).sum().backward()
        for k, p in enumerate(params):
            rows[k].append(
                torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.double()
            )
    model.zero_grad(set_to_none=True)
    return params, [torch.stack(r) for r in rows]


def ghost_param_norms(model, params, loss_of, inputs, **kw):
    cap = Capture(model, params, **kw)
    cap.attach()
    try:
        B, uses, _, _ = cap.backward(loss_of(model, inputs), early=False)  # uses, all
    finally:
        cap.detach()
    return [param_norm_sq(u, p.shape, B) if u else torch.zeros(B) for p, u in zip(params, uses)]


def assert_norms_match(model, loss_of, inputs, **kw):
    params, ref = loop_grads(model, loss_of, inputs)
    ghost = ghost_param_norms(model, params, loss_of, inputs, **kw)
    names = {id(p): n for n, p in model.named_parameters()}
    for p, r, g in zip(params, ref, ghost):
        want = r.reshape(r.shape[0], -1).square().sum(1)
        torch.testing.assert_close(
            g.double(), want, rtol=RTOL, atol=1e-12, msg=lambda m: f"{names[id(p)]}: {m}"
        )
    return params, ref


def sq(m, x):
    """Per-sample losses: each row's squared outputs summed, in float64."""
    return m(x).double().square().sum(1)


def clip_only_optimizer(model, expected_batch_size=4):
    """DP-SGD over ``model``'s parameters without noise: a clipping check only (seeded)."""
    return dpkern.DPSGD(
        model.parameters(),
        lr=0.1,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
        expected_batch_size=expected_batch_size,
        seed=0,
    )


def ghost_sums(model, x, verify="off"):
    """GhostClipping's clipped sums of ``sq``-like losses (C = 1e9: unclipped) for the
    trainable parameters, the noise warning silenced."""
    params = [p for p in model.parameters() if p.requires_grad]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # noise_multiplier=0: a clipping check only
        opt = dpkern.DPSGD(
            params, lr=0.0, max_grad_norm=1e9, noise_multiplier=0.0, expected_batch_size=x.shape[0]
        )
        with GhostClipping(model, opt, verify=verify) as gc:
            return gc.clipped_sums(model(x).square().sum(1))


def gpt2_loss(model, ids):
    return token_losses(model(input_ids=ids, use_cache=False).logits, ids)


# -- every norm on GPT-2 --------------------------------------------------------------------
def test_gpt2_every_param_norm_matches_per_example_loop():
    model = tiny_gpt2()
    ids = torch.randint(0, 53, (4, 12))
    params, _ = assert_norms_match(model, gpt2_loss, ids)
    kinds = {type(m).__name__ for m in model.modules() if any(True for _ in m.parameters(False))}
    assert {"Conv1D", "Embedding", "LayerNorm"} <= kinds
    assert len(params) == len(list(model.parameters()))  # tied weight counted once


def test_gpt2_tied_cross_term_is_needed():
    """The tied weight's norm is that of the SUM of both uses: dropping the cross term
    (what summing the two layers' norms separately gives) is measurably wrong."""
    model = tiny_gpt2(vocab=17, T=10)
    ids = torch.randint(0, 17, (4, 10))  # small vocab: tokens repeat, big cross term
    w = model.transformer.wte.weight
    cap = Capture(model, [w])
    cap.attach()
    B, uses, _, _ = cap.backward(gpt2_loss(model, ids), early=False)
    cap.detach()
    kinds = sorted(type(u).__name__ for u in uses[0])
    assert kinds == ["IndexUse", "OuterUse"]
    full = param_norm_sq(uses[0], w.shape, B)
    separate = sum(param_norm_sq([u], w.shape, B) for u in uses[0])
    _, ref = loop_grads(model, gpt2_loss, ids)
    want = ref[list(model.parameters()).index(w)].reshape(B, -1).square().sum(1)
    torch.testing.assert_close(full.double(), want, rtol=RTOL, atol=0)
    assert ((separate.double() - want).abs() / want).max() > 1e-3


def test_frozen_params_and_partial_layers():
    """Frozen embeddings and frozen Linear weights with trainable biases (BitFit-style)."""
    model = tiny_gpt2(d=16, layers=1)
    for n, p in model.named_parameters():
        p.requires_grad_(not (n.endswith("wte.weight") or n.endswith("c_fc.weight")))
    assert_norms_match(model, gpt2_loss, torch.randint(0, 53, (3, 12)))


# -- each layer type on its own ----------------------------------------------------------
class Seq(nn.Module):
    """Embedding (padding_idx) -> Linear on a sequence -> LayerNorm -> RMSNorm -> Linear used
    twice -> mean over tokens -> 2-D Linear."""

    def __init__(self, V=11, d=6, p=5):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=2)
        self.lin = nn.Linear(d, p)
        self.ln = nn.LayerNorm(p)
        self.rms = nn.RMSNorm(p, eps=1e-5)
        self.shared = nn.Linear(p, p, bias=False)
        self.head = nn.Linear(p, 3)

    def forward(self, ids):
        h = self.rms(self.ln(torch.tanh(self.lin(self.emb(ids)))))
        h = self.shared(torch.tanh(self.shared(h)))
        return self.head(h.mean(1))


def seq_loss(model, ids):
    return model(ids).square().sum(1)


def test_layer_types_padding_shared_and_2d():
    torch.manual_seed(1)
    model = Seq()
    with torch.no_grad():
        for m in (model.ln, model.rms):
            m.weight.normal_()
    ids = torch.randint(0, 11, (6, 7))
    ids[:, 0] = 2  # padding tokens: their row gets no gradient
    params, ref = assert_norms_match(model, seq_loss, ids)
    assert float(ref[0][:, 2].abs().max()) == 0.0


@pytest.mark.parametrize("T,d,p", [(3, 40, 50), (64, 6, 5), (1, 7, 3)])
def test_outer_norm_methods_agree(T, d, p):
    A, G = torch.randn(4, T, d), torch.randn(4, T, p)
    want = torch.einsum("btp,btd->bpd", G.double(), A.double()).square().sum((1, 2))
    for method in ("gram", "instantiate", "auto"):
        got = outer_norm_sq(G, A, method=method, chunk_bytes=1)  # one sample per chunk
        torch.testing.assert_close(got.double(), want, rtol=RTOL, atol=0)
    assert outer_method(T, d, p) == ("gram" if T * (d + p) <= d * p else "instantiate")
    with pytest.raises(ValueError, match="method"):
        outer_norm_sq(G, A, method="fast")


def test_index_norm_no_vocab_sized_temporaries():
    V, B, T, d = 10**7, 3, 9, 4  # a B x V x d tensor would be 480 MB
    ids = torch.randint(0, 5, (B, T)) * 1_999_999
    g = torch.randn(B, T, d)
    dense = torch.zeros(B, 5, d).index_put_(
        (torch.arange(B).repeat_interleave(T), ids.reshape(-1) // 1_999_999),
        g.reshape(-1, d),
        accumulate=True,
    )
    torch.testing.assert_close(index_norm_sq(ids, g, V), dense.square().sum((1, 2)))


def test_parameter_ops_are_covered_or_named_or_instantiated():
    """Capture by operation: a parameter broadcast-multiplied in any module is covered; one
    consumed by an operation without a ghost rule (exp) is named with the operation and
    the module path at the first backward, or instantiated on request."""

    class Scale(nn.Module):
        def __init__(self, exp=False):
            super().__init__()
            self.s, self.exp = nn.Parameter(torch.randn(5)), exp

        def forward(self, x):
            return x * (self.s.exp() if self.exp else self.s)

    class Net(nn.Module):
        def __init__(self, exp=False):
            super().__init__()
            self.lin, self.scale = nn.Linear(4, 5), Scale(exp)

        def forward(self, x):
            return self.scale(torch.tanh(self.lin(x)))

    x = torch.randn(5, 3, 4)
    loss = lambda m, x: m(x).square().sum((1, 2))  # noqa: E731
    assert supports(Net()) == (True, [])
    assert_norms_match(Net(), loss, x)
    model = Net(exp=True)
    cap = Capture(model, list(model.parameters()))
    cap.attach()
    with pytest.raises(ValueError, match=r"scale\.s .*consumed by exp in scale"):
        cap.backward(loss(model, x))
    cap.detach()
    assert_norms_match(Net(exp=True), loss, x, instantiate_unsupported=True)


def test_param_used_outside_its_forward_is_an_error():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            return self.att(x, x, x, need_weights=False)[0]

    model = Net()
    opt = dpkern.DPSGD(
        model.parameters(),
        lr=0.1,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
        expected_batch_size=2,
        seed=0,
    )
    with GhostClipping(model, opt) as gc:  # MHA's fused functional consumes raw parameters
        with pytest.raises(
            ValueError,
            match=r"in_proj_weight .*multi_head_attention_forward "
            r"in att",
        ):
            gc.backward(model(torch.randn(2, 3, 8)).sum((1, 2)))
    model.att.in_proj_weight.requires_grad_(False)
    model.att.in_proj_bias.requires_grad_(False)
    opt = dpkern.DPSGD(
        [p for p in model.parameters() if p.requires_grad],
        lr=0.1,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
        expected_batch_size=2,
        seed=0,
    )
    with GhostClipping(model, opt) as gc:  # out_proj: its forward is never called
        with pytest.raises(ValueError, match=r"att\.out_proj\.weight"):
            gc.backward(model(torch.randn(2, 3, 8)).sum((1, 2)))


def test_parameter_used_outside_any_torch_function_is_an_error():
    """A parameter whose use no torch function call shows (here: read through .data into a
    new tensor that requires grad) is caught by the same backward."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.w = nn.Linear(3, 3), nn.Parameter(torch.randn(3))

        def forward(self, x):
            return self.lin(x) * Leak.apply(self.w)

    class Leak(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w):
            return w.clone()

        @staticmethod
        def backward(ctx, g):
            return g

    model = Net()
    opt = dpkern.DPSGD(
        model.parameters(),
        lr=0.1,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
        expected_batch_size=2,
        seed=0,
    )
    with GhostClipping(model, opt, verify="off") as gc:
        with pytest.raises(ValueError, match=r"\bw \(shape"):
            gc.backward(model(torch.randn(2, 3)).sum(1))


class _InPlace(nn.Module):
    """Recorded outputs modified in place afterwards: ``y.mul_(2)`` (the output is
    returned, so it stays alive) and ``h += y`` (Falcon's parallel attention)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.lin2 = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        y.mul_(2)
        h = self.lin2(torch.tanh(y))
        h += torch.sin(y)
        h.mul_(torch.tanh(h.detach()) + 1.5)
        return h


def test_outputs_modified_in_place_keep_exact_norms():
    """The capture takes each output gradient from the graph edge of the op that made the
    output, which an in-place change later does not move (it used to be refused)."""
    torch.manual_seed(case_seed(33))
    model = _InPlace()
    x = torch.randn(5, 3)
    assert_norms_match(model, lambda m, xb: m(xb).square().sum(1), x)
    params, ref = loop_grads(model, lambda m, xb: m(xb).square().sum(1), x)
    opt = dpkern.DPSGD(
        model.parameters(), lr=0.1, max_grad_norm=1e9, noise_multiplier=0.0,
        expected_batch_size=5, seed=0,
    )  # fmt: skip
    with GhostClipping(model, opt) as gc:
        out = model(x)  # held: the output stays alive through the backward
        sums, _ = gc.clipped_sums(out.square().sum(1))
    for s, r in zip(sums, ref):
        # float32 error scales with the rows summed, not with a sum where they cancel
        scale = r.abs().sum(0)
        assert ((s.double() - r.sum(0)).abs() <= 1e-5 * scale + 1e-7).all(), (s, r.sum(0))


def test_macadam_and_bad_arguments_are_refused():
    model = Seq()
    opt = dpkern.DPMacAdam(model.parameters(), noise_multiplier=1.0, expected_batch_size=4)
    with pytest.raises(ValueError, match="per-sample path"):
        GhostClipping(model, opt)
    opt = dpkern.DPSGD(
        model.parameters(), max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4
    )
    with pytest.raises(ValueError, match="backend"):
        GhostClipping(model, opt, backend="cuda")
    with GhostClipping(model, opt) as gc:
        with pytest.raises(ValueError, match=r"\[B\]"):
            gc.backward(seq_loss(model, torch.randint(0, 11, (3, 4))).mean())
        with pytest.raises(ValueError, match="no forward"):
            gc.backward(torch.zeros(3, requires_grad=True))


# -- the full DP step ------------------------------------------------------------------------
def _pair(opt_cls, seed, **kw):
    model = Logits(tiny_gpt2(seed=seed))
    twin = copy.deepcopy(model)
    make = lambda m: opt_cls(
        m.parameters(),
        lr=1e-2,
        max_grad_norm=0.05,
        noise_multiplier=0.7,
        expected_batch_size=6,
        seed=seed,
        **kw,
    )
    return model, make(model), twin, make(twin)


def route_kw(route: str, monkeypatch) -> dict:
    """GhostClipping arguments (and a patch) for a parameter route of
    :mod:`dpkern.ghost.plan`: "ghost" (no kept per-sample gradients), "kept" (every
    used parameter kept), "auto" (the cost model's choice)."""
    if route == "kept":
        monkeypatch.setattr(plan_mod, "route_costs", lambda uses, shape, B: (1.0, 0.0))
    return {"keep_bytes": 0} if route == "ghost" else {}


@pytest.mark.parametrize("route", ["auto", "ghost", "kept"])
@pytest.mark.parametrize("opt_cls", [dpkern.DPAdamW, dpkern.DPSGD])
def test_ghost_step_equals_per_sample_step(opt_cls, route, monkeypatch):
    seed = int.from_bytes(os.urandom(2), "little")
    ghost_model, ghost_opt, ps_model, ps_opt = _pair(opt_cls, seed)
    kw = route_kw(route, monkeypatch)
    for step in range(2):
        ids = torch.randint(0, 53, (6, 12))
        with GhostClipping(ghost_model, ghost_opt, check=(step == 0), **kw) as gc:
            sums, norms = gc.clipped_sums(token_losses(ghost_model(ids), ids))
            ghost_opt.accumulate_clipped(sums, batch_size=6)
        ghost_opt.step()
        losses = compute_grad_sample(ps_model, lambda out, y: token_losses(out, y).sum(), ids, ids)
        ps_norms = dpkern.functional.per_sample_norms(
            [p.grad_sample for p in ps_model.parameters()], backend="torch"
        )
        torch.testing.assert_close(norms, ps_norms, rtol=RTOL, atol=0)
        assert (norms > 0.05).any()  # clipping is exercised
        ps_opt.step()
        assert losses.shape == (6,)
        # AdamW's normalised update m_hat / sqrt(v_hat) amplifies the fp32 summation-order
        # differences (GEMM vs per-sample rows) where m_hat ~ 0: allow 0.5% of lr there; a
        # real clipping or noise error moves parameters by O(lr) = 1e-2.
        atol = 5e-5 if opt_cls is dpkern.DPAdamW else 1e-6
        for p, q in zip(ghost_model.parameters(), ps_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=atol)
            assert p.grad is None  # ghost never fills .grad
    assert ghost_opt.dp_step == ps_opt.dp_step == 2


def test_micro_batches_accumulate_to_one_logical_step():
    seed = int.from_bytes(os.urandom(2), "little")
    ghost_model, ghost_opt, ps_model, ps_opt = _pair(dpkern.DPAdam, seed)
    ids = torch.randint(0, 53, (7, 12))
    with GhostClipping(ghost_model, ghost_opt) as gc:
        for chunk in (ids[:3], ids[3:]):
            gc.backward(token_losses(ghost_model(chunk), chunk))
        with torch.no_grad():
            ghost_model(ids)  # an evaluation forward is not recorded
    ghost_opt.step()
    compute_grad_sample(ps_model, lambda out, y: token_losses(out, y).sum(), ids, ids)
    ps_opt.step()
    # Adam's first update is lr * g / (|g| + eps): where the noisy g ~ 0 it amplifies the fp32
    # summation-order differences (GEMM vs per-sample rows); same bound as above (0.5% of lr).
    for p, q in zip(ghost_model.parameters(), ps_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=5e-5)
    assert ghost_opt.stats["samples"] == ps_opt.stats["samples"] == 7
    assert ghost_opt.stats["clipped_samples"] == ps_opt.stats["clipped_samples"]


@pytest.mark.parametrize("route", ["ghost", "kept"])
def test_nonfinite_samples_error_or_dropped(route, monkeypatch):
    kw = route_kw(route, monkeypatch)
    model = Seq()
    ids = torch.randint(3, 11, (4, 5))

    def losses_with_nan(m):
        out = seq_loss(m, ids)
        return out * torch.tensor([1.0, float("nan"), 1.0, 1.0])

    opt = clip_only_optimizer(model)
    with GhostClipping(model, opt, **kw) as gc:
        with pytest.raises(FloatingPointError, match=r"\[1\]"):
            gc.backward(losses_with_nan(model))
    assert all(float(b.abs().sum()) == 0 for b in opt.clipped_sum_buffers())
    opt = dpkern.DPSGD(
        model.parameters(),
        lr=0.1,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
        expected_batch_size=4,
        seed=0,
        nonfinite="zero",
    )
    with GhostClipping(model, opt, **kw) as gc:
        gc.backward(losses_with_nan(model))
        sums_drop = [b.clone() for b in opt.clipped_sum_buffers()]
        keep = torch.tensor([0, 2, 3])
        sums, _ = gc.clipped_sums(seq_loss(model, ids[keep]))
    assert opt.stats["nonfinite_samples"] == 1
    for a, b in zip(sums_drop, sums):
        torch.testing.assert_close(a, b)


# -- memory ------------------------------------------------------------------------------------
def _rss_reset_and_read():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (Linux)
    except OSError:
        return None
    return _hwm()


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM")


def test_ghost_memory_is_a_small_multiple_of_activations():
    """8 Linear layers 1024 x 1024 (33 MB of weights), B = 64: per-sample gradients
    would take 2.1 GB; the ghost step's peak extra memory stays a few times the
    activation memory (+ the clipped sums, one copy of the weights)."""
    torch.manual_seed(0)
    B, T, d, L = 64, 4, 1024, 8
    model = nn.Sequential(*[m for _ in range(L) for m in (nn.Linear(d, d, bias=False), nn.Tanh())])
    numel = sum(p.numel() for p in model.parameters())
    assert B * numel * 4 > 2**30
    opt = dpkern.DPSGD(
        model.parameters(),
        lr=0.1,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=B,
        seed=0,
    )
    opt.clipped_sum_buffers()  # the optimizer's own buffers: not ghost memory
    x = torch.randn(B, T, d)
    act = 2 * L * B * T * d * 4  # inputs and tanh outputs kept for backward
    with GhostClipping(model, opt) as gc:
        gc.backward(model(x).square().sum((1, 2)))  # warm-up (allocator, thread pools)
        base = _rss_reset_and_read()
        if base is None:
            pytest.skip("cannot reset the peak RSS here")
        gc.backward(model(x).square().sum((1, 2)))
        peak = _hwm() - base
    weights = numel * 4
    assert peak < 4 * act + 2 * weights, (peak, act, weights)
    assert peak < 0.1 * B * numel * 4


def test_empty_batches():
    """Poisson sampling gives empty micro-batches (B = 0) and empty logical batches: the
    step still adds noise and updates (SPEC section 4)."""
    model = Seq()
    twin = copy.deepcopy(model)
    make = lambda m: dpkern.DPSGD(
        m.parameters(),
        lr=0.1,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4,
        seed=3,
    )
    opt, ref_opt = make(model), make(twin)
    with GhostClipping(model, opt) as gc:
        gc.backward(seq_loss(model, torch.randint(0, 11, (0, 5))))  # B = 0 forward
        opt.step()
        gc.add_empty_batch()  # no forward at all
        opt.step()
    for _ in range(2):
        compute_grad_sample(twin, lambda out, y: out.square().sum(), torch.zeros(0, 5).long())
        ref_opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    assert opt.dp_step == 2 and opt.stats["samples"] == 0


def test_non_reentrant_gradient_checkpointing():
    """Forwards re-run during the backward are not recorded: norms stay exact."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)

        def block(self, x):
            return self.b(torch.tanh(self.a(x)))

        def forward(self, x):
            return self.c(torch.tanh(checkpoint(self.block, x, use_reentrant=False)))

    assert_norms_match(Net(), lambda m, x: m(x).square().sum((1, 2)), torch.randn(3, 5, 4))


# -- rounding: a squared norm that cancels to ~0 is clamped at 0, never a NaN ------------------
def _cancelling_linear_batch(B=64, d=64, p=64, seed=0):
    """Two tokens per sample with inputs a, a + 1e-3 e and output gradients v, -v: the
    per-sample weight gradient v (x) (-1e-3 e) is ~0, but the Gram terms are ~|a|^2 |v|^2."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(B, 1, d, generator=g) * 30
    x = torch.cat([a, a + 1e-3 * torch.randn(B, 1, d, generator=g)], 1)
    v = torch.randn(B, p, generator=g)
    return x, v


def test_gram_rounding_negative_is_clamped_in_reference():
    x, v = _cancelling_linear_batch()
    G = torch.stack([v, -v], 1)
    # the unclamped float32 Gram sum of this case is negative for some samples:
    raw = (torch.bmm(G, G.transpose(1, 2)) * torch.bmm(x, x.transpose(1, 2))).sum((1, 2))
    assert (raw < 0).any()
    got = outer_norm_sq(G, x, method="gram")
    assert got.dtype == torch.float32 and (got >= 0).all()
    torch.testing.assert_close(got, raw.clamp_min(0))


@pytest.mark.parametrize("nonfinite", ["error", "zero"])
def test_ghost_rounding_negative_norm_is_not_a_nonfinite_sample(nonfinite):
    """A Gram-path squared norm that float32 rounding makes slightly negative was a NaN
    after sqrt: FloatingPointError (nonfinite="error") or the sample silently dropped
    (nonfinite="zero"). Clamped at 0 it is a finite sample, clipped and summed."""
    x, v = _cancelling_linear_batch()
    B = x.shape[0]
    model = nn.Linear(64, 64, bias=False)
    assert outer_method(2, 64, 64) == "gram"

    def losses(m):
        out = m(x)  # [B, 2, p]
        return ((out[:, 0] - out[:, 1]) * v).sum(1)  # output gradients v and -v

    opt = dpkern.DPSGD(
        model.parameters(),
        lr=0.1,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
        expected_batch_size=B,
        seed=0,
        nonfinite=nonfinite,
        backend="torch",
    )
    with GhostClipping(model, opt, backend="torch", verify="off") as gc:
        _, norms = gc.clipped_sums(losses(model))
        assert torch.isfinite(norms).all() and (norms >= 0).all()
        gc.backward(losses(model))
    assert opt.stats["nonfinite_samples"] == 0 and opt.stats["samples"] == B
    assert all(torch.isfinite(b).all() for b in opt.clipped_sum_buffers())


def test_tied_cross_term_rounding_negative_is_clamped():
    """Tied embedding + output layer whose uses cancel (E_i = -L_i up to 1e-4): the norm
    ||E||^2 + ||L||^2 + 2 <E, L> rounds below 0 in float32 for some samples."""
    from dpkern.ghost.norms import IndexUse, OuterUse, index_outer_cross

    gen = torch.Generator().manual_seed(0)
    B, V, d = 128, 10, 64
    ids = torch.randint(0, V, (B, 1), generator=gen)
    x = torch.randn(B, 1, d, generator=gen) * 30
    out = -nn.functional.one_hot(ids[:, 0], V).float().unsqueeze(1)  # [B, 1, V]
    inp = x + 1e-4 * torch.randn(B, 1, d, generator=gen)
    raw = (
        index_norm_sq(ids, x, V)
        + outer_norm_sq(out, inp)
        + 2.0 * index_outer_cross(ids, x, out, inp)
    )
    assert (raw < 0).any()
    got = param_norm_sq([IndexUse(ids, x, V), OuterUse(out, inp)], (V, d), B)
    assert (got >= 0).all() and torch.isfinite(got).all()
    torch.testing.assert_close(got, raw.clamp_min(0))


def test_clamp_keeps_nonfinite_squared_norms():
    from dpkern.ghost.norms import clamp_norm_sq

    x = torch.tensor([-1e-3, 0.0, 2.0, float("nan"), float("inf"), float("-inf")])
    got = clamp_norm_sq(x)
    assert got[:3].tolist() == [0.0, 0.0, 2.0]
    assert got[3].isnan() and got[4] == float("inf") and got[5] == float("-inf")
    assert not torch.isfinite(got[3:].sqrt()).any()  # still non-finite after sqrt


# -- float64 models: norms in float64 -----------------------------------------------------------
F64_RTOL = 1e-12


def assert_float64_norms_match(model, loss_of, inputs):
    params, ref = loop_grads(model, loss_of, inputs)
    ghost = ghost_param_norms(model, params, loss_of, inputs)
    names = {id(p): n for n, p in model.named_parameters()}
    for p, r, g in zip(params, ref, ghost):
        assert g.dtype == torch.float64, names[id(p)]
        want = r.reshape(r.shape[0], -1).square().sum(1)
        torch.testing.assert_close(
            g, want, rtol=F64_RTOL, atol=1e-300, msg=lambda m: f"{names[id(p)]}: {m}"
        )
    return params, ref


def test_float64_gpt2_ghost_norms_match_float64_loop():
    """Every per-parameter norm of a float64 GPT-2 (Conv1D, tied wte <-> lm_head, LayerNorm,
    position embedding) equals the float64 per-example loop to 1e-12 relative (float32
    accumulation gave ~1e-7)."""
    model = tiny_gpt2(vocab=17, T=10, d=16, layers=1, seed=3).double()
    ids = torch.randint(0, 17, (3, 10))
    assert_float64_norms_match(model, gpt2_loss, ids)


def test_float64_layer_types_and_ghost_clipping_norms():
    """Embedding, Linear (sequence and 2-D), LayerNorm, RMSNorm and a Linear used twice in
    float64; GhostClipping's total norms are float64 and match the loop's."""
    torch.manual_seed(4)
    model = Seq().double()
    with torch.no_grad():
        for m in (model.ln, model.rms):
            m.weight.normal_()
    ids = torch.randint(0, 11, (5, 7))
    params, ref = assert_float64_norms_match(model, seq_loss, ids)
    want = sum(r.reshape(r.shape[0], -1).square().sum(1) for r in ref).sqrt()
    opt = dpkern.DPSGD(
        params,
        lr=0.1,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
        expected_batch_size=5,
        seed=0,
        backend="torch",
    )
    with GhostClipping(model, opt, backend="torch") as gc:
        _, norms = gc.clipped_sums(seq_loss(model, ids))
    assert norms.dtype == torch.float64
    torch.testing.assert_close(norms, want, rtol=F64_RTOL, atol=0)
