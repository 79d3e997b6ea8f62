"""The sampling stream: counter-based Poisson inclusion decisions (SPEC section 3.1).

Unit i is in the batch of step t iff ``u(K_s, t, i) < floor(q * 2**64)``, where u is a
64-bit word of Philox-4x32-10 under the sampling stream id (:data:`SAMPLING_STREAM`) and
the sampling key K_s. The decision is a pure function of (K_s, t, i, q): a rank that
evaluates only its own units gets exactly its part of the single-process batch, and a
resumed run continues the same sequence of batches.

The sampling key is a secret like the noise key (whoever knows it knows which units each
step used): :class:`SamplingKey` hides it from ``repr``, ``str``, pickles and tracebacks.
"""

from __future__ import annotations

import fractions
import hashlib
import numbers
import os

import torch
from torch import Tensor

from ..backends.reference import noise_counter, philox4x32_10

__all__ = [
    "SAMPLING_STREAM",
    "SamplingKey",
    "inclusion_mask",
    "rate_threshold",
    "sampling_key",
    "sampling_words",
]

#: Philox stream id of the sampling stream (SPEC 3: 0 is the gradient noise).
SAMPLING_STREAM = 1
_MASK32 = 0xFFFFFFFF
_TWO64 = 1 << 64
# pairs of units per Philox chunk: 32768 pairs (64 Ki units) keep the temporaries in cache
_CHUNK_PAIRS = 1 << 15
_SEED_PERSON = b"dpkern-sample-v1"


class SamplingKey:
    """An opaque 64-bit sampling key (the key K_s of SPEC section 3.1).

    ``repr``/``str``/``format`` print ``SamplingKey(<secret>)`` (or
    ``SamplingKey(seeded)`` for a key derived from a seed: the seed is in the run's
    configuration anyway, but the key is still never printed); pickling is refused
    (``TypeError``); ``copy``/``deepcopy`` return the same object (it is immutable).

    Args:
        value: an int in [0, 2**64).
        seeded: whether the key was derived from a known seed (reproducible mode).
    Raises:
        ValueError: ``value`` is not such an int (the message never shows the value).
    """

    __slots__ = ("_value", "seeded")

    def __init__(self, value: int, *, seeded: bool = False):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _TWO64:
            raise ValueError("invalid sampling key: expected an int in [0, 2**64)")
        object.__setattr__(self, "_value", value)
        object.__setattr__(self, "seeded", bool(seeded))

    def __setattr__(self, name, value):
        raise AttributeError("SamplingKey is immutable")

    def __repr__(self) -> str:
        return "SamplingKey(seeded)" if self.seeded else "SamplingKey(<secret>)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __reduce__(self):
        raise TypeError(
            "a SamplingKey cannot be pickled: the sampling key must not leave the process "
            "(data-parallel ranks share it with dpkern.distributed's broadcast)"
        )

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def _reveal(key: SamplingKey) -> int:
    return key._value


def sampling_key(seed: int | None = None) -> SamplingKey:
    """The sampling key: secret (``os.urandom(8)``) when ``seed`` is None, else derived
    from the seed (SPEC 3.1: the first 8 bytes, little-endian, of BLAKE2b-64 of the seed's
    8 little-endian bytes with personalisation ``b"dpkern-sample-v1"``).

    The derivation differs from the noise key's (a ``seed=`` noise key is the seed
    itself), so a run whose ``--seed`` equals its ``--noise-seed`` still has two different
    keys; the two streams also have different stream ids.

    Args:
        seed: None, or an int in [0, 2**64).
    Returns: a :class:`SamplingKey`.
    Raises: ValueError for another seed."""
    if seed is None:
        return SamplingKey(int.from_bytes(os.urandom(8), "little"))
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < _TWO64:
        raise ValueError(f"invalid seed={seed!r}: expected None or an int in [0, 2**64)")
    digest = hashlib.blake2b(
        int(seed).to_bytes(8, "little"), digest_size=8, person=_SEED_PERSON
    ).digest()
    return SamplingKey(int.from_bytes(digest, "little"), seeded=True)


