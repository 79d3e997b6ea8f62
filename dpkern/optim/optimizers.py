"""torch.optim front-ends: DPSGD, DPAdam, DPAdamBC, DPAdamW, DPAdamWBC, DPMacAdam, and the
families of SPEC section 10 (DPRMSprop, DPAdagrad, DPRAdam, DPLion, DPAdadelta,
DPAdEMAMix, DPAdafactor, DPSGDScheduleFree, DPAdamWScheduleFree).

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

import torch

from .. import rules
from ..hyper import check_betas3, check_positive, check_update_rms_clip
from ..sharding import local_shard
from .base import DPOptimizer

__all__ = [
    "DPSGD",
    "DPAdam",
    "DPAdamBC",
    "DPAdamW",
    "DPAdamWBC",
    "DPMacAdam",
    "DPAdadelta",
    "DPAdEMAMix",
    "DPRAdam",
    "DPLion",
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
        stochastic_rounding (bool): False (default): bfloat16 parameters are rounded to
            nearest even on store; True: stochastically, E[round(x)] = x, so updates
            smaller than a bf16 ulp are kept on average (SPEC 3.2: Philox stream 2 of the
            noise key). float32 and float16 parameters are unaffected.

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

_RMS_CLIP_ARG = r"""        update_rms_clip (float or None, keyword-only): d_u > 0, finite: the update
            direction U of every parameter (all param groups together) is scaled by
            1 / max(1, RMS / d_u), RMS = sqrt(sum of U^2 over all N elements / N) in
            float64, so the update's RMS over the whole model is at most d_u; weight
            decay is not scaled. None (default): off. Every param group must hold the same
            value (ValueError at step()). Post-processing of the noisy gradient: the DP
            guarantee is unchanged. Source: the global variant of StableAdamW's per-tensor
            update clipping (Wortsman et al. 2023, arXiv 2304.13013, Algorithm 2) and of
            Adafactor's (Shazeer & Stern 2018, Section 6); SPEC 10.9.
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
        stochastic_rounding: bool = False,
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
            stochastic_rounding=stochastic_rounding,
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
        stochastic_rounding=False,
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
            stochastic_rounding=stochastic_rounding,
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
        + _RMS_CLIP_ARG
        + r"""            Here U = m_hat / (sqrt(v_hat) + eps), and the step is
            theta (1 - lr lambda) - (lr s) m_hat / (sqrt(v_hat) + eps).
            Raises ValueError for a value that is not None nor a finite float > 0.
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
        update_rms_clip=None,
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
            update_rms_clip=check_update_rms_clip(update_rms_clip),
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            seed=seed,
            backend=backend,
            nonfinite=nonfinite,
            stochastic_rounding=stochastic_rounding,
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
        stochastic_rounding=False,
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
            stochastic_rounding=stochastic_rounding,
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
        + _RMS_CLIP_ARG
        + r"""            Here U = m_hat / sqrt(max(v_hat - phi_hat, gamma_0)).
            Raises ValueError for a value that is not None nor a finite float > 0.
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
        update_rms_clip=None,
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
            gamma=gamma,
            weight_decay=weight_decay,
            update_rms_clip=check_update_rms_clip(update_rms_clip),
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            seed=seed,
            backend=backend,
            nonfinite=nonfinite,
            stochastic_rounding=stochastic_rounding,
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


# --------------------------------------------------------------------------------------
# Schedule-free DP-SGD and DP-AdamW (SPEC 10.8)
# --------------------------------------------------------------------------------------
__all__ += ["DPSGDScheduleFree", "DPAdamWScheduleFree"]

_SF_MATH = r"""
    .. math::
        \begin{aligned}
        &\gamma_t = \gamma \min(1, t / T_w), \quad \gamma^{\max}_t = \max(\gamma_t,
          \gamma^{\max}_{t-1}), \quad w_t = t^r (\gamma^{\max}_t)^{p_w}, \quad
          c_t = w_t / \textstyle\sum_{s \le t} w_s \\
        &y \leftarrow (1 - c_t)\, y + c_t z + \gamma_t (\beta (1 - c_t) - 1)\, u, \qquad
          z \leftarrow z - \gamma_t u
        \end{aligned}

    where the parameters hold y in train mode (gradients are taken at y), z is the base
    sequence (z = y at the parameter's first step) and x = (y - (1 - beta) z) / beta the
    average that is evaluated: ``eval()`` sets the parameters to x, ``train()`` back to y
    (element-wise, no noise and no privacy cost). t counts the group's steps; the
    per-group scalars ``k`` (steps), ``weight_sum``, ``lr_max``, ``train_mode`` and
    ``scheduled_lr`` live in the param group, as in ``schedulefree``, so ``state_dict()``
    round-trips them.
"""

