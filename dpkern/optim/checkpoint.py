"""A DPOptimizer's checkpoints: ``state_dict`` / ``load_state_dict`` and pickling
(:class:`Checkpointing`), and their checks: the seed, a loaded state's shape, and a
state_dict validated in full before ``load_state_dict`` changes anything."""

from __future__ import annotations

from collections import defaultdict
from copy import deepcopy
from typing import Any

import torch
from torch import Tensor

from ..keys import NoiseKey, secure_key
from ..sharding import local_shard


def _check_seed(seed) -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"invalid seed={seed!r}: expected None or an int in [0, 2**64)")
    return seed


def check_state_shape(rule, name: str, value: Tensor, shape) -> None:
    """A loaded state's shape: as its StateSpec (of ``rule``) says for the parameter
    (shard); other entries (``step``) shaped like the parameter or 0-dim. Raises ValueError."""
    if name in rule.state_names:
        want = rule.state(name).shape_for(shape)
        if tuple(value.shape) != want:
            raise ValueError(
                f"state {name!r} has shape {tuple(value.shape)}, expected {want} for "
                f"the parameter (shard) of shape {tuple(shape)}"
            )
    elif value.shape != shape and value.dim() != 0:
        raise ValueError(
            f"state {name!r} has shape {tuple(value.shape)}, parameter (shard) has {tuple(shape)}"
        )


def validated_state_dict(opt, sd: dict) -> tuple[list, dict, int, int | None]:
    """What loading ``sd`` (after the pre-hooks) into the DPOptimizer ``opt`` installs:
    ``(saved_groups, new_state, step, seed)``, every value checked; nothing is changed.
    Raises: ValueError (see ``DPOptimizer.load_state_dict``)."""
    dp = sd.get("dp")
    if not isinstance(dp, dict):
        raise ValueError(
            f"load_state_dict: not a dpkern optimizer's state_dict (no 'dp' entry): a "
            f"torch.optim or Opacus DPOptimizer checkpoint cannot be loaded into "
            f"{type(opt).__name__} (its moments were built from other gradients and "
            "its step counts do not map onto dpkern's noise steps); start the DP "
            "optimizer fresh, or load a state_dict saved by a dpkern optimizer"
        )
    saved_state = sd.get("state", {})
    saved_groups = deepcopy(sd.get("param_groups", []))
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    id_to_param = {}
    for saved, group in zip(saved_groups, opt.param_groups, strict=True):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't "
                "match the size of optimizer's group"
            )
        opt.group_hyper({**group, **{k: v for k, v in saved.items() if k != "params"}})
        id_to_param.update(zip(saved["params"], group["params"], strict=True))
    step = dp.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"invalid dp step {step!r} in state dict")
    seed = _check_seed(dp.get("seed"))
    sr = dp.get("stochastic_rounding", False)  # for information (format 2 before it: absent)
    if not isinstance(sr, bool):
        raise ValueError(f"invalid dp stochastic_rounding {sr!r} in state dict: expected a bool")
    new_state = {}
    for pid, st in saved_state.items():
        if pid not in id_to_param:
            raise ValueError(f"state of parameter {pid!r} has no parameter in the groups")
        p = id_to_param[pid]
        shape = local_shard(p)[0].shape  # this rank's shard for FSDP2 DTensors
        new_state[p] = {}
        for name, value in st.items():
            if isinstance(value, Tensor):
                opt._check_state_shape(name, value, shape)
                device = "cpu" if name == "step" else p.device
                value = value.to(device=device, dtype=torch.float32).clone()
            new_state[p][name] = value
        if "step" not in new_state[p]:  # format 1: every parameter at the global step
            new_state[p]["step"] = torch.tensor(float(step), dtype=torch.float32)
        elif not 0 <= int(new_state[p]["step"]) <= step:
            raise ValueError(
                f"state 'step' {int(new_state[p]['step'])} of parameter "
                f"{pid!r} exceeds the dp step {step}"
            )
    return saved_groups, new_state, step, seed


