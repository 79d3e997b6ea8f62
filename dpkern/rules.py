"""The update-rule registry: one :class:`RuleSpec` per update rule, the single home of its
name, command-line name, hyper-parameter dataclass, optimizer states and properties.

Everything that enumerates update rules derives from :data:`RULES`: the optimizer
classes' states (:mod:`dpkern.optim`), the reference backend's dispatch
(``update_<name>`` in :mod:`dpkern.backends.reference`), the Triton and C++ rule codes
(looked up by name, never by position), the command-line choices (``dpkern finetune
--optimizer``, ``dpkern compare --optimizers``) and the test tables. Adding a rule is one
spec here plus one function per backend (CONTRIBUTING.md, "Adding an optimizer").

Names. ``RuleSpec.name`` (``"adam_bc"``) is the Python spelling: ``Hyper.rule``, the
functional ``dp_<name>``, the backends' ``update_<name>``. ``RuleSpec.cli_name``
(``"dp-adambc"``) is the command line's and the result tables', as documented in the
README; no other spelling exists.

States. Each :class:`StateSpec` names one float32 optimizer state (torch.optim's names
where a twin exists) and its shape relative to the parameter ``p``:

- ``"param"``: ``p.shape``;
- ``"row"``: one value per row of the trailing matrix, ``p.shape[:-1]`` (a parameter with
  fewer than 2 dimensions is its own row: ``p.shape``, Adafactor's unfactored fallback);
- ``"col"``: one value per column, ``p.shape[:-2] + p.shape[-1:]`` (a scalar ``()`` for
  fewer than 2 dimensions);
- ``"scalar"``: a 0-dim tensor per parameter (like torch.optim's ``step``), e.g. a
  per-group quantity such as DP-AdamBC's phi, kept and advanced with each parameter.

Kernel states (``kernel=True``) are handed to the backends' ``step`` in the order of
``RuleSpec.states``; the others are kept by the front-end. Every rule also keeps
``state["step"]``, the parameter's own step count.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .hyper import (
    AdagradHyper,
    AdadeltaHyper,
    AdafactorHyper,
    AdamBCHyper,
    AdamHyper,
    AdamWBCHyper,
    AdamWHyper,
    AdEMAMixHyper,
    Hyper,
    MacAdamHyper,
    RMSpropHyper,
    SGDHyper,
    RAdamHyper,
    LionHyper,
)
from .hyper import AdamWScheduleFreeHyper, SGDScheduleFreeHyper


__all__ = [
    "PARAM",
    "ROW",
    "COL",
    "SCALAR",
    "RULES",
    "RuleSpec",
    "StateSpec",
    "adadelta_noise_var_ema",
    "adafactor_noise_var_ema",
    "adam_noise_var_ema",
    "rmsprop_noise_var_ema",
    "adagrad_noise_var_sum",
    "ademamix_scalars",
    "ademamix_schedule",
    "by_cli_name",
    "get",
    "macadam_kappa",
    "of",
    "register",
    "state_shape",
    "radam_rectification",
]
__all__ += ["schedule_free_scalars"]

PARAM, ROW, COL, SCALAR = "param", "row", "col", "scalar"
STATE_SHAPES = (PARAM, ROW, COL, SCALAR)
DOMAINS = ("real", "nonnegative", "positive")


def state_shape(kind: str, param_shape) -> tuple[int, ...]:
    """The shape of a state of shape kind ``kind`` for a parameter of ``param_shape``.

    Raises ValueError for an unknown kind."""
    shape = tuple(int(n) for n in param_shape)
    if kind == PARAM:
        return shape
    if kind == ROW:
        return shape[:-1] if len(shape) >= 2 else shape
    if kind == COL:
        return shape[:-2] + shape[-1:] if len(shape) >= 2 else ()
    if kind == SCALAR:
        return ()
    raise ValueError(f"invalid state shape kind {kind!r}: expected one of {STATE_SHAPES}")


def factor_sizes(param_shape) -> tuple[int, int]:
    """(inner, matrix) of a parameter: its trailing dimension and the size of its trailing
    matrix (``p.shape[-1]`` and ``p.shape[-2] * p.shape[-1]``; ``(1, numel)`` below 2
    dimensions). Flat element j of the parameter has row-state index ``j // inner`` and
    col-state index ``(j // matrix) * inner + j % inner``: what the fused backends need to
    address "row" and "col" states from a flat block."""
    shape = tuple(int(n) for n in param_shape)
    if len(shape) < 2:
        return 1, math.prod(shape)
    return shape[-1], shape[-2] * shape[-1]


@dataclass(frozen=True)
class StateSpec:
    """One optimizer state of an update rule (float32 whatever the parameter dtype).

    Attributes:
        name: the key in ``optimizer.state[p]`` and in the backends' ``states`` dict.
        shape: ``"param"``, ``"row"``, ``"col"`` or ``"scalar"`` (module docstring).
        domain: ``"real"``, ``"nonnegative"`` (second moments) or ``"positive"`` (scales):
            the values the update keeps it in (tests draw random states from it).
        kernel: handed to the backends' ``step`` (False: kept by the front-end only).
        needed: ``hyper -> bool``; None means always. A state not needed for a group's
            hyper-parameters is never allocated and reaches the backends as None
            (DP-SGD's momentum buffer with momentum 0).
        init: ``hyper -> float``, the value a fresh state is filled with; None means 0
            (DP-Adagrad's ``sum`` starts at ``initial_accumulator_value``).
    """

    name: str
    shape: str = PARAM
    domain: str = "real"
    kernel: bool = True
    needed: Callable[[Hyper], bool] | None = field(default=None, compare=False)
    init: Callable[[Hyper], float] | None = field(default=None, compare=False)

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"invalid state name {self.name!r}: expected an identifier")
        state_shape(self.shape, ())  # validates the kind
        if self.domain not in DOMAINS:
            raise ValueError(f"invalid domain {self.domain!r} of state {self.name!r}")

    def shape_for(self, param_shape) -> tuple[int, ...]:
        """This state's shape for a parameter (or local shard) of ``param_shape``."""
        return state_shape(self.shape, param_shape)

    def is_needed(self, hyper: Hyper) -> bool:
        return self.needed is None or bool(self.needed(hyper))

    def initial_value(self, hyper: Hyper) -> float:
        """The value a fresh state starts at for these hyper-parameters (0.0 by default)."""
        return 0.0 if self.init is None else float(self.init(hyper))


@dataclass(frozen=True)
class RuleSpec:
    """Everything dpkern knows about one update rule, besides its math.

    Attributes:
        name: Python spelling (``Hyper.rule``, ``dp_<name>``, ``update_<name>``).
        cli_name: command-line spelling (``--optimizer``), also the result tables'.
        title: the name in prose (``"DP-AdamBC"``).
        hyper_class: its frozen hyper-parameter dataclass (:mod:`dpkern.hyper`), whose
            ``rule`` is ``name``.
        optimizer: the name of its class in :mod:`dpkern.optim`.
        states: its optimizer states, kernel states in the order backends receive them.
        decoupled_decay: weight decay p <- p (1 - lr wd) before the update (AdamW), not
            coupled into the gradient.
        noise_bias_correction: the second moment can be corrected for the noise variance
            (DP-AdamBC's phi, SPEC 5.3): the front-end keeps ``noise_var_avg`` and passes
            phi_t to the backends as ``DPStep.noise_var_avg``. For a rule whose hyper
            class has a ``noise_bias_correction`` field the correction is that field
            (:meth:`corrects`); otherwise it is always on.
        noise_var_ema: ``(hyper, phi_prev, Phi_t, t) -> phi_t``, the rule's recursion of
            phi from the noise variance Phi_t = (sigma_t C / B_e)^2 in force at its step t
            (SPEC 5.3 for the Adam form); required with ``noise_bias_correction``.
        whitening: per-sample gradients are whitened before clipping (DP-MacAdam, SPEC 7):
            no ``max_grad_norm`` (the bound is 1), noise std sigma, pass 1 through
            ``whitened_norms`` and a global scale update (``macadam_update_scale``) after
            the step.
        second_moment: keeps a second-moment estimate (``exp_avg_sq``).
        ghost: ghost clipping (:mod:`dpkern.ghost`) can serve it: its clipping works on
            the raw per-sample gradients.
        lr_grid: the learning rates ``dpkern compare`` tries (they bracket the best values
            of a 5-point sweep at epsilon 1 and 7 on digits, seed 0).
        finetune_lr: the default ``--lr`` of ``dpkern finetune`` (and ``dpkern audit``)
            with this rule (``lr_grid`` is compare's, on digits): the lowest validation
            loss of a x3 grid (x10 for the BC rules) of 40-step runs of finetune's
            default job (the built-in GPT-2 on the help pages, epsilon 8, seed 0),
            confirmed at its 150 steps (seed 1; DP-RAdam, whose rectified steps start
            small, chosen there: 3e-2, where 40 steps prefer 0.3); 2026-12-06. None:
            those commands ask for ``--lr``.
        section: where SPEC.md defines it. source: the algorithm's reference.
    """

    name: str
    cli_name: str
    title: str
    hyper_class: type
    optimizer: str
    states: tuple[StateSpec, ...]
    decoupled_decay: bool = False
    noise_bias_correction: bool = False
    whitening: bool = False
    second_moment: bool = False
    ghost: bool = True
    lr_grid: tuple[float, ...] = ()
    finetune_lr: float | None = None
    section: str = ""
    source: str = ""
    noise_var_ema: Callable[[Hyper, float, float, int], float] | None = field(
        default=None, compare=False
    )

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"invalid rule name {self.name!r}: expected an identifier")
        if getattr(self.hyper_class, "rule", None) != self.name:
            raise ValueError(
                f"rule {self.name!r}: {self.hyper_class.__name__}.rule is "
                f"{getattr(self.hyper_class, 'rule', None)!r}"
            )
        names = [s.name for s in self.states]
        if len(set(names)) != len(names) or "step" in names:
            raise ValueError(f"rule {self.name!r}: state names {names} repeat or include 'step'")
        if self.noise_bias_correction != ("noise_var_avg" in names):
            raise ValueError(
                f"rule {self.name!r}: noise_bias_correction needs a 'noise_var_avg' state "
                "(and only it has one)"
            )
        if self.noise_bias_correction and not self.second_moment:
            raise ValueError(f"rule {self.name!r}: noise_bias_correction needs a second moment")
        if self.noise_bias_correction and self.noise_var_ema is None:
            raise ValueError(f"rule {self.name!r}: noise_bias_correction needs noise_var_ema")
        if self.finetune_lr is not None and not (
            isinstance(self.finetune_lr, (int, float)) and 0 < self.finetune_lr < math.inf
        ):
            raise ValueError(
                f"rule {self.name!r}: finetune_lr must be a finite number > 0, got "
                f"{self.finetune_lr!r}"
            )

    # -- derived views -------------------------------------------------------------------
    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states)

    @property
    def kernel_states(self) -> tuple[StateSpec, ...]:
        """The states the backends receive, in order."""
        return tuple(s for s in self.states if s.kernel)

    @property
    def kernel_state_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.kernel_states)

    @property
    def fsdp(self) -> bool:
        """Coordinate sharding (FSDP2) can serve it: every state is element-wise (shaped
        like the parameter) or a per-parameter scalar, so a shard's states are the slice
        of the unsharded ones."""
        return all(s.shape in (PARAM, SCALAR) for s in self.states)

    @property
    def hyper_fields(self) -> tuple[str, ...]:
        """Field names of the hyper-parameter dataclass."""
        return tuple(f.name for f in dataclasses.fields(self.hyper_class))

    def state(self, name: str) -> StateSpec:
        for s in self.states:
            if s.name == name:
                return s
        raise KeyError(f"rule {self.name!r} has no state {name!r}")

    def corrects(self, hyper: Hyper) -> bool:
        """Whether this group's update corrects its second moment for the noise variance
        (keeps phi): the rule can, and its hyper-parameters' ``noise_bias_correction``
        (where the dataclass has that field) is on."""
        return self.noise_bias_correction and bool(getattr(hyper, "noise_bias_correction", True))

    def next_noise_var(self, hyper: Hyper, prev: float, noise_var: float, t: int) -> float:
        """phi_t from phi_{t-1} = ``prev`` and Phi_t = ``noise_var`` at the rule's step t
        (0.0 when the group does not correct)."""
        if not self.corrects(hyper):
            return 0.0
        return float(self.noise_var_ema(hyper, prev, noise_var, t))

    def needed_states(self, hyper: Hyper) -> tuple[str, ...]:
        """The states this group's hyper-parameters use (the others are never allocated)."""
        return tuple(s.name for s in self.states if s.is_needed(hyper))

    def optimizer_class(self) -> type:
        """The :mod:`dpkern.optim` class (imported on first use)."""
        from . import optim

        return getattr(optim, self.optimizer)

    def optimizer_options(self) -> frozenset[str]:
        """The argument names of its optimizer class's constructor (``"max_grad_norm"`` is
        absent for whitening rules, ``"weight_decay"`` for rules without decay)."""
        params = inspect.signature(self.optimizer_class().__init__).parameters
        return frozenset(params) - {"self", "params"}


