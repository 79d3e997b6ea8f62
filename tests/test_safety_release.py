"""Safety nets around the mechanism: no sample released twice, no (key, step) pair reused,
no key in a repr, pickle or traceback, a step all-or-nothing (README: what dpkern refuses).

Each test fails on the code before the net was added (dpkern 0.1.0 as of 2026-11-30)."""

from __future__ import annotations

import copy
import os
import pickle
import signal
import sys

import pytest
import torch
from torch import nn

import dpkern
from dpkern.backends import reference
from dpkern.guards import StepInterrupted
from dpkern.keys import NoiseKey, reveal

CLASSES = [
    dpkern.DPSGD,
    dpkern.DPAdam,
    dpkern.DPAdamBC,
    dpkern.DPAdamW,
    dpkern.DPAdamWBC,
    dpkern.DPMacAdam,
]


def _make(cls, params, **kw):
    kw = {"lr": 0.05, "noise_multiplier": 1.0, "expected_batch_size": 4.0, "backend": "torch", **kw}
    if cls is dpkern.DPSGD:
        kw.setdefault("momentum", 0.9)
    if cls is not dpkern.DPMacAdam:
        kw.setdefault("max_grad_norm", 1.0)
    return cls(params, **kw)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(3, 5, generator=g)), nn.Parameter(torch.randn(7, generator=g))]


def _fill(params, B=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad_sample = torch.randn(B, *p.shape, generator=g)


# -- 1. per-sample gradients are consumed ------------------------------------------------
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_step_consumes_grad_sample_and_a_second_step_raises(cls):
    params = _params()
    opt = _make(cls, params, seed=3)
    _fill(params)
    opt.step()
    assert all(getattr(p, "grad_sample", None) is None for p in params)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="no fresh per-sample gradients.*Opacus raises"):
        opt.step()
    assert opt.dp_step == 1 and all(torch.equal(a, p) for a, p in zip(before, params))


def test_a_grad_sample_tensor_given_again_is_refused():
    params = _params()
    opt = _make(dpkern.DPAdamW, params, seed=3)
    _fill(params)
    saved = [p.grad_sample for p in params]
    opt.step()
    for p, gs in zip(params, saved):
        p.grad_sample = gs  # the same samples again
    with pytest.raises(ValueError, match="already used by an earlier step"):
        opt.step()
    params[0].grad_sample = [saved[0]]  # Opacus' list form too
    params[1].grad_sample = torch.randn_like(saved[1])
    with pytest.raises(ValueError, match="already used"):
        opt.step()
    assert opt.dp_step == 1


def test_accumulate_consumes_and_the_same_micro_batch_is_refused():
    params = _params()
    opt = _make(dpkern.DPSGD, params, seed=3)
    _fill(params)
    saved = [p.grad_sample for p in params]
    opt.accumulate()
    for p, gs in zip(params, saved):
        p.grad_sample = gs
    with pytest.raises(ValueError, match="already used"):
        opt.accumulate()
    with pytest.raises(ValueError, match="cannot be released"):
        opt.step()  # the error ended the logical batch: nothing of it is released
    with pytest.warns(UserWarning, match="dropped"):
        opt.zero_grad()
    assert opt.dp_step == 0 and not opt._accum
    with pytest.raises(ValueError, match="no parameter has a grad_sample"):
        opt.step()


def test_opacus_grad_sample_module_without_zero_grad_releases_each_batch_once():
    from opacus import GradSampleModule

    torch.manual_seed(0)
    model = GradSampleModule(nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2)))
    opt = _make(dpkern.DPAdamW, list(model.parameters()), seed=5, expected_batch_size=8.0)
    for _ in range(2):  # 2 batches of 8, no zero_grad() between them
        x = torch.randn(8, 6)
        nn.functional.cross_entropy(model(x), torch.randint(0, 2, (8,)), reduction="sum").backward()
        opt.step()
    with pytest.raises(ValueError, match="no fresh"):
        opt.step()  # the third step of the report: nothing fresh
    assert opt.stats["samples"] == 16  # before: 8 + 16 + 16 = 40 rows released


