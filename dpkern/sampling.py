"""Poisson sampling (the sampling the DP-SGD accountant assumes; SPEC section 8).

Each step includes every example independently with probability ``sample_rate``, so batch
sizes vary and may be 0. Fixed-size shuffled batches would not match the accountant.
"""

from __future__ import annotations

import os
from typing import Iterator

import torch

from .hyper import check_positive


class PoissonBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields ``steps`` lists of dataset indices, each example in each list independently
    with probability ``sample_rate`` (empty lists included).

    Use as ``DataLoader(dataset, batch_sampler=PoissonBatchSampler(...))``; with an empty
    batch, collate_fn must cope (dpkern's finetune job handles it). ``seed=None`` draws
    the generator's seed from os.urandom (secure mode, as Opacus' secure_mode).

    Raises: ValueError for num_samples < 1, sample_rate outside (0, 1], steps < 1."""

    def __init__(
        self, num_samples: int, sample_rate: float, steps: int, *, seed: int | None = None
    ):
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"invalid num_samples={num_samples!r}: expected an int >= 1")
        if not 0.0 < check_positive("sample_rate", sample_rate) <= 1.0:
            raise ValueError(f"invalid sample_rate={sample_rate!r}: must be in (0, 1]")
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"invalid steps={steps!r}: expected an int >= 1")
        self.num_samples, self.sample_rate, self.steps = num_samples, float(sample_rate), steps
        self.generator = torch.Generator()
        self.generator.manual_seed(
            seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        )

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            yield mask.nonzero().flatten().tolist()
