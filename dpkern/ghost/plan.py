"""The route of each parameter in one ghost step: norm and clipped sum from its uses.

Two exact routes give a parameter's per-sample squared norms ``||g_i||^2`` and its
clipped sum ``sum_i c_i g_i`` from the uses of :mod:`.norms`:

- **ghost**: the norm without any per-sample gradient (Gram path, segment sums, tied
  cross terms: :func:`.norms.param_norm_sq`) and the sum by book-keeping
  (:func:`.bookkeeping.clipped_sum`: one GEMM per Linear over the ``B*T`` rows);
- **kept**: the per-sample gradients ``g_i`` formed once (``G_i^T A_i`` as one batched
  GEMM, the embedding rows by an index-add (:func:`.norms.add_sample_rows`), the rows of biases and norm
  layers copied), their squared norms taken right away, and the clipped sum later as one
  matrix-vector product ``c^T [g_1; ...; g_B]``. Forming them costs the weight-gradient
  GEMM the non-private backward does anyway (the ghost backward skips it), so the norm
  costs two passes over ``B x numel`` values instead of ``B T^2 (d + p)`` Gram flops;
  memory ``B x numel``.

:func:`plan_routes` keeps a parameter when that is cheaper by the cost model below and
the kept gradients fit in ``keep_bytes`` (greedy, largest saving per byte first): Bu et
al. 2023's per-layer choice between ghost norm and instantiation, with the instantiated
gradients also reused for the sum. Small kept parameters (biases, norm weights) share one
``[B, n]`` block, so their norms and sums are one reduction each.

A kept parameter can also be formed **early** (:func:`plan_early`, :class:`Formed`):
during the backward, each use added into its per-sample gradient as its output gradient
arrives (a pre-hook on the op's graph node), after which the use's activation and output
gradient are let go instead of being held to the end of the backward. Chosen where the
per-sample gradients take fewer bytes than the tensors of the uses (LoRA adapters: ``B r
(d + p)`` against ``B T (d + p)``) and the kept route still wins with the parameter's
summed gradient added (at worst autograd computes it: requesting it is what makes the
backward reach a use whose activation needs no grad; a use whose activation requires grad
is reached through it, and that GEMM is skipped: :func:`.early.requests`).
Not under FSDP2 (DTensor parameters) nor with ``check``.

Cost model (multiply-add equivalents, calibrated on CPU; every choice is exact, the model
only picks the faster): a Gram flop counts :data:`GRAM_WEIGHT`, a pass over one element
:data:`ELEMENT`, a torch call :data:`CALL`. For a Linear ``[B, T, d] -> [B, T, p]`` the
kept route wins when ``3 ELEMENT d p < GRAM_WEIGHT T^2 (d + p)``: at T = 64 when
``dp / (d + p) < 170`` (GPT-2 and Llama-style layers of width 128), never at T = 1 or 4.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .bookkeeping import clipped_sum
from .norms import (
    DEFAULT_CHUNK_BYTES,
    IndexUse,
    OuterUse,
    RowsUse,
    acc_dtype,
    add_sample_rows,
    clamp_norm_sq,
    no_tf32,
    param_norm_sq,
)

__all__ = ["DEFAULT_KEEP_BYTES", "Formed", "Plan", "plan_early", "plan_routes", "route_costs"]

#: Floor of the memory for kept per-sample gradients (``keep_bytes=None`` allows the
#: larger of this and the bytes of the recorded activations and output gradients).
DEFAULT_KEEP_BYTES = 256 * 2**20
GRAM_WEIGHT = 2.0  # a Gram multiply-add (small batched GEMMs, then a T x T product)
ELEMENT = 16.0  # one read or write of one element (memory bound)
CALL = float(1 << 18)  # one torch call (dispatch, allocation)
SMALL = 4096  # kept parameters up to this many elements share one block (copied in: see add_use)


def _outer3(u: OuterUse):
    o = u.out if u.out.dim() == 3 else u.out.unsqueeze(1)
    x = u.inp if u.inp.dim() == 3 else u.inp.unsqueeze(1)
    return o, x


def route_costs(uses: list, shape, B: int) -> tuple[float, float]:
    """``(ghost, kept)``: the cost model's estimate of one parameter's norm and clipped
    sum by each route (see the module doc)."""
    numel = math.prod(shape)
    outer = [u for u in uses if isinstance(u, OuterUse)]
    index = [u for u in uses if isinstance(u, IndexUse)]
    rows = [u for u in uses if isinstance(u, RowsUse)]
    E = ELEMENT
    # the norm and the sum read every element once (small ones: in a shared block)
    kept = 2 * E * B * numel + (3 * CALL if numel > SMALL else 0.0)
    ghost = 0.0
    T = sum(_outer3(u)[0].shape[1] for u in outer)
    if outer:
        P0, P1 = _outer3(outer[0])[0].shape[2], _outer3(outer[0])[1].shape[2]
        gemm = B * T * P0 * P1
        if T == 1:
            norm = 2 * E * B * (P0 + P1)
        else:
            norm = min(GRAM_WEIGHT * B * T * T * (P0 + P1), gemm + E * B * numel)
        ghost += norm + gemm + E * B * T * P0 + 6 * CALL * len(outer)
        kept += gemm + E * B * numel + 2 * CALL * len(outer)
    if index:
        Ti = sum(u.ids.shape[1] for u in index)
        P1 = index[0].g.shape[2]
        ghost += 6 * E * B * Ti * P1 + 8 * CALL
        kept += E * (B * numel * (not outer) + 2 * B * Ti * P1) + 3 * CALL
        if outer:
            ghost += B * Ti * T * P1 + 3 * E * B * Ti * T + 4 * CALL
    if rows:
        n = B * numel * len(rows)
        # (the ghost route forms a mixed parameter's per-sample gradient anyway)
        ghost += 2 * E * n + 4 * CALL + (kept if outer or index else 0.0)
        kept += E * n + CALL * len(rows)
    return ghost, kept


def _recorded_bytes(uses) -> int:
    seen, total = set(), 0
    for us in uses:
        for u in us or ():
            ts = (
                (u.out, u.inp)
                if isinstance(u, OuterUse)
                else (u.ids, u.g)
                if isinstance(u, IndexUse)
                else (u.rows,)
            )
            for t in ts:
                key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
                if key not in seen:
                    seen.add(key)
                    total += t.numel() * t.element_size()
    return total


def plan_routes(
    params, uses, B: int, keep_bytes: int | None = None, reserved: int = 0
) -> list[bool]:
    """Which parameters take the kept route (True) rather than the ghost route.

    Args: params / uses: the capture's parameters and their uses (empty: unused);
    B: the batch; keep_bytes: memory allowed for kept per-sample gradients (None: the
    larger of :data:`DEFAULT_KEEP_BYTES` and the recorded tensors' bytes; 0: none);
    reserved: bytes of that allowance already taken (:class:`Formed`)."""
    if keep_bytes is None:
        keep_bytes = max(DEFAULT_KEEP_BYTES, _recorded_bytes(uses))
    cands = []
    for k, (p, us) in enumerate(zip(params, uses)):
        if not us or B == 0:
            continue
        ghost, kept = route_costs(us, tuple(p.shape), B)
        if kept < ghost:
            dt = acc_dtype(*(t for u in us for t in _floats(u)))
            nbytes = B * p.numel() * torch.finfo(dt).bits // 8
            cands.append(((ghost - kept) / max(nbytes, 1), k, nbytes))
    return _greedy(cands, len(params), keep_bytes - reserved)


def _greedy(cands, n: int, left: int) -> list[bool]:
    """``cands`` ``(gain, k, nbytes)`` taken largest gain first (ties: lower k) while their
    bytes fit in ``left``; a mask over ``n`` parameters."""
    chosen = [False] * n
    for _, k, nbytes in sorted(cands, key=lambda c: (-c[0], c[1])):
        if nbytes <= left:
            chosen[k] = True
            left -= nbytes
    return chosen


def _floats(u):
    if isinstance(u, OuterUse):
        return (u.out, u.inp)
    return (u.g,) if isinstance(u, IndexUse) else (u.rows,)


_KIND_ORDER = {OuterUse: 0, IndexUse: 1, RowsUse: 2}


def add_use(v: Tensor, u, first: bool) -> None:
    """Add one use's per-sample gradient into ``v`` ``[B, numel]`` (a row-strided view
    whose rows are contiguous), in ``v``'s dtype; ``first``: write instead (``v``'s old
    values are ignored)."""
    B, dt = v.shape[0], v.dtype
    if isinstance(u, OuterUse):
        o, x = _outer3(u)
        P0, P1 = o.shape[2], x.shape[2]
        w = v.view(B, P0, P1)
        o, x = o.to(dt), x.to(dt)
        # On CPU the batched GEMM is one MKL call only into a contiguous result (into a
        # column slice of a shared block torch loops over the samples, one addmm each),
        # and MKL is several times slower with a very narrow last dimension (a LoRA
        # lora_B [p, r], r < 16: formed as its transpose x^T o, then copied in; 84 us
        # against 28 us at p = 128, r = 8, B = 16, T = 64 on 2 cores).
        narrow = P1 < 16 and P1 < P0
        if w.is_contiguous() and not narrow:
            if first:
                torch.bmm(o.transpose(1, 2), x, out=w)
            else:
                w.baddbmm_(o.transpose(1, 2), x)
            return
        if narrow:
            prod, w = torch.bmm(x.transpose(1, 2), o), w.transpose(1, 2)
        else:
            prod = torch.bmm(o.transpose(1, 2), x)
        if first:
            w.copy_(prod)
        else:
            w.add_(prod)
    elif isinstance(u, IndexUse):
        if first:
            v.zero_()
        # (into a column slice of a shared block: through a contiguous temporary)
        rows = v if v.is_contiguous() else torch.zeros(v.shape, dtype=dt, device=v.device)
        add_sample_rows(rows, u)
        if rows is not v:
            v.add_(rows)
    else:
        r = u.rows.reshape(B, -1)
        if first:
            v.copy_(r)
        else:
            v.add_(r)


def form_into(v: Tensor, uses: list, shape) -> None:
    """Write the per-sample gradient of one parameter (the sum of its uses) into ``v``
    ``[B, numel]`` (a row-strided view whose rows are contiguous), in ``v``'s dtype."""
    ordered = sorted(uses, key=lambda u: _KIND_ORDER[type(u)])  # (stable)
    for k, u in enumerate(ordered):
        add_use(v, u, k == 0)


