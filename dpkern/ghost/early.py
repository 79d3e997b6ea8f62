"""Per-sample gradients formed during the backward (:func:`.plan.plan_early`): which
parameters (:func:`plan`), which tensors the backward is asked for so that it reaches
their uses (:func:`requests`), the check afterwards that it did (:func:`check_reached`),
and the pre-hooks on the uses' graph nodes that add each use into its per-sample gradient
as its output gradient arrives (:func:`taker`, :func:`take`).

The functions take the :class:`.capture.Capture` of the step (``cap``): its parameters,
its plan cache and its flag that every formed parameter is requested."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from .norms import acc_dtype
from . import plan as _plan
from .graph import reached

__all__ = ["check_reached", "plan", "requests", "take", "taker"]


def requests(cap, records, hooked, formed, others: bool, roots: list):
    """``(params, also)``: the formed parameters whose summed gradients are requested from
    the backward, only so that it runs their uses' nodes (whose pre-hooks form them),
    and the other tensors requested for the same reason (their gradients unused);
    ``others``: gradients are requested anyway; ``roots``: the forward's tensors outside
    the parameters that require grad.

    A use whose activation required grad needs no request: that activation descends from
    tensors that require grad, and with each of them requested or reached, the backward
    passes the use's node anyway, so the parameter's summed gradient (a GEMM as large as
    the non-private step's, discarded) is not computed. By induction down the graph:
    the covered parameters' uses are requested (recorded outputs), reached in turn, or
    have an activation that needs no grad (those parameters are requested); the other
    tensors that require grad, the ``roots`` (inputs, tensors made to require grad in
    the forward, e.g. by transformers' ``enable_input_require_grads`` under gradient
    checkpointing) and the model's parameters outside the covered ones, are requested.
    A tensor made to require grad before the forward and kept as a plain attribute
    escapes this: :func:`check_reached` catches it afterwards."""
    members = [cap.params[k] for k, _, _ in formed.members]
    if cap._all_early:
        return members, []
    also = list({id(t): t for t in roots if t.requires_grad}.values())
    also += [p for p in cap._uncovered if p.requires_grad]
    need = {id(p) for r in records if id(r) in hooked and not r.grad_input for p in r.params}
    asked = [p for p in members if id(p) in need]
    if not (asked or others or also):  # (autograd.grad needs something to reach)
        return members, []
    return asked, also


def check_reached(cap, losses, records, hooked, fired, early_ps) -> None:
    """Raise if the backward skipped the node of a hooked use whose parameter was not
    requested although the node lies in the loss's graph (a tensor requiring grad
    outside the covered parameters fed its activation): that use would be missing from
    the per-sample gradient. Nothing was added anywhere yet; the next steps request
    every formed parameter."""
    asked = {id(p) for p in early_ps}
    skipped = {
        r.edge.node: r
        for r in records
        if id(r) in hooked and id(r) not in fired and not any(id(p) in asked for p in r.params)
    }
    if not skipped or losses.grad_fn is None:
        return
    hit = [skipped[node] for node in reached(losses, skipped)]
    if hit:
        cap._all_early = True
        names = sorted({cap._pname(p) for r in hit for p in r.params})
        raise RuntimeError(
            "ghost clipping: the backward skipped the use(s) of " + ", ".join(names) + " "
            "formed during it (their input depends on a tensor that requires grad but is "
            "neither a trainable parameter nor a model input); nothing was updated. Run "
            "the step again: from now on their gradients are requested (or freeze that "
            "tensor)"
        )


def plan(cap, records, generic, B: int, keep_bytes):
    """The :class:`.plan.Formed` block of the parameters worth forming during the
    backward (:func:`.plan.plan_early`, decided on shape-only copies of the uses),
    or None. Only plain-tensor parameters whose every use comes from a record with
    the batch in its own inputs (not a pending one, not a module of ``generic``)."""
    if keep_bytes == 0 or not B or any(type(p.data) is not Tensor for p in cap.params):
        return None
    # Cheap pre-filter (this runs every step): weights and embeddings (biases and norm
    # weights hold only [B, n] rows) whose float32 per-sample gradients are smaller than
    # what their records hold at most (outputs and every tensor input).
    bound: dict[int, int] = {}
    for r in records:
        size = math.prod(r.meta[0]) * r.meta[1].itemsize
        size += sum(x.numel() * x.element_size() for x in r.inputs if isinstance(x, Tensor))
        for p in r.params:
            bound[id(p)] = bound.get(id(p), 0) + size
    cand = {id(p) for p in cap.params if p.dim() >= 2 and 4 * B * p.numel() < bound.get(id(p), 0)}
    if not cand:
        return None
    recs = [r for r in records if any(id(p) in cand for p in r.params)]
    ruled_out = {id(p) for g in generic for p in cap.owners[g.module].values()}
    key = (B, keep_bytes, frozenset(ruled_out)) + tuple(
        (
            r.where,
            r.g_map is None,
            tuple(id(p) for p in r.params),
            tuple(r.meta[0]),
            r.meta[1],
            tuple((tuple(x.shape), x.dtype) for x in r.inputs if isinstance(x, Tensor)),
        )
        for r in recs
    )
    decided = cap._early_cache.get(key)
    if decided is None:  # (the same shapes give the same choice: decided once)
        decided = _decide(cap, recs, cand, ruled_out, B, keep_bytes)
        if len(cap._early_cache) >= 64:
            cap._early_cache.clear()
        cap._early_cache[key] = decided
    chosen, dtype = decided
    if chosen is None:
        return None
    device = recs[0].meta[2]
    return _plan.Formed(cap.params, chosen, B, dtype, device)


def _decide(cap, recs, cand, ruled_out, B, keep_bytes):
    """``(chosen, dtype)`` of :func:`plan` from shape-only (meta) copies of the
    candidates' uses; ``(None, None)``: none."""
    slot = {id(p): k for k, p in enumerate(cap.params)}
    meta: list[list] = [[] for _ in cap.params]
    ruled_out = set(ruled_out)
    for r in recs:
        if r.g_map is not None:  # pending: its gradient comes from where it met the batch
            ruled_out |= {id(p) for p in r.params}
            continue
        try:
            g = torch.empty(r.meta[0], dtype=r.meta[1], device="meta")
            ins = [x.to("meta") if isinstance(x, Tensor) else x for x in r.inputs]
            for p, use in dataclasses.replace(r, inputs=ins).make(g, B):
                meta[slot[id(p)]].append(use)
        except Exception:  # (any doubt: this record's parameters stay on the old path)
            ruled_out |= {id(p) for p in r.params}
    chosen = _plan.plan_early(  # (looked up at the call: tests replace it)
        cap.params,
        [us if id(p) in cand and id(p) not in ruled_out else [] for p, us in zip(cap.params, meta)],
        B,
        keep_bytes,
    )
    if not any(chosen):
        return None, None
    floats = [t for k, us in enumerate(meta) if chosen[k] for u in us for t in _plan._floats(u)]
    return chosen, acc_dtype(*floats)


def take(r, g: Tensor, B: int, formed, uses: dict) -> None:
    """Turn record ``r`` and its output gradient into uses: a formed parameter's are added
    to its per-sample gradient at once, the others' kept in ``uses``."""
    slot = formed.slot if formed is not None else {}
    for p, use in r.make(g, B):
        k = slot.get(id(p))
        if k is None:
            uses[id(p)].append(use)
        else:
            formed.add(k, use)


def taker(r, B: int, formed, uses: dict, fired: set):
    """The pre-hook (on the output's graph node) of a record with a formed parameter: its
    uses are taken as soon as its output gradient arrives, then its inputs (the
    activations) are let go; ``fired`` collects the records it ran for."""
    nr = r.edge.output_nr

    def hook(grad_outputs):
        fired.add(id(r))
        g = grad_outputs[nr]
        if g is not None:
            take(r, g, B, formed, uses)
        r.inputs = None

    return hook
