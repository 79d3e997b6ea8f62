"""The tables of the batch layout rule (:func:`.batch._one`): the torch functions (as the
capture's ``TorchFunctionMode`` sees them: torch-level callables such as ``torch.sort``,
``Tensor.add``, ``F.softmax``, not aten overloads) known to keep the samples apart along
dim 0, each with its kind. The rule is an allowlist: a function not listed here (nor among
the views and moves of :mod:`.batch`) gives an output of unknown layout, which a trainable
parameter or the loss then refuses.

Kinds (how :func:`.batch._one` checks a call; "tainted": an argument that depends on the
samples):

- ``EW`` element-wise, broadcasting: every tainted input has the output's rank (a
  lower-rank one would be broadcast over a new leading dim);
- ``ROW`` along the dim argument ``DIMS[func] = (position, keyword, default, free)``:
  kept when that dim is not 0 (``default`` None: all dims, i.e. dim 0 too); only the first
  argument (a list of tensors for cat / stack) and the argument positions / keywords in
  ``free`` (with the first's rank) may be tainted;
- ``ONLY`` the first argument may be tainted, with the output's rank, at least
  ``ONLY_RANK[func]`` (conv on an unbatched input would read dim 0 as channels);
- ``CONST``: the output's values do not depend on the samples (``x.new_zeros``);
- the others have a check of their own in :func:`kind_layout` (``MM`` matmuls, ``LINEAR``,
  ``EMB``, ``NORM``, ``BN``, ``NLL``, ``SDPA``, ``RNN``, ``PAD``, ``REPEAT``) or in
  :func:`.batch._one` (``MAXMIN``: ``max(x, other)`` element-wise, ``max(x, dim)`` row).

Also here: the function sets of the views, casts and moves that :mod:`.batch` rules on, and
the layout names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_T = torch.Tensor
LEAD, FLAT, UNKNOWN = "lead", "flat", "unknown"

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
_VIEWLIKE = _CASTS | _RESHAPES | {_T.unflatten, torch.unflatten}
_EXPANDS = {_T.expand, _T.expand_as, _T.broadcast_to, torch.broadcast_to}
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


(EW, ROW, ONLY, CONST, MM, LINEAR, EMB, NORM, BN, NLL, SDPA, RNN, PAD, REPEAT, MAXMIN) = range(15)

#: aten ops tagged ``torch.Tag.pointwise`` (checked by tests/test_ghost_mixing.py), looked up
#: as ``torch.<name>``, ``Tensor.<name>``, ``F.<name>`` and their in-place ``<name>_``
POINTWISE = """
abs acos acosh add addcdiv addcmul angle asin asinh atan atan2 atanh bitwise_and
bitwise_left_shift bitwise_not bitwise_or bitwise_right_shift bitwise_xor ceil celu clamp
clamp_max clamp_min clip clone conj_physical copysign cos cosh deg2rad digamma div elu eq
erf erfc erfinv exp exp2 expm1 float_power floor fmax fmin fmod frac frexp gcd ge gelu gt
hardshrink hardsigmoid hardtanh heaviside hypot i0 igamma igammac isfinite isinf isnan
isneginf isposinf lcm ldexp le leaky_relu lerp lgamma log log10 log1p log2 logaddexp
logaddexp2 logical_and logical_not logical_or logical_xor logit lt maximum minimum mish mul
mvlgamma nan_to_num ne neg nextafter polygamma positive pow rad2deg reciprocal relu relu6
remainder round rsqrt rsub selu sgn sigmoid sign signbit silu sin sinc sinh softplus
softshrink sqrt square sub tan tanh threshold true_divide trunc xlogy
""".split()

#: element-wise too, not aten pointwise ops of the same name: aliases, Python operators,
#: casts, random masks, constant fills, element-wise losses (``reduction="none"``; a
#: reduced loss is 0-dim, hence unknown)
_EW_MORE = """
absolute arccos arccosh arcsin arcsinh arctan arctan2 arctanh negative multiply divide
subtract greater greater_equal less less_equal not_equal fix masked_fill where tril triu
copy_ fill_ zero_ detach detach_ requires_grad_ int long bool short char byte half float
double bfloat16 type cpu cuda zeros_like ones_like empty_like full_like rand_like randn_like
randint_like dropout dropout_ alpha_dropout feature_alpha_dropout feature_dropout dropout1d
dropout2d dropout3d logsigmoid hardswish softsign tanhshrink rrelu prelu
mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy
binary_cross_entropy_with_logits kl_div soft_margin_loss
__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__
__rtruediv__ __itruediv__ __div__ __rdiv__ __idiv__ __floordiv__ __rfloordiv__
__ifloordiv__ __mod__ __rmod__ __imod__ __pow__ __rpow__ __ipow__ __neg__ __pos__ __abs__
__invert__ __and__ __rand__ __iand__ __or__ __ror__ __ior__ __xor__ __rxor__ __ixor__
__lshift__ __rlshift__ __ilshift__ __rshift__ __rrshift__ __irshift__ __eq__ __ne__ __lt__
__le__ __gt__ __ge__
""".split()

_NS = (torch, _T, F, torch.special)


def _funcs(name: str) -> list:
    out = []
    for ns in _NS:
        for n in (name, name + "_"):
            f = getattr(ns, n, None)
            if callable(f) and not isinstance(f, type) and f not in out:
                out.append(f)
    return out


KIND: dict = {}
for _n in POINTWISE + _EW_MORE:
    for _f in _funcs(_n):
        KIND.setdefault(_f, EW)

#: func -> (position of the dim argument, its keyword, its default (None: every dim),
#: the other argument positions / keywords that may depend on the samples)
DIMS: dict = {}
_ALL = None
_ROW_SPECS = [
    # reductions and scans over ``dim`` (argument 1)
    (
        "sum nansum mean nanmean prod std var std_mean var_mean logsumexp argmax argmin any "
        "all count_nonzero median nanmedian amax amin softmax log_softmax softmin cumsum "
        "cumprod cummax cummin logcumsumexp unbind",
        1,
        "dim",
        _ALL,
        (),
    ),
    ("mode sort argsort glu", 1, "dim", -1, ()),
    ("topk kthvalue", 2, "dim", -1, ()),
    ("diff", 2, "dim", -1, (3, "prepend", 4, "append")),
    ("aminmax", None, "dim", _ALL, ()),
    ("norm vector_norm", 2, "dim", _ALL, ()),
    ("normalize", 2, "dim", 1, ()),
    ("flip", 1, "dims", _ALL, ()),
    ("roll", 2, "dims", _ALL, ()),
    ("repeat_interleave", 2, "dim", _ALL, ()),
    ("cat concat concatenate stack", 1, "dim", 0, ()),
    ("split tensor_split chunk", 2, "dim", 0, ()),
    ("narrow select index_select", 1, "dim", _ALL, ()),
    ("gather", 1, "dim", _ALL, (2, "index")),
    ("take_along_dim", 2, "dim", _ALL, (1, "indices")),
    ("scatter scatter_add scatter_reduce", 1, "dim", _ALL, (2, "index", 3, "src")),
    ("index_add index_copy", 1, "dim", _ALL, (3, "source")),
    ("index_fill", 1, "dim", _ALL, ()),
]
for _names, _pos, _kw, _default, _free in _ROW_SPECS:
    for _n in _names.split():
        for _f in _funcs(_n) + [getattr(torch.linalg, _n, None)]:
            if callable(_f):
                KIND[_f] = ROW
                DIMS[_f] = (_pos, _kw, _default, _free)
STACKS = frozenset(_funcs("stack"))  # (dim counted in the output's rank)
for _f in (torch.max, _T.max, torch.min, _T.min):
    KIND[_f] = MAXMIN  # max(x, other) element-wise; max(x, dim) a reduction
    DIMS[_f] = (1, "dim", _ALL, ())

ONLY_RANK: dict = {}
for _n, _r in [
    ("conv1d conv_transpose1d", 3),
    ("conv2d conv_transpose2d", 4),
    ("conv3d conv_transpose3d", 5),
    ("avg_pool1d max_pool1d adaptive_avg_pool1d adaptive_max_pool1d lp_pool1d", 2),
    ("avg_pool2d max_pool2d adaptive_avg_pool2d adaptive_max_pool2d lp_pool2d", 2),
    ("avg_pool3d max_pool3d adaptive_avg_pool3d adaptive_max_pool3d", 2),
    ("interpolate upsample group_norm", 2),
    ("instance_norm", 3),
]:
    for _name in _n.split():
        for _f in _funcs(_name):
            KIND[_f], ONLY_RANK[_f] = ONLY, _r

for _n, _k in [("new_zeros new_ones new_empty new_full", CONST)] + [
    ("matmul mm bmm addmm baddbmm __matmul__ __rmatmul__", MM)
]:
    for _name in _n.split():
        for _f in _funcs(_name):
            KIND[_f] = _k
# (by the F-level function only: the torch-level ones of the same name, e.g.
# torch.embedding(weight, indices), take their arguments in another order)
_OWN = [
    (F.linear, LINEAR),
    (F.embedding, EMB),
    (F.layer_norm, NORM),
    (torch.layer_norm, NORM),
    (getattr(F, "rms_norm", None), NORM),
    (getattr(torch, "rms_norm", None), NORM),
    (F.batch_norm, BN),
    (F.cross_entropy, NLL),
    (F.nll_loss, NLL),
    (F.scaled_dot_product_attention, SDPA),
    (torch.lstm, RNN),
    (torch.gru, RNN),
    (torch.rnn_tanh, RNN),
    (torch.rnn_relu, RNN),
    (F.pad, PAD),
    (_T.repeat, REPEAT),
]
for _f, _k in _OWN:
    if _f is not None:
        KIND[_f] = _k
WHERE = frozenset(_funcs("where"))  # (where(cond) alone: the indices of its nonzeros)
del _n, _f, _k, _r, _name, _names, _pos, _kw, _default, _free, _OWN


# -- the checks of the kinds (called by .batch._one) ------------------------------
def _touches(dim, n: int) -> bool:
    """Whether the dim argument ``dim`` (of a tensor of rank ``n``) includes dim 0; None,
    ``()`` and names: every dim."""
    if dim is None or isinstance(dim, bool):
        return True
    dims = [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, (list, tuple)) else []
    if not dims:
        return True
    n = max(n, 1)
    return any(not isinstance(d, int) or isinstance(d, bool) or d % n == 0 for d in dims)


def _kept(tainted, out: Tensor, B, same_rank: bool = True) -> str:
    """The layout of an output whose dim 0 is each tainted input's dim 0: LEAD when all
    are LEAD (B rows), FLAT when all are FLAT with the output's rows; ``same_rank``: each
    must also have the output's rank (element-wise broadcasting)."""
    lay, n0, nd = tainted[0][1], out.shape[0], out.dim()
    if lay == UNKNOWN or (lay == LEAD and n0 != B):
        return UNKNOWN
    for t, la in tainted:
        if la != lay or t.dim() == 0 or t.shape[0] != n0 or (same_rank and t.dim() != nd):
            return UNKNOWN
    return lay


