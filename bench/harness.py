"""The measurement harness every benchmark shares: one clock, alternating rounds, peak
memory, machine facts, the bytes floor of a DP step, CSV output.

One clock (:func:`time_call`): CUDA events on a GPU, ``time.perf_counter`` between two
device synchronisations elsewhere. :func:`time_alternating` times several candidates in
rounds, the order rotated every round, so that a slow phase of a shared machine hits
every candidate alike; :func:`median_seconds` is the one-candidate form.

Imports nothing from the rest of ``bench`` (``bench/gpu_check.py`` uses it as a plain
module on a GPU machine).
"""

from __future__ import annotations

import csv
import ctypes
import datetime as _dt
import gc
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

import dpkern
from dpkern import backends

PATHS = ("noise", "summed", "per_sample")  # the three step paths a bytes floor exists for
BYTES_F32 = 4
KEY = 0x5EED_0F_D9_6E12  # a fixed research seed: the benchmark measures, it trains nothing
LR, WEIGHT_DECAY = 1e-3, 1e-2
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Candidate:
    """Something timed in a case. ``role``: "dpkern", "baseline" or "floor";
    ``variant``: the dpkern backend, or "foreach"/"fused" for torch.optim.AdamW.
    ``prepare`` runs untimed before every ``run`` (e.g. re-attaching grad_sample)."""

    role: str
    variant: str
    run: Callable[[], object]
    prepare: Callable[[], object] = field(default=lambda: None)

    @property
    def name(self) -> str:
        return f"{self.role}:{self.variant}"


def bytes_floor(path: str, d: int, batch: int, grad_bytes: int = BYTES_F32) -> int:
    """Bytes a step must move at least (the fused step's passes over memory): per-sample 2 B d sizeof(grad)
    (read twice: norms, then clipped sum) + 24 d (read and write p, m, v in fp32); summed
    28 d (plus reading the summed gradient); noise 4 d (writing the output)."""
    if path == "per_sample":
        return 2 * batch * d * grad_bytes + 24 * d
    if path == "summed":
        return 28 * d
    if path == "noise":
        return 4 * d
    raise ValueError(f"invalid path {path!r}: expected one of {PATHS}")


def synchronize(device) -> None:
    """Wait for queued kernels on ``device`` (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device) -> float:
    """Seconds of one call of ``fn`` on ``device``: CUDA events around it on a GPU (queued
    work synchronised first), ``time.perf_counter`` between two synchronisations
    elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_seconds(fn: Callable[[], object], device, reps: int, warmup: int = 1) -> float:
    """Median of ``reps`` :func:`time_call` timings of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(time_call(fn, device) for _ in range(max(1, reps)))


def time_alternating(
    cands: list[Candidate], repeats: int, device, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds of each candidate's ``run`` over ``repeats`` rounds, one call of each per
    round, the order rotated by one every round; ``warmup`` untimed rounds first (they
    also create lazily-allocated optimizer states)."""
    times = {c.name: [] for c in cands}
    with torch.no_grad():
        for _ in range(warmup):
            for c in cands:
                c.prepare()
                c.run()
        for r in range(repeats):
            k = r % len(cands)
            for c in cands[k:] + cands[:k]:
                c.prepare()
                times[c.name].append(time_call(c.run, device))
    return times


# -- memory ---------------------------------------------------------------------------
def _proc_kib(path: str, key: str) -> int | None:
    """A "Key:  <n> kB" field of a /proc file (e.g. VmRSS of /proc/self/status), or None."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def meminfo_kib(key: str) -> int | None:
    return _proc_kib("/proc/meminfo", key)


def pin_malloc_threshold(nbytes: int = 64 << 10) -> bool:
    """Make glibc return every freed block >= ``nbytes`` to the OS (mmap threshold and trim
    threshold pinned; cached free memory released), so a peak-RSS delta sees every
    temporary. Slows later allocations (fresh pages each time): call it only after all
    timings. False if not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(-3, nbytes)) and bool(libc.mallopt(-1, nbytes))  # M_MMAP_/M_TRIM_
    except (OSError, AttributeError):
        return False
    release_free_memory()
    return ok