def plan_early(params, uses, B: int, keep_bytes: int | None = None) -> list[bool]:
    """Which parameters to form *during* the backward, each use added as its output
    gradient arrives, so that the activation and output gradient it holds are freed at
    once instead of kept to the end of the backward (the memory of the book-keeping
    route; LoRA adapters: ``B x r x (d + p)`` formed instead of ``B x T x (d + p)`` held).

    A parameter is formed early when the kept route wins by :func:`route_costs` even with
    its summed weight gradient added (at worst autograd computes it; see the module doc)
    and its per-sample gradients take fewer
    bytes than the tensors of its uses; greedy by bytes saved within ``keep_bytes``
    (None: :data:`DEFAULT_KEEP_BYTES`; 0: none). ``uses``: shape-only (e.g. meta) uses."""
    if keep_bytes == 0 or B == 0:
        return [False] * len(params)
    left = DEFAULT_KEEP_BYTES if keep_bytes is None else keep_bytes
    cands = []
    for k, (p, us) in enumerate(zip(params, uses)):
        if not us:
            continue
        ghost, kept = route_costs(us, tuple(p.shape), B)
        gemm = 0
        for u in us:
            if isinstance(u, OuterUse):
                o, x = _outer3(u)
                gemm += B * o.shape[1] * o.shape[2] * x.shape[2]
        floats = [t for u in us for t in _floats(u)]
        held = sum(t.numel() * t.element_size() for t in floats)
        nbytes = B * p.numel() * torch.finfo(acc_dtype(*floats)).bits // 8
        if kept + gemm < ghost and nbytes < held:
            cands.append((held - nbytes, k, nbytes))
    return _greedy(cands, len(params), left)


