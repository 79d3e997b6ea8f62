"""Data-parallel DP training on torch.distributed (DDP), every step equal to one process's.

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

A training script for ``torchrun --standalone --nproc_per_node=N train.py``::

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    ddp = DistributedDataParallel(model.to(device))
    disable_gradient_allreduce(ddp)
    sampler = DistributedPoissonSampler(len(dataset), sample_rate, steps)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=...)
    opt = DistributedDPOptimizer(dpkern.DPAdamW(ddp.parameters(), lr=1e-3, max_grad_norm=1.0,
                                 noise_multiplier=sigma,
                                 expected_batch_size=sampler.expected_batch_size))
    for batch in loader:                       # may be empty on this rank
        if len(batch):                         # per-sample gradients of the local samples
            compute_grad_sample(ddp.module, loss_fn, inputs, targets)
        opt.step()                             # every rank, every step
        opt.zero_grad()
        accountant.step(noise_multiplier=sigma, sample_rate=sampler.sample_rate)

Checkpoints: save ``opt.state_dict()`` on rank 0; every rank calls ``opt.load_state_dict``
(secure mode: rank 0 draws a fresh key and broadcasts it).
"""
from __future__ import annotations

import hashlib
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import functional as F
from .optim import DPOptimizer, key_fingerprint, secure_key
from .sampling import PoissonBatchSampler

__all__ = ["DistributedDPError", "DistributedDPOptimizer", "DistributedPoissonSampler",
           "all_reduce_clipped_sums", "broadcast_key", "disable_gradient_allreduce",
           "key_fingerprint", "shard_offsets", "sharded_step", "sync_key", "verify_lockstep"]

_BUCKET_NUMEL = 1 << 24  # 64 MiB of fp32 per all-reduce bucket


class DistributedDPError(RuntimeError):
    """Ranks disagree (noise key, step, optimizer configuration) or one rank failed.

    Raised on EVERY rank of the group at the same collective, so none is left waiting."""


def _fingerprint(data: bytes, key: bytes = b"") -> int:
    digest = hashlib.blake2b(data, key=key, digest_size=8, person=b"dpkern-ddp-v1").digest()
    return int.from_bytes(digest, "little", signed=True)


def _describe(optimizer: DPOptimizer) -> dict:
    """Non-secret configuration that must be identical on every rank."""
    params = optimizer.trainable_params()
    return {"class": type(optimizer).__name__, "shapes": [tuple(p.shape) for p in params],
            "max_grad_norm": optimizer.max_grad_norm,
            "noise_multiplier": optimizer.noise_multiplier,
            "expected_batch_size": optimizer.expected_batch_size,
            "hyper": [repr(optimizer._hyper(g)) for g in optimizer.param_groups]}


def _device(optimizer: DPOptimizer) -> torch.device:
    params = optimizer.trainable_params()
    if not params:
        raise ValueError("the optimizer owns no trainable parameter")
    return params[0].device


# columns of the lockstep check: ok flag, secure flag, configuration, step, key
_OK, _SECURE, _CONFIG, _STEP, _KEY = range(5)
_WHAT = {_SECURE: "secure mode (seed=None) vs seed=", _CONFIG: "optimizer configuration",
         _STEP: "DP step counters", _KEY: "noise keys"}


def _gather_checks(optimizer: DPOptimizer, group, ok: bool = True) -> Tensor:
    row = torch.tensor([int(ok), int(optimizer.secure),
                        _fingerprint(repr(_describe(optimizer)).encode()),
                        optimizer.dp_step, optimizer.key_fingerprint()],
                       dtype=torch.int64, device=_device(optimizer))
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
    hint = (" -- call dpkern.distributed.sync_key(optimizer) after constructing or "
            "loading the optimizer on every rank" if _KEY in bad or _STEP in bad else "")
    raise DistributedDPError("; ".join(parts) + hint)


def verify_lockstep(optimizer: DPOptimizer, group=None) -> None:
    """Check that every rank has the same noise key, DP step and optimizer configuration.

    One all-gather of 5 int64 per rank (a collective: every rank of ``group`` must call it).
    The key is compared by :func:`key_fingerprint`, never sent.

    Raises:
        DistributedDPError: on every rank, naming what differs and which ranks hold which
            value (steps are shown, keys never).
    """
    _raise_on_mismatch(optimizer, _gather_checks(optimizer, group), group,
                       (_SECURE, _CONFIG, _STEP, _KEY))


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


