"""torch.optim front-ends: DPSGD, DPAdam, DPAdamBC, DPAdamW, DPAdamWBC, DPMacAdam.

Each is a ``torch.optim.Optimizer`` constructed like its torch.optim twin plus keyword-only
privacy arguments; ``step()`` consumes Opacus' ``p.grad_sample`` (shape ``[B, *p.shape]``)
and runs one fused DP step (SPEC sections 1-7) through :mod:`dpkern.functional`. The classes
hold state and policy (validation, the noise key, step counting); they hold no math.

Privacy arguments (keyword-only, all classes):
    max_grad_norm (C > 0): per-sample L2 clipping bound over all parameters (not MacAdam).
    noise_multiplier (sigma >= 0): noise std on the clipped sum is sigma * C.
    expected_batch_size (B_e > 0): normaliser, sample_rate * dataset size under Poisson
        sampling (the real batch may be 0).
    seed (None or int in [0, 2**64)): None = secure mode, the noise key comes from
        os.urandom and never leaves the process; an int = reproducible research run
        (the key is the seed and is saved in state_dict).
    backend ("auto", "torch", "triton", "cpp"): see dpkern.backends.
    nonfinite ("error" or "zero"): a sample with NaN/Inf gradient raises
        FloatingPointError (nothing updated), or is dropped and counted in ``stats``.

Gradient accumulation: call ``accumulate()`` after each micro-batch's backward (it folds
the clipped per-sample gradients into an fp32 buffer and consumes ``grad_sample``), then
``step()`` after the last one: noise is added once per logical batch.

The accumulation buffers (un-noised sums of private gradients) are never put in a
``state_dict``.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
from torch import Tensor

from . import backends
from . import functional as F
from .hyper import (AdamBCHyper, AdamHyper, AdamWBCHyper, AdamWHyper, Hyper, MacAdamHyper,
                    SGDHyper, check_betas, check_nonnegative, check_positive)
from .backends.reference import STATE_NAMES
from .sharding import common_mesh, is_sharded, local_shard

__all__ = ["DPOptimizer", "DPSGD", "DPAdam", "DPAdamBC", "DPAdamW", "DPAdamWBC", "DPMacAdam"]


def secure_key() -> int:
    """A fresh 64-bit noise key from the OS's CSPRNG (os.urandom)."""
    return int.from_bytes(os.urandom(8), "little")


def key_fingerprint(key: int) -> int:
    """A 64-bit fingerprint of a noise key (BLAKE2b keyed BY the key over a fixed message),
    so data-parallel ranks can check they share a key without sending it. Recovering the
    key means inverting a keyed hash; still, treat it as internal and do not log it.

    Returns a signed 64-bit int (fits an int64 tensor)."""
    digest = hashlib.blake2b(b"dpkern noise key fingerprint", key=int(key).to_bytes(8, "little"),
                             digest_size=8, person=b"dpkern-ddp-v1").digest()
    return int.from_bytes(digest, "little", signed=True)


def _check_seed(seed) -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"invalid seed={seed!r}: expected None or an int in [0, 2**64)")
    return seed


class _Checked:
    """An attribute validated on every assignment (``check(name, value)`` -> value)."""

    def __init__(self, check):
        self.check = check

    def __set_name__(self, owner, name):
        self.name, self.private = name, "_" + name

    def __get__(self, obj, objtype=None):
        return self if obj is None else getattr(obj, self.private)

    def __set__(self, obj, value):
        setattr(obj, self.private, self.check(self.name, value))


