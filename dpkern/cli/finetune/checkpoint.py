"""Run directories of ``dpkern finetune``: which --out may be replaced, and checkpoints.

A run directory is one that holds a ``run_config.json`` written by dpkern finetune. Only
such a directory is ever replaced (--overwrite), never the current directory or a parent
of it, nor one that holds the training data, the model or the run being resumed.

Checkpoints replace only what dpkern writes: every file is written into a staging
directory inside the run directory, then moved into place with ``os.replace`` (atomic
per file), ``run_config.json`` last; files of the previous checkpoint that the new one
does not have (its manifest, ``run_config.json["checkpoint"]["files"]``) are removed.
Any other file in the directory is left alone.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path

import torch

from ...models import LORA_BASE_DIR as BASE_DIR

FILES = {"run": "run_config.json", "metrics": "metrics.json", "trainer": "trainer_state.pt"}
#: A LoRA run's directory holds the adapter (peft's save_pretrained: adapter_config.json,
#: adapter_model.safetensors); the built-in base model it was trained on goes to BASE_DIR.
#: ``run_config.json["written_by"]``: what marks a dpkern run directory.
MARKER = "dpkern finetune"
STAGING_PREFIX = ".dpkern-staging-"
#: What a run directory written before the manifest existed may hold (save_pretrained's
#: model and tokenizer files and ours): removed when such a directory is replaced.
_LEGACY_PATTERNS = (
    "run_config.json",
    "metrics.json",
    "trainer_state.pt",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.*",
)
_LEGACY_KEYS = {"block_size", "optimizer", "noise_multiplier", "n_train", "sample_rate"}
_SAFE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")  # no "..", no hidden names


def _safe_name(name) -> bool:
    """A relative path inside the run directory (the manifest is read from disk: never
    follow it outside)."""
    return isinstance(name, str) and all(_SAFE_PART.match(part) for part in name.split("/"))


class UsageError(Exception):
    """Bad input: printed as one line naming the option (None: no option to blame), exit
    code 2."""

    def __init__(self, option: str | None, message: str):
        super().__init__(f"{option}: {message}" if option else message)
        self.option = option


def _read_run_config(path: Path) -> dict | None:
    try:
        saved = json.loads((path / FILES["run"]).read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def is_run_dir(path: Path) -> bool:
    """True when ``path`` holds a run_config.json written by dpkern finetune (marked, or
    with the plan's fields for directories written before the marker existed)."""
    saved = _read_run_config(Path(path))
    return saved is not None and (saved.get("written_by") == MARKER or _LEGACY_KEYS <= saved.keys())


def check_out(
    out_arg: str | None, *, overwrite: bool, resume: str | None, protected: dict[str, str | None]
) -> Path | None:
    """The output directory (--resume without --out writes back to the resumed run).

    A non-empty --out needs --overwrite, and is then replaced only if it is a dpkern run
    directory that is neither the current directory nor a parent of it, and holds none of
    ``protected`` ({option: path}, e.g. --data, --model, --resume). Nothing is deleted
    here. Raises UsageError (one line naming the option)."""
    if out_arg is None:
        return Path(resume) if resume else None
    out = Path(out_arg)
    if out.exists() and not out.is_dir():
        raise UsageError("--out", f"{out} exists and is not a directory")
    if resume is not None and out.resolve() == Path(resume).resolve():
        return out  # written back file by file, like a resume without --out
    if not out.is_dir() or not any(out.iterdir()):
        return out
    if not overwrite:
        raise UsageError("--out", f"{out} exists and is not empty; pass --overwrite to replace it")
    real, cwd = out.resolve(), Path.cwd().resolve()
    refuse = f"refusing to replace --out {out}:"
    if real == cwd:
        raise UsageError("--overwrite", f"{refuse} it is the current directory")
    if real in cwd.parents:
        raise UsageError("--overwrite", f"{refuse} it contains the current directory")
    for option, path in protected.items():
        if path is not None:
            p = Path(path).resolve()
            if p == real or real in p.parents:
                raise UsageError("--overwrite", f"{refuse} it holds {option} {path}")
    if not is_run_dir(real):
        raise UsageError(
            "--overwrite",
            f"{refuse} not a dpkern run directory (no {FILES['run']} written by dpkern finetune)",
        )
    return out


def _previous_files(out: Path) -> set[str]:
    """The files (relative paths) the last checkpoint in ``out`` consists of."""
    saved = _read_run_config(out)
    if saved is None or not is_run_dir(out):
        return set()
    listed = (saved.get("checkpoint") or {}).get("files")
    if isinstance(listed, list):
        return {n for n in listed if _safe_name(n)}
    return {p.name for pattern in _LEGACY_PATTERNS for p in out.glob(pattern)}


def write_checkpoint(
    out: Path,
    model,
    tokenizer,
    run_config: dict,
    metrics: dict,
    trainer: dict,
    model_state: dict | None = None,
) -> None:
    """Write a checkpoint into ``out`` (created if needed), replacing only dpkern's files.

    ``run_config``: the plan (JSON); the marker and the manifest are added. ``trainer``:
    torch.save'd (step, optimizer and accountant state). ``model_state``: the full state
    dict of a sharded (FSDP2) model. A peft (LoRA) model writes its adapter files; when
    its base is the built-in model (``run_config["model"]`` None) the base goes to
    :data:`BASE_DIR` (the adapter config names it), else the adapter names the
    ``--model`` directory (or, for a LoRA run's adapters trained further, that run's
    base). Every file is complete in a staging directory before
    any file of ``out`` is replaced; trainer_state.pt goes in first and run_config.json
    last, so a crash in between leaves a step mismatch that :func:`load_checkpoint`
    reports instead of resuming a mix."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(STAGING_PREFIX + "*"):  # left by a killed run
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
    previous = _previous_files(out)
    stage = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))
    try:
        if hasattr(model, "peft_config"):
            _save_adapter(stage, out, model, run_config)
        else:
            model.save_pretrained(stage, state_dict=model_state)
        if tokenizer is not None:
            tokenizer.save_pretrained(stage)
        torch.save(trainer, stage / FILES["trainer"])
        (stage / FILES["metrics"]).write_text(json.dumps(metrics, indent=2) + "\n")
        names = sorted(p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file())
        names = [FILES["trainer"]] + [n for n in names if n != FILES["trainer"]]
        record = {
            "written_by": MARKER,
            **run_config,
            "checkpoint": {"step": int(trainer["step"]), "files": names + [FILES["run"]]},
        }
        (stage / FILES["run"]).write_text(json.dumps(record, indent=2) + "\n")
        for name in names + [FILES["run"]]:
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(stage / name, out / name)
        for name in previous - set(names) - {FILES["run"]}:
            stale = out / name
            if stale.is_file() or stale.is_symlink():
                stale.unlink()
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _save_adapter(stage: Path, out: Path, model, run_config: dict) -> None:
    """A peft model's adapter files (and, for the built-in base, the base model in
    :data:`BASE_DIR`), without the model card peft adds (README.md: the user's name)."""
    from ... import models

    config = next(iter(model.peft_config.values()))
    source = run_config.get("model")
    if source is None:
        base = model.get_base_model()
        base.save_pretrained(stage / BASE_DIR, state_dict=models.base_state_dict(model))
        config.base_model_name_or_path = str(out / BASE_DIR)
    else:  # a --model DIR base; or, continuing a LoRA run's adapters, that run's base
        config.base_model_name_or_path = str(models.base_of(source))
    model.save_pretrained(stage, save_embedding_layers=False)  # (no embedding targets)
    (stage / "README.md").unlink(missing_ok=True)


def load_checkpoint(path: Path) -> tuple[dict, dict, dict]:
    """(run_config, trainer state, metrics) of the run directory ``path`` (--resume).

    Raises UsageError for a missing, incomplete, corrupt or partly written checkpoint."""
    if not path.is_dir():
        raise UsageError("--resume", f"{path} is not a directory")
    model_file = (
        "adapter_config.json" if (path / "adapter_config.json").is_file() else "config.json"
    )
    missing = [f for f in (FILES["run"], FILES["trainer"], model_file) if not (path / f).is_file()]
    if missing:
        raise UsageError(
            "--resume", f"{path} is not a dpkern finetune checkpoint (missing {', '.join(missing)})"
        )
    try:
        saved = json.loads((path / FILES["run"]).read_text())
        trainer = torch.load(path / FILES["trainer"], map_location="cpu", weights_only=True)
        metrics = (
            json.loads((path / FILES["metrics"]).read_text())
            if (path / FILES["metrics"]).is_file()
            else {}
        )
        if not isinstance(saved, dict) or not isinstance(trainer, dict):
            raise TypeError("not a dpkern checkpoint's structure")
    except (
        OSError,
        ValueError,
        TypeError,
        KeyError,
        RuntimeError,
        EOFError,
        pickle.UnpicklingError,
    ) as exc:  # corrupt files: one line, no traceback
        raise UsageError(
            "--resume",
            f"{path}: unreadable checkpoint ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})",
        ) from None
    step = (saved.get("checkpoint") or {}).get("step")
    if step is not None and step != trainer.get("step"):
        raise UsageError(
            "--resume",
            f"{path} holds a partly written checkpoint ({FILES['run']} "
            f"is at step {step}, {FILES['trainer']} at step {trainer.get('step')}): "
            "dpkern was stopped while saving it",
        )
    return saved, trainer, metrics
