"""Buffers written from the batch during the forward are refused on both paths.

A buffer updated in training mode from the samples (running statistics: a running-mean
normaliser, InstanceNorm with ``track_running_stats=True``) releases the batch without
noise (``state_dict``, every later forward), and in compute_grad_sample's per-sample loop it
lets sample i's forward see samples 0..i-1. Both compute_grad_sample (vmap and loop) and
ghost clipping refuse such a forward with a ValueError naming the buffer, and leave every
buffer (and the parameters) as it was. Buffers that are only read (eval-mode norms, rotary
frequencies, position ids), writes that leave the values as they were, and ghost clipping's
data-independent caches (a non-persistent buffer recomputed from the sequence length, as
transformers' dynamic RoPE does) keep working.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpkern
import dpkern.grad_sample as gs
from conftest import case_seed
from dpkern.ghost import GhostClipping
from dpkern.grad_sample import compute_grad_sample

#: the ways a forward can write a running mean into its buffer
HOWS = ("inplace", "lerp", "data", "copy", "setitem", "replace", "data_set")
#: vmap refuses every in-place write (so auto falls back to the loop) and undoes a
#: replacement (functional_call puts its own tensors back); ``.data =`` under vmap crashes
#: PyTorch itself (a segfault in 2.x), so those two run the loop only
LOOP_ONLY = ("replace", "data_set")


class RunNorm(nn.Module):
    """A running-mean normaliser (a persistent buffer updated from the batch in training
    mode), written in one of :data:`HOWS`; ``use``: the forward subtracts it."""

    def __init__(self, d: int, how: str, use: bool = True, persistent: bool = True):
        super().__init__()
        self.register_buffer("mean", torch.zeros(d), persistent=persistent)
        self.how, self.use = how, use

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                m, how = x.mean(0), self.how
                if how == "inplace":
                    self.mean.mul_(0.9).add_(0.1 * m)
                elif how == "lerp":
                    self.mean.lerp_(m, 0.5)
                elif how == "data":
                    self.mean.data.mul_(0.9).add_(0.1 * m)
                elif how == "copy":
                    self.mean.copy_(m)
                elif how == "setitem":
                    self.mean[:] = m
                elif how == "replace":
                    self.mean = 0.9 * self.mean + 0.1 * m
                elif how == "data_set":
                    self.mean.data = 0.9 * self.mean + 0.1 * m
        return x - self.mean if self.use else x


class Net(nn.Module):
    def __init__(self, how: str, use: bool = True, persistent: bool = True):
        super().__init__()
        self.norm = RunNorm(4, how, use, persistent)
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(self.norm(x))


class InstanceNet(nn.Module):
    """Linear on the last dim -> (eval) BatchNorm1d -> InstanceNorm1d -> Linear."""

    def __init__(self, track: bool = True):
        super().__init__()
        self.pre = nn.Linear(5, 5)
        self.bn = nn.BatchNorm1d(3)
        self.inorm = nn.InstanceNorm1d(3, affine=False, track_running_stats=track)
        self.head = nn.Linear(15, 2)
        with torch.no_grad():  # running statistics that matter
            for m in (self.bn, self.inorm):
                if m.running_mean is not None:
                    m.running_mean.uniform_(-1, 1)
                    m.running_var.uniform_(0.5, 2)

    def forward(self, x):
        return self.head(self.inorm(self.bn(self.pre(x))).flatten(1))


def snapshot(model):
    return {n: (b, b.detach().clone()) for n, b in model.named_buffers()}


def assert_unchanged(model, snap):
    now = dict(model.named_buffers())
    assert set(now) == set(snap), (set(now), set(snap))
    for n, (b, v) in snap.items():
        assert now[n] is b, f"{n} was replaced"
        torch.testing.assert_close(b, v, rtol=0, atol=0, msg=n)


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def sq_loss(out):
    return out.square().sum()


def ghost_step(model, x, rows=lambda out: out.square().flatten(1).sum(1)):
    """The ghost per-sample norms of one micro-batch, then a ghost-clipped DPSGD step
    (``rows``: the per-sample losses of the output)."""
    opt = dpkern.DPSGD(
        model.parameters(),
        lr=0.1,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
        expected_batch_size=x.shape[0],
        seed=0,
    )
    with GhostClipping(model, opt) as gc:
        _, norms = gc.clipped_sums(rows(model(x)))
        gc.backward(rows(model(x)))
    opt.step()
    return norms


def per_sample_norms(model):
    return torch.cat(
        [p.grad_sample.flatten(1) for p in model.parameters() if p.requires_grad], 1
    ).norm(dim=1)


# -- a running-mean normaliser --------------------------------------------------------------
@pytest.mark.parametrize(
    "method, how",
    [("loop", h) for h in HOWS] + [("auto", h) for h in HOWS if h not in LOOP_ONLY],
)
def test_per_sample_path_refuses_a_buffer_written_from_the_batch(method, how):
    torch.manual_seed(case_seed(1))
    net, x = Net(how), torch.randn(6, 4) * 3 + 1
    snap, before = snapshot(net), params_of(net)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"buffer 'norm\.mean' of RunNorm was") as info:
            compute_grad_sample(net, sq_loss, x, method=method)
    msg = str(info.value)
    assert "without noise" in msg and "eval()" in msg and "restored" in msg
    assert_unchanged(net, snap)
    assert not any(hasattr(p, "grad_sample") for p in net.parameters())
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())
    # the loop fallback is not adopted (nor announced) for a forward that writes a buffer
    assert not [w for w in record if issubclass(w.category, gs.VmapFallbackWarning)]


def test_vmap_undoes_a_replaced_buffer_and_the_loop_no_longer_mixes_samples():
    """The review's sensitivity case: with the loop's writes refused, a replaced sample can
    only move its own row; under vmap the replacement is per sample and undone."""
    torch.manual_seed(case_seed(2))
    net, x = Net("replace"), torch.randn(6, 4)
    snap = snapshot(net)
    compute_grad_sample(net, sq_loss, x)  # auto: vmap runs it, functional_call undoes it
    assert_unchanged(net, snap)
    g1 = torch.cat([p.grad_sample.flatten(1) for p in net.parameters()], 1)
    x2 = x.clone()
    x2[0] = 100.0
    compute_grad_sample(net, sq_loss, x2)
    g2 = torch.cat([p.grad_sample.flatten(1) for p in net.parameters()], 1)
    torch.testing.assert_close(g1[1:], g2[1:], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"norm\.mean.*sample 0 \(loop\)"):
        compute_grad_sample(net, sq_loss, x, method="loop")
    assert_unchanged(net, snap)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("use", [True, False])
def test_ghost_refuses_a_buffer_written_from_the_batch(how, use):
    torch.manual_seed(case_seed(3))
    net, x = Net(how, use), torch.randn(6, 4) * 3 + 1
    snap, before = snapshot(net), params_of(net)
    with warnings.catch_warnings():
        # (a forward refused for its layout: torch warns that the buffer check's own error,
        # raised in the always-called hook after restoring, was silenced)
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError) as info:
            ghost_step(net, x)
    msg = str(info.value)
    if not use or how in ("data", "data_set"):  # the forward itself is accepted
        assert "buffer 'norm.mean' (RunNorm)" in msg, msg
        assert "without noise" in msg and "eval()" in msg and "restored" in msg
    assert_unchanged(net, snap)
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())


@pytest.mark.parametrize("how", ["inplace", "copy", "replace", "data"])
def test_ghost_refuses_a_non_persistent_buffer_written_from_the_batch(how):
    """The cache exception (a non-persistent buffer) covers values independent of the
    samples only: one the batch tracking finds dependent, or written through .data, is
    refused like a persistent one."""
    torch.manual_seed(case_seed(9))
    net, x = Net(how, use=False, persistent=False), torch.randn(6, 4) * 3 + 1
    snap = snapshot(net)
    with pytest.raises(ValueError, match=r"buffer 'norm\.mean' \(RunNorm\)"):
        ghost_step(net, x)
    assert_unchanged(net, snap)


# -- InstanceNorm with running statistics; eval-mode norms ----------------------------------
def test_instance_norm_with_running_stats_in_training_mode_is_refused_on_both_paths():
    torch.manual_seed(case_seed(4))
    net, x = InstanceNet(track=True), torch.randn(6, 3, 5) * 3 + 7
    net.bn.eval()  # (batch norm in training mode has its own refusal)
    snap, before = snapshot(net), params_of(net)
    for method in ("auto", "vmap", "loop"):
        with pytest.raises(ValueError, match=r"inorm \(InstanceNorm1d\).*track_running_stats"):
            compute_grad_sample(net, sq_loss, x, method=method)
        assert_unchanged(net, snap)
    assert not any(hasattr(p, "grad_sample") for p in net.parameters())
    with pytest.raises(ValueError, match=r"instance_norm in inorm.*track_running_stats"):
        ghost_step(net, x)
    assert_unchanged(net, snap)
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())


@pytest.mark.parametrize("case", ["eval", "no_running_stats"])
def test_eval_mode_norms_and_norms_without_running_stats_still_work(case):
    torch.manual_seed(case_seed(5))
    net = InstanceNet(track=case == "eval")
    net.bn.eval()
    if case == "eval":
        net.inorm.eval()
    x = torch.randn(6, 3, 5) * 3 + 7
    snap = snapshot(net)
    compute_grad_sample(net, sq_loss, x)
    want = per_sample_norms(net)
    assert_unchanged(net, snap)
    norms = ghost_step(net, x)
    assert_unchanged(net, snap)
    torch.testing.assert_close(norms, want, rtol=1e-4, atol=1e-6)


class Refreshed(nn.Module):
    """Writes its buffer in every forward, always with the same values (a cache refresh:
    the version counter moves, the values do not)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("scale", torch.full((2,), 0.5))
        self.register_buffer("init", torch.full((2,), 0.5))

    def forward(self, x):
        with torch.no_grad():
            self.scale.copy_(self.init)
        return self.lin(x) * self.scale