class DPOptimizer(torch.optim.Optimizer):
    """Base class: state, key handling, validation and step counting for every DP optimizer.

    Subclasses set ``hyper_class`` and implement ``_hyper(group)`` (group dict -> frozen
    hyper-parameter dataclass)."""

    hyper_class: type = None

    def __init__(self, params, defaults: dict, *, max_grad_norm: float,
                 noise_multiplier: float, expected_batch_size: float, seed=None,
                 backend: str = "auto", nonfinite: str = "error"):
        self.max_grad_norm = max_grad_norm
        self.noise_multiplier = noise_multiplier
        self.expected_batch_size = expected_batch_size
        self._seed = _check_seed(seed)
        self.backend = backends.check_name(backend)
        self.nonfinite = F.check_nonfinite(nonfinite)
        self._key = self._seed if self._seed is not None else secure_key()
        self._dp_step = 0
        self._accum: dict[Tensor, Tensor] = {}  # never saved: un-noised private sums
        self.stats = {"steps": 0, "samples": 0, "clipped_samples": 0, "nonfinite_samples": 0}
        super().__init__(params, defaults)

    # -- privacy attributes, validated on every assignment (noise schedules set them) --
    max_grad_norm = _Checked(check_positive)
    noise_multiplier = _Checked(check_nonnegative)
    expected_batch_size = _Checked(check_positive)

    @property
    def dp_step(self) -> int:
        """Number of DP steps taken (t of the last step; 0 before the first)."""
        return self._dp_step

    @property
    def secure(self) -> bool:
        """True when the noise key is secret (no ``seed=`` given)."""
        return self._seed is None

    _PICKLED = ("_seed", "_key", "_dp_step", "_max_grad_norm", "_noise_multiplier",
                "_expected_batch_size", "backend", "nonfinite", "stats", "b_init")

    def key_fingerprint(self) -> int:
        """:func:`key_fingerprint` of this optimizer's noise key (never the key itself)."""
        return key_fingerprint(self._key)

    def _adopt_key(self, key: int) -> None:
        """Take a secure key drawn elsewhere (rank 0 of a data-parallel group). Secure mode
        only: a seeded optimizer's key is its seed."""
        if not self.secure:
            raise ValueError("_adopt_key: this optimizer is in reproducible mode (seed=)")
        if not (isinstance(key, int) and 0 <= key < 2**64):
            raise ValueError("_adopt_key: expected an int in [0, 2**64)")
        self._key = key

    def __getstate__(self):
        # Pickling would carry the key: refused in secure mode (use state_dict()).
        if self.secure:
            raise TypeError(f"{type(self).__name__} in secure mode cannot be pickled or "
                            "deep-copied: the noise key must not leave the process; "
                            "use state_dict() / load_state_dict()")
        state = super().__getstate__()
        state.update({k: v for k, v in self.__dict__.items() if k in self._PICKLED})
        state["_accum"] = {}
        return state

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        try:
            self._hyper(self.param_groups[-1])  # validate (ValueError names the value)
        except ValueError:
            self.param_groups.pop()
            raise

    def _hyper(self, group: dict) -> Hyper:
        raise NotImplementedError

    # -- collecting the step's tensors ------------------------------------------------
    def _rule(self) -> str:
        return self.hyper_class.rule

    def _fresh_state(self, p: Tensor, n_total: int) -> dict[str, Tensor]:
        return {name: torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
                for name in STATE_NAMES[self._rule()]}

    def _groups(self, for_accumulate: bool = False):
        """Build functional Groups over trainable params; validate the grad_sample rules.

        Returns (groups, new_states, new_buffers): tensors created for params seen for
        the first time, to commit into ``self.state`` / ``self._accum`` on success only."""
        trainable = [(gi, pi, p) for gi, g in enumerate(self.param_groups)
                     for pi, p in enumerate(g["params"]) if p.requires_grad]
        n_total = sum(p.numel() for _, _, p in trainable)  # global numel for DTensors
        any_gs = any(getattr(p, "grad_sample", None) is not None for _, _, p in trainable)
        if not any_gs and (for_accumulate or not self._accum):
            raise ValueError("no parameter has a grad_sample: per-sample gradients were "
                             "never computed (wrap the model with opacus.GradSampleModule "
                             "or call dpkern.grad_sample.compute_grad_sample); an empty batch "
                             "is grad_sample tensors with B = 0, not their absence")
        new_states, new_buffers = {}, {}
        groups, offset = [], 0
        for gi, group in enumerate(self.param_groups):
            hyper = self._hyper(group)
            params, gss, summed, offsets, names = [], [], [], [], []
            states = {name: [] for name in STATE_NAMES[self._rule()]}
            for pi, p in enumerate(group["params"]):
                if not p.requires_grad:
                    continue
                name = f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})"
                local, start = local_shard(p, name)
                if local.shape != p.shape:
                    name = f"{name[:-1]}, local shard {tuple(local.shape)})"
                gs = getattr(p, "grad_sample", None)
                if isinstance(gs, (list, tuple)):  # Opacus: several forward passes
                    if not all(isinstance(x, Tensor) for x in gs):
                        raise ValueError(f"{name}: grad_sample is a list of non-tensors")
                    gs = torch.cat(list(gs), dim=0) if gs else None
                if p.grad is not None and p.grad.is_sparse:
                    raise ValueError(f"{name}: sparse gradients are not supported")
                if gs is None and any_gs and p.grad is not None:
                    raise ValueError(f"{name}: has .grad but no grad_sample (was it created "
                                     "outside the module wrapped for per-sample gradients?)")
                unused = self._unused_states(hyper)
                state = self.state.get(p)
                if not state:
                    state = new_states[p] = {k: v for k, v in
                                             self._fresh_state(local, n_total).items()
                                             if k not in unused}
                elif any(k not in state and k not in unused for k in states):
                    # a state needed from now on (e.g. momentum switched on): zeros
                    fresh = self._fresh_state(local, n_total)
                    new_states[p] = {k: fresh[k] for k in states
                                     if k not in state and k not in unused}
                    state = {**state, **new_states[p]}
                for sname in states:
                    states[sname].append(state.get(sname))  # None: unused by this rule
                buf = self._accum.get(p)
                if buf is None and for_accumulate:
                    buf = new_buffers[p] = torch.zeros_like(
                        local, dtype=torch.float32, memory_format=torch.contiguous_format)
                params.append(local)
                gss.append(gs)
                summed.append(buf)
                offsets.append(offset + start)
                names.append(name)
                offset += p.numel()
            if params:
                groups.append(F.Group(hyper, params, gss, summed, states, offsets, names,
                                      self._noise_var_avg(group, hyper)))
        if not groups:
            raise ValueError("the optimizer owns no trainable parameter")
        return groups, new_states, new_buffers

    def _reduce(self):
        """None for ordinary parameters; for FSDP2 DTensor shards, an in-place SUM over the
        device mesh's process group (per-sample squared norms, MacAdam's global sum).

        Raises ValueError if plain and sharded parameters are mixed (the partial norms of
        a replicated parameter would be counted once per rank) or meshes differ."""
        mesh = common_mesh(self.trainable_params(), "sharded parameters (trainable)")
        if mesh is None:
            return None
        import torch.distributed as dist
        group = mesh.get_group()
        if dist.get_world_size(group) == 1:
            return None
        return lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)

    def _check_inputs(self) -> None:
        """Validate this micro-batch's grad_sample and the parameters as ``accumulate()``
        would, without computing or modifying anything (no collective: sharded callers
        run it on every rank before the norms' all-reduce). Raises ValueError."""
        groups, _, _ = self._groups()  # (no accumulation buffers: accumulate() makes them)
        F.check_params(groups)
        self._reduce()

    def _unused_states(self, hyper: Hyper) -> set[str]:
        """State names the update does not use with these hyper-parameters (never
        allocated, passed to the backends as None)."""
        return set()

    def _noise_var_avg(self, group: dict, hyper: Hyper) -> float:
        return 0.0

    def _commit_noise_var_avg(self, groups) -> None:
        pass

    # -- the public API --------------------------------------------------------------
    @torch.no_grad()
    def accumulate(self) -> None:
        """Fold the current micro-batch's clipped per-sample gradients into the logical
        batch (fp32 buffers) and consume ``p.grad_sample``. No noise is added here.

        Raises: ValueError (no/inconsistent grad_sample), FloatingPointError (non-finite
        with nonfinite="error"); buffers and state are untouched when it raises."""
        groups, new_states, new_buffers = self._groups(for_accumulate=True)
        result = F.accumulate_groups(groups, step=self._dp_step + 1,
                                     max_grad_norm=self.max_grad_norm, backend=self.backend,
                                     nonfinite=self.nonfinite, reduce=self._reduce())
        self._accum.update(new_buffers)
        self._record(result, step=False)
        for p in self.trainable_params():
            p.grad_sample = None

    def trainable_params(self) -> list[Tensor]:
        """Trainable parameters in noise-index order (param_groups order, frozen skipped)."""
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def clipped_sum_buffers(self) -> list[Tensor]:
        """The logical batch's fp32 clipped-sum buffers, one per trainable parameter
        (created as zeros where missing), e.g. for an all-reduce across data-parallel
        ranks before ``step()``. Un-noised private sums: never log or save them."""
        out = []
        for p in self.trainable_params():
            if p not in self._accum:
                self._accum[p] = torch.zeros_like(local_shard(p)[0], dtype=torch.float32,
                                                  memory_format=torch.contiguous_format)
            out.append(self._accum[p])
        return out

    @torch.no_grad()
    def accumulate_clipped(self, clipped_sums, batch_size: int = 0) -> None:
        """Add clipped sums computed elsewhere (ghost clipping, book-keeping) to the
        logical batch; the next ``step()`` adds noise once and updates.

        Args:
            clipped_sums: one entry per ``trainable_params()`` entry, ``None`` or a tensor
                shaped like the parameter holding sum_i c_i g_i with every sample's
                gradient clipped to norm <= max_grad_norm over all parameters (for
                DP-MacAdam: the sum of clipped whitened rows). FSDP2: the DTensor
                ``p.grad`` FSDP reduce-scattered (its local shard is used).
            batch_size: samples in this micro-batch (for ``stats`` only).
        Raises: ValueError (wrong count, shape, device, non-finite values); nothing is
        modified when it raises."""
        params = self.trainable_params()
        clipped_sums = list(clipped_sums)
        if len(clipped_sums) != len(params):
            raise ValueError(f"accumulate_clipped: {len(clipped_sums)} sums for "
                             f"{len(params)} trainable parameters")
        for k, (s, p) in enumerate(zip(clipped_sums, params)):
            if s is None:
                continue
            if not isinstance(s, Tensor) or s.shape != p.shape or s.device != p.device \
                    or not s.is_floating_point() or s.is_sparse \
                    or is_sharded(s) != is_sharded(p):
                raise ValueError(f"clipped_sums[{k}]: expected a dense float "
                                 f"{'DTensor' if is_sharded(p) else 'tensor'} of shape "
                                 f"{tuple(p.shape)} on {p.device}")
            clipped_sums[k] = s = local_shard(s, f"clipped_sums[{k}]")[0]
            if not torch.isfinite(s).all():
                raise ValueError(f"clipped_sums[{k}]: non-finite values")
        for s, buf in zip(clipped_sums, self.clipped_sum_buffers()):
            if s is not None:
                buf += s.float()
        self.stats["samples"] += int(batch_size)

    @torch.no_grad()
    def step(self, closure=None):
        """One DP step: clip every per-sample gradient, sum (with accumulated micro-batches),
        add Gaussian noise once, and apply the update rule (SPEC sections 2-7).

        Raises: ValueError (inconsistent grad_sample / parameters, SPEC section 1),
        FloatingPointError (non-finite per-sample gradient with nonfinite="error").
        When it raises, parameters, optimizer state and accumulation buffers are exactly
        as before, and a later valid step works."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups, new_states, _ = self._groups()
        t = self._dp_step + 1
        result = F.dp_step_groups(groups, key=self._key, step=t,
                                  max_grad_norm=self.max_grad_norm,
                                  noise_multiplier=self.noise_multiplier,
                                  expected_batch_size=self.expected_batch_size,
                                  backend=self.backend, nonfinite=self.nonfinite,
                                  reduce=self._reduce())
        for p, st in new_states.items():
            self.state[p].update(st)
        self._commit_noise_var_avg(groups)
        self._dp_step = t
        self._accum.clear()
        self._record(result, step=True)
        return loss

    def _record(self, result: F.StepResult, step: bool) -> None:
        self.stats["steps"] += int(step)
        self.stats["samples"] += result.batch_size
        self.stats["clipped_samples"] += result.clipped_samples
        self.stats["nonfinite_samples"] += result.nonfinite_samples

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's zero_grad, and also clears ``p.grad_sample`` (Opacus convention).
        Accumulated micro-batches are kept (they belong to the logical batch)."""
        super().zero_grad(set_to_none=set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                if hasattr(p, "grad_sample"):
                    p.grad_sample = None

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state_dict plus a ``"dp"`` entry: the step count, privacy
        parameters and stats; the seed only in reproducible mode (never the secure key)."""
        sd = super().state_dict()
        dp = {"step": self._dp_step, "max_grad_norm": self.max_grad_norm,
              "noise_multiplier": self.noise_multiplier,
              "expected_batch_size": self.expected_batch_size, "stats": dict(self.stats)}
        if self._seed is not None:
            dp["seed"] = self._seed
        sd["dp"] = dp
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore states (kept float32 whatever the parameter dtype) and the step count.

        Secure mode draws a fresh noise key, so no (key, step) pair is ever used twice;
        reproducible mode takes the checkpoint's seed. Validates before changing anything."""
        sd = dict(state_dict)
        dp = dict(sd.pop("dp", {}))
        saved_state = sd.get("state", {})
        saved_groups = sd.get("param_groups", [])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        id_to_param = {}
        for saved, group in zip(saved_groups, self.param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't "
                                 "match the size of optimizer's group")
            self._hyper({**group, **{k: v for k, v in saved.items() if k != "params"}})
            id_to_param.update(zip(saved["params"], group["params"]))
        new_state = {}
        for pid, st in saved_state.items():
            p = id_to_param[pid]
            shape = local_shard(p)[0].shape  # this rank's shard for FSDP2 DTensors
            new_state[p] = {}
            for name, value in st.items():
                if isinstance(value, Tensor):
                    if value.shape != shape and value.dim() != 0:
                        raise ValueError(f"state {name!r} has shape {tuple(value.shape)}, "
                                         f"parameter (shard) has {tuple(shape)}")
                    value = value.to(device=p.device, dtype=torch.float32).clone()
                new_state[p][name] = value
        step = dp.get("step", 0)
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"invalid dp step {step!r} in state dict")
        seed = _check_seed(dp.get("seed"))
        privacy = {k: dp[k] for k in ("max_grad_norm", "noise_multiplier",
                                      "expected_batch_size") if k in dp}
        F.check_privacy(**{"max_grad_norm": self.max_grad_norm,
                           "noise_multiplier": self.noise_multiplier,
                           "expected_batch_size": self.expected_batch_size, **privacy})
        # validated: now change things
        super().load_state_dict({"state": {}, "param_groups": saved_groups})
        self.state.clear()
        for p, st in new_state.items():
            self.state[p] = st
        for k, v in privacy.items():
            setattr(self, k, v)
        self._dp_step = step
        self.stats.update(dp.get("stats", {}))
        self._accum.clear()
        if self._seed is None:
            self._key = secure_key()  # never reuse a (key, step) pair after a resume
        elif seed is not None:
            self._seed = self._key = seed


