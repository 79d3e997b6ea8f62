"""The privacy record of a :class:`~dpkern.integrations.transformers.DPTrainer`
checkpoint (``dpkern_privacy.json``: the ledger, sigma, q, the plan): written next to the
optimizer state (and by ``save_model``), read and checked on resume; the warnings it
grounds (a model from an earlier run, later checkpoints beside the one resumed)."""

from __future__ import annotations

import json
import os
import warnings

from ...keys import NOT_PRIVATE

#: The privacy record written into every checkpoint directory.
PRIVACY_FILE = "dpkern_privacy.json"


def read_record(path, privacy) -> dict:
    """The privacy record of the checkpoint ``path``, checked against the run's
    PrivacyArguments ``privacy`` (ValueError: missing, not a record, another accountant
    or noise mode)."""
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
    if rec.get("accountant") != privacy.accountant:
        raise ValueError(
            f"DPTrainer: the checkpoint's ledger is {rec.get('accountant')!r}, "
            f"PrivacyArguments.accountant is {privacy.accountant!r}"
        )
    if bool(rec.get("private")) != privacy.private:
        raise ValueError(
            "DPTrainer: the checkpoint's noise key is known (noise_seed): the run is not "
            "private and cannot become so; resume it with the same noise_seed"
            if not rec.get("private")
            else "DPTrainer: the checkpoint is a private run: resume it without noise_seed"
        )
    if not privacy.private and rec.get("noise_seed") != privacy.noise_seed:
        raise ValueError(
            f"DPTrainer: the checkpoint was run with noise_seed={rec.get('noise_seed')}, "
            f"not {privacy.noise_seed}"
        )
    return rec


def build_record(privacy, plan: dict, accountant, dp_step: int) -> dict:
    """The record of a run at ``dp_step`` optimizer steps (without the privacy spent;
    RuntimeError when the ledger holds another number of steps)."""
    if dp_step != accountant.steps:
        raise RuntimeError(
            f"DPTrainer: the optimizer took {dp_step} steps, the ledger holds {accountant.steps}"
        )
    rec = {
        "format": 1,
        "private": privacy.private,
        **({} if privacy.private else {"privacy": NOT_PRIVATE}),
        **({} if privacy.private else {"noise_seed": privacy.noise_seed}),
        "ledger": accountant.state_dict(),
        "accountant": privacy.accountant,
        "target_epsilon": privacy.target_epsilon,
        "dp_step": dp_step,
        **{
            k: plan[k]
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
    return rec


def write_record(output_dir: str, record: dict) -> None:
    """Write ``record`` as ``output_dir/dpkern_privacy.json`` (atomically)."""
    tmp = os.path.join(output_dir, PRIVACY_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
    os.replace(tmp, os.path.join(output_dir, PRIVACY_FILE))


def earlier_record_private(path) -> bool | None:
    """Whether the directory ``path`` holds the privacy record (``save_model``'s or a
    checkpoint's) of a private DPTrainer run: True, False for a run with a known noise
    seed, None without a record. An unreadable record counts as private (its ledger
    then still starts a note that the epsilons compose)."""
    file = os.path.join(path, PRIVACY_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            return bool(json.load(f).get("private", True))
    except (OSError, ValueError, AttributeError):
        return True


def note_earlier_run(model) -> None:
    """Warn when ``model`` was loaded from the output of an earlier DPTrainer run (its
    directory holds a privacy record): this run's ledger starts at zero."""
    config = getattr(getattr(model, "base_model", model), "config", None)
    path = getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", None)
    private = earlier_record_private(path) if isinstance(path, str) and path else None
    if private is not None:
        earlier = (
            "If the two runs' data overlap, the final model's epsilon is the composition of "
            "both runs'"
            if private
            else "That run was not private (a known noise seed): the model has no privacy "
            "guarantee for its data, whatever this run spends"
        )
        warnings.warn(
            f"DPTrainer: the model was loaded from {path}, the output of an earlier DPTrainer "
            f"run (it holds {PRIVACY_FILE}): this run's privacy ledger starts at zero. "
            f"{earlier}; to continue that run, pass its checkpoint to "
            "train(resume_from_checkpoint=...) instead",
            stacklevel=3,
        )


def warn_later_checkpoints(path, record: dict, output_dir) -> None:
    """Warn when checkpoints past the one resumed from (``path``, its ``record``) hold a
    privacy record in ``path``'s folder or ``output_dir``: a branch this run abandons. Its
    steps were trained on the data and are in no ledger of this run: the epsilon reported
    covers only the line resumed, so those checkpoints must stay unreleased (or be
    deleted)."""
    step = int(record.get("dp_step", 0))
    later = set()
    for folder in {os.path.dirname(os.path.abspath(path)), os.path.abspath(str(output_dir))}:
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            file = os.path.join(folder, name, PRIVACY_FILE)
            if not name.startswith("checkpoint-") or not os.path.isfile(file):
                continue
            try:
                with open(file) as f:
                    other = json.load(f)
                if int(other.get("dp_step", 0)) > step:
                    later.add(os.path.join(folder, name))
            except (OSError, ValueError, TypeError):
                continue
    if later:
        warnings.warn(
            f"DPTrainer: resuming from {path} (step {step}) while later checkpoints exist "
            f"({', '.join(sorted(later))}): their steps are a branch this run abandons, "
            "trained on the same data and counted in no ledger of this run. The epsilon "
            "reported covers the line resumed only: keep those checkpoints unreleased, or "
            "delete them",
            stacklevel=3,
        )
