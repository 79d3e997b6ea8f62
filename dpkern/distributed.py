"""Data-parallel DP training on torch.distributed (DDP, FSDP2), every step equal to one process's.

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

A complete training script (``torchrun --standalone --nproc_per_node=N train.py``; it runs
as written, ``tests/test_distributed.py`` runs it on 2 gloo ranks)::

    # train.py
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import dpkern
    from dpkern.accounting import PrivacyAccountant
    from dpkern.distributed import (DistributedDPOptimizer, DistributedPoissonSampler,
                                    disable_gradient_allreduce)
    from dpkern.grad_sample import compute_grad_sample

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)              # the same data set on every rank
    X = torch.randn(2000, 20, generator=gen)
    Y = (X[:, 0] + X[:, 1] > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 2)).to(device)
    ddp = DistributedDataParallel(model)                # broadcasts rank 0's parameters
    disable_gradient_allreduce(ddp)
    sample_rate, steps, sigma = 0.05, 60, 1.0
    sampler = DistributedPoissonSampler(len(X), sample_rate, steps)
    opt = DistributedDPOptimizer(dpkern.DPAdamW(
        model.parameters(), lr=1e-2, max_grad_norm=1.0, noise_multiplier=sigma,
        expected_batch_size=sampler.expected_batch_size))  # the GLOBAL q * N
    accountant = PrivacyAccountant()
    for indices in sampler:                             # this rank's samples; may be empty
        if indices:                                     # per-sample gradients, local samples
            compute_grad_sample(model, F.cross_entropy, X[indices].to(device),
                                Y[indices].to(device))
        opt.step()                                      # every rank, every step
        opt.zero_grad()
        accountant.step(noise_multiplier=sigma, sample_rate=sample_rate)
    with torch.no_grad():
        accuracy = (model(X.to(device)).argmax(1) == Y.to(device)).float().mean()
    if rank == 0:
        print(f"epsilon = {accountant.get_epsilon(1e-5):.2f}, accuracy = {accuracy:.2f}")
    dist.destroy_process_group()

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
"""

from __future__ import annotations

import hashlib
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .keys import NoiseKey, as_key, key_fingerprint, reveal, secure_key
from .optim import DPOptimizer
from .sampling import PoissonBatchSampler
from .sharding import chunk_rows, common_mesh, is_sharded, local_shard, row_numel, shard_offsets

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

_BUCKET_NUMEL = 1 << 24  # 64 MiB of fp32 per all-reduce bucket
# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn)
_all_gather_single = getattr(dist, "all_gather_single", None) or getattr(
    dist, "all_gather_into_tensor", None
)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or getattr(
    dist, "reduce_scatter_tensor", None
)


class DistributedDPError(RuntimeError):
    """Ranks disagree (noise key, step, optimizer configuration) or one rank failed.

    Raised on EVERY rank of the group at the same collective, so none is left waiting."""


def _fingerprint(data: bytes, key: bytes = b"") -> int:
    digest = hashlib.blake2b(data, key=key, digest_size=8, person=b"dpkern-ddp-v1").digest()
    return int.from_bytes(digest, "little", signed=True)


def _describe(optimizer: DPOptimizer) -> dict:
    """Non-secret configuration that must be identical on every rank."""
    params = optimizer.trainable_params()
    return {
        "class": type(optimizer).__name__,
        "shapes": [tuple(p.shape) for p in params],
        "max_grad_norm": optimizer.max_grad_norm,
        "noise_multiplier": optimizer.noise_multiplier,
        "expected_batch_size": optimizer.expected_batch_size,
        "hyper": [repr(optimizer._hyper(g)) for g in optimizer.param_groups],
    }


def _device(optimizer: DPOptimizer) -> torch.device:
    params = optimizer.trainable_params()
    if not params:
        raise ValueError("the optimizer owns no trainable parameter")
    return params[0].device


# columns of the lockstep check: ok flag, secure flag, configuration, step, key, and
# whether the rank holds per-sample gradients (must agree for sharded parameters only)
_OK, _SECURE, _CONFIG, _STEP, _KEY, _PER_SAMPLE = range(6)
_WHAT = {
    _SECURE: "secure mode (seed=None) vs seed=",
    _CONFIG: "optimizer configuration",
    _STEP: "DP step counters",
    _KEY: "noise keys",
    _PER_SAMPLE: "per-sample gradients present (sharded: every rank or none)",
}