class Formed:
    """Per-sample gradients formed during the backward (:func:`plan_early`): one
    ``[B, sum numel]`` block of ``dtype``, members ``(k, offset, numel)`` in ``params``'
    order; :meth:`add` adds one use of parameter ``k`` (the first use of a member writes
    its columns: the block is not zeroed first); :meth:`finish` zeroes the members that got
    no use and returns the block."""

    def __init__(self, params, chosen, B: int, dtype, device):
        self.members, a = [], 0
        for k, keep in enumerate(chosen):
            if keep:
                self.members.append((k, a, params[k].numel()))
                a += params[k].numel()
        self.buf = torch.empty(B, a, dtype=dtype, device=device)
        self._views = {k: self.buf[:, o : o + n] for k, o, n in self.members}
        self._written: set[int] = set()
        self.slot = {id(params[k]): k for k, _, _ in self.members}
        self.nbytes = self.buf.numel() * self.buf.element_size()

    def add(self, k: int, use) -> None:
        with no_tf32():
            add_use(self._views[k], use, first=k not in self._written)
        self._written.add(k)

    def finish(self) -> Tensor:
        """The block, every member that got no use zeroed (a parameter whose uses were all
        unreached by the loss has a zero per-sample gradient)."""
        for k, _, _ in self.members:
            if k not in self._written:
                self._views[k].zero_()
                self._written.add(k)
        return self.buf


