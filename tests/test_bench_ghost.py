"""The ghost-clipping benchmark (bench/ghost.py) at tiny sizes: the layer candidates agree
with a per-sample loop, the agreement check can fail, ratios divide by the non-private
step, Opacus' refusal of tied weights is a note, and the report wires it behind --ghost."""
from __future__ import annotations

import functools
import json
import random

import pytest
import torch

from bench import ghost as GB
from bench import report as R

TINY = {"n_embd": 16, "n_layer": 1, "n_head": 2}


def _loop_norms_sq(A, G):
    """Per-example loop: the weight gradient of sample i is G_i^T A_i."""
    return torch.stack([(G[i].T.double() @ A[i].double()).square().sum() for i in
                        range(A.shape[0])]).float()


def test_parse_layer_and_rule():
    B, T, d, p = (random.randint(1, 64) for _ in range(4))
    case = GB.parse_layer(f"{B}x{T}x{d}x{p}")
    assert (case.B, case.T, case.d, case.p) == (B, T, d, p)
    assert case.rule == ("gram" if T * (d + p) <= d * p else "instantiate")
    assert case.flops("gram") == 2 * B * T * T * (d + p)
    assert case.flops("instantiate") == 2 * B * T * d * p
    for bad in ("16x128x768", "0x1x2x3", "axbxcxd", ""):
        with pytest.raises(ValueError, match="BxTxDxP"):
            GB.parse_layer(bad)


def test_layer_candidates_compute_the_same_norms_as_a_loop():
    case = GB.LayerCase(random.randint(1, 4), random.randint(2, 9), random.randint(2, 12),
                        random.randint(2, 12))
    cands = GB.layer_candidates(case, "cpu")
    names = {c.name for c in cands}
    assert {"dpkern:gram", "dpkern:instantiate"} <= names
    pytest.importorskip("opacus")
    assert "baseline:opacus" in names
    gen = torch.Generator().manual_seed(__import__("zlib").crc32(repr(case).encode()))
    A = torch.randn(case.B, case.T, case.d, generator=gen)
    G = torch.randn(case.B, case.T, case.p, generator=gen).mul_(1e-3)
    want = _loop_norms_sq(A, G)
    for c in cands:
        torch.testing.assert_close(c.run().float(), want, rtol=1e-4, atol=0, msg=c.name)


def test_check_agree_names_the_wrong_candidate():
    ref = torch.rand(5) + 0.5
    GB.check_agree({"dpkern:gram": ref, "x:ok": ref * (1 + 1e-5)}, "dpkern:gram")
    bad = ref.clone()
    bad[random.randrange(5)] *= 1.01
    with pytest.raises(AssertionError, match="x:bad"):
        GB.check_agree({"dpkern:gram": ref, "x:ok": ref, "x:bad": bad}, "dpkern:gram")
    with pytest.raises(AssertionError, match="x:nan"):
        GB.check_agree({"dpkern:gram": ref, "x:nan": ref * float("nan")}, "dpkern:gram")


def test_e2e_row_ratios_divide_by_the_nonprivate_step():
    base, t = random.uniform(0.01, 1), random.uniform(0.01, 1)
    med = {"floor:nonprivate": base, "dpkern:ghost": t, "dpkern:per_sample": 3 * t}
    row = GB.e2e_row(64, 16, 1000, med, {"floor:nonprivate": 100, "dpkern:ghost": 350})
    assert row["nonprivate_ratio"] == pytest.approx(1.0)
    assert row["ghost_ratio"] == pytest.approx(t / base)
    assert row["per_sample_ratio"] == pytest.approx(3 * t / base)
    assert row["opacus_s"] is None and row["opacus_ratio"] is None
    assert row["ghost_peak_over_nonprivate_bytes"] == 250
    assert row["per_sample_peak_bytes"] is None


def test_measure_tiny_end_to_end(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = GB.measure("cpu", layers=["2x4x16x16", GB.LayerCase(1, 16, 4, 4)], blocks=[8],
                         batches=[2], repeats=2, warmup=0, memory=False, model_kw=TINY)
    finally:
        torch.set_num_threads(threads)
    assert [(r["T"], r["rule"]) for r in res["layers"]] == [(4, "gram"), (16, "instantiate")]
    assert all(r["gram_s"] > 0 and r["instantiate_s"] > 0 for r in res["layers"])
    (row,) = res["e2e"]
    assert (row["block"], row["batch"]) == (8, 2) and row["params"] > 0
    for key in ("ghost", "per_sample"):
        assert row[f"{key}_ratio"] == pytest.approx(row[f"{key}_s"] / row["nonprivate_s"])
    names = {t["candidate"] for t in res["timings"] if t["kind"] == "e2e"}
    assert {"floor:nonprivate", "dpkern:ghost", "dpkern:per_sample"} <= names
    if any(n.startswith("baseline:opacus") for n in names):
        # Opacus 1.6 refuses the tied model and says why; the untied copy is timed instead
        assert ("baseline:opacus" in names) != ("baseline:opacus-untied" in names)
        if "baseline:opacus-untied" in names:
            assert any("tying" in n for n in res["notes"])
    md = GB.markdown(res)
    tables = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert len(tables) == 2 + 2 + 2 + 1
    assert all(ln.count("|") == tables[0].count("|") for ln in tables[:4])
    assert f"{row['ghost_ratio']:.2f}×" in md
    GB.write(res, tmp_path)
    assert json.loads((tmp_path / "ghost.json").read_text())["e2e"][0]["block"] == 8
    assert (tmp_path / "ghost.md").read_text().strip() == md


def test_candidates_train_their_own_model_copy():
    cands, _, _ = GB.e2e_candidates(8, 2, "cpu", model_kw=TINY, opacus=False)
    by = {c.name: c for c in cands}
    start = [p.detach().clone() for p in by["dpkern:ghost"].model.parameters()]
    for name, c in by.items():
        c.run()  # each step moves its own copy and no other
        moved = {n: any(not torch.equal(a, b) for a, b in zip(start, o.model.parameters()))
                 for n, o in by.items()}
        assert moved[name] and not any(moved[n] for n in by if n != name), name
        for p, s in zip(c.model.parameters(), start):
            p.data.copy_(s)


def test_report_runs_the_ghost_part_by_default(tmp_path, monkeypatch):
    assert R.parse_args([]).ghost is True and R.parse_args(["--no-ghost"]).ghost is False
    monkeypatch.setattr(GB, "measure", functools.partial(
        GB.measure, layers=["2x4x16x16"], blocks=[8], batches=[2], model_kw=TINY))
    threads = torch.get_num_threads()
    try:
        res = R.main(["--paths", "noise", "--noise-d", "4K", "--repeats", "1", "--warmup", "0",
                      "--threads", "1", "--bandwidth-mib", "8", "--no-memory", "--no-plot",
                      "--ghost", "--out", str(tmp_path), "--quiet"])
    finally:
        R.set_threads(threads)
    assert [r["B"] for r in res["ghost"]["layers"]] == [2]
    assert [r["block"] for r in res["ghost"]["e2e"]] == [8]
    md = (tmp_path / "results.md").read_text()
    assert GB.markdown(res["ghost"]) in md and "non-private ms" in md
    assert (tmp_path / "ghost_e2e.csv").exists()
    assert json.loads((tmp_path / "results.json").read_text())["ghost"]["e2e"][0]["batch"] == 2
