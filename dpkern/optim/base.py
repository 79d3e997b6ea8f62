"""DPOptimizer: state, the noise key, validation and step counting for every DP optimizer.

The classes (one module per family, re-exported by :mod:`dpkern.optim.optimizers`) add
one update rule each (``rule``, its spec in :mod:`dpkern.rules`, which says which states
to allocate and how); the math lives in :mod:`dpkern.functional` and the backends. What
this layer guarantees (README, "what dpkern refuses, and why"):

- ``step()`` and ``accumulate()`` consume ``p.grad_sample``: a sample's gradient is
  released once; a step with no fresh per-sample gradients or clipped sums raises;
- the noise key is a :class:`dpkern.keys.NoiseKey` (never printed, pickled or saved in
  secure mode); a (key, step) pair serves one release, across failures and resumes;
- a step is all-or-nothing: validation precedes every change; SIGINT / SIGTERM during
  the update are delivered after it; a failure midway (out of memory) counts the step,
  and the optimizer refuses to step or save until it is reloaded;
- ``state_dict()`` holds no data-dependent statistic (``stats`` stays in memory) and no
  secure key; ``load_state_dict`` keeps the constructor's privacy arguments and refuses
  checkpoints that are not dpkern's;
- each parameter keeps its own ``state["step"]`` for bias corrections (as torch.optim);
  the noise step is global.
"""

from __future__ import annotations


import dataclasses
import warnings
from typing import ClassVar

import torch
from torch import Tensor

from .. import backends
from .. import functional as F
from ..guards import (
    DPOPTIMIZER_IS_A_BASE,
    check_constructor_options,
    StepInterrupted,
    check_group_options,
    deferred_signals,
    refuse_grad_scaler,
)
from ..hyper import (
    Hyper,
    check_betas,
    check_nonnegative,
    check_positive,
    check_stochastic_rounding,
)
from ..interop import refuse_opacus_wrapper
from ..keys import NOT_PRIVATE, NoiseKey, key_fingerprint, secure_key
from ..rules import PARAM, RuleSpec
from ..sharding import common_mesh
from .batch import LogicalBatch
from .checkpoint import Checkpointing, _check_seed, check_state_shape
from .groups import build_groups, step_of
from .inputs import consume_grad_samples, grad_sample_of

__all__ = ["DPOptimizer", "key_fingerprint", "secure_key"]


NO_NOISE = (
    "dpkern: noise_multiplier=0: no noise is added, so the steps are clipped but not "
    "differentially private (the accountant's epsilon is infinite); a test or a clipping "
    "baseline only"
)
SEEDED = (
    "dpkern: seed={seed} makes the noise reproducible by anyone who knows the seed: the "
    "run is " + NOT_PRIVATE + " (tests and reproducible research only; omit seed= for a "
    "secret key from os.urandom)"
)


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


