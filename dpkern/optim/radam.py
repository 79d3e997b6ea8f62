"""DP-RAdam (SPEC 10.3): torch.optim.RAdam (rectified Adam) on the privatised gradient.

What every class shares (input, accumulation, state): :mod:`dpkern.optim.optimizers`.
"""

from __future__ import annotations

from .. import rules
from ._docs import _ADAM_ARGS, _ADAM_MATH, _DP_ARGS
from .adam import _AdamFamily

__all__ = ["DPRAdam"]


class DPRAdam(_AdamFamily):
    __doc__ = (
        r"""DP-RAdam: torch.optim.RAdam (rectified Adam) on the privatised gradient, with
    an optional noise bias correction of its second moment.
    """
        + _ADAM_MATH
        + r"""
    Weight decay: coupled :math:`g = \hat g + \lambda\theta` before the moments, or with
    ``decoupled_weight_decay`` :math:`\theta \leftarrow \theta (1 - \gamma\lambda)` first.
    With :math:`\rho_\infty = 2/(1-\beta_2) - 1` and
    :math:`\rho_t = \rho_\infty - 2t\beta_2^t/(1-\beta_2^t)` (host-side scalars):

    .. math::
        \begin{aligned}
        &\rho_t \le 5 \text{ (warm-up)}: \quad \theta \leftarrow \theta - \gamma \hat m \\
        &\rho_t > 5: \quad r_t = \sqrt{\frac{(\rho_t-4)(\rho_t-2)\rho_\infty}
          {(\rho_\infty-4)(\rho_\infty-2)\rho_t}}, \quad
          \theta \leftarrow \theta - \gamma r_t \hat m
          \frac{\sqrt{1-\beta_2^t}}{\sqrt{v} + \epsilon}
        \end{aligned}

    (epsilon is added to :math:`\sqrt{v}`, not to :math:`\sqrt{\hat v}`, as torch.optim.RAdam
    does). With ``noise_bias_correction=True`` the rectified step is
    :math:`\theta \leftarrow \theta - \gamma r_t \hat m /
    \sqrt{\max(\hat v - \hat\varphi, \gamma_0)}` (no epsilon, as DP-AdamBC), where
    :math:`\varphi \leftarrow \beta_2 \varphi + (1-\beta_2)\Phi_t` at every step, warm-up
    included, :math:`\Phi_t = (\sigma_t C / B_e)^2` with the noise multiplier in force at
    step t, and :math:`\hat\varphi = \varphi / (1 - \beta_2^t)`. The warm-up steps do not
    read v, so they are the same with or without the correction.
    """
        + _ADAM_ARGS
        + r"""        eps (float): epsilon > 0, added to sqrt(v) (default 1e-8; unused by the
            corrected step).
        weight_decay (float): lambda >= 0 (default 0), coupled L2 unless
            ``decoupled_weight_decay``.
        decoupled_weight_decay (bool): AdamW-style decay (default False).
        noise_bias_correction (bool, keyword-only): subtract the noise variance from the
            second moment in the rectified step (default False).
        gamma (float, keyword-only): gamma_0 > 0, the floor inside the corrected sqrt
            (default 1e-8, DP-AdamBC's).
    """
        + _DP_ARGS
        + r"""
    State: ``exp_avg``, ``exp_avg_sq`` (float32, shaped like the parameter),
    ``noise_var_avg`` (phi, a 0-dim float32, only with ``noise_bias_correction``), ``step``.
    With ``noise_multiplier=0`` and no clipping, the trajectory is torch.optim.RAdam's on
    the mean gradient. DDP and FSDP2 (element-wise states and a per-parameter scalar).
    Source: Liu et al., "On the Variance of the Adaptive Learning Rate and Beyond", ICLR
    2020, arXiv 1908.03265, Algorithm 2; torch.optim.RAdam; the correction follows Tang et
    al., arXiv 2312.14334 (DP-AdamBC); SPEC 10.3.
    """
    )
    rule = rules.get("radam")

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        decoupled_weight_decay=False,
        *,
        noise_bias_correction=False,
        gamma=1e-8,
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
            decoupled_weight_decay=decoupled_weight_decay,
            noise_bias_correction=noise_bias_correction,
            gamma=gamma,
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            seed=seed,
            backend=backend,
            nonfinite=nonfinite,
            stochastic_rounding=stochastic_rounding,
        )
