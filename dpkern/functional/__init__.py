"""The functional API, in torch.optim's ``_functional`` style: lists of tensors updated in place.

Each ``dp_<rule>`` function runs one DP step (SPEC sections 2-7): per-sample norms over
all given parameters (pass 1), clip factors, then clip + sum + Philox noise + moment update
+ parameter update (pass 2) on the chosen backend. :func:`dp_step` does the same for any
rule of the registry (:mod:`dpkern.rules`) given its hyper-parameter dataclass and its
states by name. ``dpkern.optim`` is a thin stateful layer over :func:`dp_step_groups`, the
multi-group form used by every front-end.

Modules: ``blocks`` (noise, per-sample norms, clip factors), ``groups`` (the multi-group
step and gradient accumulation), ``updates`` (``dp_step`` and the ``dp_<name>`` functions);
every public name is importable from ``dpkern.functional``.

Shapes and dtypes (all functions):
- ``params``: list of parameters (float32, bfloat16 or float16), updated in place;
- ``grad_samples``: list, entry k ``None`` (parameter unused: zero per-sample gradient) or
  a tensor ``[B, *params[k].shape]`` (Opacus' ``p.grad_sample`` convention); ``None`` for
  the whole argument means "no per-sample gradients, use ``summed_grads``";
- ``summed_grads``: list of float32 tensors shaped like the parameters (or ``None``
  entries): clipped sums the caller computed itself (ghost clipping, earlier micro-batches);
- optimizer states: float32 tensors shaped as the rule's ``StateSpec`` says (most are
  shaped like the parameters), updated in place.

Errors: ``ValueError`` for bad hyper-parameters and bad tensors (naming the parameter),
``FloatingPointError`` for non-finite per-sample gradients with ``nonfinite="error"``;
in every error case nothing has been modified.
"""

from .blocks import (
    CLIP_EPS,
    NONFINITE_MODES,
    PARAM_DTYPES,
    Reduce,
    clip_factors,
    gaussian_noise,
    per_sample_norms,
)
from .groups import (
    Group,
    StepResult,
    accumulate_groups,
    apply_step,
    check_nonfinite,
    check_params,
    check_privacy,
    clip_and_check,
    dp_step_groups,
    noise_var,
    noise_var_ema,
    prepare_step,
)
from .updates import dp_adam, dp_adam_bc, dp_adamw, dp_adamw_bc, dp_macadam, dp_sgd, dp_step

__all__ = [
    "CLIP_EPS",
    "NONFINITE_MODES",
    "PARAM_DTYPES",
    "Reduce",
    "Group",
    "StepResult",
    "accumulate_groups",
    "apply_step",
    "check_nonfinite",
    "check_params",
    "check_privacy",
    "clip_and_check",
    "clip_factors",
    "dp_adam",
    "dp_adam_bc",
    "dp_adamw",
    "dp_adamw_bc",
    "dp_macadam",
    "dp_sgd",
    "dp_step",
    "dp_step_groups",
    "gaussian_noise",
    "noise_var",
    "noise_var_ema",
    "per_sample_norms",
    "prepare_step",
]
