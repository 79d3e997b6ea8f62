"""README.md stays true: its Python example runs as written."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_example_runs(tmp_path, capsys):
    section = README.read_text().split("## Minimal example", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "README.md's Minimal example section has no python block"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    eps = float(re.search(r"epsilon=([0-9.]+)", out).group(1))
    acc = float(re.search(r"accuracy=([0-9.]+)", out).group(1))
    assert eps <= 3.0 + 1e-6 and acc > 0.75


def test_readme_ghost_clipping_example_runs(tmp_path):
    """The Ghost clipping section's snippet runs as written and takes one DP step."""
    section = README.read_text().split("## Ghost clipping", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, flags=re.S) if "gc." in b]
    assert blocks, "README.md's Ghost clipping section has no runnable python block"
    script = tmp_path / "ghost_example.py"
    script.write_text(blocks[0])
    ns = runpy.run_path(str(script), run_name="__main__")
    assert ns["optimizer"].state_dict()["state"], "no step was taken"


def test_readme_privacy_units_example_runs(tmp_path, capsys):
    """The Sampling and privacy units section's snippet runs as written, one row per user."""
    section = README.read_text().split("## Sampling and privacy units", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "README.md's Sampling and privacy units section has no python block"
    script = tmp_path / "units_example.py"
    script.write_text(blocks[0])
    ns = runpy.run_path(str(script), run_name="__main__")
    assert capsys.readouterr().out.strip() == "10 steps, expected batch 10 users"
    assert ns["optimizer"].stats["samples"] <= 40 * 10  # users counted, never examples
    assert ns["optimizer"].stats["samples"] < int(ns["sampler"].expected_batch_size * 10 * 3)


def test_docs_spec_extends_the_shared_contract():
    """docs/SPEC.md began as the project contract (shared/SPEC.md) and extends it: every
    paragraph of the shared contract is still there, word for word; additions are marked
    *dpkern extension*."""
    docs = README.parent / "docs" / "SPEC.md"
    shared = README.parent.parent / "shared" / "SPEC.md"
    assert docs.exists()
    if shared.exists():
        text = docs.read_text()
        for para in shared.read_text().split("\n\n"):
            assert para.strip() in text, f"docs/SPEC.md lost: {para.strip()[:80]!r}"
