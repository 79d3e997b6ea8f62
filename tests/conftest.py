"""Shared fixtures. Backends are test columns: adding one adds parameters, not files.

The Triton column runs only in a pytest process started with TRITON_INTERPRET=1 (on CPU)
or on a CUDA machine; ``tests/run.sh`` runs that process separately (``-m triton``)."""

from __future__ import annotations

import copy
import json
import os
import random
from pathlib import Path

import pytest
import torch

from dpkern import rules
from dpkern.backends import is_available, triton_interpret

VECTORS = Path(__file__).resolve().parent.parent.parent / "shared" / "vectors" / "noise_v1.json"
_LOCAL_VECTORS = Path(__file__).resolve().parent / "data" / "noise_v1.json"


#: Salt of the random test inputs: fresh each run (a case's inputs are
#: ``manual_seed(case_seed(k))``), fixed with DPKERN_TEST_SEED=<int> to replay a failure.
RUN_SEED = int(os.environ.get("DPKERN_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))


def case_seed(k: int) -> int:
    """Seed of random test case ``k`` in this run (mixes in :data:`RUN_SEED`)."""
    return (int(k) * 1_000_003 + RUN_SEED) % 2**63


def required_backends() -> list[str]:
    """Backends that must be present (``DPKERN_REQUIRE_BACKENDS=cpp,triton``, set by CI):
    a backend that failed to build or import then fails the run instead of skipping."""
    return [b for b in os.environ.get("DPKERN_REQUIRE_BACKENDS", "").split(",") if b.strip()]


def pytest_configure(config):
    from dpkern.backends import _load

    missing = [
        (name, _load(name.strip())[1])
        for name in required_backends()
        if _load(name.strip())[0] is None
    ]
    if missing:
        raise pytest.UsageError(
            "DPKERN_REQUIRE_BACKENDS: required backend(s) unavailable: "
            + "; ".join(f"{n} ({why})" for n, why in missing)
        )


def pytest_report_header(config):
    return f"dpkern random test inputs: DPKERN_TEST_SEED={RUN_SEED}"


def load_vectors() -> dict:
    """The noise stream known answers (shared/vectors, or the copy kept in tests/data)."""
    path = VECTORS if VECTORS.exists() else _LOCAL_VECTORS
    return json.loads(path.read_text())


def backend_device(name: str) -> torch.device:
    if name == "triton" and torch.cuda.is_available() and not triton_interpret():
        return torch.device("cuda")
    return torch.device("cpu")


def require_backend(name: str) -> str:
    """Skip the calling test unless backend ``name`` runs here (Triton: under
    TRITON_INTERPRET=1 or on CUDA; a fused backend: built/installed); returns ``name``."""
    if name == "triton" and not (triton_interpret() or torch.cuda.is_available()):
        pytest.skip("triton column: run with TRITON_INTERPRET=1 (tests/run.sh does)")
    if not is_available(name):
        pytest.skip(f"backend {name!r} not available")
    return name


def backend_params(names=("cpp", "triton")):
    """pytest params of backend names, the Triton one marked ``triton``."""
    return [
        pytest.param(n, marks=[pytest.mark.triton] if n == "triton" else [], id=n) for n in names
    ]


@pytest.fixture(params=backend_params())
def fused_backend(request):
    """Name of a fused backend to compare against the reference; skipped if unavailable."""
    return require_backend(request.param)


def state_in_domain(state: rules.StateSpec, x: torch.Tensor) -> torch.Tensor:
    """A random normal tensor ``x`` moved into the state's domain (second moments >= 0,
    scales > 0)."""
    if state.domain == "nonnegative":
        return x.square() * 0.5
    if state.domain == "positive":
        return x.abs() + 0.5
    return x


def random_states(rule: str, shapes, rnd) -> dict[str, list[torch.Tensor]]:
    """Random kernel states of ``rule`` (the registry's) for parameters of ``shapes``:
    {name: [tensor per shape]}, drawn with ``rnd(*shape)`` in (state, parameter) order,
    each shaped as its StateSpec says and in its domain."""
    return {
        st.name: [state_in_domain(st, rnd(*st.shape_for(s))) for s in shapes]
        for st in rules.get(rule).kernel_states
    }


def run_step(module, hyper, case):
    """Run one backend step (and MacAdam's scale update) on a deep copy of ``case`` =
    (params, grad_samples, clip_factors, summed, states, offsets, dp); return
    (params, states, the step's return value)."""
    params, grad_samples, clip, summed, states, offsets, dp = copy.deepcopy(case)
    out = module.step(hyper, dp, params, grad_samples, clip, summed, states, offsets)
    if rules.of(hyper).whitening:
        module.macadam_update_scale(hyper, dp, states["exp_var"], states["scale"], out)
    return params, states, out


#: The finetune tests' corpus vocabulary (a small language with learnable structure).
WORDS = (
    "the privacy of each record is protected by noise added to the clipped sum of "
    "gradients while the model learns which words follow which"
).split()


@pytest.fixture
def tiny_default_model(monkeypatch):
    """Shrink finetune's built-in model (in this process) so that a run takes a second or
    two (modules that run the job use it as ``pytestmark``)."""
    from dpkern import models

    monkeypatch.setattr(models, "DEFAULT_SHAPE", {"n_embd": 32, "n_layer": 1, "n_head": 2})


@pytest.fixture
def text_file(tmp_path):
    """A fresh random text with learnable structure (a small vocabulary of words)."""
    rng = random.Random()
    sentences = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + "." for _ in range(400)
    ]
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(sentences))
    return path
