"""What :class:`~dpkern.integrations.transformers.DPTrainer` refuses: TrainingArguments
and Trainer arguments it cannot train privately with (ValueError naming the field)."""

from __future__ import annotations

from collections.abc import Mapping

#: The TrainingArguments that switch activation checkpointing on (transformers 5 renamed
#: ``gradient_checkpointing``, which it keeps as an alias) and their kwargs fields.
_CHECKPOINTING = ("gradient_checkpointing", "activation_checkpointing")
_CHECKPOINTING_KWARGS = ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")


def _refuse(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"DPTrainer: {what}")


def _checkpointing(args) -> bool:
    """Whether ``args`` ask the Trainer for activation (gradient) checkpointing."""
    return any(bool(getattr(args, name, False)) for name in _CHECKPOINTING)


def _checkpointing_kwargs(args) -> list[tuple[str, object]]:
    """The checkpointing kwargs fields ``args`` has (of this transformers version), and
    their values."""
    return [(name, getattr(args, name)) for name in _CHECKPOINTING_KWARGS if hasattr(args, name)]


def _non_reentrant_checkpointing(args) -> None:
    """Have the Trainer's ``gradient_checkpointing_enable`` (transformers 4) /
    ``activation_checkpointing_enable`` (5) checkpoint with ``use_reentrant=False``: the
    kwargs fields of ``args`` get ``use_reentrant=False`` (set in place; the Trainer reads
    them when ``train()`` starts). transformers 4 would otherwise default to
    ``use_reentrant=True``, and torch < 2.9 does when it is left out. Call after
    :func:`_check_training_args` (which refuses ``use_reentrant=True``)."""
    if not _checkpointing(args):
        return
    for name, kw in _checkpointing_kwargs(args):
        setattr(args, name, {**(kw or {}), "use_reentrant": False})


