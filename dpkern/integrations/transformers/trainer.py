"""The Trainer: :class:`DPTrainer`, a ``transformers.Trainer`` that trains with
differential privacy (see :mod:`dpkern.integrations.transformers`), and the callback that
accounts each release."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from dataclasses import asdict

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from ...accounting import PrivacyAccountant
from ...ghost import GhostClipping
from ...ghost.verify import RTOL, default_rtol
from ...keys import NOT_PRIVATE
from ...models import per_sample_causal_lm_loss
from ..guard import UpdateCheck, _inner, check_trainable_params
from .arguments import (
    OPTIMIZERS,
    PrivacyArguments,
    _optimizer_kwargs,
    _optimizer_name,
    _param_groups,
)
from .checks import (
    _check_accelerator,
    _check_right_padded,
    _check_trainer_kwargs,
    _check_training_args,
    _non_reentrant_checkpointing,
    _refuse,
    check_separable,
)
from .data import _batch_rows, _row_chunks
from .loader import train_dataloader
from .plan import calibrate, compute_plan, dataset_size
from .saving import PrivateSaving
from .records import (
    note_earlier_run,
    read_record,
    warn_later_checkpoints,
)


def _is_distributed(optimizer) -> bool:
    from ...distributed import DistributedDPOptimizer

    return isinstance(optimizer, DistributedDPOptimizer)


def _unwrap_ddp(model):
    """The module under ``torch.nn.parallel.DistributedDataParallel`` (else ``model``)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model


class _PrivacyCallback(TrainerCallback):
    """Account each release when the optimizer steps (and check the first one)."""

    def __init__(self, trainer: "DPTrainer"):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._before_release()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._after_release()


