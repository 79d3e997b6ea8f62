"""Privacy accounting on Google's dp-accounting (RDP and PLD), never home-made (SPEC 8).

The mechanism is DP-SGD's: T self-compositions of the Poisson-subsampled Gaussian with
sampling rate q and noise multiplier sigma, under add/remove-one neighbouring datasets.

- :func:`get_epsilon` -- epsilon spent after ``steps`` steps at ``delta``;
- :func:`get_noise_multiplier` -- the smallest sigma (within ``tol``) for which the target
  (epsilon, delta) holds after ``steps`` steps;
- :class:`PrivacyAccountant` -- a running history for training loops with changing sigma
  or q (noise schedules, resume), with ``state_dict`` round-trips;
- :func:`truncation_delta` -- the delta cost of the noise stream's 11.6 sigma tail bound
  (SPEC section 3), which :meth:`PrivacyAccountant.get_privacy_spent` adds to delta;
- :func:`batch_overflow_probability` -- the probability that a Poisson batch exceeds a
  fixed batch shape B_max (truncated Poisson sampling, SPEC section 8), whose delta cost
  :meth:`PrivacyAccountant.get_privacy_spent` adds too (:func:`overflow_delta`);
- :meth:`PrivacyAccountant.epsilon_curve` -- epsilon at several deltas, one composition.

RDP uses Opacus' (and TF Privacy's) grid of orders, so epsilons agree with Opacus'
``RDPAccountant`` (to 1e-3 relative wherever epsilon <= 12; for larger epsilons
dp-accounting drops low orders whose series does not converge and reports a larger,
still valid, epsilon); PLD is tighter.
"""

from __future__ import annotations

from .accountant import STATE_KEYS, PrivacyAccountant, calibrate_extension
from .mechanism import (
    ACCOUNTANTS,
    MAX_NOISE_MULTIPLIER,
    RDP_ORDERS,
    dpsgd_event,
    get_epsilon,
    get_noise_multiplier,
)
from .truncation import batch_overflow_probability, overflow_delta, truncation_delta

__all__ = [
    "ACCOUNTANTS",
    "MAX_NOISE_MULTIPLIER",
    "PrivacyAccountant",
    "RDP_ORDERS",
    "STATE_KEYS",
    "batch_overflow_probability",
    "calibrate_extension",
    "dpsgd_event",
    "get_epsilon",
    "get_noise_multiplier",
    "overflow_delta",
    "truncation_delta",
]
