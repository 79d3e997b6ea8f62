"""DP-Adagrad (SPEC 10.2): torch.optim.Adagrad on the privatised gradient.

What every class shares (input, accumulation, state): :mod:`dpkern.optim.optimizers`.
"""

from __future__ import annotations

from .. import rules
from ._docs import _DP_ARGS
from .base import DPOptimizer

__all__ = ["DPAdagrad"]


class DPAdagrad(DPOptimizer):
    __doc__ = (
        r"""DP-Adagrad: torch.optim.Adagrad on the privatised gradient, coupled L2 decay,
    with an optional noise bias correction of the accumulator.

    .. math::
        \begin{aligned}
        &\hat g = \big(\textstyle\sum_i c_i g_i + \sigma C z_t\big) / B_e
          \quad (c_i = \min(1, C / (\lVert g_i \rVert + 10^{-6}))), \qquad
          g = \hat g + \lambda \theta \\
        &\tilde\gamma = \gamma / (1 + (t - 1) \eta), \qquad
          s \leftarrow s + g^2 \quad (s_0 = \text{initial\_accumulator\_value}) \\
        &\theta \leftarrow \theta - \tilde\gamma g / (\sqrt{s} + \epsilon), \text{ or }
          \theta \leftarrow \theta - \tilde\gamma g / (\sqrt{\max(s - \varphi_t, \gamma_0)}
          + \epsilon) \text{ (noise bias correction)}
        \end{aligned}

    with :math:`\varphi_t = \varphi_{t-1} + \Phi_t` (cumulative, like s),
    :math:`\Phi_t = (\sigma_t C / B_e)^2` the variance of the noise in each coordinate of
    :math:`\hat g` at the parameter's step t (sigma_t the noise multiplier in force then).
    Without the correction s absorbs :math:`\sum_t \Phi_t` (t Phi at constant sigma) and
    the step shrinks like :math:`1/\sqrt{t\Phi}`; the deterministic s_0 is not subtracted
    (SPEC 10.2). With ``noise_multiplier=0`` and no clipping this is torch.optim.Adagrad
    on the mean gradient.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr (float): learning rate gamma >= 0 (default 1e-2).
        lr_decay (float): eta >= 0 (default 0); t is the parameter's own step.
        weight_decay (float): lambda >= 0, coupled L2 (default 0).
        initial_accumulator_value (float): s_0 >= 0 (default 0).
        eps (float): epsilon > 0, added outside the sqrt (default 1e-10).
        noise_bias_correction (bool): subtract phi_t inside the sqrt (default False).
        gamma (float): gamma_0 > 0, the floor of the corrected s - phi_t (default 1e-8).
    """
        + _DP_ARGS
        + r"""
    State: ``sum`` (s, float32 shaped like the parameter, filled with
    ``initial_accumulator_value`` at the parameter's first step); ``noise_var_avg``
    (phi_t, 0-dim float32, with ``noise_bias_correction``); ``step``. torch.optim's names.
    Source: Duchi, Hazan & Singer 2011, "Adaptive Subgradient Methods for Online Learning
    and Stochastic Optimization", JMLR 12, Figure 1 (diagonal); torch.optim.Adagrad;
    SPEC 10.2.
    """
    )
    rule = rules.get("adagrad")

    def __init__(
        self,
        params,
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        noise_bias_correction: bool = False,
        gamma: float = 1e-8,
        *,
        max_grad_norm: float,
        noise_multiplier: float,
        expected_batch_size: float,
        seed=None,
        backend: str = "auto",
        nonfinite: str = "error",
        stochastic_rounding: bool = False,
    ):
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            eps=eps,
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
