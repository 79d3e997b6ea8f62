"""dpkern.grad_sample.compute_grad_sample against a per-example autograd loop: the vmap path,
the loop (forced, and as the fallback where vmap cannot run: BLOOM, BERT with padding)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import dpkern.grad_sample as gs
from dpkern.grad_sample import compute_grad_sample


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 4)
        self.conv = torch.nn.Conv1d(4, 6, 3, padding=1)
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 3)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, tokens):
        h = self.conv(self.emb(tokens).transpose(1, 2)).transpose(1, 2)
        return self.frozen(self.head(self.norm(h).relu().mean(1)))


@pytest.mark.parametrize("B,chunk", [(1, None), (5, None), (7, 3)])
def test_matches_per_example_loop(B, chunk):
    torch.manual_seed(B)
    net = Net()
    tokens = torch.randint(0, 11, (B, 9))
    y = torch.randint(0, 3, (B,))
    losses = compute_grad_sample(net, F.cross_entropy, tokens, y, chunk_size=chunk)
    assert not hasattr(net.frozen.weight, "grad_sample")
    for i in range(B):
        net.zero_grad()
        loss = F.cross_entropy(net(tokens[i : i + 1]), y[i : i + 1])
        loss.backward()
        assert losses[i].item() == pytest.approx(loss.item(), rel=1e-5)
        for name, p in net.named_parameters():
            if p.requires_grad:
                assert p.grad_sample.shape == (B, *p.shape)
                torch.testing.assert_close(p.grad_sample[i], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_empty_batch_and_errors():
    net = Net()
    losses = compute_grad_sample(
        net, F.cross_entropy, torch.zeros(0, 9, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    )
    assert losses.shape == (0,)
    assert net.head.weight.grad_sample.shape == (0, 3, 6)
    with pytest.raises(ValueError, match="batch size"):
        compute_grad_sample(
            net,
            F.cross_entropy,
            torch.zeros(2, 9, dtype=torch.long),
            torch.zeros(3, dtype=torch.long),
        )


# --- the per-sample loop (method="loop", and "auto"'s fallback where vmap cannot run) ----


def _mlp(dtype=torch.float32):
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3), torch.nn.Linear(3, 3)
    ).to(dtype)
    net[3].requires_grad_(False)
    return net


def _truth(model, B, loss_of):
    """One-sample-at-a-time ordinary autograd: ({name: [B, *shape]}, [B] losses)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads, losses = {n: [] for n, _ in named}, []
    for i in range(B):
        model.zero_grad()
        loss = loss_of(i)
        loss.backward()
        losses.append(loss.item())
        for n, p in named:
            grads[n].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(g) for n, g in grads.items()}, torch.tensor(losses)


def _check(model, grads, losses, want_losses):
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-7)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad_sample.dtype == p.dtype and p.grad_sample.shape == grads[n].shape
            torch.testing.assert_close(p.grad_sample, grads[n], rtol=1e-5, atol=1e-7, msg=n)
        else:
            assert not hasattr(p, "grad_sample"), n