def test_ghost_step_without_fresh_clipped_sums_raises():
    from dpkern.ghost import GhostClipping

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = _make(dpkern.DPAdamW, list(model.parameters()), seed=5)
    with GhostClipping(model, opt) as gc:
        x, y = torch.randn(5, 6), torch.randint(0, 2, (5,))
        gc.backward(nn.functional.cross_entropy(model(x), y, reduction="none"))
        opt.step()
        with pytest.raises(ValueError, match="no fresh"):
            opt.step()


# -- 2. torch.compile(opt.step) advances the step and draws new noise ----------------------
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_compiled_step_equals_eager_steps(cls, compiler):
    runs = []
    for compiled in (False, True):
        params = _params()
        opt = _make(cls, params, seed=11)
        step = torch.compile(opt.step, backend=compiler) if compiled else opt.step
        for k in range(3):
            _fill(params, seed=10 + k)
            step()
        assert opt.dp_step == 3
        assert all(int(opt.state[p]["step"]) == 3 for p in params)
        runs.append([p.detach().clone() for p in params])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compiled_noise_differs_between_steps():
    p = nn.Parameter(torch.zeros(64))
    opt = dpkern.DPSGD(
        [p],
        lr=1.0,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=1.0,
        seed=2,
        backend="torch",
    )
    step = torch.compile(opt.step, backend="eager")
    deltas = []
    for _ in range(2):
        before = p.detach().clone()
        p.grad_sample = torch.zeros(1, 64)
        step()
        deltas.append(p.detach() - before)
    assert not torch.allclose(deltas[0], deltas[1])


# -- 5. the key is opaque ----------------------------------------------------------------
def _key_strings(key: int) -> list[str]:
    return [str(key), hex(key), f"{key:x}"]


def test_noise_key_is_opaque():
    k = NoiseKey(0x1234_5678_9ABC_DEF0)
    for text in (repr(k), str(k), f"{k}", f"{k:>30}", repr([k]), repr({"key": k})):
        assert "<secret>" in text
        for s in _key_strings(reveal(k)):
            assert s not in text
    with pytest.raises(TypeError):
        pickle.dumps(k)
    assert copy.deepcopy(k) is k
    with pytest.raises(AttributeError):
        k._value = 3
    with pytest.raises(ValueError) as err:
        NoiseKey(2**64 + 12345)
    assert "12345" not in str(err.value)


def _frame_values(tb):
    while tb is not None:
        yield from tb.tb_frame.f_locals.items()
        tb = tb.tb_next


@pytest.mark.parametrize("where", ["validation", "kernel"])
def test_no_frame_of_a_failing_step_holds_the_key_as_an_int(where, monkeypatch):
    """What a crash reporter that captures locals (pytest -l, Sentry) would ship."""
    params = _params()
    opt = _make(dpkern.DPAdamW, params)
    key = reveal(opt._key)
    _fill(params)
    if where == "validation":
        params[0].grad_sample[1, 0, 0] = float("nan")
        exc = FloatingPointError
    else:

        def boom(*args, **kwargs):
            raise RuntimeError("kernel failed")

        monkeypatch.setattr(reference, "step", boom)
        exc = RuntimeError
    with pytest.raises(exc) as err:
        opt.step()
    for name, value in _frame_values(err.value.__traceback__.tb_next):  # (not this test's)
        assert not (isinstance(value, int) and value == key), f"local {name!r} holds the key"
        text = repr(value) if not isinstance(value, torch.Tensor) else ""
        for s in _key_strings(key):
            assert s not in text, f"repr of local {name!r} shows the key"


