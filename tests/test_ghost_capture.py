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


def _ghost(model, loss_of, x, clip=1e9, verify="off", **kw):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = dpkern.DPSGD(
        params,
        lr=0.0,
        max_grad_norm=clip,
        noise_multiplier=0.0,
        expected_batch_size=max(x.shape[0], 1),
    )
    with GhostClipping(model, opt, verify=verify, **kw) as gc:
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


def assert_exact_and_bounded(model, loss_of, x, **kw):
    """Ghost norms exact; removing any one sample j moves the released clipped sum by at
    most C, replacing it by at most 2C (``kw``: GhostClipping's options)."""
    torch.testing.assert_close(
        _ghost(model, loss_of, x, **kw)[1].double(),
        _exact_norms(model, loss_of, x),
        rtol=1e-4,
        atol=1e-9,
    )
    full = _flat(_ghost(model, loss_of, x, C, **kw)[0], model)
    B = x.shape[0]
    for j in range(B):
        keep = torch.tensor([i for i in range(B) if i != j])
        removed = _flat(_ghost(model, loss_of, x[keep], C, **kw)[0], model)
        assert (full - removed).norm() <= C * (1 + 1e-4), f"removing sample {j}"
        replaced = x.clone()
        replaced[j] = torch.flip(x[j], dims=[0]) if x.dtype == torch.long else -x[j] * 3
        other = _flat(_ghost(model, loss_of, replaced, C, **kw)[0], model)
        assert (full - other).norm() <= 2 * C * (1 + 1e-4), f"replacing sample {j}"


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
    # the message names the innermost module running (parameter-free with affine=False)
    with pytest.raises(ValueError, match=r"batch_norm in 1\b.*mixes samples"):
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


class BatchMixer(nn.Module):
    """Two Linears with a parameter-free reduction over the batch between them."""

    def __init__(self, mix):
        super().__init__()
        self.a, self.b, self.mix = nn.Linear(4, 5), nn.Linear(5, 2), mix

    def forward(self, x):
        return self.b(torch.tanh(self.mix(self.a(x))))


MIXES = {
    "centre": lambda h: h - h.mean(0, keepdim=True),
    "normalise": lambda h: h / h.norm(dim=0),
}


