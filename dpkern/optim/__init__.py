"""torch.optim front-ends of dpkern (Opacus' ``p.grad_sample`` convention).

- :mod:`dpkern.optim.base`: :class:`DPOptimizer`, what every DP optimizer shares (the
  noise key, validation, step counting, checkpoints, the safety nets);
- :mod:`dpkern.optim.inputs`: what a step consumes (``p.grad_sample``, released once;
  clipped sums from elsewhere, checked); :mod:`dpkern.optim.checkpoint`: the checks of a
  state_dict before ``load_state_dict`` changes anything;
- :mod:`dpkern.optim.optimizers`: one class per update rule of :mod:`dpkern.rules`
  (DPSGD, DPAdam, DPAdamBC, DPAdamW, DPAdamWBC, DPMacAdam), all exported here.
"""

from . import optimizers as _optimizers
from .base import DPOptimizer, key_fingerprint, secure_key
from .optimizers import *  # noqa: F403  (the classes listed in optimizers.__all__)

__all__ = ["DPOptimizer", *_optimizers.__all__, "key_fingerprint", "secure_key"]
