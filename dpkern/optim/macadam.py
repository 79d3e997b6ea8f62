"""DP-MacAdam (SPEC 7): per-coordinate whitening before clipping, noise in the whitened
space.

What every class shares (input, accumulation, state): :mod:`dpkern.optim.optimizers`.
"""

from __future__ import annotations

from .. import rules
from ..hyper import check_positive
from ._docs import _DP_ARGS
from .adam import _AdamFamily

__all__ = ["DPMacAdam"]


class DPMacAdam(_AdamFamily):
    __doc__ = (
        r"""DP-MacAdam: per-coordinate whitening before clipping, noise in the whitened
    space, and the same mean/variance estimates drive clipping and the update.

    .. math::
        \begin{aligned}
        &w_i = (g_i - \hat m_{t-1}) / b, \quad \bar w_i = w_i / \max(1, \lVert w_i \rVert),
          \quad \tilde w = (\textstyle\sum_i \bar w_i + \sigma z_t) / B_e \\
        &\tilde g = b \odot \tilde w + \hat m_{t-1}; \text{ Adam moments on } \tilde g;
          \quad \theta \leftarrow \theta - \gamma \hat m / (\sqrt{\hat v} + \gamma_0) \\
        &S \leftarrow \beta_1 S + (1-\beta_1) u, \quad
          \hat S = \mathrm{clamp}(S/\kappa_t - b^2\sigma^2/B_e^2, h_1, h_2), \quad
          b \leftarrow \hat S^{1/4} (\textstyle\sum_j \hat S_j^{1/2})^{1/2}
        \end{aligned}

    There is no ``max_grad_norm``: the bound is 1 in the whitened space. All parameters
    share one step count (b is a global function): a parameter group added, or a
    parameter unfrozen, after the first step is refused.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr (float): learning rate (default 1e-3). betas: (beta1, beta2) (default (0.9, 0.999)).
        gamma (float): gamma_0 > 0, added outside the sqrt (default 1e-8).
        h1, h2 (float): clamp of the variance estimate (defaults 1e-9, 1e-6).
        b_init (float or None): initial scale b; None = 1/d, d = number of trainable
            coordinates at the first step.
        variance_estimate (str): "unbiased" (default), "paper" or "code" (SPEC 7).
    """
        + _DP_ARGS.replace(
            """        max_grad_norm (float): C > 0, the L2 bound on each sample's gradient over ALL
            parameters (flat clipping, c_i = min(1, C / (||g_i|| + 1e-6)), SPEC 2).
""",
            "",
        )
        + r"""
    State: ``exp_avg``, ``exp_avg_sq``, ``exp_var`` (S), ``scale`` (b), all float32; ``step``.
    Source: arXiv 2606.05435, Algorithm 1 (DP-MacAdam); AdaClip, Pichapati et al.,
    arXiv 1908.07643; SPEC 7.
    """
    )
    rule = rules.get("macadam")

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        gamma=1e-8,
        h1=1e-9,
        h2=1e-6,
        b_init=None,
        variance_estimate="unbiased",
        *,
        noise_multiplier,
        expected_batch_size,
        seed=None,
        backend="auto",
        nonfinite="error",
        stochastic_rounding=False,
    ):
        if b_init is not None:
            check_positive("b_init", b_init)
        self.b_init = b_init
        super().__init__(
            params,
            lr,
            betas,
            gamma=gamma,
            h1=h1,
            h2=h2,
            variance_estimate=variance_estimate,
            max_grad_norm=1.0,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            seed=seed,
            backend=backend,
            nonfinite=nonfinite,
            stochastic_rounding=stochastic_rounding,
        )

    def _fresh_state(self, p, n_total):
        st = super()._fresh_state(p, n_total)
        st["scale"].fill_(self.b_init if self.b_init is not None else 1.0 / max(n_total, 1))
        return st

    def _check_rule_steps(self, groups) -> None:
        for grp in groups:
            if grp.step != self._dp_step + 1:
                raise ValueError(
                    f"DP-MacAdam keeps one step count for all parameters (its scale b is a "
                    f"global function of them): {grp.names[0]} is at its own step "
                    f"{grp.step} while the optimizer is at step {self._dp_step + 1}; add "
                    "every parameter group and unfreeze every parameter before the first "
                    "step"
                )
