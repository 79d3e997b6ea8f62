"""Counter-based Poisson sampling of privacy units, optionally in fixed-shape batches.

Each step t includes every privacy unit i independently with probability q, decided by
the sampling stream (SPEC section 3.1): ``u(K_s, t, i) < floor(q * 2**64)``. The batch is
the examples of the included units. Because the decision is a pure function of the key,
the step and the unit, data-parallel ranks that evaluate only their own units together
take exactly the single-process batch, and a resumed run continues the same sequence.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import Tensor

from .stream import SamplingKey, inclusion_mask, rate_threshold, sampling_key, sampling_words
from .stream import sort_keys

__all__ = ["PoissonBatch", "PoissonBatchSampler"]


@dataclass(frozen=True)
class PoissonBatch:
    """One step's batch (this rank's part of it), as :meth:`PoissonBatchSampler.batches`
    yields it.

    Attributes:
        step (int): the optimizer step t the batch is drawn for (1 = the first step).
        indices (Tensor): int64 ``[L]``, dataset indices of the rows. Rows are grouped by
            unit (units in ascending id, a unit's examples in ascending index). In
            fixed-shape mode L is the sampler's ``rows_per_rank`` and the padding rows
            hold ``pad_index`` (a valid index, so ``data[batch.indices]`` has a static
            shape); otherwise L is the number of sampled rows (0 allowed).
        mask (Tensor): bool ``[L]``, True for real rows, False for padding. Padding rows
            must be kept out of the losses, the norms and the counts (multiply the
            per-sample losses by the mask; :func:`dpkern.sampling.group_grad_samples`
            drops them).
        unit_ids (Tensor): int64 ``[L]``, the privacy unit of each row, -1 for padding.
        truncated (bool): whether this step's Poisson batch exceeded ``max_batch_size``
            and was truncated. Data-dependent: never log or publish it.
    """

    step: int
    indices: Tensor
    mask: Tensor
    unit_ids: Tensor
    truncated: bool = False

    def __len__(self) -> int:
        return self.indices.shape[0]

    @property
    def num_rows(self) -> int:
        """Real (unpadded) rows: an exact, data-dependent count."""
        return int(self.mask.sum())

    @property
    def num_units(self) -> int:
        """Distinct units among the real rows: an exact, data-dependent count."""
        return int(torch.unique(self.unit_ids[self.mask]).numel())


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"invalid {name}={value!r}: expected an int >= {low}")
    return int(value)


def _as_unit_ids(units, num_samples: int) -> Tensor:
    if isinstance(units, Tensor):
        ids = units.detach().cpu()
    else:
        try:
            ids = torch.as_tensor(list(units))
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(
                "invalid units: expected a 1-D sequence or tensor of integer unit ids"
            ) from None
    if ids.dim() != 1 or ids.numel() != num_samples:
        raise ValueError(
            f"invalid units: expected one unit id per example ([{num_samples}]), "
            f"got shape {list(ids.shape)}"
        )
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"invalid units: expected integer unit ids, got {ids.dtype}")
    ids = ids.to(torch.int64)
    if num_samples and int(ids.min()) < 0:
        raise ValueError("invalid units: unit ids must be >= 0")
    return ids


class PoissonBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Poisson sampling of privacy units with the counter-based sampling stream.

    At each step t = ``start_step``, ..., ``start_step + steps - 1``, every privacy unit i
    is in the batch independently with probability q: iff ``u(K_s, t, i) <
    floor(q * 2**64)``, u the 64-bit word of unit i in the sampling stream (SPEC 3.1;
    the comparison is exact, so the inclusion probability is in (q - 2**-64, q]). The
    batch holds every example of every included unit. This is the sampling that the
    DP-SGD accountant assumes (Abadi et al. 2016); batch sizes vary and may be 0.

    Privacy units (``units``): by default every example is its own unit. Pass one unit id
    per example (a user, a document) and the units are sampled instead; clip each unit's
    summed gradient as one row (:func:`dpkern.sampling.group_grad_samples`) and give the
    optimizer ``expected_batch_size = sampler.expected_batch_size`` (q times the number of
    units) and the accountant q: the guarantee is then about adding or removing one unit.

    Fixed shapes (``max_batch_size`` B_max): truncated Poisson sampling padded to B_max
    rows (Chua et al., "Scalable DP-SGD: Shuffling vs. Poisson Subsampling", NeurIPS
    2024). When the included units hold more than B_max rows, the units are taken in
    ascending order of their sampling word u (a uniformly random order) and each unit is
    kept if its rows still fit (whole units only); then the batch is padded to B_max rows
    (``mask`` False, ``unit_ids`` -1). The run then differs from Poisson sampling only on
    the event that some step overflows: :attr:`overflow_probability` bounds that event's
    probability per step for this dataset and its worst neighbour from public numbers
    (units counted at ``max_unit_size`` rows each, never at their private sizes), and
    :class:`dpkern.accounting.PrivacyAccountant` charges it to delta (pass it to
    ``step``). With units of several rows, ``max_unit_size`` k is required: a unit's rows
    beyond its first k (in index order) are never used, so that a neighbour's unit
    never holds more than k rows (with ``units`` and ``max_batch_size``, k is required
    even if every unit here has one row: the neighbour's unit is not this data's).

    Data parallelism (``rank``, ``world_size`` W): in variable-shape mode rank r
    evaluates only the units i with i % W == r and yields their rows: the union over
    ranks is exactly the single-process batch. In fixed-shape mode (units of one row
    only) every rank evaluates every unit (the truncation is global) and takes rows r,
    r + W, r + 2W, ... of the single-process batch, padded to ``rows_per_rank`` =
    ceil(B_max / W). The ranks must share the key: a ``seed``, or ``key=`` broadcast from
    rank 0 (:class:`dpkern.distributed.DistributedPoissonSampler` does it).

    Iterating the sampler yields ``steps`` batches, and iterating it again (the next
    epoch) the ``steps`` after them (:attr:`next_step`), as lists of dataset indices
    (this rank's real rows; use it as ``DataLoader(dataset, batch_sampler=sampler)`` with
    a ``collate_fn`` that accepts an empty list); :meth:`batches` yields
    :class:`PoissonBatch` objects with the mask, the unit ids and the static shape.

    Args:
        num_samples: dataset size N, in examples (int >= 1).
        sample_rate: q in (0, 1], each unit's probability of being in a batch.
        steps: number of batches (int >= 1).
        seed: None (default: a secret key from ``os.urandom``, never shown or saved) or an
            int in [0, 2**64) from which the key is derived (reproducible; keep the seed as
            private as the data: the accounting assumes secret sampling).
        key: a :class:`dpkern.sampling.SamplingKey` instead of ``seed``.
        start_step: the step t of the first batch (int >= 1; a resumed run passes the
            optimizer's step + 1: a seeded sampler rebuilt with the default 1 would draw
            the earlier steps' batches again).
        units: None, or a 1-D integer sequence/tensor ``[N]`` of unit ids >= 0 (the
            number of units is max + 1; an id without examples is an empty unit).
        max_batch_size: None (variable shape) or B_max (int), at least the expected batch
            from public numbers (q * rows; with units, q * units * max_unit_size) and
            ``max_unit_size``.
        max_unit_size: None or k (int >= 1): rows kept per unit.
        rank, world_size: this rank and the number of ranks (0 <= rank < world_size).
        pad_index: the dataset index padding rows hold (default 0).
    Raises:
        ValueError: an argument out of range: num_samples < 1, q outside (0, 1],
            steps < 1, both ``seed`` and ``key``, bad ``units``, B_max below the expected
            batch size or below ``max_unit_size``, ``units`` with B_max but no
            ``max_unit_size``, or fixed shapes over several ranks with ``max_unit_size``
            above 1.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps: int,
        *,
        seed: int | None = None,
        key: SamplingKey | None = None,
        start_step: int = 1,
        units: Sequence[int] | Tensor | None = None,
        max_batch_size: int | None = None,
        max_unit_size: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        pad_index: int = 0,
    ):
        self.num_samples = _check_int("num_samples", num_samples, 1)
        self._threshold = rate_threshold(sample_rate)
        self.sample_rate = float(sample_rate)
        self.steps = _check_int("steps", steps, 1)
        self.start_step = _check_int("start_step", start_step, 1)
        self.world_size = _check_int("world_size", world_size, 1)
        self.rank = _check_int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"invalid rank={rank!r}: expected an int in [0, {world_size})")
        if seed is not None and key is not None:
            raise ValueError("pass seed= or key=, not both")
        if key is not None and not isinstance(key, SamplingKey):
            raise ValueError(
                f"invalid key of type {type(key).__name__}: expected a "
                "dpkern.sampling.SamplingKey (see dpkern.sampling.sampling_key)"
            )
        self.key = key if key is not None else sampling_key(seed)
        self.pad_index = _check_int("pad_index", pad_index, 0)
        if self.pad_index >= self.num_samples:
            raise ValueError(f"invalid pad_index={pad_index!r}: expected < {num_samples}")
        self.max_unit_size = (
            None if max_unit_size is None else _check_int("max_unit_size", max_unit_size, 1)
        )
        self._build_units(units)
        self.max_batch_size = None
        if max_batch_size is not None:
            self._check_fixed_shape(_check_int("max_batch_size", max_batch_size, 1))
        self._overflow = None
        self._next_step = self.start_step

    # -- set-up ---------------------------------------------------------------------
    def _build_units(self, units) -> None:
        N = self.num_samples
        if units is None:
            self._identity = True
            self.num_units = N
            self._sizes = None
            return
        unit_of = _as_unit_ids(units, N)
        self._identity = False
        self.num_units = int(unit_of.max()) + 1
        order = torch.argsort(unit_of, stable=True)  # examples grouped by unit, by index
        sizes = torch.bincount(unit_of, minlength=self.num_units)
        starts = torch.cumsum(sizes, 0) - sizes
        if self.max_unit_size is not None:  # keep each unit's first k examples
            position = torch.arange(N) - starts[unit_of[order]]
            keep = position < self.max_unit_size
            sizes = sizes.clamp(max=self.max_unit_size)
            order = order[keep]
            starts = torch.cumsum(sizes, 0) - sizes
        self._order, self._sizes, self._starts = order, sizes, starts

    def _check_fixed_shape(self, B_max: int) -> None:
        # Public numbers only (N, q, B_max, the cap k): never the private unit sizes, which
        # a refusal or its message would reveal (the accounting bounds units at k too).
        if self._sizes is not None and self.max_unit_size is None:
            raise ValueError(
                "fixed-shape batches of privacy units need max_unit_size= (the rows any "
                "unit may contribute, a public bound: the truncation term of the "
                "accounting assumes it for the neighbouring unit, whatever this data holds)"
            )
        k = 1 if self._sizes is None else self.max_unit_size
        rows = self.num_samples if self._sizes is None else k * self.num_units
        expected = self.sample_rate * rows
        if B_max < expected:
            what = "q * rows" if self._sizes is None else "q * units * max_unit_size"
            raise ValueError(
                f"invalid max_batch_size={B_max}: below the expected batch size "
                f"{expected:g} ({what}): most steps would be truncated; pass at least "
                f"the expected batch plus a few standard deviations"
            )
        if k > B_max:
            raise ValueError(f"invalid max_unit_size={k}: above max_batch_size={B_max}")
        if self.world_size > 1 and k > 1:
            raise ValueError(
                "fixed-shape batches over several ranks support units of one row only "
                f"(max_unit_size={k}); use variable-shape batches"
            )
        self.max_batch_size = B_max

    # -- public properties -------------------------------------------------------------
    @property
    def expected_batch_size(self) -> float:
        """q times the number of units: the optimizer's ``expected_batch_size`` B_e (it
        counts units, the rows the optimizer clips)."""
        return self.sample_rate * self.num_units

    @property
    def rows_per_rank(self) -> int | None:
        """Rows of every batch on this rank in fixed-shape mode (ceil(B_max / W)); None
        in variable-shape mode."""
        if self.max_batch_size is None:
            return None
        return -(-self.max_batch_size // self.world_size)

    @property
    def overflow_probability(self) -> float:
        """Per-step bound on the probability that the Poisson batch exceeds
        ``max_batch_size``, for this dataset and its worst neighbour (one more unit of
        ``max_unit_size`` rows, or 1 row); 0.0 in variable-shape mode. Pass it to
        :meth:`dpkern.accounting.PrivacyAccountant.step` (``overflow_probability=``).

        A function of public quantities only (the number of units N, q, B_max and k): units
        of several rows are bounded as if each held k rows (P[k Binomial(N + 1, q) >
        B_max]), never by their actual sizes, which are private: a bound computed from
        them would make the delta charged, and the sigma calibrated with it, depend on one
        unit's size."""
        if self.max_batch_size is None:
            return 0.0
        if self._overflow is None:
            from ..accounting import batch_overflow_probability

            if self._sizes is None:
                k, counts = 1, {1: self.num_samples}
            else:
                k = self.max_unit_size or 1
                counts = {k: self.num_units}
            self._overflow = batch_overflow_probability(
                counts, self.sample_rate, self.max_batch_size, neighbour_rows=k
            )
        return self._overflow

    def __len__(self) -> int:
        return self.steps

    def __repr__(self) -> str:
        shape = "" if self.max_batch_size is None else f", max_batch_size={self.max_batch_size}"
        ranks = "" if self.world_size == 1 else f", rank={self.rank}, world_size={self.world_size}"
        return (
            f"PoissonBatchSampler(num_samples={self.num_samples}, sample_rate="
            f"{self.sample_rate!r}, steps={self.steps}, units={self.num_units}"
            f"{shape}{ranks}, key={self.key!r})"
        )

    # -- iteration ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches():
            yield batch.indices[batch.mask].tolist()

    @property
    def next_step(self) -> int:
        """The step t the next batch iteration draws: ``start_step``, then one past the
        last batch any iteration drew (a resumed run passes it as ``start_step``)."""
        return self._next_step

    def batches(self) -> Iterator[PoissonBatch]:
        """Yield ``steps`` batches (this rank's part), as :class:`PoissonBatch`: steps
        ``next_step``, ``next_step + 1``, ... Each iteration continues where the last one
        stopped (a second epoch draws steps ``start_step + steps`` onwards, as Opacus'
        DPDataLoader draws new batches each epoch): a step's batch is never yielded twice,
        which would put the same examples in several steps while the accountant counts
        independent ones. (:meth:`batch` gives any step's batch on request.)"""
        for _ in range(self.steps):
            t, self._next_step = self._next_step, self._next_step + 1
            yield self.batch(t)

    def batch(self, step: int) -> PoissonBatch:
        """The batch of step ``step`` (this rank's part): a pure function of the key, the
        step and the units. Raises ValueError for step < 0."""
        step = _check_int("step", step, 0)
        fixed = self.max_batch_size is not None
        U, W, r = self.num_units, self.world_size, self.rank
        if W == 1 or fixed:
            candidates = None  # every unit: range(U)
            included = inclusion_mask(
                range(0, U), key=self.key, step=step, threshold=self._threshold
            )
            units = included.nonzero().flatten()
        else:
            candidates = torch.arange(r, U, W, dtype=torch.int64)
            included = inclusion_mask(
                candidates, key=self.key, step=step, threshold=self._threshold
            )
            units = candidates[included]
        truncated = False
        if fixed:
            units, truncated = self._truncate(units, step)
        rows, unit_ids = self._rows(units)
        if not fixed:
            return PoissonBatch(step, rows, torch.ones(rows.shape, dtype=torch.bool), unit_ids)
        if W > 1:  # round-robin over ranks (units of one row)
            rows, unit_ids = rows[r::W], unit_ids[r::W]
        L = self.rows_per_rank
        n = rows.shape[0]
        indices = torch.full((L,), self.pad_index, dtype=torch.int64)
        ids = torch.full((L,), -1, dtype=torch.int64)
        indices[:n], ids[:n] = rows, unit_ids
        mask = torch.arange(L) < n
        return PoissonBatch(step, indices, mask, ids, truncated)

    def _unit_sizes(self, units: Tensor) -> Tensor:
        if self._sizes is None:
            return torch.ones(units.shape, dtype=torch.int64)
        return self._sizes[units]

    def _truncate(self, units: Tensor, step: int) -> tuple[Tensor, bool]:
        """Truncated Poisson: if the units' rows exceed B_max, take units in ascending
        order of their sampling word u (ties: ascending id), each if it still fits."""
        sizes = self._unit_sizes(units)
        B = self.max_batch_size
        if int(sizes.sum()) <= B:
            return units, False
        hi, lo = sampling_words(units, key=self.key, step=step)
        order = torch.argsort(sort_keys(hi, lo), stable=True)
        if self._sizes is None or int(sizes.max()) == 1:
            kept = units[order[:B]]
        else:
            chosen, room = [], B
            for j, s in zip(order.tolist(), sizes[order].tolist()):
                if s <= room:
                    chosen.append(j)
                    room -= s
            kept = units[torch.tensor(chosen, dtype=torch.int64)]
        return torch.sort(kept).values, True

    def _rows(self, units: Tensor) -> tuple[Tensor, Tensor]:
        """Dataset indices of the examples of ``units`` (ascending ids) and their units."""
        if self._identity:
            return units.clone(), units.clone()
        sizes = self._sizes[units]
        total = int(sizes.sum())
        starts = self._starts[units]
        base = torch.repeat_interleave(starts - (torch.cumsum(sizes, 0) - sizes), sizes)
        rows = self._order[base + torch.arange(total, dtype=torch.int64)]
        return rows, torch.repeat_interleave(units, sizes)