class DPSGD(DPOptimizer):
    """DP-SGD (Abadi et al. 2016, Algorithm 1) with torch.optim.SGD's update (SPEC 5.1).

    State: ``momentum_buffer`` (float32, like the param) when momentum != 0."""

    hyper_class = SGDHyper

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, max_grad_norm: float,
                 noise_multiplier: float, expected_batch_size: float, seed=None,
                 backend: str = "auto", nonfinite: str = "error"):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm,
                         noise_multiplier=noise_multiplier,
                         expected_batch_size=expected_batch_size, seed=seed, backend=backend,
                         nonfinite=nonfinite)

    def _hyper(self, group):
        return SGDHyper(lr=group["lr"], momentum=group["momentum"],
                        dampening=group["dampening"], weight_decay=group["weight_decay"],
                        nesterov=group["nesterov"])

    def _unused_states(self, hyper):
        return {"momentum_buffer"} if hyper.momentum == 0 else set()


class _AdamFamily(DPOptimizer):
    _defaults: dict = {}

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), *, max_grad_norm: float,
                 noise_multiplier: float, expected_batch_size: float, seed=None,
                 backend: str = "auto", nonfinite: str = "error", **extra):
        defaults = dict(lr=lr, betas=tuple(betas), **extra)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm,
                         noise_multiplier=noise_multiplier,
                         expected_batch_size=expected_batch_size, seed=seed, backend=backend,
                         nonfinite=nonfinite)

    def _hyper(self, group):
        beta1, beta2 = check_betas(group["betas"])
        extra = {k: group[k] for k in self._defaults}
        return self.hyper_class(lr=group["lr"], beta1=beta1, beta2=beta2, **extra)


