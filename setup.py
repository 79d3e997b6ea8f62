"""Builds the optional C++ CPU backend ``dpkern._C`` (csrc/, pybind11, OpenMP).

The extension sees raw buffers only (no PyTorch headers), so the build environment needs
pybind11 and a C++17 compiler, never torch. If the build fails, dpkern still installs
and imports; ``backend="auto"`` then falls back to the PyTorch reference with a warning.
"""
from setuptools import setup

setup()
