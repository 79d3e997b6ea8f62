"""The training data of a :class:`~dpkern.integrations.transformers.DPTrainer`: Poisson
logical batches split into micro-batches, a collator that serves empty micro-batches, and
the split of a large micro-batch into chunks of at most the per-device batch size."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...sampling import PoissonBatchSampler


class PoissonMicroBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Poisson-sampled logical batches, each split into ``micro_batches`` micro-batches.

    Every epoch draws ``steps_per_epoch`` logical batches with
    :class:`dpkern.sampling.PoissonBatchSampler` (each example independently with
    probability ``sample_rate``; empty batches included) and yields each as
    ``micro_batches`` consecutive index lists whose sizes differ by at most one (some
    may be empty). A ``DataLoader(dataset, batch_sampler=...)`` then gives the Trainer
    exactly ``micro_batches`` micro-batches per optimizer step.

    Args:
        num_samples: N, the dataset size (int >= 1).
        sample_rate: q in (0, 1].
        steps_per_epoch: logical batches per epoch (int >= 1).
        micro_batches: micro-batches per logical batch (int >= 1; the Trainer's
            ``gradient_accumulation_steps``).
        seed: None (default): each epoch's draw is seeded from os.urandom (never
            stored). An int: epoch e is seeded by a function of (seed, e), so an epoch
            is the same however often it is iterated (a known sampling: not private).
    Raises:
        ValueError: invalid arguments (from PoissonBatchSampler too)."""

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps_per_epoch: int,
        micro_batches: int,
        *,
        seed: int | None = None,
    ):
        for name, v in (("steps_per_epoch", steps_per_epoch), ("micro_batches", micro_batches)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"invalid {name}={v!r}: expected an int >= 1")
        PoissonBatchSampler(num_samples, sample_rate, 1, seed=0)  # validates N and q
        self.num_samples, self.sample_rate = num_samples, float(sample_rate)
        self.steps_per_epoch, self.micro_batches = steps_per_epoch, micro_batches
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration draws (the Trainer and Accelerate call it)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.steps_per_epoch * self.micro_batches

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        seed = None if self.seed is None else (self.seed * 1_000_003 + epoch) % 2**63
        m = self.micro_batches
        draws = PoissonBatchSampler(
            self.num_samples, self.sample_rate, self.steps_per_epoch, seed=seed
        )
        for indices in draws:
            n = len(indices)
            for j in range(m):
                yield indices[n * j // m : n * (j + 1) // m]


def _zero_rows(batch):
    if isinstance(batch, Mapping):
        return {k: _zero_rows(v) for k, v in batch.items()}
    if isinstance(batch, torch.Tensor) and batch.dim() >= 1:
        return batch[:0]
    return batch


class _EmptySafeCollator:
    """The Trainer's collator, and for an empty micro-batch (Poisson sampling draws them)
    the structure of a collated batch with 0 rows (from collating one fixed example:
    collators cannot pad an empty list)."""

    def __init__(self, collate_fn, dataset):
        self.collate_fn, self.dataset = collate_fn, dataset
        self._empty = None

    def __call__(self, features):
        if len(features):
            return self.collate_fn(features)
        if self._empty is None:
            self._empty = _zero_rows(self.collate_fn([self.dataset[0]]))
        return dict(self._empty)


def _batch_rows(inputs) -> int:
    ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
    if isinstance(ids, torch.Tensor):
        return ids.shape[0]
    for v in inputs.values():
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return v.shape[0]
    raise ValueError("DPTrainer: a training batch holds no tensor with a batch dimension")


def _row_chunks(inputs, rows: int, size: int):
    for start in range(0, rows, size):
        yield {
            k: v[start : start + size]
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == rows
            else v
            for k, v in inputs.items()
        }
