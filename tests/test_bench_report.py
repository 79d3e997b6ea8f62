"""The benchmark report's logic (bench/report.py) at tiny sizes: layouts, sizes, ratios,
targets, and one end-to-end run writing its files (the harness: test_bench_harness.py)."""

from __future__ import annotations

import csv
import json
import math
import random

import pytest
import torch

from bench import format_size, gpt2_like_shapes, layout_shapes, parse_size
from bench import report as R


@pytest.mark.parametrize("trial", range(3))
def test_gpt2_like_layout_has_148_tensors_and_about_d_coordinates(trial):
    d = random.choice([random.randint(3_000, 20_000), random.randint(20_000, 70 * 2**20)])
    shapes = gpt2_like_shapes(d)
    total = sum(math.prod(s) for s in shapes)
    h = shapes[0][1]
    assert len(shapes) == 148
    assert d - h < total <= d
    assert shapes[2:14] == shapes[14:26]  # identical blocks
    assert layout_shapes(d, "tensor") == [(d,)]
    with pytest.raises(ValueError, match="too small"):
        gpt2_like_shapes(500)
    with pytest.raises(ValueError, match="layout"):
        layout_shapes(d, "moe")


def test_sizes_parse_and_format():
    assert parse_size("16M") == 16 * 2**20 and parse_size("64k") == 65536
    assert parse_size("4096") == 4096 and parse_size("0.5M") == 2**19
    assert format_size(parse_size("64M")) == "64M" and format_size(3000) == "3000"
    for bad in ("", "M", "abc", "0", "-3M"):
        with pytest.raises(ValueError):
            parse_size(bad)


def _summary(medians, peaks=None, case=R.Case("summed", "tensor", 1000, 0)):
    return R.summarize(case, 1000, 1, medians, peaks or {}, bandwidth=28e3)


def test_summary_ratios_are_baseline_over_dpkern():
    t_cpp, t_ref = random.uniform(0.01, 1), random.uniform(1, 2)
    med = {
        "dpkern:cpp": t_cpp,
        "dpkern:torch": t_ref,
        "baseline:foreach": 0.5,
        "baseline:fused": 0.25,
        "floor:foreach": 0.1,
    }
    rows = {r["backend"]: r for r in _summary(med, {"baseline:fused": 7 * 2**20})}
    assert set(rows) == {"cpp", "torch"}
    r = rows["cpp"]
    assert r["baseline_foreach_ratio"] == pytest.approx(0.5 / t_cpp)
    assert r["baseline_fused_ratio"] == pytest.approx(0.25 / t_cpp)
    assert r["adamw_foreach_ratio"] == pytest.approx(0.1 / t_cpp)
    assert r["adamw_fused_s"] is None and r["adamw_fused_ratio"] is None
    assert r["bw_floor_s"] == pytest.approx(1.0)  # 28 * 1000 bytes at 28e3 B/s
    assert r["bw_fraction"] == pytest.approx(1.0 / t_cpp)
    assert r["baseline_fused_peak_bytes"] == 7 * 2**20 and r["dpkern_peak_bytes"] is None
    table = R.markdown_table([r, rows["torch"]])
    lines = table.splitlines()
    assert len(lines) == 4 and all(ln.count("|") == lines[0].count("|") for ln in lines)
    assert f"{0.5 / t_cpp:.2f}×" in table


def test_targets_report_measured_ratio_or_why_not():
    case = R.Case("summed", "tensor", 16 * 2**20, 0)
    rows = R.summarize(case, case.d, 1, {"dpkern:cpp": 1.0, "baseline:foreach": 3.5}, {}, 1e9)
    rows += R.summarize(case, case.d, 1, {"dpkern:torch": 1.0, "baseline:foreach": 9.0}, {}, 1e9)
    out = R.check_targets(rows, ["cpp"])
    assert len(out) == len(R.TARGETS)
    summed = next(t for t in out if t["target"].startswith("summed"))
    assert summed["measured"] == pytest.approx(3.5) and summed["met"] is True
    noise = next(t for t in out if t["target"].startswith("noise"))
    assert noise["measured"] is None and "not in" in noise["note"]
    missing = R.check_targets(rows, [])
    assert all(t["measured"] is None and "not available" in t["note"] for t in missing)
    slow = R.summarize(case, case.d, 1, {"dpkern:cpp": 2.0, "baseline:foreach": 3.0}, {}, 1e9)
    assert (
        next(t for t in R.check_targets(slow, ["cpp"]) if t["target"].startswith("summed"))["met"]
        is False
    )
    assert "**no**" in R.markdown_targets(R.check_targets(slow, ["cpp"]))


def test_report_end_to_end_tiny(tmp_path, capsys):
    pytest.importorskip("opacus")
    out = tmp_path / "res"
    threads = torch.get_num_threads()
    try:  # one thread: quick even on a busy machine; restored for the other tests
        res = R.main(
            [
                "--noise-d",
                "4K",
                "--summed-d",
                "8K",
                "--per-sample-d",
                "8K",
                "--batch",
                "2",
                "--repeats",
                "2",
                "--warmup",
                "0",
                "--threads",
                "1",
                "--torch-max-d",
                "4K",
                "--bandwidth-mib",
                "8",
                "--no-memory",
                "--no-ghost",
                "--out",
                str(out),
            ]
            + ([] if _has_matplotlib() else ["--no-plot"])
        )
    finally:
        R.set_threads(threads)
    saved = json.loads((out / "results.json").read_text())
    assert capsys.readouterr().out.rstrip().endswith(f"results in {out}/)")  # the path given
    assert saved["summary"] == json.loads(json.dumps(res["summary"]))
    for key in ("cpu", "cores", "torch", "dpkern", "date", "loadavg", "cpu_steal"):
        assert key in saved["machine"]
    assert saved["bandwidth"]["bytes_per_s"] > 0
    # 1 noise case + 2 summed (tensor, gpt2) + 2 per-sample (tensor, gpt2)
    cases = {(t["path"], t["layout"]) for t in saved["timings"]}
    assert cases == {
        ("noise", "tensor"),
        ("summed", "tensor"),
        ("summed", "gpt2"),
        ("per_sample", "tensor"),
        ("per_sample", "gpt2"),
    }
    backends = set(saved["backends"])
    assert "torch" in backends
    assert {r["backend"] for r in saved["summary"]} == backends
    per_sample = [r for r in saved["summary"] if r["path"] == "per_sample"]
    assert all(r["baseline_foreach_ratio"] > 0 and r["batch"] == 2 for r in per_sample)
    with open(out / "summary.csv") as f:
        assert len(list(csv.DictReader(f))) == len(saved["summary"])
    assert len(saved["targets"]) >= len(R.TARGETS)
    if _has_matplotlib():
        assert (out / "results.png").stat().st_size > 1000


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401

        return True
    except ImportError:
        return False


@pytest.mark.parametrize("name", ["families", "ghost", "report", "stochastic_rounding"])
def test_help_names_the_module_command(name, capsys):
    import importlib

    module = importlib.import_module(f"bench.{name}")
    entry = module.parse_args if name == "report" else module.main
    with pytest.raises(SystemExit) as exc:
        entry(["--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m bench.{name} ")
