"""The checks of a DPOptimizer checkpoint: the seed, a loaded state's shape, and a
state_dict validated in full before ``load_state_dict`` changes anything."""

from __future__ import annotations

from copy import deepcopy

import torch
from torch import Tensor

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
