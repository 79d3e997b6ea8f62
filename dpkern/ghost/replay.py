"""What makes the per-sample replay of a module without ghost rules
(``instantiate_unsupported=True``, :func:`.backward.generic_rows`) compute exactly what its
recorded call computed, and the checks that refuse a call where it would not:

- the replay runs the module's own ``forward`` (:func:`call_forward`: without its hooks)
  on the arguments its call received; a module with a user forward (pre-)hook, or a call
  under a global one, is refused (:func:`hooks_problem`): a pre-hook may set state the
  forward reads (weight_norm: a replay without it reads stale values, one through it
  applies an argument change twice), and a forward hook's operations run in the module's
  call (:mod:`.ops` counts them as the replay's) but after its recorded output;
- a random draw during the call (dropout in training mode, ``torch.rand*``,
  ``bernoulli``, ...) cannot be replayed one sample at a time (other shapes, other
  draws): found by the torch calls the capture's mode sees (:func:`draws_random`) and by
  the default CPU / CUDA generators' states around the call (:func:`rng_state`), refused;
- a tensor computed from the module's parameters inside its call that reaches the loss
  other than through the call's output (kept as an attribute; the output detached):
  found on the autograd graph of the losses (:func:`.graph.replay_leaks`), refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as module_mod

__all__ = [
    "call_forward",
    "draws_random",
    "hooks_problem",
    "random_why",
    "rng_state",
    "versions",
]

_T = torch.Tensor
#: torch calls that always draw random numbers (when the capture's mode sees them)
_RANDOM = frozenset(
    f
    for f in (
        torch.rand,
        torch.rand_like,
        torch.randn,
        torch.randn_like,
        torch.randint,
        torch.randint_like,
        torch.randperm,
        torch.bernoulli,
        torch.multinomial,
        torch.normal,
        torch.poisson,
        getattr(torch, "binomial", None),
        _T.bernoulli,
        _T.bernoulli_,
        _T.multinomial,
        _T.normal_,
        _T.uniform_,
        _T.random_,
        _T.exponential_,
        _T.geometric_,
        _T.cauchy_,
        _T.log_normal_,
        F.gumbel_softmax,
        nn.init.uniform_,
        nn.init.normal_,
        nn.init.trunc_normal_,
        nn.init.kaiming_uniform_,
        nn.init.kaiming_normal_,
        nn.init.xavier_uniform_,
        nn.init.xavier_normal_,
        nn.init.orthogonal_,
        nn.init.sparse_,
    )
    if f is not None
)
#: calls that draw only with ``p > 0`` and in training: func -> (position of p, of the
#: training flag, its keyword, its default); rrelu: no p (its bounds), training off
_DROPOUTS = {
    F.dropout: (1, 2, "training", True),
    F.alpha_dropout: (1, 2, "training", False),
    F.feature_alpha_dropout: (1, 2, "training", False),
    F.dropout1d: (1, 2, "training", True),
    F.dropout2d: (1, 2, "training", True),
    F.dropout3d: (1, 2, "training", True),
    torch.dropout: (1, 2, "train", None),
    torch.alpha_dropout: (1, 2, "train", None),
    torch.feature_dropout: (1, 2, "train", None),
    torch.feature_alpha_dropout: (1, 2, "train", None),
    torch.native_dropout: (1, 2, "train", None),
    F.rrelu: (None, 3, "training", False),
    torch.rrelu: (None, 3, "training", False),
}


def _arg(args, kwargs, pos, name, default):
    if name in kwargs:
        return kwargs[name]
    return args[pos] if pos is not None and len(args) > pos else default


def draws_random(func, args, kwargs) -> bool:
    """Whether the torch call ``func(*args, **kwargs)`` draws random numbers: the rand
    family, in-place samplers, ``bernoulli``, ``multinomial``, any call given a
    ``generator``, dropout with ``p > 0`` in training, rrelu in training."""
    if func in _RANDOM or kwargs.get("generator") is not None:
        return True
    spec = _DROPOUTS.get(func)
    if spec is None:
        return False
    p_pos, t_pos, t_name, t_default = spec
    p = 1.0 if p_pos is None else _arg(args, kwargs, p_pos, "p", 0.5)
    training = _arg(args, kwargs, t_pos, t_name, t_default)
    return bool(training) and not (isinstance(p, (int, float)) and p == 0)


def random_why(what: str) -> str:
    return (
        f"drew random numbers ({what}): the replay, one sample at a time, would draw "
        "others (the per-sample gradients of another function). Put the module in eval() "
        "mode (dropout off), keep the randomness out of modules without ghost rules, or "
        "use modules with ghost rules"
    )


def rng_state() -> tuple:
    """The states of the default CPU generator and of the initialised CUDA devices'
    generators (compared around a module call: a change is a random draw); an entry is
    None where the state cannot be read (during CUDA graph capture)."""
    with torch._C.DisableTorchFunction():
        states = [torch.default_generator.get_state()]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for g in torch.cuda.default_generators:
                try:
                    states.append(g.get_state())
                except RuntimeError:
                    states.append(None)
    return tuple(states)


def rng_changed(before: tuple, after: tuple) -> bool:
    with torch._C.DisableTorchFunction():
        return len(before) != len(after) or any(
            a is not None and b is not None and not torch.equal(a, b) for a, b in zip(before, after)
        )


def hooks_problem(module: nn.Module, ours: set) -> str | None:
    """Why the hooks of ``module`` make its call differ from the replay of its forward
    (``ours``: the ids of the capture's hook handles), or None (checked when the call
    returns)."""
    pre = [k for k in module._forward_pre_hooks if k not in ours]
    if pre or module_mod._global_forward_pre_hooks:
        where = "a global forward pre-hook" if not pre else "a forward pre-hook"
        return (
            f"has {where} (the replay runs its forward alone: a pre-hook may set state "
            "the forward reads, e.g. weight_norm, and cannot be replayed soundly; remove "
            "the hook, or fold it into the forward)"
        )
    if module_mod._global_forward_hooks:
        return (
            "ran under a global forward hook (its operations would be counted as the "
            "replay's but are not replayed)"
        )
    if any(k not in ours for k in module._forward_hooks):
        return (
            "has a forward hook (the replay runs its forward alone, and a hook's use of "
            "the parameters or of the output would be missed or taken twice; remove the "
            "hook, or fold it into the forward)"
        )
    return None


def call_forward(module: nn.Module, params: dict, args: tuple, kwargs: dict) -> Tensor:
    """``module.forward(*args, **kwargs)`` with ``params`` in place of its parameters
    (as :func:`torch.func.functional_call`, but without the module's own hooks, the
    capture's included: a module with user hooks is refused, see :func:`hooks_problem`)."""
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(module, params, tie_weights=True):
        return module.forward(*args, **kwargs)


def versions(args, kwargs) -> dict:
    """``{label: (tensor, version)}`` of a call's tensor arguments (labels ``"0"``,
    ``"name="``, as in the messages); inference tensors (no version counter) left out.
    (Called from the module hooks, while the capture's mode is active: not seen by it.)"""
    items = [(str(k), x) for k, x in enumerate(args)] + [(f"{k}=", x) for k, x in kwargs.items()]
    with torch._C.DisableTorchFunction():
        return {
            lab: (x, x._version)
            for lab, x in items
            if isinstance(x, Tensor) and not x.is_inference()
        }
