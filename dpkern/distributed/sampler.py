"""Poisson sampling over data-parallel ranks: each rank samples its shard of the data set."""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from .lockstep import _fingerprint
from ..sampling import PoissonBatchSampler


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
