"""The twin harness of tests/test_rule_*.py: a DP optimizer with sigma = 0 and a huge C (its
privatised gradient is then the batch's mean gradient) steps beside a non-private twin
(torch.optim.X, lion_pytorch, schedulefree, a float64 reference) that is given that mean
as .grad; after every step the parameters and the named states must agree.

Imported by the test files as ``from twin import ...`` (tests/ is on sys.path, as for
``from test_reference_spec import ...``)."""

from __future__ import annotations

import random

import torch

from conftest import RUN_SEED, backend_device, require_backend

_SEEDS = random.Random(RUN_SEED ^ 0x7717)  # (replayed with DPKERN_TEST_SEED, as case_seed)

#: Options of the DP optimizer that its twin does not have (the noise bias correction):
#: left out of the twin's options (with sigma = 0, phi = 0 and the twin's update is the
#: corrected one wherever the floor gamma is not hit).
DP_ONLY = ("noise_bias_correction", "gamma")


def fresh_seed() -> int:
    """A fresh noise / case seed: a new one at each call, the same sequence for the same
    DPKERN_TEST_SEED (conftest's RUN_SEED), so a failure replays."""
    return _SEEDS.getrandbits(32)


def need_backend(name: str) -> torch.device:
    """The device of backend ``name``'s tests (conftest's ``backend_device``); skips the
    test where the backend is not available (Triton: outside TRITON_INTERPRET=1 without
    CUDA)."""
    return backend_device(require_backend(name))


def _groups(params, lrs, split):
    """One group, or two split at ``split`` with lrs[i] as the group's lr (None: none)."""
    if lrs is None:
        return [dict(params=params)]
    parts = (params[:split], params[split:])
    return [dict(params=ps, **({} if lr is None else {"lr": lr})) for ps, lr in zip(parts, lrs)]


def twin_pair(dp_cls, twin_cls, options, backend, *, shapes, B, seed, lrs=None, split=1,
              max_grad_norm=1e6, twin_dtype=None):  # fmt: skip
    """(DP optimizer, its parameters, twin, its parameters, generator of the gradients):
    the same random start on the backend's device (the twin's in ``twin_dtype`` if given),
    the same param groups; ``options`` go to both but :data:`DP_ONLY`, which only the DP
    optimizer gets."""
    device = need_backend(backend)
    gen = torch.Generator().manual_seed(seed)
    a = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().to(twin_dtype or p.dtype).clone()) for p in a]
    dp = dp_cls(
        _groups(a, lrs, split),
        **options,
        max_grad_norm=max_grad_norm,
        noise_multiplier=0.0,
        expected_batch_size=B,
        seed=seed,
        backend=backend,
    )
    twin_options = {k: v for k, v in options.items() if k not in DP_ONLY}
    twin = twin_cls(_groups(b, lrs, split), **twin_options)
    return dp, a, twin, b, gen


def feed(a, b, gen, B, offset: float = 0.0):
    """B per-sample gradients for each DP parameter, their mean as its twin's .grad.
    ``offset`` > 0: each element's B gradients share a shift of +-offset (random signs, new
    at each call), so that their mean is kept away from 0, where the float32 sum cancels
    and its relative rounding (the backends sum in different orders) is unbounded."""
    for p, q in zip(a, b, strict=True):
        gs = torch.randn((B, *p.shape), generator=gen)
        if offset:
            sign = torch.randint(0, 2, p.shape, generator=gen) * 2 - 1
            gs = gs + offset * sign
        gs = gs.to(p.device)
        p.grad_sample = gs
        q.grad = gs.mean(0).to(q.dtype)


def assert_twins(dp, a, twin, b, msg, *, states=None, state_atol=None, rtol=1e-5, atol=1e-6,
                 step=None):  # fmt: skip
    """Parameters, and the states named in ``states`` (None: every state the twin keeps
    but "step", which must be the DP optimizer's but "step" and "noise_var_avg"), agree
    within rtol / atol (``state_atol``: a state's atol, a float for all or a dict by
    name); with ``step``, both states' "step" equal it. A float32 DP tensor is compared
    in the twin's dtype (a float64 reference)."""

    def close(x, y, tol, what):
        torch.testing.assert_close(x.detach().to(y.dtype), y.detach(), rtol=rtol, atol=tol,
                                   msg=lambda e: f"{what}\n{e}")  # fmt: skip

    for k, (p, q) in enumerate(zip(a, b, strict=True)):
        m = f"{msg} param {k}"
        close(p, q, atol, m)
        st, tst = dp.state[p], twin.state[q]
        names = states
        if names is None:
            names = [n for n in tst if n != "step"]
            assert set(names) == set(st) - {"step", "noise_var_avg"}, m
        for name in names:
            tol = state_atol.get(name, atol) if isinstance(state_atol, dict) else state_atol
            close(st[name], tst[name], atol if tol is None else tol, f"{m} {name}")
        if step is not None:
            assert float(st["step"]) == float(tst["step"]) == step, m


def twin_run(dp_cls, twin_cls, options, backend, *, shapes, steps, B, seed=None, lrs=None,
             split=1, max_grad_norm=1e6, twin_dtype=None, states=None, state_atol=None,
             rtol=1e-5, atol=1e-6, check_step=False, swaps=None, check=None,
             offset=0.0):  # fmt: skip
    """``steps`` steps of ``dp_cls`` and its twin ``twin_cls`` (see :func:`twin_pair`) on
    the same gradients (a fresh seed unless given), compared after each (see
    :func:`assert_twins`; ``check_step``: "step" is t). ``check(dp, a, twin, b, t, msg)``,
    if given, checks more at each comparison. ``swaps`` (schedule-free): both start in
    train mode, are compared in eval and again in train mode after the steps in
    ``swaps``, and in eval mode at the end. ``offset``: see :func:`feed`. Returns (DP
    optimizer, its parameters)."""
    seed = fresh_seed() if seed is None else seed
    dp, a, twin, b, gen = twin_pair(
        dp_cls, twin_cls, options, backend, shapes=shapes, B=B, seed=seed, lrs=lrs,
        split=split, max_grad_norm=max_grad_norm, twin_dtype=twin_dtype,
    )  # fmt: skip
    label = f"{dp_cls.__name__} {backend} {options} seed={seed}"

    def compare(t, mode=""):
        msg = f"{label} t={t}{mode}"
        assert_twins(dp, a, twin, b, msg, states=states, state_atol=state_atol, rtol=rtol,
                     atol=atol, step=t if check_step else None)  # fmt: skip
        if check is not None:
            check(dp, a, twin, b, t, msg)

    def switch(mode):
        getattr(dp, mode)()
        getattr(twin, mode)()

    if swaps is not None:
        switch("train")
    for t in range(1, steps + 1):
        feed(a, b, gen, B, offset)
        dp.step()
        twin.step()
        compare(t)
        if swaps is not None and t in swaps:
            for mode in ("eval", "train"):
                switch(mode)
                compare(t, f" {mode}")
    if swaps is not None:
        switch("eval")
        compare(steps, " final eval (x)")
    return dp, a
