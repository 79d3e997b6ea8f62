"""bench/families.py runs, and covers every family of SPEC section 10 (timings are not
asserted: speed lives in bench/, not in tests)."""

import pytest
import torch

from dpkern import rules

pytest.importorskip("opacus")
pytest.importorskip("lion_pytorch")
pytest.importorskip("schedulefree")

from bench import families  # noqa: E402


def test_every_section_10_family_is_benchmarked():
    section_10 = {s.cli_name for s in rules.RULES.values() if s.section.startswith("10.")}
    assert set(families._twins()) == section_10


def test_tiny_run_times_dpkern_baseline_and_floor():
    rows = families.run(4096, 2, torch.device("cpu"), "auto", 1, ["dp-rmsprop", "dp-ademamix"])
    rms, ade = rows
    for key in ("dpkern:per_sample", "dpkern:summed", "baseline:per_sample", "floor:twin"):
        assert rms[key] > 0
    assert rms["ratio:per_sample"] > 0 and ade["ratio:per_sample"] is None
    table = families.markdown(rows, 4096, 2, "auto")
    assert "| dp-ademamix |" in table and table.count("\n") == len(rows) + 3
