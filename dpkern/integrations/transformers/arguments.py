"""The privacy settings of a :class:`~dpkern.integrations.transformers.DPTrainer` run:
:class:`PrivacyArguments` (validated at construction) and the DP optimizers it can name."""

from __future__ import annotations

import dataclasses

import math
from dataclasses import dataclass

from ... import optim, rules

#: ``PrivacyArguments.optimizer`` names (as ``dpkern finetune --optimizer``): the rules of
#: the registry that ghost clipping can serve.
OPTIMIZERS = {s.cli_name: getattr(optim, s.optimizer) for s in rules.RULES.values() if s.ghost}
_VERIFY = ("first", "always", "off")
_ACCOUNTANTS = ("rdp", "pld")


def _finite_positive(name, value, *, allow_none=False):
    if value is None and allow_none:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"invalid {name}={value!r}: expected a finite number > 0")
    return float(value)


@dataclass
class PrivacyArguments:
    """The privacy settings of a :class:`DPTrainer` run (the rest is TrainingArguments).

    Args:
        target_epsilon: the epsilon the whole run may spend (finite, > 0); sigma is
            calibrated to it from the run's length (T steps at rate q, see the module doc).
        noise_multiplier: instead of ``target_epsilon``: a given sigma (finite, >= 0; the
            noise std is sigma * C); the epsilon it spends is logged. Exactly one of the
            two is given.
        target_delta: delta, in (0, 1); None (default): 1 / N^1.1 for N training
            examples (warned when >= 1 / N).
        max_grad_norm: the per-sample clipping bound C (L2 over all trainable
            parameters, > 0); None (default): ``TrainingArguments.max_grad_norm``.
        accountant: ``"rdp"`` (default) or ``"pld"`` (:mod:`dpkern.accounting`).
        optimizer: None (default: from ``TrainingArguments.optim``: ``adamw_*`` ->
            ``"dp-adamw"``, ``sgd`` -> ``"dp-sgd"``) or one of ``"dp-sgd"``,
            ``"dp-adam"``, ``"dp-adambc"``, ``"dp-adamw"``, ``"dp-adamw-bc"``
            (DP-MacAdam needs per-sample gradients, which ghost clipping does not give).
        loss_normalizer: the constant each per-sample summed token loss is divided by
            (finite, > 0; default 1: the sum). Use the block size your examples are
            tokenised to for mean-token-scale losses. It never depends on the batch.
        noise_seed: None (default, private): the noise key is drawn from os.urandom and
            never saved, and the sampling is seeded from os.urandom. An int in
            [0, 2**64) is the noise key and seeds the sampling: a reproducible run that
            is **not private**.
        backend: the dpkern optimizer backend (``"auto"``, ``"torch"``, ``"triton"``,
            ``"cpp"``).
        verify: ghost clipping's first-step check (``"first"``, ``"always"``, ``"off"``).
        check_first_step: after the first optimizer step, raise if a trainable
            parameter did not change (:class:`dpkern.integrations.UpdateCheck`; the
            model moved to another device after the optimizer was built). Turn it off
            only for updates below the parameter dtype's resolution.
        stochastic_rounding: round each update of a bfloat16 weight stochastically
            (unbiased; SPEC 3.2) instead of to nearest, so that updates below a bf16 ulp
            are not lost (default False). float32 / float16 weights are unaffected.
    Raises:
        ValueError: an invalid value, named."""

    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    target_delta: float | None = None
    max_grad_norm: float | None = None
    accountant: str = "rdp"
    optimizer: str | None = None
    loss_normalizer: float = 1.0
    noise_seed: int | None = None
    backend: str = "auto"
    verify: str = "first"
    check_first_step: bool = True
    stochastic_rounding: bool = False

    def __post_init__(self):
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise ValueError(
                "give exactly one of target_epsilon (sigma calibrated to it) and "
                f"noise_multiplier, got target_epsilon={self.target_epsilon!r}, "
                f"noise_multiplier={self.noise_multiplier!r}"
            )
        self.target_epsilon = _finite_positive(
            "target_epsilon", self.target_epsilon, allow_none=True
        )
        if self.noise_multiplier is not None:
            s = self.noise_multiplier
            if (
                isinstance(s, bool)
                or not isinstance(s, (int, float))
                or not math.isfinite(s)
                or s < 0
            ):
                raise ValueError(f"invalid noise_multiplier={s!r}: expected a finite number >= 0")
            self.noise_multiplier = float(s)
        if self.target_delta is not None:
            d = self.target_delta
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d < 1:
                raise ValueError(f"invalid target_delta={d!r}: expected None or a float in (0, 1)")
            self.target_delta = float(d)
        self.max_grad_norm = _finite_positive("max_grad_norm", self.max_grad_norm, allow_none=True)
        if self.accountant not in _ACCOUNTANTS:
            raise ValueError(
                f"invalid accountant={self.accountant!r}: expected one of {_ACCOUNTANTS}"
            )
        if self.optimizer in {s.cli_name for s in rules.RULES.values() if not s.ghost}:
            raise ValueError(
                f"optimizer={self.optimizer!r} clips whitened per-sample gradients, which "
                "ghost clipping cannot give; DPTrainer supports " + ", ".join(OPTIMIZERS)
            )
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"invalid optimizer={self.optimizer!r}: expected None or one of {list(OPTIMIZERS)}"
            )
        self.loss_normalizer = _finite_positive("loss_normalizer", self.loss_normalizer)
        s = self.noise_seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**64):
            raise ValueError(f"invalid noise_seed={s!r}: expected None or an int in [0, 2**64)")
        if self.verify not in _VERIFY:
            raise ValueError(f"invalid verify={self.verify!r}: expected one of {_VERIFY}")
        if not isinstance(self.check_first_step, bool):
            raise ValueError(f"invalid check_first_step={self.check_first_step!r}: expected a bool")
        if not isinstance(self.stochastic_rounding, bool):
            raise ValueError(
                f"invalid stochastic_rounding={self.stochastic_rounding!r}: expected a bool"
            )

    @property
    def private(self) -> bool:
        """False when ``noise_seed`` is given (the noise key is known)."""
        return self.noise_seed is None


