"""The contract dpkern implements (docs/SPEC.md): where it is, and ``python -m dpkern.spec``
to print it.

Docstrings cite it as "SPEC section N". An installed wheel carries a copy
(``dpkern/SPEC.md``, written at build time); a source checkout or editable install reads
``docs/SPEC.md`` itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
CANDIDATES = (_HERE / "SPEC.md", _HERE.parent / "docs" / "SPEC.md")


def path() -> Path:
    """The SPEC.md that ships with this installation.

    Raises: FileNotFoundError if neither the packaged copy nor docs/SPEC.md exists."""
    for candidate in CANDIDATES:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        "dpkern's SPEC.md was not installed (looked in "
        + ", ".join(str(c) for c in CANDIDATES)
        + ")"
    )


def text() -> str:
    """The SPEC's text (Markdown)."""
    return path().read_text(encoding="utf-8")


def main() -> int:
    sys.stdout.write(text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
