"""The multi-group step every front-end uses: :class:`Group`, validation, pass 1 and the
clip factors, pass 2 per group, DP-MacAdam's global scale update, and gradient
accumulation (SPEC sections 1, 2, 4, 5 and 7)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import Tensor

from .. import backends, rules
from ..hyper import (
    DPStep,
    Hyper,
    check_nonnegative,
    check_positive,
    check_stochastic_rounding,
)
from ..keys import NoiseKey
from .blocks import CLIP_EPS, NONFINITE_MODES, PARAM_DTYPES, Reduce, _check_rows


@dataclass
class Group:
    """One parameter group's share of a DP step (lists aligned with ``params``).

    ``names[k]`` is how errors refer to parameter k, e.g. "param_groups[0][3] (shape (7,))".
    ``noise_var_avg``: phi_t for the BC rules (already updated for this step).
    ``step``: the update rule's t for these parameters (their own step count, as
    torch.optim's ``state["step"]``); ``None``: the step's global t."""

    hyper: Hyper
    params: list[Tensor]
    grad_samples: list[Tensor | None]
    summed: list[Tensor | None]
    states: dict[str, list[Tensor]]
    offsets: list[int]
    names: list[str]
    noise_var_avg: float = 0.0
    step: int | None = None


@dataclass
class StepResult:
    """What one step measured: batch size, clip factors, zeroed rows, MacAdam's sum."""

    batch_size: int = 0
    clipped_samples: int = 0
    nonfinite_samples: int = 0
    clip_factors: Tensor | None = field(default=None, repr=False)


def check_params(groups: list[Group]) -> torch.device:
    """Validate parameters, their per-sample gradients and summed buffers; return the device.

    Raises ValueError naming the parameter (SPEC section 1). Modifies nothing."""
    device = None
    rows = []
    for grp in groups:
        for k, p in enumerate(grp.params):
            name = grp.names[k]
            if p.dtype not in PARAM_DTYPES:
                raise ValueError(
                    f"{name}: unsupported parameter dtype {p.dtype} "
                    f"(expected one of {PARAM_DTYPES})"
                )
            if device is None:
                device = p.device
            elif p.device != device:
                raise ValueError(f"{name}: on {p.device}, other parameters on {device}")
            gs = grp.grad_samples[k]
            if gs is not None:
                if not isinstance(gs, Tensor):
                    raise ValueError(
                        f"{name}: grad_sample is a {type(gs).__name__}, expected a tensor"
                    )
                if gs.device != p.device:
                    raise ValueError(f"{name}: grad_sample on {gs.device}, parameter on {p.device}")
                if not gs.is_sparse and tuple(gs.shape[1:]) != tuple(p.shape):
                    raise ValueError(
                        f"{name}: grad_sample has shape {tuple(gs.shape)}, "
                        f"expected [B, *{tuple(p.shape)}]"
                    )
                rows.append((name + " grad_sample", gs))
            s = grp.summed[k]
            if s is not None and (
                s.shape != p.shape
                or s.dtype != torch.float32
                or s.device != p.device
                or s.is_sparse
            ):
                raise ValueError(
                    f"{name}: summed gradient must be a dense float32 tensor "
                    f"of shape {tuple(p.shape)} on {p.device}"
                )
    if rows:
        _check_rows(rows)
    return device if device is not None else torch.device("cpu")


def _pass1(groups: list[Group], backend, batch_size: int, device, dp_step: int) -> Tensor:
    """Per-sample norms over every parameter of every group (whitened for MacAdam)."""
    if not rules.of(groups[0].hyper).whitening:
        return backend.per_sample_norms(
            [g for grp in groups for g in grp.grad_samples], batch_size, device
        )
    # MacAdam whitens with each group's own m_hat = m / (1 - beta1^(t-1)): one call per
    # group, then the norm over all coordinates (the clipped vector is the summed one).
    if len(groups) == 1:
        grp = groups[0]
        return backend.whitened_norms(
            grp.grad_samples,
            grp.states["exp_avg"],
            grp.states["scale"],
            1.0 - grp.hyper.beta1 ** (dp_step - 1),
            batch_size,
            device,
        )
    sq = torch.zeros(batch_size, dtype=torch.float32, device=device)
    for grp in groups:
        bc1 = 1.0 - grp.hyper.beta1 ** (dp_step - 1)
        sq += backend.whitened_norms(
            grp.grad_samples, grp.states["exp_avg"], grp.states["scale"], bc1, batch_size, device
        ).square()
    return sq.sqrt()