class DPOptimizer(LogicalBatch, Checkpointing, torch.optim.Optimizer):
    """Base class of dpkern's optimizers (not a wrapper: see :class:`dpkern.DPAdamW`).

    A subclass sets ``rule`` to its :class:`dpkern.rules.RuleSpec` (``hyper_class`` follows
    from it) and defines its constructor's signature; the states, the hyper-parameters of
    each param group (torch.optim's ``betas`` pair included) and the rule's properties come
    from the spec. Constructing this class itself, or passing an optimizer in place of
    parameters (Opacus' wrapper style), raises TypeError.

    Public hooks for the layers above (data parallelism, ghost clipping):
    :meth:`group_hyper`, :meth:`check_inputs`, :meth:`adopt_key`,
    :meth:`accumulate_clipped` (with its sample counts) and :meth:`trainable_params`."""

    rule: ClassVar[RuleSpec] = None
    hyper_class: ClassVar[type] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("rule") is not None:
            cls.hyper_class = cls.rule.hyper_class

    def __new__(cls, *args, **kwargs):
        if cls is DPOptimizer:
            raise TypeError(DPOPTIMIZER_IS_A_BASE)
        check_constructor_options(cls, kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        params,
        defaults: dict,
        *,
        max_grad_norm: float,
        noise_multiplier: float,
        expected_batch_size: float,
        seed=None,
        backend: str = "auto",
        nonfinite: str = "error",
        stochastic_rounding: bool = False,
    ):
        if isinstance(params, torch.optim.Optimizer):
            raise TypeError(DPOPTIMIZER_IS_A_BASE)
        self.max_grad_norm = max_grad_norm
        self.noise_multiplier = noise_multiplier
        self.expected_batch_size = expected_batch_size
        if self.noise_multiplier == 0:
            warnings.warn(NO_NOISE, UserWarning, stacklevel=3)
        self._seed = _check_seed(seed)
        if self._seed is not None:
            warnings.warn(SEEDED.format(seed=self._seed), UserWarning, stacklevel=3)
        self.backend = backends.check_name(backend)
        self.nonfinite = F.check_nonfinite(nonfinite)
        #: Round bfloat16 parameters stochastically on store (SPEC 3.2); float32 and
        #: float16 parameters are unaffected. May be changed between steps.
        self.stochastic_rounding = stochastic_rounding
        self._key = NoiseKey(self._seed) if self._seed is not None else secure_key()
        self._dp_step = 0
        self._failed: str | None = None  # why a step failed midway (see step())
        self._accum: dict[Tensor, Tensor] = {}  # never saved: un-noised private sums
        self._accum_max_grad_norm: float | None = None  # the C _accum was clipped at
        self._batch_failed: str | None = None  # why the accumulated batch can't be released
        #: In-memory counters (exact and data-dependent: never saved, never logged by
        #: dpkern): steps, samples, clipped_samples, nonfinite_samples.
        self.stats = {"steps": 0, "samples": 0, "clipped_samples": 0, "nonfinite_samples": 0}
        super().__init__(params, defaults)

    # -- privacy attributes, validated on every assignment (noise schedules set them) --
    max_grad_norm = _Checked(check_positive)
    noise_multiplier = _Checked(check_nonnegative)
    expected_batch_size = _Checked(check_positive)
    stochastic_rounding = _Checked(lambda name, value: check_stochastic_rounding(value))

    @property
    def dp_step(self) -> int:
        """Number of DP steps taken (t of the last step; 0 before the first): the noise
        stream's step counter, shared by all parameters."""
        return self._dp_step

    @property
    def secure(self) -> bool:
        """True when the noise key is secret (no ``seed=`` given). With a seed the noise
        key is known: the run is reproducible, and not private."""
        return self._seed is None

    #: GradScaler.step() then calls step() (which refuses it) instead of skipping it
    #: whenever the un-clipped p.grad overflowed
    _step_supports_amp_scaling = True

    def __repr__(self) -> str:
        dp = (
            f"    max_grad_norm: {self.max_grad_norm}\n"
            + f"    noise_multiplier: {self.noise_multiplier}"
            + (" (no noise: not private)\n" if self.noise_multiplier == 0 else "\n")
            + f"    expected_batch_size: {self.expected_batch_size}\n"
            + f"    secure: {self.secure}"
            + ("" if self.secure else " (seed given: the noise key is known, not private)")
            + f"\n    backend: {self._backend_line()}\n    dp_step: {self._dp_step}\n"
            + ("    stochastic_rounding: True\n" if self.stochastic_rounding else "")
        )
        base = super().__repr__()
        return base[:-1] + "DP settings\n" + dp + ")" if base.endswith(")") else base + "\n" + dp

    def _backend_line(self) -> str:
        """The backend setting and, for ``"auto"``, what it runs on the parameters'
        devices: ``auto (cpp)``."""
        devices = {str(p.device) for g in self.param_groups for p in g["params"]} or ["cpu"]
        rule = self.rule.name if self.rule is not None else None
        return backends.describe(self.backend, devices, rule)

    def key_fingerprint(self) -> int:
        """:func:`dpkern.keys.key_fingerprint` of this optimizer's noise key (never the key
        itself)."""
        return key_fingerprint(self._key)

    def adopt_key(self, key) -> None:
        """Take a secure noise key drawn elsewhere, e.g. rank 0's in a data-parallel group
        (:func:`dpkern.distributed.sync_key`), so that every rank draws the same noise.

        Args: key: a :class:`dpkern.keys.NoiseKey` (or a 64-bit int, wrapped in one).
        Raises: ValueError in reproducible mode (``seed=``: the key is the seed)."""
        if not self.secure:
            raise ValueError("adopt_key: this optimizer is in reproducible mode (seed=)")
        self._key = key if isinstance(key, NoiseKey) else NoiseKey(key)

    @torch._disable_dynamo
    def add_param_group(self, param_group: dict) -> None:
        """torch.optim's add_param_group; refuses options this class does not implement
        (``maximize``, ``amsgrad``, per-group privacy arguments...) with ValueError."""
        if isinstance(param_group, dict):
            check_group_options(type(self).__name__, param_group, self.defaults)
        super().add_param_group(param_group)
        try:
            self._hyper(self.param_groups[-1])  # validate (ValueError names the value)
        except ValueError:
            self.param_groups.pop()
            raise

    def _hyper(self, group: dict) -> Hyper:
        """The rule's hyper-parameter dataclass from a group dict: each of its fields from
        the group's entry of that name (the dataclass default where the group has none),
        ``beta1, beta2`` from torch.optim's ``betas`` pair."""
        fields = [f.name for f in dataclasses.fields(self.hyper_class)]
        kw = {name: group[name] for name in fields if name in group}
        if "beta1" in fields and "betas" in group:
            kw["beta1"], kw["beta2"] = check_betas(group["betas"])
        return self.hyper_class(**kw)

    def group_hyper(self, group: dict | int) -> Hyper:
        """The validated hyper-parameters (a frozen :mod:`dpkern.hyper` dataclass) of a
        param group, given as a dict or an index into ``param_groups``.

        Raises: ValueError for an invalid value or an option the class does not implement."""
        if isinstance(group, int):
            group = self.param_groups[group]
        check_group_options(type(self).__name__, group, self.defaults)
        return self._hyper(group)

    # -- collecting the step's tensors ------------------------------------------------
    def _rule(self) -> str:
        return self.rule.name

    def _fresh_state(self, p: Tensor, n_total: int) -> dict[str, Tensor]:
        """Zero float32 states of the rule for parameter (or local shard) ``p``, shaped as
        their StateSpecs say, and ``step``."""
        st = {}
        for spec in self.rule.states:
            if spec.shape == PARAM:
                st[spec.name] = torch.zeros_like(
                    p, dtype=torch.float32, memory_format=torch.contiguous_format
                )
            else:
                shape = spec.shape_for(p.shape)
                st[spec.name] = torch.zeros(shape, dtype=torch.float32, device=p.device)
        st["step"] = torch.tensor(0.0, dtype=torch.float32)  # torch.optim's convention
        return st

    def _init_states(self, hyper: Hyper, new: dict[str, Tensor]) -> None:
        """Fill freshly allocated states whose StateSpec has an ``init`` (in place)."""
        for name, value in new.items():
            if name in self.rule.state_names and self.rule.state(name).init is not None:
                value.fill_(self.rule.state(name).initial_value(hyper))

    def _rule_step(self, hyper: Hyper, state: dict, new: dict) -> int:
        """The update rule's t for a parameter: its own step count + 1."""
        return step_of(state) + 1

    def _groups(self, for_accumulate: bool = False):
        """The step's functional Groups, owners and new tensors: see
        :func:`dpkern.optim.groups.build_groups` (changes nothing)."""
        return build_groups(self, for_accumulate)

    def _check_rule_steps(self, groups) -> None:
        """Hook: refuse parameters whose own step differs where the rule cannot have it."""

    #: ``p.grad_sample`` as one tensor, refused once released (:mod:`dpkern.optim.inputs`).
    _grad_sample = staticmethod(grad_sample_of)

    def _consume_grad_samples(self) -> None:
        """Mark every trainable parameter's grad_sample as released and detach it."""
        consume_grad_samples(self.trainable_params())

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

    def check_inputs(self) -> None:
        """Validate this micro-batch's ``grad_sample`` tensors and the parameters as
        :meth:`accumulate` would, without computing or modifying anything (no collective:
        sharded callers run it on every rank before the norms' all-reduce).

        Raises: ValueError (the message names the parameter, or the logical batch can no
        longer be released: see ``step()``), StepInterrupted."""
        self._check_can_release()
        self._check_batch_usable()
        groups = self._groups()[0]  # (no accumulation buffers: accumulate() makes them)
        F.check_params(groups)
        self._reduce()

    def _check_state_shape(self, name: str, value: Tensor, shape) -> None:
        """A loaded state's shape: as its StateSpec says for the parameter (shard); other
        entries (``step``) shaped like the parameter or 0-dim. Raises ValueError."""
        check_state_shape(self.rule, name, value, shape)

    def _commit(self, groups, owners, new_states) -> None:
        """After a successful step: install new states and advance each parameter's own
        step (and phi for the BC rules)."""
        for p, st in new_states.items():
            self.state[p].update(st)
        for grp, params in zip(groups, owners, strict=True):
            for p in params:
                self.state[p]["step"] = torch.tensor(float(grp.step), dtype=torch.float32)
                if "noise_var_avg" in self.state[p]:
                    self.state[p]["noise_var_avg"].fill_(grp.noise_var_avg)

    def _check_usable(self) -> None:
        """Raise if an earlier step failed midway (StepInterrupted)."""
        if self._failed is not None:
            raise StepInterrupted(self._failed)

    def _check_can_release(self) -> None:
        """Raise before anything runs: Opacus' DPOptimizer wraps this one (it would clip
        and noise twice: ValueError), or an earlier step failed midway."""
        refuse_opacus_wrapper(self)
        self._check_usable()

    # -- the public API --------------------------------------------------------------
    @torch.no_grad()
    @torch._disable_dynamo
    def step(self, closure=None):
        """One DP step: clip every per-sample gradient, sum (with accumulated micro-batches),
        add Gaussian noise once, and apply the update rule (SPEC sections 2-7); consumes
        ``p.grad_sample``.

        Under ``torch.compile`` the step runs eagerly (a graph break): the noise step and
        the bias corrections advance at every call, as without compiling.

        Raises: ValueError (no fresh, stale or inconsistent grad_sample / parameters, SPEC
        section 1), FloatingPointError (non-finite per-sample gradient with
        nonfinite="error"): parameters and optimizer state are then exactly as before.
        Any error before the update (the closure's too) ends the logical batch: this
        micro-batch's ``grad_sample`` is consumed (a later backward must not add to it),
        and micro-batches accumulated before are never released -- a retry cannot be
        told apart from the next logical batch, and a sample drawn in both would add up
        to 2C --: ``step()``, ``accumulate()`` and ``accumulate_clipped()`` raise
        ValueError until ``zero_grad()`` drops them. With nothing accumulated, the next
        batch's step works at once. StepInterrupted: an earlier step failed midway (see
        below).

        Atomicity: SIGINT / SIGTERM arriving during the update are delivered after it (the
        step completes). An error of the machine after the update began (out of memory)
        cannot be undone without a copy of every tensor: the step is then counted (its
        (key, step) pair is never used again), the error is raised, and ``step()``,
        ``accumulate()`` and ``state_dict()`` raise StepInterrupted until a checkpoint is
        loaded with ``load_state_dict`` (and the model's weights restored with it)."""
        refuse_grad_scaler(self)
        self._check_can_release()
        self._check_batch_usable()
        loss = None
        t = self._dp_step + 1
        try:  # any error ends the logical batch (a retry looks like the next batch)
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            reduce = self._reduce()
            groups, owners, new_states, _ = self._groups()
            be, result = F.prepare_step(
                groups,
                step=t,
                max_grad_norm=self.max_grad_norm,
                backend=self.backend,
                nonfinite=self.nonfinite,
                reduce=reduce,
            )
        except BaseException as exc:
            self._fail_batch(exc, f"step() {t}")
            raise
        with deferred_signals():
            try:
                F.apply_step(
                    groups,
                    be,
                    result,
                    key=self._key,
                    step=t,
                    max_grad_norm=self.max_grad_norm,
                    noise_multiplier=self.noise_multiplier,
                    expected_batch_size=self.expected_batch_size,
                    reduce=reduce,
                    stochastic_rounding=self.stochastic_rounding,
                )
            except BaseException as exc:
                self._dp_step = t  # the pair (key, t) may have been used: never again
                self._failed = (
                    f"step {t} failed midway ({type(exc).__name__}: {exc}); "
                    "parameters and states hold a partly applied step. Reload "
                    "the last checkpoint (model weights and optimizer "
                    "load_state_dict) before stepping or saving again"
                )
                self.drop_batch()
                raise
            self._commit(groups, owners, new_states)
            self._dp_step = t
            self._clear_accum()
            self._record(result, step=True)
            self._consume_grad_samples()
        return loss

    def _record(self, result: F.StepResult, step: bool) -> None:
        self.stats["steps"] += int(step)
        self.stats["samples"] += result.batch_size
        self.stats["clipped_samples"] += result.clipped_samples
        self.stats["nonfinite_samples"] += result.nonfinite_samples

    @torch._disable_dynamo
    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's zero_grad, and also clears ``p.grad_sample`` (Opacus convention).
        Accumulated micro-batches are kept (they belong to the logical batch), except
        after any error of ``step()``, ``accumulate()``, ``accumulate_clipped()`` or
        ``GhostClipping.backward`` once micro-batches were accumulated: that logical batch
        is then dropped, with a warning, and nothing of it is released. To abandon a batch
        after an error elsewhere (your forward), call :meth:`drop_batch`.

        Raises: ValueError when Opacus' DPOptimizer (``make_private``) wraps this one."""
        refuse_opacus_wrapper(self)
        if self._batch_failed is not None:
            warnings.warn(
                f"zero_grad() after {self._batch_failed}: the micro-batches accumulated "
                "for that logical batch were dropped (nothing of them was released)",
                stacklevel=2,
            )
            self.drop_batch()
        super().zero_grad(set_to_none=set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                if hasattr(p, "grad_sample"):
                    p.grad_sample = None