class DPAdam(_AdamFamily):
    """DP-Adam (TF Privacy / Opacus + torch.optim.Adam; SPEC 5.2): coupled L2 weight decay.

    State: ``exp_avg``, ``exp_avg_sq`` (float32)."""
    hyper_class = AdamHyper
    _defaults = {"eps": 1e-8, "weight_decay": 0.0}

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 max_grad_norm, noise_multiplier, expected_batch_size, seed=None,
                 backend="auto", nonfinite="error"):
        super().__init__(params, lr, betas, eps=eps, weight_decay=weight_decay,
                         max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
                         expected_batch_size=expected_batch_size, seed=seed,
                         backend=backend, nonfinite=nonfinite)


class DPAdamW(_AdamFamily):
    """DP-AdamW (arXiv 2511.07843, Algorithm 1; SPEC 5.4): decoupled weight decay
    (torch.optim.AdamW convention, default 1e-2). State: ``exp_avg``, ``exp_avg_sq``."""
    hyper_class = AdamWHyper
    _defaults = {"eps": 1e-8, "weight_decay": 1e-2}

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 max_grad_norm, noise_multiplier, expected_batch_size, seed=None,
                 backend="auto", nonfinite="error"):
        super().__init__(params, lr, betas, eps=eps, weight_decay=weight_decay,
                         max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
                         expected_batch_size=expected_batch_size, seed=seed,
                         backend=backend, nonfinite=nonfinite)