@pytest.mark.parametrize("verify", ["off", "first"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_reduction_over_the_batch_between_linears_is_refused(mix, verify):
    """Every sample's output depends on every other's: no per-sample gradient of either
    Linear exists, so both must be refused (the consumer of the mixed activation names
    the layout it cannot prove)."""
    torch.manual_seed(4)
    model = BatchMixer(MIXES[mix])
    with pytest.raises(
        ValueError, match=r"not provably one row per sample in dim 0.*in b, consuming b\."
    ):
        _ghost(model, lambda m, x: m(x).square().sum(1), torch.randn(6, 4), verify=verify)


@pytest.mark.parametrize("verify", ["off", "first"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_reduction_over_the_batch_before_a_frozen_linear_is_refused(mix, verify):
    """Only the Linear before the reduction trainable: the reduction itself mixes samples
    (the issue: refuse any reduction over the batch, with or without parameters); its
    output gradient is not sample i's alone, so G_i x_i^T is not sample i's gradient."""
    torch.manual_seed(4)
    model = BatchMixer(MIXES[mix])
    model.b.requires_grad_(False)
    x = torch.randn(6, 4)
    loss = lambda m, x: m(x).square().sum(1)  # noqa: E731
    xg = x.clone().requires_grad_(True)
    (dx,) = torch.autograd.grad(loss(model, xg)[0], xg)
    assert float(dx[1:].abs().max()) > 1e-3, "vacuous: sample 0's loss ignores the others"
    with pytest.raises(ValueError, match=r"losses depend on \w+ in .* without a proven batch"):
        _ghost(model, loss, x, verify=verify)


@pytest.mark.parametrize("verify", ["off", "first"])
@pytest.mark.parametrize("functional", [False, True])
def test_embedding_scale_grad_by_freq_is_refused(functional, verify):
    """scale_grad_by_freq divides each row's gradient by its count in the whole batch."""
    torch.manual_seed(5)

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.lin = nn.Parameter(torch.randn(10, 4)), nn.Linear(4, 2)

        def forward(self, ids):
            return self.lin(F.embedding(ids, self.w, scale_grad_by_freq=True))

    model = (
        Functional()
        if functional
        else nn.Sequential(nn.Embedding(10, 4, scale_grad_by_freq=True), nn.Linear(4, 2))
    )
    where = "embedding in Functional" if functional else "refuses 0: an nn.Embedding"
    with pytest.raises(ValueError, match=rf"{where}.*scale_grad_by_freq.*mixes samples"):
        _ghost(
            model,
            lambda m, x: m(x).square().sum((1, 2)),
            torch.randint(0, 10, (3, 5)),
            verify=verify,
        )


class Conv(nn.Module):
    """A trainable Conv1d / Conv2d (weight and bias) between a Linear and a Linear head."""

    def __init__(self, dims):
        super().__init__()
        self.dims = dims
        self.inp = nn.Linear(3, 3)
        self.conv = (nn.Conv1d if dims == 1 else nn.Conv2d)(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x):  # x: [B, L, 3] or [B, H, W, 3]
        h = self.inp(x).movedim(-1, 1)  # channels first
        h = torch.tanh(self.conv(h))
        return self.head(h.mean(dim=tuple(range(2, 2 + self.dims))))


CONV_INPUTS = {1: (4, 7, 3), 2: (4, 5, 6, 3)}


@pytest.mark.parametrize("dims", [1, 2])
def test_convolution_is_refused_by_default_and_exact_instantiated(dims):
    torch.manual_seed(6)
    model = Conv(dims)
    x = torch.randn(*CONV_INPUTS[dims])
    loss = lambda m, x: m(x).square().sum(1)  # noqa: E731
    op = f"conv{dims}d"
    for verify in ("off", "first"):
        with pytest.raises(ValueError, match=rf"conv\.weight.*consumed by {op} in conv"):
            _ghost(model, loss, x, verify=verify)
    # frozen convolution: nothing to refuse, the rest stays exact
    model.conv.requires_grad_(False)
    assert_exact_and_bounded(model, loss, x)
    model.conv.requires_grad_(True)
    assert_exact_and_bounded(model, loss, x, instantiate_unsupported=True)
    # the norms cover the convolution's own share (not only the Linears')
    params = [model.conv.weight, model.conv.bias]
    conv_share = torch.stack(
        [
            torch.sqrt(
                sum(
                    g.double().square().sum()
                    for g in torch.autograd.grad(loss(model, x[i : i + 1]).sum(), params)
                )
            )
            for i in range(x.shape[0])
        ]
    )
    assert bool((conv_share > 1e-3).all()), "vacuous: the convolution's gradients vanish"


class Threaded(nn.Module):
    """Runs a submodule in a worker thread during its forward (``swallow``: the worker
    ignores the error, and the module's weight is used there functionally instead)."""

    def __init__(self, swallow=False):
        super().__init__()
        self.a, self.b, self.swallow = nn.Linear(4, 4), nn.Linear(4, 2), swallow

    def _side(self, x):
        if not self.swallow:
            return self.a(x)
        try:
            self.a(x)
        except ValueError:
            pass
        return F.linear(x, self.a.weight, self.a.bias)

    def forward(self, x):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            h = pool.submit(self._side, x).result()
        return self.b(torch.relu(h) + self.a(x))


@pytest.mark.parametrize("swallow", [False, True])
def test_a_module_called_from_another_thread_is_refused(swallow):
    # the mode sees the forward's own thread only: the worker's use of a.weight would
    # have no record (its gradient missing from the norms and the sums)
    model = Threaded(swallow)
    # (raised in the forward; by the backward when the worker swallowed it)
    with pytest.raises(ValueError, match=r"\ba was called from another thread"):
        _ghost(model, lambda m, x: m(x).square().sum(1), torch.randn(5, 4))
    # one thread: exact
    model.forward = lambda x: model.b(torch.relu(model._side(x)) + model.a(x))
    assert_exact_and_bounded(model, lambda m, x: m(x).square().sum(1), torch.randn(5, 4))
