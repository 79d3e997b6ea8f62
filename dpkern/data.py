"""Text data for private language-model fine-tuning: read, encode, cut into blocks, split.

The privacy unit of ``dpkern finetune`` is one block (a fixed-length run of tokens): the
Poisson sampler includes or leaves out whole blocks, so the (epsilon, delta) guarantee is
about adding or removing one block of the training text.

- :func:`read_text` -- a ``.txt`` file, or ``.jsonl`` with a ``"text"`` field per line;
- :func:`default_text` -- real English prose that ships with every CPython: the
  ``pydoc_data.topics`` help pages (about 465 kB), so the default job runs offline;
- :func:`byte_encode` -- UTF-8 bytes as token ids 0..255 (byte-level vocabulary);
- :func:`make_blocks` -- non-overlapping ``[N, block_size]`` blocks;
- :func:`split_blocks` -- a held-out validation split, the same for every run.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

#: Documents of a .jsonl file are joined with this separator before encoding.
DOC_SEPARATOR = "\n\n"
#: The validation split is drawn with this fixed seed (public, so every run and every
#: resume sees the same split; it is not part of the private randomness).
SPLIT_SEED = 0


def read_text(path: str | Path) -> str:
    """The text of ``path``: a UTF-8 ``.txt`` file as is, or a ``.jsonl`` file (one JSON
    object per line with a string field ``"text"``; blank lines skipped) joined with
    :data:`DOC_SEPARATOR`.

    Raises: OSError (missing/unreadable), ValueError (not UTF-8, bad JSON line, missing
    or non-string "text" field, or no text at all), each message naming the line."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except IsADirectoryError:
        raise ValueError(f"{path} is a directory, not a text file") from None
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if path.suffix.lower() == ".jsonl":
        docs = []
        for lineno, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(f'{path}:{lineno}: expected an object with a string "text" field')
            docs.append(obj["text"])
        content = DOC_SEPARATOR.join(docs)
    if not content.strip():
        raise ValueError(f"{path} contains no text")
    return content


def default_text() -> str:
    """The default corpus: CPython's ``pydoc_data.topics`` help pages (English prose about
    Python, shipped with every CPython), joined in sorted topic order."""
    from pydoc_data.topics import topics

    return DOC_SEPARATOR.join(topics[k].strip() for k in sorted(topics))


def byte_encode(text: str) -> Tensor:
    """UTF-8 bytes of ``text`` as an int64 tensor ``[len(bytes)]`` of ids in 0..255."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def make_blocks(ids: Tensor, block_size: int) -> Tensor:
    """Cut a 1-D id tensor into non-overlapping blocks: int64 ``[len(ids) // block_size,
    block_size]`` (the ragged tail is dropped). Raises ValueError for block_size < 2."""
    if block_size < 2:
        raise ValueError(f"invalid block_size={block_size!r}: expected >= 2")
    n = ids.numel() // block_size
    return ids[: n * block_size].reshape(n, block_size).long()


def split_blocks(blocks: Tensor, val_fraction: float) -> tuple[Tensor, Tensor]:
    """(train, validation) blocks: a fixed pseudo-random ``val_fraction`` of the blocks
    (at least one) is held out, drawn with :data:`SPLIT_SEED`.

    Raises ValueError when val_fraction is not in (0, 1) or fewer than 2 blocks exist."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"invalid val_fraction={val_fraction!r}: must be in (0, 1)")
    n = blocks.shape[0]
    if n < 2:
        raise ValueError(
            f"only {n} block(s) of text: need at least 2 (one to train on, one to validate)"
        )
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    return blocks[perm[n_val:]], blocks[perm[:n_val]]
