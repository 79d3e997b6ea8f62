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
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace

import torch
from torch import Tensor

LEAD, FLAT, UNKNOWN = "lead", "flat", "unknown"

_T = torch.Tensor
_TRANSPOSES = {_T.t, torch.t, _T.T.__get__, _T.mT.__get__}
_CASTS = {_T.to, _T.float, _T.half, _T.bfloat16, _T.double, _T.type_as, _T.contiguous, _T.clone}
_RESHAPES = {
    _T.view,
    _T.reshape,
    torch.reshape,
    _T.unsqueeze,
    torch.unsqueeze,
    _T.squeeze,
    torch.squeeze,
    _T.flatten,
    torch.flatten,
    _T.view_as,
    _T.reshape_as,
}
_ADDS = {_T.add, torch.add, _T.__add__, _T.__radd__, _T.__iadd__, _T.add_}
_SUBS = {_T.sub, torch.sub, _T.__sub__, _T.__isub__, _T.sub_}
_RSUBS = {_T.__rsub__, torch.rsub}
_MULS = {_T.mul, torch.mul, _T.__mul__, _T.__rmul__, _T.__imul__, _T.mul_}
_DIVS = {_T.div, torch.div, _T.__truediv__, _T.__itruediv__, _T.div_}
_NEGS = {_T.neg, torch.neg, _T.__neg__}
INPLACE_ADDS = {_T.__iadd__, _T.add_, _T.__isub__, _T.sub_}
_VIEWLIKE = _CASTS | _RESHAPES | {_T.expand, _T.expand_as, _T.unflatten, torch.unflatten}
_DIMMOVES = {
    _T.transpose,
    torch.transpose,
    _T.swapaxes,
    torch.swapaxes,
    _T.permute,
    torch.permute,
    _T.movedim,
    torch.movedim,
}


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


def _index_keeps_dim0(index, n: int) -> bool:
    """``x[index]`` keeps dim 0 in order: a full slice or ``...`` first, or (HF's mask
    builders) an integer tensor equal to ``arange(n)`` along its dim 0."""
    first = index[0] if isinstance(index, tuple) and index else index
    if first is Ellipsis or (isinstance(first, slice) and first == slice(None)):
        return True
    if (
        isinstance(first, Tensor)
        and not first.is_floating_point()
        and first.dim() >= 1
        and first.dtype != torch.bool
        and first.shape[0] == n
        and first.numel() == n
    ):
        return bool((first.reshape(-1) == torch.arange(n, device=first.device)).all())
    return False


_DIM_FUNCS = {
    _T.sum,
    torch.sum,
    _T.mean,
    torch.mean,
    _T.softmax,
    torch.softmax,
    torch.nn.functional.softmax,
    _T.log_softmax,
    torch.log_softmax,
    torch.nn.functional.log_softmax,
    _T.cumsum,
    torch.cumsum,
    _T.cumprod,
    torch.cumprod,
    _T.index_select,
    torch.index_select,
    _T.gather,
    torch.gather,
    _T.flip,
    torch.flip,
    _T.roll,
    torch.roll,
    _T.std,
    torch.std,
    _T.var,
    torch.var,
    _T.amax,
    torch.amax,
    _T.amin,
    torch.amin,
    _T.max,
    torch.max,
    _T.min,
    torch.min,
    _T.prod,
    torch.prod,
    _T.logsumexp,
    torch.logsumexp,
    _T.norm,
    torch.norm,
    _T.argmax,
    torch.argmax,
    _T.any,
    torch.any,
    _T.all,
    torch.all,
    torch.cat,
    torch.concat,
    torch.stack,
    torch.nn.functional.normalize,
    _T.unbind,
    torch.unbind,
    _T.narrow,
    torch.narrow,
    _T.select,
    torch.select,
    _T.split,
    torch.split,
    _T.chunk,
    torch.chunk,
    _T.repeat_interleave,
    torch.repeat_interleave,
}


#: every func with a layout rule of its own in :func:`_one` (the others: the general rule)
_SPECIAL = frozenset(
    _DIM_FUNCS
    | _TRANSPOSES
    | _VIEWLIKE
    | _DIMMOVES
    | {torch.einsum, torch.functional.einsum, _T.expand, _T.expand_as, _T.__getitem__}
)


def _touches_dim0(func, args, kwargs, x: Tensor) -> bool:
    """Whether ``func`` reduces, reorders or selects along dim 0 (of ``x``)."""
    dim = kwargs.get("dim", kwargs.get("dims"))
    if dim is None and func in (torch.cat, torch.concat, torch.stack):
        dim = args[1] if len(args) > 1 else 0
    elif dim is None and func in (
        _T.split,
        torch.split,
        _T.chunk,
        torch.chunk,
        _T.repeat_interleave,
        torch.repeat_interleave,
    ):
        dim = (
            args[2]
            if len(args) > 2
            else 0
            if func in (_T.split, torch.split, _T.chunk, torch.chunk)
            else None
        )
    elif dim is None and len(args) > 1 and isinstance(args[1], (int, tuple, list)):
        dim = args[1]
    if dim is None:
        return True  # a full reduction
    dims = [dim] if isinstance(dim, int) else list(dim)
    n = max(x.dim(), 1)
    return any(isinstance(d, int) and d % n == 0 for d in dims)


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


def _one(func, args, kwargs, out: Tensor, tainted: list, B) -> str | None:
    if not tainted:
        return None
    if out.dim() == 0:
        return UNKNOWN
    src, lay = tainted[0]
    if func in _SPECIAL:  # (every other func takes the general rule at the end)
        if func in (torch.einsum, torch.functional.einsum):
            return (
                LEAD
                if _einsum_keeps(args, tainted)
                and all(lay == LEAD for _, lay in tainted)
                and out.shape[0] == B
                else UNKNOWN
            )
        if func in _DIM_FUNCS and _touches_dim0(func, args, kwargs, src):
            return UNKNOWN
        if func in _TRANSPOSES and src.dim() >= 2 and not (func is _T.mT.__get__ and src.dim() > 2):
            return UNKNOWN
        if func in (_T.expand, _T.expand_as) and src is args[0]:
            return lay if out.shape[0] == src.shape[0] else UNKNOWN  # (broadcast rows)
        if func in _VIEWLIKE and src is args[0]:
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
            return (
                lay
                if (
                    src is args[0]
                    and _index_keeps_dim0(args[1], src.shape[0])
                    and out.shape[0] == src.shape[0]
                )
                else UNKNOWN
            )
    # the general rule: LEAD when every such input is LEAD, B rows out, and each input
    # has the output's rank or B rows; FLAT when every one is FLAT with the rows kept
    n0 = out.shape[0]
    if lay == LEAD:
        ok, nd = n0 == B, out.dim()
        for t, la in tainted:
            if la != LEAD:
                return UNKNOWN
            if ok and t.dim() != nd and t.shape[0] != B:
                ok = False
        return LEAD if ok else UNKNOWN
    if lay == FLAT and n0 == src.shape[0]:
        for _, la in tainted:
            if la != FLAT:
                return UNKNOWN
        return FLAT
    return UNKNOWN


def propagate(func, args, kwargs, out, layouts: Tracker, B, tainted=None) -> str | None:
    """The layout of ``out`` (a tensor, or a tuple of tensors: each gets its own) after
    ``func(*args, **kwargs)``; None when no input depends on the samples. ``tainted``:
    :func:`tainted_inputs` of the call when the caller has it."""
    if tainted is None:
        tainted = tainted_inputs(args, kwargs, layouts)
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, Tensor):
                lay = _one(func, args, kwargs, o, tainted, B)
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
