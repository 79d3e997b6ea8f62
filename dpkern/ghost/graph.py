"""What the ghost backward checks on the autograd graph of the per-sample losses: which
recorded nodes the losses reach (:func:`reached`), the refusal of losses that reach a
tensor mixing the samples (:func:`refuse_mixed`), and the one differentiation call with
its refusal of reentrant activation checkpointing (:func:`grad_of`)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["grad_of", "next_sequence_nr", "reached", "refuse_mixed", "used_before"]

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


#: Unary autograd nodes that transform a tensor without data (a cast, a view, a copy):
#: autocast caches a parameter's cast across forwards, so such a chain ending at a
#: parameter can predate the recorded forward and still be used only inside it.
_PARAM_TRANSFORMS = frozenset(
    {
        "ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0",
        "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "ExpandBackward0",
        "AliasBackward0", "CloneBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
        "SqueezeBackward1",
    }
)  # fmt: skip


def _param_transform(node) -> bool:
    """``node`` is a chain of :data:`_PARAM_TRANSFORMS` ending at a leaf's accumulator."""
    while type(node).__name__ in _PARAM_TRANSFORMS:
        nxt = [fn for fn, _ in node.next_functions if fn is not None]
        if len(nxt) != 1:
            return False
        node = nxt[0]
    return hasattr(node, "variable")


def used_before(loss: Tensor, seq0: int, params: dict) -> list:
    """The parameters of ``params`` (``{id(p): p}``) that the graph of ``loss`` reaches
    through a computation made before autograd node number ``seq0`` (an operation run
    before the recorded forward began, e.g. a forward before ``with GhostClipping(...)``):
    their gradient through it is invisible to the records. A node's inputs are always
    older than the node, so below an older node every node is older; a chain that only
    casts or views a parameter (autocast's cached weight casts) is no computation and is
    not counted. Walks the graph once."""
    seen, old_seen, todo, hit = set(), set(), [loss.grad_fn], {}
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node._sequence_nr() < seq0 and not hasattr(node, "variable"):
            if _param_transform(node):
                continue
            below = [node]  # everything below is older: collect its parameters
            while below:  # (its own seen set: a cast chain skipped above counts here)
                n = below.pop()
                for fn, _ in n.next_functions:
                    if fn is None or fn in old_seen:
                        continue
                    old_seen.add(fn)
                    if id(getattr(fn, "variable", None)) in params:
                        hit.setdefault(id(fn.variable), fn.variable)
                    below.append(fn)
            continue
        todo.extend(fn for fn, _ in node.next_functions)
    return list(hit.values())


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
