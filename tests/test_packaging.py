"""The source distribution carries what a build from it needs: every C++ source and header
(else the extension fails to compile there and dpkern silently installs without it) and
docs/SPEC.md (which setup.py copies into the package as dpkern/SPEC.md)."""

import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_sdist_ships_spec_and_every_csrc_file(tmp_path):
    subprocess.run(
        # (egg_info into tmp_path: a SOURCES.txt left by an earlier build would be reused)
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)]
        + ["sdist", "-d", str(tmp_path)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    (archive,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = {"docs/SPEC.md"} | {
        p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*") if p.is_file()
    }
    assert wanted <= names, sorted(wanted - names)
