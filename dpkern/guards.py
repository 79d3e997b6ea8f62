"""Safety nets of the optimizer front-ends: what dpkern refuses rather than approximate.

- :func:`check_group_options`: a param-group option that the class does not implement
  (``maximize``, ``amsgrad``, per-group privacy arguments, ...) is refused, never ignored;
- :func:`refuse_grad_scaler`: AMP's GradScaler, whose skipped steps are decided by the
  un-clipped gradients, is refused;
- :func:`deferred_signals`: SIGINT / SIGTERM that arrive while a step mutates tensors are
  delivered once the step is committed, so an interrupted step is all-or-nothing;
- the messages that say where dpkern differs from Opacus and torch.optim.
"""

from __future__ import annotations

import inspect
import os
import signal
import threading
from contextlib import contextmanager

import torch

from . import rules

#: Privacy arguments: one value per optimizer (the accountant is told one sigma per step).
PRIVACY_OPTIONS = frozenset(
    {"max_grad_norm", "noise_multiplier", "expected_batch_size", "seed", "backend", "nonfinite"}
)
#: dpkern hyper-parameters that only some classes have: every field of the registry's
#: dataclasses (betas for beta1 / beta2), and two constructor options.
DPKERN_OPTIONS = frozenset(
    {"betas", "b_init", "noise_bias_correction"}
    | {f for spec in rules.RULES.values() for f in spec.hyper_fields if f not in ("beta1", "beta2")}
)


def _torch_optim_options() -> frozenset:
    names = set()
    for name in getattr(torch.optim, "__all__", ()):
        cls = getattr(torch.optim, name, None)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            names |= set(inspect.signature(cls.__init__).parameters)
    return frozenset(names - {"self", "params", "defaults"})


#: Every option name a torch.optim optimizer, or a dpkern one, understands.
TORCH_OPTIONS = _torch_optim_options()
KNOWN_OPTIONS = TORCH_OPTIONS | PRIVACY_OPTIONS | DPKERN_OPTIONS


#: torch.optim options at the value that switches them off: harmless, accepted.
OFF_VALUES = {
    "maximize": False,
    "amsgrad": False,
    "foreach": None,
    "fused": None,
    "capturable": False,
    "differentiable": False,
}


#: why a torch.optim option a dpkern class does not implement is refused
REFUSED_NOT_IGNORED = "dpkern refuses it rather than ignore it (torch.optim would apply it)"


def is_off(key: str, value) -> bool:
    """``value`` is the one that switches torch.optim option ``key`` off (see
    :data:`OFF_VALUES`)."""
    return key in OFF_VALUES and value is OFF_VALUES[key]


def check_group_options(cls_name: str, group: dict, defaults: dict) -> None:
    """Refuse an optimizer option in a param group that ``cls_name`` does not implement.

    Keys that are no optimizer option (``params``, ``param_names``, ``initial_lr`` of the
    LR schedulers, a user's ``name``) pass, and so do torch.optim options at the value that
    switches them off (``amsgrad=False``, ``foreach=None``, ...). Raises ValueError naming
    the option."""
    for key in group:
        if is_off(key, group[key]):
            continue
        if key in KNOWN_OPTIONS and key not in defaults:
            where = (
                "one value per optimizer: pass it to the constructor"
                if key in PRIVACY_OPTIONS
                else REFUSED_NOT_IGNORED
            )
            raise ValueError(
                f"param group option {key!r} is not supported by {cls_name}: "
                f"{where}; its options are {sorted(defaults)}"
            )


def check_constructor_options(cls, kwargs: dict) -> None:
    """Raise ValueError for a torch.optim constructor option (``amsgrad``, ``maximize``,
    ``foreach``, ``fused``, ...) that ``cls.__init__`` does not take, instead of Python's
    bare TypeError: dpkern refuses it rather than ignore it. Unknown names (typos) are
    left to the TypeError."""
    taken = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values()):
        return
    for key in kwargs:
        if key in TORCH_OPTIONS and key not in taken:
            why = (
                f"{key}={OFF_VALUES[key]!r} is torch.optim's default: omit it"
                if is_off(key, kwargs[key])
                else REFUSED_NOT_IGNORED
            )
            raise ValueError(
                f"{cls.__name__} has no option {key!r}: {why}; its options are "
                + ", ".join(n for n in taken if n not in ("self", "params"))
            )