class Checkpointing:
    """Mixin of :class:`dpkern.optim.base.DPOptimizer`: what a checkpoint or a pickle holds
    (never the secure key, the un-noised accumulated sums or ``stats``), and a resume that
    never reuses a (key, step) pair."""

    _PICKLED = (
        "_seed",
        "_dp_step",
        "_max_grad_norm",
        "_noise_multiplier",
        "_failed",
        "_expected_batch_size",
        "backend",
        "nonfinite",
        "_stochastic_rounding",
        "b_init",
    )  # never stats

    def __getstate__(self):
        # Pickling would carry the key: refused in secure mode (use state_dict()).
        if self.secure:
            raise TypeError(
                f"{type(self).__name__} in secure mode cannot be pickled or "
                "deep-copied: the noise key must not leave the process; "
                "use state_dict() / load_state_dict()"
            )
        state = super().__getstate__()
        state.update({k: v for k, v in self.__dict__.items() if k in self._PICKLED})
        state["_accum"] = {}
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_stochastic_rounding", False)  # (pickled before the option)
        self._batch_failed = None
        self._accum_max_grad_norm = None
        self.stats = {"steps": 0, "samples": 0, "clipped_samples": 0, "nonfinite_samples": 0}
        if getattr(self, "_seed", None) is not None:
            self._key = NoiseKey(self._seed)  # (the key itself is never pickled)

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state_dict plus a ``"dp"`` entry: the noise step count, the
        privacy arguments and ``stochastic_rounding`` (for information: loading keeps the
        constructor's) and, in reproducible mode only, the seed. Never the secure key, the
        accumulation buffers or ``stats`` (exact data-dependent counts).

        Raises: StepInterrupted after a step failed midway."""
        self._check_usable()
        sd = super().state_dict()
        dp = {
            "step": self._dp_step,
            "max_grad_norm": self.max_grad_norm,
            "noise_multiplier": self.noise_multiplier,
            "expected_batch_size": self.expected_batch_size,
            "stochastic_rounding": self.stochastic_rounding,
            "format": 2,
        }
        if self._seed is not None:
            dp["seed"] = self._seed
        sd["dp"] = dp
        return sd

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore states (kept float32 whatever the parameter dtype) and step counts.

        Follows torch.optim's order: load-state-dict pre-hooks, then validation and
        installation, then post-hooks (what they write stays). The constructor's
        ``max_grad_norm``, ``noise_multiplier``, ``expected_batch_size`` (as Opacus
        does) and ``stochastic_rounding`` are kept: recalibrating sigma at a resume
        takes effect. Secure mode draws a fresh noise key, so no (key, step) pair is
        ever used twice; reproducible mode takes the checkpoint's seed. The accumulated
        logical batch (and an ended one's refusal) is dropped.

        Raises: ValueError (not a dpkern optimizer's state_dict -- e.g. torch.optim's or
        Opacus' DPOptimizer's, whose step counts and moments cannot be mapped exactly --,
        wrong groups, shapes or values). Validates before changing anything."""
        if not isinstance(state_dict, dict):
            raise ValueError(f"load_state_dict: expected a dict, got {type(state_dict).__name__}")
        sd = dict(state_dict)  # shallow copy, as torch.optim
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = pre_hook(self, sd)
            if out is not None:
                sd = out
        saved_groups, new_state, step, seed = validated_state_dict(self, sd)
        # validated: now change things
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            saved["params"] = group["params"]
            if "param_names" in group and "param_names" not in saved:
                saved["param_names"] = group["param_names"]
        self.param_groups = saved_groups
        self.state = defaultdict(dict, new_state)
        self._dp_step = step
        self._failed = None
        self._clear_accum()
        self._batch_failed = None
        if self._seed is None:
            self._key = secure_key()  # never reuse a (key, step) pair after a resume
        elif seed is not None:
            self._seed, self._key = seed, NoiseKey(seed)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
