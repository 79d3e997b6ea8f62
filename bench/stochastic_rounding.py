"""How much training loss stochastic rounding of bf16 weights recovers (SPEC 3.2).

    python -m bench.stochastic_rounding                     # ~2 minutes on 2 CPU cores
    python -m bench.stochastic_rounding --steps 400 --sigma 2 --seeds 5

A small MLP (64 -> 128 -> 10, GELU) on scikit-learn's digits (1,797 images of 8x8
pixels, standardised), trained with DP-AdamW (sigma = 1, C = 1, batches of 256 drawn
uniformly with replacement, lr 2e-4, no weight decay) in three settings that see the same
batches and the same noise key:

- ``fp32``: float32 weights (the target);
- ``bf16 nearest``: bfloat16 weights, each update rounded to nearest even (today's store);
- ``bf16 stochastic``: bfloat16 weights, ``stochastic_rounding=True``.

Per-sample gradients, clipped sums, noise and optimizer states are float32 in every
setting (the forward and backward run in float32 from the stored weights' values): only
the storage of the weights differs. The score is the final training loss (cross-entropy
on all 1,797 images), averaged over seeds; "recovered" is the fraction of the gap between
bf16-nearest and fp32 that stochastic rounding closes,
(L_nearest - L_stochastic) / (L_nearest - L_fp32). Prints a markdown table (README,
"bf16 weights: stochastic rounding").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import dpkern

SETTINGS = (
    ("fp32", torch.float32, False),
    ("bf16 nearest", torch.bfloat16, False),
    ("bf16 stochastic", torch.bfloat16, True),
)


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    return x, torch.tensor(y)


def make_model(seed: int, hidden: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, 10))


def full_loss(model: nn.Module, x, y) -> float:
    with torch.no_grad():
        params = {n: p.float() for n, p in model.named_parameters()}
        return float(nn.functional.cross_entropy(functional_call(model, params, (x,)), y))


def train(setting, seed: int, args, x, y) -> float:
    _, dtype, sr = setting
    model = make_model(seed, args.hidden).to(dtype)
    opt = dpkern.DPAdamW(
        model.parameters(),
        lr=args.lr,
        weight_decay=0.0,
        max_grad_norm=args.clip,
        noise_multiplier=args.sigma,
        expected_batch_size=float(args.batch),
        seed=seed,  # the same noise in the three settings (a benchmark: not private)
        stochastic_rounding=sr,
    )
    names = [n for n, _ in model.named_parameters()]

    def loss_one(params, xi, yi):
        out = functional_call(model, params, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0))

    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))
    g = torch.Generator().manual_seed(seed)
    for _ in range(args.steps):
        idx = torch.randint(0, x.shape[0], (args.batch,), generator=g)
        params = {n: p.detach().float() for n, p in model.named_parameters()}
        gs = per_sample(params, x[idx], y[idx])
        for n, p in zip(names, model.parameters(), strict=True):
            p.grad_sample = gs[n]
        opt.step()
    return full_loss(model, x, y)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.stochastic_rounding", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    x, y = digits()
    start = time.perf_counter()
    init = statistics.mean(
        full_loss(make_model(s, args.hidden).to(torch.bfloat16), x, y) for s in range(args.seeds)
    )
    losses = {
        name: [train((name, dt, sr), s, args, x, y) for s in range(args.seeds)]
        for name, dt, sr in SETTINGS
    }
    mean = {k: statistics.mean(v) for k, v in losses.items()}
    gap = mean["bf16 nearest"] - mean["fp32"]
    recovered = (mean["bf16 nearest"] - mean["bf16 stochastic"]) / gap if gap > 0 else float("nan")
    print(
        f"DP-AdamW, lr {args.lr:g}, sigma {args.sigma:g}, C {args.clip:g}, batch "
        f"{args.batch}, {args.steps} steps, MLP 64-{args.hidden}-10 on digits, "
        f"{args.seeds} seeds ({time.perf_counter() - start:.0f} s); initial loss {init:.4f}\n"
    )
    print("| weights | final training loss (mean over seeds) | per seed |")
    print("| --- | --- | --- |")
    for name, _, _ in SETTINGS:
        per = ", ".join(f"{v:.4f}" for v in losses[name])
        print(f"| {name} | {mean[name]:.4f} | {per} |")
    print(f"\nstochastic rounding recovers {100 * recovered:.0f}% of the fp32 - bf16 gap")


if __name__ == "__main__":
    main()
