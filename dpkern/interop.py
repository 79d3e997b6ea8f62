"""Interoperation with Opacus: the supported path, and the wrapping dpkern refuses.

A dpkern optimizer is a complete DP optimizer: it clips every per-sample gradient, adds the
Gaussian noise and updates (SPEC sections 2-5). Opacus users keep their per-sample
gradients: a model wrapped in ``opacus.GradSampleModule`` sets ``p.grad_sample``, which a
dpkern optimizer consumes directly (:data:`SUPPORTED_PATH`).

Wrapping a dpkern optimizer in Opacus' ``DPOptimizer`` (``PrivacyEngine.make_private`` does
it) clips and noises twice: Opacus clips, noises and writes ``p.grad``, then calls the
dpkern optimizer's ``step()``, which clips and noises ``p.grad_sample`` again; and Opacus'
accountant reports epsilon for its own mechanism, not for what ran. The dpkern optimizers
refuse it: they call :func:`refuse_opacus_wrapper` before they change anything.

Detection (the earliest reliable point without patching Opacus): ``make_private`` and
``DPOptimizer.__init__`` touch the wrapped optimizer only by reading its ``param_groups``
(and set ``p.summed_grad = None`` on its parameters), so nothing of dpkern runs while it
is wrapped. Every later call goes through the wrapper: ``DPOptimizer.zero_grad()`` calls the
wrapped ``zero_grad()`` (the first call of a usual loop, before any clipping or noise) and
``DPOptimizer.step()`` calls the wrapped ``step()`` after clipping and noising. There an
Opacus ``DPOptimizer`` (any subclass: per-layer, distributed, adaptive, fast gradient
clipping) whose ``original_optimizer`` is this optimizer is on the call stack. Also refused:
a trainable parameter whose ``p.summed_grad`` holds a tensor (Opacus' clipped sum, set by
``DPOptimizer.pre_step`` and cleared by its ``zero_grad``): an Opacus optimizer is clipping
the same parameters.
"""

from __future__ import annotations

import sys

from torch import Tensor

__all__ = ["SUPPORTED_PATH", "opacus_wrapper", "refuse_opacus_wrapper"]

#: How Opacus users run a dpkern optimizer (shown in :func:`refuse_opacus_wrapper`'s error).
SUPPORTED_PATH = """\
    model = opacus.GradSampleModule(model)       # per-sample gradients in p.grad_sample
    optimizer = dpkern.DPAdamW(model.parameters(), lr=..., max_grad_norm=C,
                               noise_multiplier=sigma, expected_batch_size=B)
    accountant = dpkern.accounting.PrivacyAccountant()   # or Opacus' RDPAccountant()
    for x, y in loader:                          # Poisson batches, sample rate q
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()                         # clip + noise + update, once
        accountant.step(noise_multiplier=sigma, sample_rate=q)"""

_MAX_WRAPPER_DEPTH = 8  # original_optimizer / optimizer links followed from a wrapper


def _opacus_dp_optimizer_class():
    """Opacus' DPOptimizer class if Opacus is imported (else no wrapper can exist)."""
    module = sys.modules.get("opacus.optimizers.optimizer")
    return getattr(module, "DPOptimizer", None) if module is not None else None


def _wraps(wrapper, optimizer) -> bool:
    """Whether ``wrapper.original_optimizer`` is ``optimizer`` or wraps it (dpkern's
    DistributedDPOptimizer keeps its inner optimizer in ``.optimizer``)."""
    inner = getattr(wrapper, "original_optimizer", None)
    for _ in range(_MAX_WRAPPER_DEPTH):
        if inner is None:
            return False
        if inner is optimizer:
            return True
        inner = getattr(inner, "optimizer", None) or getattr(inner, "original_optimizer", None)
    return False


def opacus_wrapper(optimizer):
    """The Opacus ``DPOptimizer`` that wraps ``optimizer`` and is calling into it now.

    Args:
        optimizer: the optimizer whose method is running (a dpkern optimizer calls this
            with itself).
    Returns:
        The wrapping ``opacus.optimizers.DPOptimizer`` (any subclass) found on the call
        stack -- its ``step()`` / ``zero_grad()`` / ``pre_step()`` is what called
        ``optimizer`` -- or None (also when Opacus is not imported)."""
    dp_optimizer = _opacus_dp_optimizer_class()
    if dp_optimizer is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if str(frame.f_globals.get("__name__", "")).startswith("opacus."):
            owner = frame.f_locals.get("self")
            if isinstance(owner, dp_optimizer) and _wraps(owner, optimizer):
                return owner
        frame = frame.f_back
    return None


def _opacus_clipped_params(optimizer) -> list[str]:
    """``"group g, position k, shape s"`` of trainable parameters holding Opacus' clipped
    sum ``p.summed_grad`` (a tensor)."""
    hits = []
    for g, group in enumerate(getattr(optimizer, "param_groups", ())):
        for k, p in enumerate(group["params"]):
            if p.requires_grad and isinstance(getattr(p, "summed_grad", None), Tensor):
                hits.append(f"group {g}, position {k}, shape {tuple(p.shape)}")
    return hits


def refuse_opacus_wrapper(optimizer) -> None:
    """Refuse to run ``optimizer`` (a dpkern optimizer) under Opacus' ``DPOptimizer``.

    Call it first in the optimizer's ``step()``, ``accumulate()``, ``accumulate_clipped()``
    and ``zero_grad()``, before anything is modified. It costs a walk up the call stack
    when Opacus is imported (microseconds), nothing otherwise.

    Args:
        optimizer: the dpkern optimizer (``self``).
    Raises:
        ValueError: an Opacus ``DPOptimizer`` (``PrivacyEngine.make_private``) wraps
            ``optimizer`` and is calling it, or a trainable parameter carries Opacus'
            clipped sum ``p.summed_grad`` (an Opacus optimizer clips the same
            parameters). The message shows the supported path (:data:`SUPPORTED_PATH`).
    """
    wrapper = opacus_wrapper(optimizer)
    clipped = [] if wrapper is not None else _opacus_clipped_params(optimizer)
    if wrapper is None and not clipped:
        return
    name = f"dpkern.{type(optimizer).__name__}"
    if wrapper is not None:
        what = (
            f"{name} is wrapped by Opacus' {type(wrapper).__name__} "
            "(PrivacyEngine.make_private or an Opacus DPOptimizer(...))"
        )
    else:
        shown = "; ".join(clipped[:3]) + (" ..." if len(clipped) > 3 else "")
        what = (
            f"parameters of {name} carry Opacus' clipped sum p.summed_grad ({shown}): "
            "an Opacus DPOptimizer clips and noises them too (call its zero_grad() "
            "or delete p.summed_grad if it is no longer used)"
        )
    raise ValueError(
        f"{what}. A dpkern optimizer is a DP optimizer itself: under Opacus' wrapper every "
        "gradient would be clipped and noised twice, and Opacus' accountant would report "
        "epsilon for a mechanism that is not the one that ran. Use Opacus for per-sample "
        "gradients only, without make_private and without an Opacus DPOptimizer; the "
        "dpkern optimizer consumes p.grad_sample directly, and the accounting is "
        "dpkern.accounting.PrivacyAccountant (or an Opacus accountant stepped by hand, "
        "accountant.step(noise_multiplier=sigma, sample_rate=q) once per optimizer step):\n"
        + SUPPORTED_PATH
    )
