"""The plan of a :class:`~dpkern.integrations.transformers.DPTrainer` run: the dataset
size, the expected batch and sampling rate, the steps, C and delta; and sigma, calibrated
to the target epsilon (a resumed run continues its ledger)."""

from __future__ import annotations

import math
import warnings

import torch

from ...accounting import (
    PrivacyAccountant,
    calibrate_extension,
    get_noise_multiplier,
)


def dataset_size(ds) -> int:
    """N, the size of the map-style ``train_dataset`` (ValueError otherwise)."""
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


def compute_plan(args, p, n: int, warn: bool = True) -> dict:
    """The plan of a run of the TrainingArguments ``args`` and the PrivacyArguments ``p``
    on ``n`` training examples (without sigma)."""
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
    if warn and delta >= 1.0 / n:
        warnings.warn(
            f"DPTrainer: target_delta={delta:g} is not well below 1/N = {1.0 / n:.3g} "
            f"(N = {n} training examples): such a delta allows leaking whole examples",
            stacklevel=4,
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


def calibrate(plan: dict, p, rec: dict | None) -> tuple[float, PrivacyAccountant]:
    """sigma for ``plan`` and the ledger the run continues (``rec``: the resume record,
    or None for a fresh run)."""
    kind = p.accountant
    q, steps, delta = plan["sample_rate"], plan["planned_steps"], plan["target_delta"]
    acc = PrivacyAccountant(kind)
    if p.noise_multiplier is not None:
        sigma = p.noise_multiplier
        if rec is not None:
            acc.load_state_dict(rec["ledger"])
            check_resume(rec, plan, acc.steps)
    elif rec is None:
        try:
            sigma = get_noise_multiplier(p.target_epsilon, delta, q, steps, kind)
        except ValueError as exc:
            raise ValueError(f"DPTrainer: the privacy budget is too small: {exc}") from None
    else:
        acc.load_state_dict(rec["ledger"])
        done = acc.steps
        check_resume(rec, plan, done)
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
            warnings.warn(
                f"DPTrainer: the resumed run's plan differs from the checkpoint's (steps "
                f"{rec.get('planned_steps')} -> {steps}, target epsilon "
                f"{rec.get('target_epsilon')} -> {p.target_epsilon}): noise_multiplier "
                f"recalibrated {float(rec.get('noise_multiplier') or float('nan')):.4g} -> "
                f"{sigma:.4g} for the remaining {steps - done} steps",
                stacklevel=4,
            )
    return sigma, acc


def check_resume(rec: dict, plan: dict, done: int) -> None:
    """Refuse a resume record of other data, or of a run already as long as this plan."""
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