def _gather_checks(
    optimizer: DPOptimizer, group, ok: bool = True, per_sample: bool = False
) -> Tensor:
    row = torch.tensor(
        [
            int(ok),
            int(optimizer.secure),
            _fingerprint(repr(_describe(optimizer)).encode()),
            optimizer.dp_step,
            optimizer.key_fingerprint(),
            int(per_sample),
        ],
        dtype=torch.int64,
        device=_device(optimizer),
    )
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    return torch.stack(rows).cpu()


def _ranks_by_value(column: Tensor) -> str:
    groups: dict[int, list[int]] = {}
    for rank, v in enumerate(column.tolist()):
        groups.setdefault(v, []).append(rank)
    return " vs ".join(f"ranks {r}" for r in groups.values())


def _raise_on_mismatch(optimizer: DPOptimizer, table: Tensor, group, columns) -> None:
    """Same table on every rank -> every rank raises the same error (no rank left hanging)."""
    bad = [c for c in columns if (table[:, c] != table[0, c]).any()]
    if not bad:
        return
    parts = []
    for c in bad:
        detail = ""
        if c == _STEP:
            detail = f" (steps {table[:, c].tolist()})"
        elif c == _CONFIG:  # every rank is here: one more collective is safe
            descs = [None] * dist.get_world_size(group)
            dist.all_gather_object(descs, _describe(optimizer), group=group)
            fields = sorted(k for k in descs[0] if any(d[k] != descs[0][k] for d in descs))
            detail = f" (differing: {', '.join(fields)})"
        parts.append(f"{_WHAT[c]} differ across ranks: {_ranks_by_value(table[:, c])}{detail}")
    hint = (
        " -- call dpkern.distributed.sync_key(optimizer) after constructing or "
        "loading the optimizer on every rank"
        if _KEY in bad or _STEP in bad
        else ""
    )
    raise DistributedDPError("; ".join(parts) + hint)


def verify_lockstep(optimizer: DPOptimizer, group=None) -> None:
    """Check that every rank has the same noise key, DP step and optimizer configuration.

    One all-gather of 6 int64 per rank (a collective: every rank of ``group`` must call it).
    The key is compared by :func:`key_fingerprint`, never sent.

    Raises:
        DistributedDPError: on every rank, naming what differs and which ranks hold which
            value (steps are shown, keys never).
    """
    _raise_on_mismatch(
        optimizer, _gather_checks(optimizer, group), group, (_SECURE, _CONFIG, _STEP, _KEY)
    )


def sync_key(optimizer: DPOptimizer, group=None) -> None:
    """Give every rank the same noise key and check that the ranks agree (a collective).

    Secure mode (``seed=None`` on every rank): rank 0 of ``group`` draws a fresh key from
    ``os.urandom`` and broadcasts it; every rank adopts it (their own keys are discarded). Reproducible mode (``seed=`` on every rank): nothing is sent;
    the seeds must already agree. Then :func:`verify_lockstep`. Call it after constructing
    the optimizer and after every ``load_state_dict`` (which draws a fresh secure key).

    Raises:
        DistributedDPError: on every rank, if the ranks mix secure and seeded mode, or their
            configuration, steps or (seeded) keys differ.
    """
    table = _gather_checks(optimizer, group)
    _raise_on_mismatch(optimizer, table, group, (_SECURE, _CONFIG, _STEP))
    if optimizer.secure:
        optimizer._adopt_key(broadcast_key(None, group, _device(optimizer)))
    verify_lockstep(optimizer, group)


