"""The capture's ``TorchFunctionMode`` and what it does with each torch call of the
recorded forward (:class:`OpRecorder`, a mixin of :class:`.capture.Capture`, which owns
the state it reads and writes: the trackers of forms, pending tensors and layouts, the
records, the batch size; see :mod:`.capture` for the design and :mod:`.batch` and
:mod:`.rules` for the rules it applies).

Per call: refuse what a rule refuses before running it (``rule.refuse``), run it, then look
up the tracked facts of its tensor arguments once; an output with nothing tracked behind it
is returned at once (the hot path: every torch call of the forward goes through here).
Otherwise the output becomes a new form of a parameter (a view, a cast, ``1 + w``), the
record(s) of a use of a parameter (:func:`.rules.uses_of`), the use of a pending tensor
where it meets the batch (:func:`.rules.pending_uses`), and/or gets its batch layout
(:mod:`.batch`). In-place writes are tracked by :class:`.writes.WriteTracker`, and under
``instantiate_unsupported`` the replay that counts each use by
:class:`.owners.ReplayOwners` (mixins of :class:`OpRecorder`)."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge
from torch.overrides import TorchFunctionMode

from .batch import _CASTS as CASTS
from .batch import _one as layout_one
from .batch import UNKNOWN, layout_of, param_form, propagate
from .owners import ReplayOwners
from .rules import RULES, _ps, pending_uses, uses_of
from .writes import WriteTracker

__all__ = ["OpRecorder"]

#: What a refusal of an unproven input adds when the operation behind it is known.
MIXED = (
    ". The samples were mixed or their rows moved by {origin}: ghost clipping follows a "
    "tensor's rows only through operations known to keep samples apart, and per-sample "
    "gradients are undefined once samples are mixed (batch statistics such as x.mean(0) "
    "or BatchNorm in training, a [B, B] matmul, a sort or scatter over the batch). Use "
    "per-sample normalisation (LayerNorm, GroupNorm) or statistics from public data; if "
    "the operation only moves the batch dimension, move it back to dim 0 before the layer"
)

_SEQ = (list, tuple)
#: calls that make a tensor require grad during the forward (e.g. transformers'
#: ``enable_input_require_grads`` hook on the input embeddings); factories are caught by
#: their ``requires_grad=True`` keyword
_MAKES_LEAF = frozenset({Tensor.requires_grad_, Tensor.requires_grad.__set__})
_NONE: list = []  # an empty list that is never appended to
#: the code of the frame every module call runs in (its local ``self``: the module)
_SETITEM = Tensor.__setitem__
_IDUNDERS = frozenset(
    f"__i{n}__"
    for n in "add sub mul truediv div floordiv mod pow and or xor lshift rshift matmul".split()
)
_INPLACE_POS: dict = {}  # func -> position of its ``inplace`` parameter (or None)


def _inplace_pos(func):
    if func not in _INPLACE_POS:
        import inspect

        try:
            names = list(inspect.signature(func).parameters)
        except (TypeError, ValueError):
            names = []
        _INPLACE_POS[func] = names.index("inplace") if "inplace" in names else None
    return _INPLACE_POS[func]


def _writes_first(func, args, kwargs) -> bool:
    """Whether ``func`` (which returned ``args[0]``) changed ``args[0]`` in place: a method
    ``x.name_()``, ``x += y`` (``__iadd__``), or ``inplace=True`` (``F.relu``, ...);
    not ``x.to()`` / ``x.contiguous()`` returning ``x`` itself."""
    name = getattr(func, "__name__", "")
    if (name.endswith("_") and not name.endswith("__")) or name in _IDUNDERS:
        return True
    if "inplace" in kwargs:
        return bool(kwargs["inplace"])
    pos = _inplace_pos(func)
    return pos is not None and len(args) > pos and bool(args[pos])


class Mode(TorchFunctionMode):
    """Active during the recorded forward: every torch call goes to ``capture._on_op``."""

    def __init__(self, capture: OpRecorder):
        super().__init__()
        self.cap = capture
        self._on_op = capture._on_op  # (hot path: one lookup less per torch call)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self._on_op(func, args, kwargs or {})


class OpRecorder(WriteTracker, ReplayOwners):
    """The mode's handlers, mixed into :class:`.capture.Capture`, whose state they use:
    the trackers ``forms`` / ``_pending`` / ``layouts`` (their dicts ``_fd`` / ``_pd`` /
    ``_ld``), ``_identity``, ``_batch``, ``_records``, ``_unknown``, ``_mixed``,
    ``_roots``, ``module_names``; and its ``where()``, ``current_module()``, ``_pname()``."""

    def _on_op(self, func, args, kwargs):
        # Hot path: runs for every torch call of the forward. The facts it reads (forms,
        # pending, layouts of the arguments) are looked up once, after the call (the call
        # cannot change them: the arguments stay alive, only this method writes them), and
        # an output with no tracked argument behind it is returned at once.
        rule = RULES.get(func)
        if rule is not None and rule.refuse is not None:
            why = rule.refuse(args, kwargs, self.layouts)
            if why:
                raise ValueError(f"ghost clipping refuses {func.__name__} in {self.where()}: {why}")
        out = func(*args, **kwargs)
        if func in _MAKES_LEAF or (kwargs and kwargs.get("requires_grad")):
            t = args[0] if func in _MAKES_LEAF and args else out  # (see early.requests)
            if isinstance(t, Tensor) and t.requires_grad and id(t) not in self._identity:
                self._roots.append(t)
        if isinstance(out, Tensor):
            single = True
        elif isinstance(out, _SEQ) and out and isinstance(out[0], Tensor):
            single = False
        elif func is _SETITEM:  # (returns None)
            self._on_setitem(func, args)
            return out
        else:
            return out  # shapes, dtypes, ...
        # the tensor arguments: top-level args, top-level kwargs, then the elements of
        # list / tuple arguments (args', then kwargs'); propagate reads args', nested
        # args' and kwargs' tensors in that order (the same split of args and of kwargs,
        # written out twice: a helper would add a Python call to every torch call)
        a_top, a_sub = [], _NONE
        for a in args:
            if isinstance(a, Tensor):
                a_top.append(a)
            elif isinstance(a, _SEQ):
                sub = [x for x in a if isinstance(x, Tensor)]
                if sub:
                    a_sub = sub if a_sub is _NONE else a_sub + sub
        if kwargs:
            k_top, k_sub = [], _NONE
            for a in kwargs.values():
                if isinstance(a, Tensor):
                    k_top.append(a)
                elif isinstance(a, _SEQ):
                    sub = [x for x in a if isinstance(x, Tensor)]
                    if sub:
                        k_sub = sub if k_sub is _NONE else k_sub + sub
            tensors = a_top + k_top + a_sub + k_sub
            ordered = a_top + a_sub + k_top
        elif a_sub:
            tensors = ordered = a_top + a_sub
        else:
            tensors = ordered = a_top
        fd, pd, ld, ident = self._fd, self._pd, self._ld, self._identity
        forms, pend, tainted = _NONE, _NONE, []
        for t in tensors:
            k = id(t)
            e = fd.get(k)
            if e is not None and e[0]() is t:
                forms = [(t, e[1])] if forms is _NONE else forms + [(t, e[1])]
            elif (b := t._base) is not None and id(b) in ident:  # (activations: skipped)
                self._refuse_kept_view(func, t)
            e = pd.get(k)
            if e is not None and e[0]() is t:
                pend = [(t, e[1])] if pend is _NONE else pend + [(t, e[1])]
        wr = self.__dict__.get("_written")  # (roots written with samples: see _on_write)
        written = wr[1] if wr is not None and wr[0] is ld else None
        for t in ordered:
            e = ld.get(id(t))
            if e is not None and e[0]() is t:
                tainted.append((t, e[1]))
            elif written and (lay := self._alias_layout(t, written)) is not None:
                tainted.append((t, lay))
        if not forms and not pend and not tainted:  # nothing tracked depends on it
            return out
        if forms and not any(f.param.requires_grad for _, f in forms):
            return out
        derived = (
            param_form(None, out, func=func, args=args, kwargs=kwargs, forms=forms)
            if len(forms) == 1 and single and (len(tensors) == 1 or func in CASTS)
            else None
        )
        if derived is not None:
            self.forms.put(out, derived)
            return out
        if pend:
            self._consume_pending(func, args, kwargs, out, pend)
        if forms:
            self._use(func, args, kwargs, out, forms, rule)
        if tainted:
            if single and args and out is args[0] and _writes_first(func, args, kwargs):
                self._on_write(func, args, kwargs, out, tainted)
            elif single and kwargs and out is kwargs.get("out"):
                self._on_write(func, args, kwargs, out, tainted)
            elif single:
                layout = layout_one(func, args, kwargs, out, tainted, self._batch)
                if layout is not None:
                    ld[id(out)] = (weakref.ref(out), layout)  # self.layouts.put(out, layout)
                    if layout == UNKNOWN:
                        self._note_origin(func, out, tainted)
                        if out.requires_grad:
                            self._note_mixed(func, out, tainted)
            else:
                propagate(func, args, kwargs, out, self.layouts, self._batch, tainted)
                for o in out:
                    if isinstance(o, Tensor) and layout_of(self.layouts, o) == UNKNOWN:
                        self._note_origin(func, o, tainted)
                        if o.requires_grad:
                            self._note_mixed(func, o, tainted)
        return out

    def _note_origin(self, func, out: Tensor, tainted) -> None:
        """Remember the operation that first left ``out``'s samples unproven (inherited
        from an unproven input), for the refusal's message."""
        origin = self._origin_of(t for t, la in tainted if la == UNKNOWN)
        if origin is None:
            origin = f"{getattr(func, '__name__', func)} in {self.where()}"
        self._origins[id(out)] = (weakref.ref(out), origin)

    def _origin_of(self, tensors) -> str | None:
        for t in tensors:
            e = self._origins.get(id(t)) if isinstance(t, Tensor) else None
            if e is not None and e[0]() is t:
                return e[1]
        return None

    def _note_mixed(self, func, out: Tensor, tainted) -> None:
        """Remember ``out``'s node: it requires grad and depends on the samples in an
        unproven layout; :meth:`backward` refuses losses that reach it. Only the first of
        a chain (an input already unproven and requiring grad leads to an earlier one)."""
        if out.grad_fn is None or any(la == UNKNOWN and t.requires_grad for t, la in tainted):
            return
        self._mixed.append((out.grad_fn, f"{getattr(func, '__name__', func)} in {self.where()}"))

    def _use(self, func, args, kwargs, out, forms, rule) -> None:
        B = self._batch
        name = getattr(func, "__name__", str(func))
        outs = [out] if isinstance(out, Tensor) else [o for o in out if isinstance(o, Tensor)]
        if not any(o.requires_grad for o in outs):
            return
        try:
            recs = (
                uses_of(rule, func, args, kwargs, out, forms, self.layouts, B)
                if rule is not None and isinstance(out, Tensor)
                else None
            )
        except ValueError as exc:
            origin = self._origin_of([*args, *kwargs.values()])
            raise ValueError(
                f"{exc} (in {self.where()}, consuming "
                + ", ".join(self._pname(f.param) for _, f in forms)
                + ")"
                + ("" if origin is None else MIXED.format(origin=origin))
            ) from None
        if not self.instantiate_unsupported:
            if recs is None:
                for _, f in forms:
                    self._unknown.setdefault(id(f.param), f"{name} in {self.where()}")
                return
            module, replayers = self.current_module(), None
            where = f"{name} in {self.module_names[module] if module is not None else 'the model'}"
        else:
            calls = self._calls()
            where = f"{name} in {self.module_names[calls[0]] if calls else 'the model'}"
            if recs is None:
                self._unruled(where, forms, calls)
                return
            module, replayers = self._replayed_by(recs[0].params, calls)
        for rec in recs:
            rec.where = where
            rec.module = module
            if replayers:
                rec.replayers = replayers
            if rec.pending:
                self._pending.put(out, rec)
            else:
                self._add(rec)

    def _consume_pending(self, func, args, kwargs, out, pend) -> None:
        for t, rec in pend:
            recs = pending_uses(func, args, kwargs, out, t, rec, self.layouts, self._batch)
            if recs is None:
                if func in (
                    torch.Tensor.to,
                    torch.Tensor.contiguous,
                    torch.Tensor.clone,
                    torch.Tensor.type_as,
                    torch.Tensor.float,
                ) and isinstance(out, Tensor):
                    self._pending.put(out, rec)  # same values: still pending
                    continue
                raise ValueError(
                    f"ghost clipping: the output of {rec.where} does not carry the batch "
                    f"dimension (its input, e.g. positions from arange or bucket ids, is the "
                    f"same for every sample) and is then used by "
                    f"{getattr(func, '__name__', func)} in {self.where()}, where its "
                    "per-sample contribution cannot be proven; use the per-sample path "
                    "(dpkern.grad_sample.compute_grad_sample)"
                )
            for r in recs:
                r.where = rec.where
                r.module = rec.module
                if getattr(rec, "replayers", None):
                    r.replayers = rec.replayers
                self._add(r)

    def _add(self, rec) -> None:
        # The record keeps the graph edge of the output, not the output: the activation is
        # freed when the model is done with it, and the edge's gradient is that of the
        # op's own output even when the tensor is modified in place afterwards
        # (``y.mul_(2)``, Falcon's ``mlp_output += attention_output``).
        if getattr(rec, "replayers", None):
            self._refuse_part_replayed(rec, rec.replayers)
        out = rec.output
        rec.edge = self._edge_of(rec, out)
        rec.meta = (out.shape, out.dtype, out.device)
        rec.output = None
        self._records.append(rec)

    def _edge_of(self, rec, out: Tensor):
        """The graph edge whose gradient is that of ``out``. When ``out`` is a view (e.g.
        ``F.linear`` with a bias on a 3-D / 4-D input: a view of its 2-D result), its own
        node is bypassed once it (or another view of its base) is changed in place
        (``y.mul_(3)``: autograd rebases the view onto the base): the edge of the base is
        taken instead when ``out`` is the whole base reshaped (same gradient, reshaped) and
        the base is the op's own temporary (not a tracked tensor of the forward, whose
        gradient would include its other uses); other views are refused."""
        b = out._base
        if b is None:
            return get_gradient_edge(out)
        k = id(b)
        if not (
            b.grad_fn is not None
            and all(d.get(k) is None or d[k][0]() is not b for d in (self._ld, self._fd, self._pd))
            and out.numel() == b.numel()
            and out.storage_offset() == b.storage_offset()
            and out.is_contiguous()
            and b.is_contiguous()
        ):
            raise ValueError(
                f"ghost clipping: the output of {rec.where or 'a ruled operation'} in "
                f"{self.where()} is a view of (part of) another tensor: its gradient "
                "could be bypassed by an in-place change, or include other uses of that tensor; use the per-sample path "
                "(dpkern.grad_sample.compute_grad_sample)"
            )
        B, shape = self._batch, tuple(out.shape)
        n = b.shape[0] if b.dim() else 0
        ps = tuple(b.shape) if n == B else (B, n // B, *b.shape[1:]) if B and n % B == 0 else ()
        if ps != shape:  # (the rule's gradient rows: reshape the base's gradient first)
            old = rec.g_map

            def g_map(g, Bn, rec=rec, old=old, shape=shape):
                g = g.reshape(shape)
                if old is not None:
                    return old(g, Bn)
                return _ps(g, Bn), [_ps(x, Bn) if isinstance(x, Tensor) else x for x in rec.inputs]

            rec.g_map = g_map
        return get_gradient_edge(b)
