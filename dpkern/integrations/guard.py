"""The silent-non-training trap: a model whose parameters the optimizer does not update.

Moving a model to another device after its optimizer was built (``model.to(device)``
where the move makes new parameter tensors, as it does for devices whose tensors cannot
share a storage type, or under ``torch.__future__.set_swap_module_params_on_conversion``)
leaves the optimizer holding the old tensors: training runs, the loss is computed, the
noise is drawn and the privacy budget is spent, while the model never changes (Opacus
issue 820). Two checks catch it:

- :func:`check_trainable_params` (before training): every trainable parameter of the
  model is one the optimizer owns (by identity), and every trainable parameter the
  optimizer owns is one of the model's;
- :class:`UpdateCheck` (after the first step): each trainable parameter moved
  (``max |delta| > 0`` over a sample of its elements; with noise on every coordinate a
  parameter the optimizer updates always moves).

:class:`dpkern.integrations.transformers.DPTrainer` runs both; a plain training loop
calls them itself::

    check = UpdateCheck(model, optimizer)  # runs check_trainable_params
    ...  # the first step: backward, optimizer.step()
    check.after_step()  # RuntimeError if a parameter did not change
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["check_trainable_params", "UpdateCheck"]

#: Elements of each parameter compared by :class:`UpdateCheck` (evenly spaced).
SAMPLE = 1024

_MOVED = (
    "the model's parameters were replaced after the optimizer was built: typically the "
    "model was moved to another device (model.to(...), or a library that moves it) "
    "after the optimizer was constructed, so the optimizer would update tensors the "
    "model no longer uses and the model would silently not train while the privacy "
    "budget is spent. Move the model first, then build the optimizer"
)


def _inner(optimizer):
    """The dpkern optimizer under wrappers (accelerate's AcceleratedOptimizer,
    dpkern.distributed.DistributedDPOptimizer): the object whose param_groups step."""
    seen = set()
    while hasattr(optimizer, "optimizer") and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    return optimizer


def _optimizer_params(optimizer) -> list[tuple[str, torch.Tensor]]:
    """(where, parameter) of the optimizer's trainable parameters, in param_groups order."""
    opt = _inner(optimizer)
    return [
        (f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}, {p.device})", p)
        for gi, g in enumerate(opt.param_groups)
        for pi, p in enumerate(g["params"])
        if p.requires_grad
    ]


def _names(items: list[str], limit: int = 5) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def check_trainable_params(model: nn.Module, optimizer) -> None:
    """Check that ``optimizer`` updates exactly the trainable parameters of ``model``.

    Args:
        model: the module that is trained (its ``named_parameters()`` with
            ``requires_grad=True``; tied parameters count once).
        optimizer: a dpkern optimizer, or a wrapper with ``.optimizer`` (accelerate,
            dpkern.distributed).
    Raises:
        ValueError: a trainable parameter of the optimizer is not the model's (named by
            its param group, position, shape and device; the message says the model was
            most likely moved to another device after the optimizer was built), or a
            trainable parameter of the model is not in the optimizer (named: it would
            get no update and no noise; freeze it or rebuild the optimizer)."""
    owned = _optimizer_params(optimizer)
    model_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    in_model = {id(p) for _, p in model_params}
    in_opt = {id(p) for _, p in owned}
    stale = [where for where, p in owned if id(p) not in in_model]
    missing = [f"{n} ({p.device})" for n, p in model_params if id(p) not in in_opt]
    if stale:
        devices = sorted({str(p.device) for _, p in model_params})
        raise ValueError(
            f"{len(stale)} trainable parameter(s) of the optimizer are not the model's "
            f"({_names(stale)}; the model's are on {', '.join(devices) or 'no device'})"
            + (f", and the model's {_names(missing)} are not in the optimizer" if missing else "")
            + f": {_MOVED}"
        )
    if missing:
        raise ValueError(
            f"{len(missing)} trainable parameter(s) of the model are not in the optimizer "
            f"({_names(missing)}): they would get no update and no noise. Freeze them "
            "(requires_grad_(False)) or build the optimizer after unfreezing them (or "
            "after moving the model to its device)"
        )


class UpdateCheck:
    """After the first step, raise if a trainable parameter did not change.

    At construction it runs :func:`check_trainable_params` and keeps a copy of up to
    :data:`SAMPLE` evenly spaced elements of each trainable parameter of the optimizer (a
    few KiB per parameter, on its device; parameters of groups with ``lr == 0`` are
    skipped). :meth:`after_step` compares them: a parameter the optimizer updates moves
    (the noise reaches every coordinate), so ``max |delta| == 0`` over the sample means
    that tensor is not the one being trained.

    Args:
        model: the trained module.
        optimizer: a dpkern optimizer (or a wrapper with ``.optimizer``).
    Raises:
        ValueError: from :func:`check_trainable_params`."""

    def __init__(self, model: nn.Module, optimizer):
        check_trainable_params(model, optimizer)
        names = {id(p): n for n, p in model.named_parameters()}
        opt = _inner(optimizer)
        self._snap = []
        with torch.no_grad():
            for g in opt.param_groups:
                if g.get("lr", 1.0) == 0:
                    continue
                for p in g["params"]:
                    if not p.requires_grad or p.numel() == 0:
                        continue
                    idx = _sample_index(p)
                    self._snap.append((names.get(id(p), "?"), p, idx, _take(p, idx).clone()))
        self.done = False

    def after_step(self) -> None:
        """Compare with the snapshot (once; later calls do nothing).

        Raises:
            RuntimeError: naming the parameters with ``max |delta| == 0``: most likely
                the model was moved to another device after the optimizer was built (it
                trains other tensors), or the update is below the parameter dtype's
                resolution (e.g. bfloat16 weights with a very small lr: then switch the
                check off)."""
        if self.done:
            return
        self.done = True
        unchanged = []
        with torch.no_grad():
            for name, p, idx, old in self._snap:
                if torch.equal(_take(p, idx), old):
                    unchanged.append(f"{name} ({p.dtype}, {p.device})")
        self._snap = []
        if unchanged:
            raise RuntimeError(
                f"{len(unchanged)} trainable parameter(s) did not change in the first step "
                f"(max |delta| = 0): {_names(unchanged)}. Most likely the model was moved to "
                "another device after the optimizer was built: the optimizer updates "
                "tensors the model no longer uses, and training would silently do nothing "
                "while spending the privacy budget. Move the model first, then build the "
                "optimizer. (If the update is below the resolution of the parameter dtype, "
                "e.g. bfloat16 weights with a tiny learning rate, turn this check off.)"
            )


def _sample_index(p: torch.Tensor) -> torch.Tensor:
    n = p.numel()
    k = min(n, SAMPLE)
    return torch.arange(k, device=p.device, dtype=torch.int64) * (n - 1) // max(k - 1, 1)


def _take(p: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return p.detach().reshape(-1).index_select(0, idx)