_REGISTRY: dict[str, RuleSpec] = {}
#: name -> RuleSpec, in registration order (read-only).
RULES: Mapping[str, RuleSpec] = MappingProxyType(_REGISTRY)


def register(spec: RuleSpec) -> RuleSpec:
    """Add a rule to the registry. Raises ValueError if its name or cli_name is taken."""
    for other in _REGISTRY.values():
        if spec.name == other.name or spec.cli_name == other.cli_name:
            raise ValueError(f"rule {spec.name!r} / {spec.cli_name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def get(name: str) -> RuleSpec:
    """The spec of rule ``name``. Raises ValueError naming the registered rules."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown update rule {name!r}: expected one of {tuple(_REGISTRY)}"
        ) from None


def of(hyper: Hyper) -> RuleSpec:
    """The spec of a hyper-parameter dataclass instance (``get(hyper.rule)``)."""
    return get(hyper.rule)


def by_cli_name(cli_name: str) -> RuleSpec:
    """The spec whose command-line name is ``cli_name``. Raises ValueError."""
    for spec in _REGISTRY.values():
        if spec.cli_name == cli_name:
            return spec
    raise ValueError(
        f"unknown optimizer {cli_name!r}: expected one of "
        f"{', '.join(s.cli_name for s in _REGISTRY.values())}"
    )


def macadam_kappa(beta1: float, t: int) -> float:
    """kappa_t = 2 (beta1 - beta1^t) / (1 + beta1) (SPEC section 7): E[S] / Var[g~] of
    DP-MacAdam's variance EMA. A host-side scalar every backend computes this way."""
    return 2 * (beta1 - beta1**t) / (1 + beta1)


# --------------------------------------------------------------------------------------
# The rules
# --------------------------------------------------------------------------------------
_MOMENTS = (
    StateSpec("exp_avg"),
    StateSpec("exp_avg_sq", domain="nonnegative"),
)
_PHI = StateSpec("noise_var_avg", SCALAR, domain="nonnegative", kernel=False)


def adam_noise_var_ema(hyper: Hyper, prev: float, noise_var: float, t: int) -> float:
    """The Adam form (SPEC 5.3): phi_t = beta2 phi_{t-1} + (1 - beta2) Phi_t, bias-corrected
    by the update like v. Python floats (double)."""
    return hyper.beta2 * prev + (1 - hyper.beta2) * noise_var


_SMALL_LRS = (1e-3, 3e-3, 1e-2, 3e-2)
_BC_LRS = (1e-5, 3e-5, 1e-4, 3e-4)

register(
    RuleSpec(
        "sgd",
        "dp-sgd",
        "DP-SGD",
        SGDHyper,
        "DPSGD",
        (StateSpec("momentum_buffer", needed=lambda h: h.momentum != 0),),
        lr_grid=(0.125, 0.25, 0.5, 1.0),
        finetune_lr=0.3,
        section="5.1",
        source='Abadi et al. 2016, "Deep Learning with Differential Privacy", Algorithm 1',
    )
)
register(
    RuleSpec(
        "adam",
        "dp-adam",
        "DP-Adam",
        AdamHyper,
        "DPAdam",
        _MOMENTS,
        second_moment=True,
        lr_grid=_SMALL_LRS,
        finetune_lr=5e-3,
        section="5.2",
        source="Abadi et al. 2016 with Kingma & Ba 2015 (TensorFlow Privacy, Opacus)",
    )
)
register(
    RuleSpec(
        "adam_bc",
        "dp-adambc",
        "DP-AdamBC",
        AdamBCHyper,
        "DPAdamBC",
        (*_MOMENTS, _PHI),
        noise_bias_correction=True,
        second_moment=True,
        lr_grid=_BC_LRS,
        finetune_lr=1e-3,
        section="5.3",
        source="Tang et al., AAAI 2024, arXiv 2312.14334, Algorithm 1",
        noise_var_ema=adam_noise_var_ema,
    )
)
register(
    RuleSpec(
        "adamw",
        "dp-adamw",
        "DP-AdamW",
        AdamWHyper,
        "DPAdamW",
        _MOMENTS,
        decoupled_decay=True,
        second_moment=True,
        lr_grid=_SMALL_LRS,
        finetune_lr=5e-3,
        section="5.4",
        source="arXiv 2511.07843, Algorithm 1; Loshchilov & Hutter 2019",
    )
)
register(
    RuleSpec(
        "adamw_bc",
        "dp-adamw-bc",
        "DP-AdamW-BC",
        AdamWBCHyper,
        "DPAdamWBC",
        (*_MOMENTS, _PHI),
        decoupled_decay=True,
        noise_bias_correction=True,
        second_moment=True,
        lr_grid=_BC_LRS,
        finetune_lr=1e-3,
        section="5.5",
        source="arXiv 2511.07843, Algorithm 2",
        noise_var_ema=adam_noise_var_ema,
    )
)
register(
    RuleSpec(
        "macadam",
        "dp-macadam",
        "DP-MacAdam",
        MacAdamHyper,
        "DPMacAdam",
        (
            *_MOMENTS,
            StateSpec("exp_var", domain="nonnegative"),
            StateSpec("scale", domain="positive"),
        ),
        whitening=True,
        second_moment=True,
        ghost=False,
        lr_grid=(3e-4, 1e-3, 3e-3, 1e-2),
        finetune_lr=5e-3,
        section="7",
        source="arXiv 2606.05435, Algorithm 1; AdaClip, arXiv 1908.07643",
    )
)


# --------------------------------------------------------------------------------------
# Schedule-free DP-SGD and DP-AdamW (SPEC 10.8)
# --------------------------------------------------------------------------------------
def schedule_free_scalars(hyper: Hyper, t: int) -> tuple[float, float, float, float]:
    """(lr_t, lr_max_t, weight_sum_t, c_t) of schedule-free step t (SPEC 10.8), from the
    group's ``hyper.lr_max`` and ``hyper.weight_sum`` before the step, in Python floats
    (double), operation by operation as ``schedulefree``'s ``step``:

        lr_t = lr * min(1, t / warmup_steps)           (linear warmup, k = t - 1 < warmup)
        lr_max_t = max(lr_t, lr_max);  w_t = t^r * lr_max_t^weight_lr_power
        weight_sum_t = weight_sum + w_t;  c_t = w_t / weight_sum_t  (0 when weight_sum_t = 0)

    A host-side computation every backend does this way; the optimizer class stores
    lr_max_t and weight_sum_t in the param group after the step."""
    k = t - 1
    sched = (k + 1) / hyper.warmup_steps if k < hyper.warmup_steps else 1.0
    lr = hyper.lr * sched
    lr_max = max(lr, hyper.lr_max)
    weight = ((k + 1) ** hyper.r) * (lr_max**hyper.weight_lr_power)
    weight_sum = hyper.weight_sum + weight
    ckp1 = weight / weight_sum if weight_sum != 0 else 0.0
    return lr, lr_max, weight_sum, ckp1


_SF_Z = StateSpec("z")  # the base sequence z (schedulefree's name); set to p at t = 1

register(
    RuleSpec(
        "sgd_schedule_free",
        "dp-sgd-schedulefree",
        "Schedule-free DP-SGD",
        SGDScheduleFreeHyper,
        "DPSGDScheduleFree",
        (_SF_Z,),
        lr_grid=(0.25, 0.5, 1.0, 2.0),
        finetune_lr=1.0,
        section="10.8",
        source=(
            'Defazio et al. 2024, "The Road Less Scheduled", arXiv 2405.15682, section 2 '
            "(schedule-free SGD); schedulefree.SGDScheduleFree"
        ),
    )
)
register(
    RuleSpec(
        "adamw_schedule_free",
        "dp-adamw-schedulefree",
        "Schedule-free DP-AdamW",
        AdamWScheduleFreeHyper,
        "DPAdamWScheduleFree",
        (
            _SF_Z,
            StateSpec("exp_avg_sq", domain="nonnegative"),
            StateSpec(
                "noise_var_avg",
                SCALAR,
                domain="nonnegative",
                kernel=False,
                needed=lambda h: h.noise_bias_correction,
            ),
        ),
        noise_bias_correction=True,
        second_moment=True,
        lr_grid=(3e-3, 1e-2, 3e-2, 1e-1),  # digits eps 1: best at 1e-2, the old top
        finetune_lr=5e-3,
        section="10.8",
        source=(
            'Defazio et al. 2024, "The Road Less Scheduled", arXiv 2405.15682, Algorithm 1 '
            "(schedule-free AdamW); schedulefree.AdamWScheduleFree; the noise bias "
            "correction of Tang et al., arXiv 2312.14334"
        ),
        noise_var_ema=adam_noise_var_ema,
    )
)


# --------------------------------------------------------------------------------------
# DP-RMSprop (SPEC 10.1)
# --------------------------------------------------------------------------------------
def rmsprop_noise_var_ema(hyper: Hyper, prev: float, noise_var: float, t: int) -> float:
    """phi_t = alpha phi_{t-1} + (1 - alpha) Phi_t (SPEC 10.1): the noise part of E[v_t]
    under RMSprop's EMA (no bias correction, like v). Python floats (double)."""
    return hyper.alpha * prev + (1 - hyper.alpha) * noise_var


register(
    RuleSpec(
        "rmsprop",
        "dp-rmsprop",
        "DP-RMSprop",
        RMSpropHyper,
        "DPRMSprop",
        (
            StateSpec("square_avg", domain="nonnegative"),
            StateSpec("momentum_buffer", needed=lambda h: h.momentum > 0),
            StateSpec("grad_avg", needed=lambda h: h.centered),
            StateSpec(
                "noise_var_avg",
                SCALAR,
                domain="nonnegative",
                kernel=False,
                needed=lambda h: h.noise_bias_correction,
            ),
        ),
        noise_bias_correction=True,
        second_moment=True,
        lr_grid=(3e-4, 1e-3, 3e-3, 1e-2),  # digits eps 1: best at 3e-3, the old top
        finetune_lr=1e-3,
        section="10.1",
        source="Tieleman & Hinton 2012, Lecture 6.5 (RMSprop); Graves 2013, arXiv "
        "1308.0850, eqs. 38-41 (centered); torch.optim.RMSprop",
        noise_var_ema=rmsprop_noise_var_ema,
    )
)


# --------------------------------------------------------------------------------------
# DP-Adagrad (SPEC 10.2)
# --------------------------------------------------------------------------------------
def adagrad_noise_var_sum(hyper: Hyper, prev: float, noise_var: float, t: int) -> float:
    """phi_t = phi_{t-1} + Phi_t (SPEC 10.2): the noise part of E[sum_t], cumulative like
    Adagrad's accumulator. Python floats (double)."""
    return prev + noise_var


register(
    RuleSpec(
        "adagrad",
        "dp-adagrad",
        "DP-Adagrad",
        AdagradHyper,
        "DPAdagrad",
        (
            StateSpec("sum", domain="nonnegative", init=lambda h: h.initial_accumulator_value),
            StateSpec(
                "noise_var_avg",
                SCALAR,
                domain="nonnegative",
                kernel=False,
                needed=lambda h: h.noise_bias_correction,
            ),
        ),
        noise_bias_correction=True,
        second_moment=True,
        lr_grid=(1e-2, 3e-2, 1e-1, 3e-1),  # digits eps 1: best at 1e-1, the old top
        finetune_lr=1e-2,
        section="10.2",
        source="Duchi, Hazan & Singer 2011, JMLR 12, Figure 1 (diagonal AdaGrad); "
        "torch.optim.Adagrad",
        noise_var_ema=adagrad_noise_var_sum,
    )
)


# --------------------------------------------------------------------------------------
# DP-Adadelta (SPEC 10.5)
# --------------------------------------------------------------------------------------
def adadelta_noise_var_ema(hyper: Hyper, prev: float, noise_var: float, t: int) -> float:
    """SPEC 10.5: phi_t = rho phi_{t-1} + (1 - rho) Phi_t, the noise part of square_avg
    (no bias correction: Adadelta's EMAs start at 0 and are used as they are)."""
    return hyper.rho * prev + (1 - hyper.rho) * noise_var


def _corrects(h) -> bool:
    return h.noise_bias_correction


register(
    RuleSpec(
        "adadelta",
        "dp-adadelta",
        "DP-Adadelta",
        AdadeltaHyper,
        "DPAdadelta",
        (
            StateSpec("square_avg", domain="nonnegative"),
            StateSpec("acc_delta", domain="nonnegative"),
            StateSpec("acc_delta_noise_var", domain="nonnegative", needed=_corrects),
            StateSpec(
                "noise_var_avg", SCALAR, domain="nonnegative", kernel=False, needed=_corrects
            ),
        ),
        noise_bias_correction=True,
        second_moment=True,
        lr_grid=(0.3, 1.0, 3.0, 10.0),  # digits eps 1: best at 2, the old top
        finetune_lr=1.0,
        section="10.5",
        source='Zeiler 2012, "ADADELTA: An Adaptive Learning Rate Method", arXiv 1212.5701, '
        "Algorithm 1; torch.optim.Adadelta",
        noise_var_ema=adadelta_noise_var_ema,
    )
)


# --------------------------------------------------------------------------------------
# DP-AdEMAMix (SPEC 10.6)
# --------------------------------------------------------------------------------------
def ademamix_schedule(hyper: Hyper, t: int) -> tuple[float, float]:
    """(alpha_t, beta3_t) at the rule's step t (SPEC 10.6; Pagliardini et al. 2024, Section
    3): with T = t_alpha_beta3 > 0, alpha_t = min(t alpha / T, alpha) and
    beta3_t = min(exp(ln b1 ln b3 / ((1 - t/T) ln b3 + (t/T) ln b1)), b3); (alpha, beta3)
    for T = 0 and t >= T. A host-side pair (Python floats, double) every backend computes
    this way."""
    T = hyper.t_alpha_beta3
    if not T or t >= T:
        return float(hyper.alpha), float(hyper.beta3)
    a = t / T
    alpha_t = min(t * hyper.alpha / T, hyper.alpha)
    l1, l3 = math.log(hyper.beta1), math.log(hyper.beta3)
    beta3_t = min(math.exp(l1 * l3 / ((1 - a) * l3 + a * l1)), hyper.beta3)
    return float(alpha_t), float(beta3_t)


def ademamix_scalars(hyper: Hyper, t: int) -> tuple[float, float, float, float, float]:
    """(beta3_t, A, B, E, G) of SPEC 10.6's computed form p (1 - lr wd) - (A m1 + B m2) /
    (sqrt(vc) + E): with s = sqrt(1 - beta2^t), A = lr s / (1 - beta1^t),
    B = lr alpha_t s, E = eps s and G = gamma (1 - beta2^t) (0 without the correction).
    Host-side doubles that every backend computes this way (csrc/rules.h, make_consts)."""
    alpha_t, beta3_t = ademamix_schedule(hyper, t)
    bc1, bc2 = 1 - hyper.beta1**t, 1 - hyper.beta2**t
    s = math.sqrt(bc2)
    G = hyper.gamma * bc2 if hyper.noise_bias_correction else 0.0
    return beta3_t, hyper.lr * s / bc1, hyper.lr * alpha_t * s, hyper.eps * s, G


register(
    RuleSpec(
        "ademamix",
        "dp-ademamix",
        "DP-AdEMAMix",
        AdEMAMixHyper,
        "DPAdEMAMix",
        (
            StateSpec("exp_avg"),
            StateSpec("exp_avg_slow"),
            StateSpec("exp_avg_sq", domain="nonnegative"),
            StateSpec(
                "noise_var_avg", SCALAR, domain="nonnegative", kernel=False, needed=_corrects
            ),
        ),
        decoupled_decay=True,
        noise_bias_correction=True,
        second_moment=True,
        lr_grid=(1e-3, 3e-3, 1e-2, 3e-2),  # digits eps 1: best at 1e-2, the old top
        finetune_lr=5e-3,
        section="10.6",
        source='Pagliardini, Ablin, Grangier 2024, "The AdEMAMix Optimizer: Better, Faster, '
        'Older", arXiv 2409.03137, Algorithm 1 and Section 3 (schedulers)',
        noise_var_ema=adam_noise_var_ema,
    )
)


# --------------------------------------------------------------------------------------
# DP-RAdam (SPEC 10.3)
# --------------------------------------------------------------------------------------
def radam_rectification(beta2: float, t: int) -> float | None:
    """RAdam's rectification r_t at step t (SPEC 10.3), or None for a warm-up step
    (rho_t <= 5: the un-adapted step lr m_hat). rho_inf = 2 / (1 - beta2) - 1,
    rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t), r_t = sqrt((rho_t - 4)(rho_t - 2) rho_inf
    / ((rho_inf - 4)(rho_inf - 2) rho_t)), evaluated as torch.optim.RAdam does, in double.
    A host-side scalar: the branch and r_t depend on (beta2, t) only."""
    rho_inf = 2 / (1 - beta2) - 1
    bias_correction2 = 1 - beta2**t
    rho_t = rho_inf - 2 * t * (beta2**t) / bias_correction2
    if not rho_t > 5.0:
        return None
    return ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5


register(
    RuleSpec(
        "radam",
        "dp-radam",
        "DP-RAdam",
        RAdamHyper,
        "DPRAdam",
        (
            *_MOMENTS,
            StateSpec(
                "noise_var_avg",
                SCALAR,
                domain="nonnegative",
                kernel=False,
                needed=lambda h: h.noise_bias_correction,
            ),
        ),
        noise_bias_correction=True,
        second_moment=True,
        lr_grid=(3e-3, 1e-2, 3e-2, 1e-1),  # digits, epsilon 7, seed 0: best 3e-2
        finetune_lr=3e-2,
        section="10.3",
        source=(
            'Liu et al., "On the Variance of the Adaptive Learning Rate and Beyond", ICLR '
            "2020, arXiv 1908.03265, Algorithm 2; torch.optim.RAdam; the correction of Tang "
            "et al., arXiv 2312.14334"
        ),
        noise_var_ema=adam_noise_var_ema,
    )
)


# --------------------------------------------------------------------------------------
# DP-Lion (SPEC 10.4)
# --------------------------------------------------------------------------------------
register(
    RuleSpec(
        "lion",
        "dp-lion",
        "DP-Lion",
        LionHyper,
        "DPLion",
        (StateSpec("exp_avg"),),
        decoupled_decay=True,
        # Lion's best lr is 3-10x below AdamW's; digits, epsilon 7, seed 0: best 3e-3
        lr_grid=(3e-4, 1e-3, 3e-3, 1e-2),
        finetune_lr=3e-3,
        section="10.4",
        source=(
            'Chen et al., "Symbolic Discovery of Optimization Algorithms", NeurIPS 2023, '
            "arXiv 2302.06675, Algorithm 2; lion_pytorch.Lion"
        ),
    )
)


# --------------------------------------------------------------------------------------
# DP-Adafactor (SPEC 10.7)
# --------------------------------------------------------------------------------------
def adafactor_weight(hyper: Hyper, t: int) -> float:
    """w_t = t^beta2_decay, the weight of the newest term in Adafactor's EMAs (torch's
    ``one_minus_beta2_t``; 1 at t = 1). A Python float (double)."""
    return float(t) ** hyper.beta2_decay


def adafactor_noise_var_ema(hyper: Hyper, prev: float, noise_var: float, t: int) -> float:
    """phi_t = (1 - w_t) phi_{t-1} + w_t Phi_t, w_t = t^beta2_decay (SPEC 10.7): phi follows
    Adafactor's own beta2_t schedule, as its row and column factors do."""
    w = adafactor_weight(hyper, t)
    return (1 - w) * prev + w * noise_var


register(
    RuleSpec(
        "adafactor",
        "dp-adafactor",
        "DP-Adafactor",
        AdafactorHyper,
        "DPAdafactor",
        (
            # >= 2-D: the factored row / column EMAs of g_hat^2; < 2-D: "row" is p.shape and
            # row_var holds torch's unfactored "variance" (col_var is an unused 0-dim zero)
            StateSpec("row_var", ROW, domain="nonnegative"),
            StateSpec("col_var", COL, domain="nonnegative"),
            StateSpec(
                "noise_var_avg",
                SCALAR,
                domain="nonnegative",
                kernel=False,
                needed=lambda h: h.noise_bias_correction,
            ),
        ),
        decoupled_decay=True,
        noise_bias_correction=True,
        second_moment=True,
        lr_grid=(1e-2, 3e-2, 1e-1, 3e-1),  # digits eps 1: flat at 3e-2..1e-1
        finetune_lr=0.1,
        section="10.7",
        source="Shazeer & Stern, ICML 2018, arXiv 1804.04235, Algorithms 4-5; "
        "torch.optim.Adafactor",
        noise_var_ema=adafactor_noise_var_ema,
    )
)
