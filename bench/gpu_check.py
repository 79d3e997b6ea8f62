"""Timings of the Triton backend on a CUDA machine (run by bench/gpu_check.sh).

For the parameter set of GPT-2 small (124.4M coordinates in 148 tensors, Hugging Face
``GPT2LMHeadModel`` with tied embeddings) and B in {1, 8, 32}:

- per-sample path (DP-AdamW, fp32 parameters, grad_samples of --gs-dtype):
  * ``fused``: dpkern triton pass 1 (norms) + clip factors + pass 2 (fused step);
  * ``reference``: the same through the PyTorch reference backend;
  * ``opacus-style``: per-parameter norms, einsum clip, torch.normal noise, scale,
    ``torch.optim.AdamW(fused=True)``;
  floor: 2 B d sizeof(grad) + 6 d 4 bytes (grad_samples read twice; p, m, v read+written).
- summed path (grad_samples already clipped and summed: ghost clipping):
  * ``fused``: the triton step fed with S; ``torch``: torch.normal + add + scale +
    AdamW(fused=True); floor: 28 bytes per fp32 coordinate (S, p, m, v read; p, m, v written).
- sigma = 0 vs sigma > 0 for both fused paths: if sigma > 0 is clearly slower, drawing
  Philox noise makes the step compute-bound.

Achieved GB/s = floor bytes / time, compared with the measured device copy bandwidth.
``--smoke`` runs every code path on tiny sizes (CPU under TRITON_INTERPRET=1 is fine):
that is how the script is tested without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

try:  # python bench/gpu_check.py (bench/ on sys.path), or bench.gpu_check
    from harness import bytes_floor, copy_bandwidth, median_seconds
except ImportError:
    from .harness import bytes_floor, copy_bandwidth, median_seconds

GPT2_SMALL = dict(vocab=50257, ctx=1024, d=768, layers=12)


def gpt2_shapes(vocab: int, ctx: int, d: int, layers: int) -> list[tuple[int, ...]]:
    """Trainable parameter shapes of GPT-2 (HF GPT2LMHeadModel; lm_head tied to wte)."""
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [
            (d,),
            (d,),
            (d, 3 * d),
            (3 * d,),
            (d, d),
            (d,),  # ln_1, attn
            (d,),
            (d,),
            (d, 4 * d),
            (4 * d,),
            (4 * d, d),
            (d,),
        ]  # ln_2, mlp
    return shapes + [(d,), (d,)]  # ln_f


class Model:
    """Parameters, AdamW states and noise offsets of one parameter set."""

    def __init__(self, shapes, device):
        g = torch.Generator(device="cpu").manual_seed(0)
        self.params = [(0.02 * torch.randn(s, generator=g)).to(device) for s in shapes]
        self.d = sum(p.numel() for p in self.params)
        self.states = {
            "exp_avg": [torch.zeros_like(p) for p in self.params],
            "exp_avg_sq": [torch.zeros_like(p) for p in self.params],
        }
        self.offsets, off = [], 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()


def run(args) -> int:
    from dpkern.backends import reference as ref
    from dpkern.backends import resolve
    from dpkern.hyper import AdamWHyper, DPStep

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here; nothing to time (use --smoke to test the "
            "script on CPU under TRITON_INTERPRET=1)"
        )
        return 0
    tr = resolve("triton", device)

    def timer(fn, reps=None):
        return median_seconds(fn, device, reps or args.reps, warmup=args.warmup)

    shapes = gpt2_shapes(**(dict(vocab=97, ctx=16, d=32, layers=2) if args.smoke else GPT2_SMALL))
    model = Model(shapes, device)
    d = model.d
    gs_dtype = getattr(torch, args.gs_dtype)
    gs_bytes = torch.tensor([], dtype=gs_dtype).element_size()
    hyper = AdamWHyper(lr=1e-4, weight_decay=0.01)
    C, sigma, Be = 1.0, 1.0, 1024.0
    t_step = [0]

    def dp(noise_std):
        t_step[0] += 1
        return DPStep(key=1234, step=t_step[0], noise_std=noise_std, expected_batch_size=Be)

    bw = copy_bandwidth(device, nbytes=args.copy_mib << 20, repeats=args.reps)["bytes_per_s"] / 1e9
    rows = []

    def report(path, B, impl, seconds, floor, base=None):
        gbs = floor / seconds / 1e9
        rows.append(
            (path, B, impl, seconds * 1e3, gbs, 100 * gbs / bw, (base / seconds) if base else None)
        )
        return seconds

    def clip_factors(norms):
        return torch.clamp(C / (norms + 1e-6), max=1.0)

    def fused_per_sample(gs, noise_std):
        B = gs[0].shape[0]
        c = clip_factors(tr.per_sample_norms(gs, B, device))
        tr.step(
            hyper, dp(noise_std), model.params, gs, c, [None] * len(gs), model.states, model.offsets
        )

    def reference_per_sample(gs):
        B = gs[0].shape[0]
        c = clip_factors(ref.per_sample_norms(gs, B, device))
        ref.step(
            hyper, dp(sigma * C), model.params, gs, c, [None] * len(gs), model.states, model.offsets
        )

    torch_params = [p.clone().requires_grad_(True) for p in model.params]
    adamw = torch.optim.AdamW(
        torch_params, lr=1e-4, weight_decay=0.01, fused=device.type in ("cuda", "cpu")
    )

    def opacus_per_sample(gs):
        B = gs[0].shape[0]
        per_param = torch.stack([g.reshape(B, -1).norm(2, dim=1) for g in gs], dim=1)
        c = clip_factors(per_param.norm(2, dim=1))
        for p, g in zip(torch_params, gs):
            s = torch.einsum("i,i...", c.to(g.dtype), g).float()
            noise = torch.normal(0.0, sigma * C, p.shape, device=device)
            p.grad = (s + noise) / Be
        adamw.step()

    for B in args.batches:
        gs = [torch.randn((B, *p.shape), device=device, dtype=gs_dtype) for p in model.params]
        floor = bytes_floor("per_sample", d, B, grad_bytes=gs_bytes)
        base = report("per-sample", B, "opacus-style", timer(lambda: opacus_per_sample(gs)), floor)
        report(
            "per-sample", B, "fused", timer(lambda: fused_per_sample(gs, sigma * C)), floor, base
        )
        report(
            "per-sample", B, "fused sigma=0", timer(lambda: fused_per_sample(gs, 0.0)), floor, base
        )
        if not args.skip_reference:
            report(
                "per-sample",
                B,
                "reference",
                timer(lambda: reference_per_sample(gs), reps=args.ref_reps),
                floor,
                base,
            )
        gs = None  # free this size's tensors before the next
        if device.type == "cuda":
            torch.cuda.empty_cache()

    summed = [torch.randn_like(p) for p in model.params]
    nones = [None] * len(summed)

    def fused_summed(noise_std):
        tr.step(
            hyper, dp(noise_std), model.params, nones, None, summed, model.states, model.offsets
        )

    def torch_summed():
        for p, s in zip(torch_params, summed):
            g = s + torch.normal(0.0, sigma * C, p.shape, device=device)
            p.grad = g.div_(Be)
        adamw.step()

    floor = bytes_floor("summed", d, 0)
    base = report("summed", "-", "torch.normal+AdamW(fused)", timer(torch_summed), floor)
    report("summed", "-", "fused", timer(lambda: fused_summed(sigma * C)), floor, base)
    report("summed", "-", "fused sigma=0", timer(lambda: fused_summed(0.0)), floor, base)

    print_table(rows, d, len(shapes), bw, gs_dtype, device)
    return 0


def print_table(rows, d, n_tensors, bw, gs_dtype, device):
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(
        f"\ndpkern gpu_check {datetime.date.today()} | {name} | torch {torch.__version__} | "
        f"triton {triton.__version__} | d={d / 1e6:.1f}M in {n_tensors} tensors | "
        f"grad_samples {str(gs_dtype).replace('torch.', '')} | copy bandwidth {bw:.0f} GB/s"
    )
    print("GB/s = bytes floor / time (per-sample: 2*B*d*sizeof(grad) + 24*d; summed: 28*d)\n")
    head = "| path | B | implementation | ms | GB/s | % of copy BW | speed-up vs baseline |"
    print(head)
    print("|" + "---|" * 7)
    for path, B, impl, ms, gbs, pct, speed in rows:
        sp = f"{speed:.2f}x" if speed else "baseline"
        print(f"| {path} | {B} | {impl} | {ms:.3f} | {gbs:.0f} | {pct:.0f}% | {sp} |")
    sys.stdout.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python bench/gpu_check.py", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--gs-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ref-reps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--copy-mib", type=int, default=2048)
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model, 1 rep: test the script itself (CPU + TRITON_INTERPRET=1)",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.reps, args.ref_reps, args.warmup, args.copy_mib = 1, 1, 0, 1
        args.batches = [b for b in args.batches if b <= 2] or [1]
        if not torch.cuda.is_available():
            args.device = "cpu"
    if torch.device(args.device).type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in (
        "",
        "0",
    ):
        print(
            "gpu_check: no CUDA device; on CPU the Triton kernels need TRITON_INTERPRET=1 "
            "(use --smoke). Nothing to time."
        )
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
