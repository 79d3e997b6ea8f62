"""The summary ``dpkern finetune`` prints at the end of a run (:func:`print_summary`):
the model, data, privacy unit, optimizer, the privacy spent and the mechanism, training
speed and validation loss. Nothing exact and data-dependent from the training data (the
validation figures are on held-out data)."""

from __future__ import annotations

from .plan import NOT_PRIVATE, unit_name


def _fmt_time(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{int(seconds // 60)} min {seconds % 60:.0f} s"


def _unit_line(plan) -> str:
    """What the guarantee protects, and how many of them the training set holds."""
    n = plan.n_units
    if plan.privacy_unit == "block":
        return f"one block of {plan.block_size} tokens: {n:,} training blocks"
    what = (
        f"one user (--user-field {plan.user_field}; all of the user's blocks)"
        if plan.privacy_unit == "user"
        else "one document (all of its blocks)"
    )
    cap = (
        f", at most {plan.max_blocks_per_unit} blocks each"
        if plan.max_blocks_per_unit is not None
        else ""
    )
    return f"{what}: {n:,} training {unit_name(plan, n)}, clipped as one row each{cap}"


ARCH_NAMES = {"gpt2": "GPT-2", "llama": "Llama"}


def _model_line(plan, args, m) -> str:
    model = plan.model or f"built-in byte-level {ARCH_NAMES.get(plan.arch, plan.arch)}"
    if args.resume:
        model = f"(resumed) {args.resume}, from {model}"
    line = f"{model}: {m['num_parameters_total'] / 1e6:.2f} M parameters"
    if plan.lora is not None:
        line += (
            f", LoRA r {plan.lora} (alpha {plan.lora_alpha:g}): {m['num_parameters']:,} trainable"
        )
    extras = [
        x
        for x, on in (
            ("bfloat16 weights", plan.bf16 and not plan.stochastic_rounding),
            ("bfloat16 weights (stochastic rounding)", plan.stochastic_rounding),
            ("gradient checkpointing", m.get("gradient_checkpointing")),
        )
        if on
    ]
    return line + f", block {plan.block_size}" + "".join(", " + x for x in extras)


def print_summary(plan, args, m, n_bytes, done, out) -> None:
    data = plan.data or "pydoc_data.topics (CPython help pages)"
    delta_src = "" if plan.delta is not None else " (1/N^1.1)"
    units = unit_name(plan, plan.n_units)
    sampling = (
        "Poisson"
        if plan.max_batch_size is None
        else f"truncated Poisson padded to {plan.max_batch_size} blocks"
    )
    mechanism = (
        f"sigma {m['noise_multiplier']:.4g}, C {plan.max_grad_norm:g}, q "
        f"{m['sample_rate']:.4g} ({sampling}, expected batch {plan.batch_size} {units})"
    )
    truncation = (
        f" (truncation {m['delta_batch_truncation']:.2g} of it)"
        if plan.max_batch_size is not None
        else ""
    )
    if plan.noise_seed is None:
        privacy = (
            f"epsilon {m['epsilon']:.3f} spent (target {plan.epsilon:g}), delta "
            f"{m['delta']:.3g}{delta_src}{truncation}, {mechanism}, "
            f"{plan.accountant.upper()} accountant"
        )
    else:
        privacy = f"{NOT_PRIVATE} (--noise-seed {plan.noise_seed}); {mechanism}"
    lines = [
        f"dpkern finetune: done in {_fmt_time(m['total_seconds'])}",
        f"  model       {_model_line(plan, args, m)}",
        (
            f"  data        {data}: {n_bytes:,} bytes, {plan.n_train:,} train / "
            f"{plan.n_val:,} validation blocks"
            if plan.privacy_unit == "block"
            else f"  data        {data}"  # unit sizes are private: the unit line gives N
        ),
        f"  unit        {_unit_line(plan)}",
        f"  optimizer   {plan.optimizer}, lr {plan.lr:g}, backend {m.get('backend_resolved', args.backend)}, "
        f"clipping {args.clipping}"
        + (f" (per-sample gradients {args.grad_sample})" if args.clipping == "per-sample" else ""),
        f"  privacy     {privacy}",
        f"  training    steps {done} -> {m['step']} in {_fmt_time(m['train_seconds'])} "
        + (
            f"({m['expected_tokens_per_second']:,.0f} tokens/s at the expected batch)"
            if m["expected_tokens_per_second"] is not None
            else f"({m['expected_units_per_second']:,.1f} units/s at the expected batch)"
        )
        + (f", {m['nproc']} data-parallel processes" if m["nproc"] > 1 else "")
        + (" (FSDP2-sharded)" if m.get("fsdp") else ""),
        (
            f"  validation  loss {m['val_loss_before']:.4f} -> {m['val_loss_after']:.4f}, "
            f"perplexity {m['val_perplexity_before']:.2f} -> {m['val_perplexity_after']:.2f}"
        ),
    ]
    if m.get("sample") is not None and not args.quiet:
        lines.append(f"  sample      {m['sample']!r} (greedy, from a fixed public prompt)")
    if out is not None:
        lines.append(f"  saved       {out}")
    print("\n".join(lines))
