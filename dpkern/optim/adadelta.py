"""DP-Adadelta (SPEC 10.5): torch.optim.Adadelta on the privatised gradient.

What every class shares (input, accumulation, state): :mod:`dpkern.optim.optimizers`.
"""

from __future__ import annotations

from .. import rules
from ._docs import _DP_ARGS
from .base import DPOptimizer

__all__ = ["DPAdadelta"]


class DPAdadelta(DPOptimizer):
    __doc__ = (
        r"""DP-Adadelta: torch.optim.Adadelta on the privatised gradient, coupled L2 decay,
    optionally with the noise variance removed from both of its EMAs.

    .. math::
        \begin{aligned}
        &\hat g = \big(\textstyle\sum_i c_i g_i + \sigma C z_t\big) / B_e, \quad
          g = \hat g + \lambda \theta \\
        &v \leftarrow \rho v + (1-\rho) g^2, \quad
          c = \sqrt{u + \epsilon} / \sqrt{v + \epsilon}, \quad \Delta = c\, g, \quad
          u \leftarrow \rho u + (1-\rho) \Delta^2, \quad
          \theta \leftarrow \theta - \eta \Delta
        \end{aligned}

    (:math:`c` uses the previous :math:`u`). With ``noise_bias_correction=True``,
    :math:`c = \sqrt{\max(u - \psi, 0) + \epsilon} / \sqrt{\max(v - \varphi, \gamma_0)
    + \epsilon}` where :math:`\varphi \leftarrow \rho\varphi + (1-\rho)\Phi_t` (a scalar
    per parameter), :math:`\psi \leftarrow \rho\psi + (1-\rho) c^2 \Phi_t` (per
    element, after the update), :math:`\Phi_t = (\sigma_t C / B_e)^2` the noise variance
    of each coordinate of :math:`\hat g` at this step (a noise schedule is followed).
    With ``noise_multiplier=0``, no clipping and the correction off, this is
    torch.optim.Adadelta on the mean gradient.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr (float): eta >= 0, scales the update (default 1.0, torch.optim's).
        rho (float): rho in [0, 1], the decay of both EMAs (default 0.9).
        eps (float): epsilon > 0, added inside both square roots (default 1e-6).
        weight_decay (float): lambda >= 0, coupled L2 (default 0).
        noise_bias_correction (bool): subtract the noise variance (default False).
        gamma (float): gamma_0 > 0, floor of the corrected square_avg (default 1e-8).
    """
        + _DP_ARGS
        + r"""
    State: ``square_avg`` (v), ``acc_delta`` (u), float32 shaped like the parameter;
    with the correction also ``acc_delta_noise_var`` (psi, float32, parameter-shaped) and
    ``noise_var_avg`` (phi, 0-dim); ``step``.
    Source: Zeiler 2012, "ADADELTA: An Adaptive Learning Rate Method", arXiv 1212.5701,
    Algorithm 1, as torch.optim.Adadelta computes it; the correction is dpkern's (no
    published prior), SPEC 10.5.
    """
    )
    rule = rules.get("adadelta")

    def __init__(
        self,
        params,
        lr=1.0,
        rho=0.9,
        eps=1e-6,
        weight_decay=0.0,
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
            rho=rho,
            eps=eps,
            weight_decay=weight_decay,
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
