"""Privacy invariants (SPEC sections 1-4): sensitivity <= C, noise mean/std, no
(key, step) reuse, and the secret key never leaves the process in secure mode."""

from __future__ import annotations

import logging
import math
import pickle

import pytest
import torch

import dpkern
from dpkern.hyper import DPStep
from dpkern.keys import reveal

SHAPES = [(5, 3), (3,), (17,), ()]


def _params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _set_gs(params, gs):
    for p, g in zip(params, gs):
        p.grad_sample = g.clone()


def _clipped_update(grad_samples, C, cls=dpkern.DPSGD, **kw):
    """p_before - p_after for one sigma = 0 step with lr = 1 and B_e = 1: the clipped sum."""
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = cls(
        params,
        lr=1.0,
        max_grad_norm=C,
        noise_multiplier=0.0,
        expected_batch_size=1,
        backend="torch",
        **kw,
    )
    _set_gs(params, grad_samples)
    opt.step()
    return torch.cat([(b - p.detach()).flatten() for b, p in zip(before, params)])


@pytest.mark.parametrize("C", [0.1, 1.0, 7.5])
def test_removing_one_sample_moves_the_clipped_sum_by_at_most_C(C):
    g = torch.Generator().manual_seed(int(C * 10))
    B = 6
    scales = torch.tensor([1e-3, 0.05, 1.0, 10.0, 1e4, 3.0])  # below and far above C
    gs = [torch.randn((B, *s), generator=g) * scales.view(-1, *([1] * len(s))) for s in SHAPES]
    full = _clipped_update(gs, C)
    for i in range(B):
        keep = [j for j in range(B) if j != i]
        without = _clipped_update([x[keep] for x in gs], C)
        assert torch.linalg.vector_norm(full - without) <= C * (1 + 1e-5)
    # and the worst case is attained for huge samples: the bound is tight, not vacuous
    big = [torch.full((1, *s), 1e3) for s in SHAPES]
    assert torch.linalg.vector_norm(_clipped_update(big, C)) == pytest.approx(C, rel=1e-5)


def test_macadam_whitened_sensitivity_is_one():
    """Sum of clipped whitened rows: one sample moves it by <= 1 (SPEC section 7)."""
    from dpkern.backends import reference as ref
    from dpkern.hyper import MacAdamHyper

    g = torch.Generator().manual_seed(3)
    B = 5
    gs = [torch.randn((B, *s), generator=g) * 50 for s in SHAPES]
    m = [torch.randn(s, generator=g) for s in SHAPES]
    b = [torch.rand(s, generator=g) + 0.01 for s in SHAPES]
    states = {"exp_avg": m, "scale": b}
    hyper = MacAdamHyper(lr=0.1)

    def whitened_sum(rows):
        sub = [x[rows] for x in gs]
        n = ref.whitened_norms(sub, m, b, 1 - 0.9**2, len(rows), "cpu")
        c = 1 / torch.clamp(n, min=1.0)
        bufs = [torch.zeros(s) for s in SHAPES]
        ref.accumulate(
            hyper, DPStep(key=0, step=3, noise_std=0, expected_batch_size=1), sub, c, bufs, states
        )
        return torch.cat([x.flatten() for x in bufs])

    full = whitened_sum(list(range(B)))
    for i in range(B):
        diff = full - whitened_sum([j for j in range(B) if j != i])
        assert torch.linalg.vector_norm(diff) <= 1 + 1e-5


def test_noise_mean_and_std_on_an_empty_batch():
    """B = 0 still steps with noise: delta p = -lr (sigma C / B_e) z; mean ~ 0, std ~
    sigma C / B_e within 6 standard errors (n = 2**18 coordinates)."""
    n, sigma, C, Be = 2**18, 2.0, 3.0, 4.0
    p = torch.nn.Parameter(torch.zeros(n))
    opt = dpkern.DPSGD(
        [p],
        lr=1.0,
        max_grad_norm=C,
        noise_multiplier=sigma,
        expected_batch_size=Be,
        seed=11,
        backend="torch",
    )
    p.grad_sample = torch.zeros(0, n)
    opt.step()
    x = -p.detach().double()
    target = sigma * C / Be
    se = target / math.sqrt(n)
    assert abs(x.mean()) < 6 * se
    assert abs(x.std() - target) < 6 * target / math.sqrt(2 * n)
    assert opt.stats["samples"] == 0 and opt.dp_step == 1


