"""What the ghost backward checks on the autograd graph of the per-sample losses: which
recorded nodes the losses reach (:func:`reached`), the refusal of losses that reach a
tensor mixing the samples (:func:`refuse_mixed`), and the one differentiation call with
its refusal of reentrant activation checkpointing (:func:`grad_of`)."""

from __future__ import annotations

import bisect
import functools

import torch
from torch import Tensor

__all__ = [
    "grad_of",
    "next_sequence_nr",
    "reached",
    "refuse_mixed",
    "replay_leaks",
    "unrecorded_uses",
]

REENTRANT = (
    "ghost clipping cannot run through reentrant activation checkpointing "
    "(torch.utils.checkpoint with use_reentrant=True, the default of "
    "model.gradient_checkpointing_enable() in some transformers versions): it re-runs "
    "the block inside a nested .backward() that torch.autograd.grad cannot take part in. "
    "Enable it non-reentrant: model.gradient_checkpointing_enable("
    "gradient_checkpointing_kwargs={'use_reentrant': False}), or "
    "checkpoint(fn, *args, use_reentrant=False); nothing was updated"
)


def reached(loss: Tensor, wanted, *, first: bool = False) -> list:
    """The nodes of ``wanted`` (a set or dict of autograd nodes; a callable ``node ->
    bool`` also works) that the graph of ``loss`` reaches, in the order found; ``first``:
    stop at the first. Walks ``next_functions`` from ``loss.grad_fn`` once (each node
    visited once); stops early when every node of a set or dict is found."""
    test = wanted if callable(wanted) else wanted.__contains__
    total = None if callable(wanted) else len(wanted)
    seen, todo, hit = set(), [loss.grad_fn], []
    while todo and (total is None or len(hit) < total):
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if test(node):
            hit.append(node)
            if first:
                break
        todo.extend(fn for fn, _ in node.next_functions)
    return hit


def refuse_mixed(loss: Tensor, mixed: list) -> None:
    """Raise ValueError if the graph of ``loss`` reaches a node of ``mixed`` (``(grad_fn,
    where)``): the losses then depend on the samples through a tensor whose batch
    dimension is not proven (a reduction over the batch mixes them: each output gradient
    row would carry the other samples' terms), with or without a trainable parameter
    behind it."""
    nodes = dict(mixed)
    hit = reached(loss, nodes, first=True)
    if hit:
        raise ValueError(
            f"ghost clipping: the per-sample losses depend on {nodes[hit[0]]}, whose "
            "output depends on the samples without a proven batch dimension (a "
            "reduction over the batch, e.g. x.mean(0) or batch statistics, or dim 0 "
            "moved): each sample's gradient would carry the others' data; "
            "refused (nothing was updated)"
        )


def next_sequence_nr() -> int:
    """The sequence number the next autograd node of this thread gets (autograd numbers
    the nodes of each thread in creation order): a tensor op run now, under grad mode,
    whose node number is then returned."""
    with torch.enable_grad():
        return (torch.zeros((), requires_grad=True) * 1).grad_fn._sequence_nr() + 1


@functools.cache
def _node_types() -> tuple[type, type]:
    """The classes of autograd's accumulator node (a leaf's) and of a cast's node."""
    with torch.enable_grad():
        w = torch.zeros(1, requires_grad=True)
        cast = w.to(torch.float64).grad_fn
    return type(cast.next_functions[0][0]), type(cast)


def _is_leaf(node) -> bool:
    return hasattr(node, "variable")  # an AccumulateGrad node


def _cached_cast(node) -> bool:
    """A cast straight onto a leaf (``ToCopyBackward0`` -> accumulator): autocast's weight
    cache, made in an earlier forward and reused; its consumers are what count."""
    if type(node).__name__ != "ToCopyBackward0":
        return False
    nxt = [fn for fn, _ in node.next_functions if fn is not None]
    return len(nxt) == 1 and _is_leaf(nxt[0])