def _optimizer_name(args) -> str:
    optim_name = str(getattr(args.optim, "value", args.optim))
    if optim_name.startswith("adamw"):
        return "dp-adamw"
    if optim_name == "sgd":
        return "dp-sgd"
    raise ValueError(
        f"TrainingArguments.optim={optim_name!r} has no DP counterpart here: use an adamw_* "
        "optim (DP-AdamW) or 'sgd' (DP-SGD), or name the rule in PrivacyArguments.optimizer "
        f"({', '.join(OPTIMIZERS)})"
    )


def _param_groups(model, decay: set, weight_decay: float) -> list[dict]:
    """The trainable parameters of ``model`` in the Trainer's decay (names in ``decay``) /
    no-decay groups (ValueError: no trainable parameter)."""
    named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    groups = [
        {"params": [q for n, q in named if n in decay], "weight_decay": weight_decay},
        {"params": [q for n, q in named if n not in decay], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("DPTrainer: the model has no trainable parameter")
    return groups


def _optimizer_kwargs(name: str, args) -> dict:
    """The hyper-parameters of the rule ``name`` taken from the TrainingArguments ``args``
    (``learning_rate``; ``adam_beta1/2`` and ``adam_epsilon`` where the rule has them)."""
    kw = {"lr": args.learning_rate}
    spec = rules.by_cli_name(name)
    options, fields = spec.optimizer_options(), spec.hyper_fields
    if "betas" in options:
        kw["betas"] = (args.adam_beta1, args.adam_beta2)
        if "beta3" in fields:  # DP-AdEMAMix: Adam's pair, its own slow beta3
            beta3 = next(
                f.default for f in dataclasses.fields(spec.hyper_class) if f.name == "beta3"
            )
            kw["betas"] = (*kw["betas"], beta3)
    if "eps" in options and "eps" in fields:  # Adam's eps (not DP-Adafactor's (eps1, eps2))
        kw["eps"] = args.adam_epsilon
    return kw
