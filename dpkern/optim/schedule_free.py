"""Schedule-free DP-SGD and DP-AdamW (SPEC 10.8), and ``_ScheduleFree``, their shared
part (the per-group scalars, the train / eval swaps).

What every class shares (input, accumulation, state): :mod:`dpkern.optim.optimizers`.
"""

from __future__ import annotations

import torch

from .. import rules
from ..sharding import local_shard
from ._docs import _DP_ARGS, _SF_ARGS, _SF_MATH, _SF_NOTES
from .base import DPOptimizer

__all__ = ["DPSGDScheduleFree", "DPAdamWScheduleFree"]


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