def broadcast_key(key=None, group=None, device=None) -> NoiseKey:
    """Rank 0's 64-bit noise key, on every rank of ``group`` (a collective).

    Args:
        key: this rank's candidate (only rank 0's is used); None = draw from os.urandom.
        device: where the 8-byte tensor travels (the parameters' device: CPU for gloo,
            CUDA for NCCL); default CPU.
    Returns: the key, a :class:`dpkern.keys.NoiseKey` (never printed)."""
    key = secure_key() if key is None else as_key(key)
    buf = torch.tensor(
        list(reveal(key).to_bytes(8, "little")),
        dtype=torch.uint8,
        device=device if device is not None else "cpu",
    )
    dist.broadcast(buf, group=group, group_src=0)
    return NoiseKey(int.from_bytes(bytes(buf.cpu().tolist()), "little"))


def all_reduce_clipped_sums(
    optimizer: DPOptimizer, group=None, bucket_numel: int = _BUCKET_NUMEL
) -> None:
    """Sum ``optimizer.clipped_sum_buffers()`` over the ranks of ``group``, in place.

    The buffers (fp32, one per trainable parameter, zeros where a rank had no sample) are
    flattened into buckets of at most ``bucket_numel`` elements (a single larger tensor
    gets its own) and all-reduced with SUM, so afterwards every rank holds the clipped sum
    over the global batch. A collective: every rank must call it once per logical step.
    No noise is involved (each rank adds the identical noise locally in ``step()``)."""
    bucket: list[Tensor] = []

    def flush():
        if bucket:
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            pos = 0
            for b in bucket:
                b.copy_(flat[pos : pos + b.numel()].view_as(b))
                pos += b.numel()
            bucket.clear()

    size = 0
    for buf in optimizer.clipped_sum_buffers():
        if size + buf.numel() > bucket_numel:
            flush()
            size = 0
        bucket.append(buf)
        size += buf.numel()
    flush()


def disable_gradient_allreduce(ddp_model) -> None:
    """Replace DDP's all-reduce of ``.grad`` by a no-op hook (PyTorch's ``noop_hook``).

    DP training reads ``grad_sample`` (per-sample gradients) and all-reduces the clipped
    sums itself (:func:`all_reduce_clipped_sums`); DDP's average of the raw gradients would
    only cost bandwidth. Call once, right after wrapping the model."""
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

    ddp_model.register_comm_hook(None, noop_hook)


