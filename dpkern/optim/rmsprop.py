"""DP-RMSprop (SPEC 10.1): torch.optim.RMSprop on the privatised gradient.

What every class shares (input, accumulation, state): :mod:`dpkern.optim.optimizers`.
"""

from __future__ import annotations

from .. import rules
from ._docs import _DP_ARGS
from .base import DPOptimizer

__all__ = ["DPRMSprop"]


class DPRMSprop(DPOptimizer):
    __doc__ = (
        r"""DP-RMSprop: torch.optim.RMSprop on the privatised gradient, coupled L2 decay,
    with an optional noise bias correction of the second moment.

    .. math::
        \begin{aligned}
        &\hat g = \big(\textstyle\sum_i c_i g_i + \sigma C z_t\big) / B_e
          \quad (c_i = \min(1, C / (\lVert g_i \rVert + 10^{-6}))), \qquad
          g = \hat g + \lambda \theta \\
        &v \leftarrow \alpha v + (1 - \alpha) g^2; \qquad
          \text{centered: } \bar g \leftarrow \alpha \bar g + (1 - \alpha) g \\
        &a = \sqrt{v} + \epsilon, \text{ or } \sqrt{v - \bar g^2} + \epsilon
          \text{ (centered), or } \sqrt{\max(v - \varphi_t, \gamma_0)} + \epsilon
          \text{ (noise bias correction)} \\
        &b \leftarrow \mu b + g / a, \ \theta \leftarrow \theta - \gamma b
          \quad (\mu > 0), \qquad \text{else } \theta \leftarrow \theta - \gamma g / a
        \end{aligned}

    with :math:`\varphi_t = \alpha \varphi_{t-1} + (1 - \alpha) \Phi_t`,
    :math:`\Phi_t = (\sigma_t C / B_e)^2` the variance of the noise in each coordinate of
    :math:`\hat g` at the parameter's step t (sigma_t the noise multiplier in force then,
    so a noise schedule is followed): :math:`E[v_t]` is the noiseless EMA of
    :math:`g^2` plus :math:`\varphi_t` (SPEC 10.1). With ``noise_multiplier=0`` and no
    clipping this is torch.optim.RMSprop on the mean gradient.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr (float): learning rate gamma >= 0 (default 1e-2).
        alpha (float): smoothing constant in [0, 1) (default 0.99).
        eps (float): epsilon > 0, added outside the sqrt (default 1e-8).
        weight_decay (float): lambda >= 0, coupled L2 (default 0).
        momentum (float): mu >= 0 (default 0).
        centered (bool): divide by the centred second moment v - grad_avg^2 (default
            False). Not with ``noise_bias_correction`` (ValueError, SPEC 10.1).
        noise_bias_correction (bool): subtract phi_t inside the sqrt (default False).
        gamma (float): gamma_0 > 0, the floor of the corrected v - phi_t (default 1e-8).
    """
        + _DP_ARGS
        + r"""
    State: ``square_avg`` (v), ``momentum_buffer`` (when momentum > 0), ``grad_avg``
    (when centered), all float32 shaped like the parameter; ``noise_var_avg`` (phi_t,
    0-dim float32, with ``noise_bias_correction``); ``step``. torch.optim's names.
    Raises: ValueError as above, and for centered=True with noise_bias_correction=True.
    Source: Tieleman & Hinton 2012, Coursera "Neural Networks for Machine Learning",
    Lecture 6.5; Graves 2013, arXiv 1308.0850, eqs. 38-41 (centered); torch.optim.RMSprop;
    SPEC 10.1.
    """
    )
    rule = rules.get("rmsprop")

    def __init__(
        self,
        params,
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
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
            alpha=alpha,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            centered=centered,
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
