"""The functional API, in torch.optim's ``_functional`` style: lists of tensors updated in place.

Each ``dp_<rule>`` function runs one DP step (SPEC sections 2-7): per-sample norms over
all given parameters (pass 1), clip factors, then clip + sum + Philox noise + moment update
+ parameter update (pass 2) on the chosen backend. :func:`dp_step` does the same for any
rule of the registry (:mod:`dpkern.rules`) given its hyper-parameter dataclass and its
states by name. ``dpkern.optim`` is a thin stateful layer over :func:`dp_step_groups`, the
multi-group form used by every front-end.

Shapes and dtypes (all functions):
- ``params``: list of parameters (float32, bfloat16 or float16), updated in place;
- ``grad_samples``: list, entry k ``None`` (parameter unused: zero per-sample gradient) or
  a tensor ``[B, *params[k].shape]`` (Opacus' ``p.grad_sample`` convention); ``None`` for
  the whole argument means "no per-sample gradients, use ``summed_grads``";
- ``summed_grads``: list of float32 tensors shaped like the parameters (or ``None``
  entries): clipped sums the caller computed itself (ghost clipping, earlier micro-batches);
- optimizer states: float32 tensors shaped as the rule's ``StateSpec`` says (most are
  shaped like the parameters), updated in place.

Errors: ``ValueError`` for bad hyper-parameters and bad tensors (naming the parameter),
``FloatingPointError`` for non-finite per-sample gradients with ``nonfinite="error"``;
in every error case nothing has been modified.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import Tensor

from . import backends, rules
from .hyper import (
    AdamBCHyper,
    AdamHyper,
    AdamWBCHyper,
    AdamWHyper,
    DPStep,
    Hyper,
    MacAdamHyper,
    SGDHyper,
    check_betas,
    check_nonnegative,
    check_positive,
)
from .keys import NoiseKey

__all__ = [
    "CLIP_EPS",
    "NONFINITE_MODES",
    "PARAM_DTYPES",
    "Group",
    "StepResult",
    "accumulate_groups",
    "apply_step",
    "check_params",
    "clip_and_check",
    "clip_factors",
    "dp_adam",
    "dp_adam_bc",
    "dp_adamw",
    "dp_adamw_bc",
    "dp_macadam",
    "dp_sgd",
    "dp_step",
    "dp_step_groups",
    "gaussian_noise",
    "noise_var_ema",
    "per_sample_norms",
    "prepare_step",
]

NONFINITE_MODES = ("error", "zero")
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CLIP_EPS = 1e-6  # c_i = min(1, C / (n_i + 1e-6)), Opacus' convention (SPEC section 2)
Reduce = Callable[[Tensor], None]  # in-place SUM over the ranks of sharded parameters


# --------------------------------------------------------------------------------------
# Noise and pass 1, public building blocks
# --------------------------------------------------------------------------------------
def gaussian_noise(
    numel: int,
    *,
    key: NoiseKey | int,
    step: int,
    offset: int = 0,
    stream: int = 0,
    device: torch.device | str | None = None,
    backend: str = "auto",
) -> Tensor:
    """Standard normals of the dpkern noise stream v1 (SPEC section 3).

    Returns a float32 tensor ``[numel]`` holding z_j for global element indices
    j = offset, ..., offset + numel - 1 at (key, step, stream). A pure function of those:
    independent of device, backend, block size or thread count.

    Args:
        numel: number of elements (>= 0).
        key: 64-bit noise key, an int in [0, 2**64).
        step: optimizer step t >= 1 (< 2**48).
        offset: global index of the first element (>= 0, may exceed 2**32).
        stream: 16-bit stream id (0 = gradient noise).
    Raises:
        ValueError: on any argument out of range.
    Source: Salmon et al. 2011 (Philox-4x32-10); Box-Muller radius from 96 bits, SPEC 3.
    """
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"invalid numel={numel!r}: expected an int >= 0")
    if not isinstance(offset, int) or offset < 0 or offset + numel > 2**64:
        raise ValueError(f"invalid offset={offset!r}: expected an int in [0, 2**64 - numel]")
    DPStep(key=key, step=step, noise_std=0.0, expected_batch_size=1.0, stream=stream)
    device = torch.device(device) if device is not None else torch.device("cpu")
    be = backends.resolve(backends.check_name(backend), device)
    return be.gaussian_noise(numel, key=key, step=step, offset=offset, stream=stream, device=device)


def per_sample_norms(grad_samples: Sequence[Tensor | None], *, backend: str = "auto") -> Tensor:
    """Per-sample gradient norms n_i = sqrt(sum_p ||grad_sample_p[i]||^2) (SPEC section 2).

    Args:
        grad_samples: tensors ``[B, *shape_p]`` (any float dtype; ``None`` entries are
            zero gradients), all with the same B and on the same device.
    Returns:
        float32 tensor ``[B]`` (accumulated in float32).
    Raises:
        ValueError: mismatched B, devices, sparse or non-float tensors, or no tensor at all.
    """
    present = [(k, g) for k, g in enumerate(grad_samples) if g is not None]
    if not present:
        raise ValueError("per_sample_norms: no grad_sample tensor given")
    B = _check_rows([(f"grad_samples[{k}]", g) for k, g in present])
    device = present[0][1].device
    return backends.resolve(backends.check_name(backend), device).per_sample_norms(
        list(grad_samples), B, device
    )


def clip_factors(norms: Tensor, max_grad_norm: float) -> Tensor:
    """c_i = min(1, C / (n_i + 1e-6)) (SPEC section 2, Opacus' convention): float32 ``[B]``."""
    check_positive("max_grad_norm", max_grad_norm)
    return torch.clamp(max_grad_norm / (norms.float() + CLIP_EPS), max=1.0)


def _check_rows(named: list[tuple[str, Tensor]]) -> int:
    """Check per-sample gradient tensors share B and a device; return B."""
    B, device = None, None
    for name, g in named:
        if not isinstance(g, Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(g).__name__}")
        if g.is_sparse or g.layout != torch.strided:
            raise ValueError(f"{name}: sparse per-sample gradients are not supported")
        if not g.is_floating_point() or g.dim() == 0:
            raise ValueError(
                f"{name}: expected a floating tensor [B, ...], got "
                f"{g.dtype} of shape {tuple(g.shape)}"
            )
        if B is None:
            B, device = g.shape[0], g.device
        elif g.shape[0] != B:
            raise ValueError(
                f"{name}: batch size {g.shape[0]} differs from {B} "
                "(all grad_sample tensors of one step share B)"
            )
        elif g.device != device:
            raise ValueError(f"{name}: on {g.device}, others on {device}")
    return B


# --------------------------------------------------------------------------------------
# The multi-group step every front-end uses
# --------------------------------------------------------------------------------------
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
    rank must then call this function (a collective)."""
    be, pass1 = prepare_step(
        groups,
        step=step,
        max_grad_norm=max_grad_norm,
        backend=backend,
        nonfinite=nonfinite,
        reduce=reduce,
    )
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
    be = backends.resolve(backends.check_name(backend), device, groups[0].hyper.rule)
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
) -> None:
    """The second half of :func:`dp_step_groups`: pass 2 (noise at ``step``) and
    DP-MacAdam's scale update, in place. Only errors of the machine (out of memory) can
    stop it midway; callers that must stay consistent treat that as a failed step."""
    device = next((p.device for grp in groups for p in grp.params), torch.device("cpu"))
    macadam = rules.of(groups[0].hyper).whitening  # the global scale update follows
    noise_std = noise_multiplier * (1.0 if macadam else max_grad_norm)
    sqrt_sum = 0.0
    steps = []
    for grp in groups:
        dp = DPStep(
            key=key,
            step=grp.step if grp.step is not None else step,
            noise_step=step,
            noise_std=noise_std,
            expected_batch_size=expected_batch_size,
            noise_var_avg=grp.noise_var_avg,
        )
        steps.append(dp)
        sqrt_sum += be.step(
            grp.hyper,
            dp,
            grp.params,
            grp.grad_samples,
            pass1.clip_factors,
            grp.summed,
            grp.states,
            grp.offsets,
        )
    if macadam and reduce is not None:
        total = torch.tensor([sqrt_sum], dtype=torch.float64, device=device)
        reduce(total)
        sqrt_sum = float(total)
    if macadam:
        for grp, dp in zip(groups, steps, strict=True):
            be.macadam_update_scale(
                grp.hyper, dp, grp.states["exp_var"], grp.states["scale"], sqrt_sum
            )


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
    Phi = (noise_multiplier * max_grad_norm / expected_batch_size) ** 2
    return beta2 * prev + (1 - beta2) * Phi


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


def dp_step(
    hyper: Hyper,
    params: Sequence[Tensor],
    grad_samples: Sequence[Tensor | None] | None,
    states: Mapping[str, Sequence[Tensor | None]],
    *,
    step: int,
    key: NoiseKey | int,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    summed_grads: Sequence[Tensor | None] | None = None,
    offset: int = 0,
    noise_var_avg: float = 0.0,
    nonfinite: str = "error",
    backend: str = "auto",
) -> StepResult:
    """One DP step of any registered update rule (:mod:`dpkern.rules`), in place.

    Args:
        hyper: the rule's hyper-parameter dataclass (:mod:`dpkern.hyper`), e.g.
            ``AdamWHyper(lr=1e-3)``; its ``rule`` picks the update.
        params, grad_samples, summed_grads: see the module docstring.
        states: one list per kernel state of the rule (``RuleSpec.kernel_state_names``),
            entry k a float32 tensor on params[k]'s device shaped as its ``StateSpec``
            says for params[k] (None where the hyper-parameters do not need the state).
        noise_var_avg: phi_t, the already-updated noise-variance EMA of the rules with
            ``noise_bias_correction`` (:func:`noise_var_ema`); ignored by the others.
        max_grad_norm: ignored by rules with ``whitening`` (their bound is 1).
    Raises (besides those below): NotImplementedError when ``backend`` names a fused
    backend without a kernel for the rule (``"auto"`` falls back to the reference).
    Source: the rule's (``rules.of(hyper).source``); SPEC section ``rules.of(hyper).section``.
    """
    spec = rules.of(hyper)
    check_privacy(max_grad_norm, noise_multiplier, expected_batch_size)
    check_nonfinite(nonfinite)
    n = len(params)
    if grad_samples is None and summed_grads is None:
        raise ValueError("give grad_samples (per-sample gradients) or summed_grads")
    grad_samples = list(grad_samples) if grad_samples is not None else [None] * n
    summed = list(summed_grads) if summed_grads is not None else [None] * n
    states = {name: list(lst) for name, lst in states.items()}
    if set(states) != set(spec.kernel_state_names):
        raise ValueError(
            f"states: expected {spec.kernel_state_names} for {spec.title}, got {tuple(states)}"
        )
    for name, lst in [("grad_samples", grad_samples), ("summed_grads", summed), *states.items()]:
        if len(lst) != n:
            raise ValueError(f"{name}: {len(lst)} entries for {n} params")
    for name, lst in states.items():
        st = spec.state(name)
        for k, (s, p) in enumerate(zip(lst, params, strict=True)):
            if s is None and not st.is_needed(hyper):
                continue  # unused (torch.optim's functional sgd allows it without momentum)
            want = st.shape_for(p.shape)
            if (
                not isinstance(s, Tensor)
                or tuple(s.shape) != want
                or s.dtype != torch.float32
                or s.device != p.device
            ):
                raise ValueError(f"{name}[{k}]: expected float32 of shape {want} on {p.device}")
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"invalid offset={offset!r}: expected an int >= 0")
    offsets, off = [], offset
    for p in params:
        offsets.append(off)
        off += p.numel()
    names = [f"params[{k}] (shape {tuple(p.shape)})" for k, p in enumerate(params)]
    DPStep(key=key, step=step, noise_std=0.0, expected_batch_size=1.0)  # validates key/step
    grp = Group(hyper, list(params), grad_samples, summed, states, offsets, names, noise_var_avg)
    return dp_step_groups(
        [grp],
        key=key,
        step=step,
        max_grad_norm=max_grad_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        backend=backend,
        nonfinite=nonfinite,
    )


_COMMON_DOC = """
    Common keyword arguments:
        step: optimizer step t >= 1 (shared by all parameters; bias corrections use it).
        key: 64-bit noise key (keep it secret; see SPEC section 3).
        max_grad_norm: C > 0, clipping bound on each sample's gradient (L2, all params).
        noise_multiplier: sigma >= 0; the noise added to the clipped sum has std sigma * C.
        expected_batch_size: B_e > 0, the normaliser (sample_rate * dataset size).
        grad_samples / summed_grads: see the module docstring.
        offset: global noise index of params[0]'s first element (default 0).
        nonfinite: "error" (default) or "zero" (drop samples with NaN/Inf gradients).
        backend: "auto", "torch", "triton" or "cpp".
    Returns: a StepResult (batch size, clipped and non-finite sample counts).
    Raises: ValueError (bad hyper-parameter or tensor), FloatingPointError (non-finite
    per-sample gradient with nonfinite="error"); nothing is modified when it raises.
"""


def dp_sgd(
    params: Sequence[Tensor],
    grad_samples: Sequence[Tensor | None] | None,
    momentum_buffers: Sequence[Tensor | None] | None,
    *,
    step: int,
    key: NoiseKey | int,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    summed_grads: Sequence[Tensor | None] | None = None,
    offset: int = 0,
    nonfinite: str = "error",
    backend: str = "auto",
) -> StepResult:
    """DP-SGD (Abadi et al. 2016, Algorithm 1) with torch.optim.SGD's update (SPEC 5.1).

    ``momentum_buffers``: float32 tensors like the params; with momentum = 0 they are
    unused and may be None (the whole list or entries: nothing is allocated).
    Raises: ValueError (momentum != 0 and a buffer missing), see below."""
    hyper = SGDHyper(
        lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov
    )
    if momentum_buffers is None:
        if momentum != 0:
            raise ValueError("momentum_buffers: required when momentum != 0")
        momentum_buffers = [None] * len(params)
    return dp_step(
        hyper,
        params,
        grad_samples,
        {"momentum_buffer": list(momentum_buffers)},
        summed_grads=summed_grads,
        step=step,
        key=key,
        max_grad_norm=max_grad_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        offset=offset,
        nonfinite=nonfinite,
        backend=backend,
    )


def _adam_family(
    cls,
    params,
    grad_samples,
    exp_avgs,
    exp_avg_sqs,
    *,
    step,
    key,
    lr,
    betas,
    weight_decay,
    max_grad_norm,
    noise_multiplier,
    expected_batch_size,
    summed_grads,
    offset,
    nonfinite,
    backend,
    noise_var_avg=None,
    **extra,
):
    beta1, beta2 = check_betas(betas)
    hyper = cls(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, **extra)
    phi = 0.0
    if noise_var_avg is not None:  # phi_t = beta2 phi_{t-1} + (1 - beta2) Phi_t (SPEC 5.3)
        if not (isinstance(noise_var_avg, Tensor) and noise_var_avg.numel() == 1):
            raise ValueError("noise_var_avg: expected a one-element float tensor")
        check_privacy(max_grad_norm, noise_multiplier, expected_batch_size)
        phi = noise_var_ema(
            float(noise_var_avg),
            beta2=beta2,
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
        )
    result = dp_step(
        hyper,
        params,
        grad_samples,
        {"exp_avg": list(exp_avgs), "exp_avg_sq": list(exp_avg_sqs)},
        summed_grads=summed_grads,
        step=step,
        key=key,
        max_grad_norm=max_grad_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        offset=offset,
        nonfinite=nonfinite,
        backend=backend,
        noise_var_avg=phi,
    )
    if noise_var_avg is not None:
        noise_var_avg.fill_(phi)
    return result


def dp_adam(
    params: Sequence[Tensor],
    grad_samples: Sequence[Tensor | None] | None,
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    step: int,
    key: NoiseKey | int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    summed_grads: Sequence[Tensor | None] | None = None,
    offset: int = 0,
    nonfinite: str = "error",
    backend: str = "auto",
) -> StepResult:
    """DP-Adam (TensorFlow Privacy / Opacus + torch.optim.Adam, SPEC 5.2), coupled L2."""
    return _adam_family(
        AdamHyper,
        params,
        grad_samples,
        exp_avgs,
        exp_avg_sqs,
        step=step,
        key=key,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        max_grad_norm=max_grad_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        summed_grads=summed_grads,
        offset=offset,
        nonfinite=nonfinite,
        backend=backend,
    )


def dp_adamw(
    params: Sequence[Tensor],
    grad_samples: Sequence[Tensor | None] | None,
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    step: int,
    key: NoiseKey | int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    summed_grads: Sequence[Tensor | None] | None = None,
    offset: int = 0,
    nonfinite: str = "error",
    backend: str = "auto",
) -> StepResult:
    """DP-AdamW (arXiv 2511.07843, Algorithm 1; SPEC 5.4): decoupled weight decay."""
    return _adam_family(
        AdamWHyper,
        params,
        grad_samples,
        exp_avgs,
        exp_avg_sqs,
        step=step,
        key=key,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        max_grad_norm=max_grad_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        summed_grads=summed_grads,
        offset=offset,
        nonfinite=nonfinite,
        backend=backend,
    )


def dp_adam_bc(
    params: Sequence[Tensor],
    grad_samples: Sequence[Tensor | None] | None,
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    noise_var_avg: Tensor,
    *,
    step: int,
    key: NoiseKey | int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    gamma: float = 1e-8,
    weight_decay: float = 0.0,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    summed_grads: Sequence[Tensor | None] | None = None,
    offset: int = 0,
    nonfinite: str = "error",
    backend: str = "auto",
) -> StepResult:
    """DP-AdamBC (Tang et al., arXiv 2312.14334; SPEC 5.3).

    ``noise_var_avg``: a one-element float tensor holding phi_{t-1} (0 at the start),
    the EMA of the noise variance Phi = (sigma C / B_e)^2; updated in place to phi_t."""
    return _adam_family(
        AdamBCHyper,
        params,
        grad_samples,
        exp_avgs,
        exp_avg_sqs,
        step=step,
        key=key,
        lr=lr,
        betas=betas,
        gamma=gamma,
        weight_decay=weight_decay,
        max_grad_norm=max_grad_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        summed_grads=summed_grads,
        offset=offset,
        nonfinite=nonfinite,
        backend=backend,
        noise_var_avg=noise_var_avg,
    )


def dp_adamw_bc(
    params: Sequence[Tensor],
    grad_samples: Sequence[Tensor | None] | None,
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    noise_var_avg: Tensor,
    *,
    step: int,
    key: NoiseKey | int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    gamma: float = 1e-8,
    weight_decay: float = 1e-2,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    summed_grads: Sequence[Tensor | None] | None = None,
    offset: int = 0,
    nonfinite: str = "error",
    backend: str = "auto",
) -> StepResult:
    """DP-AdamW-BC (arXiv 2511.07843, Algorithm 2; SPEC 5.5). ``noise_var_avg`` as in
    :func:`dp_adam_bc`."""
    return _adam_family(
        AdamWBCHyper,
        params,
        grad_samples,
        exp_avgs,
        exp_avg_sqs,
        step=step,
        key=key,
        lr=lr,
        betas=betas,
        gamma=gamma,
        weight_decay=weight_decay,
        max_grad_norm=max_grad_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        summed_grads=summed_grads,
        offset=offset,
        nonfinite=nonfinite,
        backend=backend,
        noise_var_avg=noise_var_avg,
    )


def dp_macadam(
    params: Sequence[Tensor],
    grad_samples: Sequence[Tensor | None] | None,
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    exp_vars: Sequence[Tensor],
    scales: Sequence[Tensor],
    *,
    step: int,
    key: NoiseKey | int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    gamma: float = 1e-8,
    h1: float = 1e-9,
    h2: float = 1e-6,
    variance_estimate: str = "unbiased",
    noise_multiplier: float,
    expected_batch_size: float,
    summed_grads: Sequence[Tensor | None] | None = None,
    offset: int = 0,
    nonfinite: str = "error",
    backend: str = "auto",
) -> StepResult:
    """DP-MacAdam (arXiv 2606.05435, Algorithm 1; AdaClip arXiv 1908.07643; SPEC 7).

    ``exp_vars`` (S, init 0) and ``scales`` (b, init b_init = 1/d) are float32 states like
    the params. There is no max_grad_norm: whitened rows are clipped to norm 1, and
    ``summed_grads`` (if given) are sums of clipped whitened rows."""
    beta1, beta2 = check_betas(betas)
    hyper = MacAdamHyper(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        gamma=gamma,
        h1=h1,
        h2=h2,
        variance_estimate=variance_estimate,
    )
    states = {
        "exp_avg": list(exp_avgs),
        "exp_avg_sq": list(exp_avg_sqs),
        "exp_var": list(exp_vars),
        "scale": list(scales),
    }
    return dp_step(
        hyper,
        params,
        grad_samples,
        states,
        summed_grads=summed_grads,
        step=step,
        key=key,
        max_grad_norm=1.0,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        offset=offset,
        nonfinite=nonfinite,
        backend=backend,
    )


for _f in (dp_step, dp_sgd, dp_adam, dp_adamw, dp_adam_bc, dp_adamw_bc, dp_macadam):
    _f.__doc__ += _COMMON_DOC
del _f


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
