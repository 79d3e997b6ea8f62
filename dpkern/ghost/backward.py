"""The backward of ghost clipping's capture: one ``torch.autograd.grad`` over the graph
edges that :class:`.capture.Capture` recorded during the forward, turned into the uses of
every trainable parameter (:mod:`.norms`), with the checks that can only be made once the
losses are known (parameters used outside the recorded forward, losses that reach an
unproven batch layout, operations without a rule). ``Capture.backward`` calls
:func:`backward`; the per-sample gradients of a module without ghost rules
(``instantiate_unsupported=True``) come from :func:`generic_rows`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from . import early as early_mod
from .batch import LEAD
from .graph import grad_of, refuse_mixed, replay_leaks, unrecorded_uses
from .replay import call_forward

if TYPE_CHECKING:
    from .batch import Tracker
    from .capture import Capture, _ModuleRecord

__all__ = ["backward", "generic_rows", "refuse_unrecorded", "refuse_unreplayed"]


def refuse_unrecorded(cap: Capture, losses: Tensor, ranges, forms: Tracker) -> None:
    """Raise ValueError if the losses reach a trainable parameter through a node made
    outside every recorded forward (:func:`.graph.unrecorded_uses`): that use's
    gradient would be missing from the norms and the clipped sums (training silently
    wrong; the bound would hold). ``forms``: the forward's; a tensor a module held in
    place of its parameter (FSDP2's unsharded parameter: the graph's leaf, not p) is
    among them."""
    if not ranges:
        return
    params = {k: f.param for k, (ref, f) in forms._d.items() if ref() is not None}
    params.update((id(p), p) for p in cap.params)
    bad = unrecorded_uses(losses, ranges, params)
    if bad:
        raise ValueError(
            "ghost clipping: parameter(s) "
            + ", ".join(cap._pname(p) for p in bad)
            + " take part in the loss outside the recorded forward: a forward run "
            "before `with GhostClipping(...)` / attach(), a submodule or weight used in "
            "the loss outside model(...) (a regulariser on the weights: use the "
            "optimizer's weight_decay), or a view of a weight kept from an earlier "
            "step. Their gradient there cannot be clipped per sample; run all of it "
            "inside the model's forward, within the `with`. Nothing was updated"
        )


def backward(
    cap: Capture,
    losses: Tensor,
    *,
    check: bool = False,
    keep_bytes: int | None = None,
    early: bool = True,
):
    """Back-propagate ``losses.sum()`` once and turn the records into uses.

    Args:
        losses: float ``[B]``, the per-sample losses of the recorded forward(s).
        check: also compute autograd's summed gradient of every parameter, returned
            for :func:`dpkern.ghost.GhostClipping` to compare (a debugging aid).
        keep_bytes: memory allowed for per-sample gradients formed during the
            backward (:func:`.plan.plan_early`; 0: none); early: allow them at all
            (off under FSDP2 and with ``check``).
    Returns: ``(B, uses, summed, formed)``: uses = one list per entry of ``params``
        (empty: unused, zero gradient, or formed); summed = autograd's gradients
        (``check``) or None; formed = a :class:`.plan.Formed` or None.
    Raises: ValueError (losses not ``[B]``, no record, batch mismatch, a parameter
        consumed by an operation without a rule or used outside the recorded forward,
        reentrant activation checkpointing), RuntimeError (autograd errors of the
        backward itself).
    """
    records, generic, unreplayed = cap._records, cap._generic_records, cap._unreplayed
    unknown, roots, mixed = cap._unknown, cap._roots, cap._mixed
    ranges, forms, foreign, layouts = cap._ranges, cap.forms, cap._foreign, cap.layouts
    cap._reset()
    if foreign is not None:
        raise ValueError(
            f"ghost clipping: {foreign} was called from another thread during the "
            "recorded forward (its operations are not recorded); run the whole forward "
            "in one thread. Nothing was updated"
        )
    if losses.dim() != 1:
        raise ValueError(
            f"ghost clipping: expected per-sample losses of shape [B], got "
            f"{tuple(losses.shape)} (do not average over the batch)"
        )
    B = losses.shape[0]
    bad = [
        f"{cap._pname(p)} (consumed by {unknown[id(p)]})"
        for p in cap.params
        if id(p) in unknown and not cap.instantiate_unsupported
    ]
    if bad and B:
        raise ValueError(
            "ghost clipping has no rule for the operation consuming "
            "trainable parameter(s) " + ", ".join(bad) + ": freeze them, "
            "use the per-sample path (dpkern.grad_sample.compute_grad_sample "
            "+ optimizer.step()), or pass instantiate_unsupported=True"
        )
    generic_modules = {
        m for m, own in cap.owners.items() if any(id(p) in unknown for p in own.values())
    }
    if generic_modules:
        records = [r for r in records if r.module not in generic_modules]
        generic = [g for g in generic if g.module in generic_modules]
    else:
        generic = []
    live = [g for g in generic if g.edge is not None]  # (the others: made under no_grad)
    outputs = [r.edge for r in records] + [g.edge for g in live]
    if B == 0:  # an empty micro-batch: zero gradient
        if losses.requires_grad and outputs:  # still back-propagated: under FSDP2 the
            cap._in_backward = True  # backward runs collectives (parameter
            try:  # all-gathers) every rank must join
                grad_of(losses.sum(), outputs)
            finally:
                cap._in_backward = False
        return 0, [[] for _ in cap.params], None, None
    if not losses.requires_grad:
        raise ValueError(
            "ghost clipping: the losses do not require grad (computed under "
            "torch.no_grad(), or from frozen parameters only)"
        )
    if mixed:
        refuse_mixed(losses, mixed)
    refuse_unrecorded(cap, losses, ranges, forms)
    refuse_unreplayed(cap, generic_modules, generic, unreplayed)
    if generic:  # (also calls whose output needs no grad: a side channel may)
        refuse_leaks(cap, losses, generic, generic_modules, forms)
    used = {id(p) for r in records for p in r.params}
    used |= {id(p) for g in generic for p in cap.owners[g.module].values()}
    extra = list(cap.params) if check else [p for p in cap.params if id(p) not in used]
    uses: dict[int, list] = {id(p): [] for p in cap.params}
    formed, hooked = None, set()
    if early and not check:
        formed = early_mod.plan(cap, records, generic, B, keep_bytes)
    handles, early_ps, fired, also = [], [], set(), []
    if formed is not None:
        for r in records:
            if r.g_map is None and any(id(p) in formed.slot for p in r.params):
                hooked.add(id(r))
                handles.append(
                    r.edge.node.register_prehook(early_mod.taker(r, B, formed, uses, fired))
                )
    rest = [r for r in records if id(r) not in hooked]  # their gradients are returned
    outputs = [r.edge for r in rest] + [g.edge for g in live]
    if formed is not None:
        early_ps, also = early_mod.requests(
            cap, records, hooked, formed, bool(outputs or extra), roots
        )
    cap._in_backward = True
    try:
        # the early parameters' summed gradients are requested only so that the
        # backward reaches their uses (their hooks then form them); not used
        grads = grad_of(losses.sum(), outputs + extra + early_ps + also)
    finally:
        cap._in_backward = False
        for h in handles:
            h.remove()
    if formed is not None and len(early_ps) < len(formed.members):
        early_mod.check_reached(cap, losses, records, hooked, fired, early_ps)
    n = len(outputs)
    gouts, gparams = grads[:n], grads[n : n + len(extra)]
    summed = list(gparams) if check else None
    if not outputs and not hooked:
        raise ValueError(
            "ghost clipping: no forward was recorded: run the model's forward with "
            "grad enabled inside `with GhostClipping(model, optimizer)` (or after "
            "attach()); a forward run before it is not recorded"
        )
    if not check:
        bad = [cap._pname(p) for p, g in zip(extra, gparams) if g is not None]
        if bad:
            raise ValueError(
                "ghost clipping: parameter(s) " + ", ".join(bad) + " take part "
                "in the loss outside the recorded forward (a forward run before "
                "`with GhostClipping(...)` / attach(), or an operation that bypasses "
                "torch functions): their per-sample norm cannot be recorded; run the "
                "forward inside the `with`, or use the per-sample path"
            )
    for r, g in zip(rest, gouts[: len(rest)]):
        if g is not None:
            early_mod.take(r, g, B, formed, uses)
    for rec, g in zip(live, gouts[len(rest) :]):
        if g is not None:
            for p, use in generic_rows(cap, rec, g, B, layouts):
                uses[id(p)].append(use)
    return B, [uses[id(p)] for p in cap.params], summed, formed


def refuse_unreplayed(cap: Capture, modules, generic: list, unreplayed: dict) -> None:
    """Raise ValueError for a module of ``modules`` (it gets the per-sample pass: a
    parameter of it has no ghost rule) with a call in the recorded forward that the pass
    cannot replay, since its parameters' uses in that call would then be missing from the
    per-sample norm: a call noted in ``unreplayed`` by :meth:`.capture.Capture._leave` (an
    output that is not one tensor, e.g. nn.LSTM's tuple or a dict; the model's own call;
    an argument changed in place during the call), a recorded call (``generic``) whose
    tensor argument was changed in place since (the replay would read the new values) or
    whose output, a view, was (its graph edge is then bypassed), or no call recorded."""
    done = {r.module for r in generic}
    for r in generic:
        for lab, v in r.versions.items():
            if lab == "out":
                x, what = r.view, "its output (a view: its own gradient is then lost)"
            else:
                x = r.args[int(lab)] if lab[-1] != "=" else r.kwargs[lab[:-1]]
                what = f"its argument {lab}"
            if x._version != v:
                unreplayed.setdefault(r.module, f"had {what} changed in place later")
    for m in modules:
        why = unreplayed.get(m) or (None if m in done else "was not called")
        if why is not None:
            raise ValueError(
                f"ghost clipping (instantiate_unsupported): {cap.module_names[m]} "
                f"({type(m).__name__}) has parameters without a ghost rule, so its calls in "
                f"the recorded forward are replayed one sample at a time, but a call of it {why}"
                ": it cannot be replayed, and the uses of its parameters there would be "
                "missing from the per-sample norm. The pass replays calls that return one "
                "tensor (not a tuple or dict, e.g. nn.LSTM / nn.GRU / nn.MultiheadAttention), "
                "of a submodule (not the model itself), whose tensor arguments (and output, "
                "if a view) are not changed in place during or after the call (pass a "
                ".clone(), or use out-of-place operations); use the "
                "per-sample path (dpkern.grad_sample.compute_grad_sample). Nothing was updated"
            )


def refuse_leaks(cap: Capture, losses: Tensor, generic: list, modules, forms: Tracker) -> None:
    """Raise ValueError if a tensor computed from a parameter of a replayed module
    (``modules``) inside one of its recorded calls (``generic``) reaches the losses other
    than through the call's output (a side channel: kept as an attribute, or the output
    detached): the replay differentiates the output only (:func:`.graph.replay_leaks`).
    (A use outside the module's calls: refused or recorded by :mod:`.ops`.)"""
    held: dict = {}  # id(p) -> the replayed modules holding p (tied weights: several)
    for m in modules:
        for p in cap.owners[m].values():
            held.setdefault(id(p), (set(), p))[0].add(m)
    owner = dict(held)
    for k, (ref, f) in forms._d.items():  # (FSDP2: a tensor standing for p)
        if ref() is not None and id(f.param) in held:
            owner.setdefault(k, held[id(f.param)])
    calls = [
        (
            *r.span,
            *((r.edge.node, r.edge.output_nr) if r.edge is not None else (None, -1)),
            r.module,
        )
        for r in generic
    ]
    hit = replay_leaks(losses, calls, owner)
    if hit is None:
        return
    m, p = hit
    raise ValueError(
        f"ghost clipping (instantiate_unsupported): {cap.module_names[m]} "
        f"({type(m).__name__}) has parameters without a ghost rule, so its calls are "
        f"replayed one sample at a time, but a tensor computed from its parameter "
        f"{cap._pname(p)} inside a call of it reaches the loss other than through the "
        "call's output (kept as an attribute or in a container and used outside, or the "
        "output detached): the replay differentiates the output only, so the per-sample "
        "norm would miss that gradient. Return everything the loss uses from the module's "
        "forward, or use the per-sample path (dpkern.grad_sample.compute_grad_sample). "
        "Nothing was updated"
    )


def _sliced(cap: Capture, r: _ModuleRecord, layouts: Tracker, B: int) -> tuple[list, list]:
    """``(positions, keywords)``: the arguments of module call ``r`` that
    :func:`generic_rows` slices per sample, those whose tracked layout is LEAD (dim 0 =
    the samples), whatever the shapes of the others (a position table ``[T, d]`` with
    T == B is passed whole). Raises ValueError for a call whose output is not LEAD, that
    has no LEAD argument, or with a tensor argument that depends on the samples in another
    layout (not sliceable per sample). (The recorded positional arguments are detached
    copies made inside the recorded forward: the detach passed their layout on.)"""
    name = cap.module_names[r.module]

    def refuse(why):
        raise ValueError(
            f"ghost clipping (instantiate_unsupported): {name} ({type(r.module).__name__}) "
            f"{why}: its per-sample gradients cannot be taken one sample at a time; "
            "use the per-sample path (dpkern.grad_sample.compute_grad_sample). Nothing "
            "was updated"
        )

    if r.layout != LEAD:
        refuse("returns a tensor whose dim 0 is not proven to hold the samples")
    pos, kws = [], []
    items = [(k, f"{k}", x, pos) for k, x in enumerate(r.args)]
    items += [(k, f"{k}=", x, kws) for k, x in r.kwargs.items()]
    for k, label, x, into in items:
        lay = layouts.get(x) if isinstance(x, Tensor) else None
        if lay == LEAD and x.shape[0] == B:
            into.append(k)
        elif lay is not None or _nested_samples(x, layouts):
            refuse(
                f"is called with argument {label} that depends on the samples, but not "
                f"with them in dim 0 (layout {lay or 'nested'}, "
                f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))})"
            )
    if not pos and not kws:
        refuse("has no argument with the samples in dim 0")
    return pos, kws


