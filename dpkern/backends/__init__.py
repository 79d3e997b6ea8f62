"""Backend selection (SPEC section 6).

A backend is a module exposing the functions of :mod:`dpkern.backends.reference` under
the same names and signatures: ``philox_words``, ``gaussian_noise``, ``normal_from_words``,
``per_sample_norms``, ``whitened_norms``, ``accumulate``, ``step``,
``macadam_update_scale``, and ``supports(rule)``: whether it implements an update rule of
:mod:`dpkern.rules` (the reference implements every one; a fused backend may lack a new
rule's kernel, and then ``"auto"`` runs that rule on the reference with a warning).

- ``"torch"``  -- :mod:`dpkern.backends.reference`, any device, the spec in code;
- ``"triton"`` -- :mod:`dpkern.backends.triton`, CUDA tensors (CPU tensors only under
  ``TRITON_INTERPRET=1``);
- ``"cpp"``    -- :mod:`dpkern.backends.cpp`, CPU tensors, needs the compiled ``dpkern._C``;
- ``"auto"``   -- CUDA tensors -> triton, CPU tensors -> cpp if built, else torch with a
  one-time warning saying why.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

import torch

BACKENDS = ("auto", "torch", "triton", "cpp")
_warned_fallback = False
_warned_rules: set = set()


def check_name(backend) -> str:
    """Validate a backend name (a ``ValueError`` naming it otherwise)."""
    if backend not in BACKENDS:
        raise ValueError(f"invalid backend={backend!r}: expected one of {BACKENDS}")
    return backend


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _load(name: str) -> tuple[ModuleType | None, str]:
    """Import a backend module; (module, "") or (None, why it is unavailable)."""
    if name == "torch":
        from . import reference

        return reference, ""
    try:
        return importlib.import_module(f"{__name__}.{name}"), ""
    except ImportError as exc:  # not built / not installed
        return None, f"{type(exc).__name__}: {exc}"


def is_available(name: str) -> bool:
    return _load(name)[0] is not None


def resolved_name(backend: str, device, rule: str | None = None) -> str:
    """The short name (``"torch"``, ``"triton"`` or ``"cpp"``) of the backend that
    :func:`resolve` picks for ``backend`` on tensors of ``device`` (and, if given, the
    update rule ``rule``), without warning and without raising: an explicit name that
    cannot run there is returned as is (``resolve`` raises for it)."""
    check_name(backend)
    device = torch.device(device)
    if backend != "auto":
        return backend
    name = {"cuda": "triton", "cpu": "cpp"}.get(device.type)
    module = _load(name)[0] if name is not None else None
    if module is None or (rule is not None and not module.supports(rule)):
        return "torch"
    return name


def describe(backend: str, device, rule: str | None = None) -> str:
    """``backend`` as a user reads it: ``"auto (cpp)"`` names the backend ``"auto"``
    resolves to on ``device`` (a device, or a list of them: ``"auto (cpp, triton)"``); an
    explicit name is returned unchanged."""
    if backend != "auto":
        return check_name(backend)
    devices = device if isinstance(device, (list, tuple, set)) else [device]
    names = sorted({resolved_name(backend, d, rule) for d in devices})
    return f"auto ({', '.join(names)})"


def resolve(
    backend: str, device: torch.device, rule: str | None = None, update_rms_clip=None
) -> ModuleType:
    """The backend module to run ``backend`` on tensors of ``device`` (and, if given, the
    update rule ``rule``, a name of :data:`dpkern.rules.RULES`).

    Raises ``ValueError`` for an unknown name, and ``RuntimeError`` when an explicitly
    requested backend is unavailable or cannot run on ``device`` (``NotImplementedError``,
    a ``RuntimeError``, when it has no kernel for ``rule``, or, with ``update_rms_clip``
    set, when it does not implement that option for ``rule``: SPEC 10.9).
    ``backend="auto"`` runs such a rule on the reference, with a one-time warning."""
    module = _resolve(backend, device)
    if rule is not None and update_rms_clip is not None and module.supports(rule):
        if module.supports_rms_clip(rule):
            return module
        if backend != "auto":
            raise NotImplementedError(
                f"backend={backend!r} does not implement update_rms_clip (SPEC 10.9) for "
                f"the update rule {rule!r}; use backend='torch' (the reference) or 'auto'"
            )
        if (module.__name__, rule, "update_rms_clip") not in _warned_rules:
            _warned_rules.add((module.__name__, rule, "update_rms_clip"))
            warnings.warn(
                f"dpkern: backend='auto' runs update_rms_clip of the update rule {rule!r} "
                f"on the PyTorch reference (slow): {module.__name__} does not implement it",
                RuntimeWarning,
                stacklevel=3,
            )
        return _load("torch")[0]
    if rule is None or module.supports(rule):
        return module
    if backend != "auto":
        raise NotImplementedError(
            f"backend={backend!r} has no kernel for the update rule {rule!r}; use "
            "backend='torch' (the reference) or 'auto'"
        )
    if (module.__name__, rule) not in _warned_rules:
        _warned_rules.add((module.__name__, rule))
        warnings.warn(
            f"dpkern: backend='auto' runs the update rule {rule!r} on the PyTorch reference "
            f"(slow): {module.__name__} has no kernel for it",
            RuntimeWarning,
            stacklevel=3,
        )
    return _load("torch")[0]


def _resolve(backend: str, device: torch.device) -> ModuleType:
    global _warned_fallback
    check_name(backend)
    device = torch.device(device)
    if backend == "auto":
        if device.type == "cuda":
            module, why = _load("triton")
            if module is not None:
                return module
        elif device.type == "cpu":
            module, why = _load("cpp")
            if module is not None:
                return module
        else:
            why = f"no fused backend for device type {device.type!r}"
        if not _warned_fallback:
            _warned_fallback = True
            warnings.warn(
                f"dpkern: backend='auto' falls back to the PyTorch reference "
                f"(slow) on {device.type}: {why}",
                RuntimeWarning,
                stacklevel=4,
            )
        return _load("torch")[0]
    module, why = _load(backend)
    if module is None:
        raise RuntimeError(f"backend={backend!r} is not available: {why}")
    if (
        backend == "triton"
        and device.type != "cuda"
        and not (device.type == "cpu" and triton_interpret())
    ):
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors (got {device.type}); "
            "CPU tensors work only under TRITON_INTERPRET=1"
        )
    if backend == "cpp" and device.type != "cpu":
        raise RuntimeError(f"backend='cpp' needs CPU tensors (got {device.type})")
    return module
