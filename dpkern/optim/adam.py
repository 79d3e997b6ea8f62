"""DP-Adam, DP-AdamW, DP-AdamBC and DP-AdamW-BC (SPEC 5.2-5.5), and ``_AdamFamily``, the
shared constructor of the classes with torch.optim.Adam's ``(params, lr, betas)``.

What every class shares (input, accumulation, state): :mod:`dpkern.optim.optimizers`.
"""

from __future__ import annotations

from .. import rules
from ..hyper import check_update_rms_clip
from ._docs import _ADAM_ARGS, _ADAM_MATH, _BC_MATH, _DP_ARGS, _RMS_CLIP_ARG
from .base import DPOptimizer

__all__ = ["DPAdam", "DPAdamBC", "DPAdamW", "DPAdamWBC"]


class _AdamFamily(DPOptimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        *,
        max_grad_norm: float,
        noise_multiplier: float,
        expected_batch_size: float,
        seed=None,
        backend: str = "auto",
        nonfinite: str = "error",
        stochastic_rounding: bool = False,
        **extra,
    ):
        defaults = dict(lr=lr, betas=tuple(betas), **extra)
        super().__init__(
            params,
            defaults,
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            seed=seed,
            backend=backend,
            nonfinite=nonfinite,
            stochastic_rounding=stochastic_rounding,
        )


class DPAdam(_AdamFamily):
    __doc__ = (
        r"""DP-Adam: torch.optim.Adam on the privatised gradient, coupled L2 decay.
    """
        + _ADAM_MATH
        + r"""
    then :math:`g = \hat g + \lambda\theta` before the moments, and
    :math:`\theta \leftarrow \theta - \gamma \hat m / (\sqrt{\hat v} + \epsilon)`.
    """
        + _ADAM_ARGS
        + r"""        eps (float): epsilon > 0 (default 1e-8).
        weight_decay (float): lambda, coupled L2 (default 0).
    """
        + _DP_ARGS
        + r"""
    State: ``exp_avg``, ``exp_avg_sq`` (float32), ``step``.
    Source: Abadi et al. 2016 (DP-SGD) with Kingma & Ba 2015 (Adam), as in TensorFlow
    Privacy and Opacus; SPEC 5.2.
    """
    )
    rule = rules.get("adam")

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        *,
        max_grad_norm,
        noise_multiplier,
        expected_batch_size,
        seed=None,
        backend="auto",
        nonfinite="error",
        stochastic_rounding=False,
    ):
        super().__init__(
            params,
            lr,
            betas,
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            seed=seed,
            backend=backend,
            nonfinite=nonfinite,
            stochastic_rounding=stochastic_rounding,
        )


class DPAdamW(_AdamFamily):
    __doc__ = (
        r"""DP-AdamW: torch.optim.AdamW on the privatised gradient (decoupled decay).
    First the decoupled decay :math:`\theta \leftarrow \theta (1 - \gamma\lambda)`, then
    the moments below on :math:`g = \hat g`, and
    :math:`\theta \leftarrow \theta - \gamma \hat m / (\sqrt{\hat v} + \epsilon)`.
    """
        + _ADAM_MATH
        + r"""
    """
        + _ADAM_ARGS
        + r"""        eps (float): epsilon > 0 (default 1e-8).
        weight_decay (float): lambda, decoupled (default 1e-2, torch.optim.AdamW's).
"""  # (_RMS_CLIP_ARG brings its own indentation)
        + _RMS_CLIP_ARG
        + r"""            Here U = m_hat / (sqrt(v_hat) + eps), and the step is
            theta (1 - lr lambda) - (lr s) m_hat / (sqrt(v_hat) + eps).
            Raises ValueError for a value that is not None nor a finite float > 0.
    """
        + _DP_ARGS
        + r"""
    State: ``exp_avg``, ``exp_avg_sq`` (float32), ``step``.
    Source: arXiv 2511.07843, Algorithm 1 (DP-AdamW); Loshchilov & Hutter 2019; SPEC 5.4.
    """
    )
    rule = rules.get("adamw")

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        *,
        update_rms_clip=None,
        max_grad_norm,
        noise_multiplier,
        expected_batch_size,
        seed=None,
        backend="auto",
        nonfinite="error",
        stochastic_rounding=False,
    ):
        super().__init__(
            params,
            lr,
            betas,
            eps=eps,
            weight_decay=weight_decay,
            update_rms_clip=check_update_rms_clip(update_rms_clip),
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            seed=seed,
            backend=backend,
            nonfinite=nonfinite,
            stochastic_rounding=stochastic_rounding,
        )


