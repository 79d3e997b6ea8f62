"""Poisson sampling over data-parallel ranks: the single-process batches, split by rank.

The sampling stream is counter-based (SPEC 3.1): whether unit i is in the batch of step t
is a pure function of (sampling key, t, i), so ranks that share the key and evaluate only
their own units take, together, exactly the batch one process would take."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..sampling import PoissonBatchSampler, SamplingKey, sampling_key
from ..sampling.stream import _reveal
from .lockstep import DistributedDPError, _all_gather_single, _fingerprint


def _group_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_sampling_key(group=None, device=None) -> SamplingKey:
    """Rank 0's fresh secret sampling key (``os.urandom``), on every rank of ``group``
    (a collective; 8 bytes on ``device``, default: CPU for gloo, the current CUDA device
    for NCCL). Returns a :class:`dpkern.sampling.SamplingKey` (never printed)."""
    device = device if device is not None else _group_device(group)
    key = sampling_key(None)
    buf = torch.tensor(list(_reveal(key).to_bytes(8, "little")), dtype=torch.uint8, device=device)
    dist.broadcast(buf, group=group, group_src=0)
    return SamplingKey(int.from_bytes(bytes(buf.cpu().tolist()), "little"))


def check_sampling_keys(key: SamplingKey, group=None, device=None) -> None:
    """Raise :class:`DistributedDPError` on every rank unless all ranks of ``group`` hold
    the same sampling key (compared by a keyed BLAKE2b fingerprint; a collective)."""
    device = device if device is not None else _group_device(group)
    mine = _fingerprint(b"dpkern sampling key", key=_reveal(key).to_bytes(8, "little"))
    rows = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=device)
    _all_gather_single(rows, torch.tensor([mine], dtype=torch.int64, device=device), group=group)
    if (rows != rows[0]).any():
        raise DistributedDPError(
            "sampling keys differ across ranks (different --seed / seed= per rank?): the "
            "ranks would not take the single-process batches"
        )


class DistributedPoissonSampler(PoissonBatchSampler):
    """Poisson sampling across data-parallel ranks: rank r's part of the single-process
    batches of :class:`dpkern.sampling.PoissonBatchSampler`.

    Every step includes each privacy unit independently with probability ``sample_rate``
    q, by the counter-based sampling stream; rank r evaluates only the units i with
    i % W == r and yields their rows (GLOBAL dataset indices), so the union over ranks is
    exactly the batch one process with the same key takes, and each rank yields exactly
    ``steps`` batches, empty ones included, so every rank takes every step. Fixed shapes
    (``max_batch_size``) and privacy units (``units``) work as in
    :class:`~dpkern.sampling.PoissonBatchSampler`. Accounting: the mechanism is Poisson(q)
    over all units, so give the accountant ``sample_rate`` (not a per-rank rate) and the
    optimizer ``expected_batch_size = sampler.expected_batch_size`` (the global one).

    The ranks share the sampling key: with ``seed`` (the same int on every rank) it is
    derived from it; in secure mode (no seed) rank 0 draws a secret key and broadcasts
    it when a process group is initialised (a collective at construction). Without a
    process group, a secure-mode rank draws its own key: the union is still Poisson(q),
    but it is not a single-process run's batches, and fixed shapes are refused. With a
    process group, the ranks check that their keys agree (by fingerprint).

    Args:
        num_samples: dataset size N (>= 1).
        sample_rate: q in (0, 1].
        steps: number of batches to yield (>= 1).
        num_replicas, rank: default to the process group's world size and rank.
        seed: None (secure) or an int in [0, 2**64) shared by all ranks.
        key: a :class:`~dpkern.sampling.SamplingKey` shared by all ranks, instead of seed.
        group: process group for the defaults, the broadcast and the check.
        start_step, units, max_batch_size, max_unit_size, pad_index: as
            :class:`~dpkern.sampling.PoissonBatchSampler`.
    Raises:
        ValueError: invalid arguments (as PoissonBatchSampler, plus rank / num_replicas;
            fixed shapes in secure mode without a process group).
        DistributedDPError: the ranks' sampling keys differ.
    Source: Poisson subsampling as in Abadi et al. 2016; the counter-based stream makes
    the sharded sampling exactly the single-process one.
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
        key: SamplingKey | None = None,
        group=None,
        start_step: int = 1,
        units=None,
        max_batch_size: int | None = None,
        max_unit_size: int | None = None,
        pad_index: int = 0,
    ):
        if num_replicas is None:
            num_replicas = dist.get_world_size(group)
        if rank is None:
            rank = dist.get_rank(group)
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"invalid num_replicas={num_replicas!r}: expected an int >= 1")
        if not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"invalid rank={rank!r}: expected an int in [0, {num_replicas})")
        grouped = dist.is_available() and dist.is_initialized()
        if seed is None and key is None:
            if grouped:
                key = broadcast_sampling_key(group)
            elif max_batch_size is not None and num_replicas > 1:
                raise ValueError(
                    "fixed-shape batches over ranks need one sampling key: pass seed=, key=, "
                    "or initialise the process group (rank 0's secret key is broadcast)"
                )
        super().__init__(
            num_samples,
            sample_rate,
            steps,
            seed=seed,
            key=key,
            start_step=start_step,
            units=units,
            max_batch_size=max_batch_size,
            max_unit_size=max_unit_size,
            rank=rank,
            world_size=num_replicas,
            pad_index=pad_index,
        )
        if grouped:
            check_sampling_keys(self.key, group)

    @property
    def num_replicas(self) -> int:
        """The number of ranks W (``world_size``)."""
        return self.world_size

    @property
    def shard(self) -> range:
        """The units this rank evaluates in variable-shape mode: ``range(rank, U, W)``
        (with one example per unit, its examples)."""
        return range(self.rank, self.num_units, self.world_size)
