"""An independent float64 model of SPEC.md sections 2, 4, 5, 7 and 10.8, for tests only.

Written from the SPEC text, not from ``dpkern/backends/reference.py``: it shares no update
code with dpkern. Only the noise stream z is taken from ``dpkern.functional.gaussian_noise``
(it is pinned separately by the known-answer vectors of ``tests/test_noise.py``).

Layout: every trainable coordinate of the optimizer lives in ONE flat float64 vector of
length d, in noise-index order (``param_groups`` order, frozen parameters skipped, each
parameter flattened row-major, SPEC section 3). So the global offsets, the global clipping
norm and DP-MacAdam's global sum are plain slices and reductions of that vector.
"""

from __future__ import annotations

import math

import torch

from dpkern.functional import gaussian_noise

F64 = torch.float64
# Monte Carlo arithmetic (Parker 1997; the idea behind Verificarlo): shadow copies of the
# model perturb every intermediate result by a random relative 2^-23 (about twice float32's
# rounding). Where the float64 result is sensitive to float32 rounding (v_hat - phi_hat ~ 0
# in DP-AdamBC; S/kappa - b^2 sigma^2/B_e^2 ~ 0, u = (g~ - m_hat)(...) with g~ = m_hat in
# DP-MacAdam; |g| ~ eps), the shadows' spread shows by how much, element by element, and a
# float32 implementation is allowed SLACK_FACTOR times the largest shadow deviation on top
# of the plain rtol/atol.
SHADOWS = 3
ROUNDOFF = 2.0**-23
SLACK_FACTOR = 8.0
CLIP_EPS = 1e-6  # c_i = min(1, C / (n_i + 1e-6)), SPEC section 2

# SPEC defaults (section 5: torch.optim's where there is a twin; section 7 for MacAdam).
SPEC_DEFAULTS = {
    "sgd": dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False),
    "adam": dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
    "adamw": dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2),
    "adam_bc": dict(betas=(0.9, 0.999), gamma=1e-8, weight_decay=0.0),
    "adamw_bc": dict(betas=(0.9, 0.999), gamma=1e-8, weight_decay=1e-2),
    "macadam": dict(betas=(0.9, 0.999), gamma=1e-8, h1=1e-9, h2=1e-6, variance_estimate="unbiased"),
    "rmsprop": dict(
        alpha=0.99,
        eps=1e-8,
        weight_decay=0.0,
        momentum=0.0,
        centered=False,
        noise_bias_correction=False,
        gamma=1e-8,
    ),
    "adagrad": dict(
        lr_decay=0.0,
        weight_decay=0.0,
        initial_accumulator_value=0.0,
        eps=1e-10,
        noise_bias_correction=False,
        gamma=1e-8,
    ),
    # SPEC 10.5, 10.6
    "adadelta": dict(rho=0.9, eps=1e-6, weight_decay=0.0, noise_bias_correction=False, gamma=1e-8),
    "ademamix": dict(
        betas=(0.9, 0.999, 0.9999),
        alpha=5.0,
        eps=1e-8,
        weight_decay=0.0,
        t_alpha_beta3=None,
        noise_bias_correction=False,
        gamma=1e-8,
    ),
    "radam": dict(
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        decoupled_weight_decay=False,
        noise_bias_correction=False,
        gamma=1e-8,
    ),
    "lion": dict(betas=(0.9, 0.99), weight_decay=0.0),
    # SPEC 10.7 (torch.optim.Adafactor's defaults)
    "adafactor": dict(
        beta2_decay=-0.8,
        eps=(None, 1e-3),
        d=1.0,
        weight_decay=0.0,
        noise_bias_correction=False,
        gamma=1e-8,
    ),
}
# SPEC 10.8 (schedulefree's defaults).
_SF_DEFAULTS = dict(weight_decay=0.0, warmup_steps=0, r=0.0, weight_lr_power=2.0)
SPEC_DEFAULTS["sgd_schedule_free"] = dict(momentum=0.9, **_SF_DEFAULTS)
SPEC_DEFAULTS["adamw_schedule_free"] = dict(
    betas=(0.9, 0.999), eps=1e-8, noise_bias_correction=False, gamma=1e-8, **_SF_DEFAULTS
)
SCHEDULE_FREE = ("sgd_schedule_free", "adamw_schedule_free")
RULES = tuple(SPEC_DEFAULTS)


