"""The functional :class:`dpkern.functional.Group` lists of one DP step, built from an
optimizer's ``param_groups``, states and ``p.grad_sample`` (validated on the way).

Nothing here changes the optimizer: tensors created for parameters seen for the first time
are returned, and :class:`dpkern.optim.base.DPOptimizer` commits them on success only. The
optimizer's hooks (``_fresh_state``, ``_init_states``, ``_rule_step``, ``_grad_sample``,
``_check_rule_steps``) let a family change what is built."""

from __future__ import annotations

import torch

from .. import functional as F
from ..guards import NO_FRESH_GRAD_SAMPLE, ONLY_SUMMED_GRAD
from ..hyper import Hyper
from ..sharding import local_shard

__all__ = ["build_groups", "noise_var_avg", "param_noise_var", "step_of", "unused_states"]


def step_of(state: dict) -> int:
    """A parameter's own step count (0 before its first step)."""
    step = state.get("step")
    return 0 if step is None else int(step)


def unused_states(rule, hyper: Hyper) -> set[str]:
    """State names the update does not use with these hyper-parameters (never
    allocated, passed to the backends as None): ``StateSpec.needed``."""
    return set(rule.state_names) - set(rule.needed_states(hyper))


def param_noise_var(state: dict) -> float:
    """The parameter's phi_{t-1} (noise-bias-corrected rules; 0.0 for the others)."""
    phi = state.get("noise_var_avg")
    return 0.0 if phi is None else float(phi)


def noise_var_avg(opt, hyper: Hyper, prev: float, t: int) -> float:
    """phi_t from the parameter's phi_{t-1} at its step t, by the rule's recursion
    (``RuleSpec.noise_var_ema``), for the groups that correct (0.0 otherwise)."""
    if not opt.rule.corrects(hyper):
        return 0.0
    noise_var = F.noise_var(opt.max_grad_norm, opt.noise_multiplier, opt.expected_batch_size)
    return opt.rule.next_noise_var(hyper, prev, noise_var, t)


def build_groups(opt, for_accumulate: bool = False):
    """Build the functional Groups of ``opt`` (a DPOptimizer) over its trainable params;
    validate the grad_sample rules.

    Each param group becomes one functional Group per distinct (own step, phi) of its
    parameters (parameters added or unfrozen later have their own bias corrections).

    Returns (groups, owners, new_states, new_buffers): ``owners[k]`` the parameters of
    ``groups[k]``; tensors created for params seen for the first time, to commit into
    ``opt.state`` / ``opt._accum`` on success only."""
    trainable = [
        (gi, pi, p)
        for gi, g in enumerate(opt.param_groups)
        for pi, p in enumerate(g["params"])
        if p.requires_grad
    ]
    n_total = sum(p.numel() for _, _, p in trainable)  # global numel for DTensors
    any_gs = any(getattr(p, "grad_sample", None) is not None for _, _, p in trainable)
    if not any_gs and (for_accumulate or not opt._accum):
        if opt._dp_step > 0:
            raise ValueError(NO_FRESH_GRAD_SAMPLE)
        if any(p.grad is not None for _, _, p in trainable):
            raise ValueError(ONLY_SUMMED_GRAD)  # before any step: no earlier grad_sample
        raise ValueError(
            "no parameter has a grad_sample: per-sample gradients were "
            "never computed (wrap the model with opacus.GradSampleModule "
            "or call dpkern.grad_sample.compute_grad_sample); an empty batch "
            "is grad_sample tensors with B = 0, not their absence"
        )
    new_states, new_buffers = {}, {}
    groups, owners, offset = [], [], 0
    for gi, group in enumerate(opt.param_groups):
        hyper = opt.group_hyper(group)
        unused = unused_states(opt.rule, hyper)
        buckets: dict[tuple, dict] = {}
        for pi, p in enumerate(group["params"]):
            if not p.requires_grad:
                continue
            name = f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})"
            local, start = local_shard(p, name)
            if local.shape != p.shape:
                name = f"{name[:-1]}, local shard {tuple(local.shape)})"
                if not opt.rule.fsdp:
                    raise ValueError(
                        f"{name}: {opt.rule.title} keeps states that are not shaped "
                        "like the parameter; they cannot be sharded coordinate-wise"
                    )
            gs = opt._grad_sample(p, name)
            if gs is None and any_gs and p.grad is not None:
                raise ValueError(
                    f"{name}: has .grad but no grad_sample (was it created "
                    "outside the module wrapped for per-sample gradients?)"
                )
            state = opt.state.get(p)
            new = {}
            if not state:
                new = {k: v for k, v in opt._fresh_state(local, n_total).items() if k not in unused}
                state = new
            elif any(k not in state and k not in unused for k in opt.rule.state_names):
                # a state needed from now on (e.g. momentum switched on): zeros
                fresh = opt._fresh_state(local, n_total)
                new = {
                    k: fresh[k] for k in opt.rule.state_names if k not in state and k not in unused
                }
                state = {**state, **new}
            if new:
                opt._init_states(hyper, new)
                new_states[p] = new
            t_p = opt._rule_step(hyper, state, new)
            key = (t_p, param_noise_var(state))
            b = buckets.get(key)
            if b is None:
                b = buckets[key] = {
                    "params": [],
                    "gss": [],
                    "summed": [],
                    "offsets": [],
                    "names": [],
                    "owners": [],
                    "states": {s: [] for s in opt.rule.kernel_state_names},
                }
            for sname in b["states"]:
                b["states"][sname].append(state.get(sname))  # None: unused by the rule
            buf = opt._accum.get(p)
            if buf is None and for_accumulate:
                buf = new_buffers[p] = torch.zeros_like(
                    local, dtype=torch.float32, memory_format=torch.contiguous_format
                )
            b["params"].append(local)
            b["gss"].append(gs)
            b["summed"].append(buf)
            b["offsets"].append(offset + start)
            b["names"].append(name)
            b["owners"].append(p)
            offset += p.numel()
        for (t_p, phi_prev), b in buckets.items():
            groups.append(
                F.Group(
                    hyper,
                    b["params"],
                    b["gss"],
                    b["summed"],
                    b["states"],
                    b["offsets"],
                    b["names"],
                    noise_var_avg(opt, hyper, phi_prev, t_p),
                    step=t_p,
                )
            )
            owners.append(b["owners"])
    if not groups:
        raise ValueError("the optimizer owns no trainable parameter")
    opt._check_rule_steps(groups)
    return groups, owners, new_states, new_buffers
