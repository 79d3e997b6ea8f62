"""One-run privacy audits of a training setup (Steinke, Nasr & Jagielski, NeurIPS 2023,
"Privacy Auditing with One (1) Training Run", arXiv 2305.08846).

m canaries, each included in the data by an independent fair coin; ONE training run;
each canary scored from the released parameters only; the top scores guessed "in", the
bottom ones "out" (guess sizes fixed in advance); the paper's main theorem turns the
number of correct guesses into a lower bound on epsilon that holds with probability
>= 1 - beta (:mod:`.bound`: exact binomial tails, the delta term, a union bound over the
guess sizes). A lower bound ABOVE the claimed epsilon is proof (at confidence 1 - beta)
that the run does not have the claimed guarantee: a bug in the noise, the clipping or
the accounting. A lower bound below it proves nothing; the audit is loose (an honest
run's bound is usually far below its epsilon), which is why each white-box audit also
runs a noise-calibration check (:mod:`.calibration`) that compares the canaries' score
distribution with the one sigma implies.

- :func:`audit_whitebox`: Dirac gradient canaries through the real path of a
  configuration: per-sample ``step()``, ``accumulate()`` micro-batches, ghost clipping,
  data-parallel (:mod:`.whitebox`);
- :mod:`.inputs`: canary token blocks inserted into the finetune job's training data,
  scored by their loss (``dpkern audit --path input``);
- :func:`.bound.lower_bound_from_scores`: the bound for canaries of your own.

The command ``dpkern audit`` runs them on a finetune configuration (dpkern.cli.audit).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .bound import (
    GUESS_FRACTIONS,
    Bound,
    delta_note,
    epsilon_lower_bound,
    lower_bound_from_scores,
    p_value,
)
from .calibration import (
    N_SIM,
    SIMULATED_RULES,
    Calibration,
    calibration_check,
    group_hyper,
    not_available,
    rule_of,
    simulate_trajectories,
    trajectory_scores,
)
from .whitebox import PATHS, WhiteBoxRun, run_canaries

__all__ = [
    "AuditResult",
    "Bound",
    "Calibration",
    "GUESS_FRACTIONS",
    "PATHS",
    "audit_whitebox",
    "epsilon_lower_bound",
    "lower_bound_from_scores",
    "p_value",
]


@dataclass
class AuditResult:
    """One audited run.

    ``epsilon_claimed``: what the accountant claims for the audited run (its sigma, q and
    T at ``delta``); ``bound``: the one-run lower bound (:class:`.bound.Bound`, valid at
    confidence 1 - beta); ``violation``: the bound exceeds the claim (proof of a bug);
    ``calibration``: the noise-calibration check (:class:`.calibration.Calibration`).
    ``verdict``: "pass", "VIOLATION" or "MISCALIBRATED"."""

    path: str
    optimizer: str
    backend: str
    canaries: int
    steps: int
    sample_rate: float
    noise_multiplier: float
    max_grad_norm: float
    delta: float
    epsilon_claimed: float
    bound: Bound
    calibration: Calibration
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def violation(self) -> bool:
        return self.bound.epsilon > self.epsilon_claimed

    @property
    def verdict(self) -> str:
        if self.violation:
            return "VIOLATION"
        return "pass" if self.calibration.ok else "MISCALIBRATED"

    def to_dict(self) -> dict:
        """A JSON-ready dict (no canary coins, scores or data-dependent counts beyond the
        guesses' correct counts)."""
        best = self.bound.best if self.bound.guesses else None
        cal = self.calibration

        def num(x):
            return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x

        return {
            "path": self.path,
            "optimizer": self.optimizer,
            "backend": self.backend,
            "canaries": self.canaries,
            "steps": self.steps,
            "sample_rate": self.sample_rate,
            "noise_multiplier": self.noise_multiplier,
            "max_grad_norm": self.max_grad_norm,
            "delta": self.delta,
            "confidence": 1.0 - self.bound.beta,
            "epsilon_lower_bound": self.bound.epsilon,
            "epsilon_claimed": self.epsilon_claimed,
            "verdict": self.verdict,
            "best_guess": None
            if best is None
            else {"k_in": best.k_in, "k_out": best.k_out, "correct": best.correct},
            "guesses": [
                {"k_in": g.k_in, "k_out": g.k_out, "correct": g.correct, "epsilon": g.epsilon}
                for g in self.bound.guesses
            ],
            "calibration": {
                "available": cal.available,
                "ok": cal.ok,
                "alpha": cal.alpha,
                "noise_ratio": num(cal.noise_ratio),
                "z_noise": num(cal.z_noise),
                "signal_ratio": num(cal.signal_ratio),
                "z_signal": num(cal.z_signal),
                "sigma_effective": num(cal.sigma_effective),
                "reason": cal.reason,
            },
            "seconds": self.seconds,
            "notes": list(self.notes),
        }


def backend_label(name: str, device="cpu") -> str:
    """The backend that ran: ``"auto (cpp)"`` for ``"auto"`` (resolved for ``device``)."""
    if name != "auto":
        return name
    from .. import backends

    module = backends.resolve("auto", torch.device(device)).__name__.rsplit(".", 1)[-1]
    return "auto (" + {"reference": "torch"}.get(module, module) + ")"


def _rng(seed):
    return np.random.default_rng(
        seed if seed is not None else int.from_bytes(os.urandom(8), "little")
    )


def coins(m: int, rng: np.random.Generator) -> np.ndarray:
    """The canaries' inclusion coins: independent fair Bernoulli draws."""
    return rng.random(m) < 0.5


def audit_whitebox(
    make_optimizer,
    *,
    sample_rate: float,
    steps: int,
    delta: float,
    path: str = "step",
    canaries: int = 1000,
    free: int | None = None,
    epsilon: float | None = None,
    accountant: str = "rdp",
    beta: float = 0.05,
    alpha: float = 1e-4,
    canary_norm: float = 10.0,
    n_real: int | None = None,
    micro_batch_size: int | None = None,
    clipping: str = "per-sample",
    nproc: int = 2,
    seed: int | None = None,
    label: str | None = None,
    device: str = "cpu",
) -> AuditResult:
    """Audit a DP optimizer configuration with white-box gradient canaries, one run.

    Args:
        make_optimizer: ``make_optimizer(params) -> optimizer``, the dpkern optimizer under
            audit (its class, lr, weight decay, max_grad_norm C, noise_multiplier sigma,
            expected_batch_size B_e and backend are the audited ones). For ``path="ddp"``
            and ``"fsdp"`` it must be picklable (a module-level function or ``functools.partial``).
        sample_rate: Poisson rate q of every sample, canaries included.
        steps: T, optimizer steps of the audited run.
        delta: the delta of the guarantee audited.
        path: ``"step"``, ``"accumulate"``, ``"ghost"``, ``"ddp"`` or ``"fsdp"`` (FSDP2
            sharding, ghost clipping; see :mod:`dpkern.audit.whitebox`).
        canaries: m (default 1000). free: noise-only coordinates beside them for the
            calibration check (default: up to 4096 coordinates in all).
        epsilon: the claimed epsilon; default: the accountant's for (sigma, q, T, delta).
        accountant: "rdp" or "pld" (for the default claim).
        beta: 1 - confidence of the bound (default 0.05). alpha: level of each
            calibration z-test (default 1e-4).
        canary_norm: the canary gradient's norm in units of C (default 10).
        n_real: real samples (default: B_e / q - m / 2, at least 16, at most 20000, so
            that a logical batch has about B_e samples).
        micro_batch_size: for accumulate / ghost / ddp (default: ceil(B_e / 2)).
        clipping: what the ddp path clips with, ``"per-sample"`` or ``"ghost"`` (the
            fsdp path: ghost clipping, whatever is given).
        nproc: processes of the ddp and fsdp paths (default 2).
        seed: seeds the coins, the tie-breaking, the data and the Poisson sampling
            (reproducible audits); the noise key is the optimizer's own.
        label: the optimizer's name in the result (default: its rule).
        device: where the single-process paths train (ddp, fsdp: CPU, gloo).
    Returns: an :class:`AuditResult`.
    Raises: ValueError on arguments out of range (also from the optimizer)."""
    from ..accounting import get_epsilon

    t0 = time.perf_counter()
    rng = _rng(seed)
    probe = make_optimizer([torch.nn.Parameter(torch.zeros(1, device=device))])
    inner = getattr(probe, "optimizer", probe)
    rule = rule_of(inner)
    sigma = float(inner.noise_multiplier)
    C = float(getattr(inner, "max_grad_norm", 1.0))
    Be = float(inner.expected_batch_size)
    group = group_hyper(inner)
    if not float(group["lr"]) > 0:
        raise ValueError("the audit needs lr > 0 (with lr = 0 nothing is released)")
    m = int(canaries)
    if m < 2:
        raise ValueError(f"invalid canaries={canaries!r}: need at least 2")
    free = max(0, 4096 - m) if free is None else int(free)
    if n_real is None:
        n_real = int(min(20_000, max(16, round(Be / sample_rate - m / 2))))
    micro = int(micro_batch_size or max(1, math.ceil(Be / 2)))
    run = WhiteBoxRun(
        path=path,
        sample_rate=float(sample_rate),
        steps=int(steps),
        canaries=m,
        free=free,
        canary_norm=float(canary_norm),
        n_real=int(n_real),
        micro_batch_size=micro,
        clipping="ghost" if path == "fsdp" else clipping,
        nproc=int(nproc),
        data_seed=int(rng.integers(2**31)) if seed is not None else 0,
        sampler_seed=None if seed is None else int(rng.integers(2**62)),
        device=str(device),
    )
    included = coins(m, rng)
    traj = run_canaries(make_optimizer, run, included)
    scores_all = trajectory_scores(traj, rule, group, unit=C / Be)
    scores = scores_all[:m]
    bound = lower_bound_from_scores(scores, included, delta, beta, generator=rng)
    claimed = (
        float(epsilon)
        if epsilon is not None
        else get_epsilon(sigma, sample_rate, int(steps), delta, accountant)
    )
    notes = [n for n in (delta_note(m, delta, beta),) if n]
    if sigma == 0.0:
        cal = not_available("sigma = 0: no noise to calibrate", alpha, sigma)
    elif rule in SIMULATED_RULES:
        gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
        c = canary_norm * C
        sim = {}
        for name, signal in (("in", c * C / (c + 1e-6)), ("out", 0.0)):
            th = simulate_trajectories(
                rule,
                group,
                sigma=sigma,
                max_grad_norm=C,
                expected_batch_size=Be,
                sample_rate=sample_rate,
                steps=int(steps),
                signal=signal,
                n=N_SIM,
                generator=gen,
            )
            sim[name] = trajectory_scores(th, rule, group, unit=C / Be)
        out_scores = np.concatenate([scores[~included], scores_all[m:]])
        cal = calibration_check(
            scores[included],
            out_scores,
            sim["in"],
            sim["out"],
            sigma=sigma,
            alpha=alpha,
            linear=rule == "sgd",
        )
    else:
        cal = not_available(f"no simulator for {rule}", alpha, sigma)
    if sigma == 0.0:
        notes.append("sigma = 0: the run adds no noise (no privacy claimed)")
    return AuditResult(
        path=(
            f"ddp x{nproc} ({clipping})"
            if path == "ddp"
            else f"fsdp x{nproc} (ghost)"
            if path == "fsdp"
            else path
        ),
        optimizer=label or rule,
        backend=backend_label(str(getattr(inner, "backend", "auto")), device),
        canaries=m,
        steps=int(steps),
        sample_rate=float(sample_rate),
        noise_multiplier=sigma,
        max_grad_norm=C,
        delta=float(delta),
        epsilon_claimed=claimed,
        bound=bound,
        calibration=cal,
        seconds=time.perf_counter() - t0,
        notes=notes,
    )
