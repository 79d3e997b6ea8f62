"""torch.optim front-ends of dpkern (Opacus' ``p.grad_sample`` convention).

- :mod:`dpkern.optim.base`: :class:`DPOptimizer`, what every DP optimizer shares (the
  noise key, validation, step counting, checkpoints, the safety nets);
- :mod:`dpkern.optim.optimizers`: one class per update rule (DPSGD, DPAdam, DPAdamBC,
  DPAdamW, DPAdamWBC, DPMacAdam).
"""

from .base import DPOptimizer, key_fingerprint, secure_key
from .optimizers import DPSGD, DPAdam, DPAdamBC, DPAdamW, DPAdamWBC, DPMacAdam

__all__ = [
    "DPOptimizer",
    "DPSGD",
    "DPAdam",
    "DPAdamBC",
    "DPAdamW",
    "DPAdamWBC",
    "DPMacAdam",
    "key_fingerprint",
    "secure_key",
]