def release_free_memory() -> None:
    """Hand glibc's cached free heap memory back to the OS (``malloc_trim(0)``), so that
    reusing it page-faults again and shows in the peak RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_extra_bytes(cand: Candidate, device) -> int | None:
    """Peak memory one ``run`` of a warmed-up candidate adds on top of what exists before
    it (inputs, parameters, states). None where it cannot be measured."""
    device = torch.device(device)
    with torch.no_grad():
        cand.prepare()
        if device.type == "cuda":
            synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            cand.run()
            synchronize(device)
            return torch.cuda.max_memory_allocated(device) - before
        gc.collect()
        release_free_memory()
        before = _proc_kib("/proc/self/status", "VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
        except OSError:
            return None
        cand.run()
        peak = _proc_kib("/proc/self/status", "VmHWM")
    if before is None or peak is None:
        return None
    return max(0, peak - before) * 1024


# -- the machine --------------------------------------------------------------------------


def _sysfs_bytes(text: str) -> int:
    """A sysfs cache size ("32768K", "8M", "512") in bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def last_level_cache_bytes() -> int | None:
    """Size of the largest CPU cache level from sysfs (None if unknown)."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    best = None
    for idx in sorted(base.glob("index*")):
        try:
            level = int((idx / "level").read_text())
            size = _sysfs_bytes((idx / "size").read_text())
        except (OSError, ValueError):
            continue
        if best is None or level >= best[0]:
            best = (level, size)
    return best[1] if best else None


def copy_bandwidth(device, *, nbytes: int | None = None, repeats: int = 5) -> dict:
    """Measured copy bandwidth (``dst.copy_(src)``, bytes read + bytes written per second)
    on buffers larger than the last-level cache (CPU: 2 x LLC, at least 256 MiB, at most a
    quarter of free memory; CUDA: 1 GiB). Returns {"bytes_per_s", "buffer_bytes"}."""
    device = torch.device(device)
    if nbytes is None:
        if device.type == "cuda":
            nbytes = 1 << 30
        else:
            nbytes = max(2 * (last_level_cache_bytes() or 0), 256 << 20)
            avail = meminfo_kib("MemAvailable")
            if avail:
                nbytes = min(nbytes, avail * 1024 // 4)
    n = nbytes // BYTES_F32
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, repeats, warmup=0)
    return {
        "bytes_per_s": 2 * n * BYTES_F32 / seconds,
        "buffer_bytes": n * BYTES_F32,
    }


def set_threads(n: int) -> None:
    """Use ``n`` CPU threads in torch and in the cpp backend (if built)."""
    torch.set_num_threads(n)
    if backends.is_available("cpp"):
        backends.resolve("cpp", "cpu").set_num_threads(n)


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (zeros where the OS has none)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else [0.0] * 3


def cpu_ticks() -> tuple[int, int] | None:
    """``(steal, total)``: clock ticks of all CPUs since boot from ``/proc/stat`` (None
    where there is none). Steal is time the hypervisor ran something else while this
    virtual machine had work (the ``steal`` field of the ``cpu`` line)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return ticks[7], sum(ticks)


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Share of the CPU time between two :func:`cpu_ticks` readings that was stolen by the
    hypervisor (0..1; None without both readings or with no tick between them). A run
    with more than a few percent stolen is slowed unevenly: its ratios move."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def steal_note(share: float | None) -> str:
    """``"CPU steal 3.1%"`` (with a warning above 5%: timings are unreliable), or
    ``"CPU steal unknown"``."""
    if share is None:
        return "CPU steal unknown"
    note = f"CPU steal {100 * share:.1f}%"
    if share > 0.05:
        note += " (WARNING: the hypervisor took CPU time from this run; ratios are unreliable)"
    return note


def machine_info(device) -> dict:
    """CPU model, cores, threads, LLC, RAM, GPU, library versions, git commit, UTC date."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "llc_bytes": last_level_cache_bytes(),
        "ram_bytes": (meminfo_kib("MemTotal") or 0) * 1024,
        "device": str(device),
        "platform": platform.platform(terse=True),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg": load_average(),
        "dpkern": dpkern.__version__,
    }
    if backends.is_available("cpp"):
        info["cpp_threads"] = backends.resolve("cpp", "cpu").get_num_threads()
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    for mod in ("triton", "opacus", "numpy"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    try:
        root = Path(__file__).resolve().parent.parent
        info["git_commit"] = (
            subprocess.run(
                ["git", "describe", "--always", "--dirty"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = None
    return info


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
