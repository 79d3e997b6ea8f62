"""``dpkern audit`` end to end (in-process, finetune's tiny model and a tiny fresh text):
the report, the JSON, and the exit codes (0 pass, 1 violation, 3 miscalibrated, 2 bad
input). Faults come through the test-only hook dpkern.audit._faults."""

from __future__ import annotations

import json
import random
import re

import pytest

from conftest import WORDS
from dpkern.audit import _faults
from dpkern.cli.__main__ import main

pytestmark = pytest.mark.usefixtures("tiny_default_model")

TINY = ["--block-size", "16", "--batch-size", "16", "--micro-batch-size", "8", "--quiet"]


def audit(*argv):
    return main(["audit", *map(str, argv)])


@pytest.fixture
def small_text(tmp_path):
    rng = random.Random()
    text = " ".join(
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + "." for _ in range(100)
    )
    path = tmp_path / "small.txt"
    path.write_text(text)
    return path


def test_quick_audit_of_an_honest_job_passes(text_file, tmp_path, capsys):
    out = tmp_path / "audit.json"
    rc = audit("--data", text_file, *TINY, "--steps", 10, "--quick", "--json", out)
    text = capsys.readouterr().out
    assert rc == 0, text
    lines = text.splitlines()
    assert "one-run privacy audit" in lines[0] and "95% confidence" in lines[0]
    assert lines[1].split()[:5] == ["path", "optimizer", "backend", "m", "T"]
    assert lines[3].split()[:5] == ["ghost", "dp-adamw", "auto", "(cpp)", "500"]
    assert lines[4].split()[:2] == ["input", "dp-adamw"]
    assert "No bound exceeds its claim" in text and "proves no privacy" in text
    report = json.loads(out.read_text())
    assert report["exit_code"] == 0 and report["private"] is True
    ghost, inp = report["results"]
    assert ghost["path"] == "ghost" and inp["path"] == "input"
    for r in (ghost, inp):
        assert r["epsilon_lower_bound"] <= r["epsilon_claimed"] and r["verdict"] == "pass"
        assert r["steps"] == 10 and r["delta"] == report["delta"]
    assert ghost["calibration"]["available"] and ghost["calibration"]["ok"]
    assert not inp["calibration"]["available"]
    assert ghost["canaries"] == 500 and inp["canaries"] == 256


def test_noise_off_input_canaries_are_a_violation(small_text, tmp_path, monkeypatch, capsys):
    """Canary blocks in the finetune job's own data: with the noise off they are
    memorised and the bound exceeds the claimed epsilon: exit code 1."""
    monkeypatch.setattr(_faults, "active", "noise-off")
    out = tmp_path / "a.json"
    argv = ["--data", small_text, "--block-size", 16, "--batch-size", 64, "--quiet"]
    argv += ["--micro-batch-size", 128, "--steps", 40, "--lr", 0.05, "--epsilon", 1]
    argv += ["--delta", 1e-6, "--path", "input", "--input-canaries", 200, "--json", out]
    rc = audit(*argv)
    text = capsys.readouterr().out
    assert rc == 1, text
    assert "VIOLATION" in text and "does NOT have the claimed guarantee" in text
    (r,) = json.loads(out.read_text())["results"]
    assert r["epsilon_lower_bound"] > r["epsilon_claimed"] == pytest.approx(1.0, rel=2e-3)


def test_a_small_sigma_error_is_miscalibrated(text_file, monkeypatch, capsys):
    monkeypatch.setitem(
        _faults.FAULTS,
        "sigma*0.8",
        lambda o: setattr(o, "noise_multiplier", 0.8 * o.noise_multiplier),
    )
    monkeypatch.setattr(_faults, "active", "sigma*0.8")
    argv = ["--data", text_file, *TINY, "--steps", 10, "--optimizer", "dp-sgd"]
    rc = audit(*argv, "--clipping", "per-sample", "--path", "step", "--canaries", 500)
    text = capsys.readouterr().out
    assert rc == 3, text
    assert "MISCALIBRATED" in text and re.search(r"noise spread x0\.(7[5-9]|8[0-5])", text)


@pytest.mark.parametrize(
    "argv,option",
    [
        (["--out", "x"], "--out"),
        (["--resume", "x"], "--resume"),
        (["--nproc", "2", "--fsdp"], "--fsdp"),
        (["--canaries", "1"], "--canaries"),
        (["--confidence", "1.5"], "--confidence"),
        (["--lr", "0"], "--lr"),
        (["--epsilon", "-1"], "--epsilon"),
        (["--path", "nowhere"], "--path"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(text_file, tmp_path, capsys, argv, option):
    with pytest.raises(SystemExit) if option == "--path" else _no_raise() as exc:
        rc = audit("--data", text_file, *TINY, *argv)
    if option == "--path":
        assert exc.value.code == 2
    else:
        assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and option in err[0], err
    assert not (tmp_path / "x").exists()


def test_missing_transformers_names_no_option(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "transformers.utils", None)
    assert audit("--quick", "--path", "ghost", "--quiet") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith("dpkern audit: error: the finetune job needs transformers"), err


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_faults_are_no_user_option(capsys):
    with pytest.raises(SystemExit):
        main(["audit", "--help"])
    help_text = capsys.readouterr().out
    assert "--canaries" in help_text and "--quick" in help_text and "--epsilon" in help_text
    assert not re.search(r"\bfaults?\b", help_text, re.I) and "sigma/4" not in help_text
    # finetune options the audit refuses are not offered
    for refused in ("--out", "--resume", "--overwrite", "--save-every", "--fsdp"):
        assert not re.search(re.escape(refused) + r"\b", help_text), refused
