"""DP-Lion (SPEC 10.4): lion_pytorch.Lion on the privatised gradient.

What every class shares (input, accumulation, state): :mod:`dpkern.optim.optimizers`.
"""

from __future__ import annotations

from .. import rules
from ._docs import _DP_ARGS
from .adam import _AdamFamily

__all__ = ["DPLion"]


class DPLion(_AdamFamily):
    __doc__ = (
        r"""DP-Lion: lion_pytorch.Lion (EvoLved Sign Momentum) on the privatised gradient.

    .. math::
        \begin{aligned}
        &\hat g = \big(\textstyle\sum_i c_i g_i + \sigma C z_t\big) / B_e
          \quad (c_i = \min(1, C / (\lVert g_i \rVert + 10^{-6}))) \\
        &\theta \leftarrow \theta (1 - \gamma\lambda) \quad (\text{decoupled weight decay}) \\
        &\theta \leftarrow \theta - \gamma \,\mathrm{sign}(\beta_1 m + (1-\beta_1)\hat g),
          \quad m \leftarrow \beta_2 m + (1-\beta_2)\hat g
        \end{aligned}

    with :math:`\mathrm{sign}(0) = 0` (torch.sign; also 0 for NaN). Every coordinate moves
    by exactly lr (or 0) per step, whatever the noise: the noise only decides signs. There
    is no second moment, so no noise bias correction.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr (float): learning rate gamma >= 0 (default 1e-4, lion_pytorch's; typically 3-10x
            below AdamW's).
        betas (tuple[float, float]): (beta1, beta2) in [0, 1): beta1 interpolates the
            update's direction, beta2 is the momentum's decay (default (0.9, 0.99)).
        weight_decay (float): lambda >= 0, decoupled: theta <- theta (1 - lr lambda)
            (default 0).
        noise_bias_correction (bool, keyword-only): only False (the default) is accepted;
            True raises ValueError (nothing to correct).
    """
        + _DP_ARGS
        + r"""
    State: ``exp_avg`` (m, float32, shaped like the parameter), ``step``.
    With ``noise_multiplier=0`` and no clipping, the trajectory is lion_pytorch.Lion's on
    the mean gradient (its ``decoupled_weight_decay`` and ``use_triton`` options are not
    offered). DDP and FSDP2 (element-wise state).
    Source: Chen et al., "Symbolic Discovery of Optimization Algorithms", NeurIPS 2023,
    arXiv 2302.06675, Algorithm 2; lion_pytorch.Lion (``update_fn``); SPEC 10.4.
    """
    )
    rule = rules.get("lion")

    def __init__(
        self,
        params,
        lr=1e-4,
        betas=(0.9, 0.99),
        weight_decay=0.0,
        *,
        noise_bias_correction=False,
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
            weight_decay=weight_decay,
            noise_bias_correction=noise_bias_correction,
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            seed=seed,
            backend=backend,
            nonfinite=nonfinite,
            stochastic_rounding=stochastic_rounding,
        )
