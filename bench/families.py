"""The optimizer families (SPEC section 10) against what a user would otherwise run.

    python -m bench.families                       # CPU, d = 1M (GPT-2-like tensors), B = 8
    python -m bench.families --d 4M --batch 16 --device cuda

For each family, in one process, alternating the candidates (medians of ``--repeats``):

- per-sample path: ``dpkern.DP<Family>.step()`` on ``p.grad_sample`` vs Opacus'
  ``DPOptimizer`` wrapping the family's twin (torch.optim's with ``foreach=True``,
  ``lion_pytorch.Lion``, ``schedulefree``'s) on the same per-sample gradients, sigma, C, B;
- summed path (clipped sums ready, as ghost clipping hands them over):
  ``accumulate_clipped`` + ``step()`` vs ``p.grad = (S + N(0, sigma C)) / B`` + the twin's
  ``step()``;
- the non-private floor: the twin's ``step()`` alone.

Ratios are baseline / dpkern (> 1: dpkern is faster). DP-AdEMAMix has no packaged twin: its
row has dpkern's times only. Prints a markdown table (docs/BENCHMARKS.md shows one run).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import dpkern

from . import layout_shapes, make_grad_samples, make_params, parse_size
from .harness import Candidate, machine_info, time_alternating

SIGMA, CLIP = 1.0, 1.0


def _twins() -> dict:
    """family cli name -> (dpkern kwargs, twin factory or None). Hyper-parameters are the
    classes' defaults (lr is irrelevant to the time)."""
    import lion_pytorch
    import schedulefree

    o = torch.optim

    def sf(cls):
        def make(ps):
            opt = cls(ps)
            opt.train()
            return opt

        return make

    return {
        "dp-rmsprop": ({}, lambda ps: o.RMSprop(ps, foreach=True)),
        "dp-adagrad": ({}, lambda ps: o.Adagrad(ps, foreach=True)),
        "dp-adadelta": ({}, lambda ps: o.Adadelta(ps, foreach=True)),
        "dp-radam": ({}, lambda ps: o.RAdam(ps, foreach=True)),
        "dp-lion": ({}, lambda ps: lion_pytorch.Lion(ps)),
        "dp-adafactor": ({}, lambda ps: o.Adafactor(ps, foreach=True)),
        "dp-ademamix": ({}, None),
        "dp-sgd-schedulefree": ({}, sf(schedulefree.SGDScheduleFree)),
        "dp-adamw-schedulefree": ({}, sf(schedulefree.AdamWScheduleFree)),
    }


def _dpkern(name, ps, B_e, backend, kw):
    opt = dpkern.rules.by_cli_name(name).optimizer_class()(
        ps,
        max_grad_norm=CLIP,
        noise_multiplier=SIGMA,
        expected_batch_size=B_e,
        seed=1234,
        backend=backend,
        **kw,
    )
    if hasattr(opt, "train"):
        opt.train()
    return opt


def candidates(name: str, shapes, batch: int, device, backend: str) -> list[Candidate]:
    """The candidates of one family (each owns its parameters and states)."""
    kw, twin = _twins()[name]
    gen = torch.Generator().manual_seed(0)
    base = make_params(shapes, device, generator=gen)
    gs = make_grad_samples(base, batch, generator=gen)
    sums = [torch.randn(p.shape, generator=gen).mul_(0.01).to(device) for p in base]
    B_e = max(batch, 1)

    def fresh():
        return [p.detach().clone().requires_grad_(True) for p in base]

    def attach(ps, opacus=None):
        def prepare():
            if opacus is not None:
                opacus.zero_grad(set_to_none=True)
            for p, g in zip(ps, gs, strict=True):
                p.grad_sample = g.view_as(g)

        return prepare

    out = []
    ps = fresh()
    opt = _dpkern(name, ps, B_e, backend, kw)
    out.append(Candidate("dpkern", "per_sample", opt.step, attach(ps)))
    ps2 = fresh()
    opt2 = _dpkern(name, ps2, B_e, backend, kw)
    out.append(
        Candidate("dpkern", "summed", opt2.step, lambda o=opt2: o.accumulate_clipped(sums, batch))
    )
    if twin is None:
        return out
    from opacus.optimizers import DPOptimizer

    ps3 = fresh()
    dp = DPOptimizer(twin(ps3), noise_multiplier=SIGMA, max_grad_norm=CLIP, expected_batch_size=B_e)
    out.append(Candidate("baseline", "per_sample", dp.step, attach(ps3, dp)))
    ps4 = fresh()
    t4 = twin(ps4)

    def noisy(ps=ps4, opt=t4):
        for p, s in zip(ps, sums, strict=True):  # a hand-written DP step after clip + sum
            p.grad = s.add(torch.normal(0.0, SIGMA * CLIP, size=p.shape, device=device)).div_(B_e)
        opt.step()

    out.append(Candidate("baseline", "summed", noisy))
    ps5 = fresh()
    for p in ps5:
        p.grad = torch.randn(p.shape, generator=gen).mul_(1e-3).to(device)
    out.append(Candidate("floor", "twin", twin(ps5).step))
    return out


def run(d: int, batch: int, device, backend: str, repeats: int, names=None) -> list[dict]:
    shapes = layout_shapes(d, "gpt2")
    rows = []
    for name in names or _twins():
        cands = candidates(name, shapes, batch, device, backend)
        times = time_alternating(cands, repeats, device, warmup=1)
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        row = {"optimizer": name, **ms}
        for path in ("per_sample", "summed"):
            base = ms.get(f"baseline:{path}")
            row[f"ratio:{path}"] = None if base is None else base / ms[f"dpkern:{path}"]
        rows.append(row)
    return rows


def markdown(rows, d: int, batch: int, backend: str) -> str:
    def f(x, fmt="{:.1f}"):
        return "–" if x is None else fmt.format(x)

    lines = [
        f"d = {d:,} (GPT-2-like tensors), B = {batch}, backend {backend}; ms, medians; "
        "× = baseline / dpkern",
        "",
        "| optimizer | per-sample dpkern | Opacus + twin | × | summed dpkern | twin + noise | × "
        "| twin alone |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['optimizer']} | {f(r['dpkern:per_sample'])} | {f(r.get('baseline:per_sample'))} "
            f"| {f(r['ratio:per_sample'], '{:.2f}')} | {f(r['dpkern:summed'])} "
            f"| {f(r.get('baseline:summed'))} | {f(r['ratio:summed'], '{:.2f}')} "
            f"| {f(r.get('floor:twin'))} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.families", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--d", default="1M", help="coordinates (e.g. 1M, 4M)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--optimizers", nargs="*", default=None)
    args = ap.parse_args(argv)
    d = parse_size(args.d)
    device = torch.device(args.device)
    rows = run(d, args.batch, device, args.backend, args.repeats, args.optimizers)
    info = machine_info(device)
    print(f"# {info.get('cpu', info.get('device', ''))}; torch {torch.__version__}")
    print(markdown(rows, d, args.batch, args.backend))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
