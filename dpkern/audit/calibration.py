"""Canary scores from released parameters, and the noise-calibration check.

A white-box canary owns one coordinate j that no other sample touches, so its released
trajectory theta_0[j], ..., theta_T[j] is the update rule (SPEC section 5) applied to the
privatised gradient of that coordinate alone:

    g_t[j] = (n_t[j] * C' + sigma * C * z_t[j]) / B_e,     n_t[j] in {0, 1}

(n_t[j] = 1 when the canary is in the data and drawn at step t; C' = C c / (c + 1e-6),
the canary of norm c clipped). Its score is the sum of the released per-step moves,
in units of C / B_e (:func:`trajectory_scores`): for DP-SGD without momentum it is
exactly sum_t g_t[j] B_e / C, N(sum_t n_t[j], T sigma^2); for the Adam family it is a
monotone, nonlinear function of the same noisy gradients.

The calibration check (:func:`calibration_check`) compares the observed scores with scores
simulated from the honest mechanism (float64, an implementation of SPEC 5.1-5.5 of its
own, written from the contract and sharing no code with the backends): the spread of the
excluded canaries' scores (pure noise: for DP-SGD the ratio is sigma_actual / sigma) and
the shift of the included ones (the clipped signal against the noise: for the Adam
family, whose updates are scale invariant, this is what a wrong sigma changes). Each is
a two-sided z-test at level ``alpha``. It is a statistical test, not a proof: it catches
a sigma or a clip bound off by less than the epsilon bound can see, at a false-alarm rate
of at most about 2 alpha per run. DP-MacAdam (noise in a whitened space that adapts
globally) is not simulated: its check is reported as not available.

The spread is tested by ranks (:func:`spread_z`), not by the sample variances: the
excluded canaries' scores are far from Gaussian for the Adam family (a few steps of
normalised updates: light tails, kurtosis 1 to 2.3; one step: every |score| the same),
and the normal approximation of a variance ratio, even with the exact fourth-moment
variance, then over- or under-states its tails at the 1e-4 level. The rank test's null
distribution is the same for every continuous score distribution.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

#: Update rules the simulator covers (``type(optimizer).hyper_class.rule``).
SIMULATED_RULES = ("sgd", "adam", "adam_bc", "adamw", "adamw_bc")

#: Simulated coordinates per class (in / out) for the reference distributions.
N_SIM = 20_000


def rule_of(optimizer) -> str:
    """The update rule of a dpkern optimizer (or of the one a wrapper holds)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return type(inner).hyper_class.rule


def group_hyper(optimizer) -> dict:
    """The hyper-parameters of the optimizer's first parameter group (the canaries')."""
    return dict(getattr(optimizer, "param_groups")[0])


def trajectory_scores(theta: torch.Tensor, rule: str, group: dict, unit: float) -> np.ndarray:
    """Scores of coordinates from their released trajectory ``theta`` [T + 1, n].

    u_t = (theta_{t-1} (1 - lr wd) - theta_t) / lr for decoupled decay (AdamW family),
    u_t = (theta_{t-1} - theta_t) / lr - wd theta_{t-1} for DP-SGD (coupled decay), else
    (theta_{t-1} - theta_t) / lr; score = sum_t u_t / ``unit`` (unit = C / B_e)."""
    th = theta.double()
    lr, wd = float(group["lr"]), float(group.get("weight_decay", 0.0) or 0.0)
    prev, nxt = th[:-1], th[1:]
    if rule in ("adamw", "adamw_bc"):
        u = (prev * (1.0 - lr * wd) - nxt) / lr
    else:
        u = (prev - nxt) / lr
        if rule == "sgd":
            u = u - wd * prev
    return (u.sum(0) / unit).numpy()