def _arg(args, kwargs, pos, *kws):
    if pos is not None and len(args) > pos:
        return args[pos]
    for k in kws:
        if k in kwargs:
            return kwargs[k]
    return None


def _only(tainted, *allowed) -> bool:
    """Whether every tainted input is one of ``allowed``."""
    return all(any(t is a for a in allowed) for t, _ in tainted)


def _row(func, args, kwargs, out, tainted, B) -> str:
    pos, kw, default, free = DIMS[func]
    x = _arg(args, kwargs, 0, "input", "self", "tensors")
    allowed = list(x) if isinstance(x, (list, tuple)) else [x]
    allowed += [_arg(args, kwargs, free[k], free[k + 1]) for k in range(0, len(free), 2)]
    if isinstance(x, (list, tuple)):  # cat / stack (cat skips legacy empty 1-D tensors)
        rank = out.dim() - (func in STACKS)
    elif isinstance(x, Tensor) and (not free or out.dim() == x.dim()):
        rank = x.dim()
    else:
        return UNKNOWN
    if not _only(tainted, *allowed) or any(t.dim() != rank for t, _ in tainted):
        return UNKNOWN
    dim = _arg(args, kwargs, pos, kw)
    if _touches(default if dim is None else dim, out.dim() if func in STACKS else rank):
        return UNKNOWN
    return _kept(tainted, out, B, same_rank=False)


