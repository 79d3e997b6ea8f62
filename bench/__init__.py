"""dpkern benchmarks: pytest-benchmark microbenchmarks and a side-by-side ratio report.

Not part of the test suite (``tests/`` is the test path). Run them with

    python -m pytest bench --benchmark-only          # microbenchmarks (bench/test_bench_*.py)
    python -m bench.report                           # ratios against the baselines, < 10 min

This module holds the workloads both share: parameter layouts (one tensor, or a GPT-2-like
set of 148 tensors), random parameters and per-sample gradients, size parsing and the list
of dpkern backends that can run on a device.
"""

from __future__ import annotations

import math

import torch

from dpkern import backends

from .harness import synchronize  # noqa: F401  (the workloads' users time with it)

MI = 1 << 20  # "1M" coordinates = 2**20
LAYOUTS = ("tensor", "gpt2")


def parse_size(text: str) -> int:
    """'4096', '64K', '16M' or '1G' -> number of coordinates (binary prefixes: M = 2**20).

    Raises ValueError on anything else or on a value < 1."""
    s = str(text).strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    try:
        n = int(float(s[:-1] if mult > 1 else s) * mult)
    except ValueError:
        raise ValueError(f"invalid size {text!r}: expected e.g. 4096, 64K, 16M") from None
    if n < 1:
        raise ValueError(f"invalid size {text!r}: must be >= 1")
    return n


def format_size(n: int) -> str:
    """Inverse of :func:`parse_size` for display: 16777216 -> '16M', 3000 -> '3000'."""
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    if n >= MI // 2:
        return f"{n / MI:.1f}M"
    return str(n)


def gpt2_like_shapes(d: int, n_layer: int = 12) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-2-like transformer holding about ``d`` coordinates.

    The layout of GPT-2 (Radford et al. 2019; Hugging Face ``GPT2Model.named_parameters``):
    wte [V, h], wpe [P, h], then per block ln_1 (w, b), attn.c_attn (w [h, 3h], b [3h]),
    attn.c_proj (w [h, h], b [h]), ln_2 (w, b), mlp.c_fc (w [h, 4h], b [4h]),
    mlp.c_proj (w [4h, h], b [h]), and ln_f (w, b): 4 + 12 * n_layer tensors (148 for
    12 layers). As in GPT-2 small (85M of 124M), the blocks hold ~69% of the coordinates;
    h is a multiple of 4, P = 4h/3 and the vocabulary V takes the rest, so the total is
    ``d`` minus less than h.

    Raises ValueError when d is too small for such a model (d < ~3000 for 12 layers).
    """
    h = max(4, 4 * round(math.sqrt(0.685 * d / (12 * n_layer)) / 4))
    while True:
        block = [
            (h,),
            (h,),
            (h, 3 * h),
            (3 * h,),
            (h, h),
            (h,),
            (h,),
            (h,),
            (h, 4 * h),
            (4 * h,),
            (4 * h, h),
            (h,),
        ]
        positions = max(1, (4 * h) // 3)
        rest = n_layer * sum(math.prod(s) for s in block) + positions * h + 2 * h
        vocab = (d - rest) // h
        if vocab >= 1:
            break
        if h == 4:
            raise ValueError(f"d={d} is too small for a {n_layer}-layer GPT-2-like layout")
        h -= 4  # rounding h up overshot a small d
    return [(vocab, h), (positions, h)] + block * n_layer + [(h,), (h,)]


def layout_shapes(d: int, layout: str) -> list[tuple[int, ...]]:
    """Shapes for ``layout`` "tensor" ([d]) or "gpt2" (:func:`gpt2_like_shapes`)."""
    if layout == "tensor":
        return [(d,)]
    if layout == "gpt2":
        return gpt2_like_shapes(d)
    raise ValueError(f"invalid layout {layout!r}: expected one of {LAYOUTS}")


def make_params(
    shapes, device, *, generator: torch.Generator | None = None, requires_grad: bool = True
) -> list[torch.Tensor]:
    """float32 leaf parameters of the given shapes, N(0, 0.02^2) like GPT-2's init."""
    out = []
    for s in shapes:
        p = torch.randn(s, generator=generator).mul_(0.02).to(device)
        out.append(p.requires_grad_(requires_grad))
    return out


def make_grad_samples(params, batch_size: int, *, generator=None) -> list[torch.Tensor]:
    """Per-sample gradients ``[B, *p.shape]`` (float32, N(0, 1e-4)) on the params' device.

    With d coordinates each row has norm ~0.01 sqrt(d), so C = 1 clips most rows (the
    common regime of DP training)."""
    return [
        torch.randn((batch_size, *p.shape), generator=generator).mul_(0.01).to(p.device)
        for p in params
    ]


def available_backends(device) -> list[str]:
    """dpkern backends that run on ``device``: "torch" always, "cpp" on CPU when
    ``dpkern._C`` is built, "triton" on CUDA when importable."""
    device = torch.device(device)
    names = ["torch"]
    if device.type == "cpu" and backends.is_available("cpp"):
        names.append("cpp")
    if device.type == "cuda" and backends.is_available("triton"):
        names.append("triton")
    return names
