"""Per-sample gradients with torch.func, in Opacus' ``p.grad_sample`` convention.

:func:`compute_grad_sample` gives users without Opacus one call that sets, for every
trainable parameter p of a module, ``p.grad_sample`` of shape ``[B, *p.shape]``: the
gradient of sample i's loss alone (``functional_call`` + ``vmap(grad)``, the recipe of
the torch.func per-sample-gradients tutorial). Where vmap cannot trace the model (an
``autograd.Function`` without ``setup_context``, as in BLOOM; data-dependent control flow
or ``.item()`` on a padding mask, as in BERT) it falls back, with a one-time
:class:`VmapFallbackWarning`, to a loop of B ordinary forward/backward passes on one sample
each. Models wrapped in Opacus' ``GradSampleModule`` need nothing from here: dpkern's
optimizers read the same attribute.

A per-sample forward must leave the module's buffers as they were: a buffer written from
the samples (running statistics: InstanceNorm with ``track_running_stats=True`` in training
mode, a running-mean normaliser) would release them without noise (in ``state_dict`` and in
every later forward), and in the loop it would let sample i's forward see samples 0..i-1.
:class:`BufferSnapshot` finds such writes (a buffer's value changed, whether in place, through
``.data`` or by replacement); they are refused with a ValueError and the buffers put back.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from .separability import check_separable

_METHODS = ("auto", "vmap", "loop")
# Module classes already warned about (the fallback warning is shown once per class).
_FALLBACK_WARNED: set[type] = set()


class VmapFallbackWarning(UserWarning):
    """compute_grad_sample could not vmap a module and loops over the samples instead."""


def _as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _reason(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    first = first if len(first) <= 300 else first[:297] + "..."
    return f"{type(err).__name__}: {first}"


def _warn_fallback(module: nn.Module, err: BaseException) -> None:
    cls = type(module)
    if cls in _FALLBACK_WARNED:
        return
    _FALLBACK_WARNED.add(cls)
    warnings.warn(
        f"compute_grad_sample: torch.func.vmap cannot run on {cls.__name__} ({_reason(err)}); "
        "falling back to a loop over samples, which is slower: B forward and backward passes "
        "of one sample each instead of one vectorised pass. Every sample's forward sees the "
        "same parameters and buffers (a forward that changes a buffer is refused), so for a "
        "deterministic forward the gradients are vmap's. Pass method='loop' to skip the vmap "
        "attempt. This warning is shown once per module class.",
        VmapFallbackWarning,
        stacklevel=4,  # (the caller of compute_grad_sample, via _per_sample)
    )


def _version(t: Tensor):
    try:
        return t._version
    except RuntimeError:  # an inference tensor: no version counter
        return None


def _ptr(t: Tensor):
    try:
        return t.data_ptr()
    except RuntimeError:
        return None


def _same_values(a, b: Tensor) -> bool:
    """``a`` holds exactly ``b``'s values (shape, dtype, device; NaN where ``b`` has NaN)."""
    if not isinstance(a, Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device != b.device or a.layout != b.layout:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    na, nb = a.isnan(), b.isnan()
    return torch.equal(na, nb) and torch.equal(a[~na], b[~nb])


def _tracked(b) -> bool:
    """Whether a buffer's values can be copied and compared (not None, lazy or meta)."""
    return (
        isinstance(b, Tensor)
        and not nn.parameter.is_lazy(b)
        and not b.is_meta
        and b.layout == torch.strided
    )


class BufferSnapshot:
    """The buffers of ``module`` and its submodules before a forward (each buffer's object,
    version counter, storage address and a copy of its values), to find those the forward
    changed and put them back. Also used by ghost clipping (:mod:`dpkern.ghost.capture`).

    A buffer *changed* when its value differs from the copy: written in place (the version
    counter moved), through ``.data`` (no version bump: only the values tell), replaced by
    another tensor (``register_buffer`` / attribute assignment), or registered during the
    forward. A write that leaves the values as they were (a cache refreshed with the same
    numbers) is not a change: it releases nothing and no other sample sees a difference.
    Costs one copy of the buffers (usually small: rotary frequencies, position ids)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.entries = []  # (owner, qualified name, attribute, tensor, version, ptr, copy)
        self.names: dict[nn.Module, set] = {}
        copies: dict[int, Tensor] = {}
        with torch.no_grad():
            for mname, m in module.named_modules():
                self.names[m] = set(m._buffers)
                for n, b in m._buffers.items():
                    if not _tracked(b):
                        continue
                    c = copies.get(id(b))
                    if c is None:
                        c = copies[id(b)] = b.detach().clone()
                    q = f"{mname}.{n}" if mname else n
                    self.entries.append((m, q, n, b, _version(b), _ptr(b), c))

    def changed(self) -> list[tuple[str, nn.Module, str, Tensor | None]]:
        """``(qualified name, owner module, how, current tensor)`` of every changed buffer,
        in module order; ``how`` says how it was written."""
        out = []
        for m, q, n, b, v, p, c in self.entries:
            cur = m._buffers.get(n)
            if cur is None or _same_values(cur, c):
                continue  # (set to None or removed: nothing released)
            if cur is not b:
                how = "replaced by another tensor"
            elif _version(b) != v:
                how = "written in place"
            else:
                how = "changed without a version bump (through .data or another alias)"
            out.append((q, m, how, cur))
        for mname, m in self.module.named_modules():
            known = self.names.get(m, ())
            for n, b in m._buffers.items():
                if n not in known and isinstance(b, Tensor):
                    q = f"{mname}.{n}" if mname else n
                    out.append((q, m, "newly registered", b))
        return out

    def restore(self) -> None:
        """Put every buffer back as it was: the same tensor object under each name, holding
        its old values; buffers registered since are removed."""
        with torch.no_grad():
            for mname, m in self.module.named_modules():
                known = self.names.get(m, ())
                for n in [n for n in m._buffers if n not in known]:
                    del m._buffers[n]
                    m._non_persistent_buffers_set.discard(n)
            for m, _, n, b, _, p, c in self.entries:
                if m._buffers.get(n) is not b:
                    m._buffers[n] = b
                if _same_values(b, c):
                    continue
                if _ptr(b) == p and b.shape == c.shape and b.dtype == c.dtype:
                    b.copy_(c)
                else:  # (its storage was swapped through .data / set_)
                    b.data = c.clone()


def _refuse_buffer_changes(module: nn.Module, snap: BufferSnapshot, when: str) -> None:
    """Raise ValueError (after restoring the buffers) if the forward changed a buffer."""
    changes = snap.changed()
    if not changes:
        return
    snap.restore()
    q, owner, how, _ = changes[0]
    others = f" (also: {', '.join(c[0] for c in changes[1:])})" if len(changes) > 1 else ""
    raise ValueError(
        f"compute_grad_sample: buffer {q!r} of {type(owner).__name__} was {how} during "
        f"{when}{others}. A buffer written from the samples (running statistics) releases "
        "them without noise (in state_dict and in every later forward) and lets one sample "
        "change the others' gradients, so a per-sample forward must leave every buffer as "
        "it was. Put that module in eval() mode, or use a normalisation without running "
        "statistics (GroupNorm, LayerNorm, or InstanceNorm with track_running_stats=False); "
        "keep state that does not depend on the data (a step counter) outside buffers. "
        "Nothing was updated: the buffers were restored and no grad_sample was set."
    )


def compute_grad_sample(
    module: nn.Module,
    loss_fn: Callable,
    inputs,
    targets=None,
    *,
    chunk_size: int | None = None,
    method: str = "auto",
    batch_kwargs: dict[str, Tensor] | None = None,
) -> Tensor:
    """Set ``p.grad_sample`` (``[B, *p.shape]``, the parameter's dtype) for every trainable
    parameter of ``module`` and return the per-sample losses (float32 ``[B]``).

    Args:
        module: any ``nn.Module`` without cross-sample operations (no BatchNorm in train
            mode: it mixes samples, which DP forbids) whose forward leaves its buffers as
            they were (no running statistics updated in train mode: InstanceNorm with
            ``track_running_stats=True``, a running-mean normaliser). Its training mode is
            left as is.
        loss_fn: ``loss_fn(output, target)`` -> scalar loss of ONE sample; it is called
            with batch dimension 1 (``output = module(x[i:i+1])``), so ordinary losses
            such as ``F.cross_entropy`` work unchanged. With ``targets=None`` it is called
            as ``loss_fn(output)``.
        inputs: a tensor ``[B, ...]`` or a tuple of them (positional arguments of module);
            ``()`` when every input is in ``batch_kwargs``.
        targets: a tensor ``[B, ...]``, or None.
        chunk_size: samples per vmap chunk (bounds memory; None = all at once). The loop
            holds one sample at a time and ignores it.
        method: ``"vmap"``: torch.func only (errors propagate); ``"loop"``: one ordinary
            forward + ``torch.autograd.grad`` per sample (B passes; for models vmap cannot
            trace); ``"auto"`` (default): vmap, and if the vmap trace raises a
            ``RuntimeError`` (functorch's errors: ``autograd.Function`` without
            ``setup_context``, data-dependent control flow, ``.item()``, in-place ops on
            unbatched tensors, ...) the loop, with a one-time :class:`VmapFallbackWarning`
            per module class. The loop is tried on the first sample before it is adopted;
            if that fails too, the original vmap error is raised, so genuine errors (a
            shape mismatch in the loss) still surface. Other exceptions (ValueError,
            TypeError, ... from user code) are never caught.
        batch_kwargs: keyword inputs of module, each a tensor ``[B, ...]`` sliced per
            sample like ``inputs`` (e.g. ``{"attention_mask": mask}`` for Hugging Face
            models whose mask is not the second positional argument).
    Returns:
        float32 tensor ``[B]``: each sample's loss.
    Raises:
        ValueError: inputs/targets/batch_kwargs with different B, no batched input, a
            module without trainable params, an FSDP2-sharded module, an unknown method;
            batch norm, or instance norm with ``track_running_stats=True``, in training
            mode; a buffer whose value a per-sample forward changed (in place, through
            ``.data``, replaced or newly registered: named in the message; the buffers
            are then restored and no ``grad_sample`` is set); a forward that mixes
            samples (:func:`dpkern.separability.check_separable`, at a module's first
            call with B >= 2: its first rows forwarded together get other losses than
            each alone, in eval mode). A write that leaves a
            buffer's values as they were is allowed. State kept outside buffers (plain
            Python attributes) is not checked.
    Source: torch.func per-sample-gradients recipe; Opacus' grad_sample convention.
    """
    if method not in _METHODS:
        raise ValueError(f"compute_grad_sample: method must be one of {_METHODS}, got {method!r}")
    inputs = _as_tuple(inputs)
    batch_kwargs = dict(batch_kwargs or {})
    for k, v in batch_kwargs.items():
        if not isinstance(v, Tensor):
            raise ValueError(
                f"compute_grad_sample: batch_kwargs[{k!r}] must be a tensor "
                f"[B, ...], got {type(v).__name__} (bind constant arguments "
                "in a wrapper module)"
            )
    batched = [*inputs, *batch_kwargs.values()]
    if not batched:
        raise ValueError(
            "compute_grad_sample: no batched input (inputs and batch_kwargs are empty)"
        )
    B = batched[0].shape[0]
    if any(x.shape[0] != B for x in batched) or (targets is not None and targets.shape[0] != B):
        raise ValueError(
            "compute_grad_sample: inputs, batch_kwargs and targets must share the batch size"
        )
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    if not names:
        raise ValueError("compute_grad_sample: the module has no trainable parameter")
    for n, m in module.named_modules():
        n = n or type(module).__name__
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
            raise ValueError(
                f"compute_grad_sample: {n} is batch norm in training mode, "
                "which normalises each sample with statistics of the whole batch "
                "(it mixes samples: not DP); use GroupNorm/LayerNorm, or eval()"
            )
        if (
            isinstance(m, nn.modules.instancenorm._InstanceNorm)
            and m.training
            and m.track_running_stats
        ):
            raise ValueError(
                f"compute_grad_sample: {n} ({type(m).__name__}) has "
                "track_running_stats=True in training mode: its forward writes the samples' "
                "statistics into the buffers running_mean/running_var, which releases them "
                "without noise (state_dict, eval) and, in the per-sample loop, lets one "
                "sample change the others' gradients; put it in eval() mode, or use "
                "track_running_stats=False (per-sample statistics), GroupNorm or LayerNorm"
            )
    from .sharding import is_sharded

    if hasattr(module, "reshard") or any(is_sharded(p) for p in module.parameters()):
        raise ValueError(
            "compute_grad_sample: FSDP2 (fully_shard) modules are not supported "
            "(torch.func cannot trace through FSDP's parameter swapping); "
            "compute per-sample gradients on an unsharded replica refreshed "
            "from p.full_tensor() and pass them to "
            "dpkern.distributed.shard_grad_samples, or use ghost clipping"
        )
    param_of = dict(module.named_parameters())
    if B == 0:
        for n in names:
            p = param_of[n]
            p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        return torch.zeros(0, device=batched[0].device)

    snap = BufferSnapshot(module)  # every per-sample forward must leave the buffers as is
    try:
        check_separable(module, loss_fn, inputs, batch_kwargs, targets)
        _refuse_buffer_changes(module, snap, "the separability check's forwards")
        grads, losses = _per_sample(
            module,
            loss_fn,
            inputs,
            batch_kwargs,
            targets,
            names,
            param_of,
            chunk_size,
            method,
            snap,
        )
    except BaseException:
        snap.restore()  # (an error after a write: put the buffers back, as a refusal does)
        raise
    for n in names:
        param_of[n].grad_sample = grads[n].detach()
    return losses.detach().float()


def _per_sample(
    module, loss_fn, inputs, batch_kwargs, targets, names, param_of, chunk_size, method, snap
):
    def check(i):  # after sample i's forward in the loop: refused before sample i + 1 runs
        _refuse_buffer_changes(module, snap, f"the per-sample forward of sample {i} (loop)")

    if method == "loop":
        return _loop(module, loss_fn, inputs, batch_kwargs, targets, names, param_of, check=check)
    try:
        out = _vmap(module, loss_fn, inputs, batch_kwargs, targets, names, chunk_size)
    except RuntimeError as vmap_err:  # functorch's trace errors are RuntimeErrors
        if method == "vmap":
            raise
        try:  # the loop on sample 0: does it run where vmap could not?
            first = _one_sample(module, loss_fn, inputs, batch_kwargs, targets, names, param_of, 0)
        except Exception as loop_err:  # noqa: BLE001 - a genuine error: the original
            vmap_err.add_note(
                "(compute_grad_sample's per-sample loop fallback failed "
                f"on sample 0 too: {_reason(loop_err)})"
            )
            raise vmap_err from None
        check(0)  # (a buffer written by sample 0: refused, not a reason to fall back)
        _warn_fallback(module, vmap_err)
        return _loop(
            module,
            loss_fn,
            inputs,
            batch_kwargs,
            targets,
            names,
            param_of,
            first=first,
            check=check,
        )
    _refuse_buffer_changes(module, snap, "the vmap forward")
    return out


def _vmap(module, loss_fn, inputs, batch_kwargs, targets, names, chunk_size):
    trainable = {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in module.named_parameters() if not p.requires_grad}
    buffers = {n: b.detach() for n, b in module.named_buffers()}

    def sample_loss(params, sample_inputs, sample_kwargs, sample_target):
        batch = tuple(x.unsqueeze(0) for x in sample_inputs)
        kwargs = {k: v.unsqueeze(0) for k, v in sample_kwargs.items()}
        out = functional_call(module, {**params, **frozen, **buffers}, batch, kwargs)
        loss = loss_fn(out) if sample_target is None else loss_fn(out, sample_target.unsqueeze(0))
        return loss, loss.detach()  # (what grad differentiates, the loss as aux output)

    per_sample = vmap(
        grad(sample_loss, has_aux=True),
        in_dims=(None, 0, 0, 0 if targets is not None else None),
        randomness="different",
        chunk_size=chunk_size,
    )
    with torch.enable_grad():
        grads, losses = per_sample(trainable, inputs, batch_kwargs, targets)
    return grads, losses


def _one_sample(module, loss_fn, inputs, batch_kwargs, targets, names, param_of, i):
    """Sample i's (gradients in ``names`` order, loss) by ordinary autograd on a batch of 1."""
    params = [param_of[n] for n in names]
    with torch.enable_grad():
        out = module(
            *(x[i : i + 1] for x in inputs), **{k: v[i : i + 1] for k, v in batch_kwargs.items()}
        )
        loss = loss_fn(out) if targets is None else loss_fn(out, targets[i : i + 1])
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            raise RuntimeError(
                "compute_grad_sample: loss_fn must return a scalar tensor "
                f"(the loss of one sample), got {getattr(loss, 'shape', loss)!r}"
            )
        gs = torch.autograd.grad(loss, params, allow_unused=True)
    gs = [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(gs, params)]
    return gs, loss.detach()


def _loop(module, loss_fn, inputs, batch_kwargs, targets, names, param_of, first=None, check=None):
    B = next(iter([*inputs, *batch_kwargs.values()])).shape[0]
    grads = {
        n: torch.empty((B, *param_of[n].shape), dtype=param_of[n].dtype, device=param_of[n].device)
        for n in names
    }
    losses = None
    for i in range(B):
        gs, loss = (
            first
            if (i == 0 and first is not None)
            else _one_sample(module, loss_fn, inputs, batch_kwargs, targets, names, param_of, i)
        )
        if check is not None and not (i == 0 and first is not None):  # (first: checked)
            check(i)
        if losses is None:
            losses = torch.empty(B, dtype=torch.float32, device=loss.device)
        losses[i] = loss.float()
        for n, g in zip(names, gs):
            grads[n][i] = g
    return grads, losses