def _nested_samples(x, layouts: Tracker) -> bool:
    """Whether a list / tuple / dict argument holds a tensor that depends on the samples
    (never sliced: such a call is refused)."""
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return any(
            _nested_samples(v, layouts)
            if isinstance(v, (list, tuple, dict))
            else isinstance(v, Tensor) and layouts.get(v) is not None
            for v in x
        )
    return False


def generic_rows(cap: Capture, r: _ModuleRecord, g: Tensor, B: int, layouts: Tracker):
    """Per-sample gradients of a module's own parameters: vmap over the batch of the
    vjp of its forward on one sample (torch.func). Only the arguments proven batch-led
    in the recorded forward's ``layouts`` are sliced per sample (:func:`_sliced`); the
    others are passed whole."""
    from torch.func import vjp, vmap

    from .norms import RowsUse

    own = cap.owners[r.module]
    names = list(own)
    prm = {n: own[n].detach() for n in names}
    if g.shape[0] != B:
        raise ValueError(
            f"ghost clipping: {cap.module_names[r.module]} ran on a batch "
            f"of {g.shape[0]}, the per-sample losses have B = {B}"
        )
    pos, kws = _sliced(cap, r, layouts, B)

    def one(xs, kw, gi):
        def f(params):
            args, kwargs = list(r.args), dict(r.kwargs)
            for k, x in zip(pos, xs):
                args[k] = x.unsqueeze(0)
            kwargs.update((k, x.unsqueeze(0)) for k, x in kw.items())
            return call_forward(r.module, params, tuple(args), kwargs)

        return vjp(f, prm)[1](gi.unsqueeze(0))[0]

    cap._active = False  # the re-run forward must not be recorded
    try:
        rows = vmap(one)(tuple(r.args[k] for k in pos), {k: r.kwargs[k] for k in kws}, g)
    finally:
        cap._active = bool(cap._handles)
    for n in names:
        yield own[n], RowsUse(rows[n])
