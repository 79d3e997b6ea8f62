"""The Triton backend (SPEC section 6): fused kernels for CUDA tensors, also runnable on
CPU tensors under ``TRITON_INTERPRET=1`` (set before this package is imported).

Same functions and signatures as :mod:`dpkern.backends.reference`:
``philox_words``, ``gaussian_noise``, ``normal_from_words``, ``rounding_bits``,
``stochastic_round_bf16`` (noise.py), ``per_sample_norms``,
``whitened_norms`` (norms.py, pass 1), ``accumulate``, ``step``, ``macadam_update_scale``
(step.py, pass 2: a shared prologue, then one ``update_<name>`` per rule in rules.py),
``supports`` (whether a rule of :mod:`dpkern.rules` has a kernel here), and
``rms_clip_moments``, ``rms_clip_apply``, ``supports_rms_clip`` (``update_rms_clip``'s
two passes, SPEC 10.9: DP-AdamW, DP-AdamW-BC and DP-Adafactor).
Importing it raises ImportError when triton is not installed (the registry relies on it).
Block sizes: :func:`configure` / :data:`_common.CONFIG` (results do not depend on them).
"""

import triton  # noqa: F401  (ImportError here marks the backend unavailable)

from ._common import INTERPRETED, Config, config, configure
from .noise import (
    gaussian_noise,
    normal_from_words,
    philox_words,
    rounding_bits,
    stochastic_round_bf16,
)
from .norms import per_sample_norms, whitened_norms
from .step import (
    accumulate,
    macadam_update_scale,
    rms_clip_apply,
    rms_clip_moments,
    step,
    supports,
    supports_rms_clip,
)

__all__ = [
    "philox_words",
    "gaussian_noise",
    "normal_from_words",
    "rounding_bits",
    "stochastic_round_bf16",
    "per_sample_norms",
    "whitened_norms",
    "accumulate",
    "step",
    "macadam_update_scale",
    "supports",
    "supports_rms_clip",
    "rms_clip_moments",
    "rms_clip_apply",
    "Config",
    "config",
    "configure",
    "INTERPRETED",
]