_SF_ARGS = r"""        weight_decay (float): lambda >= 0, evaluated at y (default 0).
        warmup_steps (int): T_w >= 0, linear learning-rate warmup (default 0).
        r (float): r >= 0, polynomial weighting of the average (default 0).
        weight_lr_power (float): p_w >= 0, the average's weights grow with lr_max^p_w
            (default 2).
"""

_SF_NOTES = r"""
    Modes: like ``schedulefree``, the optimizer starts in eval mode: call ``train()``
    before the first step (and after every ``eval()``), and ``eval()`` before evaluating
    or saving the model. ``step()`` / ``accumulate()`` in eval mode raise RuntimeError
    (nothing consumed or changed).

    Every trainable parameter of a group is updated at every step (DP noises them all), so
    a parameter's own step equals its group's ``k + 1``; a parameter that joins a group
    later (unfrozen after the group's first step) is refused with ValueError: put it in a
    new param group (``add_param_group``: its own averaging from step 1). A group whose
    parameters are all frozen does not advance. Data parallelism (DDP, lockstep) works as
    for every rule; FSDP2 works (every state is shaped like the parameter, or a scalar),
    ``train()`` / ``eval()`` act on each rank's shard.
"""


class _ScheduleFree(DPOptimizer):
    """The schedule-free classes' shared part: the per-group scalars (in ``param_groups``,
    ``schedulefree``'s names), the train / eval swaps, and the refusal of a step in eval
    mode or of a parameter whose own step is not its group's."""

    def __init__(self, params, defaults, **dp):
        defaults = dict(
            defaults,
            k=0,
            train_mode=False,
            weight_sum=0.0,
            lr_max=-1.0,
            scheduled_lr=0.0,
        )
        super().__init__(params, defaults, **dp)

    @staticmethod
    def _beta(group) -> float:
        raise NotImplementedError

    def _swap(self, to_train: bool) -> None:
        for group in self.param_groups:
            if bool(group["train_mode"]) == to_train:
                continue
            beta = self._beta(group)
            weight = 1 - beta if to_train else 1 - 1 / beta
            for p in group["params"]:
                z = self.state.get(p, {}).get("z")
                if z is not None:
                    local = local_shard(p)[0]  # this rank's shard for FSDP2 DTensors
                    local.copy_(local.float().lerp_(z.to(local.device), weight))
            group["train_mode"] = to_train

    @torch.no_grad()
    def eval(self) -> None:
        """Set the parameters to x (the average, what is evaluated and saved)."""
        self._swap(False)

    @torch.no_grad()
    def train(self) -> None:
        """Set the parameters to y (where gradients are taken) before training steps."""
        self._swap(True)

    def _check_can_release(self) -> None:
        super()._check_can_release()
        for gi, group in enumerate(self.param_groups):
            if not group["train_mode"]:
                raise RuntimeError(
                    f"{type(self).__name__} is not in train mode (param group {gi}): the "
                    "parameters hold the average x, not y; call optimizer.train() before "
                    "the training steps (and optimizer.eval() before evaluating or saving), "
                    "as schedulefree requires"
                )

    def _groups(self, for_accumulate: bool = False):
        out = super()._groups(for_accumulate)
        where = {p: gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        for grp, owners in zip(out[0], out[1], strict=True):
            gi = where[owners[0]]
            k = self.param_groups[gi]["k"]
            if grp.step != k + 1:
                raise ValueError(
                    f"{type(self).__name__}: {grp.names[0]} is at its own step {grp.step} "
                    f"but its param group at step {k + 1}: schedule-free's averaging "
                    "(weight_sum, lr_max, k) is kept per param group, so a parameter "
                    "that joins a group after its first step cannot be averaged exactly; "
                    "put it in a param group of its own (add_param_group)"
                )
        return out

    def _commit(self, groups, owners, new_states) -> None:
        super()._commit(groups, owners, new_states)
        stepped = {p for params in owners for p in params}
        for group in self.param_groups:
            if not any(p in stepped for p in group["params"]):
                continue  # every parameter frozen: the group does not advance
            lr, lr_max, weight_sum, _ = rules.schedule_free_scalars(
                self.group_hyper(group), group["k"] + 1
            )
            group.update(scheduled_lr=lr, lr_max=lr_max, weight_sum=weight_sum)
            group["k"] = group["k"] + 1

    def load_state_dict(self, state_dict) -> None:
        """torch.optim's, with the groups' ``k`` and ``train_mode`` checked first
        (ValueError; nothing changes)."""
        groups = state_dict.get("param_groups", []) if isinstance(state_dict, dict) else []
        for gi, g in enumerate(groups):
            k, mode = g.get("k", 0), g.get("train_mode", False)
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise ValueError(f"invalid k={k!r} in param group {gi}: expected an int >= 0")
            if not isinstance(mode, bool):
                raise ValueError(f"invalid train_mode={mode!r} in param group {gi}")
        super().load_state_dict(state_dict)


class DPSGDScheduleFree(_ScheduleFree):
    __doc__ = (
        r"""Schedule-free DP-SGD: ``schedulefree.SGDScheduleFree`` on the privatised
    gradient (no learning-rate schedule; the iterate average is the implicit schedule).
    """
        + _SF_MATH.replace(r"\beta", r"\mu")
        + r"""
    with :math:`\hat g = (\sum_i c_i g_i + \sigma C z_t) / B_e` and
    :math:`u = \hat g + \lambda y` (weight decay coupled at y).

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr (float): learning rate gamma (default 1.0, schedulefree's).
        momentum (float): mu in (0, 1), the interpolation y = (1 - mu) z + mu x
            (default 0.9).
"""
        + _SF_ARGS
        + r"""        noise_bias_correction (bool): must be False: there is no second moment to
            correct (True raises ValueError).
    """
        + _DP_ARGS
        + _SF_NOTES
        + r"""
    State: ``z`` (float32, parameter-shaped), ``step``; per group ``k``, ``weight_sum``,
    ``lr_max``, ``train_mode``, ``scheduled_lr``.
    Source: Defazio et al. 2024, "The Road Less Scheduled", arXiv 2405.15682,
    section 2 (schedule-free SGD); ``schedulefree.SGDScheduleFree``; SPEC 10.8.
    """
    )
    rule = rules.get("sgd_schedule_free")

    def __init__(
        self,
        params,
        lr: float = 1.0,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        r: float = 0.0,
        weight_lr_power: float = 2.0,
        noise_bias_correction: bool = False,
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
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            r=r,
            weight_lr_power=weight_lr_power,
            noise_bias_correction=noise_bias_correction,
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

    @staticmethod
    def _beta(group) -> float:
        return group["momentum"]


class DPAdamWScheduleFree(_ScheduleFree):
    __doc__ = (
        r"""Schedule-free DP-AdamW: ``schedulefree.AdamWScheduleFree`` on the privatised
    gradient, optionally with the noise bias correction of the second moment.
    """
        + _SF_MATH.replace(r"\beta", r"\beta_1")
        + r"""
    with :math:`v \leftarrow \beta_2 v + (1-\beta_2)\hat g^2`,
    :math:`\hat v = v / (1 - \beta_2^t)` and
    :math:`u = \hat g / (\sqrt{\hat v} + \epsilon) + \lambda y` (weight decay at y, not
    normalised); with ``noise_bias_correction=True`` the denominator is
    :math:`\sqrt{\max(\hat v - \hat\varphi, \gamma_0)}`,
    :math:`\varphi \leftarrow \beta_2\varphi + (1-\beta_2)\Phi_t`,
    :math:`\Phi_t = (\sigma_t C / B_e)^2`, :math:`\hat\varphi = \varphi / (1 - \beta_2^t)`.
    There is no first moment (the interpolation with beta1 is the momentum).

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr (float): learning rate gamma (default 0.0025, schedulefree's).
        betas (tuple[float, float]): beta1 in (0, 1) (the interpolation), beta2 in [0, 1)
            (the second moment) (default (0.9, 0.999)).
        eps (float): epsilon > 0, added outside the sqrt (default 1e-8).
"""
        + _SF_ARGS
        + r"""        noise_bias_correction (bool): subtract the noise variance from the second
            moment (default False).
        gamma (float): gamma_0 > 0, the floor of the corrected denominator's radicand
            (default 1e-8; used with noise_bias_correction only, in place of eps).
    """
        + _DP_ARGS
        + _SF_NOTES
        + r"""
    State: ``z``, ``exp_avg_sq`` (float32, parameter-shaped), ``noise_var_avg`` (phi,
    0-dim, with noise_bias_correction), ``step``; per group ``k``, ``weight_sum``,
    ``lr_max``, ``train_mode``, ``scheduled_lr``.
    Source: Defazio et al. 2024, "The Road Less Scheduled", arXiv 2405.15682,
    Algorithm 1 (schedule-free AdamW); ``schedulefree.AdamWScheduleFree``; the noise bias
    correction of Tang et al., arXiv 2312.14334 (DP-AdamBC); SPEC 10.8.
    """
    )
    rule = rules.get("adamw_schedule_free")

    def __init__(
        self,
        params,
        lr: float = 0.0025,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        r: float = 0.0,
        weight_lr_power: float = 2.0,
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
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            r=r,
            weight_lr_power=weight_lr_power,
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

    @staticmethod
    def _beta(group) -> float:
        return group["betas"][0]


__all__ += ["DPRMSprop", "DPAdagrad"]  # SPEC 10.1, 10.2


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


# --------------------------------------------------------------------------------------
# DP-Adadelta (SPEC 10.5)
# --------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------
# DP-AdEMAMix (SPEC 10.6)
# --------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------
# DP-RAdam (SPEC 10.3)
# --------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------
# DP-Lion (SPEC 10.4)
# --------------------------------------------------------------------------------------
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
