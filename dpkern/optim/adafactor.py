"""DP-Adafactor (SPEC 10.7): torch.optim.Adafactor on the privatised gradient.

What every class shares (input, accumulation, state): :mod:`dpkern.optim.optimizers`.
"""

from __future__ import annotations

from .. import rules
from ..hyper import check_update_rms_clip
from ._docs import _DP_ARGS, _RMS_CLIP_ARG
from .base import DPOptimizer

__all__ = ["DPAdafactor"]


class DPAdafactor(DPOptimizer):
    __doc__ = (
        r"""DP-Adafactor: torch.optim.Adafactor on the privatised gradient, with an optional
    noise bias correction of its factored second moment.

    .. math::
        \begin{aligned}
        &\hat g = \big(\textstyle\sum_i c_i g_i + \sigma C z_t\big) / B_e, \quad
          w_t = t^{k}, \quad \rho_t = \min(\gamma_{lr}, 1/\sqrt t), \quad
          \alpha_t = \max(\epsilon_2, \mathrm{RMS}(\theta))\,\rho_t \\
        &\theta \leftarrow \theta (1 - \gamma_{lr}\lambda) \quad (\text{decoupled}) \\
        &\text{(}\ge\text{2-D)}\; r \leftarrow \mathrm{lerp}(r, \mathrm{mean}_{-1}\hat g^2, w_t),
          \; c \leftarrow \mathrm{lerp}(c, \mathrm{mean}_{-2}\hat g^2, w_t), \;
          V = \tilde r \tilde c^\top / \max(\mathrm{mean}(\tilde r), \epsilon_1) \\
        &\text{(}<\text{2-D)}\; v \leftarrow \mathrm{lerp}(v, \hat g^2, w_t), \; V = \tilde v \\
        &U = \hat g / \sqrt{\max(V, \epsilon_1^2)}, \quad
          \theta \leftarrow \theta - \alpha_t U / \max(1, \mathrm{RMS}(U)/d)
        \end{aligned}

    with t the parameter's own step count and :math:`\tilde x = x` or, with
    ``noise_bias_correction=True``, :math:`\tilde x = \max(x - \varphi_t, \gamma_0)` where
    :math:`\varphi_t = (1 - w_t)\varphi_{t-1} + w_t \Phi_t`,
    :math:`\Phi_t = (\sigma_t C / B_e)^2` (the noise variance in each coordinate of
    :math:`\hat g`, following a noise schedule): each row / column mean of
    :math:`\hat g^2` carries :math:`+\Phi_t`, and :math:`\varphi` is kept with
    Adafactor's own :math:`\beta_{2,t}` schedule, so :math:`\tilde r, \tilde c` estimate
    the noiseless factors (SPEC 10.7). With ``noise_multiplier=0`` and no clipping this is
    torch.optim.Adafactor (float32 parameters).

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr (float): gamma_lr >= 0, the cap of the relative step rho_t (default 1e-2).
        beta2_decay (float): k <= 0, the exponent of w_t = t^k (default -0.8).
        eps (tuple[float | None, float]): (eps1, eps2) (default (None, 1e-3)): eps1 >= 0
            floors V (as eps1^2) and mean(r); None = float32's epsilon 2^-23 (the update
            is computed in float32 whatever the parameter dtype); eps2 >= 0 floors RMS(p).
        d (float): update clipping threshold >= 1 on RMS(U) (default 1.0).
        weight_decay (float): lambda >= 0, decoupled: theta * (1 - lr lambda) (default 0).
        noise_bias_correction (bool, keyword-only): subtract phi_t from the factors
            (default False).
        gamma (float, keyword-only): gamma_0 > 0, the floor of every corrected factor
            (default 1e-8, as DP-AdamBC).
"""  # (_RMS_CLIP_ARG brings its own indentation)
        + _RMS_CLIP_ARG
        + r"""            Here U = U_hat / max(1, RMS(U_hat) / d), the update after Adafactor's
            own per-tensor clipping (so only d_u < d has an effect), and the step is
            theta (1 - lr lambda) - (alpha_t / max(1, RMS(U_hat) / d)) s U_hat. Fused
            (two passes) on backend="cpp" and "triton", as on the reference.
            Raises ValueError for a value that is not None nor a finite float > 0.
    """
        + _DP_ARGS
        + r"""
    State (float32): ``row_var`` (shape ``p.shape[:-1]``; torch.optim keeps it as
    ``(..., R, 1)``) and ``col_var`` (``p.shape[:-2] + p.shape[-1:]``; torch ``(..., 1, C)``)
    for parameters with >= 2 dimensions; below 2 dimensions ``row_var`` (``p.shape``) holds
    torch.optim's ``variance`` and ``col_var`` is an unused 0-dim zero.
    ``noise_var_avg`` (phi, 0-dim, with the correction only), ``step``. FSDP2 sharding is
    refused (ValueError): the factors are not coordinate-wise. A parameter with no elements
    is left unchanged.
    Source: Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory
    Cost", ICML 2018, arXiv 1804.04235, Algorithms 4-5; torch.optim.Adafactor; the
    correction as DP-AdamBC's (arXiv 2312.14334); SPEC 10.7.
    """
    )
    rule = rules.get("adafactor")

    def __init__(
        self,
        params,
        lr: float = 1e-2,
        beta2_decay: float = -0.8,
        eps=(None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        noise_bias_correction: bool = False,
        gamma: float = 1e-8,
        update_rms_clip: float | None = None,
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
            beta2_decay=beta2_decay,
            eps=_adafactor_eps(eps),
            d=d,
            weight_decay=weight_decay,
            noise_bias_correction=noise_bias_correction,
            gamma=gamma,
            update_rms_clip=check_update_rms_clip(update_rms_clip),
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

    def _hyper(self, group: dict):
        """torch.optim's ``eps`` pair becomes ``eps1, eps2``; the other fields by name."""
        group = dict(group)
        if "eps" in group:
            group["eps1"], group["eps2"] = _adafactor_eps(group.pop("eps"))
        return super()._hyper(group)


def _adafactor_eps(eps) -> tuple:
    """torch.optim.Adafactor's ``eps = (eps1 or None, eps2)``. Raises ValueError."""
    if not isinstance(eps, (tuple, list)) or len(eps) != 2:
        raise ValueError(f"invalid eps={eps!r}: expected a pair (eps1 or None, eps2)")
    return tuple(eps)
