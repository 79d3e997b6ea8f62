"""Lockstep checks of data-parallel DP training: every rank must hold the same noise key,
step and optimizer configuration (compared by keyed fingerprints, never in the open), and
a failure on one rank is raised on every rank at the same collective."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import Tensor

from ..keys import NoiseKey, as_key, reveal, secure_key
from ..optim import DPOptimizer


_BUCKET_NUMEL = 1 << 24  # 64 MiB of fp32 per all-reduce bucket

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn)
_all_gather_single = getattr(dist, "all_gather_single", None) or getattr(
    dist, "all_gather_into_tensor", None
)

_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or getattr(
    dist, "reduce_scatter_tensor", None
)


class DistributedDPError(RuntimeError):
    """Ranks disagree (noise key, step, optimizer configuration) or one rank failed.

    Raised on EVERY rank of the group at the same collective, so none is left waiting."""


def _fingerprint(data: bytes, key: bytes = b"") -> int:
    digest = hashlib.blake2b(data, key=key, digest_size=8, person=b"dpkern-ddp-v1").digest()
    return int.from_bytes(digest, "little", signed=True)


def _describe(optimizer: DPOptimizer) -> dict:
    """Non-secret configuration that must be identical on every rank."""
    params = optimizer.trainable_params()
    return {
        "class": type(optimizer).__name__,
        "shapes": [tuple(p.shape) for p in params],
        "max_grad_norm": optimizer.max_grad_norm,
        "noise_multiplier": optimizer.noise_multiplier,
        "expected_batch_size": optimizer.expected_batch_size,
        "hyper": [repr(optimizer.group_hyper(g)) for g in optimizer.param_groups],
    }


def _device(optimizer: DPOptimizer) -> torch.device:
    params = optimizer.trainable_params()
    if not params:
        raise ValueError("the optimizer owns no trainable parameter")
    return params[0].device


# columns of the lockstep check: ok flag, secure flag, configuration, step, key, and
# whether the rank holds per-sample gradients (must agree for sharded parameters only)
_OK, _SECURE, _CONFIG, _STEP, _KEY, _PER_SAMPLE = range(6)
_WHAT = {
    _SECURE: "secure mode (seed=None) vs seed=",
    _CONFIG: "optimizer configuration",
    _STEP: "DP step counters",
    _KEY: "noise keys",
    _PER_SAMPLE: "per-sample gradients present (sharded: every rank or none)",
}


def _gather_checks(
    optimizer: DPOptimizer, group, ok: bool = True, per_sample: bool = False
) -> Tensor:
    row = torch.tensor(
        [
            int(ok),
            int(optimizer.secure),
            _fingerprint(repr(_describe(optimizer)).encode()),
            optimizer.dp_step,
            optimizer.key_fingerprint(),
            int(per_sample),
        ],
        dtype=torch.int64,
        device=_device(optimizer),
    )
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
    hint = (
        " -- call dpkern.distributed.sync_key(optimizer) after constructing or "
        "loading the optimizer on every rank"
        if _KEY in bad or _STEP in bad
        else ""
    )
    raise DistributedDPError("; ".join(parts) + hint)


def verify_lockstep(optimizer: DPOptimizer, group=None) -> None:
    """Check that every rank has the same noise key, DP step and optimizer configuration.

    One all-gather of 6 int64 per rank (a collective: every rank of ``group`` must call it).
    The key is compared by :func:`key_fingerprint`, never sent.

    Raises:
        DistributedDPError: on every rank, naming what differs and which ranks hold which
            value (steps are shown, keys never).
    """
    _raise_on_mismatch(
        optimizer, _gather_checks(optimizer, group), group, (_SECURE, _CONFIG, _STEP, _KEY)
    )


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
        optimizer.adopt_key(broadcast_key(None, group, _device(optimizer)))
    verify_lockstep(optimizer, group)


def broadcast_key(key=None, group=None, device=None) -> NoiseKey:
    """Rank 0's 64-bit noise key, on every rank of ``group`` (a collective).

    Args:
        key: this rank's candidate (only rank 0's is used); None = draw from os.urandom.
        device: where the 8-byte tensor travels (the parameters' device: CPU for gloo,
            CUDA for NCCL); default CPU.
    Returns: the key, a :class:`dpkern.keys.NoiseKey` (never printed)."""
    key = secure_key() if key is None else as_key(key)
    buf = torch.tensor(
        list(reveal(key).to_bytes(8, "little")),
        dtype=torch.uint8,
        device=device if device is not None else "cpu",
    )
    dist.broadcast(buf, group=group, group_src=0)
    return NoiseKey(int.from_bytes(bytes(buf.cpu().tolist()), "little"))


def raise_if_any_failed(error: Exception | None, group, device, what: str) -> None:
    """One tiny all-gather of "did my local checks pass?" before a collective: a rank whose
    input is bad re-raises its own error, every other rank raises DistributedDPError,
    instead of leaving them waiting in a collective the bad rank never joins."""
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=device)
    _all_gather_single(
        flags, torch.tensor([int(error is None)], dtype=torch.int64, device=device), group=group
    )
    failed = [r for r, ok in enumerate(flags.tolist()) if not ok]
    if error is not None:
        raise error
    if failed:
        raise DistributedDPError(
            f"{what}: ranks {failed} failed (see their error); nothing was communicated or changed"
        )
