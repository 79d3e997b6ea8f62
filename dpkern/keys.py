"""The noise key: a 64-bit secret held in an opaque object (SPEC section 3).

Whoever knows the key and the released parameters can subtract the noise exactly, so the
key never appears in a repr, a str, a pickle, a log line or a traceback's locals: front-ends
hold a :class:`NoiseKey`, pass it down unchanged, and the backends unwrap it with
:func:`reveal` only at the kernel call.
"""

from __future__ import annotations

import hashlib
import os

__all__ = ["NOT_PRIVATE", "NoiseKey", "key_fingerprint", "reveal", "secure_key"]

#: What every output of a run whose noise key is known (a seeded key) says in place of an
#: epsilon claim: whoever knows the key can subtract the noise.
NOT_PRIVATE = "not private: the noise key is known"


class NoiseKey:
    """An opaque 64-bit noise key.

    ``repr``/``str``/``format`` print ``NoiseKey(<secret>)``; pickling and copying to another
    process are refused (``TypeError``); ``copy``/``deepcopy`` return the same object (its
    value is immutable, and a copy must share :meth:`claim_step`'s record of the last
    functional step). Equality is identity. :func:`reveal` returns the integer.

    Args:
        value: an int in [0, 2**64).
    Raises:
        ValueError: ``value`` is not such an int (the message never shows the value).
    """

    __slots__ = ("_value", "_last_step")

    def __init__(self, value: int):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
            raise ValueError("invalid noise key: expected an int in [0, 2**64)")
        object.__setattr__(self, "_value", value)
        object.__setattr__(self, "_last_step", 0)

    def claim_step(self, step: int, *, check_only: bool = False) -> None:
        """Record that the functional API releases noise at ``step`` with this key; raise
        ValueError, changing nothing, when ``step`` is not above every step claimed before
        (a (key, step) pair serves one release: two calls at one step draw the same noise,
        which their difference cancels, and clip their parameters apart). The optimizer
        classes count their steps themselves and do not claim. ``check_only``: raise as
        above, record nothing."""
        if step <= self._last_step:
            raise ValueError(
                f"noise step {step} with a NoiseKey that already released at step "
                f"{self._last_step}: each (key, step) pair serves one release (another call "
                "at the same step would draw the same noise and clip apart); pass every "
                "parameter group of a step to one dp_step_groups call, and count steps up"
            )
        if not check_only:
            object.__setattr__(self, "_last_step", int(step))

    def __setattr__(self, name, value):
        raise AttributeError("NoiseKey is immutable")

    def __repr__(self) -> str:
        return "NoiseKey(<secret>)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __reduce__(self):
        raise TypeError(
            "a NoiseKey cannot be pickled: the noise key must not leave the "
            "process (an optimizer's state_dict() never holds it)"
        )

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def reveal(key: NoiseKey | int) -> int:
    """The integer behind ``key`` (a :class:`NoiseKey`, or an int from the functional API).

    Backends call it at the kernel call and nowhere else."""
    return key._value if isinstance(key, NoiseKey) else key


def as_key(key) -> NoiseKey:
    """``key`` as a :class:`NoiseKey` (ints are wrapped). Raises ValueError."""
    return key if isinstance(key, NoiseKey) else NoiseKey(key)


def secure_key() -> NoiseKey:
    """A fresh 64-bit noise key from the OS's CSPRNG (os.urandom)."""
    return NoiseKey(int.from_bytes(os.urandom(8), "little"))


def key_fingerprint(key: NoiseKey | int) -> int:
    """A 64-bit fingerprint of a noise key (BLAKE2b keyed BY the key over a fixed message),
    so data-parallel ranks can check they share a key without sending it. Recovering the
    key means inverting a keyed hash; still, treat it as internal and do not log it.

    Returns a signed 64-bit int (fits an int64 tensor)."""
    digest = hashlib.blake2b(
        b"dpkern noise key fingerprint",
        key=reveal(key).to_bytes(8, "little"),
        digest_size=8,
        person=b"dpkern-ddp-v1",
    ).digest()
    return int.from_bytes(digest, "little", signed=True)