class DistributedDPOptimizer:
    """A DP optimizer (:mod:`dpkern.optim`) stepping in lockstep over a process group.

    Every rank wraps its own optimizer over its own replica of the model::

        opt = DistributedDPOptimizer(DPAdamW(model.parameters(), lr=1e-3,
                                             max_grad_norm=1.0, noise_multiplier=1.1,
                                             expected_batch_size=q * N))   # GLOBAL B_e
        for batch in loader:                    # DistributedPoissonSampler: may be empty
            compute per-sample gradients of the LOCAL batch (or none if it is empty)
            opt.step()                          # every rank, every step
            opt.zero_grad()

    ``step()`` = local ``accumulate()`` (if this rank has ``grad_sample``), lockstep check
    (:func:`verify_lockstep`, which also tells every rank whether another one failed),
    all-reduce of the clipped sums, then the inner ``step()``: noise from the shared key
    and step, normalised by the global ``expected_batch_size``. Micro-batches: call
    ``accumulate()`` after each but the last (local, no communication).

    Sharded (FSDP2 DTensor) parameters: no all-reduce (the sums reach the shards by
    reduce-scatter, see the module docstring); per-sample inputs are validated on every
    rank before the per-sample norms are all-reduced, so a bad input raises on every rank.

    Construction runs :func:`sync_key` (a collective). Other attributes (``param_groups``,
    ``state``, ``stats`` -- local counts --, ``dp_step``, ``noise_multiplier``, ...) are the
    inner optimizer's; give LR schedulers ``opt.optimizer``.

    Args:
        optimizer: a :class:`dpkern.optim.DPOptimizer`, identically configured on every rank.
        group: the process group (None = the default group).
        bucket_numel: elements per all-reduce bucket.
    Raises:
        TypeError: ``optimizer`` is not a DPOptimizer.
        DistributedDPError: ranks disagree (at construction, or at any step: the
            lockstep check, one 48-byte all-gather, runs before each), or a rank failed
            its local clipping in ``step()`` / ``accumulate()`` (it re-raises its own
            error, the others this one); the logical batch is then dropped on every rank
            and parameters and optimizer state are untouched everywhere. Errors raised by
            ``GhostClipping.backward`` are local under DDP (catch them and still call
            ``step()`` on every rank); under FSDP2 they are raised on every rank.
    """

    def __init__(self, optimizer: DPOptimizer, group=None, *, bucket_numel: int = _BUCKET_NUMEL):
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(f"expected a dpkern DPOptimizer, got {type(optimizer).__name__}")
        self.optimizer, self.group = optimizer, group
        self.bucket_numel = int(bucket_numel)
        self.sharded = any(is_sharded(p) for p in optimizer.trainable_params())
        sync_key(optimizer, group)

    def __getattr__(self, name):
        if name == "optimizer":  # not set yet (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def _has_grad_sample(self) -> bool:
        return any(
            getattr(p, "grad_sample", None) is not None for p in self.optimizer.trainable_params()
        )

    def accumulate(self) -> None:
        """Fold this rank's micro-batch into its local clipped sum (no communication).

        Sharded (FSDP2) parameters: a collective (the per-sample norms are all-reduced),
        preceded by a check that every rank's inputs are valid, so a bad input raises on
        every rank instead of leaving the others waiting."""
        if self.sharded:
            error = None
            try:
                self.optimizer._check_inputs()
            except ValueError as exc:
                error = exc
            self._agree(
                error,
                self._has_grad_sample(),
                (_PER_SAMPLE,),
                "have invalid per-sample gradients; nothing was accumulated on any rank",
            )
        self.optimizer.accumulate()

    def _agree(self, error, per_sample: bool, columns, failure: str) -> None:
        """The lockstep all-gather with this rank's outcome: re-raise this rank's
        ``error``, else DistributedDPError if another rank failed (``failure`` says
        what happened) or the ``columns`` of the check differ across ranks."""
        table = _gather_checks(self.optimizer, self.group, ok=error is None, per_sample=per_sample)
        failed = [r for r, ok in enumerate(table[:, _OK].tolist()) if not ok]
        if error is not None:
            raise error
        if failed:
            raise DistributedDPError(f"ranks {failed} {failure}")
        _raise_on_mismatch(self.optimizer, table, self.group, columns)

    def accumulate_clipped(
        self, clipped_sums: Sequence[Tensor | None], batch_size: int = 0
    ) -> None:
        """Add this rank's clipped sums (ghost clipping: pass the wrapper to
        :class:`dpkern.ghost.GhostClipping`); see the inner optimizer.

        DDP: local, summed over ranks at ``step()``. FSDP2: plain full-shape sums are
        reduce-scattered right away (:func:`reduce_scatter_clipped_sums`, a collective:
        every rank calls it, ``None`` entries count as zeros); DTensor sums (FSDP's own
        reduce-scattered ``p.grad``) are already global and are taken as they are."""
        clipped_sums = list(clipped_sums)
        if self.sharded and not any(is_sharded(s) for s in clipped_sums if s is not None):
            clipped_sums = reduce_scatter_clipped_sums(
                self.optimizer.trainable_params(), clipped_sums, self.bucket_numel
            )
        self.optimizer.accumulate_clipped(clipped_sums, batch_size)

    @torch.no_grad()
    def step(self, closure=None):
        """One global DP step (a collective: every rank calls it, empty batch or not).

        Returns the closure's loss (local) or None."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        error = None
        per_sample = self._has_grad_sample()
        if per_sample:
            try:  # sharded: local validation only, the clipping all-reduces norms below
                (self.optimizer._check_inputs if self.sharded else self.optimizer.accumulate)()
            except (ValueError, FloatingPointError) as exc:
                error = exc
        try:
            self._agree(
                error,
                per_sample,
                (_SECURE, _CONFIG, _STEP, _KEY) + ((_PER_SAMPLE,) if self.sharded else ()),
                "failed to clip their local batch; the logical batch was dropped "
                "on every rank, nothing was updated",
            )
            if per_sample and self.sharded:  # every rank: same rows, all-reduced norms,
                self.optimizer.accumulate()  # so a non-finite row fails on every rank
        except Exception:
            for buf in self.optimizer.clipped_sum_buffers():
                buf.zero_()  # drop the logical batch on every rank, consistently
            self.optimizer.zero_grad()
            raise
        if not self.sharded:  # FSDP: the reduce-scatter / shard_grad_samples summed already
            all_reduce_clipped_sums(self.optimizer, self.group, self.bucket_numel)
        self.optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self, full: bool = False) -> dict:
        """The inner optimizer's state_dict. DDP: identical on every rank (save rank
        0's). FSDP2: this rank's shards of the states (every rank saves its own), or with
        ``full=True`` every state gathered to its parameter's full shape (a collective;
        identical on every rank: save rank 0's; the same file a single process writes)."""
        sd = self.optimizer.state_dict()
        if not (full and self.sharded):
            return sd
        from torch.distributed.tensor import DTensor

        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = {}
        for idx, st in sorted(sd["state"].items()):  # the same order on every rank
            p, st = params[idx], dict(st)  # (a copy: sd's dicts are the live state)
            for k, v in sorted(st.items()):
                if isinstance(v, Tensor) and v.dim() > 0 and is_sharded(p):
                    st[k] = DTensor.from_local(
                        v,
                        p.device_mesh,
                        p.placements,
                        run_check=False,
                        shape=p.shape,
                        stride=p.stride(),
                    ).full_tensor()
            state[idx] = st
        return {**sd, "state": state}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load on every rank, then :func:`sync_key` (secure mode: rank 0's fresh key).

        FSDP2: accepts this rank's shards or a full state_dict (``state_dict(full=True)``
        or a single-process checkpoint): full-shape states are cut to this rank's rows.

        Raises: the inner optimizer's error on a rank whose state_dict does not fit, and
        DistributedDPError on the others, which then restore their previous state (all
        ranks keep the old state, and their keys stay in lockstep)."""
        if self.sharded:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            state = {}
            for idx, st in state_dict.get("state", {}).items():
                p, st = params[idx] if 0 <= idx < len(params) else None, dict(st)
                if p is not None and is_sharded(p):
                    mesh = p.device_mesh
                    first, end = chunk_rows(p.shape[0], mesh.size(), mesh.get_local_rank())
                    for k, v in st.items():
                        if isinstance(v, Tensor) and v.dim() > 0 and v.shape == p.shape:
                            st[k] = v[first:end]
                state[idx] = st
            state_dict = {**state_dict, "state": state}
        backup, error = self.optimizer.state_dict(), None
        try:
            self.optimizer.load_state_dict(state_dict)
        except (ValueError, KeyError, TypeError) as exc:
            error = exc
        try:  # every rank loaded, or none keeps the new state (no rank left waiting)
            _raise_if_any_failed(error, self.group, _device(self.optimizer), "load_state_dict")
        except DistributedDPError:
            self.optimizer.load_state_dict(backup)
            raise
        finally:
            sync_key(self.optimizer, self.group)


def _rank_seed(seed: int, rank: int) -> int:
    return _fingerprint(f"{seed}:{rank}".encode()) & (2**63 - 1)


class DistributedPoissonSampler(torch.utils.data.Sampler[list[int]]):
    """Poisson sampling across data-parallel ranks: the union of the ranks' batches
    includes every example independently with probability ``sample_rate`` (q) at each step.

    Rank r owns the shard ``range(r, num_samples, num_replicas)`` and samples it with rate q
    (its own generator: ``os.urandom`` in secure mode, or derived from ``(seed, rank)``).
    Each rank yields exactly ``steps`` lists of GLOBAL dataset indices, empty ones
    included, so every rank takes every step. Accounting: the sampled mechanism is
    Poisson(q) over the whole dataset, so give the accountant ``sample_rate`` (not a
    per-rank rate) and the optimizer ``expected_batch_size`` = q * num_samples.

    Args:
        num_samples: dataset size N (>= 1).
        sample_rate: q in (0, 1].
        steps: number of batches to yield (>= 1).
        num_replicas, rank: default to the process group's world size and rank.
        seed: None (secure) or an int shared by all ranks (reproducible; the ranks' streams
            are still independent).
        group: process group for the defaults.
    Raises:
        ValueError: invalid arguments (as PoissonBatchSampler, plus rank / num_replicas).
    Source: Poisson subsampling as in Abadi et al. 2016; sharding keeps independence.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps: int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int | None = None,
        group=None,
    ):
        if num_replicas is None:
            num_replicas = dist.get_world_size(group)
        if rank is None:
            rank = dist.get_rank(group)
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"invalid num_replicas={num_replicas!r}: expected an int >= 1")
        if not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"invalid rank={rank!r}: expected an int in [0, {num_replicas})")
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"invalid num_samples={num_samples!r}: expected an int >= 1")
        self.num_samples, self.num_replicas, self.rank = num_samples, num_replicas, rank
        self.shard = range(rank, num_samples, num_replicas)
        # a shard may be empty (N < world size): sample a dummy element and drop it
        self._local = PoissonBatchSampler(
            max(len(self.shard), 1),
            sample_rate,
            steps,
            seed=None if seed is None else _rank_seed(seed, rank),
        )
        self.sample_rate, self.steps = self._local.sample_rate, self._local.steps

    @property
    def expected_batch_size(self) -> float:
        """q * N, the GLOBAL expected batch size (the optimizer's normaliser)."""
        return self.sample_rate * self.num_samples

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        n = len(self.shard)
        for batch in self._local:
            yield [self.shard[i] for i in batch if i < n]


