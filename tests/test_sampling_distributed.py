"""World-size invariance: with the same sampling seed (or rank 0's broadcast secret key),
W = 1, 2, 3 gloo ranks take exactly the single-process batches, and DP-SGD takes the
single-process steps (up to the float summation order)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dpkern import DPSGD
from dpkern.distributed import DistributedDPOptimizer, DistributedPoissonSampler
from dpkern.distributed.processes import end_worker
from dpkern.grad_sample import compute_grad_sample
from dpkern.sampling import PoissonBatchSampler, SamplingKey, group_grad_samples
from dpkern.sampling.stream import _reveal

N, D_IN, D_OUT, STEPS, Q = 60, 5, 3, 8, 0.2
USERS = torch.arange(N) % 7  # 7 users, scattered over the dataset
SCENARIOS = {
    "blocks": {},
    "users": {"units": USERS},
    "fixed": {"max_batch_size": 21},
}


def _net():
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(D_IN, 6), nn.Tanh(), nn.Linear(6, D_OUT))


def _loss(out, y):
    return nn.functional.cross_entropy(out, y)


def _train(sampler, data, wrap=lambda opt: opt):
    """DP-SGD (momentum, fixed noise key) driven by ``sampler``; per-unit clipping."""
    net = _net()
    params = list(net.parameters())
    opt = wrap(
        DPSGD(
            params,
            lr=0.3,
            momentum=0.9,
            max_grad_norm=0.5,
            noise_multiplier=0.7,
            expected_batch_size=sampler.expected_batch_size,
            seed=77,
            backend="torch",
        )
    )
    snaps, batches = [], []
    for batch in sampler.batches():
        batches.append(batch.indices[batch.mask].tolist())
        if batch.num_rows:
            idx = batch.indices  # fixed shape: all rows, padding included (static)
            compute_grad_sample(net, _loss, data["x"][idx], data["y"][idx])
            grouped = group_grad_samples([p.grad_sample for p in params], batch.unit_ids)
            for p, g in zip(params, grouped):
                p.grad_sample = g
        else:
            for p in params:
                p.grad_sample = torch.zeros((0, *p.shape))
        opt.step()
        snaps.append([p.detach().clone() for p in params])
    return batches, snaps


def _worker(rank, world, tmpdir):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(tmpdir, 'rendezvous')}",
        rank=rank,
        world_size=world,
    )
    torch.set_num_threads(1)
    try:
        data = torch.load(os.path.join(tmpdir, "data.pt"))
        out = {}
        for name, kw in SCENARIOS.items():
            sampler = DistributedPoissonSampler(N, Q, STEPS, seed=5, **kw)
            out[name] = _train(sampler, data, DistributedDPOptimizer)
        secure = DistributedPoissonSampler(N, Q, STEPS)  # rank 0's key, broadcast
        out["secure"] = ([b for b in secure], _reveal(secure.key))  # key: test only
        resumed = DistributedPoissonSampler(N, Q, 3, seed=5, start_step=6)
        out["resumed"] = list(resumed)
        torch.save(out, os.path.join(tmpdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    end_worker()  # (past gloo's occasional abort at interpreter exit)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"W{w}")
def run(request, tmp_path_factory):
    world = request.param
    tmpdir = str(tmp_path_factory.mktemp(f"sampling_w{world}"))
    gen = torch.Generator().manual_seed(3)
    data = {"x": 3 * torch.randn(N, D_IN, generator=gen), "y": torch.randint(0, D_OUT, (N,))}
    torch.save(data, os.path.join(tmpdir, "data.pt"))
    mp.spawn(_worker, args=(world, tmpdir), nprocs=world, join=True)
    return world, data, [torch.load(os.path.join(tmpdir, f"rank{r}.pt")) for r in range(world)]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_ranks_take_the_single_process_batches_and_steps(run, name):
    world, data, results = run
    sampler = PoissonBatchSampler(N, Q, STEPS, seed=5, **SCENARIOS[name])
    batches, snaps = _train(sampler, data)
    for t in range(STEPS):
        union = sorted(i for r in results for i in r[name][0][t])
        assert union == sorted(batches[t]), (name, t)
        for r in results:  # every rank ends every step with the single-process parameters
            for got, want in zip(r[name][1][t], snaps[t]):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if name == "users":  # a user's rows are all on one rank
        for r, res in enumerate(results):
            assert all(int(USERS[i]) % world == r for b in res[name][0] for i in b)


def test_secure_key_is_broadcast_and_resume_continues(run):
    world, _, results = run
    keys = {r["secure"][1] for r in results}
    assert len(keys) == 1  # every rank got rank 0's key
    single = list(PoissonBatchSampler(N, Q, STEPS, key=SamplingKey(keys.pop())))
    for t in range(STEPS):
        assert sorted(i for r in results for i in r["secure"][0][t]) == single[t]
    whole = list(PoissonBatchSampler(N, Q, 8, seed=5))
    for t in range(3):
        assert sorted(i for r in results for i in r["resumed"][t]) == whole[5 + t]
