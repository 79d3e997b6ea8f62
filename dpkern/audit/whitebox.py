"""White-box gradient canaries through the real training paths (one run each).

The audited model is small but real: two ``nn.Linear`` layers (with biases) trained on
random regression data, and between them in parameter order a bias-free
``nn.Linear(d, 1)`` whose input is zero for every real sample. Canary j is a sample
whose input to that layer is c * e_j and whose regression loss is masked out, so its
per-sample gradient is the Dirac c * e_j on coordinate j of the canary weight (norm
c > C: clipped to exactly C) and zero elsewhere; real samples never touch the canary
weight. Coordinates m..d-1 of the canary weight carry no canary ("free" coordinates):
only noise, for the calibration check.

Each canary is in the data set by a fair coin and, when in, Poisson-sampled at rate q at
every step like every other sample: the mechanism is exactly the one the accountant
analyses (Poisson-subsampled Gaussian, add/remove one sample), so its claimed epsilon
applies to every canary. The gradients take the path of the user's configuration:

- ``step``: per-sample gradients (dpkern.grad_sample, torch.func) of the whole logical
  batch, then ``optimizer.step()``;
- ``accumulate``: micro-batches, ``optimizer.accumulate()`` each, then ``step()``;
- ``ghost``: :class:`dpkern.ghost.GhostClipping` per micro-batch, then ``step()``;
- ``ddp``: ``nproc`` gloo processes (torch.multiprocessing, spawn), each Poisson-sampling
  its shard (:class:`dpkern.distributed.DistributedPoissonSampler`) and clipping by
  per-sample gradients or ghost clipping, :class:`~dpkern.distributed.DistributedDPOptimizer`
  all-reducing the clipped sums;
- ``fsdp``: ``nproc`` gloo processes as ``ddp``, the model sharded by FSDP2 (``fully_shard``
  on each layer and the root, before the optimizer is built over the DTensor shards),
  ghost clipping (torch.func cannot trace FSDP2 modules): each rank's book-kept clipped
  sums are reduce-scattered to the shards, and every shard is noised at its global
  indices. Every rank runs one forward and backward per logical batch, its share empty
  or not (FSDP2's all-gathers need every rank); the released canary weight is gathered
  (``full_tensor``) after every step.

What the auditor keeps is the released trajectory of the canary weight (every iterate,
as DP-SGD's analysis releases every iterate); the scores are computed from it alone."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from . import _faults

PATHS = ("step", "accumulate", "ghost", "ddp", "fsdp")
#: the paths that run in ``nproc`` gloo processes
PROCESS_PATHS = ("ddp", "fsdp")
CLIPPINGS = ("per-sample", "ghost")
D_IN, HIDDEN = 8, 16


@dataclass(frozen=True)
class WhiteBoxRun:
    """One white-box run (picklable: the data-parallel workers receive it).

    ``path``: one of :data:`PATHS`; ``clipping``: what the ddp path clips with (fsdp:
    ghost only);
    ``canaries`` (m) and ``free`` coordinates of the canary weight; ``canary_norm``: the
    canary gradient's norm in units of C (> 1); ``n_real``: real samples;
    ``micro_batch_size``: for accumulate / ghost / ddp; ``data_seed``: the real data and
    the model's init; ``sampler_seed``: None (secret, os.urandom) or an int;
    ``fault``: filled in from :mod:`._faults` when the run starts; ``device``: of the
    single-process paths (ddp runs on CPU, gloo)."""

    path: str
    sample_rate: float
    steps: int
    canaries: int
    free: int = 0
    canary_norm: float = 10.0
    n_real: int = 256
    micro_batch_size: int = 64
    clipping: str = "per-sample"
    nproc: int = 2
    data_seed: int = 0
    sampler_seed: int | None = None
    fault: str | None = None
    device: str = "cpu"

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"invalid path={self.path!r}: expected one of {PATHS}")
        if self.clipping not in CLIPPINGS:
            raise ValueError(f"invalid clipping={self.clipping!r}: expected one of {CLIPPINGS}")
        if not 0.0 < self.sample_rate <= 1.0:
            raise ValueError(f"invalid sample_rate={self.sample_rate!r}: must be in (0, 1]")
        for name, low in (("steps", 1), ("canaries", 1), ("free", 0), ("n_real", 0)):
            if int(getattr(self, name)) < low:
                raise ValueError(f"invalid {name}={getattr(self, name)!r}: must be >= {low}")
        if self.path == "fsdp" and self.clipping != "ghost":
            raise ValueError(
                "the fsdp path clips with ghost clipping only (torch.func cannot trace "
                "FSDP2 modules): pass clipping='ghost'"
            )
        if self.micro_batch_size < 1 or self.nproc < 1:
            raise ValueError("micro_batch_size and nproc must be >= 1")
        if not self.canary_norm > 1.0:
            raise ValueError(f"invalid canary_norm={self.canary_norm!r}: must be > 1 (x C)")


class CanaryModel(nn.Module):
    """Per-sample losses ``w * (out(tanh(inp(x))) - y)^2 + canary(xc)``: the canary
    weight sits between the two real layers in parameter (noise index) order."""

    def __init__(self, d_canary: int):
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.canary = nn.Linear(d_canary, 1, bias=False)
        self.out = nn.Linear(HIDDEN, 1)
        nn.init.zeros_(self.canary.weight)

    def forward(self, x, xc, w, y):
        real = (self.out(torch.tanh(self.inp(x))).squeeze(-1) - y) ** 2
        return w * real + self.canary(xc).squeeze(-1)


def _sum_loss(out):
    return out.sum()


class Data:
    """The data set of one run: ``n_real`` real samples, then the included canaries."""

    def __init__(self, run: WhiteBoxRun, included: np.ndarray, c: float):
        gen = torch.Generator().manual_seed(run.data_seed)
        self.x = torch.randn(run.n_real, D_IN, generator=gen)
        self.y = torch.sin(self.x @ torch.randn(D_IN, generator=gen)) + 0.1 * torch.randn(
            run.n_real, generator=gen
        )
        self.canary_of = torch.as_tensor(np.flatnonzero(included), dtype=torch.long)
        self.n_real, self.c = run.n_real, float(c)
        self.d = run.canaries + run.free

    def __len__(self) -> int:
        return self.n_real + int(self.canary_of.numel())

    def batch(self, idx, device="cpu"):
        idx = torch.as_tensor(idx, dtype=torch.long)
        real = idx < self.n_real
        B = int(idx.numel())
        x = torch.zeros(B, D_IN)
        y = torch.zeros(B)
        x[real], y[real] = self.x[idx[real]], self.y[idx[real]]
        xc = torch.zeros(B, self.d)
        rows = (~real).nonzero().flatten()
        xc[rows, self.canary_of[idx[~real] - self.n_real]] = self.c
        return tuple(t.to(device) for t in (x, xc, real.float(), y))


def _chunks(batch, size: int):
    B = batch[0].shape[0]
    return [tuple(t[i : i + size] for t in batch) for i in range(0, B, size)] or [batch]


def _train(model, optimizer, data: Data, sampler, run: WhiteBoxRun, clipping: str, record):
    """The training loop of one path; ``record(t)`` after every step."""
    device = next(model.parameters()).device
    from ..grad_sample import compute_grad_sample

    gc = None
    if clipping == "ghost":
        from ..ghost import GhostClipping

        # (FSDP2: the first-step check cannot run on shards; the same canary model is
        # checked unsharded by the ghost path)
        verify = "off" if run.path == "fsdp" else "first"
        gc = GhostClipping(model, optimizer, verify=verify).attach()
    try:
        for t, idx in enumerate(sampler, start=1):
            batch = data.batch(idx, device)
            if run.path == "step":
                compute_grad_sample(model, _sum_loss, batch)
                optimizer.step()
            elif run.path == "fsdp":  # (every rank: one forward and backward, B = 0 too)
                gc.backward(model(*batch))
                optimizer.step()
            else:
                for chunk in _chunks(batch, run.micro_batch_size):
                    if gc is None:
                        compute_grad_sample(model, _sum_loss, chunk)
                        optimizer.accumulate()
                    elif chunk[0].shape[0] == 0:
                        gc.add_empty_batch()
                    else:
                        gc.backward(model(*chunk))
                optimizer.step()
            record(t)
    finally:
        if gc is not None:
            gc.detach()


def _setup(make_optimizer, run: WhiteBoxRun, included: np.ndarray, device="cpu", shard=None):
    torch.manual_seed(run.data_seed)
    model = CanaryModel(run.canaries + run.free).to(device)
    if shard is not None:  # (FSDP2 replaces the parameters: before the optimizer)
        shard(model)
    optimizer = make_optimizer(list(model.parameters()))
    C = float(getattr(optimizer, "max_grad_norm", 1.0))
    _faults.apply(optimizer, run.fault)
    return model, optimizer, Data(run, included, run.canary_norm * C)


def run_canaries(make_optimizer, run: WhiteBoxRun, included: np.ndarray) -> torch.Tensor:
    """Train once with canary j in the data iff ``included[j]``; return the canary
    weight's released trajectory, float32 [steps + 1, canaries + free].

    ``make_optimizer(params) -> optimizer``: builds the dpkern optimizer under audit over
    the model's parameters (for ``ddp``: picklable, e.g. a module-level function or a
    ``functools.partial``; it runs in every worker). The fault of :mod:`._faults` in
    force, if any, is applied to it."""
    run = replace(run, fault=_faults.active if run.fault is None else run.fault)
    included = np.asarray(included, dtype=bool)
    if included.shape != (run.canaries,):
        raise ValueError(f"included: expected shape ({run.canaries},), got {included.shape}")
    if run.path in PROCESS_PATHS:
        return _spawn(make_optimizer, run, included)
    from ..sampling import PoissonBatchSampler

    model, optimizer, data = _setup(make_optimizer, run, included, run.device)
    sampler = PoissonBatchSampler(len(data), run.sample_rate, run.steps, seed=run.sampler_seed)
    clipping = {"step": "per-sample", "accumulate": "per-sample", "ghost": "ghost"}[run.path]
    traj = torch.zeros(run.steps + 1, run.canaries + run.free)
    w = model.canary.weight

    def record(t):
        traj[t] = w.detach()[0].cpu()

    _train(model, optimizer, data, sampler, run, clipping, record)
    return traj


def _spawn(make_optimizer, run: WhiteBoxRun, included: np.ndarray) -> torch.Tensor:
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    from ..distributed.processes import finished_before_dying

    with tempfile.TemporaryDirectory(prefix="dpkern-audit-") as tmp:
        try:
            mp.start_processes(
                _worker,
                args=(run.nproc, tmp, make_optimizer, run, included),
                nprocs=run.nproc,
                join=True,
                start_method="spawn",
            )
        except ProcessException as exc:  # (killed at exit after finishing: the run is whole)
            if not finished_before_dying(exc, tmp, run.nproc):
                raise
        return torch.load(Path(tmp, "trajectory.pt"))


def _worker(rank: int, world: int, tmp: str, make_optimizer, run: WhiteBoxRun, included):
    import torch.distributed as dist

    from ..distributed import DistributedDPOptimizer, DistributedPoissonSampler
    from ..distributed.processes import end_worker, mark_finished

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(tmp, 'rendezvous')}",
        rank=rank,
        world_size=world,
    )
    try:
        shard = _fsdp_shard(world) if run.path == "fsdp" else None
        model, optimizer, data = _setup(make_optimizer, run, included, shard=shard)
        optimizer = DistributedDPOptimizer(optimizer)  # broadcasts rank 0's key
        seed = run.sampler_seed
        sampler = DistributedPoissonSampler(
            len(data), run.sample_rate, run.steps, rank=rank, num_replicas=world, seed=seed
        )
        traj = torch.zeros(run.steps + 1, run.canaries + run.free)
        w = model.canary.weight

        def record(t):  # (fsdp: a collective, every rank gathers the canary weight)
            traj[t] = (w.full_tensor() if shard is not None else w).detach()[0]

        inner = run if run.path == "fsdp" else replace(run, path="accumulate")
        _train(model, optimizer, data, sampler, inner, run.clipping, record)
        if rank == 0:
            torch.save(traj, Path(tmp, "trajectory.pt"))
        mark_finished(tmp, rank)
    finally:
        dist.destroy_process_group()
    end_worker()  # (past gloo's occasional abort at interpreter exit)


def _fsdp_shard(world: int):
    """``shard(model)``: FSDP2 ``fully_shard`` on each layer of the canary model and on
    the root, over a CPU mesh of ``world`` ranks; the units reduce with SUM (gloo has no
    PREMUL_SUM; the clipped sums are sums, not means)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def shard(model):
        mesh = init_device_mesh("cpu", (world,))
        units = (model.inp, model.canary, model.out)
        for m in units:
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for m in (model, *units):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)

    return shard
