"""The ghost rule of each operation that may consume a trainable parameter (see
:mod:`.capture`): from the operation's arguments, which parameters it uses and how their
per-sample gradients follow from the per-sample output gradient G (the uses of
:mod:`.norms`). Every rule works on per-sample tensors ``[B, ...]`` (``*_b`` below).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .batch import _ADDS, _MULS, _SUBS, FLAT, LEAD, UNKNOWN, layout_of, reduce_rows
from .norms import IndexUse, OuterUse, RowsUse, instantiate, layer_norm_rows, rms_norm_rows

_T = torch.Tensor


def _ps(x: Tensor, B: int) -> Tensor:
    """A LEAD or FLAT tensor with the samples in dim 0: ``[B, ...]``."""
    return x if x.shape[0] == B else x.reshape(B, x.shape[0] // B, *x.shape[1:])


@dataclass
class Rec:
    """One use of one or more parameters by one operation.

    ``fn(G_b, inputs_b)`` -> [(param, use)], from the per-sample gradient of ``output``
    and the per-sample inputs. ``pending``: the inputs do not carry the batch; ``g_map``
    (set when the pending output meets the batch) gives (G_b, inputs_b) from the gradient
    of the op where it met it, which is then ``output``."""

    params: list
    fn: Callable
    inputs: list
    output: Tensor
    pending: bool = False
    g_map: Callable | None = None
    where: str = ""
    module: object = None
    edge: object = None  # the output's GradientEdge (set when recorded; output then None)
    meta: tuple = ()  # the output's (shape, dtype, device)
    grad_input: bool = False  # the activation required grad (the backward passes the op)

    def make(self, g: Tensor, B: int):
        if self.g_map is not None:
            G_b, ins = self.g_map(g, B)
        else:
            G_b = _ps(g, B)
            ins = [_ps(x, B) if isinstance(x, Tensor) else x for x in self.inputs]
        got = self.fn(G_b, ins)
        self._check(got)
        return got

    def _check(self, got) -> None:
        """Raise ValueError unless every parameter of the call gets a use from the rule
        (one left out would silently be missing from the per-sample norms)."""
        for p in self.params:
            if not any(q is p for q, _ in got):
                names = self.module.named_parameters(remove_duplicate=False) if self.module else ()
                name = next((n for n, q in names if q is p), "a parameter")
                raise ValueError(
                    f"ghost clipping: the rule of {self.where or 'an operation'} gives no "
                    f"per-sample use to {name} (shape {tuple(p.shape)}), which the call "
                    "consumes: its gradient would be left out of the norms; refused "
                    "(nothing was updated)"
                )


_REQUIRED = object()  # (a signature entry without a default)


def _signature(spec: str) -> tuple:
    """``"input|self weight bias=None"`` -> ``(((names), default), ...)``, one entry per
    positional argument (``|``: other names of the same argument, e.g. a method's self)."""
    out = []
    for item in spec.split():
        names, _, default = item.partition("=")
        value = ast.literal_eval(default) if default else _REQUIRED
        out.append((tuple(names.split("|")), value))
    return tuple(out)


@dataclass
class Rule:
    """``activation``: index of the argument that carries the batch; ``refuse``: returns a
    reason to refuse the call (before it runs), or None. ``sig``: the op's positional
    arguments (:func:`_signature`), by which :meth:`bind` puts every argument passed by
    keyword in its position before ``uses`` / ``refuse`` read them (positions only);
    ``slots``: the positions where the rule takes a parameter's use (a parameter passed
    anywhere else: no rule for the call)."""

    name: str
    uses: Callable | None = None
    activation: int = 0
    refuse: Callable | None = None
    sig: str = ""
    slots: tuple = ()
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self._sig = _signature(self.sig)
        raw = getattr(self.refuse, "raw", self.refuse)
        if raw is not None:

            def refuse(args, kwargs, layouts):
                return raw(*self.bind(args, kwargs), layouts)

            refuse.raw = raw
            self.refuse = refuse

    def bind(self, args, kwargs) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with every argument of ``sig`` in its position (keywords
        moved, defaults filled in: all of ``sig`` present); the other keywords (keyword-only
        ones such as ``alpha``) stay in the dict."""
        sig = self._sig
        if len(args) >= len(sig) and not kwargs:
            return tuple(args), {}
        out, rest = list(args), dict(kwargs)
        for names, default in sig[len(out) :]:
            name = next((n for n in names if n in rest), None)
            out.append(
                rest.pop(name) if name is not None else None if default is _REQUIRED else default
            )
        return tuple(out), rest


def _outer(form, out_b, inp_b, scale=1.0):
    """The use of a 2-D form whose gradient is sum_t out[t] (x) inp[t] ([P0, P1])."""
    o = out_b.reshape(out_b.shape[0], -1, out_b.shape[-1])
    i = inp_b.reshape(inp_b.shape[0], -1, inp_b.shape[-1])
    if form.transposed:
        o, i = i, o
    s = form.scale * scale
    return form.param, OuterUse(o * s if s != 1.0 else o, i)


def _rows(form, rows_b):
    return form.param, RowsUse(form.rows_to_param(rows_b))


# -- the rules: (forms by argument position, args, kwargs) -> fn(G_b, inputs_b) -------------
# (args: bound by Rule.bind, every argument of the rule's sig in its position)
def _linear(fa, args, kwargs):
    w, b = fa.get(1), fa.get(2)
    if w is not None and (w.shape is not None or w.param.dim() != 2):
        return None

    def fn(G, ins):
        out = []
        if w is not None:
            out.append(_outer(w, G, ins[0]))
        if b is not None:
            out.append(_rows(b, reduce_rows(G, b.shape or b.param.shape)))
        return out

    return fn


def _matmul(fa, args, kwargs):
    w = fa.get(1)
    if w is None or w.shape is not None or w.param.dim() != 2:
        return None
    return lambda G, ins: [_outer(w, ins[0], G)]


def _addmm(fa, args, kwargs):
    b, w = fa.get(0), fa.get(2)
    if w is not None and (w.shape is not None or w.param.dim() != 2):
        return None
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)

    def fn(G, ins):
        out = []
        if w is not None:
            out.append(_outer(w, ins[1], G, alpha))
        if b is not None:
            rows = reduce_rows(G, b.shape or b.param.shape)
            out.append(_rows(b, rows * beta if beta != 1 else rows))
        return out

    return fn


def _embedding_refuse(args, kwargs, layouts):
    if args[3] is not None:
        return (
            "max_norm renormalises the looked-up weight rows in place (a data-dependent "
            "change of the parameters outside the mechanism)"
        )
    if args[5]:
        return "scale_grad_by_freq scales gradients by batch frequencies (mixes samples)"
    return None


def _embedding(fa, args, kwargs):
    w = fa.get(1)
    if w is None or w.shape is not None:
        return None
    pad = args[2]
    V, d = args[1].shape  # the table as used: [V, d] (a transposed form: param is [d, V])
    if pad is not None and pad < 0:
        pad += V

    def fn(G, ins):
        B = G.shape[0]
        ids = ins[0].reshape(B, -1)
        g = G.reshape(B, ids.shape[1], -1)
        if pad is not None:
            g = g.masked_fill((ids == pad).unsqueeze(-1), 0)
        use = IndexUse(ids, g * w.scale if w.scale != 1.0 else g, V)
        if not w.transposed:
            return [(w.param, use)]
        # loralib's Embedding looks up lora_A.T: instantiate (B x V x d, a low rank d)
        return [(w.param, RowsUse(instantiate([use], (V, d), B).transpose(1, 2)))]

    return fn


def _layer_norm(fa, args, kwargs):
    shape, eps = args[1], args[4]
    w, b = fa.get(2), fa.get(3)

    def fn(G, ins):
        wr, br = layer_norm_rows(
            ins[0], G, shape, eps, b is not None, has_weight=w is not None, stats=ins[-1]
        )
        return ([_rows(w, wr)] if w is not None else []) + ([_rows(b, br)] if b is not None else [])

    fn.stash = _layer_norm_stats
    return fn


def _layer_norm_stats(out: Tensor):
    """The forward's ``(mean, rstd)`` of a layer norm's output, saved by autograd for its
    own backward (``native_layer_norm`` returns ``(out, mean, rstd)``), or None (another
    backward node, e.g. a later in-place change or a backend's own kernel)."""
    node = out.grad_fn
    if type(node).__name__ != "NativeLayerNormBackward0":
        return None
    try:
        mean, rstd = node._saved_result1, node._saved_result2
    except (AttributeError, RuntimeError):
        return None
    if not (isinstance(mean, Tensor) and isinstance(rstd, Tensor)) or mean.shape != rstd.shape:
        return None
    return mean.detach(), rstd.detach()


def _rms_norm(fa, args, kwargs):
    shape, w, eps = args[1], fa.get(2), args[3]
    if w is None:
        return None
    return lambda G, ins: [_rows(w, rms_norm_rows(ins[0], G, shape, eps))]


def _elementwise(kind):
    def rule(fa, args, kwargs):
        if len(fa) != 1 or not all(isinstance(a, Tensor) for a in args[:2]):
            return None
        pos, f = next(iter(fa.items()))
        shape = f.shape or tuple(f.param.shape)
        if f.transposed:
            shape = tuple(f.param.shape[::-1])
        other = 1 - pos
        alpha = kwargs.get("alpha", 1)
        sign = -1.0 if kind == "sub" and pos == 1 else 1.0

        def fn(G, ins):
            x = ins[other]
            if kind == "mul":
                prod = G * x if x.dim() == G.dim() else G * x.unsqueeze(0)
                return [_rows(f, reduce_rows(prod, shape))]
            s = sign * (alpha if pos == 1 else 1.0)
            return [_rows(f, reduce_rows(G * s if s != 1.0 else G, shape))]

        fn.activation = other
        return fn

    return rule


def _batch_norm_refuse(args, kwargs, layouts):
    if args[5] and layout_of(layouts, args[0]) is not None:
        return (
            "batch_norm in training mode normalises each sample with statistics of the "
            "whole batch (it mixes samples: not DP); use GroupNorm/LayerNorm, or eval()"
        )
    return None


def _instance_norm_refuse(args, kwargs, layouts):
    """InstanceNorm with running statistics in training mode (``use_input_stats`` and a
    running_mean / running_var): it writes the batch's statistics into those buffers."""
    x, running_mean, running_var, _, _, use_input_stats = args[:6]
    tracked = running_mean is not None or running_var is not None
    if use_input_stats and tracked and layout_of(layouts, x) is not None:
        return (
            "instance_norm with track_running_stats=True in training mode writes the batch's "
            "statistics into its running_mean/running_var buffers, which releases them "
            "without noise (state_dict, eval); use eval() for that module, or "
            "track_running_stats=False (per-sample statistics) or LayerNorm"
        )
    return None


def _batch_norm_eval(fa, args, kwargs):
    """Batch norm with running statistics (eval): per-sample affine rows on channel dim 1."""
    _, running_mean, running_var, _, _, training, _, eps = args[:8]
    if training or running_mean is None:
        return None
    w, b = fa.get(3), fa.get(4)
    eps = eps if eps is not None else 1e-5
    mean, var = running_mean.detach(), running_var.detach()

    def fn(G, ins):
        x = ins[0]
        shape = [1, -1] + [1] * (x.dim() - 2)
        x_hat = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + eps)
        dims = tuple(range(2, x.dim()))
        out = []
        if w is not None:
            r = G * x_hat
            out.append(_rows(w, r.sum(dims) if dims else r))
        if b is not None:
            out.append(_rows(b, G.sum(dims) if dims else G))
        return out

    return fn


_BINARY = "input|self other"
RULES: dict = {}
for _f in (F.linear, torch._C._nn.linear):
    RULES[_f] = Rule("linear", _linear, sig="input weight bias=None", slots=(1, 2))
for _f in (_T.matmul, torch.matmul, _T.__matmul__, torch.mm, _T.mm):
    RULES[_f] = Rule("matmul", _matmul, sig="input|self other|mat2", slots=(1,))
for _f in (torch.addmm, _T.addmm):
    RULES[_f] = Rule("addmm", _addmm, 1, sig="input|self mat1 mat2", slots=(0, 2))
RULES[F.embedding] = Rule(
    "embedding",
    _embedding,
    refuse=_embedding_refuse,
    sig="input weight padding_idx=None max_norm=None norm_type=2.0 "
    "scale_grad_by_freq=False sparse=False",
    slots=(1,),
)
RULES[F.layer_norm] = Rule(
    "layer_norm",
    _layer_norm,
    sig="input normalized_shape weight=None bias=None eps=1e-05",
    slots=(2, 3),
)
if hasattr(F, "rms_norm"):
    RULES[F.rms_norm] = Rule(
        "rms_norm", _rms_norm, sig="input normalized_shape weight=None eps=None", slots=(2,)
    )
for _f in _MULS:
    RULES[_f] = Rule("mul", _elementwise("mul"), -1, sig=_BINARY, slots=(0, 1))
for _f in _ADDS:
    RULES[_f] = Rule("add", _elementwise("add"), -1, sig=_BINARY, slots=(0, 1))
for _f in _SUBS:
    RULES[_f] = Rule("sub", _elementwise("sub"), -1, sig=_BINARY, slots=(0, 1))
RULES[F.batch_norm] = Rule(
    "batch_norm",
    _batch_norm_eval,
    refuse=_batch_norm_refuse,
    sig="input running_mean running_var weight=None bias=None training=False "
    "momentum=0.1 eps=1e-05",
    slots=(3, 4),
)
RULES[F.instance_norm] = Rule(  # (no use: an affine one's parameters have no rule)
    "instance_norm",
    refuse=_instance_norm_refuse,
    sig="input running_mean=None running_var=None weight=None bias=None "
    "use_input_stats=True momentum=0.1 eps=1e-05",
)


def _forms_by_position(args, kwargs, forms) -> dict | None:
    """``{position or keyword: form}`` of the (bound) arguments that are forms of a
    parameter; None when a form is elsewhere (inside a list argument)."""
    ids = {id(t): f for t, f in forms}
    fa = {k: ids[id(a)] for k, a in enumerate(args) if isinstance(a, Tensor) and id(a) in ids}
    fa.update({k: ids[id(v)] for k, v in kwargs.items() if isinstance(v, Tensor) and id(v) in ids})
    seen = {id(a) for a in list(args) + list(kwargs.values())}
    return fa if all(id(t) in seen for t, _ in forms) else None


def uses_of(rule, func, args, kwargs, out, forms, layouts, B):
    """[Rec] for this call, or None when the parameters' use has no rule (the caller then
    refuses): no rule for ``func``, a parameter in an argument the rule does not cover
    (``rule.slots``), or a case the rule does not handle. The arguments are bound first
    (:meth:`Rule.bind`: by position or keyword alike). Raises ValueError when the
    activation's batch dimension is unproven."""
    if rule.uses is None:
        return None
    args, kwargs = rule.bind(args, kwargs)
    fa = _forms_by_position(args, kwargs, forms)
    if not fa or any(k not in rule.slots for k in fa):
        return None
    fn = rule.uses(fa, args, kwargs)
    if fn is None:
        return None
    act = getattr(fn, "activation", rule.activation)
    x = args[act] if 0 <= act < len(args) else None
    params = [f.param for f in fa.values()]
    inputs = [
        a.detach() if k == act and isinstance(a, Tensor) else None for k, a in enumerate(args)
    ]
    stash = getattr(fn, "stash", None)
    if stash is not None:  # what the rule needs from the forward beyond its arguments
        inputs.append(stash(out))
    lay = layout_of(layouts, x)
    if lay == UNKNOWN:
        raise ValueError(
            f"ghost clipping: the input of {rule.name} depends on the samples, but not "
            "provably one row per sample in dim 0 (an operation mixed samples, or moved, "
            "flattened or reduced the batch dimension): per-sample gradients unproven"
        )
    if lay in (LEAD, FLAT) and out.shape[0] != x.shape[0]:
        return None
    grad_input = isinstance(x, Tensor) and x.requires_grad
    return [Rec(params, fn, inputs, out, pending=lay is None, grad_input=grad_input)]


def pending_uses(func, args, kwargs, out, t, rec: Rec, layouts, B):
    """Where pending ``t`` (a parameter-dependent tensor without the batch) meets the batch
    in ``t + x`` / ``x + t`` / ``x - t``: [Rec] with ``output`` = that sum; None when
    ``func`` is no such broadcasting sum."""
    if not (func in _ADDS or func in _SUBS) or not isinstance(out, Tensor):
        return None
    args, kwargs = RULES[func].bind(args, kwargs)
    pos = 0 if args[0] is t else 1 if args[1] is t else None
    other = args[1 - pos] if pos is not None else None
    if pos is None or layout_of(layouts, other) != LEAD or out.dim() == 0 or out.shape[0] != B:
        return None
    alpha = kwargs.get("alpha", 1) if pos == 1 else 1  # (t + alpha * x: t's gradient is G)
    sign = (-1.0 if (func in _SUBS and pos == 1) else 1.0) * alpha
    aligned = t.dim() == out.dim() and t.shape[0] == B and B > 1
    ins = rec.inputs

    def g_map(g, Bn):
        G = g * sign if sign != 1.0 else g
        if aligned:
            return reduce_rows(G, t.shape[1:]), [
                x.reshape(Bn, *x.shape[1:]) if isinstance(x, Tensor) else x for x in ins
            ]
        return reduce_rows(G, t.shape), [
            x.unsqueeze(0).expand(Bn, *x.shape) if isinstance(x, Tensor) else x for x in ins
        ]

    if aligned and not all(x is None or not isinstance(x, Tensor) or x.shape[0] == B for x in ins):
        return None
    return [Rec(rec.params, rec.fn, ins, out, g_map=g_map)]