class _BCMixin:
    """phi = beta2 phi + (1 - beta2) Phi_t per parameter group (SPEC 5.3), kept in each
    parameter's state as ``noise_var_avg`` (a 0-dim float32 tensor, like torch's ``step``)."""

    def _fresh_state(self, p, n_total):
        st = super()._fresh_state(p, n_total)
        st["noise_var_avg"] = torch.zeros((), dtype=torch.float32, device=p.device)
        return st

    def _noise_var_avg(self, group, hyper) -> float:
        Phi = (self.noise_multiplier * self.max_grad_norm / self.expected_batch_size) ** 2
        prev = 0.0
        for p in group["params"]:
            st = self.state.get(p)
            if p.requires_grad and st and "noise_var_avg" in st:
                prev = float(st["noise_var_avg"])
                break
        return hyper.beta2 * prev + (1 - hyper.beta2) * Phi

    def _commit_noise_var_avg(self, groups) -> None:
        # groups[k] holds the (local views of the) trainable parameters of the k-th
        # param_group that has any; self.state is keyed by the parameters themselves
        owners = [ps for ps in ([p for p in g["params"] if p.requires_grad]
                                for g in self.param_groups) if ps]
        for grp, params in zip(groups, owners):
            for p in params:
                self.state[p]["noise_var_avg"].fill_(grp.noise_var_avg)


