"""The optimizer classes give the same trajectory on every backend (SPEC section 6):
several steps, two parameter groups, a frozen parameter, an unused parameter, gradient
accumulation, an empty batch; fp32 parameters, and bf16 for DP-SGD."""

from __future__ import annotations

import pytest
import torch

import dpkern
from dpkern import rules

from conftest import backend_device, case_seed

# Well-conditioned hyper-parameters: with gamma or h1 near 1e-6 the clamps in
# sqrt(max(v_hat - phi_hat, gamma)) and S/kappa - b^2 sigma^2/B_e^2 turn a 1-ulp
# difference in z (cos/log rounding differs by device) into errors far above 1e-5.
# DP-MacAdam's first step runs at b = 1/d, so |g~| is about 1e-4 and the update
# m_hat / (sqrt(v_hat) + gamma) = g~ / (|g~| + gamma) has slope 1/gamma at g~ = 0: with the
# default gamma = 1e-8, a g~ that cancels to near zero turns z's ~1e-11 rounding (scaled by b)
# into ~1e-6 in p (a fuzz of the cpp backend: 2 of 2000 seeds past tolerance); gamma = 1e-4
# bounds that slope (0 of 2000, worst at 4% of tolerance).
CLASSES = {
    "sgd": (dpkern.DPSGD, dict(momentum=0.9, nesterov=True, weight_decay=0.01)),
    "sgd_plain": (dpkern.DPSGD, dict(weight_decay=0.01)),  # momentum 0: no buffer at all
    "adam": (dpkern.DPAdam, dict(weight_decay=0.01)),
    "adam_bc": (dpkern.DPAdamBC, dict(gamma=1e-2)),
    "adamw": (dpkern.DPAdamW, dict(weight_decay=0.1)),
    "adamw_bc": (dpkern.DPAdamWBC, dict(weight_decay=0.1, gamma=1e-2)),
    "macadam": (dpkern.DPMacAdam, dict(h1=1e-2, h2=10.0, gamma=1e-4)),
    "rmsprop": (dpkern.DPRMSprop, dict(alpha=0.9, weight_decay=0.01, momentum=0.9)),
    "rmsprop_centered": (dpkern.DPRMSprop, dict(alpha=0.9, centered=True)),
    "rmsprop_bc": (dpkern.DPRMSprop, dict(noise_bias_correction=True, gamma=1e-2)),
    "adagrad": (
        dpkern.DPAdagrad,
        dict(lr_decay=0.1, weight_decay=0.01, initial_accumulator_value=0.1),
    ),
    "adagrad_bc": (dpkern.DPAdagrad, dict(noise_bias_correction=True, gamma=1e-2)),
    "adadelta": (dpkern.DPAdadelta, dict(weight_decay=0.01)),
    "adadelta_bc": (dpkern.DPAdadelta, dict(noise_bias_correction=True, gamma=1e-2)),
    "ademamix": (dpkern.DPAdEMAMix, dict(weight_decay=0.1)),
    "ademamix_bc_warmup": (
        dpkern.DPAdEMAMix,
        dict(weight_decay=0.1, noise_bias_correction=True, gamma=1e-2, t_alpha_beta3=3),
    ),
    "radam": (dpkern.DPRAdam, dict(weight_decay=0.01)),
    "radam_bc_decoupled": (
        dpkern.DPRAdam,
        dict(weight_decay=0.1, decoupled_weight_decay=True, noise_bias_correction=True, gamma=1e-2),
    ),
    "lion": (dpkern.DPLion, dict(weight_decay=0.1)),
    "adafactor": (dpkern.DPAdafactor, dict(weight_decay=0.1)),
    "adafactor_bc": (dpkern.DPAdafactor, dict(noise_bias_correction=True, gamma=1e-2)),
}
CLASSES.update(
    {
        "sgd_schedule_free": (
            dpkern.DPSGDScheduleFree,
            dict(weight_decay=0.01, warmup_steps=2, r=0.5),
        ),
        "adamw_schedule_free": (
            dpkern.DPAdamWScheduleFree,
            dict(weight_decay=0.05, warmup_steps=2),
        ),
        "adamw_schedule_free_bc": (
            dpkern.DPAdamWScheduleFree,
            dict(noise_bias_correction=True, gamma=1e-2, weight_decay=0.05),
        ),
    }
)
for _name, _spec in rules.RULES.items():  # every registered rule's class is a case
    CLASSES.setdefault(_name, (_spec.optimizer_class(), {}))
SHAPES = [(9, 7), (7,), (1,), (), (130,), (3, 4, 5)]


def _setup(name, backend, dtype, device):
    cls, extra = CLASSES[name]
    g = torch.Generator().manual_seed(case_seed(0))  # fresh each run (conftest)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype).to(device)) for s in SHAPES]
    params[3].requires_grad_(False)  # frozen: no noise index, no state, no decay
    groups = [{"params": params[:3]}, {"params": params[3:], "lr": 0.02}]
    kw = dict(
        lr=0.05, noise_multiplier=0.6, expected_batch_size=5.0, seed=2024, backend=backend, **extra
    )
    if not cls.rule.whitening:  # whitening rules have no max_grad_norm
        kw["max_grad_norm"] = 2.0
    opt = cls(groups, **kw)
    if hasattr(opt, "train"):  # schedule-free (SPEC 10.8): train mode before stepping
        opt.train()
    return params, opt


def _trajectory(name, backend, dtype, device):
    params, opt = _setup(name, backend, dtype, device)
    g = torch.Generator().manual_seed(case_seed(1))  # fresh each run (conftest)
    for step, batches in enumerate([[4], [3, 2], [0], [5]]):
        for i, B in enumerate(batches):
            for k, p in enumerate(params):
                if not p.requires_grad or (k == 2 and step == 1):
                    continue  # frozen / unused this step
                p.grad_sample = (2 * torch.randn((B, *p.shape), generator=g)).to(dtype).to(device)
            if i < len(batches) - 1:
                opt.accumulate()
        opt.step()
        opt.zero_grad()
    return params, opt


# bf16 over several steps only for SGD: with Adam-type rules a 1-ulp rounding flip in one
# step is amplified by the normalised update (lr-sized differences where m_hat ~ 0);
# single-step bf16 parity of every rule is tested in test_backend_parity.py.
CASES = [(n, torch.float32) for n in CLASSES] + [("sgd", torch.bfloat16)]


@pytest.mark.parametrize("name,dtype", CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_same_trajectory_as_reference(fused_backend, name, dtype):
    device = backend_device(fused_backend)
    want_p, want_o = _trajectory(name, "torch", dtype, device)
    got_p, got_o = _trajectory(name, fused_backend, dtype, device)
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (1.6e-2, 1e-3)
    for a, b in zip(got_p, want_p):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)
    assert got_o.dp_step == want_o.dp_step == 4
    for q, p in zip(got_p, want_p):
        if not p.requires_grad:
            assert q not in got_o.state and p not in want_o.state
            continue
        assert got_o.state[q].keys() == want_o.state[p].keys()
        momentum = CLASSES[name][1].get("momentum", 0) > 0  # a buffer only where used
        assert ("momentum_buffer" in want_o.state[p]) == momentum
        for sname, val in want_o.state[p].items():
            torch.testing.assert_close(
                got_o.state[q][sname].float(),
                val.float(),
                rtol=max(rtol, 1e-4),
                atol=max(atol, 1e-5),
            )
