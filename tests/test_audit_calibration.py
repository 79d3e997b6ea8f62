"""dpkern.audit.calibration: the noise-spread statistic alone, by seeded Monte Carlo.

Under the null (observed and simulated scores from the same honest distribution) its
false-alarm rate must stay at the stated alpha for the score distributions the audit
meets: the quick audit's (``dpkern audit --quick``: DP-AdamW, T = 10, light-tailed,
kurtosis 2.25; ~3846 excluded canaries and free coordinates against N_SIM simulated
ones), Gaussian ones (DP-SGD), nearly two-point ones (kurtosis ~1: DP-Adam after a step or
two), and DP-Adam after one step (every |score| the same). And it must still see a 15%
spread error at the quick audit's sizes. The seeds are fixed: these are deterministic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpkern.audit import calibration as cal

#: ``dpkern audit --quick``'s white-box run (finetune's defaults, its tiny test job).
QUICK_GROUP = {"lr": 0.005, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
QUICK = dict(sigma=0.387, max_grad_norm=1.0, expected_batch_size=16.0, sample_rate=0.0155)
#: Excluded canaries (~250 of m = 500) and free coordinates (4096 - 500) of --quick.
N_OUT = 3846


def adamw_out_scores(n: int, steps: int, gen: torch.Generator, dtype=torch.float64):
    """Scores of n excluded canaries of the quick job's DP-AdamW (released as ``dtype``)."""
    th = cal.simulate_trajectories(
        "adamw", QUICK_GROUP, **QUICK, steps=steps, signal=0.0, n=n, generator=gen
    )
    return cal.trajectory_scores(th.to(dtype), "adamw", QUICK_GROUP, unit=1.0 / 16.0)


def pooled(scores: np.ndarray, seed: int):
    """``draw(n)``: n scores drawn (without replacement) from a pool of honest ones."""
    rng = np.random.default_rng(seed)
    return lambda n: scores[rng.choice(scores.size, n, replace=False)]


def z_values(draw, n_obs: int, reps: int, scale: float = 1.0) -> np.ndarray:
    """spread_z of ``reps`` observed samples (n_obs scores, times ``scale``) each against
    N_SIM simulated ones, all drawn at once (under the null: exchangeable)."""
    out = []
    for _ in range(reps):
        x = draw(n_obs + cal.N_SIM)
        out.append(cal.spread_z(scale * x[:n_obs], x[n_obs:]))
    return np.array(out)


def test_null_at_the_quick_audit_sizes():
    pool = adamw_out_scores(400_000, 10, torch.Generator().manual_seed(20261206))
    z = z_values(pooled(pool, 1), N_OUT, 200)
    assert abs(z.mean()) < 0.3 and 0.8 < z.std() < 1.2, (z.mean(), z.std())
    alarms = int((abs(z) > cal.z_critical(0.05)).sum())  # Binomial(200, 0.05): 10 +- 3
    assert alarms <= 20, alarms
    rng = np.random.default_rng(7)  # DP-SGD's scores are Gaussian
    z = z_values(lambda n: rng.normal(0.0, 3.0, n), N_OUT, 200)
    assert abs(z.mean()) < 0.3 and 0.8 < z.std() < 1.2, (z.mean(), z.std())


def test_null_for_nearly_two_point_scores():
    """Kurtosis 1.01 (+-1 plus a little noise), 250 observed scores: the normal
    approximation of log(std ratio) with the fourth-moment standard error
    sqrt((k - 1) / 4n) raises 5% false alarms at alpha = 1%; the rank test, 1%."""
    rng = np.random.default_rng(11)

    def draw(n):
        return rng.choice([-1.0, 1.0], n) + 0.05 * rng.normal(size=n)

    z = z_values(draw, 250, 400)
    alarms = int((abs(z) > cal.z_critical(0.01)).sum())  # Binomial(400, 0.01): 4 +- 2
    assert alarms <= 10, alarms
    assert 0.8 < z.std() < 1.2, z.std()


def test_null_for_dp_adam_after_one_step():
    """One step of DP-Adam moves every coordinate by lr (|g| / (|g| + eps)): the spread
    is the update rule's, not the noise's. The job releases float32 parameters, the
    simulator float64; neither rounding may read as a miscalibration."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        obs = adamw_out_scores(N_OUT, 1, gen, dtype=torch.float32)
        assert cal.spread_z(obs, adamw_out_scores(cal.N_SIM, 1, gen)) == 0.0
    sim = adamw_out_scores(cal.N_SIM, 1, gen)
    assert cal.spread_z(np.zeros(N_OUT), sim) == -np.inf  # noise off: every score 0


@pytest.mark.parametrize("scores", ["dp-adamw", "gaussian"])
def test_a_15_percent_spread_error_is_seen_at_the_quick_audit_sizes(scores):
    if scores == "dp-adamw":
        draw = pooled(adamw_out_scores(200_000, 10, torch.Generator().manual_seed(5)), 5)
    else:
        rng = np.random.default_rng(5)

        def draw(n):
            return rng.normal(0.0, 3.0, n)

    crit = cal.z_critical(1e-4)
    assert (z_values(draw, N_OUT, 10, scale=1.15) > crit).all()
    assert (z_values(draw, N_OUT, 10, scale=1 / 1.15) < -crit).all()
    sim_in, sim_out = draw(cal.N_SIM) + 1.0, draw(cal.N_SIM)
    check = cal.calibration_check(
        draw(250) + 1.0, 1.15 * draw(N_OUT), sim_in, sim_out, sigma=0.387, linear=False
    )
    assert not check.ok and check.noise_ratio == pytest.approx(1.15, abs=0.03)
    assert check.z_noise > crit and abs(check.z_signal) < crit, check.summary()
