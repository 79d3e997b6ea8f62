"""Poisson sampling (the sampling the DP-SGD accountant assumes; SPEC sections 3.1 and 8).

Each step includes every privacy unit independently with probability ``sample_rate``, so
batch sizes vary and may be 0; fixed-size shuffled batches would not match the accountant.
The decision is counter-based: unit i is in the batch of step t iff its 64-bit word in the
Philox sampling stream is below floor(q * 2**64), so a step's batch is the same on one
process or many, and a resumed run continues the same sequence.

- :class:`PoissonBatchSampler` -- batches of dataset indices (a DataLoader batch sampler),
  privacy units of several examples, fixed-shape (truncated, padded) batches, ranks;
- :class:`PoissonBatch` -- one step's batch with its padding mask and unit ids;
- :func:`group_grad_samples` -- sum per-sample gradients per unit before clipping
  (user- or document-level DP);
- :func:`unit_ids_from_keys` -- unit ids from per-example keys (user names);
- :func:`sampling_key`, :class:`SamplingKey`, :func:`inclusion_mask`,
  :func:`rate_threshold` -- the stream itself.
"""

from .poisson import PoissonBatch, PoissonBatchSampler
from .stream import (
    SAMPLING_STREAM,
    SamplingKey,
    inclusion_mask,
    rate_threshold,
    sampling_key,
    sampling_words,
)
from .units import group_grad_samples, unit_ids_from_keys

__all__ = [
    "SAMPLING_STREAM",
    "PoissonBatch",
    "PoissonBatchSampler",
    "SamplingKey",
    "group_grad_samples",
    "inclusion_mask",
    "rate_threshold",
    "sampling_key",
    "sampling_words",
    "unit_ids_from_keys",
]
