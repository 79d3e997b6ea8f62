"""Ghost clipping in the benchmark report: per-layer norms and the end-to-end DP step.

    python -m bench.ghost                  # this part alone (~2-3 min on a 2-core CPU)
    python -m bench.report --ghost         # the same, inside the full report
    python -m bench.ghost --models llama   # the end-to-end step of one model only
    python -m bench.ghost --layers --models gpt2-lora llama-lora   # LoRA rows only

Two measurements, each alternating its candidates (the order rotates every repeat) and
reporting medians, as :mod:`bench.report` does:

1. **Per-layer norms** of a bias-free ``nn.Linear`` weight with sequence input
   ``A [B, T, d] -> G [B, T, p]`` (the per-sample squared norms ``||G_i^T A_i||_F^2``,
   float32 ``[B]``), on shapes ``BxTxDxP``:

   - ``dpkern:gram``: :func:`dpkern.ghost.norms.outer_norm_sq` ``method="gram"``
     (``sum((A_i A_i^T) o (G_i G_i^T))``, ~2 B T^2 (d + p) flops);
   - ``dpkern:instantiate``: the same with ``method="instantiate"`` (form ``G_i^T A_i``
     chunk by chunk, then square it: ~2 B T d p flops);
   - ``dpkern:triton`` (CUDA only): the fused Gram kernel
     :func:`dpkern.ghost.triton_norms.gram_norm_sq`;
   - ``baseline:opacus``: the norm function Opacus' ghost clipping runs in its backward
     hook, ``GradSampleModuleFastGradientClipping.NORM_SAMPLERS[nn.Linear]`` (opacus
     1.6: ``compute_linear_norm_sample``, the Gram path by ``einsum``, unchunked), on the
     same A and G (it returns norms; timed as is).

   The table marks which method dpkern's rule (:func:`dpkern.ghost.norms.outer_method`,
   Gram when ``T (d + p) <= d p``) picks. Before timing, every candidate's norms are
   checked against the Gram path (``rtol`` 1e-3), so a wrong fast path cannot win.

2. **End-to-end DP fine-tuning step** of two small byte-level causal LMs on random token
   blocks ``[B, block]`` (the same blocks and batches for both), each candidate on its own
   copy of the model:

   - ``gpt2``: the default GPT-2 (:func:`dpkern.models.default_model`: n_embd 128, 2
     layers, 4 heads, transformers' ``Conv1D`` projections, LayerNorm, learned positions,
     tied embedding <-> lm-head, eager attention; 0.44 M parameters at block 64);
   - ``llama``: a Llama-style model (:func:`llama_model`: ``LlamaForCausalLM`` from a
     ``LlamaConfig`` built in code: hidden 128, 2 layers, 4 heads, 2 KV heads (GQA),
     intermediate 344 (SwiGLU), ``LlamaRMSNorm``, rotary positions, bias-free
     ``nn.Linear``, **untied** lm-head (Llama's default ``tie_word_embeddings=False``),
     **eager** attention like the GPT-2 (torch.func's per-sample path has no batching
     rule for the fused CPU attention kernel); 0.43 M parameters). Its vocabulary is the
     project's byte vocabulary (:data:`dpkern.models.BYTE_VOCAB` = 257: 256 bytes + EOT),
     so both models see the same ids;
   - ``gpt2-lora``, ``llama-lora``: the same seeded base models wrapped by peft's
     ``get_peft_model`` with :func:`dpkern.models.lora_config` (what ``dpkern finetune
     --lora R`` trains: r :data:`LORA_R` (``--lora-r``), alpha 16, dropout 0, on every
     linear layer of a block: GPT-2's c_attn/c_proj/c_fc, Llama's q/k/v/o and
     gate/up/down projections); only the adapters (``lora_A``/``lora_B``, 33 k and 37 k
     parameters) are trainable, and every candidate's optimizer holds only those.

   Candidates (each on its own deep copy of the model):

   - ``floor:nonprivate``: ``token_loss(...).mean().backward()`` +
     ``torch.optim.AdamW.step()`` (the non-private step every ratio divides by);
   - ``dpkern:ghost``: :class:`dpkern.ghost.GhostClipping` ``.backward(losses)`` +
     ``dpkern.DPAdamW.step()`` (default ``keep_bytes``: each parameter on the route
     :mod:`dpkern.ghost.plan` picks, Gram norm or per-sample gradients kept);
   - ``dpkern:ghost-gram``: the same with ``keep_bytes=0`` (every norm by the Gram path /
     segment sums, every sum by book-keeping: the route before the kept one);
   - ``dpkern:per_sample``: :func:`dpkern.grad_sample.compute_grad_sample` (torch.func) +
     ``dpkern.DPAdamW.step()``;
   - ``baseline:opacus``: Opacus' fast gradient clipping
     (``GradSampleModuleFastGradientClipping(use_ghost_clipping=True)``,
     ``DPOptimizerFastGradientClipping`` around ``torch.optim.AdamW``,
     ``DPTensorFastGradientClipping(...).backward()``: two backward passes). Opacus 1.6
     refuses tied weights ("Parameter tying is not supported with Ghost Clipping"): the
     tied model is tried first and, when refused, the note says so and the candidate runs
     on a copy whose lm-head is untied (``baseline:opacus-untied``: V x n_embd more
     parameters, the same FLOPs), so it is still a number on this model's shapes. Any
     other refusal is a note and leaves no Opacus number. Opacus has ghost-clipping norm
     samplers for ``nn.Linear`` and ``nn.Embedding`` only: other trainable modules get
     instantiated per-sample gradients, by its hooks (LayerNorm) or by its functorch
     fallback (transformers' ``Conv1D``, ``LlamaRMSNorm``); a note per model says which.
     (On the Llama-style model it runs as is; its per-sample norms equal dpkern's. On
     the LoRA models the tied embedding is frozen, so nothing is refused, and the
     trainable modules are the adapters' ``nn.Linear``: all ghost norms.)

   Reported: median ms, ratio = candidate / non-private (1.0 = free privacy), and the peak
   extra memory of one step (the report's ``peak_extra_bytes``: CPU peak-RSS delta,
   CUDA ``max_memory_allocated`` delta), measured after all timings, on CPU in a fresh
   process (:mod:`bench.ghost_memory`).

   Issue 16's goals (:func:`goals`, a table under the e2e table): ghost / non-private
   <= 1.25x (full fine-tuning) or <= 1.10x (LoRA); Opacus / ghost >= 2x; and the
   peak-memory ratio, defined as the ghost step's peak extra bytes over the non-private
   step's (the memory one step adds on top of the model, its optimizer states and the
   batch; not the process' total, which the model and the interpreter dominate at
   these sizes) <= 1.2x. Each is marked met or not met; speed is never asserted in tests.

   The ghost candidate is timed with ``verify="off"`` (the steady state). The one-time
   first-step check of the default ``verify="first"`` (:mod:`dpkern.ghost.verify`: exact
   norms of up to 4 samples by autograd) is measured apart by :func:`verify_cost` on a
   fresh copy: ``GhostClipping.verify_seconds`` of its first step, reported in ms and in
   units of the median ghost step (a line under the table).

Layout: this module is the entry point (:func:`main`) and re-exports the names below
from :mod:`bench.ghost_models` (the models, LoRA and Opacus helpers),
:mod:`bench.ghost_layers` (measurement 1), :mod:`bench.ghost_e2e` (measurement 2 and the
goals), :mod:`bench.ghost_measure` (:func:`measure`) and :mod:`bench.ghost_report` (the
tables and :func:`write`).

Sources: Li et al. 2022 (ghost clipping, arXiv 2110.05679); Bu et al. 2023 (book-keeping
and the per-layer Gram/instantiation choice, arXiv 2210.00038); Opacus 1.6 fast gradient
clipping (``opacus.grad_sample.grad_sample_module_fast_gradient_clipping``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from pathlib import Path

import torch

from dpkern.models import BYTE_VOCAB

from .ghost_e2e import (
    DEFAULT_BATCHES,
    DEFAULT_BLOCKS,
    E2E_ROLES,
    GOAL_GHOST_RATIO,
    GOAL_OPACUS_OVER_GHOST,
    GOAL_PEAK_RATIO,
    e2e_candidates,
    e2e_row,
    goals,
    verify_cost,
)
from .ghost_layers import (
    DEFAULT_LAYERS,
    LayerCase,
    check_agree,
    layer_candidates,
    layer_rows,
    parse_layer,
)
from .ghost_measure import _fmt, _peaks, _timed, measure
from .ghost_models import (
    E2E_MODELS,
    LLAMA_SHAPE,
    LORA_ALPHA,
    LORA_DROPOUT,
    LORA_R,
    MODEL_PROSE,
    MODEL_TITLES,
    OPACUS_QUIET,
    _batch_ids,
    _opacus_step,
    _quiet,
    _seeded_model,
    _tied,
    _untied_copy,
    base_name,
    build_model,
    is_lora,
    llama_model,
    opacus_modes,
    trainable,
)
from .ghost_report import _count, _met, _mib, _ms, _x, goals_markdown, markdown, write
from .harness import (
    RESULTS_DIR,
    cpu_ticks,
    load_average,
    machine_info,
    steal_note,
    steal_share,
)

#: Every name this module had before it was split (tests, :mod:`bench.report`,
#: :mod:`bench.ghost_memory` and bench/test_bench_ghost.py use them through it; a test that
#: monkeypatches ``bench.ghost.measure`` reaches :func:`main` and :mod:`bench.report`, which
#: look it up here).
__all__ = [
    "BYTE_VOCAB",
    "DEFAULT_BATCHES",
    "DEFAULT_BLOCKS",
    "DEFAULT_LAYERS",
    "E2E_MODELS",
    "E2E_ROLES",
    "GOAL_GHOST_RATIO",
    "GOAL_OPACUS_OVER_GHOST",
    "GOAL_PEAK_RATIO",
    "LLAMA_SHAPE",
    "LORA_ALPHA",
    "LORA_DROPOUT",
    "LORA_R",
    "MODEL_PROSE",
    "MODEL_TITLES",
    "OPACUS_QUIET",
    "LayerCase",
    "_batch_ids",
    "_count",
    "_fmt",
    "_met",
    "_mib",
    "_ms",
    "_opacus_step",
    "_peaks",
    "_quiet",
    "_seeded_model",
    "_tied",
    "_timed",
    "_untied_copy",
    "_x",
    "base_name",
    "build_model",
    "check_agree",
    "e2e_candidates",
    "e2e_row",
    "goals",
    "goals_markdown",
    "is_lora",
    "layer_candidates",
    "layer_rows",
    "llama_model",
    "main",
    "markdown",
    "measure",
    "opacus_modes",
    "parse_layer",
    "trainable",
    "verify_cost",
    "write",
]


def main(argv=None) -> dict:
    """``python -m bench.ghost``: the ghost part alone; prints the tables, writes the files
    under ``--out`` and returns the results (with "machine" and "command" added)."""
    ap = argparse.ArgumentParser(prog="python -m bench.ghost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    ap.add_argument(
        "--layers",
        nargs="*",
        default=list(DEFAULT_LAYERS),
        help="Linear shapes BxTxDxP (default: %(default)s; none: no per-layer table)",
    )
    ap.add_argument(
        "--blocks",
        nargs="+",
        type=int,
        default=list(DEFAULT_BLOCKS),
        help="end-to-end block lengths in tokens, >= 2 (default: %(default)s)",
    )
    ap.add_argument(
        "--batches",
        nargs="+",
        type=int,
        default=list(DEFAULT_BATCHES),
        help="end-to-end batch sizes B (default: %(default)s)",
    )
    ap.add_argument(
        "--models",
        nargs="+",
        choices=E2E_MODELS,
        default=list(E2E_MODELS),
        help="end-to-end models (default: %(default)s)",
    )
    ap.add_argument(
        "--lora-r",
        type=int,
        default=LORA_R,
        help="LoRA rank of the -lora models (default: %(default)s; alpha 16, dropout 0)",
    )
    ap.add_argument(
        "--repeats", type=int, default=5, help="timed runs per candidate (default: %(default)s)"
    )
    ap.add_argument(
        "--warmup", type=int, default=1, help="untimed runs first (default: %(default)s)"
    )
    ap.add_argument(
        "--sigma", type=float, default=1.0, help="noise multiplier (default: %(default)s)"
    )
    ap.add_argument(
        "--clip", type=float, default=1.0, help="clipping bound C (default: %(default)s)"
    )
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    ap.add_argument(
        "--default-malloc",
        action="store_true",
        help="time under glibc's default malloc (default on CPU: freed memory kept for "
        "reuse, as dpkern finetune runs: dpkern.cli.heap; every candidate alike)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        help="results directory (default: bench/results/<UTC time>-ghost)",
    )
    ap.add_argument("--quiet", action="store_true", help="print nothing")
    args = ap.parse_args(argv)
    try:
        layers = [parse_layer(s) for s in args.layers]
    except ValueError as exc:
        ap.error(str(exc))
    if args.repeats < 1 or args.warmup < 0 or min(args.blocks + args.batches) < 1:
        ap.error("--repeats, --blocks, --batches must be >= 1 and --warmup >= 0")
    if min(args.blocks) < 2:
        ap.error("--blocks must be >= 2")
    if args.lora_r < 1:
        ap.error("--lora-r must be >= 1")
    if args.threads:
        from .harness import set_threads

        set_threads(args.threads)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    info = machine_info(args.device)
    from dpkern.cli.heap import keep_freed_memory, user_settings

    kept = False
    if not args.default_malloc and torch.device(args.device).type == "cpu":
        kept = keep_freed_memory()
    mine = user_settings()
    info["malloc"] = (
        "freed memory kept (dpkern.cli.heap)"
        if kept
        else f"the environment's ({', '.join(mine)})"
        if mine
        else "default"
    )
    say(
        f"# dpkern ghost bench on {info['cpu']} ({info['cores']} cores, torch threads "
        f"{info['torch_threads']}), load average {info['loadavg'][0]:.1f}, malloc "
        f"{info['malloc']}"
    )
    ticks = cpu_ticks()
    res = measure(
        args.device,
        layers=layers,
        blocks=args.blocks,
        batches=args.batches,
        repeats=args.repeats,
        warmup=args.warmup,
        sigma=args.sigma,
        clip=args.clip,
        memory=not args.no_memory,
        models=args.models,
        model_kw={m: {"r": args.lora_r} for m in args.models if is_lora(m)},
        say=say,
    )
    info["loadavg_end"] = load_average()[0]
    info["cpu_steal"] = steal_share(ticks, cpu_ticks())
    res["machine"] = info
    res["command"] = "python -m bench.ghost " + " ".join(
        map(str, argv if argv is not None else sys.argv[1:])
    )
    out = args.out or RESULTS_DIR / (
        _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-ghost"
    )
    write(res, out)
    say("\n" + markdown(res))
    say(
        f"\n(ghost part {res['elapsed_s']:.0f}s; load average {info['loadavg'][0]:.1f} -> "
        f"{info['loadavg_end']:.1f}; {steal_note(info['cpu_steal'])}; results in {out})"
    )
    return res


if __name__ == "__main__":
    main()
