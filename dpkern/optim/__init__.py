"""torch.optim front-ends of dpkern (Opacus' ``p.grad_sample`` convention).

- :mod:`dpkern.optim.base`: :class:`DPOptimizer`, what every DP optimizer shares (the
  noise key, validation, step counting, checkpoints, the safety nets);
- :mod:`dpkern.optim.inputs`: what a step consumes (``p.grad_sample``, released once;
  clipped sums from elsewhere, checked); :mod:`dpkern.optim.checkpoint`: the checks of a
  state_dict before ``load_state_dict`` changes anything;
- one module per family of update rules of :mod:`dpkern.rules`, as torch.optim:
  :mod:`~dpkern.optim.sgd` (DPSGD), :mod:`~dpkern.optim.adam` (DPAdam, DPAdamW, DPAdamBC,
  DPAdamWBC), :mod:`~dpkern.optim.macadam`, :mod:`~dpkern.optim.schedule_free`
  (DPSGDScheduleFree, DPAdamWScheduleFree), :mod:`~dpkern.optim.rmsprop`,
  :mod:`~dpkern.optim.adagrad`, :mod:`~dpkern.optim.adadelta`,
  :mod:`~dpkern.optim.ademamix`, :mod:`~dpkern.optim.radam`, :mod:`~dpkern.optim.lion`,
  :mod:`~dpkern.optim.adafactor`; :mod:`dpkern.optim._docs` holds their shared docstring
  fragments; :mod:`dpkern.optim.optimizers` re-exports every class, all exported here;
  so is :class:`~dpkern.guards.StepInterrupted` (raised after a step failed midway).
"""

from ..guards import StepInterrupted
from . import optimizers as _optimizers
from .base import DPOptimizer, key_fingerprint, secure_key
from .optimizers import *  # noqa: F403  (the classes listed in optimizers.__all__)

__all__ = [
    "DPOptimizer",
    *_optimizers.__all__,
    "StepInterrupted",
    "key_fingerprint",
    "secure_key",
]