def kappa(beta1: float, t: int) -> float:
    """kappa_t = 2 (beta1 - beta1^t) / (1 + beta1) (SPEC section 7)."""
    return 2.0 * (beta1 - beta1**t) / (1.0 + beta1)


class SpecOptimizer:
    """SPEC's optimizers over a list of parameter groups, all arithmetic in float64.

    Args:
        rule: one of :data:`RULES`.
        groups: list of dicts ``{"params": [tensor, ...], **hyper}`` where the tensors are
            the initial parameters (their ``requires_grad``, dtype and shape are used; they
            are copied, never modified) and ``hyper`` holds ``lr`` and any override of
            :data:`SPEC_DEFAULTS`.
        max_grad_norm, noise_multiplier, expected_batch_size: C, sigma, B_e (change them
            between steps with :meth:`set_privacy`).
        key: the noise key (the ``seed=`` given to dpkern).
        b_init: DP-MacAdam's initial scale (default 1/d).
        perturb: None for the model itself; an int seeds a Monte Carlo arithmetic shadow.

    After each :meth:`step`, :meth:`params` holds the parameters rounded to their dtype
    (SPEC: updated in float32, rounded once on store), :meth:`state` the states and
    :meth:`slacks` / :meth:`state_slack` the float32 error budgets.
    """

    def __init__(
        self,
        rule,
        groups,
        *,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
        expected_batch_size=1.0,
        key=0,
        b_init=None,
        perturb=None,
    ):
        assert rule in RULES
        self.rule = rule
        self.C, self.sigma, self.B_e, self.key = (
            max_grad_norm,
            noise_multiplier,
            expected_batch_size,
            key,
        )
        self.t = 0
        self.groups = []  # list of (hyper, slice) per group
        self.entries = []  # per trainable param: (group index, slice, shape, dtype)
        values = []
        offset = 0
        for gi, g in enumerate(groups):
            hyper = {**SPEC_DEFAULTS[rule], **{k: v for k, v in g.items() if k != "params"}}
            start = offset
            for p in g["params"]:
                if not p.requires_grad:  # frozen: no norm, noise, state, nor noise index
                    continue
                n = p.numel()
                self.entries.append((gi, slice(offset, offset + n), tuple(p.shape), p.dtype))
                values.append(p.detach().to(F64).reshape(-1))
                offset += n
            self.groups.append((hyper, slice(start, offset)))
        self.d = offset
        self.p = torch.cat(values) if values else torch.zeros(0, dtype=F64)
        z = lambda: torch.zeros(self.d, dtype=F64)
        self.m, self.v, self.buf, self.S = z(), z(), z(), z()
        self.b = torch.full((self.d,), b_init if b_init is not None else 1.0 / self.d, dtype=F64)
        self.phi = [0.0 for _ in self.groups]  # DP-AdamBC's noise-variance EMA per group
        self.zs = z()  # schedule-free's z (SPEC 10.8)
        self.sf = [dict(k=0, weight_sum=0.0, lr_max=-1.0) for _ in self.groups]
        self.train_mode = False
        self.acc = z()
        if rule == "adagrad":  # SPEC 10.2: sum starts at initial_accumulator_value
            for hyper, sl in self.groups:
                self.v[sl] = float(hyper["initial_accumulator_value"])
        self.u, self.psi, self.m2 = z(), z(), z()  # DP-Adadelta's u, psi; AdEMAMix's m2
        # DP-Adafactor's factors per trainable parameter (SPEC 10.7): "row" p.shape[:-1]
        # (p.shape below 2-D, where it holds the unfactored variance), "col"
        # p.shape[:-2] + p.shape[-1:] (a scalar below 2-D)
        self.row_var = {
            k: torch.zeros(shape[:-1] if len(shape) >= 2 else shape, dtype=F64)
            for k, (_, _, shape, _) in enumerate(self.entries)
        }
        self.col_var = {
            k: torch.zeros(shape[:-2] + shape[-1:] if len(shape) >= 2 else (), dtype=F64)
            for k, (_, _, shape, _) in enumerate(self.entries)
        }
        self._gen = None if perturb is None else torch.Generator().manual_seed(perturb)
        self.shadows = (
            []
            if perturb is not None
            else [
                SpecOptimizer(
                    rule,
                    groups,
                    max_grad_norm=max_grad_norm,
                    noise_multiplier=noise_multiplier,
                    expected_batch_size=expected_batch_size,
                    key=key,
                    b_init=b_init,
                    perturb=1000 + k,
                )
                for k in range(SHADOWS)
            ]
        )

    def _r(self, x):
        """An intermediate result: exact in the model, perturbed by 2^-23 in a shadow."""
        if self._gen is None:
            return x
        if isinstance(x, float):
            return x * (1.0 + ROUNDOFF * (2.0 * float(torch.rand((), generator=self._gen)) - 1))
        noise = torch.rand(x.shape, generator=self._gen, dtype=F64)
        return x * (1.0 + ROUNDOFF * (2.0 * noise - 1.0))

    # -- views -------------------------------------------------------------------------
    def params(self) -> list[torch.Tensor]:
        """Current trainable parameters (float64, shaped, already rounded to their dtype)."""
        return [self.p[sl].reshape(shape) for _, sl, shape, _ in self.entries]

    def sync_params(self, tensors) -> None:
        """Take ``tensors`` (the optimizer's trainable parameters, in order) as this model's
        and its shadows' parameters: for bf16, where two correct implementations may round
        a step's result to neighbouring bf16 values (one each way of a tie), so that each
        step is compared from the same start and such one-ulp splits do not add up."""
        for m in (self, *self.shadows):
            for (_, sl, _, _), t in zip(m.entries, tensors):
                m.p[sl] = t.detach().to(F64).reshape(-1)

    def state(self, k: int) -> dict[str, torch.Tensor]:
        """States of trainable parameter k (float64, shaped like it), torch.optim names."""
        _, sl, shape, _ = self.entries[k]
        return {
            "momentum_buffer": self.buf[sl].reshape(shape),
            "exp_avg": self.m[sl].reshape(shape),
            "exp_avg_sq": self.v[sl].reshape(shape),
            "exp_var": self.S[sl].reshape(shape),
            "scale": self.b[sl].reshape(shape),
            "z": self.zs[sl].reshape(shape),
            "square_avg": self.v[sl].reshape(shape),  # RMSprop's, Adadelta's v (SPEC 10.1, 10.5)
            "grad_avg": self.m[sl].reshape(shape),
            "sum": self.v[sl].reshape(shape),  # Adagrad's s (SPEC 10.2)
            "acc_delta": self.u[sl].reshape(shape),
            "acc_delta_noise_var": self.psi[sl].reshape(shape),
            "exp_avg_slow": self.m2[sl].reshape(shape),
            "row_var": self.row_var[k],
            "col_var": self.col_var[k],
        }

    def slacks(self) -> list[torch.Tensor]:
        """Per-parameter float32 error budgets (float64, shaped like the params)."""
        out = [torch.zeros(shape, dtype=F64) for _, _, shape, _ in self.entries]
        for sh in self.shadows:
            out = [
                torch.maximum(o, SLACK_FACTOR * (q - q2).abs())
                for o, q, q2 in zip(out, self.params(), sh.params())
            ]
        return out

    def state_slack(self, k: int) -> dict[str, torch.Tensor]:
        """Float32 error budgets of the states of trainable parameter k."""
        ours = self.state(k)
        out = {n: torch.zeros_like(v) for n, v in ours.items()}
        for sh in self.shadows:
            theirs = sh.state(k)
            out = {
                n: torch.maximum(out[n], SLACK_FACTOR * (ours[n] - theirs[n]).abs()) for n in ours
            }
        return out

    def set_privacy(self, *, max_grad_norm, noise_multiplier, expected_batch_size) -> None:
        """Change C, sigma, B_e before the next step (a noise schedule)."""
        for m in (self, *self.shadows):
            m.C, m.sigma, m.B_e = max_grad_norm, noise_multiplier, expected_batch_size

    # -- section 2 (and the whitening of section 7) --------------------------------------
    def _rows(self, grads, t: int) -> torch.Tensor:
        """[B, d] rows x_i: per-sample gradients (whitened for MacAdam)."""
        B = next(g.shape[0] for g in grads if g is not None)
        parts = []
        for (_, sl, shape, _), g in zip(self.entries, grads):
            n = sl.stop - sl.start
            parts.append(
                torch.zeros(B, n, dtype=F64) if g is None else g.detach().to(F64).reshape(B, n)
            )
        X = torch.cat(parts, dim=1) if parts else torch.zeros(B, 0, dtype=F64)
        if self.rule == "macadam":  # w_i = (g_i - m_hat_{t-1}) / b
            X = self._r(self._r(X - self._m_hat(t - 1)) / self.b)
        return X

    def _m_hat(self, t: int) -> torch.Tensor:
        """m_hat_t = m_t / (1 - beta1^t) with the current m, beta1 per group (m_hat_0 = 0)."""
        out = torch.zeros(self.d, dtype=F64)
        if t > 0:
            for hyper, sl in self.groups:
                out[sl] = self._r(self.m[sl] / (1.0 - hyper["betas"][0] ** t))
        return out

    def clipped_sum(self, grads, t: int) -> torch.Tensor:
        """Sum_i c_i x_i over one micro-batch (flat [d]); c_i per SPEC 2 or SPEC 7."""
        r = self._r
        X = self._rows(grads, t)
        n = r(X.norm(dim=1))
        if self.rule == "macadam":
            c = r(1.0 / torch.clamp(n, min=1.0))  # w_bar_i = w_i / max(1, ||w_i||)
        else:
            c = r(torch.clamp(self.C / (n + CLIP_EPS), max=1.0))
        return r((r(c[:, None] * X)).sum(dim=0))

    def accumulate(self, grads) -> None:
        """Fold one micro-batch into the logical batch (no noise)."""
        self.acc = self._r(self.acc + self.clipped_sum(grads, self.t + 1))
        for sh in self.shadows:
            sh.accumulate(grads)

    # -- sections 4, 5, 7 ------------------------------------------------------------------
    def step(self, grads=None) -> None:
        """One step: grads is a list (one entry per trainable param: None or [B, *shape])
        or None when everything was accumulated."""
        for sh in self.shadows:
            sh.step(grads)
        r = self._r
        self.t += 1
        t = self.t
        S = self.acc.clone()
        if grads is not None:
            S = r(S + self.clipped_sum(grads, t))
        self.acc.zero_()
        z = gaussian_noise(self.d, key=self.key, step=t, backend="torch").to(F64)
        noise_std = self.sigma * (1.0 if self.rule == "macadam" else self.C)
        g_hat = r(r(S + r(noise_std * z)) / self.B_e)  # SPEC 4 (whitened w~ for MacAdam)
        update = getattr(self, f"_{self.rule}", self._adam)  # _sgd, _macadam, ...; else Adam
        if self.rule in SCHEDULE_FREE:
            assert self.train_mode, "SPEC 10.8: a step in eval mode is refused"
            update = self._schedule_free
        for gi, (hyper, sl) in enumerate(self.groups):
            if sl.stop > sl.start:
                update(gi, hyper, sl, g_hat[sl])
        if self.rule == "macadam":
            self._macadam_scale()
        for _, sl, _, dtype in self.entries:  # rounded once on store
            self.p[sl] = self.p[sl].to(dtype).to(F64)

    def _moments(self, h, sl, g):
        """m, v EMAs (in place) and their bias-corrected m_hat, v_hat (SPEC 5.2)."""
        r, t, (beta1, beta2) = self._r, self.t, h["betas"]
        self.m[sl] = r(r(beta1 * self.m[sl]) + r((1 - beta1) * g))
        self.v[sl] = r(r(beta2 * self.v[sl]) + r(r((1 - beta2) * g) * g))
        return r(self.m[sl] / (1 - beta1**t)), r(self.v[sl] / (1 - beta2**t))

    def _sgd(self, gi, h, sl, g_hat):  # SPEC 5.1, torch.optim.SGD semantics
        r, p, mu = self._r, self.p[sl], h["momentum"]
        g = r(g_hat + r(h["weight_decay"] * p))
        if mu != 0:
            if self.t == 1:
                buf = g.clone()
            else:
                buf = r(r(mu * self.buf[sl]) + r((1.0 - h["dampening"]) * g))
            self.buf[sl] = buf
            g = r(g + r(mu * buf)) if h["nesterov"] else buf
        self.p[sl] = r(p - r(h["lr"] * g))

    def _adam(self, gi, h, sl, g_hat):  # SPEC 5.2 - 5.5
        r, t, beta2, lr, wd = self._r, self.t, h["betas"][1], h["lr"], h["weight_decay"]
        p = self.p[sl]
        if self.rule in ("adamw", "adamw_bc"):
            p = r(p * (1.0 - lr * wd))  # decoupled, first
            g = g_hat
        else:
            g = r(g_hat + r(wd * p))  # coupled L2
        m_hat, v_hat = self._moments(h, sl, g)
        if self.rule in ("adam_bc", "adamw_bc"):
            Phi = (self.sigma * self.C / self.B_e) ** 2
            self.phi[gi] = r(beta2 * self.phi[gi] + (1 - beta2) * Phi)
            phi_hat = r(self.phi[gi] / (1 - beta2**t))
            denom = r(torch.sqrt(torch.clamp(r(v_hat - phi_hat), min=h["gamma"])))
        else:
            denom = r(r(v_hat.sqrt()) + h["eps"])
        self.p[sl] = r(p - r(lr * r(m_hat / denom)))

    def _macadam(self, gi, h, sl, w_tilde):  # SPEC 7, per group
        r, t, beta1 = self._r, self.t, h["betas"][0]
        b = self.b[sl]
        m_hat_prev = r(self.m[sl] / (1 - beta1 ** (t - 1))) if t > 1 else torch.zeros_like(b)
        g = r(r(b * w_tilde) + m_hat_prev)  # back to gradient scale
        m_hat, v_hat = self._moments(h, sl, g)
        self.p[sl] = r(self.p[sl] - r(h["lr"] * r(m_hat / r(r(v_hat.sqrt()) + h["gamma"]))))
        u = {
            "unbiased": r(r(g - m_hat_prev) * r(g - m_hat)),
            "paper": r(r(g - m_hat) ** 2),
            "code": r(r(g - m_hat_prev) ** 2),
        }[h["variance_estimate"]]
        self.S[sl] = r(r(beta1 * self.S[sl]) + r((1 - beta1) * u))

    def _macadam_scale(self):
        """t >= 2: S_hat = clamp(S/kappa_t - b^2 sigma^2/B_e^2, h1, h2);
        b <- S_hat^(1/4) (sum_j S_hat_j^(1/2))^(1/2), the sum over ALL coordinates."""
        if self.t < 2:
            return
        r = self._r
        S_hat = torch.zeros(self.d, dtype=F64)
        for hyper, sl in self.groups:
            k = kappa(hyper["betas"][0], self.t)
            raw = r(r(self.S[sl] / k) - r(r(self.b[sl] ** 2) * (self.sigma / self.B_e) ** 2))
            S_hat[sl] = torch.clamp(raw, min=hyper["h1"], max=hyper["h2"])
        total = r(float(r(S_hat.sqrt()).sum()))
        self.b = r(r(S_hat.sqrt().sqrt()) * math.sqrt(total))

    # -- SPEC 10.8: schedule-free SGD and AdamW ------------------------------------------
    def _sf_beta(self, h) -> float:
        return h["momentum"] if self.rule == "sgd_schedule_free" else h["betas"][0]

    def _schedule_free(self, gi, h, sl, g_hat):
        """y <- (1 - c) y + c z + gamma_t (beta (1 - c) - 1) u;  z <- z - gamma_t u."""
        r, sf = self._r, self.sf[gi]
        t = sf["k"] + 1
        warm = h["warmup_steps"]
        lr = h["lr"] * (t / warm if t - 1 < warm else 1.0)
        sf["lr_max"] = max(lr, sf["lr_max"])
        w = t ** h["r"] * sf["lr_max"] ** h["weight_lr_power"]
        sf["weight_sum"] += w
        c = w / sf["weight_sum"] if sf["weight_sum"] != 0 else 0.0
        sf["k"] = t
        y = self.p[sl]
        if t == 1:
            self.zs[sl] = y.clone()  # z starts at the parameter
        z = self.zs[sl]
        if self.rule == "sgd_schedule_free":
            u = r(g_hat + r(h["weight_decay"] * y))
        else:
            beta2 = h["betas"][1]
            self.v[sl] = r(r(beta2 * self.v[sl]) + r(r((1 - beta2) * g_hat) * g_hat))
            v_hat = r(self.v[sl] / (1 - beta2**t))
            if h["noise_bias_correction"]:
                Phi = (self.sigma * self.C / self.B_e) ** 2
                self.phi[gi] = r(beta2 * self.phi[gi] + (1 - beta2) * Phi)
                phi_hat = r(self.phi[gi] / (1 - beta2**t))
                denom = r(torch.sqrt(torch.clamp(r(v_hat - phi_hat), min=h["gamma"])))
            else:
                denom = r(r(v_hat.sqrt()) + h["eps"])
            u = r(r(g_hat / denom) + r(h["weight_decay"] * y))
        beta = self._sf_beta(h)
        x = r(r(y - r((1 - beta) * z)) / beta)  # the average, from y = (1 - beta) z + beta x
        z = r(z - r(lr * u))
        x = r(r((1 - c) * x) + r(c * z))
        self.zs[sl] = z
        self.p[sl] = r(r((1 - beta) * z) + r(beta * x))

    def eval(self) -> None:
        """Parameters to x = (y - (1 - beta) z) / beta (SPEC 10.8), rounded to their dtype."""
        self._swap(False)

    def train(self) -> None:
        """Parameters to y = (1 - beta) z + beta x."""
        self._swap(True)

    def _swap(self, to_train: bool) -> None:
        for sh in self.shadows:
            sh._swap(to_train)
        if self.train_mode != to_train and self.t > 0:
            for gi, (h, sl) in enumerate(self.groups):
                beta, z = self._sf_beta(h), self.zs[sl]
                if to_train:
                    self.p[sl] = self._r(self._r((1 - beta) * z) + self._r(beta * self.p[sl]))
                else:
                    self.p[sl] = self._r(self._r(self.p[sl] - self._r((1 - beta) * z)) / beta)
            for _, sl, _, dtype in self.entries:
                self.p[sl] = self.p[sl].to(dtype).to(F64)
        self.train_mode = to_train

    # -- section 10 ------------------------------------------------------------------------
    def _noise_var(self) -> float:
        """Phi_t = (sigma_t C / B_e)^2 with the privacy arguments in force at this step."""
        return (self.sigma * self.C / self.B_e) ** 2

    def _rmsprop(self, gi, h, sl, g_hat):  # SPEC 10.1, torch.optim.RMSprop semantics
        r, p, alpha, eps = self._r, self.p[sl], h["alpha"], h["eps"]
        g = r(g_hat + r(h["weight_decay"] * p))  # coupled L2
        self.v[sl] = r(r(alpha * self.v[sl]) + r(r((1 - alpha) * g) * g))
        v = self.v[sl]
        if h["centered"]:
            self.m[sl] = r(self.m[sl] + r((1 - alpha) * r(g - self.m[sl])))
            a = r(r(torch.sqrt(r(v - r(self.m[sl] * self.m[sl])))) + eps)
        elif h["noise_bias_correction"]:
            self.phi[gi] = alpha * self.phi[gi] + (1 - alpha) * self._noise_var()
            a = r(r(torch.sqrt(torch.clamp(r(v - self.phi[gi]), min=h["gamma"]))) + eps)
        else:
            a = r(r(torch.sqrt(v)) + eps)
        if h["momentum"] > 0:
            self.buf[sl] = r(r(h["momentum"] * self.buf[sl]) + r(g / a))
            self.p[sl] = r(p - r(h["lr"] * self.buf[sl]))
        else:
            self.p[sl] = r(p - r(h["lr"] * r(g / a)))

    def _adagrad(self, gi, h, sl, g_hat):  # SPEC 10.2, torch.optim.Adagrad semantics
        r, p, eps = self._r, self.p[sl], h["eps"]
        g = r(g_hat + r(h["weight_decay"] * p))  # coupled L2
        clr = h["lr"] / (1 + (self.t - 1) * h["lr_decay"])
        self.v[sl] = r(self.v[sl] + r(g * g))
        s = self.v[sl]
        if h["noise_bias_correction"]:
            self.phi[gi] = self.phi[gi] + self._noise_var()  # cumulative
            d = r(r(torch.sqrt(torch.clamp(r(s - self.phi[gi]), min=h["gamma"]))) + eps)
        else:
            d = r(r(torch.sqrt(s)) + eps)
        self.p[sl] = r(p - r(clr * r(g / d)))

    # -- section 10 ------------------------------------------------------------------------
    def _adadelta(self, gi, h, sl, g_hat):  # SPEC 10.5, torch.optim.Adadelta on g_hat
        r, rho, eps, lr = self._r, h["rho"], h["eps"], h["lr"]
        p = self.p[sl]
        g = r(g_hat + r(h["weight_decay"] * p))  # coupled L2
        self.v[sl] = v = r(r(rho * self.v[sl]) + r(r((1 - rho) * g) * g))
        u, psi = self.u[sl], self.psi[sl]
        if h["noise_bias_correction"]:
            Phi = (self.sigma * self.C / self.B_e) ** 2
            self.phi[gi] = phi = r(rho * self.phi[gi] + (1 - rho) * Phi)
            num = r(torch.sqrt(r(torch.clamp(r(u - psi), min=0.0) + eps)))
            den = r(torch.sqrt(r(torch.clamp(r(v - phi), min=h["gamma"]) + eps)))
        else:
            num, den = r(torch.sqrt(r(u + eps))), r(torch.sqrt(r(v + eps)))
        c = r(num / den)
        delta = r(c * g)
        self.u[sl] = r(r(rho * u) + r(r((1 - rho) * delta) * delta))
        if h["noise_bias_correction"]:
            self.psi[sl] = r(r(rho * psi) + r(r(r((1 - rho) * c) * c) * Phi))
        self.p[sl] = r(p - r(lr * delta))

    def _ademamix(self, gi, h, sl, g):  # SPEC 10.6, the paper's form (not the computed one)
        r, t, lr, eps, wd = self._r, self.t, h["lr"], h["eps"], h["weight_decay"]
        b1, b2, b3 = h["betas"]
        alpha, T = h["alpha"], h["t_alpha_beta3"]
        if T and t < T:
            alpha_t = min(t * alpha / T, alpha)
            ln1, ln3 = math.log(b1), math.log(b3)
            beta3_t = min(math.exp(ln1 * ln3 / ((1 - t / T) * ln3 + (t / T) * ln1)), b3)
        else:
            alpha_t, beta3_t = alpha, b3
        p = self.p[sl]
        self.m[sl] = m1 = r(r(b1 * self.m[sl]) + r((1 - b1) * g))
        self.m2[sl] = m2 = r(r(beta3_t * self.m2[sl]) + r((1 - beta3_t) * g))
        self.v[sl] = nu = r(r(b2 * self.v[sl]) + r(r((1 - b2) * g) * g))
        m1_hat, nu_hat = r(m1 / (1 - b1**t)), r(nu / (1 - b2**t))
        if h["noise_bias_correction"]:
            Phi = (self.sigma * self.C / self.B_e) ** 2
            self.phi[gi] = r(b2 * self.phi[gi] + (1 - b2) * Phi)
            phi_hat = r(self.phi[gi] / (1 - b2**t))
            root = r(torch.sqrt(torch.clamp(r(nu_hat - phi_hat), min=h["gamma"])))
        else:
            root = r(nu_hat.sqrt())
        update = r(r(m1_hat + r(alpha_t * m2)) / r(root + eps))
        self.p[sl] = r(p - r(lr * r(update + r(wd * p))))

    # -- section 10.3 ------------------------------------------------------------------
    def _radam(self, gi, h, sl, g_hat):  # SPEC 10.3, torch.optim.RAdam semantics
        r, t, beta2 = self._r, self.t, h["betas"][1]
        lr, wd = h["lr"], h["weight_decay"]
        p = self.p[sl]
        if wd != 0 and h["decoupled_weight_decay"]:
            p = r(p * (1.0 - lr * wd))  # decoupled, first
            g = g_hat
        else:
            g = r(g_hat + r(wd * p))  # coupled L2
        m_hat, v_hat = self._moments(h, sl, g)
        if h["noise_bias_correction"]:  # phi advances at every step, warm-up included
            Phi = (self.sigma * self.C / self.B_e) ** 2
            self.phi[gi] = r(beta2 * self.phi[gi] + (1 - beta2) * Phi)
        rho_inf = 2.0 / (1.0 - beta2) - 1.0
        rho_t = rho_inf - 2.0 * t * beta2**t / (1.0 - beta2**t)
        if rho_t <= 5.0:  # warm-up: v is not read
            self.p[sl] = r(p - r(lr * m_hat))
            return
        rect = math.sqrt(
            (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
        )
        if h["noise_bias_correction"]:
            phi_hat = r(self.phi[gi] / (1 - beta2**t))
            scale = r(1.0 / r(torch.sqrt(torch.clamp(r(v_hat - phi_hat), min=h["gamma"]))))
        else:  # eps on sqrt(v) (not on sqrt(v_hat)), times sqrt(1 - beta2^t)
            scale = r(math.sqrt(1 - beta2**t) / r(r(self.v[sl].sqrt()) + h["eps"]))
        self.p[sl] = r(p - r(r(r(lr * m_hat) * scale) * rect))

    # -- section 10.4 ------------------------------------------------------------------
    def _lion(self, gi, h, sl, g_hat):  # SPEC 10.4, lion_pytorch.Lion semantics
        r, (beta1, beta2), lr = self._r, h["betas"], h["lr"]
        p = r(self.p[sl] * (1.0 - lr * h["weight_decay"]))  # decoupled, first
        c = r(r(beta1 * self.m[sl]) + r((1 - beta1) * g_hat))
        self.p[sl] = r(p - lr * torch.sign(c))  # sign(0) = 0
        self.m[sl] = r(r(beta2 * self.m[sl]) + r((1 - beta2) * g_hat))

    def _adafactor(self, gi, h, sl, g_hat):  # SPEC 10.7, each parameter of the group
        r, t = self._r, self.t
        w = t ** h["beta2_decay"]  # the EMA weight of the newest term (1 - beta2_t)
        rho = min(h["lr"], 1.0 / math.sqrt(t))
        eps1 = 2.0**-23 if h["eps"][0] is None else h["eps"][0]
        eps2, gamma, correct = h["eps"][1], h["gamma"], h["noise_bias_correction"]
        if correct:  # phi_t = (1 - w_t) phi_{t-1} + w_t Phi_t
            Phi = (self.sigma * self.C / self.B_e) ** 2
            self.phi[gi] = r((1 - w) * self.phi[gi] + w * Phi)
        phi = self.phi[gi]
        floor = lambda x: torch.clamp(r(x - phi), min=gamma) if correct else x
        for k, (gk, esl, shape, _) in enumerate(self.entries):
            n = esl.stop - esl.start
            if gk != gi or n == 0:
                continue
            p = self.p[esl].reshape(shape)
            g = g_hat[esl.start - sl.start : esl.stop - sl.start].reshape(shape)
            alpha = max(eps2, r(math.sqrt(float((p * p).sum())) / math.sqrt(n))) * rho
            p = r(p * (1.0 - h["lr"] * h["weight_decay"]))  # decoupled, with lr
            g2 = r(g * g)
            if len(shape) >= 2:
                self.row_var[k] = r(self.row_var[k] + w * r(r(g2.mean(-1)) - self.row_var[k]))
                self.col_var[k] = r(self.col_var[k] + w * r(r(g2.mean(-2)) - self.col_var[k]))
                rt, ct = floor(self.row_var[k]), floor(self.col_var[k])
                mean = torch.clamp(r(rt.mean(-1)), min=eps1)
                V = r(r(rt[..., :, None] * ct[..., None, :]) / mean[..., None, None])
            else:
                self.row_var[k] = r(self.row_var[k] + w * r(g2 - self.row_var[k]))
                V = floor(self.row_var[k])
            U = r(g / r(torch.sqrt(torch.clamp(V, min=eps1 * eps1))))
            rms_u = r(math.sqrt(float((U * U).mean())))
            step = alpha / max(1.0, rms_u / h["d"])
            self.p[esl] = r(p - r(step * U)).reshape(-1)