# --------------------------------------------------------------------------------------
# FSDP2: per-sample gradients of every rank's samples, on the shard each rank owns
# --------------------------------------------------------------------------------------
def _mesh_group(params: Sequence[Tensor]):
    """The process group of the first DTensor's mesh (None = the default group)."""
    for p in params:
        if is_sharded(p):
            return p.device_mesh.get_group()
    return None


def _check_fsdp_params(params: Sequence[Tensor], what: str) -> None:
    """Every parameter a DTensor in FSDP2's layout, all on one mesh. Raises ValueError."""
    if common_mesh(params, what) is None:
        raise ValueError(
            f"{what}: every parameter must be a DTensor on one device mesh (FSDP2 fully_shard)"
        )
    for k, p in enumerate(params):
        local_shard(p, f"params[{k}]")  # validates the layout


def _raise_if_any_failed(error: Exception | None, group, device, what: str) -> None:
    """One tiny all-gather of "did my local checks pass?" before a collective: a rank whose
    input is bad re-raises its own error, every other rank raises DistributedDPError,
    instead of leaving them waiting in a collective the bad rank never joins."""
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=device)
    _all_gather_single(
        flags, torch.tensor([int(error is None)], dtype=torch.int64, device=device), group=group
    )
    failed = [r for r, ok in enumerate(flags.tolist()) if not ok]
    if error is not None:
        raise error
    if failed:
        raise DistributedDPError(
            f"{what}: ranks {failed} failed (see their error); nothing was communicated or changed"
        )


