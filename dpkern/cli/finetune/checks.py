"""Checks of ``dpkern finetune``'s device, process and memory options against this
machine and each other, run by :func:`.job.prepare` before anything is built."""

from __future__ import annotations

import torch

from .checkpoint import UsageError
from .options import require
from .plan import Plan


def check_device(device: torch.device) -> None:
    """Raise UsageError unless this torch can hold data on ``device`` (a CPU-only build
    asked for cuda, a GPU index past the last one, ``meta``), before anything is built."""
    require(device.type != "meta", "--device", "meta tensors hold no data; pick cpu or cuda")
    try:
        torch.zeros(1, device=device)
    except (RuntimeError, AssertionError) as exc:  # (a CPU-only torch asserts for cuda)
        why = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise UsageError("--device", f"{device} is not usable here: {why}") from None


def check_nproc(args, device: torch.device) -> None:
    nproc = getattr(args, "nproc", 1)
    if getattr(args, "fsdp", False):
        require(
            nproc > 1, "--fsdp", "shards over the --nproc processes: pass --nproc N with N >= 2"
        )
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            raise UsageError(
                "--fsdp", f"needs FSDP2 (torch >= 2.6), torch is {torch.__version__}"
            ) from None
    if nproc == 1:
        return
    import torch.distributed as dist

    require(dist.is_available(), "--nproc", "this torch build has no torch.distributed")
    if device.type == "cuda":
        require(
            device.index is None,
            "--device",
            f"{device} names one GPU; with --nproc rank r runs on cuda:r (pass --device cuda)",
        )
        require(
            nproc <= torch.cuda.device_count(),
            "--nproc",
            f"{nproc} processes but only {torch.cuda.device_count()} CUDA devices",
        )
    else:
        require(device.type == "cpu", "--nproc", f"supports cpu and cuda, not {device.type}")


def check_memory_options(args, plan: Plan) -> None:
    """--lora, --bf16, --stochastic-rounding and --gradient-checkpointing against the other
    options."""
    if plan.stochastic_rounding:
        require(
            plan.bf16,
            "--stochastic-rounding",
            "rounds bfloat16 weights: it needs --bf16 (float32 weights are not rounded)",
        )
        require(
            plan.lora is None,
            "--stochastic-rounding",
            "has nothing to round with --lora: the trained LoRA adapters stay float32 "
            "(only the frozen base is bfloat16)",
        )
    if plan.lora is not None:
        try:
            import peft  # noqa: F401
        except ImportError:
            raise UsageError(
                "--lora", "needs peft, which is not installed (pip install 'dpkern[llm]')"
            ) from None
        require(
            not getattr(args, "fsdp", False),
            "--fsdp",
            "is not supported with --lora yet (use --nproc N without --fsdp: the adapters "
            "are small enough to replicate)",
        )
    require(
        not getattr(args, "gradient_checkpointing", False) or args.grad_sample != "opacus",
        "--gradient-checkpointing",
        "cannot be used with --grad-sample opacus: its hooks would record the recomputed "
        "forward of each block a second time (use --grad-sample functorch)",
    )