class DPAdamBC(_AdamFamily):
    __doc__ = (
        r"""DP-AdamBC: DP-Adam with the noise variance removed from the second moment.
    """
        + _ADAM_MATH
        + _BC_MATH
        + r"""
    Coupled L2: :math:`g = \hat g + \lambda\theta`;
    :math:`\theta \leftarrow \theta - \gamma \hat m / \sqrt{\max(\hat v - \hat\varphi, \gamma_0)}`.
    """
        + _ADAM_ARGS
        + r"""        gamma (float): gamma_0 > 0, the floor inside the sqrt (default 1e-8).
        weight_decay (float): lambda, coupled L2 (default 0).
    """
        + _DP_ARGS
        + r"""
    State: ``exp_avg``, ``exp_avg_sq`` (float32), ``noise_var_avg`` (phi, 0-dim), ``step``.
    Source: Tang et al., "DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You Apply Bias
    Correction)", AAAI 2024, arXiv 2312.14334, Algorithm 1; SPEC 5.3.
    """
    )
    rule = rules.get("adam_bc")

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        gamma=1e-8,
        weight_decay=0.0,
        *,
        max_grad_norm,
        noise_multiplier,
        expected_batch_size,
        seed=None,
        backend="auto",
        nonfinite="error",
        stochastic_rounding=False,
    ):
        super().__init__(
            params,
            lr,
            betas,
            gamma=gamma,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            seed=seed,
            backend=backend,
            nonfinite=nonfinite,
            stochastic_rounding=stochastic_rounding,
        )


class DPAdamWBC(_AdamFamily):
    __doc__ = (
        r"""DP-AdamW-BC: DP-AdamW with DP-AdamBC's denominator.
    First the decoupled decay :math:`\theta \leftarrow \theta (1 - \gamma\lambda)`, then
    the moments below on :math:`g = \hat g`,
    """
        + _ADAM_MATH
        + _BC_MATH
        + r"""
    """
        + _ADAM_ARGS
        + r"""        gamma (float): gamma_0 > 0, the floor inside the sqrt (default 1e-8).
        weight_decay (float): lambda, decoupled (default 1e-2).
"""  # (_RMS_CLIP_ARG brings its own indentation)
        + _RMS_CLIP_ARG
        + r"""            Here U = m_hat / sqrt(max(v_hat - phi_hat, gamma_0)).
            Raises ValueError for a value that is not None nor a finite float > 0.
    """
        + _DP_ARGS
        + r"""
    State: ``exp_avg``, ``exp_avg_sq`` (float32), ``noise_var_avg`` (phi, 0-dim), ``step``.
    Source: arXiv 2511.07843, Algorithm 2 (DP-AdamW-BC); SPEC 5.5.
    """
    )
    rule = rules.get("adamw_bc")

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        gamma=1e-8,
        weight_decay=1e-2,
        *,
        update_rms_clip=None,
        max_grad_norm,
        noise_multiplier,
        expected_batch_size,
        seed=None,
        backend="auto",
        nonfinite="error",
        stochastic_rounding=False,
    ):
        super().__init__(
            params,
            lr,
            betas,
            gamma=gamma,
            weight_decay=weight_decay,
            update_rms_clip=check_update_rms_clip(update_rms_clip),
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            seed=seed,
            backend=backend,
            nonfinite=nonfinite,
            stochastic_rounding=stochastic_rounding,
        )