class DPAdamBC(_BCMixin, _AdamFamily):
    """DP-AdamBC (Tang et al., arXiv 2312.14334; SPEC 5.3): Adam with the noise variance
    removed from the second moment, denominator sqrt(max(v_hat - phi_hat, gamma)).

    State: ``exp_avg``, ``exp_avg_sq``, ``noise_var_avg`` (phi, 0-dim)."""
    hyper_class = AdamBCHyper
    _defaults = {"gamma": 1e-8, "weight_decay": 0.0}

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), gamma=1e-8, weight_decay=0.0, *,
                 max_grad_norm, noise_multiplier, expected_batch_size, seed=None,
                 backend="auto", nonfinite="error"):
        super().__init__(params, lr, betas, gamma=gamma, weight_decay=weight_decay,
                         max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
                         expected_batch_size=expected_batch_size, seed=seed,
                         backend=backend, nonfinite=nonfinite)


class DPAdamWBC(_BCMixin, _AdamFamily):
    """DP-AdamW-BC (arXiv 2511.07843, Algorithm 2; SPEC 5.5): DP-AdamW with DP-AdamBC's
    denominator. State: ``exp_avg``, ``exp_avg_sq``, ``noise_var_avg``."""
    hyper_class = AdamWBCHyper
    _defaults = {"gamma": 1e-8, "weight_decay": 1e-2}

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), gamma=1e-8, weight_decay=1e-2, *,
                 max_grad_norm, noise_multiplier, expected_batch_size, seed=None,
                 backend="auto", nonfinite="error"):
        super().__init__(params, lr, betas, gamma=gamma, weight_decay=weight_decay,
                         max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
                         expected_batch_size=expected_batch_size, seed=seed,
                         backend=backend, nonfinite=nonfinite)