def unrecorded_uses(loss: Tensor, ranges: list, params: dict) -> list:
    """The parameters of ``params`` (``{id(leaf): p}``: a parameter by itself, or the
    tensor that stands for it in the graph, such as FSDP2's unsharded parameter) that the
    graph of ``loss`` reaches through a node made outside every recorded forward
    (``ranges``: the ``[start, end)`` autograd node numbers of each recorded forward of
    this thread): a use before it (a forward before ``with GhostClipping(...)``, a view
    of the weight kept from an earlier step) or after it (a submodule called, or a weight used, in the loss outside
    ``model(...)``), which the records do not see: its gradient would be missing from the
    norms and the clipped sums. The node consuming the parameter's accumulator is the one
    checked; autocast's cached casts (:func:`_cached_cast`) are looked through to their
    consumers. Walks the graph once."""

    def inside(node) -> bool:
        n = node._sequence_nr()
        return any(lo <= n < hi for lo, hi in ranges)

    acc, to_copy = _node_types()
    seen, todo, hit = set(), [loss.grad_fn], {}
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for fn, _ in node.next_functions:
            if fn is None:
                continue
            kind = type(fn)
            if kind is acc:  # (a leaf: nothing beyond it)
                leaf = fn
            elif kind is to_copy and _cached_cast(fn):  # (its consumers are what count)
                leaf = fn.next_functions[0][0]
            else:
                todo.append(fn)
                continue
            p = params.get(id(leaf.variable))
            if p is not None and id(p) not in hit and not inside(node):
                hit[id(p)] = p
    return list(hit.values())


def _leaf_of(fn, acc):
    """The accumulator a graph edge ends at (a leaf, or autocast's cached cast of one), or
    None for an interior node."""
    if type(fn) is acc:
        return fn
    return fn.next_functions[0][0] if _cached_cast(fn) else None


def replay_leaks(loss: Tensor, calls: list, owner: dict):
    """``(module, p)``: a way the graph of ``loss`` gets a gradient of parameter ``p`` of a
    replayed module that the replay of its calls does not give, or None. ``calls``: ``(lo,
    hi, node, nr, module)`` per replayed call: its ``[lo, hi)`` autograd node numbers
    (calls nest: the spans are nested or disjoint) and its output edge (node None: the
    output needs no grad); ``owner``: ``{id(leaf): (modules, p)}`` of those modules'
    parameters (or the tensors standing for them in the graph; ``modules``: the replayed
    modules holding p). Found: an edge from outside a call into a node made inside it,
    other than the call's output edge, that leads (within the call, not through its
    output edge) to a parameter of the call's module: a tensor computed from the
    parameters inside the call that reaches the loss other than through the call's
    output (kept as an attribute). Walks the graph once (plus, from each such edge, the
    nodes of that call)."""
    acc, _ = _node_types()
    calls = sorted(calls, key=lambda c: (c[0], -c[1]))
    los, parent, open_ = [c[0] for c in calls], [], []
    for k, c in enumerate(calls):  # the innermost call enclosing each call
        while open_ and calls[open_[-1]][1] <= c[0]:
            open_.pop()
        parent.append(open_[-1] if open_ else -1)
        open_.append(k)

    def containing(n) -> list:
        k = bisect.bisect_right(los, n) - 1
        while k >= 0 and calls[k][1] <= n:
            k = parent[k]
        out = []
        while k >= 0:
            out.append(calls[k])
            k = parent[k]
        return out

    def param_inside(v, c):  # (v: made inside call c)
        seen, todo = set(), [v]
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            for fn, nr in node.next_functions:
                if fn is None or (fn is c[2] and nr == c[3]):
                    continue
                leaf = _leaf_of(fn, acc)
                if leaf is not None:
                    hit = owner.get(id(leaf.variable))
                    if hit is not None and c[4] in hit[0]:
                        return hit[1]
                elif c[0] <= fn._sequence_nr() < c[1]:
                    todo.append(fn)
        return None

    seen, todo = set(), [(None, [(loss.grad_fn, loss.output_nr)])]
    while todo:
        u, edges = todo.pop()
        in_u = [] if u is None else containing(u._sequence_nr())
        for fn, nr in edges:
            if fn is None or _leaf_of(fn, acc) is not None:
                continue
            for c in containing(fn._sequence_nr()):
                if not any(c is d for d in in_u) and not (fn is c[2] and nr == c[3]):
                    p = param_inside(fn, c)
                    if p is not None:
                        return c[4], p
            if fn not in seen:
                seen.add(fn)
                todo.append((fn, fn.next_functions))
    return None


def _reentrant(node) -> bool:
    return type(node).__name__ == "CheckpointFunctionBackward"


def grad_of(loss: Tensor, inputs: list):
    """``torch.autograd.grad(loss, inputs, allow_unused=True)``; a reentrant checkpoint in
    the graph is reported as a ValueError saying what to do instead."""
    try:
        return torch.autograd.grad(loss, inputs, allow_unused=True)
    except RuntimeError as exc:
        if "use_reentrant" in str(exc) or reached(loss, _reentrant, first=True):
            raise ValueError(REENTRANT) from exc
        raise