def clip_and_check(
    groups: list[Group],
    *,
    backend: ModuleType,
    device: torch.device,
    step: int,
    max_grad_norm: float,
    nonfinite: str,
    reduce: Reduce | None = None,
) -> StepResult:
    """Pass 1 and the clip factors; raise FloatingPointError on non-finite rows if asked.

    ``reduce``: for coordinate-sharded parameters (FSDP, tensor parallel), an in-place SUM
    over the shards' ranks applied to the [B] partial squared norms, so every rank clips
    with the norms over ALL coordinates (see :func:`dp_step_groups`).

    Returns a StepResult whose ``clip_factors`` is None when no per-sample gradient is
    present (summed-gradient step). Modifies nothing."""
    present = [g for grp in groups for g in grp.grad_samples if g is not None]
    if not present:
        return StepResult()
    B = present[0].shape[0]
    norms = _pass1(groups, backend, B, device, step)
    if reduce is not None:
        sq = norms.double().square()
        reduce(sq)
        norms = sq.sqrt().float()
    finite = torch.isfinite(norms)
    bad = (~finite).nonzero().flatten().tolist()
    if bad and nonfinite == "error":
        raise FloatingPointError(
            f"non-finite per-sample gradient (NaN/Inf, or a squared norm overflowing "
            f"float32) in sample rows {bad[:20]}{' ...' if len(bad) > 20 else ''}; "
            "nothing was updated (pass nonfinite='zero' to drop such samples)"
        )
    c = torch.clamp(max_grad_norm / (norms + CLIP_EPS), max=1.0)
    if rules.of(groups[0].hyper).whitening:  # w_bar = w / max(1, ||w||), bound 1 (SPEC 7)
        c = 1.0 / torch.clamp(norms, min=1.0)
    c = torch.where(finite, c, torch.zeros_like(c))
    clipped = int((finite & (c < 1.0)).sum()) if B else 0
    return StepResult(
        batch_size=B, clipped_samples=clipped, nonfinite_samples=len(bad), clip_factors=c
    )


def dp_step_groups(
    groups: list[Group],
    *,
    key: NoiseKey | int,
    step: int,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    backend: str = "auto",
    nonfinite: str = "error",
    reduce: Reduce | None = None,
    stochastic_rounding: bool = False,
) -> StepResult:
    """One DP step over several parameter groups sharing one noise index space and step.

    Validates everything first (nothing is modified on error), then runs pass 1 over all
    groups, pass 2 per group, and DP-MacAdam's global scale update. ``max_grad_norm`` is
    ignored by DP-MacAdam (its bound is 1 in the whitened space). ``key`` is a
    :class:`dpkern.keys.NoiseKey` or an int; ``step`` the noise stream's step (each
    group's update rule uses ``Group.step`` when set).

    Coordinate-sharded parameters (each rank holds a slice of every parameter, e.g. FSDP2
    shards or tensor-parallel slices): give each rank's local slices with their GLOBAL
    ``offsets`` and a ``reduce`` callable (an in-place SUM over the ranks holding the
    shards, e.g. ``lambda t: dist.all_reduce(t, group=g)``). It is called on the [B]
    partial squared per-sample norms (float64; the grad_sample slices must hold the same
    B samples on every rank) and, for DP-MacAdam, on the one-element sum
    sum_j sqrt(S_hat_j) (SPEC section 7): the only two global reductions of a step. Every
    rank must then call this function (a collective).

    ``stochastic_rounding``: round bfloat16 parameters stochastically on store (SPEC 3.2)
    instead of to nearest even; float32 / float16 parameters are unaffected.

    Every parameter of a step goes into ONE call: the clipping bound holds over all of
    them, and the noise of two calls at one (key, step) would be the same draw (their
    difference cancels it). A :class:`NoiseKey` therefore refuses a step that is not above
    the last one it served (ValueError, nothing changed); an int key (seeded, not private)
    is not tracked."""
    check_stochastic_rounding(stochastic_rounding)
    if isinstance(key, NoiseKey):  # before any collective: every rank refuses alike
        key.claim_step(step, check_only=True)
    be, pass1 = prepare_step(
        groups,
        step=step,
        max_grad_norm=max_grad_norm,
        backend=backend,
        nonfinite=nonfinite,
        reduce=reduce,
    )
    if isinstance(key, NoiseKey):  # validated: the pair is now spent, whatever follows
        key.claim_step(step)
    apply_step(
        groups,
        be,
        pass1,
        key=key,
        step=step,
        max_grad_norm=max_grad_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        reduce=reduce,
        stochastic_rounding=stochastic_rounding,
    )
    return pass1