def _check_training_args(args) -> None:
    """The TrainingArguments DPTrainer refuses (ValueError naming the field)."""
    if args.world_size > 1:  # DDP (torchrun / accelerate launch): one replica per process
        mode = str(getattr(args.parallel_mode, "value", args.parallel_mode))
        _refuse(
            mode == "distributed",
            f"world_size={args.world_size} under parallel_mode={mode!r}: only "
            "torch.distributed data parallelism (torchrun / accelerate launch, one "
            "process per device) is supported",
        )
        _refuse(
            getattr(args, "parallelism_config", None) is None,
            "parallelism_config (tensor / context / sequence parallelism) is not "
            "supported: DPTrainer's ranks each hold a full replica (DDP)",
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
    if _checkpointing(args):
        for name, kw in _checkpointing_kwargs(args):
            _refuse(
                kw is None or isinstance(kw, Mapping),
                f"{name}={kw!r}: expected a dict of torch.utils.checkpoint keyword arguments",
            )
            reentrant = None if kw is None else kw.get("use_reentrant")
            _refuse(
                reentrant is None or reentrant is False,
                f"{name}={{'use_reentrant': {reentrant!r}, ...}}: reentrant activation "
                "checkpointing is incompatible with torch.autograd.grad, which ghost "
                "clipping differentiates with; leave use_reentrant out (DPTrainer sets "
                "use_reentrant=False) or set it to False",
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
        not getattr(args, "use_liger_kernel", False),
        "use_liger_kernel=True replaces the model's layers with fused kernels (custom "
        "autograd functions) whose per-sample norms ghost clipping has no rule for",
    )
    _refuse(
        getattr(args, "skip_memory_metrics", True),
        "skip_memory_metrics=False would save the peak memory of the run, which grows with "
        "the largest sampled micro-batch (a data-dependent figure)",
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


def _check_trainer_kwargs(given: dict) -> None:
    """The ``transformers.Trainer`` arguments DPTrainer refuses (``given``: the bound
    arguments of ``Trainer.__init__``)."""
    _refuse(
        given.get("optimizers", (None, None)) in ((None, None), [None, None]),
        "optimizers=... is not supported: DPTrainer builds the dpkern optimizer itself "
        "(sigma is calibrated from the run); choose it with PrivacyArguments.optimizer "
        "and the TrainingArguments' learning rate, weight decay and scheduler",
    )
    _refuse(
        given.get("optimizer_cls_and_kwargs") is None,
        "optimizer_cls_and_kwargs is not supported: name the DP rule in PrivacyArguments.optimizer",
    )
    _refuse(
        given.get("compute_loss_func") is None,
        "compute_loss_func returns a batch loss; pass per_sample_loss_func "
        "(outputs, labels) -> float [B] instead",
    )


def _check_right_padded(mask) -> None:
    """Refuse a 2-D ``attention_mask`` with 0s before 1s (a left-padded batch)."""
    m = mask != 0
    if bool((m[:, 1:] & ~m[:, :-1]).any()):
        raise ValueError(
            "DPTrainer: a batch is not right-padded (its attention_mask has 0s before "
            "1s): with left padding a sample's positions depend on the longest sample "
            "of its batch, which couples the samples (removing one would change the "
            "others' gradients). Pad on the right (tokenizer.padding_side = 'right'), "
            "or have the collator pass position_ids"
        )


def _check_accelerator(accelerator) -> None:
    """Refuse what Accelerate's own config or environment turns on behind the
    TrainingArguments (``ACCELERATE_MIXED_PRECISION=fp16``, ``accelerate launch
    --dynamo_backend``), like their TrainingArguments twins."""
    mp = str(getattr(accelerator, "mixed_precision", "no"))
    _refuse(
        mp != "fp16",
        "fp16 mixed precision (from Accelerate's config or ACCELERATE_MIXED_PRECISION): "
        "the fp16 loss scaler rescales .grad, which DP training does not use; use bf16",
    )
    _refuse(
        mp in ("no", "bf16"),
        f"{mp} mixed precision (from Accelerate's config or ACCELERATE_MIXED_PRECISION) is "
        "not supported: its layers replace the ones ghost clipping's norms are proven "
        "for; use bf16",
    )
    plugin = getattr(getattr(accelerator, "state", None), "dynamo_plugin", None)
    backend = getattr(plugin, "backend", None)
    name = str(getattr(backend, "value", backend) or "no").lower()
    _refuse(
        name in ("no", "none"),
        f"torch.compile through Accelerate (dynamo backend {name!r}, from its config or "
        "ACCELERATE_DYNAMO_BACKEND) is not supported yet",
    )


def check_separable(loss_of, model, chunk: Mapping, rows: int, low_precision: bool) -> None:
    """Raise ValueError unless each per-sample loss depends on its own sample alone: the
    losses of the first half of ``chunk``'s ``rows`` (>= 2) rows, computed alone, equal
    theirs within the whole chunk (``loss_of(model, batch)``, under
    :func:`dpkern.separability.side_effect_free`: eval mode, no dropout, no grad, the RNG
    state and each submodule's mode restored). A loss divided by the batch's token count or
    scaled by a batch statistic (``l * l.mean()``, ``l / l.sum()``) changes when samples
    are left out: one sample would move the others' gradients, which clipping does not
    bound. Tolerance (relative to each loss): 1e-4, 5e-2 with ``low_precision`` (bf16
    weights or autocast; batch-size-dependent kernels round differently)."""
    import torch

    from ...separability import side_effect_free

    half = rows // 2
    part = {
        k: v[:half] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == rows else v
        for k, v in chunk.items()
    }
    with side_effect_free(model, chunk.values()):
        whole = loss_of(model, chunk)[:half].double()
        alone = loss_of(model, part).double()
    if tuple(alone.shape) != (half,) or not torch.isfinite(whole).all():
        return  # (the step's own checks report a wrong shape or a non-finite loss)
    rtol = 5e-2 if low_precision else 1e-4
    scale = torch.maximum(whole.abs(), alone.abs()).clamp(min=1e-12)
    change = float(((whole - alone).abs() / scale).max())
    _refuse(
        change <= rtol,
        f"the per-sample losses are not separable: a sample's loss changed by {change:.0%} "
        "when the other half of its micro-batch was left out (eval mode, no dropout). Each "
        "sample's loss must depend on that sample alone: a loss divided by the batch's token "
        "count or scaled by a batch statistic (loss.mean(), l / l.sum()) lets one sample "
        "move the others' gradients, which clipping does not bound (not DP). Divide by a "
        "constant instead (in your per_sample_loss_func; the built-in loss takes "
        "PrivacyArguments(loss_normalizer=...)). Checked once, at the first "
        "micro-batch of two or more samples, before its gradients were used",
    )
