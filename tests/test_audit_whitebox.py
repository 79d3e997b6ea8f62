"""dpkern.audit: white-box canaries through every path and backend.

Soundness: honest runs never get a lower bound above the claimed epsilon, and their noise
calibration passes. Power: faults injected through the test-only hook
(dpkern.audit._faults: sigma / 4, noise off, clipping off) are caught with the bound
above the claimed epsilon (DP-SGD, whose scores are exactly the noisy gradients; for the
Adam family sigma / 4 is caught by the calibration check, see the module docstring of
dpkern.audit.calibration). Config "strong": q = 1, T = 2, eps = 2, m = 2000 (the
audit's best case); "poisson": q = 0.25, T = 8, eps = 4, m = 1000."""

from __future__ import annotations

import functools

import pytest

import dpkern
from conftest import case_seed
from dpkern import audit
from dpkern.accounting import get_noise_multiplier
from dpkern.audit import _faults
from dpkern.backends import is_available

DELTA = 1e-5
STRONG = dict(epsilon=2.0, sample_rate=1.0, steps=2, canaries=2000, n_real=64)
POISSON = dict(epsilon=4.0, sample_rate=0.25, steps=8, canaries=1000, n_real=64)

CLASSES = {
    "sgd": (dpkern.DPSGD, dict(lr=0.1)),
    "adam": (dpkern.DPAdam, dict(lr=0.01)),
    "adamw": (dpkern.DPAdamW, dict(lr=0.01, weight_decay=0.01)),
    "adambc": (dpkern.DPAdamBC, dict(lr=0.01, gamma=1e-7)),
    "adamwbc": (dpkern.DPAdamWBC, dict(lr=0.01, weight_decay=0.01)),
    "macadam": (dpkern.DPMacAdam, dict(lr=0.01)),
}


def make_opt(params, *, name, sigma, batch, backend, seed):
    cls, kw = CLASSES[name]
    extra = {} if name == "macadam" else {"max_grad_norm": 1.0}
    return cls(
        params,
        noise_multiplier=sigma,
        expected_batch_size=batch,
        backend=backend,
        seed=seed,
        **kw,
        **extra,
    )


@functools.lru_cache(maxsize=None)
def noise_multiplier(eps, q, T):  # (RDP calibration under subsampling takes seconds)
    return get_noise_multiplier(eps, DELTA, q, T)


def run_audit(name, cfg, path, backend="cpp", k=0, **kw):
    """One audit of ``cfg``; under subsampling the claim is the calibration's target (the
    accountant guarantees it), at q = 1 the accountant's epsilon of the run."""
    if not is_available(backend):
        pytest.skip(f"backend {backend!r} not available")
    cfg = dict(cfg)
    eps = cfg.pop("epsilon")
    q, T, m, n_real = cfg["sample_rate"], cfg["steps"], cfg["canaries"], cfg["n_real"]
    sigma = noise_multiplier(eps, q, T)
    if q < 1:
        kw.setdefault("epsilon", eps)
    batch = q * (n_real + m / 2)
    factory = functools.partial(
        make_opt, name=name, sigma=sigma, batch=batch, backend=backend, seed=case_seed(100 + k)
    )
    kw.setdefault("free", 0)
    res = audit.audit_whitebox(
        factory,
        delta=DELTA,
        path=path,
        seed=case_seed(k),
        micro_batch_size=kw.pop("micro_batch_size", 300),
        **cfg,
        **kw,
    )
    assert res.epsilon_claimed == pytest.approx(eps, rel=2e-3)  # sigma's calibration tol
    return res


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("path", ["step", "accumulate", "ghost"])
def test_honest_sgd_is_never_over_claimed(path, backend):
    res = run_audit("sgd", STRONG, path, backend, k=1)
    assert res.bound.epsilon <= res.epsilon_claimed, res.to_dict()
    assert res.calibration.available and res.calibration.ok, res.calibration.summary()
    assert res.verdict == "pass"
    assert 0.9 < res.calibration.noise_ratio < 1.1 and 0.7 < res.calibration.signal_ratio < 1.3


@pytest.mark.parametrize(
    "name,path",
    [
        ("adam", "step"),
        ("adamw", "ghost"),
        ("adambc", "accumulate"),
        ("adamwbc", "ghost"),
        ("sgd", "accumulate"),
        ("macadam", "step"),
    ],
)
def test_honest_rules_under_poisson_sampling(name, path):
    res = run_audit(name, POISSON, path, k=2, micro_batch_size=64)
    assert res.bound.epsilon <= res.epsilon_claimed, res.to_dict()
    assert res.calibration.ok, res.calibration.summary()
    assert res.calibration.available == (name != "macadam")
    assert res.steps == 8


@pytest.mark.parametrize(
    "fault,path", [("sigma/4", "step"), ("noise-off", "accumulate"), ("clip-off", "ghost")]
)
def test_faults_are_caught_by_the_bound(monkeypatch, fault, path):
    monkeypatch.setattr(_faults, "active", fault)
    res = run_audit("sgd", STRONG, path, k=3)
    assert res.bound.epsilon > res.epsilon_claimed, res.to_dict()
    assert res.verdict == "VIOLATION" and not res.calibration.ok


@pytest.mark.parametrize("fault", ["noise-off", "clip-off", "sigma/4"])
def test_faults_in_adamw(monkeypatch, fault):
    monkeypatch.setattr(_faults, "active", fault)
    res = run_audit("adamw", STRONG, "ghost", k=4)
    assert not res.calibration.ok, res.calibration.summary()
    if fault == "sigma/4":  # scale-invariant updates: the shift, not the spread, moves
        assert res.calibration.z_signal > 5 and abs(res.calibration.z_noise) < 4
    else:
        assert res.bound.epsilon > res.epsilon_claimed, res.to_dict()