def prepare_step(
    groups: list[Group],
    *,
    step: int,
    max_grad_norm: float,
    backend: str = "auto",
    nonfinite: str = "error",
    reduce: Reduce | None = None,
) -> tuple[ModuleType, StepResult]:
    """The first half of :func:`dp_step_groups`: validation, pass 1 and the clip factors.

    Returns (backend module, StepResult). Modifies nothing; raises ValueError /
    FloatingPointError as :func:`dp_step_groups`."""
    device = check_params(groups)
    clip = check_update_rms_clip(groups)
    be = backends.resolve(
        backends.check_name(backend), device, groups[0].hyper.rule, update_rms_clip=clip
    )
    pass1 = clip_and_check(
        groups,
        backend=be,
        device=device,
        step=step,
        max_grad_norm=max_grad_norm,
        nonfinite=nonfinite,
        reduce=reduce,
    )
    return be, pass1


def apply_step(
    groups: list[Group],
    be: ModuleType,
    pass1: StepResult,
    *,
    key: NoiseKey | int,
    step: int,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    reduce: Reduce | None = None,
    stochastic_rounding: bool = False,
) -> None:
    """The second half of :func:`dp_step_groups`: pass 2 (noise at ``step``; bf16
    parameters rounded stochastically if ``stochastic_rounding``, SPEC 3.2) and
    DP-MacAdam's scale update, in place. Only errors of the machine (out of memory) can
    stop it midway; callers that must stay consistent treat that as a failed step."""
    device = next((p.device for grp in groups for p in grp.params), torch.device("cpu"))
    macadam = rules.of(groups[0].hyper).whitening  # the global scale update follows
    noise_std = noise_multiplier * (1.0 if macadam else max_grad_norm)
    clip = check_update_rms_clip(groups)
    sqrt_sum = 0.0  # DP-MacAdam's sum of sqrt(S_hat_j); with update_rms_clip, sum of U^2
    steps = []
    pending = []
    for grp in groups:
        dp = DPStep(
            key=key,
            step=grp.step if grp.step is not None else step,
            noise_step=step,
            noise_std=noise_std,
            expected_batch_size=expected_batch_size,
            noise_var_avg=grp.noise_var_avg,
            stochastic_rounding=stochastic_rounding,
        )
        steps.append(dp)
        args = (
            grp.hyper,
            dp,
            grp.params,
            grp.grad_samples,
            pass1.clip_factors,
            grp.summed,
            grp.states,
            grp.offsets,
        )
        if clip is None:
            sqrt_sum += be.step(*args)
        else:  # SPEC 10.9, pass A: states and sum U^2, no parameter write
            uu, todo = be.rms_clip_moments(*args)
            sqrt_sum += uu
            pending.append(todo)
    if clip is not None:  # SPEC 10.9: one RMS over every group (and shard), then pass B
        n = sum(p.numel() for grp in groups for p in grp.params)
        if reduce is not None:
            total = torch.tensor([sqrt_sum, float(n)], dtype=torch.float64, device=device)
            reduce(total)
            sqrt_sum, n = total.tolist()
        scale = rms_clip_scale(sqrt_sum, n, clip)
        for todo in pending:
            be.rms_clip_apply(todo, scale)
        return
    if macadam and reduce is not None:
        total = torch.tensor([sqrt_sum], dtype=torch.float64, device=device)
        reduce(total)
        sqrt_sum = float(total)
    if macadam:
        for grp, dp in zip(groups, steps, strict=True):
            be.macadam_update_scale(
                grp.hyper, dp, grp.states["exp_var"], grp.states["scale"], sqrt_sum
            )