def broadcast_key(key: int | None = None, group=None, device=None) -> int:
    """Rank 0's 64-bit noise key, on every rank of ``group`` (a collective).

    Args:
        key: this rank's candidate (only rank 0's is used); None = draw from os.urandom.
        device: where the 8-byte tensor travels (the parameters' device: CPU for gloo,
            CUDA for NCCL); default CPU.
    Returns: the key, an int in [0, 2**64). Never log it."""
    if key is None:
        key = secure_key()
    buf = torch.tensor(list(int(key).to_bytes(8, "little")), dtype=torch.uint8,
                       device=device if device is not None else "cpu")
    dist.broadcast(buf, group=group, group_src=0)
    return int.from_bytes(bytes(buf.cpu().tolist()), "little")


def all_reduce_clipped_sums(optimizer: DPOptimizer, group=None,
                            bucket_numel: int = _BUCKET_NUMEL) -> None:
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
                b.copy_(flat[pos:pos + b.numel()].view_as(b))
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
            lockstep check, one 40-byte all-gather, runs before each), or a rank failed its local clipping (it re-raises its own error, the others
            this one); the logical batch is then dropped on every rank and parameters and
            optimizer state are untouched everywhere.
    """

    def __init__(self, optimizer: DPOptimizer, group=None, *,
                 bucket_numel: int = _BUCKET_NUMEL):
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(f"expected a dpkern DPOptimizer, got {type(optimizer).__name__}")
        self.optimizer, self.group = optimizer, group
        self.bucket_numel = int(bucket_numel)
        sync_key(optimizer, group)

    def __getattr__(self, name):
        if name == "optimizer":  # not set yet (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def _has_grad_sample(self) -> bool:
        return any(getattr(p, "grad_sample", None) is not None
                   for p in self.optimizer.trainable_params())

    def accumulate(self) -> None:
        """Fold this rank's micro-batch into its local clipped sum (no communication)."""
        self.optimizer.accumulate()

    def accumulate_clipped(self, clipped_sums: Sequence[Tensor | None],
                           batch_size: int = 0) -> None:
        """Add locally computed clipped sums (ghost clipping); see the inner optimizer."""
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
        if self._has_grad_sample():
            try:
                self.optimizer.accumulate()
            except (ValueError, FloatingPointError) as exc:
                error = exc
        table = _gather_checks(self.optimizer, self.group, ok=error is None)
        try:
            failed = [r for r, ok in enumerate(table[:, _OK].tolist()) if not ok]
            if error is not None:
                raise error
            if failed:
                raise DistributedDPError(f"ranks {failed} failed to clip their local batch; "
                                         "the logical batch was dropped on every rank, "
                                         "nothing was updated")
            _raise_on_mismatch(self.optimizer, table, self.group,
                               (_SECURE, _CONFIG, _STEP, _KEY))
        except Exception:
            for buf in self.optimizer.clipped_sum_buffers():
                buf.zero_()  # drop the logical batch on every rank, consistently
            self.optimizer.zero_grad()
            raise
        all_reduce_clipped_sums(self.optimizer, self.group, self.bucket_numel)
        self.optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """The inner optimizer's state_dict (identical on every rank: save rank 0's)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load on every rank, then :func:`sync_key` (secure mode: rank 0's fresh key)."""
        self.optimizer.load_state_dict(state_dict)
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

    def __init__(self, num_samples: int, sample_rate: float, steps: int, *,
                 num_replicas: int | None = None, rank: int | None = None,
                 seed: int | None = None, group=None):
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
            max(len(self.shard), 1), sample_rate, steps,
            seed=None if seed is None else _rank_seed(seed, rank))
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
# FSDP2 (fully_shard) prototype: each rank noises ITS shard, at the GLOBAL indices
# --------------------------------------------------------------------------------------
def shard_offsets(params: Sequence[Tensor]) -> list[tuple[Tensor, int]]:
    """Local shard and global noise index of its first element, for each parameter.

    ``params``: the trainable parameters in noise-index order (SPEC section 3: the order
    the single-process optimizer would see), plain tensors or FSDP2 DTensors sharded on
    dim 0 over a 1-D mesh (``fully_shard``'s default layout). FSDP2 cuts dim 0 like
    ``torch.chunk`` (ceil(n / W) rows per rank, the last ranks possibly short or empty);
    a rank's rows are a contiguous run of the row-major flattening, so its shard is the
    global index range [offset_p + first_row * row_numel, + local numel). Padding is not
    part of the local tensor and consumes no index. Using LOCAL indices instead would
    hand every shard the same noise -- a privacy failure (correlated noise).

    Returns: list of (local tensor -- a view sharing storage --, global flat offset int).
    Raises: ValueError for other placements (Shard(d > 0), Replicate, 2-D meshes) or a
        local shard whose size does not match the torch.chunk layout."""
    from torch.distributed.tensor import DTensor, Shard
    out, offset = [], 0
    for k, p in enumerate(params):
        if isinstance(p, DTensor):
            if len(p.placements) != 1 or p.placements[0] != Shard(0):
                raise ValueError(f"params[{k}]: placements {p.placements} not supported "
                                 "(the prototype handles FSDP2's Shard(0) on a 1-D mesh)")
            local, n_rows = p.to_local(), p.shape[0]
            world, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
            first = min(rank * -(-n_rows // world), n_rows)
            row_numel = p.numel() // n_rows if n_rows else 0
            if local.shape[0] != min(-(-n_rows // world), n_rows - first) \
                    or tuple(local.shape[1:]) != tuple(p.shape[1:]):
                raise ValueError(f"params[{k}]: local shard {tuple(local.shape)} does not "
                                 f"match torch.chunk rows of {tuple(p.shape)} on rank {rank}")
            out.append((local, offset + first * row_numel))
        else:
            out.append((p.detach(), offset))
        offset += p.numel()
    return out


_SHARDED_RULES = {"sgd": (F.dp_sgd, ("momentum_buffer",)),
                  "adam": (F.dp_adam, ("exp_avg", "exp_avg_sq")),
                  "adamw": (F.dp_adamw, ("exp_avg", "exp_avg_sq"))}


@torch.no_grad()
def sharded_step(rule: str, params: Sequence[Tensor], states: dict, *, key: int, step: int,
                 max_grad_norm: float, noise_multiplier: float, expected_batch_size: float,
                 backend: str = "auto", **hyper) -> None:
    """PROTOTYPE: one DP step on FSDP2-sharded parameters whose ``.grad`` already holds
    the GLOBAL clipped sum of this rank's shard (no noise yet).

    Getting that gradient under FSDP2: compute per-sample clip factors c_i (ghost norms,
    or any per-sample norm pass), back-propagate sum_i c_i * loss_i, and let FSDP's
    reduce-scatter SUM the ranks' clipped sums (on every FSDP unit:
    ``set_gradient_divide_factor(1.0)``, plus ``set_force_sum_reduction_for_comms(True)``
    under gloo, which lacks PREMUL_SUM).
    This function then adds, on each rank, the noise of its shard drawn at the shard's
    global indices (:func:`shard_offsets`) and applies the update with
    :mod:`dpkern.functional` -- no noise is communicated, and gathering the shards gives
    exactly the single-process step.

    Args:
        rule: "sgd", "adam" or "adamw" (element-wise rules; the BC rules and DP-MacAdam
            need a global scalar reduction the functional API does not expose yet).
        params: trainable parameters in noise-index order (DTensors or plain tensors).
        states: dict, filled lazily: param -> {state name: float32 local tensor}.
        key, step: shared by all ranks (:func:`broadcast_key`; step counted from 1).
        **hyper: the rule's hyper-parameters (lr, betas, eps, weight_decay, momentum...).
    Raises: ValueError (unknown rule, bad layout or hyper-parameters)."""
    if rule not in _SHARDED_RULES:
        raise ValueError(f"invalid rule={rule!r}: expected one of {tuple(_SHARDED_RULES)}")
    fn, names = _SHARDED_RULES[rule]
    for p, (local, offset) in zip(params, shard_offsets(params)):
        if local.numel() == 0:
            continue  # an empty shard: its rows live elsewhere, no index is consumed here
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        summed = torch.zeros_like(local, dtype=torch.float32) if grad is None else grad.float()
        st = states.setdefault(p, {n: torch.zeros_like(local, dtype=torch.float32)
                                   for n in names})
        fn([local], None, *[[st[n]] for n in names], step=step, key=key,
           max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
           expected_batch_size=expected_batch_size, summed_grads=[summed], offset=offset,
           backend=backend, **hyper)
