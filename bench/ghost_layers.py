"""Per-layer norms of the ghost bench (:mod:`bench.ghost`, measurement 1): a bias-free
``nn.Linear`` shape ``BxTxDxP`` (:class:`LayerCase`, the method dpkern's rule picks and its
flop estimate), the candidates computing its per-sample squared weight-gradient norms on
the same random activations and output gradients (dpkern's Gram and instantiation paths,
the fused Triton kernel on CUDA, Opacus' ghost-clipping norm sampler), the check that they
agree before anything is timed, and the summary row of one shape."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from dpkern.ghost.norms import outer_method, outer_norm_sq

from .harness import Candidate

#: Linear shapes ``(B, T, d, p)``: the default GPT-2's c_fc at block 64, GPT-2-small's
#: attention projection at T = 128, its MLP c_fc at T = 512 (Gram and instantiation close),
#: and T = 1024 with d = p = 768 (the rule instantiates).
DEFAULT_LAYERS = ("16x64x128x512", "16x128x768x768", "8x512x768x3072", "4x1024x768x768")


@dataclass(frozen=True)
class LayerCase:
    """A bias-free Linear ``[B, T, d] -> [B, T, p]``."""

    B: int
    T: int
    d: int
    p: int

    @property
    def rule(self) -> str:
        """What dpkern's per-layer rule picks: "gram" or "instantiate"."""
        return outer_method(self.T, self.d, self.p)

    def flops(self, method: str) -> int:
        """Multiply-adds x 2 of a method (the rule's estimate, not counting the squares)."""
        if method == "instantiate":
            return 2 * self.B * self.T * self.d * self.p
        return 2 * self.B * self.T * self.T * (self.d + self.p)


def parse_layer(text: str) -> LayerCase:
    """'BxTxDxP' (e.g. '16x128x768x768') -> LayerCase. Raises ValueError otherwise."""
    try:
        vals = [int(v) for v in str(text).lower().split("x")]
    except ValueError:
        vals = []
    if len(vals) != 4 or min(vals) < 1:
        raise ValueError(
            f"invalid layer shape {text!r}: expected BxTxDxP with positive "
            "integers, e.g. 16x128x768x768"
        )
    return LayerCase(*vals)


def layer_candidates(case: LayerCase, device) -> list[Candidate]:
    """Candidates computing the per-sample squared weight-gradient norms of ``case`` on the
    same random A ``[B, T, d]`` and G ``[B, T, p]`` (float32, on ``device``)."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    A = torch.randn(case.B, case.T, case.d, generator=gen).to(device)
    G = torch.randn(case.B, case.T, case.p, generator=gen).mul_(1e-3).to(device)
    cands = [
        Candidate("dpkern", m, lambda m=m: outer_norm_sq(G, A, method=m))
        for m in ("gram", "instantiate")
    ]
    if device.type == "cuda":
        try:
            from dpkern.ghost.triton_norms import gram_norm_sq

            cands.append(Candidate("dpkern", "triton", lambda: gram_norm_sq(G, A)))
        except ImportError:
            pass
    try:
        from opacus.grad_sample import GradSampleModuleFastGradientClipping as GSM
    except ImportError:
        return cands
    layer = torch.nn.Linear(case.d, case.p, bias=False, device=device)
    norm_fn = GSM.NORM_SAMPLERS[torch.nn.Linear]
    cands.append(
        Candidate("baseline", "opacus", lambda: norm_fn(layer, [A], G)[layer.weight].square())
    )
    return cands


def check_agree(values: dict[str, torch.Tensor], reference: str, rtol: float = 1e-3) -> None:
    """Raise AssertionError naming the candidate whose per-sample squared norms differ from
    ``values[reference]`` by more than ``rtol`` (relative to the largest norm)."""
    ref = values[reference].float().cpu()
    scale = float(ref.abs().max()) or 1.0
    for name, v in values.items():
        err = float((v.float().cpu() - ref).abs().max()) / scale
        if not err <= rtol:
            raise AssertionError(
                f"ghost bench: {name} norms differ from {reference} "
                f"(max relative error {err:.2e} > {rtol})"
            )


def layer_rows(case: LayerCase, medians: dict[str, float], peaks: dict[str, int | None]) -> dict:
    """One summary row: medians (s), speed-ups of dpkern's rule and Gram path over Opacus."""
    auto = medians.get(f"dpkern:{case.rule}")
    opacus = medians.get("baseline:opacus")
    row = dict(
        B=case.B,
        T=case.T,
        d=case.d,
        p=case.p,
        rule=case.rule,
        gram_gflop=case.flops("gram") / 1e9,
        instantiate_gflop=case.flops("instantiate") / 1e9,
    )
    for name in ("dpkern:gram", "dpkern:instantiate", "dpkern:triton", "baseline:opacus"):
        key = name.split(":")[1]
        row[f"{key}_s"] = medians.get(name)
        row[f"{key}_peak_bytes"] = peaks.get(name)
    row["rule_s"] = auto
    row["opacus_over_rule"] = opacus / auto if opacus and auto else None
    row["opacus_over_gram"] = opacus / medians["dpkern:gram"] if opacus else None
    best = min((v, k) for k, v in medians.items() if k.startswith("dpkern:"))
    row["fastest_dpkern"] = best[1].split(":")[1]
    return row
