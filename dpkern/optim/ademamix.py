"""DP-AdEMAMix (SPEC 10.6): AdEMAMix on the privatised gradient.

What every class shares (input, accumulation, state): :mod:`dpkern.optim.optimizers`.
"""

from __future__ import annotations

from .. import rules
from ..hyper import check_betas3
from ._docs import _DP_ARGS
from .base import DPOptimizer

__all__ = ["DPAdEMAMix"]


class DPAdEMAMix(DPOptimizer):
    __doc__ = (
        r"""DP-AdEMAMix: AdEMAMix (a fast and a slow EMA of the gradient over Adam's
    denominator) on the privatised gradient, decoupled weight decay.

    .. math::
        \begin{aligned}
        &\hat g = \big(\textstyle\sum_i c_i g_i + \sigma C z_t\big) / B_e \\
        &m_1 \leftarrow \beta_1 m_1 + (1-\beta_1)\hat g, \quad
          m_2 \leftarrow \beta_{3,t} m_2 + (1-\beta_{3,t})\hat g, \quad
          \nu \leftarrow \beta_2 \nu + (1-\beta_2)\hat g^2 \\
        &\hat m_1 = m_1 / (1-\beta_1^t), \quad \hat\nu = \nu / (1-\beta_2^t), \quad
          \theta \leftarrow \theta - \eta\Big(\frac{\hat m_1 + \alpha_t m_2}
          {\sqrt{\hat\nu} + \epsilon} + \lambda\theta\Big)
        \end{aligned}

    with t the parameter's own step. With ``t_alpha_beta3 = T``, the paper's warm-up:
    :math:`\alpha_t = \min(t\alpha/T, \alpha)` and :math:`\beta_{3,t} =
    \min(\exp(\ln\beta_1 \ln\beta_3 / ((1 - t/T)\ln\beta_3 + (t/T)\ln\beta_1)),
    \beta_3)`; without it :math:`\alpha_t = \alpha`, :math:`\beta_{3,t} = \beta_3`.
    With ``noise_bias_correction=True`` the denominator is
    :math:`\sqrt{\max(\hat\nu - \hat\varphi, \gamma_0)} + \epsilon`, where
    :math:`\varphi \leftarrow \beta_2\varphi + (1-\beta_2)\Phi_t`,
    :math:`\hat\varphi = \varphi / (1-\beta_2^t)`, :math:`\Phi_t = (\sigma_t C / B_e)^2`
    (DP-AdamBC's correction, following a noise schedule).

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr (float): eta >= 0 (default 1e-3).
        betas (tuple[float, float, float]): (beta1, beta2, beta3), each in [0, 1)
            (default (0.9, 0.999, 0.9999)): the fast EMA, the second moment, the slow EMA.
        alpha (float): alpha >= 0, the slow EMA's weight (default 5.0).
        eps (float): epsilon > 0 (default 1e-8).
        weight_decay (float): lambda >= 0, decoupled, scaled by lr (default 0).
        t_alpha_beta3 (int or None): T, the warm-up steps of alpha and beta3 (default
            None: no warm-up; 0 means the same). Needs beta1 > 0 and beta3 > 0.
        noise_bias_correction (bool): subtract the noise variance (default False).
        gamma (float): gamma_0 > 0, floor of the corrected second moment (default 1e-8).
    """
        + _DP_ARGS
        + r"""
    State: ``exp_avg`` (m1), ``exp_avg_slow`` (m2), ``exp_avg_sq`` (nu), float32 shaped
    like the parameter; with the correction ``noise_var_avg`` (phi, 0-dim); ``step``.
    Source: Pagliardini, Ablin, Grangier, "The AdEMAMix Optimizer: Better, Faster, Older",
    arXiv 2409.03137, Algorithm 1 and the schedulers of Section 3; SPEC 10.6.
    """
    )
    rule = rules.get("ademamix")

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999, 0.9999),
        alpha=5.0,
        eps=1e-8,
        weight_decay=0.0,
        t_alpha_beta3=None,
        noise_bias_correction=False,
        gamma=1e-8,
        *,
        max_grad_norm,
        noise_multiplier,
        expected_batch_size,
        seed=None,
        backend="auto",
        nonfinite="error",
        stochastic_rounding=False,
    ):
        defaults = dict(
            lr=lr,
            betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas,
            alpha=alpha,
            eps=eps,
            weight_decay=weight_decay,
            t_alpha_beta3=t_alpha_beta3,
            noise_bias_correction=noise_bias_correction,
            gamma=gamma,
        )
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

    def _hyper(self, group):
        """As the base's, with AdEMAMix's ``betas`` triple (beta1, beta2, beta3)."""
        if "betas" in group:
            b1, b2, b3 = check_betas3(group["betas"])
            group = {k: v for k, v in group.items() if k != "betas"}
            group.update(beta1=b1, beta2=b2, beta3=b3)
        return super()._hyper(group)
