"""Builds the optional C++ CPU backend ``dpkern._C`` (csrc/, pybind11, OpenMP).

The extension sees raw buffers only (no PyTorch headers), so the build environment needs
pybind11 and a C++17 compiler, never torch. If the build fails, dpkern still installs
and imports; ``backend="auto"`` then falls back to the PyTorch reference with a warning.

Portability: no ``-march=native``. The hot kernels carry GCC's ``target_clones`` attribute
(csrc/common.h): each is compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2 + FMA) and the
x86-64 baseline, and the dynamic loader picks one for the CPU the wheel runs on. If the
compiler refuses that, the build retries with one baseline version (``DPK_NO_CLONES``),
then without OpenMP (one thread), and finally skips the extension with a warning.
"""

import os
import sys
from glob import glob

from setuptools import setup
from setuptools.command.build_py import build_py as _build_py

try:
    from pybind11.setup_helpers import Pybind11Extension, ParallelCompile
    from pybind11.setup_helpers import build_ext as _build_ext
except ImportError:  # pybind11 missing: install the pure-PyTorch package only
    Pybind11Extension = None

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = sorted(os.path.relpath(p, HERE) for p in glob(os.path.join(HERE, "csrc", "*.cpp")))
HEADERS = sorted(os.path.relpath(p, HERE) for p in glob(os.path.join(HERE, "csrc", "*.h")))
# -O3 vectorises; -g0 drops the debug info of Python's own CFLAGS (it doubles the build
# time); -ffp-contract=off: no FMA contraction, so every clone (with or without FMA) rounds
# each operation as the reference does and results are identical on every x86-64 CPU;
# -fno-math-errno lets sqrt be one instruction; -fno-trapping-math lets the selects of the
# branch-free math if-convert. None of these changes a result (no -ffast-math: the noise
# transform and the fp16 rounding rely on IEEE arithmetic).
BASE_FLAGS = ["-O3", "-g0", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-Wall"]
OPENMP = ["-fopenmp"]

# Build attempts, most capable first: (description, extra macros, OpenMP?).
ATTEMPTS = [
    ("multiversioned, OpenMP", [], True),
    ("single version, OpenMP", [("DPK_NO_CLONES", "1")], True),
    ("single version, no OpenMP", [("DPK_NO_CLONES", "1")], False),
]


def _warn(msg):
    print(f"WARNING: dpkern: {msg}", file=sys.stderr)


if Pybind11Extension is not None:

    class OptionalBuildExt(_build_ext):
        """Builds dpkern._C if it can; a failure is a warning, never a failed install."""

        def build_extension(self, ext):
            errors = []
            for what, macros, openmp in ATTEMPTS:
                ext.define_macros = list(macros)
                ext.extra_compile_args = BASE_FLAGS + (
                    OPENMP if openmp else ["-Wno-unknown-pragmas"]
                )
                ext.extra_link_args = OPENMP if openmp else []
                try:
                    super().build_extension(ext)
                    if errors:
                        _warn(f"built dpkern._C as '{what}' after: {'; '.join(errors)}")
                    return
                except Exception as exc:  # CompileError, LinkError, missing compiler...
                    errors.append(f"{what}: {type(exc).__name__}: {exc}")
            _warn(
                "could not build the C++ CPU backend dpkern._C (backend='cpp'); "
                "backend='auto' will use the PyTorch reference on CPU. Errors: "
                + " | ".join(errors)
            )

        def run(self):
            try:
                super().run()
            except Exception as exc:
                _warn(f"skipping dpkern._C: {type(exc).__name__}: {exc}")

    ParallelCompile("DPKERN_BUILD_JOBS", default=0).install()
    ext_modules = [
        Pybind11Extension("dpkern._C", SOURCES, depends=HEADERS, include_dirs=["csrc"], cxx_std=17)
    ]
    cmdclass = {"build_ext": OptionalBuildExt}
else:
    _warn("pybind11 is not installed: skipping the C++ CPU backend dpkern._C")
    ext_modules, cmdclass = [], {}


class BuildPyWithSpec(_build_py):
    """Also copies docs/SPEC.md into the package (dpkern/SPEC.md), so that the contract the
    docstrings cite is installed with it (``python -m dpkern.spec`` prints it)."""

    def run(self):
        super().run()
        spec = os.path.join(HERE, "docs", "SPEC.md")
        if os.path.isfile(spec) and not self.editable_mode:
            self.copy_file(spec, os.path.join(self.build_lib, "dpkern", "SPEC.md"))


cmdclass["build_py"] = BuildPyWithSpec
setup(ext_modules=ext_modules, cmdclass=cmdclass)
