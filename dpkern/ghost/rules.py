"""The ghost rule of each operation that may consume a trainable parameter (see
:mod:`.capture`): from the operation's arguments, which parameters it uses and how their
per-sample gradients follow from the per-sample output gradient G (the uses of
:mod:`.norms`). Every rule works on per-sample tensors ``[B, ...]`` (``*_b`` below).
"""

from __future__ import annotations

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
        return self.fn(G_b, ins)


@dataclass
class Rule:
    """``activation``: index of the argument that carries the batch; ``refuse``: returns a
    reason to refuse the call (before it runs), or None."""

    name: str
    uses: Callable | None = None
    activation: int = 0
    refuse: Callable | None = None
    extra: dict = field(default_factory=dict)


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
def _linear(fa, args, kwargs):
    w, b = fa.get(1), fa.get(2) or fa.get("bias")
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
    if w is None or 0 in fa or w.shape is not None or w.param.dim() != 2:
        return None
    return lambda G, ins: [_outer(w, ins[0], G)]


def _addmm(fa, args, kwargs):
    b, w = fa.get(0), fa.get(2)
    if 1 in fa or (w is not None and (w.shape is not None or w.param.dim() != 2)):
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
    if len(args) > 3 and args[3] is not None or kwargs.get("max_norm") is not None:
        return (
            "max_norm renormalises the looked-up weight rows in place (a data-dependent "
            "change of the parameters outside the mechanism)"
        )
    if (len(args) > 5 and args[5]) or kwargs.get("scale_grad_by_freq"):
        return "scale_grad_by_freq scales gradients by batch frequencies (mixes samples)"
    return None


def _embedding(fa, args, kwargs):
    w = fa.get(1)
    if w is None or 0 in fa or w.shape is not None:
        return None
    pad = args[2] if len(args) > 2 else kwargs.get("padding_idx")
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
    shape = args[1] if len(args) > 1 else kwargs["normalized_shape"]
    w, b = fa.get(2) or fa.get("weight"), fa.get(3) or fa.get("bias")
    eps = args[4] if len(args) > 4 else kwargs.get("eps", 1e-5)
    if 0 in fa:
        return None

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
    shape = args[1] if len(args) > 1 else kwargs["normalized_shape"]
    w = fa.get(2) or fa.get("weight")
    eps = args[3] if len(args) > 3 else kwargs.get("eps")
    if w is None or 0 in fa:
        return None
    return lambda G, ins: [_rows(w, rms_norm_rows(ins[0], G, shape, eps))]


def _elementwise(kind):
    def rule(fa, args, kwargs):
        if len(fa) != 1 or len(args) < 2 or not all(isinstance(a, Tensor) for a in args[:2]):
            return None
        pos, f = next(iter(fa.items()))
        if pos not in (0, 1):
            return None
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
    training = args[5] if len(args) > 5 else kwargs.get("training", False)
    x = args[0] if args else kwargs.get("input")
    if training and layout_of(layouts, x) is not None:
        return (
            "batch_norm in training mode normalises each sample with statistics of the "
            "whole batch (it mixes samples: not DP); use GroupNorm/LayerNorm, or eval()"
        )
    return None


def _batch_norm_eval(fa, args, kwargs):
    """Batch norm with running statistics (eval): per-sample affine rows on channel dim 1."""
    names = (
        "input",
        "running_mean",
        "running_var",
        "weight",
        "bias",
        "training",
        "momentum",
        "eps",
    )
    get = {n: (args[k] if k < len(args) else kwargs.get(n)) for k, n in enumerate(names)}
    if get["training"] or 0 in fa or get["running_mean"] is None:
        return None
    w, b = fa.get(3) or fa.get("weight"), fa.get(4) or fa.get("bias")
    eps = get["eps"] if get["eps"] is not None else 1e-5
    mean, var = get["running_mean"].detach(), get["running_var"].detach()

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


RULES: dict = {}
for _f in (F.linear, torch._C._nn.linear):
    RULES[_f] = Rule("linear", _linear)
for _f in (_T.matmul, torch.matmul, _T.__matmul__, torch.mm, _T.mm):
    RULES[_f] = Rule("matmul", _matmul)
for _f in (torch.addmm, _T.addmm):
    RULES[_f] = Rule("addmm", _addmm, activation=1)
RULES[F.embedding] = Rule("embedding", _embedding, refuse=_embedding_refuse)
RULES[F.layer_norm] = Rule("layer_norm", _layer_norm)
if hasattr(F, "rms_norm"):
    RULES[F.rms_norm] = Rule("rms_norm", _rms_norm)
for _f in _MULS:
    RULES[_f] = Rule("mul", _elementwise("mul"), activation=-1)
for _f in _ADDS:
    RULES[_f] = Rule("add", _elementwise("add"), activation=-1)
for _f in _SUBS:
    RULES[_f] = Rule("sub", _elementwise("sub"), activation=-1)
RULES[F.batch_norm] = Rule("batch_norm", _batch_norm_eval, refuse=_batch_norm_refuse)


def _forms_by_position(args, kwargs, forms) -> dict:
    ids = {id(t): f for t, f in forms}
    fa = {k: ids[id(a)] for k, a in enumerate(args) if isinstance(a, Tensor) and id(a) in ids}
    fa.update({k: ids[id(v)] for k, v in kwargs.items() if isinstance(v, Tensor) and id(v) in ids})
    return fa


def uses_of(rule, func, args, kwargs, out, forms, layouts, B):
    """[Rec] for this call, or None when the parameters' use has no rule (the caller then
    refuses). Raises ValueError when the activation's batch dimension is unproven."""
    if rule.uses is None:
        return None
    fa = _forms_by_position(args, kwargs, forms)
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
            f"ghost clipping: the input of {rule.name} depends on the samples, "
            "but in a layout where the batch dimension is not dim 0 (it was "
            "moved, flattened or reduced): per-sample gradients unproven"
        )
    if lay in (LEAD, FLAT) and out.shape[0] != x.shape[0]:
        return None
    grad_input = isinstance(x, Tensor) and x.requires_grad
    return [Rec(params, fn, inputs, out, pending=lay is None, grad_input=grad_input)]


def pending_uses(func, args, kwargs, out, t, rec: Rec, layouts, B):
    """Where pending ``t`` (a parameter-dependent tensor without the batch) meets the batch
    in ``t + x`` / ``x + t`` / ``x - t``: [Rec] with ``output`` = that sum; None when
    ``func`` is no such broadcasting sum."""
    if not (func in _ADDS or func in _SUBS) or len(args) < 2 or not isinstance(out, Tensor):
        return None
    pos = 0 if args[0] is t else 1 if args[1] is t else None
    other = args[1 - pos] if pos is not None else None
    if pos is None or layout_of(layouts, other) != LEAD or out.dim() == 0 or out.shape[0] != B:
        return None
    sign = -1.0 if (func in _SUBS and pos == 1) else 1.0
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
