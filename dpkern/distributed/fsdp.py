"""FSDP2 exchanges: per-sample gradients to their shards (:func:`shard_grad_samples`) and
book-kept clipped sums reduce-scattered to the shards (:func:`reduce_scatter_clipped_sums`)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .lockstep import (
    _BUCKET_NUMEL,
    _all_gather_single,
    raise_if_any_failed,
    _reduce_scatter_single,
)
from ..sharding import chunk_rows, common_mesh, is_sharded, local_shard, row_numel


def mesh_group(params: Sequence[Tensor]):
    """The process group of the first DTensor's mesh (None = the default group)."""
    for p in params:
        if is_sharded(p):
            return p.device_mesh.get_group()
    return None


def _check_fsdp_params(params: Sequence[Tensor], what: str) -> None:
    """Every parameter a DTensor in FSDP2's layout, all on one mesh. Raises ValueError."""
    if common_mesh(params, what) is None:
        raise ValueError(
            f"{what}: every parameter must be a DTensor on one device mesh (FSDP2 fully_shard)"
        )
    for k, p in enumerate(params):
        local_shard(p, f"params[{k}]")  # validates the layout


@torch.no_grad()
def shard_grad_samples(params: Sequence[Tensor], grad_samples: Sequence[Tensor]) -> int:
    """Give every rank the per-sample gradients of ALL ranks' samples, on ITS shard.

    Under FSDP2 each rank computes per-sample gradients of its own B_r samples for whole
    parameters (on an unsharded replica refreshed from ``p.full_tensor()``: torch.func
    cannot trace an FSDP2 module), but owns only a shard of each parameter's coordinates
    and of its optimizer state. One ``all_to_all_single``
    sends rank k the rows of its shard: afterwards ``p.grad_sample`` on every rank has
    shape ``[B, *local_shard_shape]`` with B = sum_r B_r (samples in rank order), and the
    optimizer's ``step()`` clips with per-sample norms all-reduced over the shards ([B]
    floats) -- the coordinate-sharded per-sample path that DP-MacAdam needs (its clipping
    whitens every coordinate with state that lives on the owning rank). Communication:
    each rank sends and receives about B_r * d and B * d / W elements (d = trainable
    coordinates); a transient send buffer of B_r * d elements. Ghost clipping (no
    per-sample gradients) is the cheaper path for the other rules: see the module doc.

    Args:
        params: the optimizer's trainable parameters (``opt.trainable_params()``): FSDP2
            DTensors sharded on dim 0, all on one 1-D device mesh.
        grad_samples: per parameter, this rank's per-sample gradients, a plain tensor of
            shape ``[B_r, *p.shape]`` (global shape; B_r may be 0), any float dtype (sent
            as their common dtype; mixed dtypes are sent as float32, which rounds
            float64 inputs).
    Returns: B, the global number of samples (every rank gets the same).
    Raises: ValueError on a rank whose input is bad (not DTensors, meshes differ, wrong
        count, shape or B_r) and DistributedDPError on the others: the ranks agree on
        their inputs' validity first (a collective: every rank must call it).
    """
    params, grad_samples = list(params), list(grad_samples)
    error, B_r = None, 0
    try:
        B_r = _check_grad_samples(params, grad_samples)
    except ValueError as exc:
        error = exc
    raise_if_any_failed(
        error,
        mesh_group(params),
        params[0].device if params else torch.device("cpu"),
        "shard_grad_samples",
    )
    mesh = params[0].device_mesh
    group, world, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    dtypes = {g.dtype for g in grad_samples}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    device = params[0].device
    return _exchange_grad_samples(params, grad_samples, B_r, group, world, me, dtype, device)


def _check_grad_samples(params, grad_samples) -> int:
    """shard_grad_samples' local checks; returns B_r. Raises ValueError."""
    if len(params) != len(grad_samples):
        raise ValueError(
            f"shard_grad_samples: {len(grad_samples)} grad_samples for {len(params)} parameters"
        )
    if not params:
        raise ValueError("shard_grad_samples: no parameters")
    _check_fsdp_params(params, "shard_grad_samples")
    B_r = None
    for k, (p, g) in enumerate(zip(params, grad_samples)):
        if (
            not isinstance(g, Tensor)
            or is_sharded(g)
            or not g.is_floating_point()
            or tuple(g.shape[1:]) != tuple(p.shape)
            or g.device != p.device
        ):
            raise ValueError(
                f"grad_samples[{k}]: expected a plain float tensor "
                f"[B_r, *{tuple(p.shape)}] on {p.device}"
            )
        if B_r is None:
            B_r = g.shape[0]
        elif g.shape[0] != B_r:
            raise ValueError(f"grad_samples[{k}]: {g.shape[0]} rows, others {B_r}")
    return B_r


