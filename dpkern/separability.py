"""Is a module's forward separable over the batch? The per-sample path
(:func:`dpkern.grad_sample.compute_grad_sample`) evaluates each sample alone (torch.func's
vmap, or a loop over batches of one), so a forward that mixes samples (``x - x.mean(0)``,
a ``[B, B]`` matmul, attention across the batch) would silently give the gradients of
another model: the one that sees each sample alone. :func:`check_separable` refuses it,
once per module, before any gradient is used.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = ["check_separable", "side_effect_free"]

#: Modules already checked (the check runs at the first call of each).
_CHECKED: weakref.WeakSet = weakref.WeakSet()
_ROWS = 4  # rows compared: a batch of up to 4 against the same rows one at a time


@contextmanager
def side_effect_free(module: nn.Module, tensors=()):
    """Extra forwards of a check, as if they never ran: eval mode (no dropout; each
    submodule's own mode restored after, an eval-mode BatchNorm stays in eval), no grad,
    and the RNG state of the CPU and of the CUDA devices of ``tensors`` restored."""
    modes = [(m, m.training) for m in module.modules()]
    cuda = list({t.device for t in tensors if isinstance(t, Tensor) and t.is_cuda})
    module.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def _rows(out, i: int, n: int):
    """Row ``i`` (as a batch of one) of every tensor with ``n`` rows in ``out`` (a tensor,
    or tuples / lists / dicts / ModelOutputs of them); other leaves as they are."""
    if isinstance(out, Tensor):
        return out[i : i + 1] if out.dim() and out.shape[0] == n else out
    if isinstance(out, dict):  # (transformers' ModelOutput is a dict: rebuilt as its type)
        rows = {k: _rows(v, i, n) for k, v in out.items()}
        try:
            return type(out)(**rows)
        except Exception:
            return rows
    if isinstance(out, (tuple, list)):
        return type(out)(_rows(v, i, n) for v in out) if not hasattr(out, "_fields") else out
    return out


def _loss(loss_fn, out, targets, i):
    return loss_fn(out) if targets is None else loss_fn(out, targets[i : i + 1])


def check_separable(module: nn.Module, loss_fn, inputs: tuple, batch_kwargs: dict, targets):
    """Raise ValueError when ``module``'s first rows, forwarded together, get other losses
    than each forwarded alone (the forward mixes samples); once per module, B >= 2.

    Runs under :func:`side_effect_free` (eval mode: dropout off) on the first
    ``min(B, 4)`` rows: one forward of them together and one per row, comparing the
    losses of ``loss_fn`` (the batched output's rows are sliced as batches of one) to
    rtol 1e-4 (5e-2 for low-precision outputs), atol 1e-6 of the largest loss. Nothing
    is kept: no gradient, no buffer change (the caller's buffer check covers them). A
    forward or loss that raises here is not checked: the per-sample path then raises its
    genuine error (or, where only batches of one work, runs as before)."""
    batched = [*inputs, *batch_kwargs.values()]
    n = min(int(batched[0].shape[0]), _ROWS)
    if n < 2 or module in _CHECKED:
        return
    pairs = []
    try:
        with side_effect_free(module, batched):
            together = module(
                *(x[:n] for x in inputs), **{k: v[:n] for k, v in batch_kwargs.items()}
            )
            for i in range(n):
                alone = module(
                    *(x[i : i + 1] for x in inputs),
                    **{k: v[i : i + 1] for k, v in batch_kwargs.items()},
                )
                a = _loss(loss_fn, alone, targets, i)
                b = _loss(loss_fn, _rows(together, i, n), targets, i)
                if isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape:
                    pairs.append((a.detach().double(), b.detach().double(), a.dtype))
    except Exception:
        return  # (not checkable here: the per-sample path raises the genuine error, or works)
    if len(pairs) < n:
        return  # losses of another shape (the loss_fn's own error surfaces later)
    low = any(dt in (torch.float16, torch.bfloat16) for _, _, dt in pairs)
    rtol = 5e-2 if low else 1e-4
    scale = max(float(a.abs().max()) for a, _, _ in pairs) if pairs else 0.0
    for i, (a, b, _) in enumerate(pairs):
        if not torch.allclose(a, b, rtol=rtol, atol=1e-6 * max(scale, 1.0), equal_nan=True):
            raise ValueError(
                f"compute_grad_sample: {type(module).__name__}'s forward mixes samples: "
                f"row {i}'s loss differs when the first {n} rows are forwarded together "
                "and when it is forwarded alone (relative difference "
                f"{float((a - b).abs().max() / max(float(a.abs().max()), 1e-30)):.2g}). The "
                "per-sample path evaluates each sample alone, so it would compute the "
                "gradients of another model (batch statistics such as x.mean(0), a [B, B] "
                "matmul, attention over the batch). Use per-sample normalisation "
                "(LayerNorm, GroupNorm), statistics from public data, or keep samples "
                "apart. Nothing was updated"
            )
    _CHECKED.add(module)
