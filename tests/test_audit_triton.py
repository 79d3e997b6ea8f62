"""dpkern.audit with the Triton backend (the kernels run under TRITON_INTERPRET=1 on CPU,
in the suite's separate Triton process, or on CUDA): an honest run is never over-claimed
and passes its calibration; a run with the noise off is caught by the bound."""

from __future__ import annotations

import pytest

from dpkern.audit import _faults
from conftest import require_backend
from test_audit_whitebox import STRONG, run_audit

#: Small enough for the interpreter (per-sample norms of B ~ 116 rows); noise off still
#: separates all 200 canaries perfectly: a bound of about 3.6 > 2.
SMALL = dict(STRONG, canaries=200, n_real=16)

pytestmark = pytest.mark.triton


@pytest.fixture(autouse=True)
def _triton_column():
    require_backend("triton")


@pytest.mark.parametrize("path", ["step", "ghost"])
def test_honest_triton_run_is_never_over_claimed(path):
    res = run_audit("adamw" if path == "ghost" else "sgd", SMALL, path, "triton", k=11)
    assert res.bound.epsilon <= res.epsilon_claimed, res.to_dict()
    assert res.calibration.ok, res.calibration.summary()


def test_triton_noise_off_is_caught(monkeypatch):
    monkeypatch.setattr(_faults, "active", "noise-off")
    res = run_audit("sgd", SMALL, "accumulate", "triton", k=12)
    assert res.bound.epsilon > res.epsilon_claimed and res.verdict == "VIOLATION"
