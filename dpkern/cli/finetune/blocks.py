"""The token blocks a ``dpkern finetune`` run trains and validates on (:func:`load_blocks`:
block-level privacy, or documents / users as units) and the fixed-shape check of
--max-batch-size (:func:`fixed_shape`); called by :func:`.job.prepare`."""

from __future__ import annotations

import torch

from .checkpoint import UsageError
from .plan import Plan, unit_name


def _encode(tokenizer, text: str) -> torch.Tensor:
    from ... import data

    if tokenizer is None:
        return data.byte_encode(text)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def _data_error(plan: Plan, exc: Exception) -> UsageError:
    msg = exc.strerror + f": {plan.data}" if isinstance(exc, OSError) and exc.strerror else str(exc)
    field = plan.user_field is not None and f'"{plan.user_field}"' in msg
    return UsageError("--user-field" if field else "--data", msg)


def load_blocks(plan: Plan, tokenizer, block_size_given: bool):
    """(train blocks, validation blocks, bytes of text, tokens of text, units): ``units``
    is None for block-level privacy, else the unit of each training block."""
    from ... import data

    if plan.privacy_unit != "block":
        return _load_unit_blocks(plan, tokenizer)
    try:
        text = data.read_text(plan.data) if plan.data is not None else data.default_text()
    except (OSError, ValueError) as exc:
        raise _data_error(plan, exc) from None
    ids = _encode(tokenizer, text)
    blocks = data.make_blocks(ids, plan.block_size)
    try:
        train, val = data.split_blocks(blocks, plan.val_fraction)
    except ValueError as exc:
        if block_size_given and ids.numel() >= 4:  # a smaller block size would do
            raise UsageError(
                "--block-size",
                f"{plan.block_size} is too large for the data: "
                f"its {ids.numel():,} tokens make {blocks.shape[0]} block(s), at "
                "least 2 are needed (one to train on, one to validate)",
            ) from None
        raise UsageError(
            "--data", f"{exc} at --block-size {plan.block_size} ({ids.numel()} tokens)"
        ) from None
    return train, val, len(text.encode("utf-8")), ids.numel(), None


def _load_unit_blocks(plan: Plan, tokenizer):
    """Documents or users: each unit's text cut into blocks of its own; whole units held
    out for validation; the training units numbered 0 .. U-1 in order."""
    from ... import data

    try:
        docs = (
            data.read_documents(plan.data, user_field=plan.user_field)
            if plan.data is not None
            else data.default_documents()
        )
    except (OSError, ValueError) as exc:
        raise _data_error(plan, exc) from None
    texts, _ = data.group_units(docs)
    ids = [_encode(tokenizer, t) for t in texts]
    blocks, unit_of = data.make_unit_blocks(ids, plan.block_size)
    n_tokens = sum(x.numel() for x in ids)
    try:
        train_idx, val_idx = data.split_units(unit_of, plan.val_fraction)
    except ValueError as exc:
        raise UsageError(
            "--data",
            f"{str(exc).replace('unit(s)', unit_name(plan) + '(s)')} at --block-size "
            f"{plan.block_size} ({len(texts)} {unit_name(plan, len(texts))}, "
            f"{n_tokens} tokens; a {unit_name(plan, 1)} shorter than a block has none)",
        ) from None
    units = torch.unique(unit_of[train_idx], return_inverse=True)[1]
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return blocks[train_idx], blocks[val_idx], n_bytes, n_tokens, units


def fixed_shape(plan: Plan, n_blocks: int, units, steps: int, delta: float) -> float:
    """--max-batch-size: check it against the data (a sampler validates it) and return
    the per-step overflow probability; refuse a B_max below the expected batch, or one
    whose truncation would cost more than a tenth of delta at the target epsilon (the
    message gives the smallest B_max that would do). Every check and message uses public
    numbers only (the blocks N, or the units N and the cap k): never the private unit
    sizes."""
    import math

    from ...accounting import overflow_delta
    from ...sampling import PoissonBatchSampler

    def sampler(B_max):
        return PoissonBatchSampler(
            n_blocks,
            plan.sample_rate,
            1,
            seed=0,  # (a throw-away: only the shape is checked)
            units=units,
            max_batch_size=B_max,
            max_unit_size=plan.max_blocks_per_unit,
        )

    def cost(B_max):
        return overflow_delta(steps * sampler(B_max).overflow_probability, plan.epsilon)

    # A public bound on the rows (every unit at its cap k; the sampler asks for k)
    if units is None:
        rows, k, what = n_blocks, 1, "blocks"
    else:
        k = plan.max_blocks_per_unit or 1
        rows = (int(units.max()) + 1) * k
        what = f"blocks at most ({unit_name(plan, 2)} x --max-blocks-per-unit x q)"
    expected = plan.sample_rate * rows
    capped = units is None or plan.max_blocks_per_unit is not None

    def smallest() -> int:
        """The smallest B_max >= the expected batch whose truncation costs <= delta / 10."""
        lo, hi = max(plan.max_batch_size, math.ceil(expected) - 1), rows + k  # cost(hi) = 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if cost(mid) <= 0.1 * delta else (mid, hi)
        return hi

    if capped and plan.max_batch_size < expected:  # (no cap: the sampler asks for it)
        raise UsageError(
            "--max-batch-size",
            f"{plan.max_batch_size} is below the expected batch of {expected:.1f} {what}: "
            f"most steps would be truncated; use at least {smallest()}",
        )
    try:
        eta = sampler(plan.max_batch_size).overflow_probability
    except ValueError as exc:
        option = "--max-blocks-per-unit" if "max_unit_size" in str(exc) else "--max-batch-size"
        raise UsageError(option, str(exc).replace("rows", "blocks")) from None
    charge = overflow_delta(steps * eta, plan.epsilon)
    if charge > 0.1 * delta:
        raise UsageError(
            "--max-batch-size",
            f"{plan.max_batch_size} blocks truncate too often: the truncation would add "
            f"{charge:.3g} to delta (target {delta:.3g}; "
            f"P[a batch exceeds it] = {eta:.3g} per step, charged (1 + e^epsilon) times "
            f"over {steps} steps); use at least {smallest()} (the expected batch is "
            f"{expected:.1f} {what})",
        )
    return eta
