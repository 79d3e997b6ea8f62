"""Per-sample gradients with torch.func, in Opacus' ``p.grad_sample`` convention.

:func:`compute_grad_sample` gives users without Opacus one call that sets, for every
trainable parameter p of a module, ``p.grad_sample`` of shape ``[B, *p.shape]``: the
gradient of sample i's loss alone (``functional_call`` + ``vmap(grad)``, the recipe of
the torch.func per-sample-gradients tutorial). Models wrapped in Opacus'
``GradSampleModule`` need nothing from here: dpkern's optimizers read the same attribute.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap


def _as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def compute_grad_sample(module: nn.Module, loss_fn: Callable, inputs, targets=None, *,
                        chunk_size: int | None = None) -> Tensor:
    """Set ``p.grad_sample`` (``[B, *p.shape]``, the parameter's dtype) for every trainable
    parameter of ``module`` and return the per-sample losses (float32 ``[B]``).

    Args:
        module: any ``nn.Module`` without cross-sample operations (no BatchNorm in train
            mode: it mixes samples, which DP forbids).
        loss_fn: ``loss_fn(output, target)`` -> scalar loss of ONE sample; it is called
            with batch dimension 1 (``output = module(x[i:i+1])``), so ordinary losses
            such as ``F.cross_entropy`` work unchanged. With ``targets=None`` it is called
            as ``loss_fn(output)``.
        inputs: a tensor ``[B, ...]`` or a tuple of them (positional arguments of module).
        targets: a tensor ``[B, ...]``, or None.
        chunk_size: samples per vmap chunk (bounds memory; None = all at once).
    Returns:
        float32 tensor ``[B]``: each sample's loss.
    Raises:
        ValueError: inputs/targets with different B, a module without trainable params, or
            an FSDP2-sharded module.
    Source: torch.func per-sample-gradients recipe; Opacus' grad_sample convention.
    """
    inputs = _as_tuple(inputs)
    B = inputs[0].shape[0]
    if any(x.shape[0] != B for x in inputs) or (targets is not None and targets.shape[0] != B):
        raise ValueError("compute_grad_sample: inputs and targets must share the batch size")
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    if not names:
        raise ValueError("compute_grad_sample: the module has no trainable parameter")
    from .sharding import is_sharded
    if hasattr(module, "reshard") or any(is_sharded(p) for p in module.parameters()):
        raise ValueError("compute_grad_sample: FSDP2 (fully_shard) modules are not supported "
                         "(torch.func cannot trace through FSDP's parameter swapping); "
                         "compute per-sample gradients on an unsharded replica refreshed "
                         "from p.full_tensor() and pass them to "
                         "dpkern.distributed.shard_grad_samples, or use ghost clipping")
    trainable = {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in module.named_parameters() if not p.requires_grad}
    buffers = {n: b.detach() for n, b in module.named_buffers()}
    param_of = dict(module.named_parameters())
    if B == 0:
        for n in names:
            p = param_of[n]
            p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        return torch.zeros(0, device=inputs[0].device)

    def sample_loss(params, sample_inputs, sample_target):
        batch = tuple(x.unsqueeze(0) for x in sample_inputs)
        out = functional_call(module, {**params, **frozen, **buffers}, batch)
        loss = loss_fn(out) if sample_target is None else loss_fn(out, sample_target.unsqueeze(0))
        return loss, loss.detach()  # (what grad differentiates, the loss as aux output)

    per_sample = vmap(grad(sample_loss, has_aux=True),
                      in_dims=(None, 0, 0 if targets is not None else None),
                      randomness="different", chunk_size=chunk_size)
    with torch.enable_grad():
        grads, losses = per_sample(trainable, inputs, targets)
    for n in names:
        param_of[n].grad_sample = grads[n].detach()
    return losses.detach().float()
