"""Data-parallel DP training with dpkern on torch.distributed (DDP), complete and runnable.

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py

Every rank Poisson-samples its shard of a synthetic data set at the global rate q, computes
per-sample gradients of its local samples (torch.func), and DistributedDPOptimizer
all-reduces the clipped sums once per step and adds the same noise on every rank, so the
step is the one a single process would take on the union of the ranks' batches. Runs on
CPU (gloo) or one GPU per rank (NCCL). ``tests/test_examples.py`` runs it on 2 gloo ranks.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import dpkern
from dpkern.accounting import PrivacyAccountant
from dpkern.distributed import (
    DistributedDPOptimizer,
    DistributedPoissonSampler,
    disable_gradient_allreduce,
)
from dpkern.grad_sample import compute_grad_sample

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank = dist.get_rank()
device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")
gen = torch.Generator().manual_seed(0)  # the same data set on every rank
X = torch.randn(2000, 20, generator=gen)
Y = (X[:, 0] + X[:, 1] > 0).long()
model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)).to(
    device
)
ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters
disable_gradient_allreduce(ddp)
sample_rate, steps, sigma = 0.05, 60, 1.0
sampler = DistributedPoissonSampler(len(X), sample_rate, steps)
opt = DistributedDPOptimizer(
    dpkern.DPAdamW(
        model.parameters(),
        lr=1e-2,
        max_grad_norm=1.0,
        noise_multiplier=sigma,
        expected_batch_size=sampler.expected_batch_size,
    )
)  # the GLOBAL q * N
accountant = PrivacyAccountant()
for indices in sampler:  # this rank's samples; may be empty
    if indices:  # per-sample gradients, local samples
        compute_grad_sample(model, F.cross_entropy, X[indices].to(device), Y[indices].to(device))
    opt.step()  # every rank, every step
    opt.zero_grad()
    accountant.step(noise_multiplier=sigma, sample_rate=sample_rate)
with torch.no_grad():
    accuracy = (model(X.to(device)).argmax(1) == Y.to(device)).float().mean()
if rank == 0:
    print(f"epsilon = {accountant.get_epsilon(1e-5):.2f}, accuracy = {accuracy:.2f}")
dist.destroy_process_group()
