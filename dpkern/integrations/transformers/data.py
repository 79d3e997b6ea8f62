"""The training data of a :class:`~dpkern.integrations.transformers.DPTrainer`: Poisson
logical batches split into micro-batches, a collator that serves empty micro-batches, and
the split of a large micro-batch into chunks of at most the per-device batch size."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...sampling import PoissonBatchSampler, SamplingKey


class PoissonMicroBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Poisson-sampled logical batches, each split into ``micro_batches`` micro-batches.

    Every epoch draws ``steps_per_epoch`` logical batches with
    :class:`dpkern.sampling.PoissonBatchSampler` (each example independently with
    probability ``sample_rate``; empty batches included) and yields each as
    ``micro_batches`` consecutive index lists whose sizes differ by at most one (some
    may be empty). A ``DataLoader(dataset, batch_sampler=...)`` then gives the Trainer
    exactly ``micro_batches`` micro-batches per optimizer step.

    Data-parallel ranks (``rank``, ``world_size`` W > 1): rank r takes its part of every
    logical batch, the units i with i % W == r of the single-process draw under the same
    key (counter-based sampling, :class:`~dpkern.sampling.PoissonBatchSampler`), split
    into ``micro_batches`` micro-batches as above; every rank yields the same number of
    micro-batches (empty ones included), and the union over ranks is the single-process
    logical batch. The ranks must share the key: ``seed`` (the same on every rank), or
    ``key``, a secret :class:`~dpkern.sampling.SamplingKey` broadcast from rank 0, under
    which epoch e draws the steps e * steps_per_epoch + 1, ... of the sampling stream.

    Args:
        num_samples: N, the dataset size (int >= 1).
        sample_rate: q in (0, 1].
        steps_per_epoch: logical batches per epoch (int >= 1).
        micro_batches: micro-batches per logical batch (int >= 1; the Trainer's
            ``gradient_accumulation_steps``).
        seed: None (default): each epoch's draw is seeded from os.urandom (never
            stored). An int: epoch e is seeded by a function of (seed, e), so an epoch
            is the same however often it is iterated (a known sampling: not private).
        key: instead of ``seed``: one secret sampling key for every epoch (what ranks
            share in secure mode; epochs then draw successive steps of its stream).
        rank, world_size: this rank and the number of ranks (default 0 and 1).
    Raises:
        ValueError: invalid arguments (from PoissonBatchSampler too), both ``seed`` and
            ``key``, or several ranks with neither."""

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps_per_epoch: int,
        micro_batches: int,
        *,
        seed: int | None = None,
        key: SamplingKey | None = None,
        rank: int = 0,
        world_size: int = 1,
    ):
        for name, v in (("steps_per_epoch", steps_per_epoch), ("micro_batches", micro_batches)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"invalid {name}={v!r}: expected an int >= 1")
        # validates N, q, rank, world_size and the key
        PoissonBatchSampler(
            num_samples,
            sample_rate,
            1,
            seed=0 if key is None else None,
            key=key,
            rank=rank,
            world_size=world_size,
        )
        if seed is not None and key is not None:
            raise ValueError("pass seed= or key=, not both")
        if world_size > 1 and seed is None and key is None:
            raise ValueError(
                "several ranks need one sampling key: pass seed= or key= (rank 0's secret "
                "key, broadcast: dpkern.distributed.broadcast_sampling_key)"
            )
        self.num_samples, self.sample_rate = num_samples, float(sample_rate)
        self.steps_per_epoch, self.micro_batches = steps_per_epoch, micro_batches
        self.seed, self.key = seed, key
        self.rank, self.world_size = rank, world_size
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
        start = 1 if self.key is None else epoch * self.steps_per_epoch + 1
        draws = PoissonBatchSampler(
            self.num_samples,
            self.sample_rate,
            self.steps_per_epoch,
            seed=seed,
            key=self.key,
            start_step=start,
            rank=self.rank,
            world_size=self.world_size,
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
            out = self.collate_fn(features)
            check_one_row_per_example(out, len(features))
            return out
        if self._empty is None:
            self._empty = _zero_rows(self.collate_fn([self.dataset[0]]))
        return dict(self._empty)


#: Keys of padding-free / packed batches (several examples in one row; transformers'
#: DataCollatorWithFlattening, TRL's packing).
PACKED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def check_one_row_per_example(batch, n: int) -> None:
    """Raise ValueError unless the collated ``batch`` holds one row per example (``n``
    features in, ``n`` rows out, no packing keys): each row is clipped as one privacy
    unit, so a row holding several examples would bound the group, not each example (one
    example could move the released sum by far more than C)."""
    packed = [k for k in PACKED_KEYS if isinstance(batch, Mapping) and k in batch]
    rows = _batch_rows(batch) if isinstance(batch, Mapping) else None
    if packed or rows != n:
        why = f"packing keys {packed}" if packed else f"{rows} row(s) from {n} examples"
        raise ValueError(
            f"DPTrainer: the data collator's batch has {why}: each row must be exactly one "
            "example (one privacy unit, clipped to max_grad_norm on its own). Padding-free "
            "or packing collators (DataCollatorWithFlattening, TRL packing) put several "
            "examples in one row, so clipping a row would bound the group, not each example "
            "(not DP); use a padding collator (DataCollatorForLanguageModeling, "
            "DataCollatorWithPadding) or pack the texts into blocks before the dataset"
        )


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
