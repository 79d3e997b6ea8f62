"""Capture by operation on the synthetic cases of the ghost-clipping audit: each is exact
against one-sample-at-a-time autograd (and its released clipped sum moves by at most C
when one sample is removed, 2C when one is replaced), or refused with a ValueError that
names what was refused. Before capture by operation each of them was silently wrong,
silently incomplete, or crashed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpkern
from dpkern.ghost import GhostClipping

C = 0.05  # small: every sample clips


def _exact_norms(model, loss_of, x):
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(x.shape[0]):
        g = torch.autograd.grad(loss_of(model, x[i : i + 1]).sum(), params, allow_unused=True)
        out.append(torch.sqrt(sum(t.double().square().sum() for t in g if t is not None)))
    return torch.stack(out)


def _ghost(model, loss_of, x, clip=1e9):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = dpkern.DPSGD(
        params,
        lr=0.0,
        max_grad_norm=clip,
        noise_multiplier=0.0,
        expected_batch_size=max(x.shape[0], 1),
    )
    with GhostClipping(model, opt, verify="off") as gc:
        sums, norms = gc.clipped_sums(loss_of(model, x))
    return sums, norms


def _flat(sums, model):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat(
        [
            (s if s is not None else torch.zeros_like(p)).reshape(-1).double()
            for s, p in zip(sums, params)
        ]
    )


def assert_exact_and_bounded(model, loss_of, x):
    torch.testing.assert_close(
        _ghost(model, loss_of, x)[1].double(), _exact_norms(model, loss_of, x), rtol=1e-4, atol=1e-9
    )
    full = _flat(_ghost(model, loss_of, x, C)[0], model)
    removed = _flat(_ghost(model, loss_of, x[1:], C)[0], model)
    assert (full - removed).norm() <= C * (1 + 1e-4)
    replaced = x.clone()
    replaced[0] = torch.flip(x[0], dims=[0]) if x.dtype == torch.long else -x[0] * 3
    other = _flat(_ghost(model, loss_of, replaced, C)[0], model)
    assert (full - other).norm() <= 2 * C * (1 + 1e-4)


def _token_loss(model, ids):
    return model(ids).square().mean(-1).sum(-1)


class Positions(nn.Module):
    """Token + learned position embeddings, positions from arange(T) (no batch dim)."""

    def __init__(self, V=11, T=8, d=6, index_first=False, as_batch=False):
        super().__init__()
        self.tok, self.pos, self.out = nn.Embedding(V, d), nn.Embedding(T, d), nn.Linear(d, 3)
        self.index_first, self.as_batch = index_first, as_batch

    def forward(self, ids):
        B, T = ids.shape
        pos = torch.arange(T)
        if self.as_batch:
            pos = pos.unsqueeze(0).expand(B, T)  # ids of shape [B, T]: not data
        p = self.pos(pos)
        if self.index_first:
            p = p[0]  # what a pre-hook expansion would have let sample 0 absorb
        return self.out(torch.tanh(self.tok(ids) + p))


@pytest.mark.parametrize("as_batch", [False, True])
@pytest.mark.parametrize("B,T", [(3, 5), (4, 4), (1, 6)])
def test_positions_without_a_batch_dimension_are_exact(B, T, as_batch):
    torch.manual_seed(0)
    model = Positions(as_batch=as_batch)
    ids = torch.randint(0, 11, (B, T))
    if B > 1:
        assert_exact_and_bounded(model, _token_loss, ids)
    else:
        torch.testing.assert_close(
            _ghost(model, _token_loss, ids)[1].double(),
            _exact_norms(model, _token_loss, ids),
            rtol=1e-4,
            atol=0,
        )


def test_positions_indexed_after_the_lookup_are_refused():
    model = Positions(as_batch=True, index_first=True)
    with pytest.raises(ValueError, match="does not carry the batch dimension.*__getitem__"):
        _ghost(model, _token_loss, torch.randint(0, 11, (4, 4)))


class Buckets(nn.Module):
    """T5-style relative attention bias: an embedding of [Tq, Tk] bucket ids, permuted."""

    def __init__(self):
        super().__init__()
        self.bias, self.lin = nn.Embedding(7, 2), nn.Linear(4, 4)

    def forward(self, x):
        T = x.shape[1]
        buckets = (torch.arange(T)[None, :] - torch.arange(T)[:, None]).clamp(-3, 3) + 3
        b = self.bias(buckets).permute(2, 0, 1).unsqueeze(0)  # [1, H, T, T]
        scores = self.lin(x) @ x.transpose(1, 2)  # [B, T, T]
        return (scores.unsqueeze(1) + b).sum(1)


def test_t5_style_bucket_bias_is_refused():
    with pytest.raises(ValueError, match="does not carry the batch dimension.*permute"):
        _ghost(Buckets(), lambda m, x: m(x).sum((1, 2)), torch.randn(4, 4, 4))


@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_in_training_mode_is_refused(affine):
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5, affine=affine), nn.Linear(5, 2))
    with pytest.raises(ValueError, match="batch_norm.*mixes samples"):
        _ghost(model, lambda m, x: m(x).square().sum(1), torch.randn(6, 4))
    model.eval()  # running statistics: per-sample, exact
    assert_exact_and_bounded(model, lambda m, x: m(x).square().sum(1), torch.randn(6, 4))


def test_embedding_with_max_norm_is_refused():
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 2))
    opt = dpkern.DPSGD(
        model.parameters(), lr=0.1, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=2
    )
    with pytest.raises(ValueError, match="max_norm.*renormalises"):
        GhostClipping(model, opt)

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(10, 4))

        def forward(self, ids):
            return F.embedding(ids, self.w, max_norm=1.0).sum(-1)

    with pytest.raises(ValueError, match="max_norm.*renormalises"):
        _ghost(Functional(), lambda m, x: m(x).sum(1), torch.randint(0, 10, (3, 5)))


class LoRALinear(nn.Linear):
    """loralib-style: a Linear subclass with extra trainable parameters in its forward."""

    def __init__(self, i, o, r=2):
        super().__init__(i, o)
        self.lora_A = nn.Parameter(torch.randn(r, i) * 0.3)
        self.lora_B = nn.Parameter(torch.randn(o, r) * 0.3)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + (x @ self.lora_A.T) @ self.lora_B.T * 0.5


def test_linear_subclass_with_extra_parameters_is_exact():
    torch.manual_seed(1)
    model = nn.Sequential(LoRALinear(5, 4), nn.Tanh(), LoRALinear(4, 3))
    model[0].weight.requires_grad_(False)
    assert_exact_and_bounded(model, lambda m, x: m(x).square().sum((1, 2)), torch.randn(4, 3, 5))


class TiedScaled(nn.Module):
    """Gemma-like: embedding scaled after the lookup, (1 + w) RMS scale, tied head as a
    matmul with the embedding's transpose."""

    def __init__(self, V=13, d=8):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.norm_w = nn.Parameter(torch.randn(d) * 0.1)
        self.mid = nn.Linear(d, d)

    def forward(self, ids):
        h = self.emb(ids) * (self.emb.weight.shape[1] ** 0.5)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.norm_w.float())
        h = torch.tanh(self.mid(h))
        return h @ self.emb.weight.T


