"""DP-SGD (SPEC 5.1): torch.optim.SGD on the privatised gradient.

What every class shares (input, accumulation, state): :mod:`dpkern.optim.optimizers`.
"""

from __future__ import annotations

from .. import rules
from ._docs import _DP_ARGS
from .base import DPOptimizer

__all__ = ["DPSGD"]


class DPSGD(DPOptimizer):
    __doc__ = (
        r"""DP-SGD: torch.optim.SGD on the privatised gradient.

    .. math::
        \begin{aligned}
        &c_i = \min(1, C / (\lVert g_i \rVert + 10^{-6})), \quad
          \hat g = \big(\textstyle\sum_i c_i g_i + \sigma C z_t\big) / B_e \\
        &g \leftarrow \hat g + \lambda \theta \quad (\text{weight decay, coupled}) \\
        &b \leftarrow \mu b + (1 - \tau) g \quad (b = g \text{ at the parameter's first step}) \\
        &g \leftarrow g + \mu b \text{ (nesterov) or } b; \qquad \theta \leftarrow \theta - \gamma g
        \end{aligned}

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr (float): learning rate gamma (default 1e-3).
        momentum (float): mu (default 0). dampening (float): tau (default 0).
        weight_decay (float): lambda, coupled L2 (default 0).
        nesterov (bool): Nesterov momentum (default False).
    """
        + _DP_ARGS
        + r"""
    State: ``momentum_buffer`` (float32, when momentum != 0), ``step``.
    Source: Abadi et al. 2016, "Deep Learning with Differential Privacy", Algorithm 1;
    SPEC 5.1.
    """
    )

    rule = rules.get("sgd")

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
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
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
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

    def _rule_step(self, hyper, state, new):
        # SGD's t only says "first momentum step" (buf = g): true for a buffer created now,
        # as torch.optim.SGD starts a missing buffer with the gradient itself
        return 1 if "momentum_buffer" in new else super()._rule_step(hyper, state, new)
