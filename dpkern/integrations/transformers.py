"""Private fine-tuning with the Hugging Face ``Trainer``: :class:`DPTrainer`.

An ordinary Trainer script becomes private by swapping ``Trainer`` for ``DPTrainer`` and
adding :class:`PrivacyArguments`::

    trainer = DPTrainer(model=model, args=TrainingArguments(...), train_dataset=train,
                        data_collator=collator,
                        privacy=PrivacyArguments(target_epsilon=8.0, loss_normalizer=128))
    trainer.train()

What changes against ``transformers.Trainer`` (everything else is the Trainer's own:
logging, evaluation, checkpoints, callbacks, Accelerate):

- **Sampling.** The training loader draws Poisson batches (:mod:`dpkern.sampling`): each
  example is in a logical batch independently with probability q = B_e / N, where the
  expected batch B_e = ``per_device_train_batch_size * gradient_accumulation_steps`` and
  N = ``len(train_dataset)``; batch sizes vary, and a batch may be empty. One epoch is
  ceil(N / B_e) logical steps. Each logical batch is split into
  ``gradient_accumulation_steps`` micro-batches (the Trainer's accumulation loop), and a
  micro-batch larger than ``per_device_train_batch_size`` (a large draw) runs in chunks of
  at most that size: the memory bound stays the Trainer's.
- **Per-sample losses and clipping.** :meth:`DPTrainer.compute_per_sample_loss` gives one
  loss per sample (:func:`per_sample_causal_lm_loss`: summed over the sample's own valid
  tokens, divided by the constant ``loss_normalizer``); ghost clipping
  (:class:`dpkern.ghost.GhostClipping`) clips each sample's gradient over all trainable
  parameters to C and adds the sum into the dpkern optimizer's buffers. Exact on Hugging
  Face causal LMs, PEFT LoRA included (only the trainable parameters are in the norms
  and the noise); the first micro-batch is checked against per-sample autograd.
- **One logical batch, noise once.** The optimizer step at the end of the accumulation
  adds the Gaussian noise (sigma * C) once and applies DP-AdamW (``optim="adamw_*"``,
  the Trainer's default) or DP-SGD (``optim="sgd"``), or the rule named by
  ``PrivacyArguments.optimizer``. Hyper-parameters come from the TrainingArguments
  (``learning_rate``, ``weight_decay`` with the Trainer's no-decay groups, ``adam_*``,
  the LR scheduler). C is ``PrivacyArguments.max_grad_norm``, by default
  ``TrainingArguments.max_grad_norm`` (then a per-sample bound: the Trainer's clipping
  of the summed gradient is not applied).
- **Calibration and accounting.** sigma is calibrated so that the run's T steps
  (``max_steps``, or ``num_train_epochs`` epochs) at rate q spend ``target_epsilon`` at
  ``target_delta`` (default 1 / N^1.1); the accountant (:mod:`dpkern.accounting`) is
  stepped at every optimizer step, and ``epsilon`` is logged with the loss.
- **Checkpoints.** The Trainer's checkpoints also hold ``dpkern_privacy.json`` (the
  ledger, sigma, q, the plan); ``train(resume_from_checkpoint=...)`` restores the
  optimizer state (dpkern's state_dict, never the secure noise key: a resumed secure
  run draws a fresh key), the scheduler and the ledger, and keeps sigma when the plan is
  unchanged (else recalibrates it so that the whole run still meets the target). A
  checkpoint without the ledger (not a DPTrainer's, or ``save_only_model``) is refused.
- **Padding.** Batches must be right-padded (or carry ``position_ids``): with left
  padding a sample's positions would depend on the longest sample of its batch. A
  left-padded batch is a ValueError.
- **What is not logged.** ``grad_norm`` (the norm of ``.grad``, which DP training never
  fills), ``total_flos`` is 0 (it would count the sampled tokens), and nothing counts
  the realised batch; the logged loss is the un-noised training loss
  (sum of per-sample losses / B_e), for the operator only.
- **Refused** (ValueError at construction; the data at ``train()``): more than one
  process or GPU (DDP,
  DataParallel: not tested here; use :mod:`dpkern.distributed` in your own loop or
  ``dpkern finetune --nproc``), DeepSpeed, FSDP, model parallelism, fp16 (its loss
  scaler works on ``.grad``; bf16 works), ``torch_compile``, activation checkpointing,
  label smoothing, NEFTune, ``include_num_input_tokens_seen``, ``auto_find_batch_size``,
  non-random sampling strategies, an iterable dataset, ``optimizers=`` /
  ``optimizer_cls_and_kwargs=`` (the optimizer is built here, with the calibrated
  sigma), ``compute_loss_func`` (pass ``per_sample_loss_func``), hyper-parameter search.

``PrivacyArguments(noise_seed=INT)`` makes the noise key (and the sampling) known: the run
is reproducible (a resumed run equals the uninterrupted one) and **not private**; it logs
``epsilon_if_noise_key_were_secret`` instead of ``epsilon`` and its ledger file says so.

Tested with transformers 5.24, accelerate 1.15 and peft 0.21 (single process, CPU).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from .. import optim, rules
from ..keys import NOT_PRIVATE
from ..accounting import (
    PrivacyAccountant,
    calibrate_extension,
    get_noise_multiplier,
)
from ..ghost import GhostClipping
from ..models import per_sample_causal_lm_loss
from ..sampling import PoissonBatchSampler
from .guard import UpdateCheck, _inner, check_trainable_params

__all__ = [
    "DPTrainer",
    "PrivacyArguments",
    "PoissonMicroBatchSampler",
    "per_sample_causal_lm_loss",
    "UpdateCheck",
    "check_trainable_params",
    "NOT_PRIVATE",
    "PRIVACY_FILE",
]

#: What a run with a known noise key says in place of an epsilon claim.
#: The privacy record written into every checkpoint directory.
PRIVACY_FILE = "dpkern_privacy.json"

#: ``PrivacyArguments.optimizer`` names (as ``dpkern finetune --optimizer``): the rules of
#: the registry that ghost clipping can serve.
OPTIMIZERS = {s.cli_name: getattr(optim, s.optimizer) for s in rules.RULES.values() if s.ghost}
_VERIFY = ("first", "always", "off")
_ACCOUNTANTS = ("rdp", "pld")
#: Log keys never passed on: ``grad_norm`` is the norm of ``.grad`` (not the released
#: gradient; an exact un-noised statistic if anything filled it).
_DROPPED_LOGS = ("grad_norm",)


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

    @property
    def private(self) -> bool:
        """False when ``noise_seed`` is given (the noise key is known)."""
        return self.noise_seed is None


class PoissonMicroBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Poisson-sampled logical batches, each split into ``micro_batches`` micro-batches.

    Every epoch draws ``steps_per_epoch`` logical batches with
    :class:`dpkern.sampling.PoissonBatchSampler` (each example independently with
    probability ``sample_rate``; empty batches included) and yields each as
    ``micro_batches`` consecutive index lists whose sizes differ by at most one (some
    may be empty). A ``DataLoader(dataset, batch_sampler=...)`` then gives the Trainer
    exactly ``micro_batches`` micro-batches per optimizer step.

    Args:
        num_samples: N, the dataset size (int >= 1).
        sample_rate: q in (0, 1].
        steps_per_epoch: logical batches per epoch (int >= 1).
        micro_batches: micro-batches per logical batch (int >= 1; the Trainer's
            ``gradient_accumulation_steps``).
        seed: None (default): each epoch's draw is seeded from os.urandom (never
            stored). An int: epoch e is seeded by a function of (seed, e), so an epoch
            is the same however often it is iterated (a known sampling: not private).
    Raises:
        ValueError: invalid arguments (from PoissonBatchSampler too)."""

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps_per_epoch: int,
        micro_batches: int,
        *,
        seed: int | None = None,
    ):
        for name, v in (("steps_per_epoch", steps_per_epoch), ("micro_batches", micro_batches)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"invalid {name}={v!r}: expected an int >= 1")
        PoissonBatchSampler(num_samples, sample_rate, 1, seed=0)  # validates N and q
        self.num_samples, self.sample_rate = num_samples, float(sample_rate)
        self.steps_per_epoch, self.micro_batches = steps_per_epoch, micro_batches
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration draws (the Trainer and Accelerate call it)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.steps_per_epoch * self.micro_batches

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        seed = None if self.seed is None else (self.seed * 1_000_003 + epoch) % 2**63
        m = self.micro_batches
        draws = PoissonBatchSampler(
            self.num_samples, self.sample_rate, self.steps_per_epoch, seed=seed
        )
        for indices in draws:
            n = len(indices)
            for j in range(m):
                yield indices[n * j // m : n * (j + 1) // m]


def _zero_rows(batch):
    if isinstance(batch, Mapping):
        return {k: _zero_rows(v) for k, v in batch.items()}
    if isinstance(batch, torch.Tensor) and batch.dim() >= 1:
        return batch[:0]
    return batch


class _EmptySafeCollator:
    """The Trainer's collator, and for an empty micro-batch (Poisson sampling draws them)
    the structure of a collated batch with 0 rows (from collating one fixed example:
    collators cannot pad an empty list)."""

    def __init__(self, collate_fn, dataset):
        self.collate_fn, self.dataset = collate_fn, dataset
        self._empty = None

    def __call__(self, features):
        if len(features):
            return self.collate_fn(features)
        if self._empty is None:
            self._empty = _zero_rows(self.collate_fn([self.dataset[0]]))
        return dict(self._empty)


def _batch_rows(inputs) -> int:
    ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
    if isinstance(ids, torch.Tensor):
        return ids.shape[0]
    for v in inputs.values():
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return v.shape[0]
    raise ValueError("DPTrainer: a training batch holds no tensor with a batch dimension")


def _row_chunks(inputs, rows: int, size: int):
    for start in range(0, rows, size):
        yield {
            k: v[start : start + size]
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == rows
            else v
            for k, v in inputs.items()
        }


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


def _refuse(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"DPTrainer: {what}")


def _check_training_args(args) -> None:
    """The TrainingArguments DPTrainer refuses (ValueError naming the field)."""
    _refuse(
        args.world_size <= 1,
        f"world_size={args.world_size}: DPTrainer runs in one process (data-parallel "
        "training through the Trainer is not tested yet; use dpkern.distributed in your "
        "own loop, or dpkern finetune --nproc N)",
    )
    _refuse(
        args.n_gpu <= 1,
        f"n_gpu={args.n_gpu}: torch.nn.DataParallel replicas are not supported (make one "
        "device visible, e.g. CUDA_VISIBLE_DEVICES=0)",
    )
    _refuse(
        not args.fp16,
        "fp16=True: the fp16 loss scaler rescales .grad, which DP training does not use; "
        "use bf16=True or fp32",
    )
    _refuse(not args.deepspeed, "deepspeed is not supported")
    _refuse(not args.fsdp, "fsdp is not supported (dpkern.distributed has FSDP2 for own loops)")
    _refuse(not getattr(args, "torch_compile", False), "torch_compile=True is not supported yet")
    _refuse(
        not (
            getattr(args, "activation_checkpointing", False)
            or getattr(args, "gradient_checkpointing", False)
        ),
        "activation (gradient) checkpointing is not supported yet: ghost clipping records "
        "the forward once",
    )
    _refuse(
        not args.label_smoothing_factor,
        "label_smoothing_factor != 0 is not supported: pass a per_sample_loss_func",
    )
    _refuse(
        getattr(args, "include_num_input_tokens_seen", "no") in ("no", False),
        "include_num_input_tokens_seen would log an exact data-dependent count",
    )
    _refuse(
        getattr(args, "neftune_noise_alpha", None) is None,
        "neftune_noise_alpha scales each sample's embedding noise by the batch's padded "
        "length, which couples the samples",
    )
    _refuse(
        not args.auto_find_batch_size,
        "auto_find_batch_size=True would change the expected batch (and sigma) mid-run",
    )
    _refuse(
        getattr(args, "train_sampling_strategy", "random") == "random"
        and not getattr(args, "group_by_length", False),
        "the training batches are Poisson-sampled (what the accountant assumes): "
        "train_sampling_strategy / group_by_length must stay at their defaults",
    )


class _PrivacyCallback(TrainerCallback):
    """Account each release when the optimizer steps (and check the first one)."""

    def __init__(self, trainer: "DPTrainer"):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._before_release()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._after_release()


class DPTrainer(Trainer):
    """A ``transformers.Trainer`` that trains with differential privacy (DP-SGD style):
    Poisson sampling, per-sample losses, ghost clipping at C, Gaussian noise sigma * C
    once per logical batch, a dpkern optimizer, sigma calibrated to the target epsilon, and
    the privacy ledger in the checkpoints. See :mod:`dpkern.integrations.transformers`.

    Args:
        model, args, **kwargs: as ``transformers.Trainer`` (``train_dataset`` must be a
            map-style dataset with ``len``; the data collator may pad dynamically).
        privacy: the :class:`PrivacyArguments` (required, keyword).
        per_sample_loss_func: optional ``(outputs, labels) -> float [B]``, one loss per
            sample that depends on that sample alone (default: causal LM next-token loss,
            :func:`per_sample_causal_lm_loss` with ``privacy.loss_normalizer``). ``labels``
            is the batch's ``labels`` (or ``input_ids`` masked by ``attention_mask``).
    Raises:
        ValueError: at construction, the settings of the module doc's "Refused" list
            (named); at ``train()``: a dataset smaller than the expected batch, a budget
            too small for the run (no sigma <= 1e6), a checkpoint without its ledger or
            of another noise mode, ghost clipping that cannot cover the model (named by
            operation and module), trainable parameters that are not the optimizer's.
        RuntimeError: during ``train()``, a trainable parameter unchanged after the first
            step (``check_first_step``), or a Trainer loop that does not step once per
            logical batch.

    Attributes (after ``train()`` started): ``accountant`` (:class:`PrivacyAccountant`),
    ``noise_multiplier``, ``sample_rate``, ``expected_batch_size``, ``planned_steps``,
    ``target_delta``; :meth:`privacy_spent`.
    """

    def __init__(self, model=None, args=None, *pos, privacy=None, per_sample_loss_func=None, **kw):
        if not isinstance(privacy, PrivacyArguments):
            raise ValueError(
                "DPTrainer needs privacy=PrivacyArguments(target_epsilon=...) (keyword), got "
                f"{type(privacy).__name__}"
            )
        try:
            bound = inspect.signature(Trainer.__init__).bind(None, model, args, *pos, **kw)
        except TypeError as exc:
            raise TypeError(f"DPTrainer: {exc}") from None
        given = bound.arguments
        _refuse(
            given.get("optimizers", (None, None)) in ((None, None), [None, None]),
            "optimizers=... is not supported: DPTrainer builds the dpkern optimizer itself "
            "(sigma is calibrated from the run); choose it with PrivacyArguments.optimizer "
            "and the TrainingArguments' learning rate, weight decay and scheduler",
        )
        _refuse(
            given.get("optimizer_cls_and_kwargs") is None,
            "optimizer_cls_and_kwargs is not supported: name the DP rule in "
            "PrivacyArguments.optimizer",
        )
        _refuse(
            given.get("compute_loss_func") is None,
            "compute_loss_func returns a batch loss; pass per_sample_loss_func "
            "(outputs, labels) -> float [B] instead",
        )
        if args is not None:
            _check_training_args(args)
        self.privacy = PrivacyArguments(**asdict(privacy))  # a validated copy
        self.per_sample_loss_func = per_sample_loss_func
        super().__init__(model, args, *pos, **kw)
        _check_training_args(self.args)
        _refuse(not self.is_model_parallel, "a model spread over several devices is not supported")
        if not self.privacy.private:
            warnings.warn(
                f"DPTrainer: noise_seed={self.privacy.noise_seed} given: {NOT_PRIVATE} "
                "(a reproducible run; it logs epsilon_if_noise_key_were_secret)",
                stacklevel=2,
            )
        self.accountant = PrivacyAccountant(self.privacy.accountant)
        self.noise_multiplier = None
        self._plan = None
        self._resume_record = None
        self._gc = None
        self._update_check = None
        self._micro = 0
        self._accounted = 0
        self._started = False
        self._spent_cache = None
        self.add_callback(_PrivacyCallback(self))

    # -- the plan: sampling rate, steps, sigma ---------------------------------------------
    def _dataset_size(self) -> int:
        ds = self.train_dataset
        if ds is None:
            raise ValueError("DPTrainer: training requires a train_dataset")
        if isinstance(ds, torch.utils.data.IterableDataset) or not hasattr(ds, "__len__"):
            raise ValueError(
                "DPTrainer: Poisson sampling draws each example independently: the "
                "train_dataset must be a map-style dataset with len(), not an iterable one"
            )
        n = len(ds)
        if n < 1:
            raise ValueError("DPTrainer: the train_dataset is empty")
        return n

    def _compute_plan(self) -> dict:
        args, p = self.args, self.privacy
        n = self._dataset_size()
        micro = args.gradient_accumulation_steps
        batch = args.per_device_train_batch_size * micro
        if batch > n:
            raise ValueError(
                f"DPTrainer: the expected batch per_device_train_batch_size x "
                f"gradient_accumulation_steps = {batch} exceeds the {n} training examples"
            )
        steps_per_epoch = math.ceil(n / batch)
        if args.max_steps is not None and args.max_steps > 0:
            steps = int(args.max_steps)
        else:
            steps = max(1, math.ceil(args.num_train_epochs * steps_per_epoch))
        clip = p.max_grad_norm
        if clip is None:
            clip = args.max_grad_norm
            if clip is None or not clip > 0:
                raise ValueError(
                    f"DPTrainer: TrainingArguments.max_grad_norm={clip!r} cannot serve as the "
                    "per-sample clipping bound; set PrivacyArguments.max_grad_norm > 0"
                )
        delta = p.target_delta if p.target_delta is not None else 1.0 / n**1.1
        if delta >= 1.0 / n:
            warnings.warn(
                f"DPTrainer: target_delta={delta:g} is not well below 1/N = {1.0 / n:.3g} "
                f"(N = {n} training examples): such a delta allows leaking whole examples",
                stacklevel=3,
            )
        return {
            "dataset_size": n,
            "expected_batch_size": batch,
            "micro_batches": micro,
            "sample_rate": batch / n,
            "steps_per_epoch": steps_per_epoch,
            "planned_steps": steps,
            "target_delta": delta,
            "max_grad_norm": float(clip),
        }

    def _calibrate(self) -> dict:
        """The plan and sigma of this train() (a resumed run continues its ledger)."""
        plan = self._compute_plan()
        p, kind = self.privacy, self.privacy.accountant
        q, steps, delta = plan["sample_rate"], plan["planned_steps"], plan["target_delta"]
        acc = PrivacyAccountant(kind)
        rec = self._resume_record
        if p.noise_multiplier is not None:
            sigma = p.noise_multiplier
            if rec is not None:
                acc.load_state_dict(rec["ledger"])
                self._check_resume(rec, plan, acc.steps)
        elif rec is None:
            try:
                sigma = get_noise_multiplier(p.target_epsilon, delta, q, steps, kind)
            except ValueError as exc:
                raise ValueError(f"DPTrainer: the privacy budget is too small: {exc}") from None
        else:
            acc.load_state_dict(rec["ledger"])
            done = acc.steps
            self._check_resume(rec, plan, done)
            same = (
                rec.get("planned_steps") == steps
                and rec.get("target_epsilon") == p.target_epsilon
                and rec.get("target_delta") == delta
                and rec.get("sample_rate") == q
            )
            if same:
                sigma = float(rec["noise_multiplier"])  # an interrupted run: the same plan
            else:
                sigma = calibrate_extension(
                    acc.history,
                    q,
                    steps - done,
                    p.target_epsilon,
                    delta,
                    kind,
                    guess=float(rec.get("noise_multiplier") or 1.0),
                )
        plan["noise_multiplier"] = sigma
        self.accountant = acc
        self.noise_multiplier = sigma
        self._plan = plan
        return plan

    @staticmethod
    def _check_resume(rec: dict, plan: dict, done: int) -> None:
        if rec.get("dataset_size") != plan["dataset_size"]:
            raise ValueError(
                f"DPTrainer: the checkpoint was trained on {rec.get('dataset_size')} "
                f"examples, this train_dataset has {plan['dataset_size']}: not the same data"
            )
        if plan["planned_steps"] <= done:
            raise ValueError(
                f"DPTrainer: the checkpoint already took {done} of the run's "
                f"{plan['planned_steps']} steps; raise max_steps / num_train_epochs to continue"
            )

    @property
    def sample_rate(self) -> float | None:
        """q = B_e / N (None before train())."""
        return None if self._plan is None else self._plan["sample_rate"]

    @property
    def expected_batch_size(self) -> int | None:
        """B_e = per_device_train_batch_size x gradient_accumulation_steps."""
        return None if self._plan is None else self._plan["expected_batch_size"]

    @property
    def planned_steps(self) -> int | None:
        """T, the optimizer steps sigma is calibrated for."""
        return None if self._plan is None else self._plan["planned_steps"]

    @property
    def target_delta(self) -> float | None:
        """The delta of the target (the given one, or 1 / N^1.1)."""
        return None if self._plan is None else self._plan["target_delta"]

    def _numel(self) -> int:
        return sum(p.numel() for p in _inner(self.optimizer).trainable_params())

    def privacy_spent(self) -> dict:
        """What the run has spent so far: ``{"private", "epsilon" (or
        "epsilon_if_noise_key_were_secret" for a known noise key), "delta" (the target
        plus the noise stream's truncation term), "steps"}``.

        Raises: RuntimeError before train() built the optimizer."""
        if self._plan is None or self.optimizer is None:
            raise RuntimeError("DPTrainer.privacy_spent: train() has not started")
        ledger = (self._plan["target_delta"], self._numel(), repr(self.accountant.history))
        cached = self._spent_cache
        if cached is None or cached[0] != ledger:  # (an RDP / PLD evaluation takes ~0.1-1 s)
            spent = self.accountant.get_privacy_spent(self._plan["target_delta"], self._numel())
            self._spent_cache = cached = (ledger, spent)
        eps, delta = cached[1]
        key = "epsilon" if self.privacy.private else "epsilon_if_noise_key_were_secret"
        return {
            "private": self.privacy.private,
            key: eps,
            "delta": delta,
            "steps": self.accountant.steps,
        }

    # -- data ---------------------------------------------------------------------------------
    def get_train_dataloader(self):
        """The Poisson-sampled training loader (:class:`PoissonMicroBatchSampler`),
        prepared by Accelerate (device placement); columns the model does not take are
        removed as by the Trainer."""
        plan = self._plan or self._compute_plan()
        dataset = self.train_dataset
        collator = self.data_collator
        try:
            import datasets

            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        seed = self.privacy.noise_seed
        sampler = PoissonMicroBatchSampler(
            plan["dataset_size"],
            plan["sample_rate"],
            plan["steps_per_epoch"],
            plan["micro_batches"],
            seed=None if seed is None else (seed ^ 0x5DEECE66D) % 2**63,
        )
        args = self.args
        params = {
            "batch_sampler": sampler,
            "collate_fn": _EmptySafeCollator(collator, dataset),
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
        }
        if args.dataloader_num_workers > 0:
            params["prefetch_factor"] = args.dataloader_prefetch_factor
        loader = torch.utils.data.DataLoader(dataset, **params)
        return self.accelerator.prepare(loader)

    # -- the optimizer ------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        """Build the dpkern optimizer over the trainable parameters (the Trainer's decay /
        no-decay groups), with sigma calibrated for the run (see the class doc)."""
        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        plan = self._calibrate()
        if self.state.max_steps and self.state.max_steps != plan["planned_steps"]:
            raise RuntimeError(
                f"DPTrainer: the Trainer plans {self.state.max_steps} steps, sigma was "
                f"calibrated for {plan['planned_steps']}"
            )
        args, p = self.args, self.privacy
        decay = set(self.get_decay_parameter_names(opt_model))
        named = [(n, q) for n, q in opt_model.named_parameters() if q.requires_grad]
        groups = [
            {"params": [q for n, q in named if n in decay], "weight_decay": args.weight_decay},
            {"params": [q for n, q in named if n not in decay], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        if not groups:
            raise ValueError("DPTrainer: the model has no trainable parameter")
        name = p.optimizer or _optimizer_name(args)
        kw = {"lr": args.learning_rate}
        options = rules.by_cli_name(name).optimizer_options()
        if "betas" in options:
            kw["betas"] = (args.adam_beta1, args.adam_beta2)
        if "eps" in options and "eps" in rules.by_cli_name(name).hyper_fields:  # Adam's eps
            kw["eps"] = args.adam_epsilon  # (not DP-Adafactor's (eps1, eps2) pair)
        self.optimizer = OPTIMIZERS[name](
            groups,
            **kw,
            max_grad_norm=plan["max_grad_norm"],
            noise_multiplier=plan["noise_multiplier"],
            expected_batch_size=plan["expected_batch_size"],
            seed=p.noise_seed,
            backend=p.backend,
        )
        return self.optimizer

    # -- the training step --------------------------------------------------------------------
    def _setup_clipping(self):
        opt = _inner(self.optimizer)
        check_trainable_params(self.model, opt)
        self._gc = GhostClipping(self.model, opt, verify=self.privacy.verify).attach()
        if str(getattr(self.accelerator, "mixed_precision", "no")) != "no":
            # Accelerate's autocast wraps the forward only: the check would not see it
            self._gc.verify_rtol = 1e-2
        if self.privacy.check_first_step:
            self._update_check = UpdateCheck(self.model, opt)

    def compute_per_sample_loss(self, model, inputs) -> torch.Tensor:
        """One loss per sample of a (micro-)batch: float ``[B]``, each a function of its own
        sample only (override for other tasks, or pass ``per_sample_loss_func``).

        Default: ``labels`` (or ``input_ids`` where ``attention_mask`` is 1) ->
        :func:`per_sample_causal_lm_loss` of the model's logits with
        ``normalizer=privacy.loss_normalizer`` and the batch's ``attention_mask``.
        Raises: ValueError (no ``labels`` nor ``input_ids``; packed batches with
        ``shift_labels``)."""
        inputs = dict(inputs)
        if "shift_labels" in inputs:
            raise ValueError("DPTrainer: packed batches (shift_labels) are not supported yet")
        labels = inputs.pop("labels", None)
        mask = inputs.get("attention_mask")
        if mask is not None and "position_ids" not in inputs and mask.dim() == 2:
            m = mask != 0
            if bool((m[:, 1:] & ~m[:, :-1]).any()):
                raise ValueError(
                    "DPTrainer: a batch is not right-padded (its attention_mask has 0s before "
                    "1s): with left padding a sample's positions depend on the longest sample "
                    "of its batch, which couples the samples (removing one would change the "
                    "others' gradients). Pad on the right (tokenizer.padding_side = 'right'), "
                    "or have the collator pass position_ids"
                )
        if labels is None:
            ids = inputs.get("input_ids")
            if ids is None:
                raise ValueError("DPTrainer: a batch needs labels or input_ids")
            labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
        outputs = model(**inputs)
        if self.per_sample_loss_func is not None:
            return self.per_sample_loss_func(outputs, labels)
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        return per_sample_causal_lm_loss(
            logits, labels, normalizer=self.privacy.loss_normalizer, attention_mask=mask
        )

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-batch: per-sample losses, ghost clipping, the clipped sum into the
        optimizer's buffers (no ``.grad``; ``num_items_in_batch`` is ignored: nothing is
        divided by a realised count). Returns the micro-batch's sum of per-sample losses
        / B_e (detached; the logged training loss)."""
        if self._gc is None:
            self._setup_clipping()
        opt = _inner(self.optimizer)
        if self._micro == 0 and opt.dp_step != self._accounted:
            raise RuntimeError(
                f"DPTrainer: the optimizer took {opt.dp_step} steps, {self._accounted} were "
                "accounted: a step happened outside the Trainer's loop"
            )
        if self._micro >= self._plan["micro_batches"]:
            raise RuntimeError(
                "DPTrainer: more micro-batches than gradient_accumulation_steps before an "
                "optimizer step (the Trainer's loop does not step once per logical batch)"
            )
        self._micro += 1
        model.train()
        inputs = self._prepare_inputs(inputs)
        rows = _batch_rows(inputs)
        total = torch.zeros((), device=self.args.device)
        if rows == 0:
            self._gc.add_empty_batch()
            return total
        for chunk in _row_chunks(inputs, rows, self.args.per_device_train_batch_size):
            self._gc.discard()  # forwards outside this step are not trained on
            with self.compute_loss_context_manager():
                losses = self.compute_per_sample_loss(model, chunk)
            b = _batch_rows(chunk)
            if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (b,):
                raise ValueError(
                    f"DPTrainer: the per-sample loss must be a float tensor [{b}], got "
                    f"{tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses)}"
                )
            self._gc.backward(losses)
            total = total + losses.detach().float().sum().to(total.device)
        return total / self._plan["expected_batch_size"]

    def _before_release(self):
        if self._micro != self._plan["micro_batches"]:
            raise RuntimeError(
                f"DPTrainer: an optimizer step after {self._micro} micro-batches, expected "
                f"gradient_accumulation_steps = {self._plan['micro_batches']} (one logical "
                "Poisson batch per step)"
            )

    def _after_release(self):
        self._before_release()
        opt = _inner(self.optimizer)
        if opt.dp_step != self._accounted + 1:
            raise RuntimeError(
                f"DPTrainer: the optimizer is at step {opt.dp_step} after a release, the "
                f"ledger at {self._accounted}"
            )
        self.accountant.step(self._plan["noise_multiplier"], self._plan["sample_rate"])
        self._accounted = opt.dp_step
        self._micro = 0
        check, self._update_check = self._update_check, None
        if check is not None:
            check.after_step()

    # -- train, logging, checkpoints ----------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        """``Trainer.train``; ``resume_from_checkpoint`` (a path, or True: the last
        checkpoint in ``output_dir``) also restores the privacy ledger (see the class doc).

        Raises: ValueError for a second call on the same trainer (build a new one and
        resume from a checkpoint), hyper-parameter search (``trial``: every trial would
        spend the budget), a checkpoint without ``dpkern_privacy.json`` or of the other
        noise mode; the errors of the class doc."""
        _refuse(not self._started, "train() runs once per DPTrainer; resume from a checkpoint")
        _refuse(trial is None, "hyper-parameter search is not supported (each trial spends)")
        self._started = True
        path = resume_from_checkpoint
        if isinstance(path, bool):
            path = get_last_checkpoint(self.args.output_dir) if path else None
            if resume_from_checkpoint and path is None:
                raise ValueError(
                    f"No valid checkpoint found in output directory ({self.args.output_dir})"
                )
        self._resume_record = None if path is None else self._read_record(path)
        try:
            return super().train(resume_from_checkpoint=path, trial=trial, **kwargs)
        finally:
            if self._gc is not None:
                self._gc.detach()
                self._gc = None

    def _read_record(self, path) -> dict:
        file = os.path.join(path, PRIVACY_FILE)
        if not os.path.isfile(file):
            raise ValueError(
                f"DPTrainer: {path} has no {PRIVACY_FILE}: not a DPTrainer checkpoint (or "
                "saved with save_only_model); resuming it would lose the privacy ledger and "
                "under-report epsilon"
            )
        with open(file) as f:
            rec = json.load(f)
        if not isinstance(rec, dict) or rec.get("format") != 1 or "ledger" not in rec:
            raise ValueError(f"DPTrainer: {file} is not a dpkern privacy record (format 1)")
        if rec.get("accountant") != self.privacy.accountant:
            raise ValueError(
                f"DPTrainer: the checkpoint's ledger is {rec.get('accountant')!r}, "
                f"PrivacyArguments.accountant is {self.privacy.accountant!r}"
            )
        if bool(rec.get("private")) != self.privacy.private:
            raise ValueError(
                "DPTrainer: the checkpoint's noise key is known (noise_seed): the run is not "
                "private and cannot become so; resume it with the same noise_seed"
                if not rec.get("private")
                else "DPTrainer: the checkpoint is a private run: resume it without noise_seed"
            )
        if not self.privacy.private and rec.get("noise_seed") != self.privacy.noise_seed:
            raise ValueError(
                f"DPTrainer: the checkpoint was run with noise_seed={rec.get('noise_seed')}, "
                f"not {self.privacy.noise_seed}"
            )
        return rec

    def _record(self) -> dict:
        opt = _inner(self.optimizer)
        if opt.dp_step != self.accountant.steps:
            raise RuntimeError(
                f"DPTrainer: the optimizer took {opt.dp_step} steps, the ledger holds "
                f"{self.accountant.steps}"
            )
        rec = {
            "format": 1,
            "private": self.privacy.private,
            **({} if self.privacy.private else {"privacy": NOT_PRIVATE}),
            **({} if self.privacy.private else {"noise_seed": self.privacy.noise_seed}),
            "ledger": self.accountant.state_dict(),
            "accountant": self.privacy.accountant,
            "target_epsilon": self.privacy.target_epsilon,
            "dp_step": opt.dp_step,
            **{
                k: self._plan[k]
                for k in (
                    "noise_multiplier",
                    "sample_rate",
                    "planned_steps",
                    "target_delta",
                    "max_grad_norm",
                    "expected_batch_size",
                    "dataset_size",
                )
            },
        }
        spent = self.privacy_spent()
        rec.update({k: v for k, v in spent.items() if k not in ("private", "steps")})
        return rec

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            record = self._record()
            tmp = os.path.join(output_dir, PRIVACY_FILE + ".tmp")
            with open(tmp, "w") as f:
                json.dump(record, f, indent=2)
            os.replace(tmp, os.path.join(output_dir, PRIVACY_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        opt, done = _inner(self.optimizer), self.accountant.steps
        if not opt.dp_step == done == self.state.global_step:
            raise ValueError(
                f"DPTrainer: {checkpoint} does not fit together: optimizer at step "
                f"{opt.dp_step}, privacy ledger at {done}, Trainer at {self.state.global_step}"
            )
        self._accounted = opt.dp_step

    def log(self, logs: dict, start_time=None) -> None:
        """``Trainer.log`` with the privacy spent next to the training loss (``epsilon``,
        or ``epsilon_if_noise_key_were_secret``), without ``grad_norm``."""
        for key in _DROPPED_LOGS:
            logs.pop(key, None)
        if (
            ("loss" in logs or "train_loss" in logs)
            and self._plan is not None
            and self.optimizer is not None
        ):
            spent = self.privacy_spent()
            key = "epsilon" if self.privacy.private else "epsilon_if_noise_key_were_secret"
            logs[key] = spent[key]
            if "train_loss" in logs:
                logs.update(
                    delta=spent["delta"],
                    noise_multiplier=self._plan["noise_multiplier"],
                    sample_rate=self._plan["sample_rate"],
                )
        super().log(logs, start_time)

    def floating_point_ops(self, inputs) -> int:
        """0: the Trainer's count multiplies the sampled tokens (a data-dependent count)."""
        return 0