def test_calibration_sees_a_sigma_the_bound_cannot(monkeypatch):
    """sigma 10% too small: far inside what the bound can see, obvious to the spread."""
    monkeypatch.setitem(
        _faults.FAULTS,
        "sigma*0.9",
        lambda o: setattr(o, "noise_multiplier", 0.9 * o.noise_multiplier),
    )
    monkeypatch.setattr(_faults, "active", "sigma*0.9")
    # 6000 canaries: the signal ratio's standard error is ~0.04, the spread's ~0.007, so
    # the bands below are 5 standard errors (1000 canaries put rel=0.2 at 2: 1 run in 20).
    res = run_audit("sgd", dict(POISSON, canaries=6000), "step", k=5, free=8000)
    assert res.bound.epsilon <= res.epsilon_claimed
    assert res.verdict == "MISCALIBRATED"
    assert res.calibration.noise_ratio == pytest.approx(0.9, abs=0.035)
    assert res.calibration.sigma_effective == pytest.approx(0.9 * res.noise_multiplier, rel=0.25)


def test_summary_says_when_sigma_eff_is_not_estimable():
    import numpy as np

    from dpkern.audit.calibration import calibration_check

    rng = np.random.default_rng(case_seed(41))
    out, sim_out, sim_in = (rng.normal(size=200) for _ in range(3))
    sim_in += 0.5  # the honest shift; the observed one is negative (noise won)
    cal = calibration_check(rng.normal(size=200) - 1.0, out, sim_in, sim_out, sigma=0.44)
    assert cal.signal_ratio < 0 and cal.sigma_effective == float("inf")
    line = cal.summary()
    assert "sigma_eff not estimable" in line and "inf" not in line, line
    honest = calibration_check(rng.normal(size=200) + 0.5, out, sim_in, sim_out, sigma=0.44)
    assert f"sigma_eff {honest.sigma_effective:.4g} vs 0.44" in honest.summary()
    # the Adam family rescales the signal: no sigma_eff that would read as a noise error
    adam = calibration_check(
        rng.normal(size=200) + 0.5, out, sim_in, sim_out, sigma=0.44, linear=False
    )
    assert adam.sigma_effective != adam.sigma_effective  # NaN: JSON null
    assert "sigma_eff is estimated for DP-SGD only" in adam.summary()
    assert "vs 0.44" not in adam.summary()


@pytest.mark.slow
def test_data_parallel_path(monkeypatch):
    """Two gloo processes: honest with ghost clipping, then noise off per-sample."""
    res = run_audit("sgd", STRONG, "ddp", k=6, clipping="ghost", nproc=2)
    assert res.path == "ddp x2 (ghost)"
    assert res.bound.epsilon <= res.epsilon_claimed and res.calibration.ok, res.to_dict()
    monkeypatch.setattr(_faults, "active", "noise-off")  # (the workers are handed it)
    bad = run_audit("sgd", STRONG, "ddp", k=7, clipping="per-sample", nproc=2)
    assert bad.bound.epsilon > bad.epsilon_claimed and bad.verdict == "VIOLATION"


@pytest.mark.slow
def test_fsdp2_path(monkeypatch):
    """Two gloo processes with the model sharded by FSDP2 (ghost clipping): honest, then
    noise off (caught by the bound)."""
    res = run_audit("sgd", STRONG, "fsdp", k=6, nproc=2)
    assert res.path == "fsdp x2 (ghost)"
    assert res.bound.epsilon <= res.epsilon_claimed and res.calibration.ok, res.to_dict()
    assert 0.9 < res.calibration.noise_ratio < 1.1 and 0.7 < res.calibration.signal_ratio < 1.3
    monkeypatch.setattr(_faults, "active", "noise-off")  # (the workers are handed it)
    bad = run_audit("sgd", STRONG, "fsdp", k=7, nproc=2)
    assert bad.bound.epsilon > bad.epsilon_claimed and bad.verdict == "VIOLATION"


def test_fsdp2_path_clips_with_ghost_only():
    from dpkern.audit.whitebox import WhiteBoxRun

    with pytest.raises(ValueError, match="fsdp path clips with ghost clipping only"):
        WhiteBoxRun(path="fsdp", sample_rate=0.5, steps=1, canaries=2, clipping="per-sample")


def test_result_is_json_ready():
    import json

    res = run_audit("sgd", POISSON, "step", k=8)
    d = json.loads(json.dumps(res.to_dict()))
    assert d["epsilon_lower_bound"] == res.bound.epsilon and d["verdict"] == res.verdict
    assert d["confidence"] == pytest.approx(0.95) and len(d["guesses"]) == 11
    assert "included" not in d and "scores" not in d


def test_errors():
    def factory(params):
        return dpkern.DPSGD(
            params, lr=0.0, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8
        )

    with pytest.raises(ValueError, match="lr > 0"):
        audit.audit_whitebox(factory, sample_rate=0.5, steps=1, delta=1e-5)
    ok = functools.partial(make_opt, name="sgd", sigma=1.0, batch=8, backend="torch", seed=1)
    with pytest.raises(ValueError, match="path"):
        audit.audit_whitebox(ok, sample_rate=0.5, steps=1, delta=1e-5, path="nope")
    with pytest.raises(ValueError, match="canaries"):
        audit.audit_whitebox(ok, sample_rate=0.5, steps=1, delta=1e-5, canaries=1)