def rate_threshold(sample_rate: float) -> int:
    """floor(q * 2**64), exactly (q is a binary float: no rounding anywhere).

    A unit is included iff its 64-bit word is below the threshold, so its inclusion
    probability is ``rate_threshold(q) / 2**64``, in (q - 2**-64, q]: never above q.
    q = 1 gives 2**64 (every unit).

    Raises: ValueError for q outside (0, 1] (or not a finite real)."""
    if (
        isinstance(sample_rate, bool)
        or not isinstance(sample_rate, numbers.Real)
        or not 0.0 < float(sample_rate) <= 1.0
    ):
        raise ValueError(f"invalid sample_rate={sample_rate!r}: must be in (0, 1]")
    return int(fractions.Fraction(float(sample_rate)) * _TWO64)  # int() floors a positive


def sampling_words(index: Tensor, *, key: SamplingKey, step: int) -> tuple[Tensor, Tensor]:
    """The 64-bit sampling words u(K_s, t, i) of units ``index`` (int64 ``[n]``, >= 0).

    Returns ``(hi, lo)``: int64 tensors in [0, 2**32) with u = hi * 2**32 + lo. Unit i
    uses the Philox call of pair k = i >> 1 (the noise stream's counter layout, stream 1):
    words (r0, r1) for lane 0 (i even), (r2, r3) for lane 1."""
    index = index.to(torch.int64)
    k = _reveal(key)
    r0, r1, r2, r3 = philox4x32_10(*noise_counter(index, step, SAMPLING_STREAM), k)
    lane0 = (index & 1) == 0
    return torch.where(lane0, r0, r2), torch.where(lane0, r1, r3)


def _less(hi: Tensor, lo: Tensor, threshold: int) -> Tensor:
    """(hi * 2**32 + lo) < threshold, exactly, for threshold in [0, 2**64)."""
    t_hi, t_lo = threshold >> 32, threshold & _MASK32
    return (hi < t_hi) | ((hi == t_hi) & (lo < t_lo))


def _range_included(start: int, stop: int, key: SamplingKey, step: int, threshold: int):
    """Inclusion of the units start .. stop - 1: one Philox call per pair of units."""
    pairs = torch.arange(start >> 1, ((stop - 1) >> 1) + 1, dtype=torch.int64)
    r0, r1, r2, r3 = philox4x32_10(*noise_counter(2 * pairs, step, SAMPLING_STREAM), _reveal(key))
    both = torch.stack((_less(r0, r1, threshold), _less(r2, r3, threshold)), dim=1)
    first = start & 1
    return both.reshape(-1)[first : first + stop - start]


def inclusion_mask(
    index: Tensor | range,
    *,
    key: SamplingKey,
    step: int,
    sample_rate: float | None = None,
    threshold: int | None = None,
) -> Tensor:
    """Whether each unit of ``index`` is in the batch of step ``step``.

    Exactly ``u(K_s, step, i) < floor(q * 2**64)`` (integer comparison of the two 32-bit
    words; q = 1 includes every unit). Vectorised in int64 arithmetic, in chunks of
    64 Ki units: about 0.2 s per million units on one CPU thread (a ``range`` of
    consecutive units costs one Philox call per pair, other indices one per unit).

    Args:
        index: unit indices, an int64 tensor ``[n]`` (values >= 0) or a ``range`` with
            step 1.
        key: the :class:`SamplingKey`.
        step: the optimizer step t (int >= 0; 1 = the first step).
        sample_rate: q in (0, 1]; or pass ``threshold`` (from :func:`rate_threshold`).
    Returns: bool ``[n]``.
    Raises: ValueError for a bad q, or a ``range`` with a step other than 1."""
    if threshold is None:
        threshold = rate_threshold(sample_rate)
    if isinstance(index, range):
        if index.step != 1:
            raise ValueError("inclusion_mask: a range index must have step 1")
        n, device = len(index), None
    else:
        index = index.to(torch.int64).reshape(-1)
        n, device = index.numel(), index.device
    if threshold >= _TWO64:
        return torch.ones(n, dtype=torch.bool, device=device)
    out = torch.empty(n, dtype=torch.bool, device=device)
    chunk = 2 * _CHUNK_PAIRS
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        if isinstance(index, range):
            out[s:e] = _range_included(index.start + s, index.start + e, key, step, threshold)
        else:
            hi, lo = sampling_words(index[s:e], key=key, step=step)
            out[s:e] = _less(hi, lo, threshold)
    return out


def sort_keys(hi: Tensor, lo: Tensor) -> Tensor:
    """An int64 key with the order of u = hi * 2**32 + lo (u - 2**63, exactly)."""
    return (hi - (1 << 31)) * (1 << 32) + lo