def test_scaled_embedding_one_plus_w_and_matmul_tied_head_are_exact():
    torch.manual_seed(2)
    model = TiedScaled()
    ids = torch.randint(0, 13, (4, 6))
    assert_exact_and_bounded(
        model, lambda m, x: F.cross_entropy(m(x).transpose(1, 2), x, reduction="none").sum(1), ids
    )


def test_loralib_layers_are_exact_or_refused():
    """loralib's Linear and Embedding (which looks up lora_A.T) are exact; its MergedLinear
    (a grouped conv1d of lora_A with lora_B, data-free, then a matmul) is refused, naming
    the parameters and the operation."""
    lora = pytest.importorskip("loralib")
    torch.manual_seed(3)

    class Net(nn.Module):
        def __init__(self, merged=False):
            super().__init__()
            self.emb, self.lin = lora.Embedding(20, 8, r=2), lora.Linear(8, 6, r=2)
            self.head = (
                lora.MergedLinear(6, 9, r=2, enable_lora=[True, False, True])
                if merged
                else nn.Linear(6, 4)
            )

        def forward(self, ids):
            return self.head(torch.tanh(self.lin(self.emb(ids))))

    def prepared(merged):
        model = Net(merged)
        lora.mark_only_lora_as_trainable(model)
        for p in model.parameters():
            if p.requires_grad:
                nn.init.normal_(p, std=0.3)
        return model

    loss = lambda m, x: m(x).square().sum((1, 2))  # noqa: E731
    assert_exact_and_bounded(prepared(False), loss, torch.randint(0, 20, (4, 5)))
    with pytest.raises(ValueError, match=r"head\.lora_A.*conv1d in head"):
        _ghost(prepared(True), loss, torch.randint(0, 20, (4, 5)))