@torch.no_grad()
def shard_grad_samples(params: Sequence[Tensor], grad_samples: Sequence[Tensor]) -> int:
    """Give every rank the per-sample gradients of ALL ranks' samples, on ITS shard.

    Under FSDP2 each rank computes per-sample gradients of its own B_r samples for whole
    parameters (on an unsharded replica refreshed from ``p.full_tensor()``: torch.func
    cannot trace an FSDP2 module), but owns only a shard of each parameter's coordinates
    and of its optimizer state. One ``all_to_all_single``
    sends rank k the rows of its shard: afterwards ``p.grad_sample`` on every rank has
    shape ``[B, *local_shard_shape]`` with B = sum_r B_r (samples in rank order), and the
    optimizer's ``step()`` clips with per-sample norms all-reduced over the shards ([B]
    floats) -- the coordinate-sharded per-sample path that DP-MacAdam needs (its clipping
    whitens every coordinate with state that lives on the owning rank). Communication:
    each rank sends and receives about B_r * d and B * d / W elements (d = trainable
    coordinates); a transient send buffer of B_r * d elements. Ghost clipping (no
    per-sample gradients) is the cheaper path for the other rules: see the module doc.

    Args:
        params: the optimizer's trainable parameters (``opt.trainable_params()``): FSDP2
            DTensors sharded on dim 0, all on one 1-D device mesh.
        grad_samples: per parameter, this rank's per-sample gradients, a plain tensor of
            shape ``[B_r, *p.shape]`` (global shape; B_r may be 0), any float dtype (sent
            as their common dtype; mixed dtypes are sent as float32, which rounds
            float64 inputs).
    Returns: B, the global number of samples (every rank gets the same).
    Raises: ValueError on a rank whose input is bad (not DTensors, meshes differ, wrong
        count, shape or B_r) and DistributedDPError on the others: the ranks agree on
        their inputs' validity first (a collective: every rank must call it).
    """
    params, grad_samples = list(params), list(grad_samples)
    error, B_r = None, 0
    try:
        B_r = _check_grad_samples(params, grad_samples)
    except ValueError as exc:
        error = exc
    _raise_if_any_failed(
        error,
        _mesh_group(params),
        params[0].device if params else torch.device("cpu"),
        "shard_grad_samples",
    )
    mesh = params[0].device_mesh
    group, world, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    dtypes = {g.dtype for g in grad_samples}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    device = params[0].device
    return _exchange_grad_samples(params, grad_samples, B_r, group, world, me, dtype, device)


