"""Habits of torch.optim / AMP that would release private data outside the mechanism are
refused before anything changes: AMP's GradScaler (its skip is decided by un-clipped
gradients), a clipping bound changed within a logical batch, and a seeded (not private)
optimizer made without a word."""

from __future__ import annotations

import warnings

import pytest
import torch

import dpkern

from test_errors import _assert_same, _fill, _model, _snapshot


def _opt(model, **kw):
    kw = {"max_grad_norm": 1.0, "noise_multiplier": 0.5, "expected_batch_size": 4.0, **kw}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (seed= warns: tested below)
        return dpkern.DPSGD(model.parameters(), lr=0.1, seed=1, **kw)


@pytest.mark.parametrize("overflow", [False, True])
def test_grad_scaler_step_is_refused_never_skipped_and_nothing_changes(overflow):
    """GradScaler.step skipped optimizer.step() whenever the raw p.grad held an inf: a
    release decided by one sample's un-clipped gradient, in silence. Now GradScaler hands
    the step to dpkern, which refuses it (overflow or not), and a plain step works next."""
    model = _model()
    opt = _opt(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x = torch.randn(4, 4)
    scaler.scale(model(x).square().sum()).backward()
    _fill(model)
    if overflow:
        model[0].weight.grad[0, 0] = float("inf")  # one sample's gradient overflowed
    before = _snapshot(model, opt)
    with pytest.raises(TypeError, match="GradScaler"):
        scaler.step(opt)
    _assert_same(before, _snapshot(model, opt))
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    opt.step()  # the same micro-batch, without the scaler
    assert opt.dp_step == 1


def _accumulate_one(model, opt, seed):
    _fill(model, seed=seed)
    opt.accumulate()


def test_max_grad_norm_changed_within_a_logical_batch_is_refused():
    """Micro-batches clipped at C = 10, then C set to 0.01 before step(): the noise would
    be sigma * 0.01 over sums clipped at 10. Refused at step() and at the next accumulate
    (nothing changes); set back, the batch steps; between batches C may change."""
    model = _model()
    opt = _opt(model, max_grad_norm=10.0)
    _accumulate_one(model, opt, 1)
    opt.max_grad_norm = 0.01
    _fill(model, seed=2)
    before = _snapshot(model, opt)
    for call in (opt.step, opt.accumulate):
        with pytest.raises(ValueError, match=r"max_grad_norm changed from 10\.0 to 0\.01"):
            call()
    _assert_same(before, _snapshot(model, opt))
    opt.max_grad_norm = 10.0
    opt.step()
    assert opt.dp_step == 1
    opt.max_grad_norm = 0.01  # a new logical batch: a clipping schedule may change it
    _accumulate_one(model, opt, 3)
    _fill(model, seed=4)
    opt.step()
    assert opt.dp_step == 2


def test_max_grad_norm_change_after_accumulate_clipped_is_refused_and_drop_batch_resets():
    model = _model()
    opt = _opt(model)
    sums = [torch.randn_like(p) * 0.1 for p in opt.trainable_params()]
    opt.accumulate_clipped(sums, 4)
    opt.max_grad_norm = 2.0
    with pytest.raises(ValueError, match="within a logical batch"):
        opt.step()
    with pytest.raises(ValueError, match="within a logical batch"):
        opt.accumulate_clipped(sums, 4)
    opt.drop_batch()  # abandoned: the new C applies to the next batch
    opt.accumulate_clipped(sums, 4)
    opt.step()
    assert opt.dp_step == 1


def test_a_seeded_optimizer_warns_that_it_is_not_private():
    model = _model()
    with pytest.warns(UserWarning, match=r"seed=7 .*not private"):
        dpkern.DPAdamW(
            model.parameters(), max_grad_norm=1.0, noise_multiplier=1.0,
            expected_batch_size=4, seed=7,
        )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dpkern.DPAdamW(
            model.parameters(), max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4
        )


def test_functional_calls_at_one_step_with_one_noise_key_are_refused():
    """dp_sgd called per parameter (torch.optim._functional's habit) at one (key, step):
    the second call would draw the same noise (a difference of the two releases cancels
    it) and clip its parameters apart. A NoiseKey refuses a step not above the last it
    served, before anything changes; counting steps up works."""
    from dpkern import functional as F
    from dpkern.keys import NoiseKey

    torch.manual_seed(0)
    key = NoiseKey(0x5EED_0F_DA7A)
    a, b = torch.randn(3), torch.randn(2)
    ga, gb = torch.randn(4, 3), torch.randn(4, 2)
    priv = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4.0)
    F.dp_sgd([a], [ga], [None], lr=0.1, step=1, key=key, backend="torch", **priv)
    b0 = b.clone()
    with pytest.raises(ValueError, match="already released at step 1"):
        F.dp_sgd([b], [gb], [None], lr=0.1, step=1, key=key, backend="torch", **priv)
    assert torch.equal(b, b0)
    F.dp_sgd([a, b], [ga, gb], [None, None], lr=0.1, step=2, key=key, backend="torch", **priv)
    assert not torch.equal(b, b0)
