"""torch.optim front-ends: DPSGD, DPAdam, DPAdamBC, DPAdamW, DPAdamWBC, DPMacAdam, and the
families of SPEC section 10 (DPRMSprop, DPAdagrad, DPRAdam, DPLion, DPAdadelta,
DPAdEMAMix, DPAdafactor, DPSGDScheduleFree, DPAdamWScheduleFree).

Each is a ``torch.optim.Optimizer`` constructed like its torch.optim twin plus keyword-only
privacy arguments; ``step()`` consumes Opacus' ``p.grad_sample`` (shape ``[B, *p.shape]``)
and runs one fused DP step (SPEC sections 1-7) through :mod:`dpkern.functional`. A class is
its constructor's signature, its docstring and its ``rule`` (the spec in
:mod:`dpkern.rules`); state and policy live in :class:`dpkern.optim.base.DPOptimizer`, the
math in the functional layer and the backends.

Gradient accumulation: call ``accumulate()`` after each micro-batch's backward (it folds
the clipped per-sample gradients into an fp32 buffer and consumes ``grad_sample``), then
``step()`` after the last one: noise is added once per logical batch. The accumulation
buffers (un-noised sums of private gradients) are never put in a ``state_dict``.

SPEC: ``python -m dpkern.spec`` prints the contract (docs/SPEC.md in the source tree).

Layout (as torch.optim): one module per family, :mod:`.sgd` (DPSGD), :mod:`.adam`
(DPAdam, DPAdamW, DPAdamBC, DPAdamWBC), :mod:`.macadam`, :mod:`.schedule_free`
(DPSGDScheduleFree, DPAdamWScheduleFree), :mod:`.rmsprop`, :mod:`.adagrad`,
:mod:`.adadelta`, :mod:`.ademamix`, :mod:`.radam`, :mod:`.lion`, :mod:`.adafactor`; the
docstring fragments they share are in :mod:`._docs`. This module re-exports every class
(``__all__``), so ``from dpkern.optim.optimizers import DPAdamW`` and pickles that name a
class by this module keep working.
"""

from .adadelta import DPAdadelta
from .adafactor import DPAdafactor
from .adagrad import DPAdagrad
from .adam import DPAdam, DPAdamBC, DPAdamW, DPAdamWBC
from .ademamix import DPAdEMAMix
from .lion import DPLion
from .macadam import DPMacAdam
from .radam import DPRAdam
from .rmsprop import DPRMSprop
from .schedule_free import DPAdamWScheduleFree, DPSGDScheduleFree
from .sgd import DPSGD

__all__ = [
    "DPSGD",
    "DPAdam",
    "DPAdamBC",
    "DPAdamW",
    "DPAdamWBC",
    "DPMacAdam",
    "DPAdadelta",
    "DPAdEMAMix",
    "DPRAdam",
    "DPLion",
    "DPAdafactor",
    "DPSGDScheduleFree",
    "DPAdamWScheduleFree",
    "DPRMSprop",
    "DPAdagrad",
]