DPOPTIMIZER_IS_A_BASE = (
    "dpkern.DPOptimizer is the base class of dpkern's optimizers, not a wrapper like "
    "opacus.optimizers.DPOptimizer(optimizer, ...): construct the DP optimizer over the "
    "parameters directly, e.g. dpkern.DPAdamW(model.parameters(), lr=1e-3, "
    "max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=256) (also "
    + ", ".join(s.optimizer for s in rules.RULES.values() if s.optimizer != "DPAdamW")
    + ")"
)

NO_FRESH_GRAD_SAMPLE = (
    "no fresh per-sample gradients: step() consumed (and released) the p.grad_sample of "
    "the last step, and no backward, accumulate() or accumulate_clipped() has happened "
    "since; a second step would release the same samples again. Run a backward on a new "
    "batch first (did you forget zero_grad() or the backward?). Opacus raises here too; "
    "torch.optim would silently reuse p.grad. (If per-sample gradients were never computed: "
    "wrap the model with opacus.GradSampleModule or call "
    "dpkern.grad_sample.compute_grad_sample; with ghost clipping, call gc.backward(losses) "
    "for each micro-batch, not loss.backward().)"
)

ONLY_SUMMED_GRAD = (
    "no parameter has a grad_sample, but p.grad is set: a plain loss.backward() ran, "
    "which gives only the summed gradient (dpkern never steps on it: it cannot be "
    "clipped per sample). With dpkern.ghost.GhostClipping, call gc.backward(losses) on "
    "the per-sample losses (float [B], reduction='none') instead of loss.backward(); "
    "otherwise compute per-sample gradients (opacus.GradSampleModule, or "
    "dpkern.grad_sample.compute_grad_sample)"
)

ALREADY_RELEASED = (
    "{name}: this grad_sample tensor was already used by an earlier step() or "
    "accumulate(); releasing it again would spend the same samples twice. Compute fresh "
    "per-sample gradients (a new backward) for each step"
)


GRAD_SCALER = (
    "dpkern optimizers do not take a GradScaler (scaler.step(optimizer)): it would skip a "
    "step whenever the raw, unclipped gradients of the batch overflow -- a decision made "
    "from the private data, outside the clipping and the noise -- and it unscales p.grad, "
    "never p.grad_sample. Use bfloat16 autocast or weights (no loss scaling; "
    "stochastic_rounding=True keeps small updates) and call optimizer.step(). Nothing was "
    "changed"
)


def refuse_grad_scaler(optimizer) -> None:
    """Raise TypeError when ``torch.amp.GradScaler.step`` called ``optimizer.step()``.

    dpkern optimizers set ``_step_supports_amp_scaling``, so GradScaler hands the step to
    them, setting ``grad_scale`` and ``found_inf`` on the optimizer (or passing
    ``grad_scaler=``); without it GradScaler would skip ``step()`` in silence when the
    un-clipped ``p.grad`` held an inf, a release decided by the data. The attributes are
    removed again, so a later plain ``step()`` works."""
    if getattr(optimizer, "grad_scale", None) is None and (
        getattr(optimizer, "found_inf", None) is None
    ):
        return
    for name in ("grad_scale", "found_inf"):
        optimizer.__dict__.pop(name, None)
    raise TypeError(GRAD_SCALER)


class StepInterrupted(RuntimeError):
    """A step failed after it began to modify tensors (out of memory, an error in a
    kernel): the optimizer refuses to continue or to save until it is reloaded."""


@contextmanager
def deferred_signals(signals=(signal.SIGINT, signal.SIGTERM)):
    """Hold SIGINT / SIGTERM while the block runs; deliver them (once, to the handlers that
    were installed) when it exits. Only in the main thread, where Python runs signal
    handlers; elsewhere (and for handlers set outside Python) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {}
    try:
        for sig in signals:
            old = signal.getsignal(sig)
            if old is None:  # installed from C: leave it alone
                continue
            previous[sig] = old
            signal.signal(sig, lambda signum, frame: caught.append(signum))
    except (ValueError, OSError):  # pragma: no cover - no signal support here
        pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        for sig in dict.fromkeys(caught):  # each signal once, in arrival order
            handler = previous.get(sig)
            if callable(handler):
                handler(sig, None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), sig)  # the default action (terminate) now