class DPTrainer(PrivateSaving, Trainer):
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
        _check_trainer_kwargs(bound.arguments)
        if args is not None:
            _check_training_args(args)
        self.privacy = PrivacyArguments(**asdict(privacy))  # a validated copy
        self.per_sample_loss_func = per_sample_loss_func
        super().__init__(model, args, *pos, **kw)
        _check_training_args(self.args)
        _non_reentrant_checkpointing(self.args)  # (the Trainer enables it in train())
        _refuse(not self.is_model_parallel, "a model spread over several devices is not supported")
        _check_accelerator(self.accelerator)
        if not self.privacy.private:
            warnings.warn(
                f"DPTrainer: noise_seed={self.privacy.noise_seed} given: {NOT_PRIVATE} "
                "(a reproducible run; it logs epsilon_if_noise_key_were_secret)",
                stacklevel=2,
            )
        note_earlier_run(self.model)
        self.accountant = PrivacyAccountant(self.privacy.accountant)
        self.noise_multiplier = None
        self._plan = None
        self._resume_record = None
        self._gc = None
        self._update_check = None
        self._separable_checked = False  # (check_separable: once, at the first chunk of >= 2)
        self._micro = 0
        self._accounted = 0
        self._started = False
        self._spent_cache = None
        self.add_callback(_PrivacyCallback(self))

    # -- the plan: sampling rate, steps, sigma ---------------------------------------------
    def _compute_plan(self, warn: bool = True) -> dict:
        return compute_plan(self.args, self.privacy, dataset_size(self.train_dataset), warn)

    def _calibrate(self) -> dict:
        """The plan and sigma of this train() (a resumed run continues its ledger)."""
        plan = self._compute_plan()
        sigma, acc = calibrate(plan, self.privacy, self._resume_record)
        plan["noise_multiplier"] = sigma
        self.accountant = acc
        self.noise_multiplier = sigma
        self._plan = plan
        return plan

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
        """The Poisson-sampled training loader: :func:`.loader.train_dataloader`."""
        return train_dataloader(self)

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
        groups = _param_groups(opt_model, decay, args.weight_decay)
        name = p.optimizer or _optimizer_name(args)
        kw = _optimizer_kwargs(name, args)
        self.optimizer = OPTIMIZERS[name](
            groups,
            **kw,
            max_grad_norm=plan["max_grad_norm"],
            noise_multiplier=plan["noise_multiplier"],
            expected_batch_size=plan["expected_batch_size"],
            seed=p.noise_seed,
            backend=p.backend,
            stochastic_rounding=p.stochastic_rounding,
        )
        if self.args.world_size > 1:
            from ...distributed import DistributedDPOptimizer

            # a collective: rank 0's secure noise key is broadcast, and the ranks'
            # configuration, steps and keys are compared (DistributedDPError on a
            # mismatch, on every rank); step() all-reduces the clipped sums, then every
            # rank adds the same noise (same key and step) with the global B_e
            self.optimizer = DistributedDPOptimizer(self.optimizer)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The Trainer's LR scheduler, over the dpkern optimizer's param_groups (under
        DDP: the inner optimizer of the DistributedDPOptimizer)."""
        if optimizer is None and _is_distributed(self.optimizer):
            optimizer = self.optimizer.optimizer
        return super().create_scheduler(num_training_steps, optimizer=optimizer)

    # -- the training step --------------------------------------------------------------------
    def _setup_clipping(self):
        opt = _inner(self.optimizer)
        check_trainable_params(self.model, opt)
        # (DDP: the wrapper, whose accumulate_clipped keeps the sums local until step())
        target = self.optimizer if _is_distributed(self.optimizer) else opt
        self._gc = GhostClipping(self.model, target, verify=self.privacy.verify).attach()
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
            _check_right_padded(mask)
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

    def _loss_in_context(self, model, batch) -> torch.Tensor:
        with self.compute_loss_context_manager():
            return self.compute_per_sample_loss(model, batch)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-batch: per-sample losses, ghost clipping, the clipped sum into the
        optimizer's buffers (no ``.grad``; ``num_items_in_batch`` is ignored: nothing is
        divided by a realised count). Returns the micro-batch's sum of per-sample losses
        / B_e (detached; the logged training loss; under DDP x world_size: the Trainer
        logs the mean over ranks, which is then the global sum / B_e)."""
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
        # DDP: run the module itself. Ghost clipping differentiates the recorded outputs,
        # not the parameters, so DDP's all-reduce of .grad has nothing to do, and its
        # forward may add collectives (buffer broadcasts; with find_unused_parameters, a
        # reduction of the unused ones) that need every rank to run as many forwards,
        # which Poisson batches do not give (a rank's micro-batch may be empty, or need
        # more chunks). Its one role here, broadcasting rank 0's parameters, happened
        # when Accelerate wrapped the model.
        model = _unwrap_ddp(model)
        model.train()
        if callable(getattr(opt, "train", None)):  # schedule-free: the parameters hold y
            opt.train()  # (as Trainer.training_step does; evaluate() set them to x)
        inputs = self._prepare_inputs(inputs)
        rows = _batch_rows(inputs)
        total = torch.zeros((), device=self.args.device)
        if rows == 0:
            self._gc.add_empty_batch()
            return total
        for chunk in _row_chunks(inputs, rows, self.args.per_device_train_batch_size):
            self._gc.discard()  # forwards outside this step are not trained on
            losses = self._loss_in_context(model, chunk)
            b = _batch_rows(chunk)
            if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (b,):
                raise ValueError(
                    f"DPTrainer: the per-sample loss must be a float tensor [{b}], got "
                    f"{tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses)}"
                    " (one loss per sample of the micro-batch: do not average or sum over it)"
                )
            if not self._separable_checked and b >= 2 and self.privacy.verify != "off":
                # (the first-step check's precision: verify_rtol is set for Accelerate's
                # mixed precision, default_rtol sees bf16 / fp16 parameters)
                low = self._gc.verify_rtol is not None or default_rtol(model.parameters()) != RTOL
                check_separable(self._loss_in_context, model, chunk, b, low)
                self._separable_checked = True
            self._gc.backward(losses)
            total = total + losses.detach().float().sum().to(total.device)
        # the Trainer logs the mean over ranks of this: x W makes it sum / B_e globally
        return total * self.args.world_size / self._plan["expected_batch_size"]

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
        self._resume_record = None if path is None else read_record(path, self.privacy)
        if path is not None and self.args.should_save:
            warn_later_checkpoints(path, self._resume_record, self.args.output_dir)
        try:
            return super().train(resume_from_checkpoint=path, trial=trial, **kwargs)
        finally:
            if self._gc is not None:
                self._gc.detach()
                self._gc = None