def check_update_rms_clip(groups: list[Group]) -> float | None:
    """The step's ``update_rms_clip`` d_u (SPEC 10.9): None when off. Every group must hold
    the same value (one RMS over the model). Raises ValueError naming the values."""
    values = [getattr(grp.hyper, "update_rms_clip", None) for grp in groups]
    if any(v != values[0] for v in values):
        raise ValueError(
            f"invalid update_rms_clip: the param groups hold {sorted(set(values), key=str)}; "
            "the update's RMS is clipped over the whole model, so every param group must "
            "hold the same value (None in all, or one float > 0) (SPEC 10.9)"
        )
    return values[0]


def rms_clip_scale(sum_sq: float, numel: float, clip: float) -> float:
    """s = 1 / max(1, RMS / d_u), RMS = sqrt(sum_sq / numel) (SPEC 10.9), in double. A NaN
    RMS gives 1 (max(1, NaN) is 1: the unclipped step), an infinite one 0."""
    rms = (sum_sq / numel) ** 0.5 if numel else 0.0
    return 1.0 / max(1.0, rms / clip)


def noise_var(max_grad_norm: float, noise_multiplier: float, expected_batch_size: float) -> float:
    """Phi = (sigma C / B_e)^2: the variance of the Gaussian noise in each coordinate of
    g_hat = (S + sigma C z) / B_e (SPEC 5.3), with sigma the noise multiplier in force at
    the step. Python float (double)."""
    return (noise_multiplier * max_grad_norm / expected_batch_size) ** 2


def noise_var_ema(
    prev: float,
    *,
    beta2: float,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
) -> float:
    """phi_t = beta2 phi_{t-1} + (1 - beta2) Phi_t, Phi_t = (sigma C / B_e)^2: the EMA of
    the noise variance in each coordinate of g_hat that DP-AdamBC / DP-AdamW-BC remove from
    the second moment (SPEC 5.3; Tang et al., arXiv 2312.14334). Python floats (double)."""
    return beta2 * prev + (1 - beta2) * noise_var(
        max_grad_norm, noise_multiplier, expected_batch_size
    )


def check_privacy(
    max_grad_norm: float, noise_multiplier: float, expected_batch_size: float
) -> None:
    check_positive("max_grad_norm", max_grad_norm)
    check_nonnegative("noise_multiplier", noise_multiplier)
    check_positive("expected_batch_size", expected_batch_size)


def check_nonfinite(nonfinite: str) -> str:
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"invalid nonfinite={nonfinite!r}: expected one of {NONFINITE_MODES}")
    return nonfinite


def accumulate_groups(
    groups: list[Group],
    *,
    step: int,
    max_grad_norm: float,
    backend: str = "auto",
    nonfinite: str = "error",
    reduce: Reduce | None = None,
) -> StepResult:
    """Fold one micro-batch into the logical batch: ``grp.summed[k] += sum_i c_i x_i``.

    ``grp.summed`` entries must be float32 buffers (not None); x_i is the per-sample
    gradient (whitened for DP-MacAdam, whose m_hat and b stay fixed within a logical
    batch). ``step`` is the step that will end the logical batch. No noise is added: the
    step that ends the logical batch adds it once (SPEC section 2). ``reduce``: as in
    :func:`dp_step_groups` (sharded parameters). Validates first; nothing is modified on
    error."""
    device = check_params(groups)
    if not any(g is not None for grp in groups for g in grp.grad_samples):
        raise ValueError(
            "accumulate: no parameter has a grad_sample (per-sample gradients "
            "were never computed for this micro-batch)"
        )
    be = backends.resolve(backends.check_name(backend), device, groups[0].hyper.rule)
    result = clip_and_check(
        groups,
        backend=be,
        device=device,
        step=step,
        max_grad_norm=max_grad_norm,
        nonfinite=nonfinite,
        reduce=reduce,
    )
    dp = DPStep(key=0, step=step, noise_std=0.0, expected_batch_size=1.0)
    for grp in groups:
        be.accumulate(grp.hyper, dp, grp.grad_samples, result.clip_factors, grp.summed, grp.states)
    return result