def _fallback_warnings(record):
    return [w for w in record if issubclass(w.category, gs.VmapFallbackWarning)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forced_loop_equals_vmap_on_mlp(dtype):
    net = _mlp(dtype)
    net.train()
    x, y = torch.randn(6, 5, dtype=dtype), torch.randint(0, 3, (6,))
    ref = compute_grad_sample(net, F.cross_entropy, x, y, method="vmap")
    want = {n: p.grad_sample.clone() for n, p in net.named_parameters() if p.requires_grad}
    for p in net.parameters():
        p.__dict__.pop("grad_sample", None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = compute_grad_sample(net, F.cross_entropy, x, y, method="loop")
    assert not _fallback_warnings(record)  # an explicit loop is not a fallback
    assert got.dtype == torch.float32 and got.shape == (6,)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    for n, p in net.named_parameters():
        if p.requires_grad:
            assert p.grad_sample.dtype == dtype
            torch.testing.assert_close(p.grad_sample, want[n], rtol=1e-6, atol=1e-6, msg=n)
            assert p.grad is None  # autograd.grad: nothing accumulates
        else:
            assert not hasattr(p, "grad_sample")
    assert net.training  # training mode untouched


def test_loop_empty_batch_and_bad_arguments():
    net = _mlp()
    losses = compute_grad_sample(
        net, F.cross_entropy, torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), method="loop"
    )
    assert losses.shape == (0,) and losses.dtype == torch.float32
    assert net[0].weight.grad_sample.shape == (0, 8, 5)
    with pytest.raises(ValueError, match="method"):
        compute_grad_sample(net, F.cross_entropy, torch.zeros(2, 5), method="jit")
    with pytest.raises(ValueError, match="batch size"):
        compute_grad_sample(
            net, F.cross_entropy, torch.zeros(2, 5), batch_kwargs={"m": torch.zeros(3)}
        )
    with pytest.raises(ValueError, match="must be a tensor"):
        compute_grad_sample(net, F.cross_entropy, torch.zeros(2, 5), batch_kwargs={"m": 1})
    with pytest.raises(ValueError, match="no batched input"):
        compute_grad_sample(net, F.cross_entropy, ())


class Gated(torch.nn.Module):
    """Keyword inputs; with branch=True, data-dependent Python control flow (no vmap) that
    decides alike for any subset of these samples (a decision over the batch's sum would
    mix samples: compute_grad_sample refuses it)."""

    def __init__(self, branch=False):
        super().__init__()
        self.lin, self.branch = torch.nn.Linear(4, 2), branch

    def forward(self, x, *, gate):
        if self.branch and bool((gate.abs() < 1e6).all()):
            x = x * 2
        return self.lin(x * gate.unsqueeze(-1))


@pytest.mark.parametrize("method", ["vmap", "loop"])
def test_batch_kwargs(method):
    torch.manual_seed(1)
    net, x, gate = Gated(), torch.randn(4, 4), torch.randn(4)
    y = torch.randint(0, 2, (4,))
    grads, want = _truth(
        net, 4, lambda i: F.cross_entropy(net(x[i : i + 1], gate=gate[i : i + 1]), y[i : i + 1])
    )
    got = compute_grad_sample(
        net, F.cross_entropy, x, y, batch_kwargs={"gate": gate}, method=method
    )
    _check(net, grads, got, want)


def test_auto_falls_back_with_one_warning_per_class(monkeypatch):
    monkeypatch.setattr(gs, "_FALLBACK_WARNED", set(), raising=False)
    torch.manual_seed(2)
    net, x = Gated(branch=True), torch.randn(5, 4)
    gate, y = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0]), torch.randint(0, 2, (5,))
    with pytest.raises(RuntimeError, match="data-dependent control flow"):
        compute_grad_sample(net, F.cross_entropy, x, y, batch_kwargs={"gate": gate}, method="vmap")
    grads, want = _truth(
        net, 5, lambda i: F.cross_entropy(net(x[i : i + 1], gate=gate[i : i + 1]), y[i : i + 1])
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            got = compute_grad_sample(net, F.cross_entropy, x, y, batch_kwargs={"gate": gate})
            _check(net, grads, got, want)
    (w,) = _fallback_warnings(record)
    assert "Gated" in str(w.message) and "loop" in str(w.message)
    assert "data-dependent" in str(w.message) and w.filename == __file__


def test_genuine_errors_are_not_swallowed(monkeypatch):
    monkeypatch.setattr(gs, "_FALLBACK_WARNED", set(), raising=False)
    net, x, y = _mlp(), torch.randn(3, 5), torch.randint(0, 3, (3,))

    def bad_value(out, target):
        raise ValueError("user loss says no")

    def bad_shape(out, target):  # [1, 3] - [1, 4]: a RuntimeError
        return (out - torch.zeros(1, 4)).sum()

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="user loss says no"):
            compute_grad_sample(net, bad_value, x, y)
        with pytest.raises(RuntimeError, match="must match") as info:
            compute_grad_sample(net, bad_shape, x, y)
        with pytest.raises(RuntimeError, match="Expected f"):  # vmap's error, not the loop's
            compute_grad_sample(net, lambda out, t: out.sum(1), x, y)
    assert "loop fallback failed on sample 0 too" in "".join(getattr(info.value, "__notes__", []))
    assert not _fallback_warnings(record)
    assert not any(hasattr(p, "grad_sample") for p in net.parameters())