def test_a_cpp_signature_mismatch_never_shows_the_key(monkeypatch):
    """pybind11's TypeError on a signature mismatch lists every argument ("Invoked with:
    ..."), the key among them: the cpp backend re-raises it without them, with no
    context exception and no frame holding the key."""
    from dpkern.backends import cpp

    if not dpkern.backends.is_available("cpp"):
        pytest.skip("the C++ extension is not built")
    params = _params()
    opt = _make(dpkern.DPAdamW, params, backend="cpp")
    key = reveal(opt._key)
    _fill(params)

    def mismatch(*args):
        raise TypeError(f"step(): incompatible function arguments. Invoked with: {args!r}")

    monkeypatch.setattr(cpp._C, "step", mismatch)
    with pytest.raises(TypeError, match="not shown: they hold the noise key") as err:
        opt.step()
    assert err.value.__context__ is None and err.value.__cause__ is None
    for s in _key_strings(key):
        assert s not in str(err.value)
    for name, value in _frame_values(err.value.__traceback__.tb_next):
        assert not (isinstance(value, int) and value == key), f"local {name!r} holds the key"
        if isinstance(value, tuple):
            assert not any(isinstance(v, int) and v == key for v in value), name


# -- 6. a step is all-or-nothing -----------------------------------------------------------
def _two_groups(seed=0):
    a, b = _params(seed)
    return [a, b], [{"params": [a]}, {"params": [b], "lr": 0.01}]


def test_sigint_during_the_update_is_delivered_after_a_complete_step(monkeypatch):
    if sys.platform == "win32":
        pytest.skip("POSIX signals")
    # Python's own SIGINT handler, whatever this process inherited (a job started in the
    # background by a non-interactive shell ignores SIGINT, and Python keeps it ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _sigint_during_update(monkeypatch)
    finally:
        signal.signal(signal.SIGINT, previous)


def _sigint_during_update(monkeypatch):
    expected, groups = _two_groups()
    ref = _make(dpkern.DPAdamW, groups, seed=9)
    _fill(expected)
    ref.step()

    params, groups = _two_groups()
    opt = _make(dpkern.DPAdamW, groups, seed=9)
    real = reference.step
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # arrives between the two groups' updates
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "step", interrupted)
    _fill(params)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert len(calls) == 2 and opt.dp_step == 1  # both groups updated, the step counted
    for a, b in zip(params, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    opt.state_dict()  # consistent: it can be saved


def test_failure_midway_counts_the_step_and_refuses_to_continue(monkeypatch):
    params, groups = _two_groups()
    opt = _make(dpkern.DPAdamW, groups)
    _fill(params)
    opt.step()
    checkpoint = opt.state_dict()
    weights = [p.detach().clone() for p in params]
    real = reference.step
    calls = []

    def oom_in_second_group(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "step", oom_in_second_group)
    _fill(params, seed=2)
    with pytest.raises(MemoryError):
        opt.step()
    monkeypatch.setattr(reference, "step", real)
    assert opt.dp_step == 2  # (key, 2) may have served a release: never again
    _fill(params, seed=3)
    for call in (opt.step, opt.accumulate, opt.state_dict):
        with pytest.raises(StepInterrupted, match="failed midway"):
            call()
    # the documented recovery: restore weights and optimizer from the checkpoint
    key_before = reveal(opt._key)
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)
    opt.load_state_dict(checkpoint)
    assert opt.dp_step == 1 and reveal(opt._key) != key_before  # fresh secure key
    opt.step()
    assert opt.dp_step == 2


def test_validation_errors_do_not_poison_the_optimizer():
    params = _params()
    opt = _make(dpkern.DPAdam, params)
    _fill(params)
    params[1].grad_sample = torch.randn(3, 7)  # B differs
    with pytest.raises(ValueError):
        opt.step()
    _fill(params)
    opt.step()
    assert opt.dp_step == 1


def test_step_interrupted_is_exported():
    import dpkern
    import dpkern.optim

    assert dpkern.StepInterrupted is dpkern.optim.StepInterrupted is StepInterrupted
    assert "StepInterrupted" in dpkern.__all__ and "StepInterrupted" in dpkern.optim.__all__
