"""dpkern.distributed: DP steps under torch.distributed DDP equal the single-process steps.

CPU, gloo, ``torch.multiprocessing.spawn``, file:// rendezvous in a tmp dir (no port).
Spawning costs seconds, so one spawn per world size W runs every scenario and saves its
results; the tests below compare them with single-process runs in the pytest process.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dpkern import DPAdamW, DPAdamWBC, DPLion, DPMacAdam, DPRAdam, DPSGD
from dpkern.distributed import (
    DistributedDPOptimizer,
    DistributedPoissonSampler,
    disable_gradient_allreduce,
    key_fingerprint,
    sync_key,
)
from dpkern.distributed.processes import end_worker
from dpkern.functional import gaussian_noise
from dpkern.keys import reveal
from dpkern.grad_sample import compute_grad_sample

from conftest import case_seed

N, D_IN, D_OUT = 13, 5, 3
# global batches of the fixed-batch scenarios: sizes 7, 5, 1 (some ranks empty), 0, 8
BATCHES = [[0, 2, 3, 5, 8, 9, 12], [1, 4, 6, 7, 11], [10], [], [0, 1, 3, 4, 6, 9, 10, 12]]
SIGMA = 0.8
ADAM_LR, ADAM_BETA2, ADAM_EPS = 0.05, 0.999, 1e-8  # _make_opt's Adam-type optimizers
POISSON = dict(num_samples=60, sample_rate=0.05, steps=12)  # training loop, W <= 3
SAMPLER = dict(num_samples=200, sample_rate=0.05, steps=300)  # statistics only
NOISE_NUMEL, NOISE_SIGMA, NOISE_C, NOISE_BE = 30_000, 2.0, 0.5, 10.0


def _net(seed: int = 1234) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, 6), nn.Tanh(), nn.Linear(6, D_OUT))


def _ddp(net: nn.Module):
    """DDP over ``net`` (it broadcasts rank 0's parameters), DDP's own all-reduce disabled."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(net)
    disable_gradient_allreduce(ddp)
    return ddp


def _make_opt(name: str, params, seed, expected_batch_size=float(N) / 2, sigma=SIGMA):
    common = dict(
        max_grad_norm=0.7,
        noise_multiplier=sigma,
        seed=seed,
        backend="torch",
        expected_batch_size=expected_batch_size,
    )
    if name == "adamw":
        return DPAdamW(params, lr=ADAM_LR, weight_decay=0.1, **common)
    if name == "adamw_bc":
        return DPAdamWBC(params, lr=ADAM_LR, weight_decay=0.1, gamma=1e-3, **common)
    if name == "sgd":
        return DPSGD(params, lr=0.2, momentum=0.9, nesterov=True, **common)
    if name == "radam":  # decoupled decay and phi (a per-parameter scalar on every shard)
        return DPRAdam(
            params,
            lr=ADAM_LR,
            weight_decay=0.1,
            decoupled_weight_decay=True,
            noise_bias_correction=True,
            gamma=1e-3,
            **common,
        )
    if name == "lion":
        return DPLion(params, lr=0.01, weight_decay=0.1, **common)
    # gamma 1e-4, not the default 1e-8: the step m_hat / (sqrt(v_hat) + gamma) amplifies
    # the float32 rounding of a cancelling sum by up to 1 / gamma, and the whitened g~ here
    # is ~2e-3 (b = 1/d), so a sum + noise that nearly cancels (g~ ~ 1e-7) turned the
    # ranks' different summation order into 1.7e-6 at step 1 (DPKERN_TEST_SEED=1517284906,
    # W2). With 1e-4 that amplification is <= lr * 3e-10 / 1e-4 ~ 1.5e-7; a sharding or
    # noise error still moves a parameter by O(lr).
    return DPMacAdam(
        params,
        lr=ADAM_LR,
        gamma=1e-4,
        noise_multiplier=sigma,
        expected_batch_size=expected_batch_size,
        seed=seed,
        backend="torch",
    )


def _loss(out, y):
    return nn.functional.cross_entropy(out, y)


def _snapshot(opt) -> dict:
    return {
        "params": [p.detach().clone() for p in opt.trainable_params()],
        "state": [{k: v.clone() for k, v in opt.state[p].items()} for p in opt.trainable_params()],
    }


# ------------------------------------------------------------------------------------
# the worker: every scenario, on every rank
# ------------------------------------------------------------------------------------
def _run_ddp_opacus(rank, world, data):
    """DP-AdamW, secure key, DDP(GradSampleModule) with the no-op comm hook."""
    from opacus import GradSampleModule  # slow import: this scenario runs for W = 2 only

    net = GradSampleModule(_net(), loss_reduction="sum")
    ddp = _ddp(net)
    opt = DistributedDPOptimizer(_make_opt("adamw", net.parameters(), seed=None))
    snaps = []
    for batch in BATCHES:
        local = batch[rank::world]
        out = ddp(data["x"][local])
        nn.functional.cross_entropy(out, data["y"][local], reduction="sum").backward()
        opt.step()
        opt.zero_grad()
        snaps.append(_snapshot(opt.optimizer))
    return {"key": reveal(opt.optimizer._key), "snaps": snaps}  # key: test only, to replay


def _run_func(rank, world, data, name):
    """torch.func per-sample gradients, seeded key; empty local batch: no gradient at all.
    Steps 2 and 3 are one logical batch of two micro-batches (accumulate()). Ranks start
    from different initialisations: DDP's broadcast makes rank 0's everyone's."""
    net = _ddp(_net(1234 + rank)).module
    opt = DistributedDPOptimizer(_make_opt(name, net.parameters(), seed=77))
    snaps = []
    for k, batch in enumerate(BATCHES):
        local = batch[rank::world]
        if local:
            compute_grad_sample(net, _loss, data["x"][local], data["y"][local])
        if k == 1:
            if local:
                opt.accumulate()
            continue
        opt.step()
        opt.zero_grad()
        snaps.append(_snapshot(opt.optimizer))
    return {"snaps": snaps}


def _run_noise(rank, world):
    p = nn.Parameter(torch.zeros(NOISE_NUMEL))
    opt = DistributedDPOptimizer(
        DPSGD(
            [p],
            lr=1.0,
            max_grad_norm=NOISE_C,
            noise_multiplier=NOISE_SIGMA,
            expected_batch_size=NOISE_BE,
            seed=5,
            backend="torch",
        )
    )
    opt.step()  # no sample anywhere: the averaged gradient is pure noise
    return {"update": -p.detach().clone()}


def _catch(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 (the test inspects type and message)
        return (type(exc).__name__, str(exc))
    return None


def _run_mismatch(rank, world, data):
    last = rank == world - 1
    out = {}
    net = _net()
    # seeds differ (reproducible mode): caught at construction
    out["seed"] = _catch(
        lambda: DistributedDPOptimizer(_make_opt("adamw", net.parameters(), seed=11 + int(last)))
    )
    # one rank secure, the others seeded
    out["mixed"] = _catch(
        lambda: DistributedDPOptimizer(
            _make_opt("adamw", net.parameters(), seed=None if last else 11)
        )
    )
    # configuration differs
    out["config"] = _catch(
        lambda: DistributedDPOptimizer(
            _make_opt("adamw", net.parameters(), seed=11, sigma=SIGMA + 0.1 * last)
        )
    )
    # secure mode, then one rank reloads its state (fresh key) without sync_key
    opt = DistributedDPOptimizer(_make_opt("adamw", net.parameters(), seed=None))
    if last:
        opt.optimizer.load_state_dict(opt.optimizer.state_dict())
    before = [p.detach().clone() for p in net.parameters()]
    out["key"] = _catch(opt.step)
    out["key_untouched"] = all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
    opt.load_state_dict(opt.state_dict())  # the wrapper re-syncs: steps work again
    out["key_resync"] = _catch(opt.step)
    # steps differ (seeded: keys agree)
    opt = DistributedDPOptimizer(_make_opt("adamw", net.parameters(), seed=11))
    if last:
        sd = opt.optimizer.state_dict()
        sd["dp"]["step"] = 3
        opt.optimizer.load_state_dict(sd)
    out["step"] = _catch(opt.step)
    # one rank's local clipping fails (NaN): every rank raises, nothing changes anywhere
    opt = DistributedDPOptimizer(_make_opt("adamw", net.parameters(), seed=11))
    local = BATCHES[0][rank::world]
    compute_grad_sample(net, _loss, data["x"][local], data["y"][local])
    if rank == 0:
        net[0].weight.grad_sample[0, 0, 0] = float("nan")
    before = [p.detach().clone() for p in net.parameters()]
    out["nan"] = _catch(opt.step)
    out["nan_untouched"] = all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
    out["nan_step"] = opt.dp_step
    out["nan_retry"] = _catch(opt.step)  # then a valid (empty) step works on every rank
    out["nan_after"] = [p.detach().clone() for p in net.parameters()]
    out.update(_run_inner_failures(net))
    out.update(_run_one_rank_fails(rank, net))
    return out


def _run_one_rank_fails(rank, net):
    """Rank 0 alone fails (an earlier micro-batch, the closure): no rank releases."""
    out = {}
    for case in ("micro_batch", "closure"):
        opt = DistributedDPOptimizer(_make_opt("sgd", net.parameters(), seed=11))
        good = [torch.ones_like(p) for p in opt.optimizer.trainable_params()]
        opt.accumulate_clipped(good, batch_size=1)
        closure = None
        if rank == 0 and case == "micro_batch":
            bad = [torch.full_like(p, float("nan")) for p in opt.optimizer.trainable_params()]
            out[f"{case}_local"] = _catch(lambda: opt.accumulate_clipped(bad, batch_size=1))
        if rank == 0 and case == "closure":

            def closure():
                raise RuntimeError("the closure failed")

        before = [p.detach().clone() for p in net.parameters()]
        out[case] = _catch(lambda: opt.step(closure))
        out[f"{case}_untouched"] = all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
        out[f"{case}_step"] = opt.dp_step
        out[f"{case}_left"] = float(sum(b.abs().sum() for b in opt.optimizer._accum.values()))
    return out


def _run_inner_failures(net):
    """The inner step raises after the all-reduce, then fails midway: the logical batch
    is dropped on every rank (a retry would all-reduce the global sums again: W x the
    sensitivity), and load_state_dict recovers from StepInterrupted."""
    from dpkern.backends import reference

    out = {}
    opt = DistributedDPOptimizer(_make_opt("sgd", net.parameters(), seed=11))
    sums = [torch.ones_like(p) for p in opt.optimizer.trainable_params()]
    opt.accumulate_clipped(sums, batch_size=1)
    inner_step = opt.optimizer.step

    def raising(closure=None):
        raise ValueError("simulated failure of the inner step")

    opt.optimizer.step = raising
    out["inner"] = _catch(opt.step)
    opt.optimizer.step = inner_step
    out["inner_left"] = float(sum(b.abs().sum() for b in opt.optimizer._accum.values()))
    checkpoint, real = opt.state_dict(), reference.step

    def oom(*args, **kwargs):
        raise MemoryError("simulated out of memory")

    reference.step = oom
    try:
        opt.accumulate_clipped(sums, batch_size=1)
        out["midway"] = _catch(opt.step)
    finally:
        reference.step = real
    out["reload"] = _catch(lambda: opt.load_state_dict(checkpoint))
    opt.accumulate_clipped(sums, batch_size=1)
    out["after_reload"] = _catch(opt.step)
    return out


def _run_fsdp_errors(rank, world, data):
    """Sharded-path errors: clear, raised on every rank, nothing changed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dpkern.distributed import shard_grad_samples

    model, replica = _net(), _net()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    params = list(model.parameters())
    out = {
        "count": _catch(lambda: shard_grad_samples(params, [])),
        "plain": _catch(
            lambda: shard_grad_samples(
                list(replica.parameters()), [torch.zeros(1, *p.shape) for p in replica.parameters()]
            )
        ),
        "shape": _catch(lambda: shard_grad_samples(params, [torch.zeros(1, 2)] * 4)),
    }
    mixed = DPAdamW(
        [params[0], nn.Parameter(torch.randn(3))],
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=2.0,
        seed=3,
    )
    out["mixed"] = _catch(lambda: mixed.accumulate_clipped([None, None]) or mixed.step())
    # a NaN in rank 0's per-sample gradients lands in some rank's shard; the all-reduced
    # norms carry it to every rank, so every rank refuses the step
    opt = DistributedDPOptimizer(_make_opt("macadam", params, seed=5))
    local = BATCHES[0][rank::world]
    compute_grad_sample(replica, _loss, data["x"][local], data["y"][local])
    gs = [p.grad_sample for p in replica.parameters()]
    if rank == 0:
        gs[2][0, -1, -1] = float("nan")
    before = [p.full_tensor().clone() for p in params]
    shard_grad_samples(params, gs)
    out["nan"] = _catch(opt.step)
    out["nan_untouched"] = all(torch.equal(a, p.full_tensor()) for a, p in zip(before, params))
    out["nan_state"] = any(len(opt.state[p]) for p in params)
    # one rank's per-sample gradients have a wrong shape: checked on every rank BEFORE the
    # norms' all-reduce, so no rank is left waiting in a collective
    gs[2][0, -1, -1] = 0.0
    shard_grad_samples(params, gs)
    if rank == world - 1:
        params[1].grad_sample = params[1].grad_sample[:, :0]
    out["shape_step"] = _catch(opt.step)
    out["shape_untouched"] = all(torch.equal(a, p.full_tensor()) for a, p in zip(before, params))
    opt.zero_grad()
    # a micro-batch accumulated, then a bad one raised on every rank by the wrapper's
    # check: the logical batch ended on every rank (not kept for the next one)
    shard_grad_samples(params, gs)
    opt.accumulate()
    shard_grad_samples(params, gs)
    if rank == world - 1:
        params[1].grad_sample = params[1].grad_sample[:, :0]
    out["bad_micro_batch"] = _catch(opt.accumulate)
    out["after_bad_micro_batch"] = _catch(opt.step)
    out["after_bad_untouched"] = all(
        torch.equal(a, p.full_tensor()) for a, p in zip(before, params)
    )
    opt.zero_grad()
    # torch.func cannot trace FSDP2 modules: a clear error, not an AttributeError
    out["func"] = _catch(lambda: compute_grad_sample(model, _loss, data["x"][:2], data["y"][:2]))
    # a root that owns parameters keeps them unsharded after an evaluation forward:
    # GhostClipping reshards first; add_empty_batch is refused (it would leave the other
    # ranks waiting in their forward's all-gathers)
    from dpkern.ghost import GhostClipping

    rooted = _net()
    fully_shard(rooted[0], mesh=params[0].device_mesh)
    fully_shard(rooted, mesh=params[0].device_mesh)
    ropt = DistributedDPOptimizer(_make_opt("adamw", rooted.parameters(), seed=5))
    with torch.no_grad():
        rooted(data["x"][:3])
    out["eval_then_ghost"] = _catch(lambda: GhostClipping(rooted, ropt))
    out["empty"] = _catch(lambda: GhostClipping(rooted, ropt).add_empty_batch())
    # bad input on ONE rank: it raises its own error, the others DistributedDPError (the
    # ranks agree on validity before communicating), nobody hangs
    from dpkern.distributed import reduce_scatter_clipped_sums

    last = rank == world - 1
    rows = 3 if last else 2
    bad_gs = [torch.zeros(rows if k == 1 else 2, *p.shape) for k, p in enumerate(params)]
    out["one_gs"] = _catch(lambda: shard_grad_samples(params, bad_gs))
    sums = [torch.zeros(p.shape) for p in params]
    if last:
        sums[0] = torch.zeros(1)
    out["one_rs"] = _catch(lambda: reduce_scatter_clipped_sums(params, sums))
    # ghost clipping: a non-finite sample on rank 0 only
    gopt = DistributedDPOptimizer(_make_opt("adamw", params, seed=5))
    before = [p.full_tensor().clone() for p in params]
    x = data["x"][:3].clone()
    if rank == 0:
        x[1, 0] = float("inf")
    with GhostClipping(model, gopt) as gc:
        out["one_ghost"] = _catch(
            lambda: gc.backward(
                nn.functional.cross_entropy(model(x), data["y"][:3], reduction="none")
            )
        )
    out["one_ghost_untouched"] = (
        all(torch.equal(a, p.full_tensor()) for a, p in zip(before, params)) and not gopt._accum
    )
    # a weight of the root (FSDP2 keeps it unsharded after the forward: the graph's leaf
    # is the unsharded tensor, not the optimizer's DTensor) used in the loss outside the
    # forward: its gradient there would escape the clipping; refused on every rank
    outside = _net()
    fully_shard(outside[0], mesh=params[0].device_mesh)
    fully_shard(outside, mesh=params[0].device_mesh)
    oopt = DistributedDPOptimizer(_make_opt("adamw", outside.parameters(), seed=5))
    oparams = list(outside.parameters())  # (the DTensor shards the optimizer holds)
    o_before = [p.full_tensor().clone() for p in oparams]
    with GhostClipping(outside, oopt) as gc:
        losses = nn.functional.cross_entropy(
            outside(data["x"][:2]), data["y"][:2], reduction="none"
        )
        out["outside"] = _catch(lambda: gc.backward(losses + (outside[2].weight ** 2).sum()))
    out["outside_untouched"] = (
        all(torch.equal(a, p.full_tensor()) for a, p in zip(o_before, oparams)) and not oopt._accum
    )
    # a state_dict that fits on all ranks but one: every rank keeps its old state
    gopt.accumulate_clipped([None] * len(params))  # an empty batch: a noise-only step
    gopt.step()  # gives every parameter a state
    sd = gopt.state_dict()
    if last:
        first = next(iter(sd["state"]))
        sd["state"][first] = {**sd["state"][first], "exp_avg": torch.zeros(7, 7)}
    gopt.optimizer._dp_step = 5  # (a state that differs from sd, to see it restored)
    out["one_load"] = _catch(lambda: gopt.load_state_dict(sd))
    out["one_load_step"] = gopt.dp_step
    return out


def _run_poisson(rank, world, data):
    sampler = DistributedPoissonSampler(**SAMPLER, seed=None)
    batches = list(sampler)
    # a training loop driven by the sampler: every rank steps every time
    train = DistributedPoissonSampler(**POISSON, seed=3)
    torch.manual_seed(0)
    x, y = (
        torch.randn(POISSON["num_samples"], D_IN),
        torch.randint(0, D_OUT, (POISSON["num_samples"],)),
    )
    net = _net()
    opt = DistributedDPOptimizer(
        _make_opt("adamw", net.parameters(), seed=9, expected_batch_size=train.expected_batch_size)
    )
    train_batches = []
    for local in train:
        train_batches.append(local)
        if local:
            compute_grad_sample(net, _loss, x[local], y[local])
        opt.step()
        opt.zero_grad()
    return {
        "batches": batches,
        "shard": list(sampler.shard),
        "train_batches": train_batches,
        "train_steps": opt.dp_step,
        "train_params": [p.detach().clone() for p in net.parameters()],
    }


# FSDP2 scenarios: name -> (optimizer, how the clipped sums reach the shards)
FSDP_CASES = {
    "adamw": ("adamw", "fsdp_grad"),
    "ghost": ("adamw", "ghost"),
    "ghost_bc": ("adamw_bc", "ghost"),
    "macadam": ("macadam", "per_sample"),
    "sgd": ("sgd", "per_sample"),
    "radam": ("radam", "per_sample"),
    "lion": ("lion", "fsdp_grad"),
}


def _run_fsdp(rank, world, data, name, local_indices=False):
    """FSDP2 fully_shard, the optimizer classes on DTensor shards, through
    DistributedDPOptimizer (seeded key 77). Paths (FSDP_CASES):

    fsdp_grad: FSDP reduce-scatters (SUM) the gradient of sum_i c_i loss_i, fed to
    accumulate_clipped; the clip factors c_i come from a full replica.
    ghost: GhostClipping over the wrapper: each rank's book-kept full-shape clipped sums
    are reduce-scattered to the shards (reduce_scatter_clipped_sums).
    per_sample: the replica's per-sample gradients of the local samples go through
    shard_grad_samples; the optimizer clips (MacAdam: whitens, then clips) each shard with
    norms all-reduced over the ranks (MacAdam: b from the all-reduced global sum).
    ``local_indices``: the privacy failure the global offsets prevent (every shard noised
    from its parameter's first index), as a negative control."""
    from unittest import mock

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dpkern.optim.groups
    from dpkern.distributed import shard_grad_samples, shard_offsets
    from dpkern.functional import clip_factors, per_sample_norms
    from dpkern.ghost import GhostClipping

    mesh = init_device_mesh("cpu", (world,))
    model, replica = _net(), _net()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for layer in (model, model[0], model[2]):
        layer.set_gradient_divide_factor(1.0)  # each FSDP unit reduce-scatters with SUM
        layer.set_force_sum_reduction_for_comms(True)  # (gloo has no PREMUL_SUM)
    real_local_shard = dpkern.optim.groups.local_shard
    fake = (lambda p, name="": (real_local_shard(p, name)[0], 0)) if local_indices else None
    rule, path = FSDP_CASES[name]
    opt = DistributedDPOptimizer(_make_opt(rule, model.parameters(), seed=77))
    ghost = GhostClipping(model, opt) if path == "ghost" else None
    snaps = []
    with mock.patch.object(dpkern.optim.groups, "local_shard", fake or real_local_shard):
        for batch in BATCHES:
            local = batch[rank::world]
            for r, p in zip(replica.parameters(), model.parameters()):
                r.data.copy_(p.full_tensor())
            if local:
                compute_grad_sample(replica, _loss, data["x"][local], data["y"][local])
            gs = [
                r.grad_sample if local else torch.zeros(0, *r.shape) for r in replica.parameters()
            ]
            if path == "per_sample":
                assert shard_grad_samples(opt.trainable_params(), gs) == len(batch)
            elif path == "ghost":
                # every rank runs forward and backward, empty batch or not: on B = 0
                # (ghost), or on a placeholder sample whose loss is dropped (ghost_bc: the
                # recipe for models that cannot run on an empty batch)
                rows = local or ([0] if name == "ghost_bc" else [])
                with ghost:
                    losses = nn.functional.cross_entropy(
                        model(data["x"][rows]), data["y"][rows], reduction="none"
                    )
                    ghost.backward(losses if local else losses[:0])
            else:
                c = clip_factors(per_sample_norms(gs, backend="torch"), 0.7)
                losses = nn.functional.cross_entropy(
                    model(data["x"][local]), data["y"][local], reduction="none"
                )
                (c * losses).sum().backward()  # every rank, empty batch or not
                opt.accumulate_clipped([p.grad for p in model.parameters()], len(local))
            opt.step()
            opt.zero_grad()
            replica.zero_grad()
            snaps.append([p.full_tensor().detach().clone() for p in model.parameters()])
    shards = [
        (off, local.numel(), {k: v.clone() for k, v in opt.state[p].items()})
        for p, (local, off) in zip(model.parameters(), shard_offsets(list(model.parameters())))
    ]
    # a checkpoint of the sharded state (this rank's shards) loads back
    again = DistributedDPOptimizer(_make_opt(rule, model.parameters(), seed=77))
    again.load_state_dict(opt.state_dict())
    resumed = again.dp_step == opt.dp_step and all(
        torch.equal(again.state[p][k], v)
        for p in model.parameters()
        for k, v in opt.state[p].items()
    )
    # ... and so does a FULL one (gathered states, what a single process would save)
    full = opt.state_dict(full=True)
    again = DistributedDPOptimizer(_make_opt(rule, model.parameters(), seed=77))
    again.load_state_dict(full)
    resumed = resumed and all(
        torch.equal(again.state[p][k], v)
        for p in model.parameters()
        for k, v in opt.state[p].items()
    )
    return {
        "snaps": snaps,
        "shards": shards,
        "resumed": resumed,
        "full_state": [full["state"][k] for k in sorted(full["state"])],
    }


def _worker(rank, world, tmpdir):
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group(
        "gloo",
        init_method="file://" + os.path.join(tmpdir, "rdv"),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        data = torch.load(os.path.join(tmpdir, "data.pt"))
        res = {
            "ddp_opacus": _run_ddp_opacus(rank, world, data) if world == 2 else None,
            "func_adamw": _run_func(rank, world, data, "adamw"),
            "func_macadam": _run_func(rank, world, data, "macadam"),
            "noise": _run_noise(rank, world),
            "poisson": _run_poisson(rank, world, data),
        }
        for name in FSDP_CASES:
            res[f"fsdp_{name}"] = _run_fsdp(rank, world, data, name)
        if world > 1:
            res["mismatch"] = _run_mismatch(rank, world, data)
            res["fsdp_errors"] = _run_fsdp_errors(rank, world, data)
            res["fsdp_local"] = _run_fsdp(rank, world, data, "adamw", local_indices=True)
        torch.save(res, os.path.join(tmpdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    end_worker()  # (past gloo's occasional abort at interpreter exit)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"W{w}")
def run(request, tmp_path_factory):
    world = request.param
    tmpdir = str(tmp_path_factory.mktemp(f"ddp_w{world}"))
    gen = torch.Generator().manual_seed(case_seed(500 + world))  # (DPKERN_TEST_SEED replays)
    data = {
        "x": torch.randn(N, D_IN, generator=gen),
        "y": torch.randint(0, D_OUT, (N,), generator=gen),
    }
    torch.save(data, os.path.join(tmpdir, "data.pt"))
    mp.spawn(_worker, args=(world, tmpdir), nprocs=world, join=True)
    results = [torch.load(os.path.join(tmpdir, f"rank{r}.pt")) for r in range(world)]
    return world, data, results


# ------------------------------------------------------------------------------------
# single-process references
# ------------------------------------------------------------------------------------
def _single(name, data, seed, batches, accumulate_step=None):
    net = _net()
    opt = _make_opt(name, net.parameters(), seed=seed)
    snaps = []
    for k, batch in enumerate(batches):
        if batch:
            compute_grad_sample(net, _loss, data["x"][batch], data["y"][batch])
        if k == accumulate_step:
            if batch:
                opt.accumulate()
            continue
        if not batch and not opt._accum:  # an empty batch: B = 0 grad_sample tensors
            for p in opt.trainable_params():
                p.grad_sample = torch.zeros((0, *p.shape))
        opt.step()
        opt.zero_grad()
        snaps.append(_snapshot(opt))
    return snaps


def _assert_snaps_equal(got, want):
    assert len(got) == len(want)
    for t, (g, w) in enumerate(zip(got, want)):
        for a, b in zip(g["params"], w["params"]):
            torch.testing.assert_close(
                a, b, atol=1e-6, rtol=0, msg=lambda m, t=t: f"params, step {t + 1}: {m}"
            )
        for sa, sb in zip(g["state"], w["state"]):
            assert sa.keys() == sb.keys()
            for k in sa:
                torch.testing.assert_close(
                    sa[k],
                    sb[k],
                    atol=1e-6,
                    rtol=0,
                    msg=lambda m, k=k, t=t: f"state {k}, step {t + 1}: {m}",
                )


# ------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------
def test_ddp_opacus_adamw_secure_key_equals_single_process(run):
    world, data, results = run
    if world != 2:
        pytest.skip("runs for W = 2 only (importing Opacus in every rank is slow)")
    key = results[0]["ddp_opacus"]["key"]
    assert all(r["ddp_opacus"]["key"] == key for r in results)  # broadcast from rank 0
    want = _single("adamw", data, key, BATCHES)
    for r in results:
        _assert_snaps_equal(r["ddp_opacus"]["snaps"], want)
    # the noise mattered: a different key gives a different first step
    other = _single("adamw", data, key ^ 1, BATCHES[:1])
    assert (other[0]["params"][0] - want[0]["params"][0]).abs().max() > 1e-4


@pytest.mark.parametrize("name", ["adamw", "macadam"])
def test_ddp_func_steps_with_accumulation_equal_single_process(run, name):
    world, data, results = run
    want = _single(name, data, 77, BATCHES, accumulate_step=1)
    for r in results:
        _assert_snaps_equal(r[f"func_{name}"]["snaps"], want)


def test_noise_std_of_averaged_gradient_is_sigma_C_over_Be(run):
    world, _, results = run
    update = results[0]["noise"]["update"]
    for r in results[1:]:
        assert torch.equal(r["noise"]["update"], update)  # identical noise, no communication
    z = gaussian_noise(NOISE_NUMEL, key=5, step=1, backend="torch")
    torch.testing.assert_close(update, NOISE_SIGMA * NOISE_C / NOISE_BE * z, atol=1e-7, rtol=0)
    target = NOISE_SIGMA * NOISE_C / NOISE_BE
    assert abs(float(update.std()) / target - 1) < 0.03  # not sqrt(W) or W times it


def test_mismatches_are_detected_on_every_rank(run):
    world, _, results = run
    if world == 1:
        pytest.skip("needs two ranks")
    for rank, r in enumerate(results):
        m = r["mismatch"]
        assert m["seed"][0] == "DistributedDPError" and "noise keys differ" in m["seed"][1]
        assert f"ranks {list(range(world - 1))} vs ranks [{world - 1}]" in m["seed"][1]
        assert "11" not in m["seed"][1] and "12" not in m["seed"][1]  # no key material
        assert m["mixed"][0] == "DistributedDPError" and "secure mode" in m["mixed"][1]
        assert "configuration" not in m["mixed"][1]
        assert m["config"][0] == "DistributedDPError"
        assert "configuration differ" in m["config"][1] and "noise_multiplier" in m["config"][1]
        assert m["key"][0] == "DistributedDPError" and "noise keys differ" in m["key"][1]
        assert m["key_untouched"] and m["key_resync"] is None
        assert m["step"][0] == "DistributedDPError" and "step counters differ" in m["step"][1]
        assert f"{[0] * (world - 1) + [3]}" in m["step"][1]
        want_nan = "FloatingPointError" if rank == 0 else "DistributedDPError"
        assert m["nan"][0] == want_nan, m["nan"]
        assert m["nan_untouched"] and m["nan_step"] == 0 and m["nan_retry"] is None
        for a, b in zip(m["nan_after"], results[0]["mismatch"]["nan_after"]):
            assert torch.equal(a, b)
        assert m["inner"] == ("ValueError", "simulated failure of the inner step")
        assert m["inner_left"] == 0.0  # dropped, not kept for a second all-reduce
        assert m["midway"] == ("MemoryError", "simulated out of memory")
        assert m["reload"] is None and m["after_reload"] is None
        for case, why in (("micro_batch", "cannot be released"), ("closure", "closure failed")):
            want = (
                ("ValueError" if case == "micro_batch" else "RuntimeError")
                if rank == 0
                else ("DistributedDPError")
            )
            assert m[case][0] == want, m[case]
            assert (why if rank == 0 else "failed their local step") in m[case][1]
            assert m[f"{case}_untouched"] and m[f"{case}_step"] == 0 and m[f"{case}_left"] == 0


def test_fsdp2_errors_are_clear_and_raised_on_every_rank(run):
    world, _, results = run
    if world == 1:
        pytest.skip("needs two ranks")
    for r in results:
        e = r["fsdp_errors"]
        assert e["count"][0] == "ValueError" and "0 grad_samples for 4" in e["count"][1]
        assert e["plain"][0] == "ValueError" and "DTensor" in e["plain"][1]
        assert e["shape"][0] == "ValueError" and "grad_samples[0]" in e["shape"][1]
        assert e["mixed"][0] == "ValueError" and "must be a DTensor" in e["mixed"][1]
        assert e["nan"][0] == "FloatingPointError" and "rows [0]" in e["nan"][1]
        assert e["nan_untouched"] and not e["nan_state"]
        assert e["shape_untouched"]
        assert e["bad_micro_batch"][0] in ("ValueError", "DistributedDPError")
        assert e["after_bad_micro_batch"][0] == "ValueError", e["after_bad_micro_batch"]
        assert "cannot be released" in e["after_bad_micro_batch"][1]
        assert e["after_bad_untouched"]
        assert e["func"][0] == "ValueError" and "shard_grad_samples" in e["func"][1]
        assert e["eval_then_ghost"] is None
        assert e["outside"][0] == "ValueError" and "2.weight" in e["outside"][1]
        assert "outside the recorded forward" in e["outside"][1] and e["outside_untouched"]
        assert e["empty"][0] == "RuntimeError" and "losses[:0]" in e["empty"][1]
        assert e["one_ghost_untouched"] and e["one_load_step"] == 5
    others = ["DistributedDPError"] * (world - 1)
    assert [r["fsdp_errors"]["one_gs"][0] for r in results] == others + ["ValueError"]
    assert [r["fsdp_errors"]["one_rs"][0] for r in results] == others + ["ValueError"]
    assert [r["fsdp_errors"]["one_load"][0] for r in results] == others + ["ValueError"]
    assert [r["fsdp_errors"]["one_ghost"][0] for r in results] == ["FloatingPointError"] + others
    assert "ranks [0] failed" in results[-1]["fsdp_errors"]["one_ghost"][1]
    assert [r["fsdp_errors"]["shape_step"][0] for r in results] == ["DistributedDPError"] * (
        world - 1
    ) + ["ValueError"]
    assert "grad_sample has shape" in results[-1]["fsdp_errors"]["shape_step"][1]


def test_distributed_poisson_sampling(run):
    world, _, results = run
    n, q, steps = SAMPLER["num_samples"], SAMPLER["sample_rate"], SAMPLER["steps"]
    shards = [set(r["poisson"]["shard"]) for r in results]
    assert set().union(*shards) == set(range(n)) and sum(map(len, shards)) == n
    for r, shard in zip(results, shards):
        assert len(r["poisson"]["batches"]) == steps  # every rank yields every step
        assert all(set(b) <= shard for b in r["poisson"]["batches"])
    sizes = torch.tensor(
        [sum(len(r["poisson"]["batches"][t]) for r in results) for t in range(steps)],
        dtype=torch.float64,
    )
    # mean global batch q N = 10; std of the mean sqrt(qN(1-q)/steps) ~ 0.18
    assert abs(float(sizes.mean()) - q * n) < 5 * math.sqrt(q * (1 - q) * n / steps)
    assert float(sizes.var()) == pytest.approx(q * (1 - q) * n, rel=0.35)
    if world > 1:  # ranks draw independently (secure mode: own os.urandom seeds)
        assert results[0]["poisson"]["batches"] != [
            [i - 1 for i in b] for b in results[1]["poisson"]["batches"]
        ]


def test_poisson_training_loop_equals_single_process_on_union(run):
    world, _, results = run
    steps = POISSON["steps"]
    assert all(r["poisson"]["train_steps"] == steps for r in results)
    local_sizes = [[len(b) for b in r["poisson"]["train_batches"]] for r in results]
    if world > 1:  # the scenario did exercise empty local batches next to non-empty ones
        assert any(
            0 in [s[t] for s in local_sizes] and any(s[t] for s in local_sizes)
            for t in range(steps)
        )
    torch.manual_seed(0)
    x, y = (
        torch.randn(POISSON["num_samples"], D_IN),
        torch.randint(0, D_OUT, (POISSON["num_samples"],)),
    )
    net = _net()
    be = POISSON["sample_rate"] * POISSON["num_samples"]
    opt = _make_opt("adamw", net.parameters(), seed=9, expected_batch_size=be)
    for t in range(steps):
        union = sorted(i for r in results for i in r["poisson"]["train_batches"][t])
        if union:
            compute_grad_sample(net, _loss, x[union], y[union])
        else:
            for p in net.parameters():
                p.grad_sample = torch.zeros((0, *p.shape))
        opt.step()
        opt.zero_grad()
    for r in results:
        for a, b in zip(r["poisson"]["train_params"], net.parameters()):
            torch.testing.assert_close(a, b.detach(), atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------
# single-process unit tests
# ------------------------------------------------------------------------------------
def _param_atol(state: dict, t: int, drifted: bool = False):
    """Per element: 1e-6, except where an Adam-type step divides by sqrt(v_hat) + eps with
    sqrt(v_hat) < 100 eps. There m_hat / (sqrt(v_hat) + eps) amplifies the float32 rounding
    of a cancelling sum by up to 1 / eps (seen once in ~50 runs: MacAdam, step 1, a g~ of
    3.5 eps, 1.9e-5 off); those elements get 0.1 lr (a step is at most lr), and after such
    a step (``drifted``) every element gets 1e-4: the next gradients, and MacAdam's global
    scale, carry that difference (1.5e-6 seen). Any sharding error (a shard noised twice,
    a wrong offset) moves elements by O(lr) = 0.05."""
    base = 1e-4 if drifted else 1e-6
    if "exp_avg_sq" not in state:
        return torch.tensor(base)
    ill = (state["exp_avg_sq"] / (1 - ADAM_BETA2**t)).sqrt() < 100 * ADAM_EPS
    return torch.where(ill, 0.1 * ADAM_LR, base)


@pytest.mark.parametrize("name", list(FSDP_CASES))
def test_fsdp2_sharded_steps_equal_single_process(run, name):
    world, data, results = run
    # samples in rank order, as shard_grad_samples stacks them (same float summation order)
    rank_order = [[i for r in range(world) for i in b[r::world]] for b in BATCHES]
    want = _single(FSDP_CASES[name][0], data, 77, rank_order)
    for r in results:
        assert r[f"fsdp_{name}"]["resumed"]
        for got, w in zip(r[f"fsdp_{name}"]["full_state"], want[-1]["state"]):
            assert got.keys() == w.keys()
            for k in w:  # state_dict(full=True): the single-process states, full shape
                torch.testing.assert_close(got[k], w[k], atol=1e-6, rtol=1e-6, msg=k)
        drifted = False  # an ill-conditioned element earlier: the trajectory drifts
        for t, (got, w) in enumerate(zip(r[f"fsdp_{name}"]["snaps"], want)):
            tols = [_param_atol(st, t + 1, drifted) for st in w["state"]]
            for a, b, tol in zip(got, w["params"], tols):
                bad = ((a - b).abs() > tol).nonzero().tolist()
                assert not bad, (t + 1, bad[:5], (a - b).abs().max().item())
            drifted = drifted or any(bool((tol > 1e-6).any()) for tol in tols)
    # the shards tile the global index space exactly (no index twice, none skipped) ...
    numel = sum(p.numel() for p in want[-1]["params"])
    ranges = sorted((off, n) for r in results for off, n, _ in r[f"fsdp_{name}"]["shards"] if n)
    assert [o for o, _ in ranges] == [0] + [o + n for o, n in ranges[:-1]]
    assert ranges[-1][0] + ranges[-1][1] == numel
    # ... and the shards' optimizer states are the single-process states at those indices
    names = want[-1]["state"][0].keys()
    flat = {k: torch.cat([s[k].flatten() for s in want[-1]["state"]]) for k in names}
    for r in results:
        for off, n, st in r[f"fsdp_{name}"]["shards"]:
            assert st.keys() == names
            for k, v in st.items():
                if v.dim() == 0:  # a per-group scalar (DP-AdamW-BC's phi): the same value
                    torch.testing.assert_close(v, want[-1]["state"][0][k], atol=0, rtol=1e-6)
                    continue
                torch.testing.assert_close(
                    v.flatten(), flat[k][off : off + n], atol=1e-6, rtol=0, msg=k
                )


def test_fsdp2_local_indices_would_differ(run):
    """Negative control: shards noised at LOCAL indices reuse noise across ranks."""
    world, data, results = run
    if world == 1:
        pytest.skip("needs two ranks")
    want = _single("adamw", data, 77, BATCHES[:1])
    diff = max(
        float((a - b).abs().max())
        for a, b in zip(results[0]["fsdp_local"]["snaps"][0], want[0]["params"])
    )
    assert diff > 1e-4


def test_sampler_validation_and_small_datasets():
    with pytest.raises(ValueError, match="rank"):
        DistributedPoissonSampler(10, 0.1, 3, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="num_replicas"):
        DistributedPoissonSampler(10, 0.1, 3, num_replicas=0, rank=0)
    with pytest.raises(ValueError, match="sample_rate"):
        DistributedPoissonSampler(10, 1.5, 3, num_replicas=2, rank=0)
    s = DistributedPoissonSampler(2, 1.0, 4, num_replicas=3, rank=2)  # empty shard
    assert list(s) == [[]] * 4 and len(s) == 4
    s = DistributedPoissonSampler(7, 1.0, 2, num_replicas=3, rank=1, seed=0)
    assert list(s) == [[1, 4]] * 2 and s.expected_batch_size == 7.0
    a = list(DistributedPoissonSampler(50, 0.3, 5, num_replicas=2, rank=0, seed=4))
    b = list(DistributedPoissonSampler(50, 0.3, 5, num_replicas=2, rank=0, seed=4))
    assert a == b  # reproducible with a seed


def test_key_fingerprint_is_keyed_and_stable():
    k = int.from_bytes(os.urandom(8), "little")
    assert key_fingerprint(k) == key_fingerprint(k)
    assert key_fingerprint(k) != key_fingerprint(k ^ 1)
    assert -(2**63) <= key_fingerprint(k) < 2**63 and key_fingerprint(k) not in (k, k - 2**64)


def test_wrapper_rejects_non_dp_optimizers():
    with pytest.raises(TypeError, match="DPOptimizer"):
        DistributedDPOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1))
    assert callable(sync_key)