# --- Hugging Face models vmap cannot trace (tiny, built from configs: no download) ------


def test_bloom_causal_lm_falls_back(monkeypatch):
    tf = pytest.importorskip("transformers")
    monkeypatch.setattr(gs, "_FALLBACK_WARNED", set(), raising=False)
    torch.manual_seed(3)
    cfg = tf.BloomConfig(
        vocab_size=64,
        hidden_size=16,
        n_layer=1,
        n_head=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = tf.BloomForCausalLM(cfg).eval()
    B, T = 3, 7
    ids = torch.randint(0, 64, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 5:], mask[2, 3:] = 0, 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)

    def lm_loss(out, lab):  # one sample's summed next-token loss
        return F.cross_entropy(
            out.logits[:, :-1].reshape(-1, 64), lab[:, 1:].reshape(-1), reduction="sum"
        )

    with pytest.raises(RuntimeError, match="setup_context"):  # today's crash, under vmap
        compute_grad_sample(
            model, lm_loss, ids, labels, batch_kwargs={"attention_mask": mask}, method="vmap"
        )
    grads, want = _truth(
        model,
        B,
        lambda i: lm_loss(model(ids[i : i + 1], attention_mask=mask[i : i + 1]), labels[i : i + 1]),
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            got = compute_grad_sample(
                model, lm_loss, ids, labels, batch_kwargs={"attention_mask": mask}
            )
            _check(model, grads, got, want)
    (w,) = _fallback_warnings(record)
    assert "BloomForCausalLM" in str(w.message) and "setup_context" in str(w.message)
    assert not model.training


def test_bert_classifier_with_padding_mask_falls_back(monkeypatch):
    tf = pytest.importorskip("transformers")
    monkeypatch.setattr(gs, "_FALLBACK_WARNED", set(), raising=False)
    torch.manual_seed(4)
    cfg = tf.BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = tf.BertForSequenceClassification(cfg).eval()
    B, T = 4, 8
    ids = torch.randint(0, 64, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 6:], mask[2, 3:] = 0, 0
    y = torch.randint(0, 3, (B,))

    def cls_loss(out, target):
        return F.cross_entropy(out.logits, target)

    grads, want = _truth(
        model, B, lambda i: cls_loss(model(ids[i : i + 1], mask[i : i + 1]), y[i : i + 1])
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            got = compute_grad_sample(model, cls_loss, (ids, mask), y)
            _check(model, grads, got, want)
    (w,) = _fallback_warnings(record)
    assert "BertForSequenceClassification" in str(w.message)
    # the per-sample gradients sum to the gradient of the padded batch's summed loss
    model.zero_grad()
    F.cross_entropy(model(ids, mask).logits, y, reduction="sum").backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample.sum(0), p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_batch_norm_in_training_mode_is_refused():
    import pytest

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    with pytest.raises(ValueError, match="batch norm in training mode.*mixes samples"):
        compute_grad_sample(
            model, lambda out, y: out.square().sum(), torch.randn(5, 4), torch.zeros(5)
        )
    model.eval()
    compute_grad_sample(model, lambda out, y: out.square().sum(), torch.randn(5, 4), torch.zeros(5))
