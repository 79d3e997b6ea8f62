"""One DP step of one update rule: :func:`dp_step` for any rule of the registry, and one
``dp_<name>`` per built-in rule with torch.optim's ``_functional`` argument lists."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from .. import rules
from ..hyper import (
    AdamBCHyper,
    AdamHyper,
    AdamWBCHyper,
    AdamWHyper,
    DPStep,
    Hyper,
    MacAdamHyper,
    SGDHyper,
    check_betas,
)
from ..keys import NoiseKey
from .groups import (
    Group,
    StepResult,
    check_nonfinite,
    check_privacy,
    dp_step_groups,
    noise_var_ema,
)


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
    stochastic_rounding: bool = False,
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
        stochastic_rounding=stochastic_rounding,
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
        stochastic_rounding: round bfloat16 params stochastically on store (SPEC 3.2,
            the rounding stream of ``key`` at ``step``); default False: to nearest even.
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
    stochastic_rounding: bool = False,
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
        stochastic_rounding=stochastic_rounding,
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
    stochastic_rounding=False,
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
        stochastic_rounding=stochastic_rounding,
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
    stochastic_rounding: bool = False,
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
        stochastic_rounding=stochastic_rounding,
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
    stochastic_rounding: bool = False,
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
        stochastic_rounding=stochastic_rounding,
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
    stochastic_rounding: bool = False,
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
        stochastic_rounding=stochastic_rounding,
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
    stochastic_rounding: bool = False,
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
        stochastic_rounding=stochastic_rounding,
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
    stochastic_rounding: bool = False,
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
        stochastic_rounding=stochastic_rounding,
    )


for _f in (dp_step, dp_sgd, dp_adam, dp_adamw, dp_adam_bc, dp_adamw_bc, dp_macadam):
    _f.__doc__ += _COMMON_DOC
del _f
