"""dpkern: fused kernels for differentially private training in PyTorch.

Public names: the optimizers (:mod:`dpkern.optim`), the functional API
(:mod:`dpkern.functional`), privacy accounting (:mod:`dpkern.accounting`), per-sample
gradients (:mod:`dpkern.grad_sample`) and Poisson sampling (:mod:`dpkern.sampling`).
The contract they implement is SPEC.md (the noise stream, the math of each optimizer).
"""

from . import accounting, functional, ghost, grad_sample, rules, sampling
from .guards import StepInterrupted
from .optim import DPOptimizer
from .optim import optimizers as _optimizers
from .optim.optimizers import *  # noqa: F403  (one class per update rule of dpkern.rules)

__version__ = "0.1.0"  # the one source of the version: pyproject.toml reads it from here
__all__ = [
    *_optimizers.__all__,
    "DPOptimizer",
    "StepInterrupted",
    "rules",
    "functional",
    "accounting",
    "ghost",
    "grad_sample",
    "sampling",
]
