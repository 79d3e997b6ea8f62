"""What the capture knows about a tensor: where its batch dimension is (layouts), and which
parameter it is a view, cast, transpose or affine image of (forms). See :mod:`.capture`.

Layouts are proven from the forward's arguments, never guessed from a shape:

- ``LEAD``: dim 0 holds the B samples (the forward's tensor arguments with B rows, and
  what rules below derive from them);
- ``FLAT``: dim 0 is the batch-major flattening of the samples with the next dims
  (``x.view(-1, d)`` of a LEAD tensor), so ``reshape(B, -1, ...)`` restores them;
- ``UNKNOWN``: depends on the samples, in an unproven layout (dim 0 moved or reduced).
A tensor with no layout does not depend on the samples (constants, buffers, positions
from ``arange``): its dim 0 is never taken for the batch, even when it equals B.

The rule (:func:`_one`) is an allowlist: LEAD / FLAT pass only through the views and moves
ruled on here and the operations of :mod:`.batch_ops` known to keep the samples apart
along dim 0; any other operation on a sample-dependent tensor gives UNKNOWN.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .batch_ops import _ADDS, _CASTS, _DIMMOVES, _DIVS, _EXPANDS, _MULS, _NEGS  # noqa: F401
from .batch_ops import _RESHAPES, _RSUBS, _SUBS, _TRANSPOSES, _VIEWLIKE, INPLACE_ADDS  # noqa: F401
from .batch_ops import EW, FLAT, KIND, LEAD, MAXMIN, ROW, UNKNOWN, WHERE, _arg, _kept
from .batch_ops import _row, kind_layout

_T = torch.Tensor


class Tracker:
    """A map keyed by tensor identity that does not keep tensors alive."""

    def __init__(self):
        self._d: dict[int, tuple] = {}

    def get(self, t):
        e = self._d.get(id(t))
        if e is None:
            return None
        ref, value = e
        return value if ref() is t else None

    def put(self, t, value) -> None:
        self._d[id(t)] = (weakref.ref(t), value)


def layout_of(layouts: Tracker, t) -> str | None:
    return layouts.get(t) if isinstance(t, Tensor) else None


@dataclass(frozen=True)
class Form:
    """A tensor equal to ``scale * view(param)`` (+ a constant), where view is the
    identity, a 2-D transpose (``transposed``) or a reshape to ``shape``."""

    param: Tensor
    transposed: bool = False
    scale: float = 1.0
    shape: tuple | None = None

    def rows_to_param(self, rows: Tensor) -> Tensor:
        """Per-sample gradients w.r.t. this form ``[B, *form shape]`` -> w.r.t. the
        parameter ``[B, *param.shape]``."""
        B = rows.shape[0]
        if self.transposed:
            rows = rows.transpose(-1, -2)
        rows = rows.reshape(B, *self.param.shape)
        return rows * self.scale if self.scale != 1.0 else rows


def _scalar(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def param_form(param, cur, *, func=None, args=(), kwargs=None, forms=()):
    """The form of ``cur``: the identity form of ``param`` (``func`` None), or the form of
    the output ``cur`` of ``func`` applied to a single form with constants, or None."""
    if func is None:
        return Form(param)
    if len(forms) != 1 or not isinstance(cur, Tensor):
        return None
    t, f = forms[0]
    if not cur.requires_grad:
        return None
    others = [a for a in args if a is not t]
    if func in _CASTS:
        return f if tuple(cur.shape) == tuple(t.shape) else None
    if func in _TRANSPOSES or (
        func in _DIMMOVES
        and t.dim() == 2
        and cur.dim() == 2
        and tuple(cur.shape) == tuple(t.shape[::-1])
        and t.shape[0] != t.shape[1]
    ):
        if t.dim() != 2 or f.shape is not None:
            return None
        return replace(f, transposed=not f.transposed)
    if func in _RESHAPES:
        if f.transposed or cur.numel() != t.numel():
            return None
        return replace(f, shape=tuple(cur.shape))
    c = _scalar(others[0]) if len(others) == 1 and not kwargs else None
    if c is None and func in _NEGS and not others:
        return replace(f, scale=-f.scale)
    if c is None or func in {
        _T.__iadd__,
        _T.add_,
        _T.__isub__,
        _T.sub_,
        _T.__imul__,
        _T.mul_,
        _T.__itruediv__,
        _T.div_,
    }:
        return None  # (in place on a parameter: not a form)
    if func in _ADDS or func in _SUBS:
        return f if args[0] is t else None
    if func in _RSUBS:
        return replace(f, scale=-f.scale)
    if func in _MULS and c != 0:
        return replace(f, scale=f.scale * c)
    if func in _DIVS and args[0] is t and c != 0:
        return replace(f, scale=f.scale / c)
    return None


def _dim0_kept(func, args, kwargs, x: Tensor) -> bool:
    if func in (_T.transpose, torch.transpose, _T.swapaxes, torch.swapaxes):
        dims = [d % x.dim() for d in args[1:3]] if len(args) >= 3 else []
        return 0 not in dims
    if func in (_T.permute, torch.permute):
        perm = (
            args[1:]
            if len(args) > 1 and isinstance(args[1], int)
            else (args[1] if len(args) > 1 else kwargs.get("dims", ()))
        )
        return len(perm) > 0 and perm[0] % x.dim() == 0
    if func in (_T.movedim, torch.movedim):
        src, dst = args[1], args[2]
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        return 0 not in [s % x.dim() for s in src] and 0 not in [d % x.dim() for d in dst]
    return False


def _consumed(e) -> int:
    """How many dims of the indexed tensor an index entry consumes."""
    if e is None or e is Ellipsis or isinstance(e, bool):
        return 0
    if isinstance(e, Tensor) and e.dtype == torch.bool:
        return e.dim()
    return 1


def _index_keeps_dim0(index, x: Tensor) -> bool:
    """``x[index]`` keeps dim 0 in order: a full slice first, ``...`` first covering dim 0,
    or (HF's mask builders) an integer tensor equal to ``arange(n)`` along its dim 0; and
    no non-adjacent advanced indices (their dims would move to the front)."""
    idx = index if isinstance(index, tuple) else (index,)
    if not idx:
        return True
    adv = [k for k, e in enumerate(idx) if isinstance(e, (Tensor, list, tuple))]
    if adv and adv != list(range(adv[0], adv[0] + len(adv))):
        return False
    first, n = idx[0], x.shape[0]
    if first is Ellipsis:
        return sum(_consumed(e) for e in idx[1:]) < x.dim()
    if isinstance(first, slice) and first == slice(None):
        return True
    if (
        isinstance(first, Tensor)
        and not first.is_floating_point()
        and first.dim() >= 1
        and first.dtype != torch.bool
        and first.shape[0] == n
        and first.numel() == n
        and all(not isinstance(e, Tensor) or e.dim() <= first.dim() for e in idx[1:])
        and not any(isinstance(e, (list, tuple)) for e in idx[1:])
    ):
        return bool((first.reshape(-1) == torch.arange(n, device=first.device)).all())
    return False


_SHAPED = _VIEWLIKE | _EXPANDS
#: every func with a layout rule in :func:`_special` (the others: the tables of .batch_ops)
_SPECIAL = frozenset(
    _TRANSPOSES
    | _VIEWLIKE
    | _DIMMOVES
    | _EXPANDS
    | {torch.einsum, torch.functional.einsum, _T.__getitem__}
)


def _einsum_keeps(args, tainted) -> bool:
    eq = args[0] if isinstance(args[0], str) else None
    if eq is None or "->" not in eq or "..." in eq:
        return False
    ins, out = eq.replace(" ", "").split("->")
    ops = [a for a in args[1:] if isinstance(a, Tensor)]
    if len(ops) == 1 and isinstance(args[1], (list, tuple)):
        ops = list(args[1])
    letters = ins.split(",")
    firsts = {
        letters[k][0]
        for k, t in enumerate(ops)
        if k < len(letters) and letters[k] and any(t is u for u, _ in tainted)
    }
    return len(firsts) == 1 and out[:1] in firsts


def tainted_inputs(args, kwargs, layouts: Tracker) -> list:
    """``[(tensor, layout)]`` of the arguments that depend on the samples, in the order
    :func:`propagate` reads them: tensor args, tensors inside list / tuple args, tensor
    kwargs."""
    ins = [(a, layout_of(layouts, a)) for a in args if isinstance(a, Tensor)]
    ins += [
        (x, layout_of(layouts, x))
        for a in args
        if isinstance(a, (list, tuple))
        for x in a
        if isinstance(x, Tensor)
    ]
    ins += [(v, layout_of(layouts, v)) for v in kwargs.values() if isinstance(v, Tensor)]
    return [(t, lay) for t, lay in ins if lay is not None]


def _special(func, args, kwargs, out, tainted, B) -> str:
    """Views, moves, expands, transposes, einsum, indexing (of :data:`_SPECIAL`)."""
    src, lay = tainted[0]
    if func in (torch.einsum, torch.functional.einsum):
        return (
            LEAD
            if _einsum_keeps(args, tainted)
            and all(lay == LEAD for _, lay in tainted)
            and out.shape[0] == B
            else UNKNOWN
        )
    if src is not args[0]:  # a constant shaped / cast like a tainted one: its values
        return _kept(tainted, out, B) if func in _SHAPED else UNKNOWN
    if len(tainted) > 1 and func not in _SHAPED:
        return UNKNOWN  # (e.g. a sample-dependent index)
    if func in _TRANSPOSES:
        if src.dim() >= 2 and not (func is _T.mT.__get__ and src.dim() > 2):
            return UNKNOWN
        return _kept(tainted, out, B)
    if func in _EXPANDS:  # (broadcast rows: same rank, same dim 0)
        return lay if out.dim() == src.dim() and out.shape[0] == src.shape[0] else UNKNOWN
    if func in _VIEWLIKE:
        if lay == LEAD:
            if out.shape[0] == B and math.prod(src.shape[1:]) == math.prod(out.shape[1:]):
                return LEAD
            if out.shape[0] != B and any(
                math.prod(src.shape[:j]) == out.shape[0] for j in range(2, src.dim() + 1)
            ):
                return FLAT
            return UNKNOWN
        if lay == FLAT:
            if out.shape[0] == src.shape[0]:
                return FLAT
            if out.shape[0] == B and any(
                B * math.prod(out.shape[1:j]) == src.shape[0] for j in range(2, out.dim() + 1)
            ):
                return LEAD
        return UNKNOWN
    if func in _DIMMOVES:
        return lay if _dim0_kept(func, args, kwargs, src) else UNKNOWN
    if func is _T.__getitem__:
        keeps = _index_keeps_dim0(args[1], src) and out.shape[0] == src.shape[0]
        return lay if keeps else UNKNOWN
    return UNKNOWN


def _one(func, args, kwargs, out: Tensor, tainted: list, B, index: int = 0) -> str | None:
    """The layout of ``out`` (output ``index`` of ``func``); an allowlist: a func with no
    rule here or in :mod:`.batch_ops` gives UNKNOWN."""
    if not tainted:
        return None
    if out.dim() == 0:
        return UNKNOWN
    if func in _SPECIAL:
        return _special(func, args, kwargs, out, tainted, B)
    kind = KIND.get(func)
    if kind == EW:
        if func in WHERE and len(args) + len(kwargs) == 1:
            return UNKNOWN  # (where(cond): the indices of its nonzeros)
        return _kept(tainted, out, B)
    if kind == MAXMIN:
        if isinstance(_arg(args, kwargs, 1, "other"), Tensor):
            return _kept(tainted, out, B)
        kind = ROW
    if kind == ROW:
        return _row(func, args, kwargs, out, tainted, B)
    if kind is None:
        return UNKNOWN
    return kind_layout(kind, func, args, kwargs, out, tainted, B, index)


def propagate(func, args, kwargs, out, layouts: Tracker, B, tainted=None) -> str | None:
    """The layout of ``out`` (a tensor, or a tuple of tensors: each gets its own) after
    ``func(*args, **kwargs)``; None when no input depends on the samples. ``tainted``:
    :func:`tainted_inputs` of the call when the caller has it."""
    if tainted is None:
        tainted = tainted_inputs(args, kwargs, layouts)
    if isinstance(out, (tuple, list)):
        for k, o in enumerate(out):
            if isinstance(o, Tensor):
                lay = _one(func, args, kwargs, o, tainted, B, k)
                if lay is not None:
                    layouts.put(o, lay)
        return None
    return _one(func, args, kwargs, out, tainted, B)


def per_sample(x: Tensor, lay: str, B: int) -> Tensor:
    """A LEAD or FLAT tensor as ``[B, n, last]``."""
    return x.reshape(B, -1, x.shape[-1])


def reduce_rows(t: Tensor, shape) -> Tensor:
    """Per-sample ``t [B, *S]`` summed over the dims a tensor of ``shape`` was broadcast
    over (right-aligned), giving ``[B, *shape]``."""
    shape = tuple(shape)
    extra = t.dim() - 1 - len(shape)
    if extra > 0:
        t = t.sum(dim=tuple(range(1, 1 + extra)))
    elif extra < 0:
        t = t.reshape(t.shape[0], *([1] * -extra), *t.shape[1:])
    dims = tuple(1 + i for i, s in enumerate(shape) if s == 1 and t.shape[1 + i] != 1)
    if dims:
        t = t.sum(dim=dims, keepdim=True)
    return t.reshape(t.shape[0], *shape)


# -- in-place writes (``x[i] = v``, ``index_put_``, ``copy_`` into a view, ...) -----------
def row_aligned(v: Tensor, base: Tensor) -> bool:
    """Whether view ``v`` of ``base`` (contiguous) has ``base``'s rows as its dim 0, in
    order: ``v[i]`` lies inside ``base[i]`` for every i (``base[:, 2:]``, ``base[..., 0]``,
    not ``base[0]``, ``base[1:]``, ``base.view(-1)`` nor ``base.t()``). Read off the strides,
    so it holds for any chain of views. A view of a non-contiguous base: False."""
    if v.dim() == 0 or base.dim() == 0 or v.shape[0] != base.shape[0]:
        return False
    if (
        not base.is_contiguous()
        or v.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    ):
        return False
    n, row = base.shape[0], math.prod(base.shape[1:])
    if n > 1 and v.stride(0) != row:
        return False
    off = v.storage_offset() - base.storage_offset()
    span = sum((s - 1) * st for s, st in zip(v.shape[1:], v.stride()[1:]))
    return 0 <= off and off + span < max(row, 1) and v.numel() > 0


def _index_tensors(index) -> list:
    idx = index if isinstance(index, tuple) else (index,)
    out = []
    for e in idx:
        if isinstance(e, Tensor):
            out.append(e)
        elif isinstance(e, (list, tuple)):
            out += [x for x in e if isinstance(x, Tensor)]
    return out


def write_layout(dest: Tensor, lay, index, value, lay_of, B) -> tuple:
    """``(layout, harmless)`` of ``dest`` after ``dest[index] = value`` (``index_put_``
    too); ``lay`` its layout before, ``lay_of(t)`` the layout of another tensor. An
    allowlist, like :func:`_one`:

    - nothing written depends on the samples (constants, an untainted index): the layout
      is kept, ``harmless`` (no alias of ``dest`` changes layout);
    - a sample-dependent value written into every row in order (``dest[:, 1:] = h[:, :-1]``,
      ``dest[..., 0] = h[:, 3]``, the index keeping dim 0 as :func:`_index_keeps_dim0`
      says) with its own rows (same rank as the target, same dim 0): kept as
      :func:`.batch_ops._kept` of ``dest`` and the value;
    - a sample-dependent boolean mask of ``dest``'s shape, a constant written
      (``dest[dest > 0] = 0``): element-wise, kept;
    - anything else (a sample-dependent value written into chosen rows, ``dest[0] = h[1]``;
      a sample-dependent index): UNKNOWN."""
    idx = index if isinstance(index, tuple) else (index,)
    t_idx = [(t, lay_of(t)) for t in _index_tensors(idx)]
    t_idx = [(t, la) for t, la in t_idx if la is not None]
    v_lay = lay_of(value) if isinstance(value, Tensor) else None
    if not t_idx and v_lay is None:
        return lay, True
    own = [(dest, lay)] if lay is not None else []
    if dest.dim() == 0:
        return UNKNOWN, False
    if t_idx:
        m = idx[0]
        ok = (
            len(idx) == 1
            and isinstance(m, Tensor)
            and m.dtype == torch.bool
            and tuple(m.shape) == tuple(dest.shape)
            and v_lay is None
            and (not isinstance(value, Tensor) or value.numel() == 1)
        )
        return (_kept(own + t_idx, dest, B) if ok else UNKNOWN), False
    if not _index_keeps_dim0(idx, dest):
        return UNKNOWN, False
    with torch._C.DisableTorchFunction():
        target = dest[index]
    if (
        target.dim() == 0
        or target.shape[0] != dest.shape[0]
        or value.dim() != target.dim()
        or value.shape[0] != target.shape[0]
    ):
        return UNKNOWN, False
    return _kept([(value, v_lay)] + own, dest, B, same_rank=False), False
