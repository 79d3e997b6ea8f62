"""The training loader of a :class:`~dpkern.integrations.transformers.DPTrainer`:
Poisson-sampled logical batches (:class:`.data.PoissonMicroBatchSampler`) in a
``DataLoader`` prepared by Accelerate, and, on data-parallel ranks, the check that every
rank shares the plan and one sampling key."""

from __future__ import annotations

from dataclasses import asdict

import torch

from .arguments import PrivacyArguments
from .data import PoissonMicroBatchSampler, _EmptySafeCollator

__all__ = ["train_dataloader"]

#: The plan and privacy settings every data-parallel rank must share (compared at train()).
_SHARED = (
    "dataset_size",
    "expected_batch_size",
    "micro_batches",
    "sample_rate",
    "steps_per_epoch",
    "planned_steps",
    "target_delta",
    "max_grad_norm",
)


def _shared_sampling_key(plan: dict, privacy: PrivacyArguments, seed: int | None):
    """Data-parallel ranks: check that they share the plan and the privacy settings,
    and give them one sampling key (collectives on the default group). Secure mode: rank
    0's fresh secret key, broadcast; with a seed: None (each rank derives the epochs'
    keys from it). Either way the ranks' keys are compared by fingerprint.

    Raises: DistributedDPError on every rank (plan, settings or keys differ)."""
    import torch.distributed as dist

    from ...distributed import DistributedDPError, broadcast_sampling_key
    from ...distributed.sampler import check_sampling_keys
    from ...sampling import sampling_key

    mine = {k: plan[k] for k in _SHARED}
    mine.update({f"privacy.{k}": v for k, v in asdict(privacy).items() if k != "noise_seed"})
    mine["privacy.private"] = privacy.private
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)  # public numbers only (no key, no seed)
    differ = sorted(k for k in mine if any(r[k] != rows[0][k] for r in rows))
    if differ:
        raise DistributedDPError(
            "DPTrainer: the ranks' runs differ (" + ", ".join(differ) + "): every rank "
            "needs the same TrainingArguments, PrivacyArguments and train_dataset"
        )
    key = broadcast_sampling_key() if seed is None else None
    check_sampling_keys(key if key is not None else sampling_key(seed))
    return key


def train_dataloader(trainer):
    """``trainer``'s Poisson-sampled training loader
    (:class:`PoissonMicroBatchSampler`), prepared by Accelerate (device placement); columns the model does not take are
    removed as by the Trainer."""
    plan = trainer._plan or trainer._compute_plan(warn=False)  # (train() warns, once)
    dataset = trainer.train_dataset
    collator = trainer.data_collator
    try:
        import datasets

        is_hf_dataset = isinstance(dataset, datasets.Dataset)
    except ImportError:
        is_hf_dataset = False
    if is_hf_dataset:
        dataset = trainer._remove_unused_columns(dataset, description="training")
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description="training")
    seed = trainer.privacy.noise_seed
    seed = None if seed is None else (seed ^ 0x5DEECE66D) % 2**63
    world = trainer.args.world_size
    key = _shared_sampling_key(plan, trainer.privacy, seed) if world > 1 else None
    sampler = PoissonMicroBatchSampler(
        plan["dataset_size"],
        plan["sample_rate"],
        plan["steps_per_epoch"],
        plan["micro_batches"],
        seed=seed,
        key=key,
        rank=trainer.args.process_index if world > 1 else 0,
        world_size=world,
    )
    args = trainer.args
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
    if world > 1:
        # each rank's loader already yields its part of every logical batch:
        # Accelerate's prepare would shard the batches again (rank r taking every
        # W-th micro-batch); only its device placement is wanted here
        from accelerate.data_loader import prepare_data_loader

        return prepare_data_loader(
            loader,
            trainer.accelerator.device,
            num_processes=1,
            process_index=0,
            put_on_device=True,
            rng_types=list(trainer.accelerator.rng_types or []),
            non_blocking=trainer.accelerator.non_blocking,
        )
    return trainer.accelerator.prepare(loader)
