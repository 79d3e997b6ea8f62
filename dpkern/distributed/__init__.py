"""Data-parallel DP training on torch.distributed (DDP, FSDP2), each step a single process's.

The noise stream (SPEC section 3) is a pure function of (key, step, global element index),
so data-parallel ranks need to exchange no noise: each rank clips and sums its own samples
(per-sample gradients or ghost clipping), the clipped sums are all-reduced with SUM once per
logical step, and every rank then runs the same fused noise + update with the same key, the
same step and the GLOBAL expected batch size. The result on every rank is, up to the float
summation order, the step a single process would take on the union of the ranks' batches:

    S_p = sum_r S_p^(r)              (all-reduce, SUM; S^(r) = rank r's clipped sum)
    g_p = (S_p + sigma C z_p) / B_e  (z_p: the same noise slice on every rank)

Pieces (usable alone or through :class:`DistributedDPOptimizer`):

- :func:`sync_key`: at construction, rank 0's secret key (``os.urandom``) is broadcast over
  the process group, then every rank checks that keys, steps and the optimizer
  configuration agree (by fingerprints: the key itself is never compared in the open).
- :func:`verify_lockstep`: that check alone (one small all-gather); it runs before every
  step by default, so a rank that resumed with a different key or step is caught.
- :func:`all_reduce_clipped_sums`: SUM over ranks of ``optimizer.clipped_sum_buffers()``.
- :class:`DistributedPoissonSampler`: each rank Poisson-samples its own shard of the
  dataset with the global rate q, so the union over ranks is Poisson(q) over the whole
  dataset; every rank yields every step (empty local batches included), so collectives
  never desync. Feed the accountant ``sample_rate`` (the global q) and give the optimizer
  ``expected_batch_size = q * N`` (the global one).

DDP: wrap the model in ``DistributedDataParallel`` as usual (it broadcasts rank 0's
parameters at construction) and call :func:`disable_gradient_allreduce` on it: DDP's own
all-reduce of the raw, unclipped ``.grad`` is useless for DP training (the optimizer reads
``grad_sample``), so it is replaced by a no-op communication hook. Works with gloo (CPU)
and NCCL (GPU) alike: collectives run on the parameters' device.

A complete training script: ``examples/ddp_train.py`` (``torchrun --standalone
--nproc_per_node=N examples/ddp_train.py``; the test suite runs it on 2 gloo ranks).

(With a ``DataLoader(dataset, batch_sampler=sampler)``, give it a ``collate_fn`` that
accepts an empty list: the default one fails on an empty local batch.)

Checkpoints: save ``opt.state_dict()`` on rank 0; every rank calls ``opt.load_state_dict``
(secure mode: rank 0 draws a fresh key and broadcasts it).

FSDP2 (``fully_shard``): give the optimizer classes the sharded model's parameters
(DTensors, Shard(0) on a 1-D mesh; every trainable parameter, so apply ``fully_shard`` to
the root too) and wrap them in :class:`DistributedDPOptimizer` as above. Each rank then
keeps optimizer state for its shard only and draws the noise of exactly its shard, at the
shard's GLOBAL element indices (:mod:`dpkern.sharding`; padding consumes no index), so
gathering the shards gives the single-process step -- no noise is communicated. The
clipped sum reaches each shard one of two ways:

- ghost clipping (DP-SGD, Adam, AdamW and their BC variants):
  ``GhostClipping(model, opt)`` with ``opt`` the wrapper; each micro-batch's book-kept
  full-shape clipped sums are reduce-scattered to the shards
  (:func:`reduce_scatter_clipped_sums`). Every rank runs forward and ``gc.backward``,
  empty local batch or not (FSDP's all-gathers are collectives): a model that cannot run
  on B = 0 runs on a placeholder sample, followed by ``gc.backward(losses[:0])``
  (``gc.add_empty_batch()`` is refused there).
- or FSDP's own reduce-scatter: back-propagate ``sum_i c_i * loss_i`` with this rank's
  clip factors c_i; it SUMs the ranks' clipped sums into each shard's ``p.grad`` (set
  ``set_gradient_divide_factor(1.0)`` on every FSDP unit, and under gloo, which lacks
  PREMUL_SUM, ``set_force_sum_reduction_for_comms(True)``); then
  ``opt.accumulate_clipped([p.grad for p in params], batch_size)`` and ``opt.step()``.
- per-sample (every rule, and the only one for DP-MacAdam, whose clipping whitens each
  coordinate with state held by the shard's owner): per-sample gradients of the local
  samples come from an unsharded replica of the model (refreshed from ``p.full_tensor()``
  each step; torch.func cannot trace an FSDP2 module), :func:`shard_grad_samples` sends
  each rank its columns of every rank's per-sample gradients; ``opt.step()`` clips each shard
  with the per-sample norms all-reduced over the mesh ([B] floats) and, for DP-MacAdam,
  all-reduces the global sum_j sqrt(S_hat_j) that sets b (SPEC section 7).

The wrapper skips its all-reduce for sharded parameters (the sums are already global).
``state_dict()`` holds this rank's shards: every rank saves and loads its own. After a
``torch.no_grad()`` forward (evaluation) FSDP2's root module keeps its parameters
unsharded until the next forward/backward: call ``model.reshard()`` before reading
``p.full_tensor()`` (:class:`dpkern.ghost.GhostClipping` reshards at construction).

Modules: lockstep.py (the key, step and configuration checks; failures raised on every
rank), optimizer.py (:class:`DistributedDPOptimizer` and the all-reduce), sampler.py
(:class:`DistributedPoissonSampler`), fsdp.py (the FSDP2 exchanges).
"""

from __future__ import annotations

from ..keys import key_fingerprint
from ..sharding import shard_offsets
from .fsdp import reduce_scatter_clipped_sums, shard_grad_samples
from .lockstep import DistributedDPError, broadcast_key, sync_key, verify_lockstep
from .optimizer import (
    DistributedDPOptimizer,
    all_reduce_clipped_sums,
    disable_gradient_allreduce,
)
from .sampler import DistributedPoissonSampler

__all__ = [
    "DistributedDPError",
    "DistributedDPOptimizer",
    "DistributedPoissonSampler",
    "all_reduce_clipped_sums",
    "broadcast_key",
    "disable_gradient_allreduce",
    "key_fingerprint",
    "reduce_scatter_clipped_sums",
    "shard_grad_samples",
    "shard_offsets",
    "sync_key",
    "verify_lockstep",
]