def _exchange_grad_samples(params, grad_samples, B_r, group, world, me, dtype, device) -> int:
    """shard_grad_samples' communication (inputs checked on every rank)."""
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    _all_gather_single(sizes, torch.tensor([B_r], dtype=torch.int64, device=device), group=group)
    sizes = sizes.tolist()

    def cols(rank):  # elements per sample that rank owns, param by param
        out = []
        for p in params:
            first, end = chunk_rows(p.shape[0], world, rank)
            out.append((end - first) * row_numel(p))
        return out

    def block(rank):  # a [B_r, n_rank] block (the params' slices side by side), flattened
        if not B_r:
            return torch.zeros(0, dtype=dtype, device=device)
        return torch.cat(
            [
                g[:, slice(*chunk_rows(p.shape[0], world, rank))].reshape(B_r, -1).to(dtype)
                for p, g in zip(params, grad_samples)
            ],
            dim=1,
        ).reshape(-1)

    mine = cols(me)
    blocks = [block(rank) for rank in range(world)]
    out = torch.empty(sum(sizes) * sum(mine), dtype=dtype, device=device)
    dist.all_to_all_single(
        out,
        torch.cat(blocks),
        output_split_sizes=[b * sum(mine) for b in sizes],
        input_split_sizes=[blk.numel() for blk in blocks],
        group=group,
    )
    B = sum(sizes)
    rows = out.view(B, sum(mine))
    pos = 0
    for p, n in zip(params, mine):
        local = p.to_local()
        p.grad_sample = rows[:, pos : pos + n].reshape(B, *local.shape).contiguous()
        pos += n
    return B


@torch.no_grad()
def reduce_scatter_clipped_sums(
    params: Sequence[Tensor],
    clipped_sums: Sequence[Tensor | None],
    bucket_numel: int = _BUCKET_NUMEL,
) -> list[Tensor]:
    """SUM over ranks of each rank's full-shape clipped sums, each rank keeping its shard.

    For ghost clipping under FSDP2: book-keeping builds sum_i c_i g_i of this rank's
    samples with each parameter's full shape (the layers ran unsharded); this SUMs them
    over the mesh and returns this rank's shard of each, as a DTensor like ``p`` (ready
    for ``optimizer.accumulate_clipped``). Parameters are packed into buckets of at most
    ``bucket_numel`` elements, one reduce-scatter each (rows padded to the
    torch.chunk layout; the padding is dropped). A collective: every rank calls it.

    Args:
        params: the optimizer's trainable parameters, FSDP2 DTensors on one 1-D mesh.
        clipped_sums: per parameter, a plain float tensor of the parameter's global shape,
            or None (unused on this rank: zeros, still communicated).
    Returns: list of float32 DTensors (Shard(0)), one per parameter.
    Raises: ValueError on a rank whose input is bad (count, shapes, non-DTensor
        parameters), DistributedDPError on the others (the ranks agree on their inputs'
        validity first; nothing is reduced)."""
    params, clipped_sums = list(params), list(clipped_sums)
    error = None
    try:
        _check_clipped_sums(params, clipped_sums)
    except ValueError as exc:
        error = exc
    raise_if_any_failed(
        error,
        mesh_group(params),
        params[0].device if params else torch.device("cpu"),
        "reduce_scatter_clipped_sums",
    )
    return _reduce_scatter(params, clipped_sums, bucket_numel)


def _check_clipped_sums(params, clipped_sums) -> None:
    """reduce_scatter_clipped_sums' local checks. Raises ValueError."""
    if len(params) != len(clipped_sums) or not params:
        raise ValueError(
            f"reduce_scatter_clipped_sums: {len(clipped_sums)} sums for {len(params)} parameters"
        )
    _check_fsdp_params(params, "reduce_scatter_clipped_sums")
    for k, (p, s) in enumerate(zip(params, clipped_sums)):
        if s is not None and (
            not isinstance(s, Tensor)
            or is_sharded(s)
            or tuple(s.shape) != tuple(p.shape)
            or s.device != p.device
            or not s.is_floating_point()
        ):
            raise ValueError(
                f"clipped_sums[{k}]: expected None or a plain float tensor of "
                f"shape {tuple(p.shape)} on {p.device}"
            )


def _reduce_scatter(params, clipped_sums, bucket_numel) -> list[Tensor]:
    """reduce_scatter_clipped_sums' communication (inputs checked on every rank)."""
    from torch.distributed.tensor import DTensor

    mesh = params[0].device_mesh
    group, world = mesh.get_group(), mesh.size()
    out: list[Tensor] = [None] * len(params)

    def padded_rows(p):
        return -(-p.shape[0] // world)

    def flush(idx):
        blocks = []
        for rank in range(world):
            for k in idx:
                p, s = params[k], clipped_sums[k]
                first, end = chunk_rows(p.shape[0], world, rank)
                block = torch.zeros(
                    (padded_rows(p), *p.shape[1:]), dtype=torch.float32, device=p.device
                )
                if s is not None:
                    block[: end - first] = s[first:end]
                blocks.append(block.reshape(-1))
        flat = torch.cat(blocks)
        mine = torch.empty(flat.numel() // world, dtype=torch.float32, device=flat.device)
        _reduce_scatter_single(mine, flat, op=dist.ReduceOp.SUM, group=group)
        pos = 0
        for k in idx:
            p = params[k]
            local = local_shard(p)[0]
            n = padded_rows(p) * row_numel(p)
            shard = mine[pos : pos + n].view(padded_rows(p), *p.shape[1:])[: local.shape[0]]
            out[k] = DTensor.from_local(
                shard.contiguous(),
                mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
            pos += n

    idx, size = [], 0
    for k, p in enumerate(params):
        n = padded_rows(p) * world * row_numel(p)
        if idx and size + n > bucket_numel:
            flush(idx)
            idx, size = [], 0
        idx.append(k)
        size += n
    if idx:
        flush(idx)
    return out
