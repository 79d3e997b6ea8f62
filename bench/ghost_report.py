"""Reporting of the ghost bench (:mod:`bench.ghost`): the markdown tables of
:func:`bench.ghost_measure.measure`'s results (per-layer norms, the end-to-end step, issue
16's goals, the first-step check's cost, the notes), the number formatting they share
(milliseconds, ratios, MiB, parameter counts, met / not met), and :func:`write`, which
saves the results as JSON, CSV and markdown in a folder."""

from __future__ import annotations

import json
from pathlib import Path

from . import MI
from .ghost_e2e import GOAL_GHOST_RATIO, GOAL_OPACUS_OVER_GHOST, GOAL_PEAK_RATIO, goals
from .ghost_models import MODEL_TITLES
from .harness import write_csv


def _ms(s):
    return "–" if s is None else (f"{s * 1e3:.3g}" if s * 1e3 < 100 else f"{s * 1e3:.0f}")


def _x(r):
    return "–" if r is None else f"{r:.2f}×"


def _mib(b):
    return "–" if b is None else (f"{b / MI:.0f}" if b >= 10 * MI else f"{b / MI:.1f}")


def _count(n):
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


def _met(ok):
    return "–" if ok is None else ("met" if ok else "**not met**")


def goals_markdown(rows: list[dict]) -> list[str]:
    """Issue 16's goals (:func:`goals`) of the e2e rows, as a markdown table (lines)."""
    head = (
        "| model | block | B | ghost / non-private | goal | met | Opacus / ghost | goal "
        "| met | peak extra ghost / non-private | goal | met |"
    )
    lines = [
        "LLM fine-tuning goals on this run: ghost step / non-private step ≤ "
        f"{GOAL_GHOST_RATIO['full']:.2f}× (full fine-tuning) or ≤ "
        f"{GOAL_GHOST_RATIO['lora']:.2f}× (LoRA); Opacus fast gradient clipping / ghost ≥ "
        f"{GOAL_OPACUS_OVER_GHOST:g}× (its untied copy on the tied GPT-2); the peak extra "
        "memory of one ghost step / that of one non-private step (what the step adds to "
        f"the model, optimizer states and batch) ≤ {GOAL_PEAK_RATIO:g}×.",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in rows:
        g = {**r, **goals(r)}
        title = MODEL_TITLES.get(r.get("model", "gpt2"), r.get("model"))
        lines.append(
            f"| {title} | {r['block']} | {r['batch']} | {_x(g['ghost_ratio'])} "
            f"| ≤ {g['goal_ghost_ratio']:.2f}× | {_met(g['goal_ghost_met'])} "
            f"| {_x(g['opacus_over_ghost'])} | ≥ {GOAL_OPACUS_OVER_GHOST:.2f}× "
            f"| {_met(g['goal_opacus_met'])} | {_x(g['peak_ratio'])} "
            f"| ≤ {GOAL_PEAK_RATIO:.2f}× | {_met(g['goal_peak_met'])} |"
        )
    return lines


def markdown(res: dict) -> str:
    """The tables (per-layer norms, the e2e step, issue 16's goals) and notes of
    :func:`measure`'s results, as markdown."""
    head = (
        "| B | T | d | p | rule picks | Gram ms | instantiate ms | triton ms | Opacus ms "
        "| Opacus / dpkern (rule) | Opacus / Gram | peak extra MiB (Gram / inst. / Opacus) |"
    )
    lines = []
    if res["layers"]:
        lines += [
            "Per-sample weight-gradient norms of a Linear [B, T, d] -> [B, T, p] "
            "(float32; Opacus = `GradSampleModuleFastGradientClipping.NORM_SAMPLERS"
            "[nn.Linear]`; > 1×: dpkern faster).",
            "",
            head,
            "|" + "---|" * (head.count("|") - 1),
        ]
    for r in res["layers"]:
        lines.append(
            f"| {r['B']} | {r['T']} | {r['d']} | {r['p']} | {r['rule']} | "
            f"{_ms(r['gram_s'])} | {_ms(r['instantiate_s'])} | {_ms(r['triton_s'])} "
            f"| {_ms(r['opacus_s'])} | {_x(r['opacus_over_rule'])} | "
            f"{_x(r['opacus_over_gram'])} | {_mib(r['gram_peak_bytes'])} / "
            f"{_mib(r['instantiate_peak_bytes'])} / {_mib(r['opacus_peak_bytes'])} |"
        )
    head = (
        "| model | block | B | params | non-private ms | ghost ms | × | ghost Gram-only ms | × "
        "| per-sample ms | × | Opacus ms | × | peak extra MiB (non-private / ghost / "
        "ghost Gram-only / per-sample / Opacus) |"
    )
    lines += [
        *([""] if lines else []),
        "One DP-AdamW fine-tuning step of the default byte-level GPT-2 "
        "(`dpkern.models.default_model`, tied embedding <-> lm-head) and of a "
        "Llama-style model (`bench.ghost.llama_model`: RMSNorm, SwiGLU, rotary, 2 KV "
        "heads, untied lm-head), eager attention, all parameters trained, and of the same "
        "models with peft LoRA adapters (+ LoRA: `dpkern.models.lora_config`, every "
        "linear layer of a block, only the adapters trained); params = trainable "
        "parameters; × = time / non-private step (AdamW after `loss.mean().backward()`); "
        "ghost Gram-only = `keep_bytes=0` (no kept per-sample gradients).",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in res["e2e"]:
        op = (
            "opacus"
            if r["opacus_s"] is not None
            else "opacus_untied"
            if r.get("opacus_untied_s") is not None
            else "opacus"
        )
        title = MODEL_TITLES.get(r.get("model", "gpt2"), r.get("model"))
        lines.append(
            f"| {title} | {r['block']} | {r['batch']} | {_count(r['params'])} | "
            f"{_ms(r['nonprivate_s'])} | {_ms(r['ghost_s'])} | {_x(r['ghost_ratio'])} "
            f"| {_ms(r.get('ghost_gram_s'))} | {_x(r.get('ghost_gram_ratio'))} "
            f"| {_ms(r['per_sample_s'])} | {_x(r['per_sample_ratio'])} | "
            f"{_ms(r[op + '_s'])}{' (untied)' if op == 'opacus_untied' else ''} | "
            f"{_x(r[op + '_ratio'])} | "
            f"{_mib(r['nonprivate_peak_bytes'])} / {_mib(r['ghost_peak_bytes'])} / "
            f"{_mib(r.get('ghost_gram_peak_bytes'))} / {_mib(r['per_sample_peak_bytes'])} / {_mib(r[op + '_peak_bytes'])} |"
        )
    if res["e2e"]:
        lines += ["", *goals_markdown(res["e2e"])]
    checks = [
        f"{MODEL_TITLES.get(r.get('model', 'gpt2'), r.get('model'))} block {r['block']} "
        f"B {r['batch']}: {_ms(r['verify_s'])} ms ({_x(r['verify_over_ghost'])} a ghost "
        "step)"
        for r in res["e2e"]
        if r.get("verify_s") is not None
    ]
    if checks:
        lines += [
            "",
            'Ghost clipping\'s one-time first-step check (`verify="first"`: exact '
            "norms of 4 samples by autograd, compared with the ghost norms): "
            + "; ".join(checks)
            + ".",
        ]
    if res["notes"]:
        lines += [""] + [f"Note: {n}." for n in res["notes"]]
    return "\n".join(lines)


def write(res: dict, out: Path) -> None:
    """ghost.json, ghost_layers.csv, ghost_e2e.csv, ghost_timings.csv, ghost.md in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "ghost.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    write_csv(out / "ghost_layers.csv", res["layers"])
    write_csv(out / "ghost_e2e.csv", res["e2e"])
    write_csv(out / "ghost_timings.csv", res["timings"])
    (out / "ghost.md").write_text(markdown(res) + "\n")
