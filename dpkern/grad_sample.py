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
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

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
        "of one sample each instead of one vectorised pass (the gradients are the same). "
        "Pass method='loop' to skip the vmap attempt. This warning is shown once per "
        "module class.",
        VmapFallbackWarning,
        stacklevel=3,
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
            mode: it mixes samples, which DP forbids). Its training mode is left as is.
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
            module without trainable params, an FSDP2-sharded module, or an unknown method.
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
    mixing = [
        n or type(module).__name__
        for n, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
    ]
    if mixing:
        raise ValueError(
            f"compute_grad_sample: {mixing[0]} is batch norm in training mode, "
            "which normalises each sample with statistics of the whole batch "
            "(it mixes samples: not DP); use GroupNorm/LayerNorm, or eval()"
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

    if method == "loop":
        grads, losses = _loop(module, loss_fn, inputs, batch_kwargs, targets, names, param_of)
    else:
        try:
            grads, losses = _vmap(module, loss_fn, inputs, batch_kwargs, targets, names, chunk_size)
        except RuntimeError as vmap_err:  # functorch's trace errors are RuntimeErrors
            if method == "vmap":
                raise
            try:  # the loop on sample 0: does it run where vmap could not?
                first = _one_sample(
                    module, loss_fn, inputs, batch_kwargs, targets, names, param_of, 0
                )
            except Exception as loop_err:  # noqa: BLE001 - a genuine error: the original
                vmap_err.add_note(
                    "(compute_grad_sample's per-sample loop fallback failed "
                    f"on sample 0 too: {_reason(loop_err)})"
                )
                raise vmap_err from None
            _warn_fallback(module, vmap_err)
            grads, losses = _loop(
                module, loss_fn, inputs, batch_kwargs, targets, names, param_of, first=first
            )
    for n in names:
        param_of[n].grad_sample = grads[n].detach()
    return losses.detach().float()


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


def _loop(module, loss_fn, inputs, batch_kwargs, targets, names, param_of, first=None):
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
        if losses is None:
            losses = torch.empty(B, dtype=torch.float32, device=loss.device)
        losses[i] = loss.float()
        for n, g in zip(names, gs):
            grads[n][i] = g
    return grads, losses
