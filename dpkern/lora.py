"""LoRA adapters with peft, for ``dpkern finetune --lora`` and the bench: the target modules
per architecture, the ``LoraConfig``, adding or loading adapters, and the adapter
directory a ``--lora`` run writes (peft's ``save_pretrained`` files, and the built-in base
in :data:`LORA_BASE_DIR`): how to recognise it and find its base. peft is imported inside
the functions (an optional dependency: the ``llm`` extra). :mod:`dpkern.models` re-exports
these names."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

from torch import nn

__all__ = [
    "LORA_BASE_DIR",
    "LORA_TARGETS",
    "adapter_base",
    "adapter_config",
    "add_lora",
    "base_of",
    "base_state_dict",
    "is_adapter_dir",
    "load_lora",
    "lora_config",
    "lora_targets",
]


#: LoRA target modules per ``config.model_type``: every linear layer of the block.
LORA_TARGETS = {
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


def lora_targets(model: nn.Module) -> tuple[list[str], str]:
    """(target module names, where they come from) for LoRA on ``model``: the table
    :data:`LORA_TARGETS` for GPT-2 and Llama (every linear layer of a block), else peft's
    own defaults for the model type (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``:
    usually the attention projections).

    Raises: ValueError naming the model type and the supported ones when neither knows it."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT

    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind in LORA_TARGETS:
        return list(LORA_TARGETS[kind]), "dpkern"
    if kind in PEFT:
        return list(PEFT[kind]), "peft"
    known = sorted(set(LORA_TARGETS) | set(PEFT))
    raise ValueError(
        f"no LoRA target modules known for model type {kind!r}: supported are "
        f"{', '.join(LORA_TARGETS)} (every linear layer) and peft's defaults for "
        f"{', '.join(k for k in known if k not in LORA_TARGETS)}"
    )


def lora_config(model: nn.Module, r: int, alpha: float, dropout: float):
    """peft's ``LoraConfig`` for ``model`` (targets from :func:`lora_targets`; GPT-2's
    Conv1D layers get ``fan_in_fan_out=True``)."""
    from peft import LoraConfig

    targets, _ = lora_targets(model)
    kind = model.config.model_type
    return LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        fan_in_fan_out=kind == "gpt2",
        task_type="CAUSAL_LM",
    )


def add_lora(model: nn.Module, r: int, alpha: float, dropout: float) -> nn.Module:
    """``peft.get_peft_model(model, LoraConfig(r, ...))``: only the adapters are
    trainable (peft keeps them in float32 on a bfloat16 model). Raises ValueError from
    :func:`lora_targets`."""
    from peft import get_peft_model

    with _quiet_transformers():
        return get_peft_model(model, lora_config(model, r, alpha, dropout))


def load_lora(
    base: nn.Module, path: str | Path, *, trainable: bool = True, dropout: float | None = None
) -> nn.Module:
    """The peft model of the adapter saved in ``path`` (``save_pretrained`` of a peft
    model: adapter_config.json, adapter_model.safetensors) on ``base``: its adapters
    trainable (or frozen with ``trainable=False``); ``dropout``: the LoRA dropout to
    train with instead of the saved one. The adapter config names ``base``'s directory
    (``base.name_or_path``) as its base when it has one."""
    from peft import PeftConfig, PeftModel

    config = PeftConfig.from_pretrained(str(path))
    if dropout is not None:
        config.lora_dropout = dropout
    if getattr(base, "name_or_path", None):
        config.base_model_name_or_path = str(base.name_or_path)
    with _quiet_transformers():
        return PeftModel.from_pretrained(base, str(path), is_trainable=trainable, config=config)


#: The subfolder where a ``dpkern finetune --lora`` run directory keeps the base model it
#: was trained on when that is the built-in model (its adapter config names it).
LORA_BASE_DIR = "base_model"


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` is a peft adapter directory (adapter_config.json, no config.json of
    its own): the output of a ``dpkern finetune --lora`` run."""
    path = Path(path)
    return (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()


def adapter_config(path: str | Path) -> dict:
    """The adapter_config.json of the peft adapter directory ``path``, checked to be a
    LoRA adapter. Raises ValueError with a one-line reason."""
    import json

    try:
        config = json.loads((Path(path) / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable adapter_config.json ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise ValueError(f"{path} holds a peft {kind} adapter: only LoRA adapters are supported")
    return config


def adapter_base(path: str | Path) -> Path:
    """The directory of the base model of the LoRA adapter saved in ``path``: its
    :data:`LORA_BASE_DIR` subfolder when present (found wherever the run directory was
    moved), else adapter_config.json's ``base_model_name_or_path``, which must be a
    local model directory (nothing is downloaded). Raises ValueError naming the path."""
    path = Path(path)
    local = path / LORA_BASE_DIR
    if (local / "config.json").is_file():
        return local.absolute()
    name = adapter_config(path).get("base_model_name_or_path")
    base = Path(name) if isinstance(name, str) and name else None
    if base is None or not (base / "config.json").is_file():
        raise ValueError(
            f"{path} holds a LoRA adapter whose base model "
            + (f"{name!r} " if name else "")
            + "(adapter_config.json's base_model_name_or_path) is not a local model "
            "directory: put the base in "
            f"{path / LORA_BASE_DIR} or point base_model_name_or_path at it"
        )
    if is_adapter_dir(base) or base.resolve() == path.resolve():
        raise ValueError(f"{path}: the adapter's base {base} is itself an adapter directory")
    return base.absolute()


def base_of(path: str | Path) -> Path:
    """The model directory that ``path`` trains on as a base: ``path`` itself for a plain
    model directory, :func:`adapter_base` for a LoRA adapter directory (a ``--lora``
    run's). Raises ValueError from :func:`adapter_base`."""
    return adapter_base(path) if is_adapter_dir(path) else Path(path)


@contextlib.contextmanager
def _quiet_transformers():
    """peft calls transformers APIs deprecated in its v5 (``is_gradient_checkpointing``):
    their FutureWarnings say nothing to a user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*is deprecated.*")
        yield


def base_state_dict(model: nn.Module) -> dict:
    """The state dict of a peft model's base model as the plain model has it (adapter
    weights dropped, peft's ``.base_layer`` removed from the names): what
    ``save_pretrained`` of the base needs to write an ordinary checkpoint."""
    base = model.get_base_model()
    return {
        k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if ".lora_" not in k
    }
