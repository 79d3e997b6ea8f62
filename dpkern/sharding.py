"""Coordinate-sharded parameters (FSDP2 ``fully_shard``): where a rank's shard sits in the
global noise index space.

The noise stream (SPEC section 3) is indexed by the GLOBAL flat element index: parameter
k's element j has index offset_k + j, offset_k = numel of the trainable parameters before
it (noise-index order). A rank holding only a shard of parameter k must draw the noise of
exactly the shard's global indices; drawing at LOCAL indices (0 ... local numel - 1) would
hand every rank the same noise -- correlated noise, a privacy failure.

FSDP2 shards every parameter on dim 0 over a 1-D device mesh, cutting rows like
``torch.chunk``: ceil(n / W) rows per rank, the last ranks possibly short or empty. A
rank's rows are a contiguous run of the row-major flattening, so its shard is the global
index range [offset_k + first_row * row_numel, + local numel). FSDP2's padding is not
part of the local tensor and consumes no index.
"""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

__all__ = ["is_sharded", "local_shard", "shard_offsets"]


def is_sharded(p: Tensor) -> bool:
    """True for a DTensor (FSDP2 parameter or gradient)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(p, DTensor)


def local_shard(p: Tensor, name: str = "parameter") -> tuple[Tensor, int]:
    """This rank's part of ``p`` and the flat index (within ``p``) of its first element.

    Args:
        p: a plain tensor (returned detached, start 0) or a DTensor sharded on dim 0 over a
            1-D mesh (FSDP2's layout; fully_shard never shards 0-dim parameters).
        name: how errors refer to ``p``.
    Returns: (local tensor -- a view sharing ``p``'s storage, so in-place updates reach the
        parameter --, start index: int).
    Raises: ValueError for other placements (Shard(d > 0), Replicate, 2-D meshes) or a
        local shard whose size does not match the torch.chunk layout."""
    if not is_sharded(p):
        return p.detach(), 0
    from torch.distributed.tensor import Shard
    if len(p.placements) != 1 or p.placements[0] != Shard(0):
        raise ValueError(f"{name}: placements {p.placements} are not supported (dpkern "
                         "handles FSDP2's Shard(0) on a 1-D mesh)")
    local, n_rows = p.to_local(), p.shape[0]
    world, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
    per_rank = -(-n_rows // world)
    first = min(rank * per_rank, n_rows)
    if local.shape[0] != min(per_rank, n_rows - first) \
            or tuple(local.shape[1:]) != tuple(p.shape[1:]):
        raise ValueError(f"{name}: local shard {tuple(local.shape)} does not match "
                         f"torch.chunk rows of {tuple(p.shape)} on rank {rank}")
    row_numel = p.numel() // n_rows if n_rows else 0
    return local.detach(), first * row_numel


def shard_offsets(params: Sequence[Tensor]) -> list[tuple[Tensor, int]]:
    """Local shard and GLOBAL noise index of its first element, for each parameter.

    ``params``: the trainable parameters in noise-index order (plain tensors or FSDP2
    DTensors, see :func:`local_shard`).
    Returns: list of (local tensor, global flat offset: int).
    Raises: ValueError (see :func:`local_shard`)."""
    out, offset = [], 0
    for k, p in enumerate(params):
        local, start = local_shard(p, f"params[{k}]")
        out.append((local, offset + start))
        offset += p.numel()
    return out