def _mm(func, args, kwargs, out, tainted, B) -> str:
    """matmul family: a tainted left operand keeps its dim 0 (rank >= 2, not below the
    right's); a tainted right one only as a batch dim (rank >= 3, not below the left's)."""
    name = getattr(func, "__name__", "")
    inp = None
    if name.startswith(("addmm", "baddbmm")):
        inp = _arg(args, kwargs, 0, "input", "self")
        a = _arg(args, kwargs, 1, "mat1", "batch1")
        b = _arg(args, kwargs, 2, "mat2", "batch2")
    elif name == "__rmatmul__":
        a, b = _arg(args, kwargs, 1, "other"), args[0]
    else:
        a, b = _arg(args, kwargs, 0, "input", "self"), _arg(args, kwargs, 1, "other", "mat2")
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or not _only(tainted, a, b, inp):
        return UNKNOWN
    for t, _ in tainted:
        if t is a and not (a.dim() >= 2 and a.dim() >= b.dim()):
            return UNKNOWN
        if t is b and not (b.dim() >= 3 and b.dim() >= a.dim()):
            return UNKNOWN
        if t is inp and t is not a and t is not b and t.dim() != out.dim():
            return UNKNOWN
    return _kept(tainted, out, B, same_rank=False)


def kind_layout(kind, func, args, kwargs, out, tainted, B, index) -> str | None:
    """The layout of ``out`` for the kinds with a check of their own (see above)."""
    x = _arg(args, kwargs, 0, "input", "self", "query")
    if kind == CONST:
        return None  # (the values do not depend on the samples)
    if kind == MM:
        return _mm(func, args, kwargs, out, tainted, B)
    if not isinstance(x, Tensor):
        return UNKNOWN
    if kind == NLL:
        y = _arg(args, kwargs, 1, "target")
        red = _arg(args, kwargs, 6, "reduction")
        ok = (
            _only(tainted, x, y)
            and red == "none"
            and _arg(args, kwargs, 3, "size_average") is None
            and _arg(args, kwargs, 5, "reduce") is None
            and x.dim() >= 2  # (class dim 1)
        )
        return _kept(tainted, out, B, same_rank=False) if ok else UNKNOWN
    if kind == SDPA:
        qkvm = [_arg(args, kwargs, k, n) for k, n in enumerate(("query", "key", "value"))]
        ok = _only(tainted, *qkvm, _arg(args, kwargs, 3, "attn_mask")) and out.dim() >= 3
        return _kept(tainted, out, B) if ok else UNKNOWN
    if not _only(tainted, x):
        return UNKNOWN
    if kind == ONLY:
        ok = x.dim() >= ONLY_RANK[func]
    elif kind == LINEAR:
        ok = x.dim() >= 2
    elif kind == EMB:
        return _kept(tainted, out, B, same_rank=False) if x.dim() >= 1 else UNKNOWN
    elif kind == NORM:
        ns = _arg(args, kwargs, 1, "normalized_shape")
        ok = (1 if isinstance(ns, int) else len(ns)) < x.dim()
    elif kind == BN:
        stats = [_arg(args, kwargs, k, n) for k, n in ((1, "running_mean"), (2, "running_var"))]
        ok = not _arg(args, kwargs, 5, "training") and None not in stats and x.dim() >= 2
    elif kind == RNN:  # batch_first, not packed: output 0 is [B, T, H]
        ok = (
            index == 0
            and len(args) == 9
            and isinstance(args[2], (list, tuple))
            and (func is not torch.lstm or isinstance(args[1], (list, tuple)))
            and args[8] is True
            and x.dim() == 3
        )
    elif kind == PAD:
        pad = list(_arg(args, kwargs, 1, "pad"))
        ok = len(pad) < 2 * x.dim() or not any(pad[2 * x.dim() - 2 :])
    elif kind == REPEAT:
        sizes = args[1:] if len(args) > 1 else kwargs.get("repeats", ())
        sizes = list(sizes[0]) if len(sizes) == 1 and not isinstance(sizes[0], int) else sizes
        ok = len(sizes) == x.dim() and sizes[0] == 1
    else:
        return UNKNOWN
    return _kept(tainted, out, B) if ok else UNKNOWN
