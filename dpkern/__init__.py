"""dpkern: fused kernels for differentially private training in PyTorch.

Public names: the optimizers (:mod:`dpkern.optim`), the functional API
(:mod:`dpkern.functional`), privacy accounting (:mod:`dpkern.accounting`), per-sample
gradients (:mod:`dpkern.grad_sample`) and Poisson sampling (:mod:`dpkern.sampling`).
The contract they implement is SPEC.md (the noise stream, the math of each optimizer).
"""

from . import accounting, functional, ghost, grad_sample, sampling
from .optim import DPAdam, DPAdamBC, DPAdamW, DPAdamWBC, DPMacAdam, DPOptimizer, DPSGD

__version__ = "0.1.0"
__all__ = [
    "DPSGD",
    "DPAdam",
    "DPAdamBC",
    "DPAdamW",
    "DPAdamWBC",
    "DPMacAdam",
    "DPOptimizer",
    "functional",
    "accounting",
    "ghost",
    "grad_sample",
    "sampling",
]