def _check_grad_samples(params, grad_samples) -> int:
    """shard_grad_samples' local checks; returns B_r. Raises ValueError."""
    if len(params) != len(grad_samples):
        raise ValueError(
            f"shard_grad_samples: {len(grad_samples)} grad_samples for {len(params)} parameters"
        )
    if not params:
        raise ValueError("shard_grad_samples: no parameters")
    _check_fsdp_params(params, "shard_grad_samples")
    B_r = None
    for k, (p, g) in enumerate(zip(params, grad_samples)):
        if (
            not isinstance(g, Tensor)
            or is_sharded(g)
            or not g.is_floating_point()
            or tuple(g.shape[1:]) != tuple(p.shape)
            or g.device != p.device
        ):
            raise ValueError(
                f"grad_samples[{k}]: expected a plain float tensor "
                f"[B_r, *{tuple(p.shape)}] on {p.device}"
            )
        if B_r is None:
            B_r = g.shape[0]
        elif g.shape[0] != B_r:
            raise ValueError(f"grad_samples[{k}]: {g.shape[0]} rows, others {B_r}")
    return B_r


def _exchange_grad_samples(params, grad_samples, B_r, group, world, me, dtype, device) -> int:
    """shard_grad_samples' communication (inputs checked on every rank)."""
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    _all_gather_single(sizes, torch.tensor([B_r], dtype=torch.int64, device=device), group=group)
    sizes = sizes.tolist()

    def cols(rank):  # elements per sample that rank owns, param by param
        out = []
        for p in params:
            first, end = chunk_rows(p.shape[0], world, rank)
            out.append((end - first) * row_numel(p))
        return out

    def block(rank):  # a [B_r, n_rank] block (the params' slices side by side), flattened
        if not B_r:
            return torch.zeros(0, dtype=dtype, device=device)
        return torch.cat(
            [
                g[:, slice(*chunk_rows(p.shape[0], world, rank))].reshape(B_r, -1).to(dtype)
                for p, g in zip(params, grad_samples)
            ],
            dim=1,
        ).reshape(-1)

    mine = cols(me)
    blocks = [block(rank) for rank in range(world)]
    out = torch.empty(sum(sizes) * sum(mine), dtype=dtype, device=device)
    dist.all_to_all_single(
        out,
        torch.cat(blocks),
        output_split_sizes=[b * sum(mine) for b in sizes],
        input_split_sizes=[blk.numel() for blk in blocks],
        group=group,
    )
    B = sum(sizes)
    rows = out.view(B, sum(mine))
    pos = 0
    for p, n in zip(params, mine):
        local = p.to_local()
        p.grad_sample = rows[:, pos : pos + n].reshape(B, *local.shape).contiguous()
        pos += n
    return B


