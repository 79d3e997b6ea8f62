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

__all__ = ["chunk_rows", "common_mesh", "is_sharded", "local_shard", "row_numel", "shard_offsets"]


def is_sharded(p: Tensor) -> bool:
    """True for a DTensor (FSDP2 parameter or gradient)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(p, DTensor)


def common_mesh(params: Sequence[Tensor], what: str):
    """The one device mesh of ``params`` if they are all DTensors, None if none is.

    Raises: ValueError (``what`` names the caller) if plain tensors and DTensors are mixed
    (a replicated tensor's partial norms would be counted once per rank) or meshes differ."""
    sharded = [p for p in params if is_sharded(p)]
    if not sharded:
        return None
    meshes = {id(p.device_mesh) for p in sharded}
    if len(sharded) != len(params) or len(meshes) > 1:
        raise ValueError(
            f"{what}: every parameter must be a DTensor on one device mesh "
            "(FSDP2 fully_shard; apply it to the root module too); got "
            f"{len(sharded)} DTensors among {len(params)} parameters on "
            f"{len(meshes)} meshes"
        )
    return sharded[0].device_mesh


def chunk_rows(n_rows: int, world: int, rank: int) -> tuple[int, int]:
    """[first, end) of the dim-0 rows ``rank`` holds under FSDP2's torch.chunk layout:
    ceil(n_rows / world) rows per rank, the last ranks possibly short or empty."""
    per_rank = -(-n_rows // world)
    first = min(rank * per_rank, n_rows)
    return first, min(first + per_rank, n_rows)


def row_numel(p: Tensor) -> int:
    """Elements per dim-0 row of ``p`` (0 for a tensor with no rows)."""
    return p.numel() // p.shape[0] if p.shape[0] else 0


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
        raise ValueError(
            f"{name}: placements {p.placements} are not supported (dpkern "
            "handles FSDP2's Shard(0) on a 1-D mesh)"
        )
    local, rank = p.to_local(), p.device_mesh.get_local_rank()
    first, end = chunk_rows(p.shape[0], p.device_mesh.size(), rank)
    if local.shape[0] != end - first or tuple(local.shape[1:]) != tuple(p.shape[1:]):
        raise ValueError(
            f"{name}: local shard {tuple(local.shape)} does not match "
            f"torch.chunk rows of {tuple(p.shape)} on rank {rank}"
        )
    return local.detach(), first * row_numel(p)


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
