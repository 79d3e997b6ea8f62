"""Capture: forward hooks that record, per covered layer, its input A and output; one backward
(``torch.autograd.grad`` with respect to those outputs) gives every output gradient G.

No second backward and no ``.grad``: the parameters' own gradients are never computed
(book-keeping builds the clipped sum from A and G), so nothing aliases ``p.grad``.

Covered layer types (the trainable parameters each one gives a *use* of, see :mod:`.norms`):

==============================  ==============================================================
``nn.Linear``                   weight: OuterUse(out=G, inp=A); bias: RowsUse(sum_t G)
``transformers`` ``Conv1D``     weight ``[nx, nf]`` (Linear's transpose): OuterUse(out=A, inp=G);
                                bias: RowsUse(sum_t G)
``nn.Embedding``                weight: IndexUse(ids, G with padding_idx tokens zeroed)
``nn.LayerNorm``                weight, bias: RowsUse (per-sample rows ``[B, d]`` instantiated)
``nn.RMSNorm``                  weight: RowsUse
anything else (opt-in)          ``instantiate_unsupported=True``: per-sample gradients of the
                                module's own parameters by ``torch.func`` (vmap of vjp), rows
==============================  ==============================================================

A trainable parameter owned by another layer type is an error naming it (unless opted in);
a parameter that takes part in the loss outside its module's recorded forward (e.g.
``nn.MultiheadAttention.out_proj``, whose ``forward`` is never called) is detected in the
same backward and is an error naming it. Modules may be called several times per forward
and parameters may be shared between modules (tied embeddings): every call is one use.

Broadcast inputs: a covered module whose input has batch size 1 while the batch has B > 1
(GPT-2's position ids ``[1, T]``) gets its input expanded to B rows by a pre-hook, so its
output gradient is per sample (the values computed are unchanged). The batch size is read
from the first tensor argument of the wrapped model's forward (or ``input_ids`` /
``inputs_embeds``). Batch-first tensors are assumed throughout.

Gradient checkpointing: the non-reentrant kind (``use_reentrant=False``) works (forwards
re-run during the backward are not recorded: the first forward's graph is what the output
gradients flow through); the reentrant kind runs its first forward without grad, so its
parameters are reported as used outside their recorded forward (an error). Modules whose
output is modified in place after their forward are an error.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .norms import IndexUse, OuterUse, RowsUse, layer_norm_rows, rms_norm_rows

__all__ = ["Capture", "module_kind", "KINDS"]

KINDS = ("linear", "conv1d", "embedding", "layer_norm", "rms_norm", "generic")


def _is_conv1d(module: nn.Module) -> bool:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is optional
        return False
    return isinstance(module, Conv1D)


def module_kind(module: nn.Module) -> str | None:
    """The covered kind of ``module`` (``"linear"``, ``"conv1d"``, ``"embedding"``,
    ``"layer_norm"``, ``"rms_norm"``) or None when it is not covered."""
    if isinstance(module, nn.Linear):
        return "linear"
    if _is_conv1d(module):
        return "conv1d"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.LayerNorm):
        return "layer_norm"
    if hasattr(nn, "RMSNorm") and isinstance(module, nn.RMSNorm):
        return "rms_norm"
    return None


@dataclass
class _Record:
    module: nn.Module
    args: tuple           # detached inputs (A: args[0] for covered kinds)
    kwargs: dict
    output: Tensor
    version: int


@dataclass
class _Layer:
    name: str
    kind: str
    params: dict = field(default_factory=dict)   # attribute name -> trainable Parameter


def _first_tensor(args, kwargs):
    for a in args:
        if isinstance(a, Tensor):
            return a
    for key in ("input_ids", "inputs_embeds"):
        if isinstance(kwargs.get(key), Tensor):
            return kwargs[key]
    return next((v for v in kwargs.values() if isinstance(v, Tensor)), None)


class Capture:
    """Hooks on every module of ``model`` that owns one of ``params``; see the module doc.

    Args:
        model: the ``nn.Module`` whose forward is run.
        params: the trainable parameters to cover (the optimizer's, in its order).
        instantiate_unsupported: cover other layer types by torch.func instantiation
            (their forward must be deterministic: it is re-run once per sample).
    Raises:
        ValueError: a parameter not found in ``model``; a trainable parameter of an
            uncovered layer type (named, unless opted in); an ``nn.Embedding`` with
            ``scale_grad_by_freq=True`` (its gradient mixes samples)."""

    def __init__(self, model: nn.Module, params, *, instantiate_unsupported: bool = False):
        self.model = model
        self.params = list(params)
        wanted = {id(p) for p in self.params}
        self.param_names: dict[int, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            self.param_names.setdefault(id(p), n)
        missing = [k for k, p in enumerate(self.params) if id(p) not in self.param_names]
        if missing:
            raise ValueError(f"ghost clipping: trainable parameters {missing} (optimizer order, "
                             "shapes " + ", ".join(str(tuple(self.params[k].shape))
                                                   for k in missing) +
                             ") are not parameters of the model")
        self.layers: dict[nn.Module, _Layer] = {}
        uncovered = []
        for mname, m in model.named_modules(remove_duplicate=True):
            own = {n: p for n, p in m.named_parameters(recurse=False, remove_duplicate=False)
                   if id(p) in wanted}
            if not own:
                continue
            kind = module_kind(m)
            if kind is None:
                if not instantiate_unsupported:
                    uncovered += [f"{mname + '.' if mname else ''}{n} ({type(m).__name__})"
                                  for n in own]
                    continue
                kind = "generic"
            if kind == "embedding" and m.scale_grad_by_freq:
                raise ValueError(f"ghost clipping: {mname} is an nn.Embedding with "
                                 "scale_grad_by_freq=True, whose gradient mixes samples (not DP)")
            self.layers[m] = _Layer(mname, kind, own)
        if uncovered:
            raise ValueError("ghost clipping does not cover the layer type of trainable "
                             "parameter(s) " + ", ".join(uncovered) + ": freeze them, use "
                             "the per-sample path (dpkern.grad_sample.compute_grad_sample + "
                             "optimizer.step()), or pass instantiate_unsupported=True")
        self._handles = []
        self._records: list[_Record] = []
        self._batch: int | None = None
        self._active = False
        self._in_backward = False

    # -- hooks -----------------------------------------------------------------------------
    def attach(self) -> None:
        """Install the hooks (idempotent)."""
        if self._handles:
            return
        self._handles.append(self.model.register_forward_pre_hook(self._root_pre,
                                                                  with_kwargs=True))
        for m, layer in self.layers.items():
            if layer.kind != "generic":
                self._handles.append(m.register_forward_pre_hook(self._expand, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._record, with_kwargs=True))
        self._active = True

    def detach(self) -> None:
        """Remove the hooks and drop unconsumed records."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._records.clear()
        self._active = False

    def discard(self) -> None:
        """Drop the records of forwards whose loss will not be back-propagated."""
        self._records.clear()

    def _root_pre(self, module, args, kwargs):
        x = _first_tensor(args, kwargs)
        self._batch = x.shape[0] if x is not None and x.dim() > 0 else None

    def _expand(self, module, args, kwargs):
        B = self._batch
        if not (self._active and B and B > 1 and torch.is_grad_enabled()):
            return None
        if args and isinstance(args[0], Tensor) and args[0].dim() > 0 and args[0].shape[0] == 1:
            return (args[0].expand(B, *args[0].shape[1:]), *args[1:]), kwargs
        return None

    def _record(self, module, args, kwargs, output):
        if not (self._active and torch.is_grad_enabled()) or self._in_backward:
            return  # in backward: a non-reentrant checkpoint's recomputation (not a use)
        if not isinstance(output, Tensor):
            raise TypeError(f"ghost clipping: {self.layers[module].name} returned "
                            f"{type(output).__name__}; covered layers must return one tensor")
        if not output.requires_grad:
            return
        det = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
        if not det and self.layers[module].kind != "generic":
            det = (_first_tensor((), kwargs).detach(),)
        self._records.append(_Record(module, det, dict(kwargs), output, output._version))

    # -- the backward ------------------------------------------------------------------------
    def backward(self, losses: Tensor, *, check: bool = False):
        """Back-propagate ``losses.sum()`` once and turn the records into uses.

        Args:
            losses: float ``[B]``, the per-sample losses of the recorded forward(s).
            check: also compute autograd's summed gradient of every parameter, returned
                for :func:`dpkern.ghost.GhostClipping` to compare (a debugging aid).
        Returns: ``(B, uses, summed)``: uses = one list per entry of ``params`` (empty:
            unused, zero gradient); summed = autograd's gradients (``check``) or None.
        Raises: ValueError (losses not ``[B]``, no record, batch mismatch, a parameter
            used outside its recorded forward), RuntimeError (an output modified in place).
        """
        records, self._records = self._records, []
        if losses.dim() != 1:
            raise ValueError(f"ghost clipping: expected per-sample losses of shape [B], got "
                             f"{tuple(losses.shape)} (do not average over the batch)")
        B = losses.shape[0]
        if B == 0:  # an empty micro-batch: zero gradient
            if losses.requires_grad and records:  # still back-propagated: under FSDP2 the
                self._in_backward = True           # backward runs collectives (parameter
                try:                               # all-gathers) every rank must join
                    torch.autograd.grad(losses.sum(), [r.output for r in records],
                                        allow_unused=True)
                finally:
                    self._in_backward = False
            return 0, [[] for _ in self.params], None
        if not losses.requires_grad:
            raise ValueError("ghost clipping: the losses do not require grad (computed under "
                             "torch.no_grad(), or from frozen parameters only)")
        for r in records:
            if r.output._version != r.version:
                raise RuntimeError(f"ghost clipping: the output of {self.layers[r.module].name} "
                                   "was modified in place after its forward; its output "
                                   "gradient is then not recoverable")
        used = {id(p) for r in records for p in self.layers[r.module].params.values()}
        extra = [p for p in self.params if id(p) not in used] if not check else list(self.params)
        self._in_backward = True
        try:
            grads = torch.autograd.grad(losses.sum(), [r.output for r in records] + extra,
                                        allow_unused=True)
        finally:
            self._in_backward = False
        gouts, gparams = grads[:len(records)], grads[len(records):]
        summed = None
        if check:
            summed = list(gparams)
        else:
            bad = [self._pname(p) for p, g in zip(extra, gparams) if g is not None]
            if bad:
                raise ValueError("ghost clipping: parameter(s) " + ", ".join(bad) + " take part "
                                 "in the loss outside the forward of the module that owns them "
                                 "(e.g. nn.MultiheadAttention.out_proj): their per-sample norm "
                                 "cannot be recorded; use the per-sample path")
        if not records:
            raise ValueError("ghost clipping: no forward was recorded (run the model's "
                             "forward with grad enabled while the hooks are attached)")
        uses: dict[int, list] = {id(p): [] for p in self.params}
        for r, g in zip(records, gouts):
            if g is None:
                continue
            if g.shape[0] != B:
                raise ValueError(f"ghost clipping: {self.layers[r.module].name} ran on a batch "
                                 f"of {g.shape[0]}, the per-sample losses have B = {B} "
                                 "(batch-first inputs expected)")
            for p, use in self._uses(r, g, B):
                uses[id(p)].append(use)
        return B, [uses[id(p)] for p in self.params], summed

    def _pname(self, p) -> str:
        return f"{self.param_names.get(id(p), '?')} (shape {tuple(p.shape)})"

    def _uses(self, r: _Record, g: Tensor, B: int):
        layer = self.layers[r.module]
        m, kind, own = r.module, layer.kind, layer.params
        if kind == "generic":
            yield from self._generic(r, g, B)
            return
        a = r.args[0]
        if a.shape[0] != B:
            raise ValueError(f"ghost clipping: {layer.name} input has batch {a.shape[0]}, "
                             f"expected {B}")
        if kind in ("linear", "conv1d"):
            gs = g.reshape(B, -1, g.shape[-1])
            As = a.reshape(B, -1, a.shape[-1])
            if "weight" in own:
                yield own["weight"], (OuterUse(gs, As) if kind == "linear" else OuterUse(As, gs))
            if "bias" in own:
                yield own["bias"], RowsUse(gs.sum(1))
        elif kind == "embedding":
            ids = a.reshape(B, -1)
            gs = g.reshape(B, ids.shape[1], -1)
            if m.padding_idx is not None:
                gs = gs.masked_fill((ids == m.padding_idx).unsqueeze(-1), 0)
            yield own["weight"], IndexUse(ids, gs, m.num_embeddings)
        elif kind == "layer_norm":
            w, b = layer_norm_rows(a, g, m.normalized_shape, m.eps, "bias" in own)
            if "weight" in own:
                yield own["weight"], RowsUse(w)
            if "bias" in own:
                yield own["bias"], RowsUse(b)
        elif kind == "rms_norm":
            yield own["weight"], RowsUse(rms_norm_rows(a, g, m.normalized_shape, m.eps))

    def _generic(self, r: _Record, g: Tensor, B: int):
        """Per-sample gradients of an uncovered module's own parameters: vmap over the
        batch of the vjp of its forward on one sample (torch.func)."""
        from torch.func import functional_call, vjp, vmap

        layer = self.layers[r.module]
        names = list(layer.params)
        prm = {n: layer.params[n].detach() for n in names}
        batched = [k for k, x in enumerate(r.args)
                   if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == B]

        def one(xs, gi):
            def f(params):
                args = list(r.args)
                for k, x in zip(batched, xs):
                    args[k] = x.unsqueeze(0)
                return functional_call(r.module, params, tuple(args), r.kwargs)
            return vjp(f, prm)[1](gi.unsqueeze(0))[0]

        self._active = False  # the re-run forward must not be recorded
        try:
            rows = vmap(one)(tuple(r.args[k] for k in batched), g)
        finally:
            self._active = bool(self._handles)
        for n in names:
            yield layer.params[n], RowsUse(rows[n])