@torch.no_grad()
def reduce_scatter_clipped_sums(
    params: Sequence[Tensor],
    clipped_sums: Sequence[Tensor | None],
    bucket_numel: int = _BUCKET_NUMEL,
) -> list[Tensor]:
    """SUM over ranks of each rank's full-shape clipped sums, each rank keeping its shard.

    For ghost clipping under FSDP2: book-keeping builds sum_i c_i g_i of this rank's
    samples with each parameter's full shape (the layers ran unsharded); this SUMs them
    over the mesh and returns this rank's shard of each, as a DTensor like ``p`` (ready
    for ``optimizer.accumulate_clipped``). Parameters are packed into buckets of at most
    ``bucket_numel`` elements, one reduce-scatter each (rows padded to the
    torch.chunk layout; the padding is dropped). A collective: every rank calls it.

    Args:
        params: the optimizer's trainable parameters, FSDP2 DTensors on one 1-D mesh.
        clipped_sums: per parameter, a plain float tensor of the parameter's global shape,
            or None (unused on this rank: zeros, still communicated).
    Returns: list of float32 DTensors (Shard(0)), one per parameter.
    Raises: ValueError on a rank whose input is bad (count, shapes, non-DTensor
        parameters), DistributedDPError on the others (the ranks agree on their inputs'
        validity first; nothing is reduced)."""
    params, clipped_sums = list(params), list(clipped_sums)
    error = None
    try:
        _check_clipped_sums(params, clipped_sums)
    except ValueError as exc:
        error = exc
    _raise_if_any_failed(
        error,
        _mesh_group(params),
        params[0].device if params else torch.device("cpu"),
        "reduce_scatter_clipped_sums",
    )
    return _reduce_scatter(params, clipped_sums, bucket_numel)


def _check_clipped_sums(params, clipped_sums) -> None:
    """reduce_scatter_clipped_sums' local checks. Raises ValueError."""
    if len(params) != len(clipped_sums) or not params:
        raise ValueError(
            f"reduce_scatter_clipped_sums: {len(clipped_sums)} sums for {len(params)} parameters"
        )
    _check_fsdp_params(params, "reduce_scatter_clipped_sums")
    for k, (p, s) in enumerate(zip(params, clipped_sums)):
        if s is not None and (
            not isinstance(s, Tensor)
            or is_sharded(s)
            or tuple(s.shape) != tuple(p.shape)
            or s.device != p.device
            or not s.is_floating_point()
        ):
            raise ValueError(
                f"clipped_sums[{k}]: expected None or a plain float tensor of "
                f"shape {tuple(p.shape)} on {p.device}"
            )


def _reduce_scatter(params, clipped_sums, bucket_numel) -> list[Tensor]:
    """reduce_scatter_clipped_sums' communication (inputs checked on every rank)."""
    from torch.distributed.tensor import DTensor

    mesh = params[0].device_mesh
    group, world = mesh.get_group(), mesh.size()
    out: list[Tensor] = [None] * len(params)

    def padded_rows(p):
        return -(-p.shape[0] // world)

    def flush(idx):
        blocks = []
        for rank in range(world):
            for k in idx:
                p, s = params[k], clipped_sums[k]
                first, end = chunk_rows(p.shape[0], world, rank)
                block = torch.zeros(
                    (padded_rows(p), *p.shape[1:]), dtype=torch.float32, device=p.device
                )
                if s is not None:
                    block[: end - first] = s[first:end]
                blocks.append(block.reshape(-1))
        flat = torch.cat(blocks)
        mine = torch.empty(flat.numel() // world, dtype=torch.float32, device=flat.device)
        _reduce_scatter_single(mine, flat, op=dist.ReduceOp.SUM, group=group)
        pos = 0
        for k in idx:
            p = params[k]
            local = local_shard(p)[0]
            n = padded_rows(p) * row_numel(p)
            shard = mine[pos : pos + n].view(padded_rows(p), *p.shape[1:])[: local.shape[0]]
            out[k] = DTensor.from_local(
                shard.contiguous(),
                mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
            pos += n

    idx, size = [], 0
    for k, p in enumerate(params):
        n = padded_rows(p) * world * row_numel(p)
        if idx and size + n > bucket_numel:
            flush(idx)
            idx, size = [], 0
        idx.append(k)
        size += n
    if idx:
        flush(idx)
    return out
