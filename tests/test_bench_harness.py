"""The benchmark harness (bench/harness.py): the one clock, alternating rounds, peak
memory, and the bytes floor against the tensors a real DP step touches."""

from __future__ import annotations

import random
import time

import pytest
import torch

import dpkern
from bench import harness as H


def _state_bytes(opt, params) -> int:
    """Bytes of the parameter-shaped tensors a step reads and writes: p and its states."""
    total = 0
    for p in params:
        total += p.numel() * p.element_size()
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor) and v.shape == p.shape:
                total += v.numel() * v.element_size()
    return total


@pytest.mark.parametrize("gs_dtype", [torch.float32, torch.bfloat16])
def test_bytes_floor_counts_the_tensors_a_dp_adamw_step_touches(gs_dtype):
    """The floor against a real DP-AdamW step: per-sample reads grad_sample twice (norms,
    then the fused clip + sum) and reads + writes p, exp_avg, exp_avg_sq; summed reads S
    once instead; noise writes d floats. Fails if the step keeps another state tensor."""
    gen = torch.Generator().manual_seed(random.randint(0, 2**31))
    shapes = [(random.randint(1, 9), random.randint(1, 9)) for _ in range(3)] + [(7,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    B = random.randint(1, 5)
    opt = dpkern.DPAdamW(
        params, lr=1e-3, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=B
    )
    for p in params:
        p.grad_sample = torch.randn((B, *p.shape), generator=gen).to(gs_dtype)
    gs_bytes = sum(p.grad_sample.numel() * p.grad_sample.element_size() for p in params)
    opt.step()
    d = sum(p.numel() for p in params)
    touched = 2 * _state_bytes(opt, params)  # read and written once each
    elem = torch.tensor([], dtype=gs_dtype).element_size()
    assert H.bytes_floor("per_sample", d, B, grad_bytes=elem) == 2 * gs_bytes + touched
    assert H.bytes_floor("summed", d, B) == d * 4 + touched  # S in fp32, read once
    assert H.bytes_floor("noise", d, 0) == d * 4
    with pytest.raises(ValueError, match="path"):
        H.bytes_floor("sgd", d, B)


def test_time_call_measures_the_call_and_median_skips_the_warmup():
    assert 0.009 < H.time_call(lambda: time.sleep(0.01), "cpu") < 1.0
    calls = []
    slow_first = lambda: (calls.append(1), time.sleep(0.05 if len(calls) == 1 else 0))
    assert H.median_seconds(slow_first, "cpu", reps=3, warmup=1) < 0.04
    assert len(calls) == 4


def test_sysfs_sizes():
    assert H._sysfs_bytes("32768K\n") == 32 << 20 and H._sysfs_bytes("8M") == 8 << 20
    assert H._sysfs_bytes("512") == 512


def test_alternating_timing_rotates_the_order_and_counts_calls():
    calls = []
    cands = [
        H.Candidate("dpkern", name, run=lambda name=name: calls.append(name))
        for name in ("a", "b", "c")
    ]
    times = H.time_alternating(cands, repeats=4, device="cpu", warmup=2)
    assert calls[:6] == ["a", "b", "c"] * 2  # warm-up rounds
    rounds = [calls[6 + 3 * r : 9 + 3 * r] for r in range(4)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert {k: len(v) for k, v in times.items()} == {"dpkern:a": 4, "dpkern:b": 4, "dpkern:c": 4}
    assert all(t >= 0 for v in times.values() for t in v)


def test_peak_memory_sees_a_large_temporary():
    big = H.Candidate("baseline", "foreach", run=lambda: torch.ones(16 * 2**20).sum())
    small = H.Candidate("dpkern", "cpp", run=lambda: None)
    peak_big = H.peak_extra_bytes(big, "cpu")
    if peak_big is None:
        pytest.skip("no /proc/self/clear_refs here")
    assert peak_big >= 60 * 2**20  # the 64 MiB tensor
    assert H.peak_extra_bytes(small, "cpu") < 16 * 2**20


def test_steal_share_is_the_stolen_part_of_the_ticks_between_readings(monkeypatch, tmp_path):
    """cpu_ticks reads the steal field (the 8th number) of /proc/stat's cpu line and
    the total of the first eight; steal_share is the stolen share between two readings;
    steal_note warns above 5%."""
    lines = [
        "cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3\n",
        "cpu  160 0 60 900 10 0 5 65 0 0\n",  # +60 +10 +100 +30 steal: 30 / 200
    ]
    real_open = open

    def fake_open(path, *a, **k):
        if path == "/proc/stat":
            f = tmp_path / "stat"
            f.write_text(lines.pop(0))
            return real_open(f, *a, **k)
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", fake_open)
    before, after = H.cpu_ticks(), H.cpu_ticks()
    assert before == (35, 1000) and after == (65, 1200)
    assert H.steal_share(before, after) == pytest.approx(0.15)
    assert H.steal_share(before, None) is None and H.steal_share(after, after) is None
    assert H.steal_note(0.15) == (
        "CPU steal 15.0% (WARNING: the hypervisor took CPU time from this run; "
        "ratios are unreliable)"
    )
    assert H.steal_note(0.031) == "CPU steal 3.1%" and H.steal_note(None) == "CPU steal unknown"
