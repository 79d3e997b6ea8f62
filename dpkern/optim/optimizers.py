"""torch.optim front-ends: DPSGD, DPAdam, DPAdamBC, DPAdamW, DPAdamWBC, DPMacAdam.

Each is a ``torch.optim.Optimizer`` constructed like its torch.optim twin plus keyword-only
privacy arguments; ``step()`` consumes Opacus' ``p.grad_sample`` (shape ``[B, *p.shape]``)
and runs one fused DP step (SPEC sections 1-7) through :mod:`dpkern.functional`. A class is
its constructor's signature, its docstring and its ``rule`` (the spec in
:mod:`dpkern.rules`); state and policy live in :class:`dpkern.optim.base.DPOptimizer`, the
math in the functional layer and the backends.

Gradient accumulation: call ``accumulate()`` after each micro-batch's backward (it folds
the clipped per-sample gradients into an fp32 buffer and consumes ``grad_sample``), then
``step()`` after the last one: noise is added once per logical batch. The accumulation
buffers (un-noised sums of private gradients) are never put in a ``state_dict``.

SPEC: ``python -m dpkern.spec`` prints the contract (docs/SPEC.md in the source tree).
"""

from __future__ import annotations

from .. import rules
from ..hyper import check_positive
from .base import DPOptimizer

__all__ = [
    "DPSGD",
    "DPAdam",
    "DPAdamBC",
    "DPAdamW",
    "DPAdamWBC",
    "DPMacAdam",
    "DPAdafactor",
]

_DP_ARGS = r"""
    Privacy arguments (keyword-only):
        max_grad_norm (float): C > 0, the L2 bound on each sample's gradient over ALL
            parameters (flat clipping, c_i = min(1, C / (||g_i|| + 1e-6)), SPEC 2).
        noise_multiplier (float): sigma >= 0; the noise on the clipped sum has standard
            deviation sigma * C. Get it from :func:`dpkern.accounting.get_noise_multiplier`.
        expected_batch_size (float): B_e > 0, the normaliser: sample_rate * dataset size
            under Poisson sampling (the real batch may be 0 or larger).
        seed (int or None): None (default) = private: the noise key comes from os.urandom
            and never leaves the process (not in state_dict, repr, pickle or logs). An int
            in [0, 2**64) IS the noise key: the run is reproducible and NOT private (anyone
            with the seed and the weights subtracts the noise exactly); it is saved in
            state_dict. Seed initialisation and sampling elsewhere, not here.
        backend (str): "auto" (triton for CUDA, cpp for CPU if built, else torch), "torch"
            (the reference), "triton" or "cpp".
        nonfinite (str): "error" (default): a sample with a NaN/Inf gradient raises
            FloatingPointError and nothing is updated; "zero": such samples are dropped
            (their rows contribute nothing) and counted in ``stats``.

    Input: ``step()`` reads ``p.grad_sample`` (``[B, *p.shape]``, any float dtype, from
    ``opacus.GradSampleModule`` or :func:`dpkern.grad_sample.compute_grad_sample`), never
    ``p.grad``, and consumes it (a second step over the same samples raises); or the
    clipped sums given to ``accumulate_clipped`` (ghost clipping). Parameters: float32,
    bfloat16 or float16 (updated in fp32, rounded once); states: float32.

    Raises: ValueError for invalid hyper-parameters (at construction, naming the value)
    and for bad, stale or missing per-sample gradients at ``step()``; FloatingPointError
    (non-finite gradients, nonfinite="error"). A failed step changes nothing.
    ``stats`` holds exact counts in memory only (never in state_dict). "SPEC n" is a
    section of the contract, docs/SPEC.md (``python -m dpkern.spec`` prints it).
"""


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
        )

    def _rule_step(self, hyper, state, new):
        # SGD's t only says "first momentum step" (buf = g): true for a buffer created now,
        # as torch.optim.SGD starts a missing buffer with the gradient itself
        return 1 if "momentum_buffer" in new else super()._rule_step(hyper, state, new)


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
        )


_ADAM_MATH = r"""
    .. math::
        \begin{aligned}
        &\hat g = \big(\textstyle\sum_i c_i g_i + \sigma C z_t\big) / B_e
          \quad (c_i = \min(1, C / (\lVert g_i \rVert + 10^{-6}))) \\
        &m \leftarrow \beta_1 m + (1-\beta_1) g, \quad v \leftarrow \beta_2 v + (1-\beta_2) g^2,
          \quad \hat m = m / (1-\beta_1^t), \quad \hat v = v / (1-\beta_2^t)
        \end{aligned}

    with t the parameter's own step count (``state["step"]``, as torch.optim).
"""

_ADAM_ARGS = r"""
    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr (float): learning rate gamma (default 1e-3).
        betas (tuple[float, float]): (beta1, beta2) in [0, 1) (default (0.9, 0.999)).
"""


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
        max_grad_norm,
        noise_multiplier,
        expected_batch_size,
        seed=None,
        backend="auto",
        nonfinite="error",
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
        )


_BC_MATH = r"""
    and the denominator :math:`\sqrt{\max(\hat v - \hat\varphi, \gamma_0)}` where
    :math:`\varphi \leftarrow \beta_2 \varphi + (1-\beta_2)\Phi_t`,
    :math:`\Phi_t = (\sigma C / B_e)^2` (the noise variance in each coordinate of
    :math:`\hat g`) and :math:`\hat\varphi = \varphi / (1 - \beta_2^t)`.
"""


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
        max_grad_norm,
        noise_multiplier,
        expected_batch_size,
        seed=None,
        backend="auto",
        nonfinite="error",
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
        )


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


# --------------------------------------------------------------------------------------
# DP-Adafactor (SPEC 10.7)
# --------------------------------------------------------------------------------------
class DPAdafactor(DPOptimizer):
    __doc__ = (
        r"""DP-Adafactor: torch.optim.Adafactor on the privatised gradient, with an optional
    noise bias correction of its factored second moment.

    .. math::
        \begin{aligned}
        &\hat g = \big(\textstyle\sum_i c_i g_i + \sigma C z_t\big) / B_e, \quad
          w_t = t^{c}, \quad \rho_t = \min(\gamma_{lr}, 1/\sqrt t), \quad
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
        beta2_decay (float): c <= 0, w_t = t^c (default -0.8).
        eps (tuple[float | None, float]): (eps1, eps2) (default (None, 1e-3)): eps1 >= 0
            floors V (as eps1^2) and mean(r); None = float32's epsilon 2^-23 (the update
            is computed in float32 whatever the parameter dtype); eps2 >= 0 floors RMS(p).
        d (float): update clipping threshold >= 1 on RMS(U) (default 1.0).
        weight_decay (float): lambda >= 0, decoupled: theta * (1 - lr lambda) (default 0).
        noise_bias_correction (bool, keyword-only): subtract phi_t from the factors
            (default False).
        gamma (float, keyword-only): gamma_0 > 0, the floor of every corrected factor
            (default 1e-8, as DP-AdamBC).
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
        max_grad_norm: float,
        noise_multiplier: float,
        expected_batch_size: float,
        seed=None,
        backend: str = "auto",
        nonfinite: str = "error",
    ):
        defaults = dict(
            lr=lr,
            beta2_decay=beta2_decay,
            eps=_adafactor_eps(eps),
            d=d,
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