class Plan:
    """One step's norms and clipped sums of every parameter by its route.

    Args:
        params: the trainable parameters (norm order); uses: one list per parameter
            (empty: unused), taken over: a kept parameter's entry is emptied once its
            per-sample gradient is formed (its tensors can be freed); B: the batch.
        outer_fn, chunk_bytes: the ghost route's Gram options (:func:`.norms.param_norm_sq`).
        keep_bytes: see :func:`plan_routes`; keep_uses: keep the kept parameters' uses
            (for ``GhostClipping(check=True)``), else they are dropped once formed;
            device: of the norms when no parameter is used; formed: per-sample gradients
            formed during the backward (their parameters' ``uses`` are empty).
    The kept per-sample gradients are formed (and their norms taken) on construction."""

    def __init__(
        self,
        params,
        uses,
        B: int,
        *,
        outer_fn=None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        keep_bytes: int | None = None,
        keep_uses: bool = False,
        device: torch.device | None = None,
        formed: Formed | None = None,
    ):
        self.params, self.B, self.device = list(params), B, device
        self.uses = uses if isinstance(uses, list) else list(uses)
        self.outer_fn, self.chunk_bytes = outer_fn, chunk_bytes
        reserved = formed.nbytes if formed is not None else 0
        self.kept = plan_routes(self.params, self.uses, B, keep_bytes, reserved)
        ks = [k for k, keep in enumerate(self.kept) if keep]
        self.blocks: list[tuple[Tensor, list[tuple[int, int, int]]]] = []
        self._norms: dict[int, Tensor] = {}  # kept big parameter -> [B]
        self._block_norms: list[Tensor] = []
        if formed is not None and formed.members:
            for k, _, _ in formed.members:
                self.kept[k] = True
            self._add_block(formed.finish(), formed.members)
        if not ks:
            return
        dt = acc_dtype(*(t for k in ks for u in self.uses[k] for t in _floats(u)))
        device = next(iter(_floats(self.uses[ks[0]][0]))).device
        small = [k for k in ks if self.params[k].numel() <= SMALL]
        with no_tf32():
            for k in ks:
                if self.params[k].numel() > SMALL:
                    buf = torch.empty(B, self.params[k].numel(), dtype=dt, device=device)
                    form_into(buf, self.uses[k], self.params[k].shape)
                    self._add_block(buf, [(k, 0, buf.shape[1])])
                    self._norms[k] = self._block_norms[-1]
                    if not keep_uses:  # its activations and output gradients can go now
                        self.uses[k] = []
            if small:
                sizes = [self.params[k].numel() for k in small]
                buf = torch.empty(B, sum(sizes), dtype=dt, device=device)
                members, a = [], 0
                for k, n in zip(small, sizes):
                    form_into(buf[:, a : a + n], self.uses[k], self.params[k].shape)
                    members.append((k, a, n))
                    a += n
                    if not keep_uses:
                        self.uses[k] = []
                self._add_block(buf, members)

    def _add_block(self, buf: Tensor, members) -> None:
        self.blocks.append((buf, members))
        self._block_norms.append(torch.linalg.vector_norm(buf, dim=1).square())

    def each(self) -> list[Tensor | None]:
        """Per-parameter squared norms ``[B]`` (None: unused), as :func:`param_norm_sq`."""
        out: list[Tensor | None] = [None] * len(self.params)
        for buf, members in self.blocks:
            for k, a, n in members:
                out[k] = self._norms.get(k)
                if out[k] is None:
                    out[k] = torch.linalg.vector_norm(buf[:, a : a + n], dim=1).square()
        for k, us in enumerate(self.uses):
            if us and not self.kept[k]:
                out[k] = self._ghost_norm(k)
        return out

    def _ghost_norm(self, k: int) -> Tensor:
        return param_norm_sq(
            self.uses[k],
            self.params[k].shape,
            self.B,
            outer_fn=self.outer_fn,
            chunk_bytes=self.chunk_bytes,
        )

    def norm_sq(self, each: list[Tensor | None] | None = None) -> Tensor:
        """Per-sample squared norms of the whole gradient ``[B]`` (float32, float64 for a
        float64 model), the sum of ``each`` (given: the per-parameter ones) or of the
        blocks' norms and the ghost-route parameters' norms; clamped at 0 (see
        :func:`.norms.clamp_norm_sq`)."""
        if each is not None:
            parts = [n for n in each if n is not None]
        else:
            parts = list(self._block_norms)
            parts += [
                self._ghost_norm(k) for k, us in enumerate(self.uses) if us and not self.kept[k]
            ]
        dt = torch.float64 if any(n.dtype == torch.float64 for n in parts) else torch.float32
        device = parts[0].device if parts else self.device
        total = torch.zeros(self.B, dtype=dt, device=device)
        for n in parts:
            total += n
        return clamp_norm_sq(total)

    def sums(self, c: Tensor, drop: Tensor | None = None) -> list[Tensor | None]:
        """``sum_i c_i g_i`` of every parameter, float32 shaped like it (None: unused);
        samples in ``drop`` (bool ``[B]``) are left out entirely (never multiplied)."""
        out: list[Tensor | None] = [None] * len(self.params)
        keep = (~drop).nonzero().flatten() if drop is not None else None
        for buf, members in self.blocks:
            cb, rows = c.to(buf.dtype), buf
            if keep is not None:
                cb, rows = cb[keep], buf.index_select(0, keep)
            with no_tf32():
                s = cb @ rows
            s = s.float()
            for k, a, n in members:
                out[k] = s[a : a + n].view(self.params[k].shape)
        for k, us in enumerate(self.uses):
            if us and not self.kept[k]:
                out[k] = clipped_sum(us, self.params[k].shape, c, drop)
        return out