class DPMacAdam(_AdamFamily):
    """DP-MacAdam (arXiv 2606.05435, Algorithm 1; AdaClip arXiv 1908.07643; SPEC 7).

    Per-coordinate whitening before clipping, noise in the whitened space; no
    max_grad_norm (the bound is 1 there). ``b_init`` defaults to 1/d, d = number of
    trainable coordinates at the first step. State: ``exp_avg``, ``exp_avg_sq``,
    ``exp_var`` (S), ``scale`` (b), all float32."""
    hyper_class = MacAdamHyper
    _defaults = {"gamma": 1e-8, "h1": 1e-9, "h2": 1e-6, "variance_estimate": "unbiased"}

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), gamma=1e-8, h1=1e-9, h2=1e-6,
                 b_init=None, variance_estimate="unbiased", *, noise_multiplier,
                 expected_batch_size, seed=None, backend="auto", nonfinite="error"):
        if b_init is not None:
            check_positive("b_init", b_init)
        self.b_init = b_init
        super().__init__(params, lr, betas, gamma=gamma, h1=h1, h2=h2,
                         variance_estimate=variance_estimate, max_grad_norm=1.0,
                         noise_multiplier=noise_multiplier,
                         expected_batch_size=expected_batch_size, seed=seed,
                         backend=backend, nonfinite=nonfinite)

    def _fresh_state(self, p, n_total):
        st = super()._fresh_state(p, n_total)
        st["scale"].fill_(self.b_init if self.b_init is not None else 1.0 / max(n_total, 1))
        return st
