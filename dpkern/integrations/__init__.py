"""dpkern inside the tools practitioners already use.

- :mod:`dpkern.integrations.transformers`: :class:`~dpkern.integrations.transformers.DPTrainer`,
  a ``transformers.Trainer`` that trains privately (Poisson sampling, per-sample losses,
  ghost clipping, a dpkern optimizer, a calibrated sigma, epsilon in the logs, checkpoints
  that resume); importing it imports transformers.
- :mod:`dpkern.integrations.guard`: the checks against the silent-non-training trap (a
  model moved to another device after its optimizer was built), for any training loop.
"""

from .guard import UpdateCheck, check_trainable_params

__all__ = ["UpdateCheck", "check_trainable_params"]
