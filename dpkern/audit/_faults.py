"""Fault injection for the audit's own tests (never a user option).

``active`` names the fault applied to the optimizer after it was built and calibrated
(None: none). Tests set it (``monkeypatch.setattr(dpkern.audit._faults, "active", ...)``)
to check that the audit catches a broken mechanism; the data-parallel workers receive the
parent's value explicitly."""

from __future__ import annotations

#: The fault in force (a key of FAULTS) or None.
active: str | None = None

#: Clip bound factor of "clip-off": C is raised this much and sigma lowered as much, so
#: the noise sigma * C stays the claimed one while no sample is clipped.
_CLIP_OFF = 1e6


def _sigma_quarter(opt) -> None:
    opt.noise_multiplier = opt.noise_multiplier / 4.0


def _noise_off(opt) -> None:
    opt.noise_multiplier = 0.0


def _clip_off(opt) -> None:
    opt.max_grad_norm = opt.max_grad_norm * _CLIP_OFF
    opt.noise_multiplier = opt.noise_multiplier / _CLIP_OFF


FAULTS = {"sigma/4": _sigma_quarter, "noise-off": _noise_off, "clip-off": _clip_off}


def apply(optimizer, fault: str | None = None) -> None:
    """Apply ``fault`` (default: :data:`active`) to a dpkern optimizer, in place."""
    name = active if fault is None else fault
    if name is not None:
        FAULTS[name](optimizer)