def test_a_write_that_leaves_the_values_as_they_were_is_allowed():
    torch.manual_seed(case_seed(6))
    net, x = Refreshed(), torch.randn(5, 4)
    snap = snapshot(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gs.VmapFallbackWarning)  # (vmap refuses the copy_)
        compute_grad_sample(net, sq_loss, x)
    want = per_sample_norms(net)
    assert_unchanged(net, snap)
    torch.testing.assert_close(ghost_step(net, x), want, rtol=1e-4, atol=1e-6)
    assert_unchanged(net, snap)


# -- transformers models ----------------------------------------------------------------------
def lm_rows(out, ids):
    """Each sample's summed next-token cross-entropy: ``[B]``."""
    lg = out.logits[:, :-1]
    ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return ce.view(ids.shape[0], -1).sum(1)


class Ids(nn.Module):
    """The model called as ``model(input_ids=ids)`` (logits out)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_gpt2_and_llama_still_work_on_both_paths(arch):
    pytest.importorskip("transformers")
    from dpkern import models

    torch.manual_seed(case_seed(7))
    net = Ids(models.default_model(8, arch=arch, n_embd=16, n_layer=1, n_head=2, seed=0))
    net.train()
    ids = torch.randint(0, models.BYTE_VOCAB, (3, 8))
    snap = snapshot(net)
    compute_grad_sample(net, lambda out, y: lm_rows(out, y).sum(), ids, ids)
    want = per_sample_norms(net)
    assert_unchanged(net, snap)
    norms = ghost_step(net, ids, lambda out: lm_rows(out, ids))
    assert_unchanged(net, snap)
    torch.testing.assert_close(norms, want, rtol=1e-4, atol=1e-6)


def test_llama_dynamic_rope_recomputes_its_frequencies_under_ghost():
    """transformers' dynamic RoPE replaces the non-persistent ``inv_freq`` buffer when a
    sequence is longer than the cached length: a value that depends on the length only,
    which ghost clipping lets through (the per-sample path's vmap undoes it)."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(case_seed(8))
    cfg = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=8,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        attention_dropout=0.0,
    )
    cfg._attn_implementation = "eager"
    net = Ids(tf.LlamaForCausalLM(cfg)).train()
    ids = torch.randint(0, 64, (3, 12))  # longer than max_position_embeddings
    rope = net.model.model.rotary_emb
    if "dynamic" not in str(getattr(rope, "rope_type", "")):
        pytest.skip("this transformers version does not build a dynamic RoPE from the config")
    inv = rope.inv_freq.clone()
    ghost_step(net, ids, lambda out: lm_rows(out, ids))
    assert not torch.equal(rope.inv_freq, inv)  # recomputed, and accepted
