"""Distributed smoke check on CUDA (NCCL): dpkern.distributed's code path on GPUs.

    python bench/gpu_dist_check.py                 # NCCL, one process per visible GPU
    python bench/gpu_dist_check.py --device cpu    # the same on gloo (tests run this)

For W = number of GPUs (at least 1), three steps of a tiny GPT-2 (transformers, built
from a config, no dropout) are taken four ways and compared with the same steps in one
process on the first device:

- DDP + per-sample gradients (torch.func) + DP-SGD with momentum;
- FSDP2 + ghost clipping (reduce-scattered book-kept sums) + DP-SGD with momentum;
- FSDP2 + per-sample gradients of an unsharded replica through ``shard_grad_samples``
  + DP-MacAdam (per-sample norms and the global scale sum all-reduced);
- and the noise alone (sigma > 0, no sample), which must be sigma C / B_e times the
  noise stream on every rank.

Prints one line per way with the largest parameter difference from the single process
(float32; a few 1e-6 is rounding, a wrong noise index or a missing reduction is >= 1e-3)
and exits 1 if any is above ``--atol``. The collectives run on the parameters' device,
so on CUDA this exercises NCCL's all-reduce, reduce-scatter, all-to-all, all-gather and
broadcast.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS, B, T, VOCAB = 3, 6, 12, 97


def _model(device):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=T,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg).to(device)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n, T), generator=g) for n in (B, B - 1, 0)][:STEPS]


def _opt(name, params):
    import dpkern

    if name == "macadam":
        return dpkern.DPMacAdam(
            params, lr=1e-2, noise_multiplier=0.7, expected_batch_size=B, seed=11, backend="auto"
        )
    # DP-SGD, not AdamW: the ways differ from one process by float rounding (other GEMM
    # buffers, summation orders), which Adam's normalised first step can turn into
    # lr-sized flips where the noisy gradient is ~0; SGD keeps them at rounding size
    return dpkern.DPSGD(
        params,
        lr=0.5,
        momentum=0.9,
        max_grad_norm=0.5,
        noise_multiplier=0.7,
        expected_batch_size=B,
        seed=11,
        backend="auto",
    )


def _single(device, way):
    """The reference: one process, per-sample gradients of the whole batch."""
    from dpkern import models
    from dpkern.grad_sample import compute_grad_sample

    model = _model(device)
    net = models.CausalLMLogits(model)
    opt = _opt("macadam" if way == "fsdp_macadam" else "sgd", list(model.parameters()))
    for ids in _batches():
        ids = ids.to(device)
        compute_grad_sample(net, models.sample_loss, ids, ids)
        opt.step()
        opt.zero_grad()
    return [p.detach().float().cpu() for p in model.parameters()]


def _worker(rank, world, tmp, device_type, way):
    warnings.simplefilter("ignore")
    device = torch.device(f"cuda:{rank}" if device_type == "cuda" else "cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo",
        init_method="file://" + os.path.join(tmp, "rdv"),
        rank=rank,
        world_size=world,
    )
    try:
        from dpkern import models
        from dpkern.distributed import (
            DistributedDPOptimizer,
            disable_gradient_allreduce,
            shard_grad_samples,
        )
        from dpkern.grad_sample import compute_grad_sample

        if way != "noise":
            model = _model(device)
            net = models.CausalLMLogits(model)
        if way == "noise":
            import dpkern

            p = torch.nn.Parameter(torch.zeros(100_003, device=device))
            opt = DistributedDPOptimizer(
                dpkern.DPSGD(
                    [p],
                    lr=1.0,
                    max_grad_norm=0.5,
                    noise_multiplier=2.0,
                    expected_batch_size=4.0,
                    seed=5,
                )
            )
            opt.step()
            out = [-p.detach().cpu()]
        elif way == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel(
                model, device_ids=[rank] if device.type == "cuda" else None
            )
            disable_gradient_allreduce(ddp)
            opt = DistributedDPOptimizer(_opt("sgd", list(model.parameters())))
            for ids in _batches():
                local = ids[rank::world].to(device)
                if local.shape[0]:
                    compute_grad_sample(net, models.sample_loss, local, local)
                opt.step()
                opt.zero_grad()
            out = [p.detach().float().cpu() for p in model.parameters()]
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            replica = _model(device)
            mesh = init_device_mesh(device.type, (world,))
            for block in model.transformer.h:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            params = list(model.parameters())
            opt = DistributedDPOptimizer(
                _opt("macadam" if way == "fsdp_macadam" else "sgd", params)
            )
            if way == "fsdp_ghost":
                from dpkern.ghost import GhostClipping

                gc = GhostClipping(net, opt).attach()
            for ids in _batches():
                local = ids[rank::world].to(device)
                if way == "fsdp_ghost":
                    placeholder = _batches()[0][:1].to(device)  # any one sample
                    rows = local if local.shape[0] else placeholder
                    losses = models.token_loss(net(rows), rows)
                    gc.backward(losses if local.shape[0] else losses[:0])
                else:
                    with torch.no_grad():
                        for r, p in zip(replica.parameters(), params):
                            r.copy_(p.full_tensor())
                    rnet = models.CausalLMLogits(replica)
                    if local.shape[0]:
                        compute_grad_sample(rnet, models.sample_loss, local, local)
                    gs = [
                        r.grad_sample
                        if local.shape[0]
                        else torch.zeros((0, *r.shape), device=device)
                        for r in replica.parameters()
                    ]
                    shard_grad_samples(params, gs)
                    replica.zero_grad(set_to_none=True)
                    for r in replica.parameters():
                        r.grad_sample = None
                opt.step()
                opt.zero_grad()
            model.reshard()
            out = [p.full_tensor().detach().float().cpu() for p in params]
        if rank == 0:
            torch.save(out, os.path.join(tmp, "out.pt"))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python bench/gpu_dist_check.py", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--world", type=int, help="processes (default: GPUs, or 2 on cpu)")
    ap.add_argument("--atol", type=float, default=1e-4)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")  # torch.func's SDPA batching-rule notes
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_dist_check: no CUDA device; nothing to check")
        return 0
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    status = 0
    for way in ("noise", "ddp", "fsdp_ghost", "fsdp_macadam"):
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(world, tmp, args.device, way), nprocs=world, join=True)
            got = torch.load(os.path.join(tmp, "out.pt"))
        if way == "noise":
            from dpkern.functional import gaussian_noise

            want = [2.0 * 0.5 / 4.0 * gaussian_noise(100_003, key=5, step=1, device=device).cpu()]
        else:
            want = _single(device, way)
        diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
        ok = diff <= args.atol
        status |= not ok
        backend = "nccl" if args.device == "cuda" else "gloo"
        print(
            f"gpu_dist_check: {way:13s} W={world} {backend}: max |diff| vs one process "
            f"{diff:.2e} {'ok' if ok else 'FAILED'}"
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
