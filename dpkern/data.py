"""Text data for private language-model fine-tuning: read, encode, cut into blocks, split.

The privacy unit of ``dpkern finetune`` is by default one block (a fixed-length run of
tokens): the Poisson sampler includes or leaves out whole blocks, so the (epsilon, delta)
guarantee is about adding or removing one block of the training text. With a document or
a user as the unit, each unit's text is cut into blocks of its own (no block mixes two
units) and every block records its unit, so that the sampler includes or leaves out a
unit's blocks together and the optimizer clips their summed gradient as one row.

- :func:`read_text` -- a ``.txt`` file, or ``.jsonl`` with a ``"text"`` field per line;
- :func:`default_text` -- real English prose that ships with every CPython: the
  ``pydoc_data.topics`` help pages (about 465 kB), so the default job runs offline;
- :func:`byte_encode` -- UTF-8 bytes as token ids 0..255 (byte-level vocabulary);
- :func:`make_blocks` -- non-overlapping ``[N, block_size]`` blocks;
- :func:`split_blocks` -- a held-out validation split, the same for every run;
- :func:`read_documents`, :func:`default_documents` -- the documents of a file (with a
  user per document from a ``.jsonl`` field), for document- and user-level units;
- :func:`group_units` -- the text of each unit (its documents joined);
- :func:`make_unit_blocks` -- blocks cut unit by unit, with the unit of each block;
- :func:`split_units` -- a held-out validation split of whole units.
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


def read_documents(path: str | Path, *, user_field: str | None = None) -> list[tuple[str, object]]:
    """The documents of ``path``, each with its unit key: ``[(text, key), ...]``.

    - ``.jsonl``: one document per non-blank line (a string ``"text"`` field); the key is
      the value of ``user_field`` (a string or an integer; user-level units) or, without
      ``user_field``, the line number (document-level units).
    - ``.txt``: the whole file is one document (key 0); ``user_field`` is refused.

    Raises: OSError (missing/unreadable); ValueError (as :func:`read_text`, a ``user_field``
    missing, null or not a string/integer on a line -- the message names the line --, a
    ``user_field`` with a ``.txt`` file, or no text at all)."""
    path = Path(path)
    if path.suffix.lower() != ".jsonl":
        if user_field is not None:
            raise ValueError(
                f"{path}: a user field needs a .jsonl file (one JSON object per line); a "
                ".txt file has no users"
            )
        return [(read_text(path), 0)]
    text = read_text(path)  # validates the JSON and the "text" fields
    del text
    docs = []
    for lineno, line in enumerate(path.read_bytes().decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        if user_field is None:
            docs.append((obj["text"], lineno))
            continue
        if user_field not in obj or obj[user_field] is None:
            raise ValueError(f'{path}:{lineno}: no "{user_field}" field (the user of the line)')
        user = obj[user_field]
        if isinstance(user, bool) or not isinstance(user, (str, int)):
            raise ValueError(
                f'{path}:{lineno}: the "{user_field}" field must be a string or an integer, '
                f"not {type(user).__name__}"
            )
        docs.append((obj["text"], user))
    return docs


def default_documents() -> list[tuple[str, object]]:
    """The default corpus as documents: one per ``pydoc_data.topics`` topic (sorted),
    keyed by the topic name."""
    from pydoc_data.topics import topics

    return [(topics[k].strip(), k) for k in sorted(topics)]


def group_units(docs: list[tuple[str, object]]) -> tuple[list[str], list]:
    """The text of each unit: the documents with the same key, joined with
    :data:`DOC_SEPARATOR` in file order; units in order of first appearance.

    Returns: ``(texts, keys)``, one entry per unit."""
    texts: dict = {}
    for text, key in docs:
        texts.setdefault(key, []).append(text)
    return [DOC_SEPARATOR.join(t) for t in texts.values()], list(texts)


def make_unit_blocks(unit_ids: list[Tensor], block_size: int) -> tuple[Tensor, Tensor]:
    """Cut each unit's token ids into blocks of its own: ``(blocks, unit_of)``.

    Args:
        unit_ids: per unit, a 1-D id tensor (its documents' tokens).
        block_size: tokens per block (>= 2).
    Returns:
        blocks: int64 ``[N, block_size]``, unit by unit (each unit's ragged tail dropped:
            a unit shorter than a block has no block);
        unit_of: int64 ``[N]``, the index in ``unit_ids`` of each block's unit.
    Raises: ValueError for block_size < 2."""
    if block_size < 2:
        raise ValueError(f"invalid block_size={block_size!r}: expected >= 2")
    blocks, owner = [], []
    for u, ids in enumerate(unit_ids):
        b = make_blocks(ids, block_size)
        blocks.append(b)
        owner.append(torch.full((b.shape[0],), u, dtype=torch.int64))
    if not blocks:
        return torch.zeros((0, block_size), dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    return torch.cat(blocks), torch.cat(owner)


def split_units(unit_of: Tensor, val_fraction: float) -> tuple[Tensor, Tensor]:
    """(train, validation) block indices holding out whole units: a fixed pseudo-random
    ``val_fraction`` of the units that have blocks (at least one), drawn with
    :data:`SPLIT_SEED`. A unit's blocks are all on one side.

    Returns: two int64 index tensors into ``unit_of``'s blocks (ascending).
    Raises ValueError when val_fraction is not in (0, 1) or fewer than 2 units have
    blocks."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"invalid val_fraction={val_fraction!r}: must be in (0, 1)")
    units = torch.unique(unit_of)
    n = units.numel()
    if n < 2:
        raise ValueError(
            f"only {n} unit(s) with a block of text: need at least 2 (one to train on, "
            "one to validate)"
        )
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    held = torch.zeros(int(unit_of.max()) + 1, dtype=torch.bool)
    held[units[perm[:n_val]]] = True
    is_val = held[unit_of]
    return (~is_val).nonzero().flatten(), is_val.nonzero().flatten()