def simulate_trajectories(
    rule: str,
    group: dict,
    *,
    sigma: float,
    max_grad_norm: float,
    expected_batch_size: float,
    sample_rate: float,
    steps: int,
    signal: float,
    n: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """Trajectories [steps + 1, n] (float64, from 0) of n coordinates under the honest
    mechanism: each step a coordinate gets ``signal`` (the clipped canary's contribution,
    0 for an excluded canary) with probability ``sample_rate``, plus sigma C z, over B_e;
    then the update rule (SPEC 5.1-5.5) with the group's hyper-parameters."""
    if rule not in SIMULATED_RULES:
        raise ValueError(f"no simulator for rule {rule!r}")
    C, Be = float(max_grad_norm), float(expected_batch_size)
    lr, wd = float(group["lr"]), float(group.get("weight_decay", 0.0) or 0.0)
    kw = dict(dtype=torch.float64, generator=generator)
    theta = torch.zeros(n, dtype=torch.float64)
    out = [theta.clone()]
    m = torch.zeros(n, dtype=torch.float64)
    v = torch.zeros(n, dtype=torch.float64)
    buf = None
    phi = 0.0
    Phi = (sigma * C / Be) ** 2
    for t in range(1, steps + 1):
        drawn = (torch.rand(n, **kw) < sample_rate).double() if signal else 0.0
        g = (drawn * signal + sigma * C * torch.randn(n, **kw)) / Be
        if rule == "sgd":
            mu, damp = float(group.get("momentum", 0.0)), float(group.get("dampening", 0.0))
            g = g + wd * theta
            if mu != 0.0:
                buf = g.clone() if buf is None else mu * buf + (1.0 - damp) * g
                d = g + mu * buf if group.get("nesterov", False) else buf
            else:
                d = g
            theta = theta - lr * d
        else:
            b1, b2 = (float(b) for b in group["betas"])
            if rule in ("adamw", "adamw_bc"):
                theta = theta * (1.0 - lr * wd)
            else:
                g = g + wd * theta
            m = b1 * m + (1.0 - b1) * g
            v = b2 * v + (1.0 - b2) * g * g
            m_hat, v_hat = m / (1.0 - b1**t), v / (1.0 - b2**t)
            if rule in ("adam", "adamw"):
                denom = v_hat.sqrt() + float(group["eps"])
            else:
                phi = b2 * phi + (1.0 - b2) * Phi
                phi_hat = phi / (1.0 - b2**t)
                denom = torch.clamp(v_hat - phi_hat, min=float(group["gamma"])).sqrt()
            theta = theta - lr * m_hat / denom
        out.append(theta.clone())
    return torch.stack(out)


@dataclass(frozen=True)
class Calibration:
    """The noise-calibration check.

    ``noise_ratio``: spread (std) of the excluded canaries' scores, observed / honest
    (DP-SGD: sigma_actual / sigma). ``signal_ratio``: the included canaries' mean shift,
    observed / honest (DP-SGD: C_actual / C; the Adam family: about sigma / sigma_actual).
    ``z_noise``, ``z_signal``: their z statistics; ``sigma_effective`` = sigma *
    noise_ratio / signal_ratio, the noise in units of one canary's contribution, for
    DP-SGD only (NaN for the Adam family, whose normalised update rescales the signal by
    about sigma / sigma_actual: the ratio would read as a noise error where there is none).
    ``ok``: both |z| below the two-sided
    critical value at ``alpha``; ``available``: False for a rule that is not simulated
    (then ``reason`` says why and the numbers are NaN)."""

    available: bool
    ok: bool
    alpha: float
    noise_ratio: float
    z_noise: float
    signal_ratio: float
    z_signal: float
    sigma: float
    sigma_effective: float
    reason: str = ""

    def summary(self) -> str:
        if not self.available:
            return f"n/a ({self.reason})"
        word = "ok" if self.ok else "FAIL"
        if math.isnan(self.sigma_effective):
            eff = "sigma_eff is estimated for DP-SGD only"
        elif math.isfinite(self.sigma_effective):
            eff = f"sigma_eff {self.sigma_effective:.4g} vs {self.sigma:.4g}"
        else:  # no positive signal to divide by: the canaries' shift is lost in the noise
            eff = "sigma_eff not estimable (no positive signal: too few steps or canaries)"
        return (
            f"{word}: noise spread x{self.noise_ratio:.3f} (z {self.z_noise:+.1f}), "
            f"signal x{self.signal_ratio:.3f} (z {self.z_signal:+.1f}), {eff}"
        )


def z_critical(alpha: float) -> float:
    """Two-sided critical value of the standard normal at level alpha."""
    from statistics import NormalDist

    return NormalDist().inv_cdf(1.0 - alpha / 2.0)


def not_available(reason: str, alpha: float, sigma: float) -> Calibration:
    nan = math.nan
    return Calibration(False, True, alpha, nan, nan, nan, nan, sigma, nan, reason)


#: Relative tolerance within which the honest |scores| count as pinned to one value (see
#: :func:`spread_z`); float32 trajectories reproduce them far more closely than this.
PINNED_RTOL = 1e-4


def _tie_averaged(values: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """``scores`` (increasing, one per rank 1..N) given to ``values`` by rank, averaged over
    each run of equal values (midrank scores)."""
    order = np.argsort(values)
    ranked = values[order]
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
    counts = np.diff(np.r_[starts, ranked.size])
    out = np.empty(values.size, np.float64)
    out[order] = np.repeat(np.add.reduceat(scores, starts) / counts, counts)
    return out


def spread_z(obs: np.ndarray, sim: np.ndarray) -> float:
    """z of a two-sample rank test that ``obs`` and ``sim`` (scores symmetric about 0, as
    every simulated rule makes the excluded canaries' scores) have the same spread;
    positive when ``obs`` is wider.

    The pooled |scores| are ranked and rank r of N gets the squared half-normal score
    a_r = Phi^-1((1 + r / (N + 1)) / 2)^2 (ties: the average over their ranks): Gaussian
    scores are scored as by their squares, so the test is as efficient as the variance
    ratio for DP-SGD. Under the null every split of the pooled sample into n observed
    and N - n simulated scores is equally likely, whatever the score distribution, so
    the first three moments of Y = (mean of the observed a) / a_bar are exact (a draw
    without replacement). Y is skewed like a chi-square; its Box-Cox power p chosen to
    cancel that skewness (p = 1 - mu_3 / (3 var^2), 1/3 for chi-square, as
    Wilson-Hilferty) is normal to second order. Monte Carlo of the null (400,000 splits
    each, n = 50, 250, 1000, 3846 beside 20,000): false-alarm rates 1.07, 0.88, 0.92,
    1.12 (+- 0.16) x 1e-4 at |z| > 3.89, alpha = 1e-4.

    Pinned magnitudes: where most honest |scores| equal one value (DP-Adam after one
    step: every update is +-1), the spread says nothing about sigma and float32
    rounding would decide the ranks; z is then 0 if the observed median |score| is that
    value (relative ``PINNED_RTOL``), else +-inf."""
    o = np.abs(np.asarray(obs, np.float64))
    s = np.abs(np.asarray(sim, np.float64))
    n, m = o.size, s.size
    if n == 0 or m == 0:
        return 0.0
    med = float(np.median(s))
    if med > 0 and np.mean(np.abs(s - med) <= PINNED_RTOL * med) >= 0.5:
        gap = float(np.median(o)) / med - 1.0
        return 0.0 if abs(gap) <= PINNED_RTOL else math.copysign(math.inf, gap)
    N = n + m
    a = _tie_averaged(np.concatenate([o, s]), _squared_half_normal_scores(N))
    a_bar = float(a.mean())
    c = a - a_bar
    c2 = c * c
    f = (N - n) / (N - 1)  # finite-population factor of a draw without replacement
    var = f * float(c2.mean()) / n / a_bar**2
    if not var > 0:  # every |score| tied: nothing to rank
        return 0.0
    mu3 = float((c2 * c).mean()) / a_bar**3 / n**2 * f * (N - 2 * n) / (N - 2) if N > 2 else 0.0
    p = 1.0 - mu3 / (3.0 * var * var)
    y = float(a[:n].mean()) / a_bar
    g = math.log(y) if abs(p) < 1e-9 else (y**p - 1.0) / p
    return (g - (p - 1.0) * var / 2.0) / math.sqrt(var)


@functools.lru_cache(maxsize=8)
def _squared_half_normal_scores(N: int) -> np.ndarray:
    u = torch.arange(1, N + 1, dtype=torch.float64) / (N + 1)
    out = (torch.special.ndtri((1.0 + u) / 2.0) ** 2).numpy()
    out.flags.writeable = False
    return out


def calibration_check(
    scores_in: np.ndarray,
    scores_out: np.ndarray,
    sim_in: np.ndarray,
    sim_out: np.ndarray,
    *,
    sigma: float,
    alpha: float = 1e-4,
    linear: bool = True,
) -> Calibration:
    """Compare observed canary scores (included / excluded) with honest simulated ones.

    noise: the ratio std_out / std_sim_out, tested by ranks (:func:`spread_z`: valid
    for any score distribution; the normal approximation of log(std_out / std_sim_out)
    with a kurtosis-based standard error is not, for the light-tailed Adam scores).
    signal: (mean_in - mean_out) - (sim_mean_in - sim_mean_out), with the standard error of
    a difference of four independent means. ``linear``: the update is linear in the
    noisy sum (DP-SGD), so sigma_effective is estimated; False (the Adam family): NaN."""
    so, si = np.asarray(scores_out, np.float64), np.asarray(scores_in, np.float64)
    mo, mi = np.asarray(sim_out, np.float64), np.asarray(sim_in, np.float64)
    crit = z_critical(alpha)
    sd_obs, sd_sim = float(so.std(ddof=1)), float(mo.std(ddof=1))
    noise_ratio = sd_obs / sd_sim
    z_noise = spread_z(so, mo)
    shift_obs = float(si.mean() - so.mean())
    shift_sim = float(mi.mean() - mo.mean())
    se_s = math.sqrt(
        si.var(ddof=1) / si.size
        + so.var(ddof=1) / so.size
        + mi.var(ddof=1) / mi.size
        + mo.var(ddof=1) / mo.size
    )
    z_signal = (shift_obs - shift_sim) / se_s if se_s > 0 else math.copysign(math.inf, shift_obs)
    signal_ratio = shift_obs / shift_sim if shift_sim != 0 else math.nan
    sigma_eff = (
        math.nan
        if not linear
        else sigma * noise_ratio / signal_ratio
        if signal_ratio and signal_ratio > 0
        else math.inf
    )
    ok = abs(z_noise) < crit and abs(z_signal) < crit
    return Calibration(
        True, ok, alpha, noise_ratio, z_noise, signal_ratio, z_signal, sigma, sigma_eff
    )
