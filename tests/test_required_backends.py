"""The suite can fail: with DPKERN_REQUIRE_BACKENDS=cpp, a C++ extension that failed to
build or import fails the run instead of skipping the cpp tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HIDE = """
import importlib.abc, sys
class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "dpkern._C":
            raise ImportError("hidden by the test: as if the C++ build had failed")
sys.meta_path.insert(0, _Hide())
"""


def _pytest(tmp_path, required: str, hide: bool):
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(HIDE if hide else "")
    env = {
        **os.environ,
        "DPKERN_REQUIRE_BACKENDS": required,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(ROOT / "tests" / "test_noise.py"),
            "-k",
            "known_answer",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_missing_required_backend_fails_the_run(tmp_path):
    res = _pytest(tmp_path, "cpp", hide=True)
    assert res.returncode != 0
    assert "required backend(s) unavailable: cpp" in res.stdout + res.stderr


def test_the_same_run_passes_when_it_is_not_required(tmp_path):
    assert _pytest(tmp_path, "", hide=True).returncode == 0