def _noise_of_step(opt, params):
    """The noise that opt's next step adds (SGD, lr 1, empty batch): -delta p * B_e / (sigma C)."""
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad_sample = torch.zeros((0, *p.shape))
    opt.step()
    scale = opt.expected_batch_size / (opt.noise_multiplier * opt.max_grad_norm)
    return torch.cat([((b - p.detach()) * scale).flatten() for b, p in zip(before, params)])


def _sgd(params, **kw):
    return dpkern.DPSGD(
        params,
        lr=1.0,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=1.0,
        backend="torch",
        **kw,
    )


def test_no_key_step_reuse_across_steps_and_parameters():
    params = _params()
    opt = _sgd(params)
    z1, z2 = _noise_of_step(opt, params), _noise_of_step(opt, params)
    assert not torch.isclose(z1, z2).any()
    # parameters draw disjoint slices: no two coordinates share a value
    assert z1.unique().numel() == z1.numel()


def test_secure_resume_draws_a_fresh_key_but_keeps_the_step():
    params = _params()
    opt = _sgd(params)
    _noise_of_step(opt, params)
    sd = opt.state_dict()
    resumed = []
    for _ in range(2):
        p2 = _params()
        opt2 = _sgd(p2)
        opt2.load_state_dict(sd)
        assert opt2.dp_step == 1
        resumed.append(_noise_of_step(opt2, p2))
    continued = _noise_of_step(opt, params)
    assert not torch.isclose(resumed[0], resumed[1]).any()
    assert not torch.isclose(resumed[0], continued).any()


def test_reproducible_resume_continues_the_same_stream():
    params = _params()
    opt = _sgd(params, seed=77)
    _noise_of_step(opt, params)
    p2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = _sgd(p2, seed=5)
    opt2.load_state_dict(opt.state_dict())
    torch.testing.assert_close(
        _noise_of_step(opt2, p2), _noise_of_step(opt, params), rtol=0, atol=0
    )


def _key_strings(key: int) -> list[str]:
    return [str(key), hex(key), f"{key:x}", f"{key:X}", repr(key.to_bytes(8, "little"))]


def test_secure_key_never_appears_in_repr_state_logs_or_errors(caplog):
    caplog.set_level(logging.DEBUG)
    params = _params()
    opt = dpkern.DPAdamW(
        params,
        lr=0.1,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=2,
        backend="torch",
    )
    key = reveal(opt._key)
    _set_gs(params, [torch.randn(2, *p.shape) for p in params])
    opt.step()
    texts = [
        repr(opt),
        str(opt),
        str(opt.state_dict()),
        str(vars(opt.state_dict()["dp"])) if hasattr(opt.state_dict()["dp"], "__dict__") else "",
        str(opt.stats),
        caplog.text,
        repr(DPStep(key=key, step=1, noise_std=1.0, expected_batch_size=1.0)),
    ]
    params[0].grad_sample = torch.full((2, *params[0].shape), float("nan"))
    for p in params[1:]:
        p.grad_sample = torch.randn(2, *p.shape)
    with pytest.raises(FloatingPointError) as err:
        opt.step()
    texts.append(str(err.value))
    with pytest.raises(ValueError) as err:
        DPStep(key=2**64 + key, step=1, noise_std=0.0, expected_batch_size=1.0)
    texts.append(str(err.value))
    with pytest.raises(TypeError):
        pickle.dumps(opt)  # would carry the key
    blob = "\n".join(texts)
    assert "seed" not in opt.state_dict()["dp"]
    for s in _key_strings(key):
        assert s not in blob


def test_seeded_mode_saves_the_seed_and_pickles():
    params = _params()
    opt = _sgd(params, seed=123)
    assert opt.state_dict()["dp"]["seed"] == 123
    clone = pickle.loads(pickle.dumps(opt))
    assert reveal(clone._key) == 123 and not clone.secure
