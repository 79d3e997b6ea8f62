"""Capture by operation: every use of a trainable parameter is recorded by the operation that
consumes it, whatever module, subclass or functional call it came from; one backward
(``torch.autograd.grad`` with respect to the graph edges of the recorded outputs) gives the
output gradients. A record keeps the edge, not the output tensor (activations the model is
done with are freed during the forward; an output changed in place later still yields its
op's own output gradient); the uses of parameters formed early (:func:`.plan.plan_early`)
are taken by a pre-hook on the edge's node as the backward reaches it.

A ``TorchFunctionMode`` is active during the wrapped model's forward (with grad enabled;
:mod:`.ops` handles each call). It sees every torch call and keeps two kinds of facts
(:mod:`.batch` holds the rules):

- which tensors carry the batch, and where: the forward's tensor arguments with B rows are
  *batch-led*; an op's output is batch-led or batch-major flattened (``x.view(-1, d)``) only
  when a rule proves it; anything else that depends on them has an unknown layout;
- which tensors are a parameter seen through a view, a cast, a transpose or an affine map
  with constants (``w.T``, ``w.float()``, ``1 + w``): its *forms*.

Operations with a ghost rule (the uses of :mod:`.norms`):

=========================================  =================================================
``F.linear`` (any module), ``x @ W.T``     weight: OuterUse(out=G, inp=A); bias: RowsUse
``torch.addmm(b, x, W)``, ``x @ W``        (transformers' Conv1D): OuterUse(out=A, inp=G)
``F.embedding``                            IndexUse (``padding_idx`` rows zeroed)
``F.layer_norm``, ``F.rms_norm``           RowsUse (per-sample rows instantiated)
``x * w``, ``x + b``, ``x - b``            RowsUse: w broadcast over the batch (HF's RMSNorm
                                           variants, Gemma's ``(1 + w)``, biases, scales)
=========================================  =================================================

A parameter-dependent output whose input does not carry the batch (positions from
``arange``, a buffer of ids, T5's buckets) is *pending*: its per-sample gradient is taken
where it meets the batch in a broadcasting ``+`` (GPT-2's, BERT's and BART's learned
positions); any other consumer of a pending tensor is refused (T5's relative bias).

Refused, with a ValueError naming the operation and the module path, never approximated:
a trainable parameter consumed by an operation without a rule (unless
``instantiate_unsupported=True``, which instantiates that module's per-sample gradients by
torch.func, replaying each of its calls: a call it cannot replay is refused, see
:func:`.backward.refuse_unreplayed`; hooks, random draws, side channels: :mod:`.replay`);
an activation whose batch dimension cannot be proven; operations that mix samples
(``batch_norm`` in training mode, with or without parameters); ``nn.Embedding`` with
``max_norm`` (its forward renormalises weight rows in place) or
``scale_grad_by_freq``; a buffer whose value the recorded forward changes (running
statistics written from the batch: a running-mean normaliser, InstanceNorm with
``track_running_stats=True`` in training mode), found by comparing every buffer with a copy
taken before the forward (:class:`dpkern.grad_sample.BufferSnapshot`: in place, through
``.data``, replaced or newly registered) and put back before the error. The one exception
is a cache: a non-persistent buffer (not in ``state_dict``) written visibly (not through
``.data``) with a value that the batch tracking finds independent of the samples
(transformers' dynamic / long RoPE recomputing ``inv_freq`` for a longer sequence). A write
that leaves the values as they were is no change. A parameter that takes part in the loss
outside the recorded forward is detected in the same backward: by the ``extra`` gradients
when no record uses it, and by the autograd node numbers of the recorded forwards
(:func:`.graph.unrecorded_uses`) when one does; a view of a parameter made outside the
forward (kept from ``__init__``) is refused where the forward consumes it.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from ..grad_sample import BufferSnapshot
from . import backward as backward_mod
from . import replay
from .batch import FLAT, LEAD, Form, Tracker, param_form
from .graph import next_sequence_nr
from .ops import Mode, OpRecorder
from .rules import Rec

#: the code of the frame every module call runs in (its local ``self``: the module)
_CALL_IMPL = nn.Module._call_impl.__code__

__all__ = ["Capture", "module_kind", "KINDS"]

KINDS = ("op", "generic")


def module_kind(module: nn.Module) -> str | None:
    """Kept for compatibility: ``"op"`` for every module (coverage is decided per
    operation at the first forward), None for modules dpkern refuses by construction."""
    return None if _refused_module(module) else "op"


def _refused_module(module: nn.Module) -> str | None:
    if isinstance(module, nn.Embedding) and (
        module.max_norm is not None or module.scale_grad_by_freq
    ):
        what = "max_norm" if module.max_norm is not None else "scale_grad_by_freq=True"
        return f"an nn.Embedding with {what}: its forward " + (
            "renormalises the looked-up weight rows in place (a data-dependent "
            "change of the parameters outside the mechanism)"
            if module.max_norm is not None
            else "scales gradients by batch frequencies (mixes samples)"
        )
    return None


@dataclass
class _ModuleRecord:
    """A call of a module that may get the per-sample pass (:func:`.backward.generic_rows`):
    its arguments (the positional ones detached), the graph edge of its output (the call's
    own output gradient even if the output is changed in place later; None: the output
    does not require grad), the output's batch layout, and the versions of its tensor
    arguments when it returned (:func:`.backward.refuse_unreplayed` checks them), and of
    its output when that is a view (``view``: changed in place, its edge is left behind)."""

    module: nn.Module
    args: tuple
    kwargs: dict
    edge: object
    layout: object
    versions: dict
    view: Tensor | None = None
    span: tuple = (0, 0)  # [start, end) autograd node numbers of the call (graph.replay_leaks)


@dataclass
class _Generic:
    name: str
    params: dict = field(default_factory=dict)


class Capture(OpRecorder):
    """Records the uses of ``params`` during ``model``'s forward; see the module doc.

    Args:
        model: the ``nn.Module`` whose forward is run (batch-first tensor arguments).
        params: the trainable parameters to cover (the optimizer's, in its order).
        instantiate_unsupported: a parameter consumed by an operation without a ghost rule
            gets per-sample gradients of its module by torch.func (vmap of vjp; the
            module's forward must be deterministic) instead of an error.
    Raises:
        ValueError: a parameter not found in ``model``; a refused module (see the module
            doc) that owns one of ``params``."""

    def __init__(self, model: nn.Module, params, *, instantiate_unsupported: bool = False):
        self.model = model
        self.params = list(params)
        self.instantiate_unsupported = instantiate_unsupported
        wanted = {id(p) for p in self.params}
        self.param_names: dict[int, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            self.param_names.setdefault(id(p), n)
        missing = [k for k, p in enumerate(self.params) if id(p) not in self.param_names]
        if missing:
            raise ValueError(
                f"ghost clipping: trainable parameters {missing} (optimizer order, "
                "shapes "
                + ", ".join(str(tuple(self.params[k].shape)) for k in missing)
                + ") are not parameters of the model"
            )
        self._identity = {id(p): Form(p) for p in self.params}  # (immutable: shared)
        self.owners: dict[nn.Module, dict[str, Tensor]] = {}
        self.module_names: dict[nn.Module, str] = {}
        for mname, m in model.named_modules(remove_duplicate=True):
            self.module_names[m] = mname or type(model).__name__
            own = {
                n: p
                for n, p in m.named_parameters(recurse=False, remove_duplicate=False)
                if id(p) in wanted
            }
            if not own:
                continue
            why = _refused_module(m)
            if why:
                raise ValueError(
                    f"ghost clipping refuses {mname}: {why}; use the per-sample "
                    "path (dpkern.grad_sample.compute_grad_sample)"
                )
            self.owners[m] = own
        self._handles = []
        self._active = False
        self._in_backward = False
        self._early_cache: dict = {}  # shapes of a step -> its plan_early choice
        # (their requires_grad is read at every backward: see early.requests)
        self._uncovered = [p for p in model.parameters() if id(p) not in wanted]
        self._all_early = False  # request every formed parameter (see early.check_reached)
        self._hook_ids: set = set()  # the ids of this capture's module hooks
        if instantiate_unsupported:  # (the mode reads capture._on_op: see replay)
            self._on_op = self._on_op_random
        self._reset()

    def _reset(self) -> None:
        self._records: list[Rec] = []
        self._pending = Tracker()  # pending tensor -> (rule name, param form, inputs)
        self.forms = Tracker()  # tensor -> Form of a parameter
        self.layouts = Tracker()  # tensor -> LEAD / FLAT / "unknown"
        self._fd, self._pd, self._ld = self.forms._d, self._pending._d, self.layouts._d
        self._unknown: dict[int, str] = {}  # id(param) -> first unknown consumer
        # grad_fn of each tensor that requires grad and depends on the samples in an
        # unproven layout (a reduction over the batch, dim 0 moved), first of its chain
        self._mixed: list[tuple[object, str]] = []
        self._origins: dict[int, tuple] = {}  # id(unproven tensor) -> (ref, the op behind it)
        self._generic_records: list[_ModuleRecord] = []
        # (module, its argument versions, first node number, generator states) of the
        # running calls (the last three: instantiate_unsupported only)
        self._stack: list[tuple] = []
        # module -> why a call of it could not be recorded for the per-sample pass
        self._unreplayed: dict[nn.Module, str] = {}
        self._batch: int | None = None
        # [start, end) autograd node numbers of each recorded root forward (this thread)
        self._ranges: list[tuple[int, int]] = []
        self._range_start: int | None = None
        self._roots: list[Tensor] = []  # tensors outside the parameters that require grad
        # (forward inputs, tensors made to require grad in the forward: see early.requests)
        self._mode = None
        self._depth = 0
        self._thread: int | None = None  # the thread of the recorded forward
        self._foreign: str | None = None  # a module called from another thread meanwhile
        self._buffers_before: BufferSnapshot | None = None  # the buffers at the root forward

    # -- hooks -----------------------------------------------------------------------------
    def attach(self) -> None:
        """Install the hooks (idempotent)."""
        if self._handles:
            return
        self._handles.append(self.model.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._root_post, always_call=True))
        for m in self.owners:  # (the rest: found by where(); a hook slows every call)
            self._handles.append(m.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(
                m.register_forward_hook(self._leave, with_kwargs=True, always_call=True)
            )
        self._hook_ids = {h.id for h in self._handles}
        self._active = True

    def detach(self) -> None:
        """Remove the hooks and drop unconsumed records."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._reset()  # (also the node ranges: a later attach starts afresh)
        self._active = False

    def discard(self) -> None:
        """Drop the records of forwards whose loss will not be back-propagated."""
        self._reset()

    def _recording(self) -> bool:
        return self._active and torch.is_grad_enabled() and not self._in_backward

    def _root_pre(self, module, args, kwargs):
        if self._depth and threading.get_ident() != self._thread:
            self._from_other_thread(module)
        if not self._recording() or self._depth:
            self._depth += bool(self._depth)
            return
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, Tensor)]
        first = next((t for t in tensors if t.dim() > 0), None)
        B = first.shape[0] if first is not None else None
        if self._batch is not None and B != self._batch and self._records:
            raise ValueError(
                f"ghost clipping: a forward with batch {B} after one with "
                f"{self._batch} in the same micro-batch"
            )
        self._batch = B
        self._buffers_before = BufferSnapshot(self.model)  # (before any op of the forward)
        self._range_start = next_sequence_nr()
        self._roots += [t for t in tensors if t.requires_grad]
        for t in tensors:
            if t.dim() > 0 and t.shape[0] == B:
                self.layouts.put(t, LEAD)
        put, identity = self.forms.put, self._identity
        for m, own in self.owners.items():  # (FSDP2: refreshed at each module's forward)
            for n, p in own.items():
                cur = getattr(m, n, None)
                if isinstance(cur, Tensor):
                    put(cur, identity[id(p)] if cur is p else Form(p))
        self._depth = 1
        self._thread = threading.get_ident()
        self._mode = Mode(self)
        self._mode.__enter__()

    def _root_post(self, module, args, output):
        if self._depth > 1:
            self._depth -= 1
            return
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
            if self._range_start is not None:
                self._ranges.append((self._range_start, next_sequence_nr()))
                self._range_start = None
        self._depth = 0
        snap, self._buffers_before = self._buffers_before, None
        if snap is not None:
            self._refuse_buffer_changes(snap)

    def _refuse_buffer_changes(self, snap: BufferSnapshot) -> None:
        """Raise ValueError, after restoring the buffers and dropping this micro-batch's
        records, if the recorded forward changed a buffer other than a data-independent
        cache (see the module doc). Runs also when the forward raised (the hook is
        ``always_call``: torch then keeps the forward's error and warns about this one),
        so a refused forward never leaves a buffer written from the batch."""
        bad = []
        for q, owner, how, cur in snap.changed():
            cache = (  # a non-persistent buffer given a value that is not the batch's
                q.rsplit(".", 1)[-1] in owner._non_persistent_buffers_set
                and not how.startswith("changed without a version bump")
                and self.layouts.get(cur) is None
            )
            if not cache:
                bad.append((q, owner, how, self.layouts.get(cur) is not None))
        if not bad:
            return
        snap.restore()
        self._reset()  # (fail closed: a backward of this micro-batch finds no records)
        q, owner, how, tainted = bad[0]
        why = (
            "its new value depends on the samples"
            if tainted
            else "ghost clipping cannot prove that its new value does not depend on them"
        )
        others = f" (also: {', '.join(b[0] for b in bad[1:])})" if len(bad) > 1 else ""
        raise ValueError(
            f"ghost clipping refuses buffer {q!r} ({type(owner).__name__}): it was {how} "
            f"during the recorded forward and {why}{others}. A buffer written from the "
            "batch (running statistics) releases the batch without noise (in state_dict "
            "and in every later forward) and lets one sample change the others' gradients. "
            "Put that module in eval() mode, or use a normalisation without running "
            "statistics (LayerNorm; InstanceNorm with track_running_stats=False; GroupNorm "
            "with instantiate_unsupported=True or on the per-sample path); keep state that "
            "does not depend on the data (a step counter) outside buffers. Nothing was "
            "updated: the buffers were restored and this micro-batch's records dropped."
        )

    def _enter(self, module, args, kwargs):
        if self._mode is None:
            return
        if threading.get_ident() != self._thread:
            self._from_other_thread(module)
        if self.instantiate_unsupported:
            with torch._C.DisableTorchFunction():
                start = next_sequence_nr()
            entry = (module, replay.versions(args, kwargs), start, replay.rng_state())
        else:
            entry = (module, None, None, None)
        self._stack.append(entry)
        own = self.owners.get(module)
        if own:  # FSDP2 swaps in unsharded tensors: map what the module holds now
            for n, p in own.items():
                cur = getattr(module, n, None)
                if isinstance(cur, Tensor) and cur is not p:  # (p itself: mapped at the root)
                    self.forms.put(cur, param_form(p, cur))

    def _from_other_thread(self, module) -> None:
        """Raise ValueError: ``module`` is called from another thread while a recorded
        forward runs (the mode sees the torch calls of its own thread only: that call's
        uses of the parameters would have no record). Remembered, so that the backward
        refuses too if the thread's error was swallowed."""
        name = self.module_names.get(module, type(module).__name__)
        self._foreign = self._foreign or name
        raise ValueError(
            f"ghost clipping: {name} was called from another thread during the recorded "
            "forward; the capture sees the operations of the forward's own thread only. "
            "Run the whole forward in one thread"
        )

    def _leave(self, module, args, kwargs, output):
        """Record a finished call of an owner for the per-sample pass, or note why it cannot
        be replayed (:func:`.backward.refuse_unreplayed` refuses it if the module gets the
        pass: the uses of its parameters in that call would be missing from the norm)."""
        stack = self._stack
        if threading.get_ident() != self._thread or not any(e[0] is module for e in stack):
            return  # (a call not entered in a recorded forward)
        while stack[-1][0] is not module:  # (a call whose forward hooks did not run)
            self._unreplayable(stack.pop()[0], "did not return normally")
        _, before, start, rng = stack.pop()
        if not self.instantiate_unsupported or module not in self.owners:
            return
        if module is self.model:
            return self._unreplayable(module, "is the model itself (its own call is not replayed)")
        if replay.rng_changed(rng, replay.rng_state()):
            return self._unreplayable(module, replay.random_why("a random generator advanced"))
        hooks = replay.hooks_problem(module, self._hook_ids)
        if hooks:
            return self._unreplayable(module, hooks)
        if not isinstance(output, Tensor):
            what = "None (or raised)" if output is None else f"a {type(output).__name__}"
            return self._unreplayable(module, f"returned {what}, not a single tensor")
        after = replay.versions(args, kwargs)
        for lab, (x, v) in after.items():
            if lab in before and before[lab][0] is x and before[lab][1] != v:
                return self._unreplayable(module, f"changed its argument {lab} in place")
        versions = {lab: v for lab, (_, v) in after.items()}
        with torch._C.DisableTorchFunction():  # (inspecting the output: not a torch op)
            edge = get_gradient_edge(output) if output.requires_grad else None
            view = output if output._base is not None else None
            if view is not None:
                versions["out"] = output._version
        det = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)  # (in the mode:
        # the copies get the arguments' layouts)
        with torch._C.DisableTorchFunction():
            span = (start, next_sequence_nr())
        rec = _ModuleRecord(
            module, det, dict(kwargs), edge, self.layouts.get(output), versions, view, span
        )
        self._generic_records.append(rec)

    def _unreplayable(self, module, why: str) -> None:
        if module in self.owners:
            self._unreplayed.setdefault(module, why)

    def _on_op_random(self, func, args, kwargs):
        """``_on_op`` under instantiate_unsupported: a random draw inside running calls
        makes them unreplayable (:mod:`.replay`)."""
        if self._stack and replay.draws_random(func, args, kwargs):
            why = replay.random_why(getattr(func, "__name__", str(func)))
            for entry in self._stack:
                self._unreplayable(entry[0], why)
        return OpRecorder._on_op(self, func, args, kwargs)

    def current_module(self) -> nn.Module | None:
        """The innermost of the model's modules whose call is running (read off the
        Python stack: the frames of ``nn.Module._call_impl``), or None outside them."""
        names, f = self.module_names, sys._getframe(1)
        while f is not None:
            if f.f_code is _CALL_IMPL:
                m = f.f_locals.get("self")
                if m in names:
                    return m
            f = f.f_back
        return None

    def where(self) -> str:
        """The path of :meth:`current_module` (messages), or "the model"."""
        m = self.current_module()
        return self.module_names[m] if m is not None else "the model"

    # -- the backward ------------------------------------------------------------------------
    def backward(self, losses: Tensor, *, check=False, keep_bytes=None, early=True):
        """Back-propagate ``losses.sum()`` once and turn the records into uses:
        :func:`.backward.backward` (arguments, returns and errors there)."""
        return backward_mod.backward(self, losses, check=check, keep_bytes=keep_bytes, early=early)

    def _pname(self, p) -> str:
        return f"{self.param_names.get(id(p), '?')} (shape {tuple(p.shape)})"


# re-exported for the rules' users
__all__ += ["FLAT", "LEAD", "Form"]
