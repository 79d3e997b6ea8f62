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
- **Data parallelism (DDP).** The same script under ``torchrun --nproc_per_node=W`` or
  ``accelerate launch`` (gloo on CPU, NCCL on GPUs) takes the single-process steps: B_e
  stays ``per_device_train_batch_size * gradient_accumulation_steps``, the expected
  batch of the whole step over all ranks (sigma, q and epsilon do not depend on W). Each
  rank draws its part of that Poisson batch (the examples i % W == r of the
  single-process draw, under one sampling key: rank 0's secret key, broadcast, or the
  one derived from ``noise_seed``; compared by fingerprint; every rank yields every
  micro-batch, empty ones included), ghost clipping sums its samples locally, and
  :class:`dpkern.distributed.DistributedDPOptimizer` all-reduces the clipped sums once
  per step; every rank then adds the same noise (rank 0's noise key, the same step:
  the logical batch's one draw, computed on each rank) divided by the global B_e. The
  training step calls the module inside Accelerate's ``DistributedDataParallel``
  wrapper directly, and nothing fills ``.grad``, so DDP's all-reduce never runs (no
  un-noised sum is exchanged, none is counted twice). Each rank's
  accountant counts each global step once (the same ledger everywhere); rank 0 writes
  the checkpoints, ``dpkern_privacy.json`` and the log lines. A rank whose plan,
  privacy settings, optimizer configuration or keys differ stops every rank with
  :class:`dpkern.distributed.DistributedDPError`. An error in one rank's clipping ends
  that process (torchrun then stops the others).
- **Padding.** Batches must be right-padded (or carry ``position_ids``): with left
  padding a sample's positions would depend on the longest sample of its batch. A
  left-padded batch is a ValueError. One row per example: a collator that returns
  another number of rows than examples, or packing keys (``cu_seq_lens_*``:
  ``DataCollatorWithFlattening``), is a ValueError at the first batch (a clipped row
  would hold several examples).
- **What is not logged.** ``grad_norm`` (the norm of ``.grad``, which DP training never
  fills), ``total_flos`` is 0 (it would count the sampled tokens), and nothing counts
  the realised batch; the logged loss is the un-noised training loss
  (sum of per-sample losses / B_e), for the operator only: logged live, and left out of
  the files written from the log (``trainer_state.json``, the model card).
- **The privacy unit** is one ``train_dataset`` row (a document packed into k rows gets
  group privacy for k). ``save_model`` writes the privacy record beside the model; a
  DPTrainer on a model loaded from such a directory warns that its ledger starts at 0.
- **Gradient checkpointing.** ``TrainingArguments(gradient_checkpointing=True)`` (in
  transformers 5 also ``activation_checkpointing=True``) recomputes the blocks in the
  backward; the norms stay exact. DPTrainer sets ``use_reentrant=False`` in
  ``gradient_checkpointing_kwargs`` (and ``activation_checkpointing_kwargs``) where it is
  left out (transformers 4 and torch before 2.9 default to reentrant), in the
  TrainingArguments it was given. ``use_reentrant=True`` is refused at construction, a
  model checkpointed reentrantly by hand at the first step (by ghost clipping's own
  refusal, :func:`dpkern.ghost.graph.grad_of`): reentrant checkpointing does not work
  with ``torch.autograd.grad``, which ghost clipping differentiates with.
- **Refused** (ValueError at construction; the data at ``train()``): several GPUs in
  one process (DataParallel), parallel modes other than torch.distributed DDP (TPU,
  SageMaker, ``parallelism_config``), DeepSpeed, FSDP (:mod:`dpkern.distributed` has
  FSDP2 for own loops), model parallelism, fp16 (its loss
  scaler works on ``.grad``; bf16 works), ``torch_compile`` (both also when Accelerate's
  config or environment sets them), reentrant checkpointing,
  label smoothing, NEFTune, ``include_num_input_tokens_seen``, ``auto_find_batch_size``,
  non-random sampling strategies, an iterable dataset, ``optimizers=`` /
  ``optimizer_cls_and_kwargs=`` (the optimizer is built here, with the calibrated
  sigma), ``compute_loss_func`` (pass ``per_sample_loss_func``), hyper-parameter search.

``PrivacyArguments(noise_seed=INT)`` makes the noise key (and the sampling) known: the run
is reproducible (a resumed run equals the uninterrupted one) and **not private**; it logs
``epsilon_if_noise_key_were_secret`` instead of ``epsilon`` and its ledger file says so.

Tested with transformers 5.24, accelerate 1.15 and peft 0.21 on CPU: one process, and 2
gloo ranks under torchrun (``tests/test_integration_transformers_ddp.py``: the final
weights within 1e-6 of the single-process run; NCCL is not tested).

Layout: :mod:`.arguments` (PrivacyArguments, the DP optimizers it names), :mod:`.data`
(the Poisson sampler, the collator, the row chunks), :mod:`.checks` (what is refused),
:mod:`.plan` (the plan and the calibration of sigma), :mod:`.records` (the checkpoint's
privacy record), :mod:`.trainer` (DPTrainer).
"""

from __future__ import annotations

from ...keys import NOT_PRIVATE
from ...models import per_sample_causal_lm_loss
from ..guard import UpdateCheck, check_trainable_params
from .arguments import OPTIMIZERS, PrivacyArguments  # noqa: F401  (OPTIMIZERS: the names)
from .data import PoissonMicroBatchSampler, _EmptySafeCollator  # noqa: F401
from .records import PRIVACY_FILE
from .trainer import DPTrainer


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
