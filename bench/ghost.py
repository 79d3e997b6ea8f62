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

Sources: Li et al. 2022 (ghost clipping, arXiv 2110.05679); Bu et al. 2023 (book-keeping
and the per-layer Gram/instantiation choice, arXiv 2210.00038); Opacus 1.6 fast gradient
clipping (``opacus.grad_sample.grad_sample_module_fast_gradient_clipping``).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import json
import statistics
import sys
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

import dpkern
from dpkern.ghost.norms import outer_method, outer_norm_sq
from dpkern.models import BYTE_VOCAB, CausalLMLogits, default_model, sample_loss, token_loss

from . import MI, synchronize
from .harness import (
    KEY,
    LR,
    RESULTS_DIR,
    WEIGHT_DECAY,
    Candidate,
    load_average,
    machine_info,
    peak_extra_bytes,
    time_alternating,
    write_csv,
)

#: Linear shapes ``(B, T, d, p)``: the default GPT-2's c_fc at block 64, GPT-2-small's
#: attention projection at T = 128, its MLP c_fc at T = 512 (Gram and instantiation close),
#: and T = 1024 with d = p = 768 (the rule instantiates).
DEFAULT_LAYERS = ("16x64x128x512", "16x128x768x768", "8x512x768x3072", "4x1024x768x768")
DEFAULT_BLOCKS = (64, 128)
DEFAULT_BATCHES = (16, 32)
#: End-to-end models (see :func:`build_model`), in the order they run: full fine-tuning
#: of the two built-in models, then LoRA on the same seeded base models.
E2E_MODELS = ("gpt2", "llama", "gpt2-lora", "llama-lora")
MODEL_TITLES = {  # table column
    "gpt2": "GPT-2",
    "llama": "Llama-style",
    "gpt2-lora": "GPT-2 + LoRA",
    "llama-lora": "Llama-style + LoRA",
}
MODEL_PROSE = {  # notes
    "gpt2": "default GPT-2",
    "llama": "Llama-style model",
    "gpt2-lora": "default GPT-2 with LoRA",
    "llama-lora": "Llama-style model with LoRA",
}
#: The LoRA models' adapters (``dpkern finetune --lora R`` defaults: alpha 16, dropout 0):
#: ``r`` in a LoRA model's ``model_kw`` overrides :data:`LORA_R`.
LORA_R = 8
LORA_ALPHA = 16.0
LORA_DROPOUT = 0.0
#: Issue 16's goals for one DP step on CPU (see :func:`goals`): ghost step / non-private
#: step at most 1.25x (full fine-tuning) or 1.10x (LoRA); Opacus' fast gradient clipping /
#: ghost step at least 2x; the ghost step's peak extra bytes / the non-private step's at
#: most 1.2x.
GOAL_GHOST_RATIO = {"full": 1.25, "lora": 1.10}
GOAL_OPACUS_OVER_GHOST = 2.0
GOAL_PEAK_RATIO = 1.2
#: The Llama-style model's shape (:func:`llama_model`'s defaults).
LLAMA_SHAPE = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 344,
}
E2E_ROLES = (
    "floor:nonprivate",
    "dpkern:ghost",
    "dpkern:ghost-gram",
    "dpkern:per_sample",
    "baseline:opacus",
    "baseline:opacus-untied",
)
OPACUS_QUIET = (
    "Full backward hook is firing",
    "Using a non-full backward hook",
    "Secure RNG turned off",
    "Optimal order is the largest alpha",
)


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


def _quiet(fn):
    """``fn`` with autograd on (the report times under no_grad) and Opacus' chatter off."""

    def run():
        with torch.enable_grad(), warnings.catch_warnings():
            for msg in OPACUS_QUIET:
                warnings.filterwarnings("ignore", message=msg)
            return fn()

    return run


# --------------------------------------------------------------------------------------
# 1. Per-layer norms
# --------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------
# 2. End-to-end DP fine-tuning step
# --------------------------------------------------------------------------------------
def llama_model(block_size: int, *, seed: int | None = None, **shape):
    """A freshly initialised byte-level Llama-style ``LlamaForCausalLM`` (transformers),
    context ``block_size``: :data:`LLAMA_SHAPE` (``LlamaConfig`` names; ``shape``
    overrides them), vocabulary :data:`dpkern.models.BYTE_VOCAB`, untied lm-head, eager
    attention, no dropout. ``seed``: initialise with ``torch.manual_seed(seed)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dpkern.models import EOT_ID

    config = LlamaConfig(
        vocab_size=BYTE_VOCAB,
        max_position_embeddings=block_size,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        bos_token_id=EOT_ID,
        eos_token_id=EOT_ID,
        attn_implementation="eager",
        **{**LLAMA_SHAPE, **shape},
    )
    if seed is not None:
        torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def is_lora(model: str) -> bool:
    """Whether the e2e model name is a LoRA one ("gpt2-lora", "llama-lora")."""
    return model.endswith("-lora")


def base_name(model: str) -> str:
    """The built-in model a LoRA model adapts ("gpt2-lora" -> "gpt2"); else ``model``."""
    return model.removesuffix("-lora")


def build_model(model: str, block: int, **kw):
    """``model`` ("gpt2": :func:`dpkern.models.default_model`, "llama": :func:`llama_model`;
    "gpt2-lora" / "llama-lora": that model wrapped by peft's ``get_peft_model`` with
    :func:`dpkern.models.lora_config` (r :data:`LORA_R`, alpha :data:`LORA_ALPHA`, dropout
    0, every linear layer of a block; only the adapters are trainable)) at context
    ``block``; ``kw``: the builder's shape arguments (and ``r`` for a LoRA model). Raises
    ValueError for an unknown name."""
    if is_lora(model) and base_name(model) in ("gpt2", "llama"):
        from dpkern.models import add_lora

        r = kw.pop("r", LORA_R)
        return add_lora(build_model(base_name(model), block, **kw), r, LORA_ALPHA, LORA_DROPOUT)
    if model == "gpt2":
        return default_model(block, **kw)
    if model == "llama":
        return llama_model(block, **kw)
    raise ValueError(f"unknown e2e model {model!r}: expected one of {E2E_MODELS}")


def _seeded_model(model: str, block: int, kw: dict | None):
    """The same initial weights for every candidate, verify_cost and the memory phase (a
    LoRA model: the same base weights as its full fine-tuning model, then its adapters)."""
    base = base_name(model)
    seed = f"ghost model {block}" if base == "gpt2" else f"ghost model {base} {block}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(zlib.crc32(seed.encode()))
        return build_model(model, block, **(kw or {}))


def trainable(model) -> list:
    """The parameters of ``model`` that require gradients (a LoRA model: the adapters)."""
    return [p for p in model.parameters() if p.requires_grad]


def _batch_ids(block: int, batch: int):
    gen = torch.Generator().manual_seed(zlib.crc32(f"ghost e2e {block} {batch}".encode()))
    return torch.randint(0, BYTE_VOCAB, (batch, block), generator=gen)


def _tied(model) -> bool:
    """A trainable lm-head tied to the input embedding (frozen under LoRA: no tying to
    refuse)."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    return head is not None and head.weight is emb.weight and head.weight.requires_grad


def _untied_copy(model):
    m = copy.deepcopy(model)
    m.config.tie_word_embeddings = False
    head = m.get_output_embeddings()
    head.weight = torch.nn.Parameter(m.get_input_embeddings().weight.detach().clone())
    return m


def opacus_modes(model) -> dict[str, list[str]]:
    """How Opacus' fast gradient clipping (``use_ghost_clipping=True``) serves each
    trainable module type of ``model``: {"ghost": norm samplers, "hooks": instantiated
    per-sample gradients by its grad samplers, "functorch": by its functorch fallback}
    (type names, sorted; empty lists left out). Opacus must be installed."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping as GSM

    modes: dict[str, set] = {"ghost": set(), "hooks": set(), "functorch": set()}
    for m in model.modules():
        if not any(p.requires_grad for p in m.parameters(recurse=False)):
            continue
        kind = (
            "ghost"
            if type(m) in GSM.NORM_SAMPLERS
            else "hooks"
            if type(m) in GSM.GRAD_SAMPLERS
            else "functorch"
        )
        modes[kind].add(type(m).__name__)
    return {k: sorted(v) for k, v in modes.items() if v}


def _opacus_step(model, batch: int, ids, *, sigma: float, clip: float):
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

    gsm = GradSampleModuleFastGradientClipping(
        CausalLMLogits(model, explicit_positions=True),
        batch_first=True,
        loss_reduction="mean",
        max_grad_norm=clip,
        use_ghost_clipping=True,
    )
    opt = DPOptimizerFastGradientClipping(
        torch.optim.AdamW(trainable(gsm), lr=LR, weight_decay=WEIGHT_DECAY),
        noise_multiplier=sigma,
        max_grad_norm=clip,
        expected_batch_size=batch,
        loss_reduction="mean",
    )

    def step():
        opt.zero_grad(set_to_none=True)
        losses = token_loss(gsm(ids), ids)
        DPTensorFastGradientClipping(gsm, opt, losses, "mean").backward()
        opt.step()

    run = _quiet(step)
    run.optimizer = opt
    return run


def e2e_candidates(
    block: int,
    batch: int,
    device,
    *,
    sigma: float = 1.0,
    clip: float = 1.0,
    model_kw: dict | None = None,
    opacus: bool = True,
    model: str = "gpt2",
) -> tuple[list[Candidate], list[str], int]:
    """(candidates, notes, trainable parameter count) for one DP step of
    ``build_model(model, block, **model_kw)`` (default: the default GPT-2) on random ids
    ``[batch, block]`` (the same ids for every model).

    Each candidate owns a deep copy of the same initial model (its ``.model`` attribute)
    and its optimizer (``.optimizer``, over the trainable parameters only: the LoRA
    adapters of a LoRA model). The Opacus candidate is probed with one step at build time; when
    Opacus refuses the model the refusal goes to the notes (and, for tied weights, an
    untied copy is used instead; see the module docstring)."""
    device = torch.device(device)
    base = _seeded_model(model, block, model_kw).to(device)
    ids = _batch_ids(block, batch).to(device)
    n_params = sum(p.numel() for p in trainable(base))
    title = MODEL_PROSE.get(model, model)
    cands, notes = [], []
    if is_lora(model):
        cfg = base.peft_config["default"]
        share = n_params / sum(p.numel() for p in base.parameters())
        notes.append(  # (the same for every block: a note once per model)
            f"{MODEL_TITLES[model]}: peft LoRA r {cfg.r}, alpha {cfg.lora_alpha:g}, dropout "
            f"{cfg.lora_dropout:g} on {', '.join(sorted(cfg.target_modules))}: {n_params:,} "
            f"trainable parameters (~{share:.0%} of the model; every optimizer holds only "
            "these, the base is frozen)"
        )

    net = CausalLMLogits(copy.deepcopy(base))
    adamw = torch.optim.AdamW(trainable(net), lr=LR, weight_decay=WEIGHT_DECAY)

    def nonprivate():
        adamw.zero_grad(set_to_none=True)
        token_loss(net(ids), ids).mean().backward()
        adamw.step()

    cands.append(Candidate("floor", "nonprivate", _quiet(nonprivate)))
    cands[-1].model, cands[-1].optimizer = net, adamw

    def dp_opt(model):
        return dpkern.DPAdamW(
            trainable(model),
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            max_grad_norm=clip,
            noise_multiplier=sigma,
            expected_batch_size=batch,
            seed=KEY,
        )

    from dpkern.ghost import GhostClipping

    g_net = CausalLMLogits(copy.deepcopy(base))
    g_opt = dp_opt(g_net)
    # hooks live as long as the candidate; the one-time first-step check is timed apart
    ghost = GhostClipping(g_net, g_opt, verify="off").attach()

    def ghost_step():
        ghost.backward(token_loss(g_net(ids), ids))
        g_opt.step()

    cands.append(Candidate("dpkern", "ghost", _quiet(ghost_step)))
    cands[-1].model, cands[-1].optimizer = g_net, g_opt

    gg_net = CausalLMLogits(copy.deepcopy(base))
    gg_opt = dp_opt(gg_net)
    ghost_gram = GhostClipping(gg_net, gg_opt, verify="off", keep_bytes=0).attach()

    def ghost_gram_step():
        ghost_gram.backward(token_loss(gg_net(ids), ids))
        gg_opt.step()

    cands.append(Candidate("dpkern", "ghost-gram", _quiet(ghost_gram_step)))
    cands[-1].model, cands[-1].optimizer = gg_net, gg_opt

    from dpkern.grad_sample import compute_grad_sample

    p_net = CausalLMLogits(copy.deepcopy(base))
    p_opt = dp_opt(p_net)

    def per_sample_step():
        compute_grad_sample(p_net, sample_loss, ids, ids)
        p_opt.step()

    cands.append(Candidate("dpkern", "per_sample", _quiet(per_sample_step)))
    cands[-1].model, cands[-1].optimizer = p_net, p_opt

    if opacus:
        try:
            import opacus as _opacus  # noqa: F401
        except ImportError:
            notes.append("Opacus not installed: no Opacus candidate")
            return cands, notes, n_params
        modes = opacus_modes(base)
        what = {
            "ghost": "ghost norms",
            "hooks": "per-sample gradients by its hooks",
            "functorch": "per-sample gradients by its functorch fallback",
        }
        notes.append(
            f"Opacus on the {title}: "
            + "; ".join(f"{what[k]} for {', '.join(v)}" for k, v in modes.items())
        )
        variants = [("opacus", lambda: copy.deepcopy(base))]
        if _tied(base):
            variants.append(("opacus-untied", lambda: _untied_copy(base)))
        for variant, make in variants:
            m = make()
            try:
                step = _opacus_step(m, batch, ids, sigma=sigma, clip=clip)
                step()  # probe: Opacus raises in its hooks on models it cannot serve
            except (NotImplementedError, ValueError, RuntimeError) as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                notes.append(
                    f"Opacus fast gradient clipping ({variant}) refused the "
                    f"{title}: {type(exc).__name__}: {first}"
                )
                if "tying" not in first:
                    break  # an untied copy would not help
                continue
            if variant == "opacus-untied":
                notes.append(
                    f"baseline:opacus-untied runs on a copy of the {title} with an "
                    f"untied lm-head (+{base.get_output_embeddings().weight.numel()} "
                    "parameters; the same FLOPs)"
                )
            cands.append(Candidate("baseline", variant, step))
            cands[-1].model, cands[-1].optimizer = m, step.optimizer
            break
    return cands, notes, n_params


def verify_cost(
    block: int,
    batch: int,
    device,
    *,
    sigma: float = 1.0,
    clip: float = 1.0,
    model_kw: dict | None = None,
    model: str = "gpt2",
) -> dict:
    """The one-time cost of ghost clipping's first-step check (``verify="first"``) on the
    e2e workload: one ghost DP step of a fresh copy of the same model and batch.

    Returns: {"verify_s": the check's wall time (``GhostClipping.verify_seconds``),
    "first_step_s": that whole first step (check included)}."""
    from dpkern.ghost import GhostClipping

    device = torch.device(device)
    net = CausalLMLogits(_seeded_model(model, block, model_kw).to(device))
    ids = _batch_ids(block, batch).to(device)
    opt = dpkern.DPAdamW(
        trainable(net),
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=clip,
        noise_multiplier=sigma,
        expected_batch_size=batch,
        seed=KEY,
    )
    with GhostClipping(net, opt) as ghost:

        def step():
            ghost.backward(token_loss(net(ids), ids))
            opt.step()

        synchronize(device)
        t0 = time.perf_counter()
        _quiet(step)()
        synchronize(device)
        first = time.perf_counter() - t0
    if not ghost.verified:
        raise AssertionError("ghost bench: the first-step check did not run")
    return {"verify_s": ghost.verify_seconds, "first_step_s": first}


def e2e_row(
    block: int,
    batch: int,
    n_params: int,
    medians: dict[str, float],
    peaks: dict[str, int | None],
    verify: dict | None = None,
    model: str = "gpt2",
) -> dict:
    """One summary row of ``model``: medians (s), ratios to the non-private step, peak
    extra bytes (and the part beyond the non-private step's peak); with ``verify`` (see
    :func:`verify_cost`) the first-step check's seconds and its ratio to the ghost step."""
    base = medians["floor:nonprivate"]
    base_peak = peaks.get("floor:nonprivate")
    row = dict(model=model, block=block, batch=batch, params=n_params)
    for name in E2E_ROLES:
        key = name.split(":")[1].replace("-", "_")
        t = medians.get(name)
        row[f"{key}_s"] = t
        row[f"{key}_ratio"] = t / base if t is not None else None
        pk = peaks.get(name)
        row[f"{key}_peak_bytes"] = pk
        row[f"{key}_peak_over_nonprivate_bytes"] = (
            pk - base_peak if pk is not None and base_peak is not None else None
        )
    v = (verify or {}).get("verify_s")
    row["verify_s"] = v
    row["verify_over_ghost"] = v / row["ghost_s"] if v is not None and row["ghost_s"] else None
    row.update(goals(row))
    return row


def goals(row: dict) -> dict:
    """Issue 16's goals for one e2e row (see :data:`GOAL_GHOST_RATIO`): {
    "goal_ghost_ratio": the bound on ghost / non-private (1.25 full fine-tuning, 1.10
    LoRA), "goal_ghost_met"; "opacus_over_ghost": Opacus' fast gradient clipping step /
    the ghost step (its untied copy where Opacus refuses the tied model), "goal_opacus_met"
    (>= 2); "peak_ratio": the ghost step's peak extra bytes / the non-private step's (the
    memory one step adds on top of the model, its optimizer states and the batch, measured
    in a fresh process on CPU), "goal_peak_met" (<= 1.2)}. A ``*_met`` is None where its
    figure is missing."""
    bound = GOAL_GHOST_RATIO["lora" if is_lora(row.get("model", "gpt2")) else "full"]
    ghost, ratio = row.get("ghost_s"), row.get("ghost_ratio")
    opacus = row.get("opacus_s") if row.get("opacus_s") is not None else row.get("opacus_untied_s")
    over = opacus / ghost if opacus is not None and ghost else None
    gp, npk = row.get("ghost_peak_bytes"), row.get("nonprivate_peak_bytes")
    peak = gp / npk if gp is not None and npk else None

    def met(value, ok):
        return None if value is None else bool(ok(value))

    return {
        "goal_ghost_ratio": bound,
        "goal_ghost_met": met(ratio, lambda r: r <= bound),
        "opacus_over_ghost": over,
        "goal_opacus_met": met(over, lambda r: r >= GOAL_OPACUS_OVER_GHOST),
        "peak_ratio": peak,
        "goal_peak_met": met(peak, lambda r: r <= GOAL_PEAK_RATIO),
    }


# --------------------------------------------------------------------------------------
# Running, tables
# --------------------------------------------------------------------------------------
def measure(
    device="cpu",
    *,
    layers=DEFAULT_LAYERS,
    blocks=DEFAULT_BLOCKS,
    batches=DEFAULT_BATCHES,
    repeats: int = 5,
    warmup: int = 1,
    sigma: float = 1.0,
    clip: float = 1.0,
    memory: bool = True,
    model_kw: dict | None = None,
    models=E2E_MODELS,
    say=lambda *a: None,
) -> dict:
    """Run both measurements; returns {"layers": rows, "e2e": rows, "timings": rows,
    "notes": [str], "elapsed_s"}. ``layers``: LayerCase or 'BxTxDxP' strings;
    ``models``: the e2e models (:data:`E2E_MODELS` names), each on every block and batch;
    ``model_kw``: {model name: its builder's shape arguments} (e.g. tiny models in tests).

    Memory (``memory=True``) is measured after all timings: on CPU in a fresh process
    (:mod:`bench.ghost_memory`: this process's heap after the timings inflates RSS peaks),
    on CUDA in this one. Raises AssertionError when a layer candidate's norms
    disagree with the Gram path, ValueError for an unknown model name."""
    device = torch.device(device)
    started = time.perf_counter()
    cases = [c if isinstance(c, LayerCase) else parse_layer(c) for c in layers]
    model_kw = model_kw or {}
    for model in models:
        if model not in E2E_MODELS:
            raise ValueError(f"unknown e2e model {model!r}: expected one of {E2E_MODELS}")
    timings, notes = [], []
    layer_meds, e2e_meds = [], []
    for case in cases:
        t0 = time.perf_counter()
        cands = layer_candidates(case, device)
        with torch.no_grad():
            check_agree({c.name: c.run() for c in cands}, "dpkern:gram")
        meds = _timed(
            cands,
            repeats,
            device,
            warmup,
            timings,
            dict(kind="layer", B=case.B, T=case.T, d=case.d, p=case.p),
        )
        layer_meds.append((case, meds))
        del cands
        gc.collect()
        say(
            f"layer B={case.B} T={case.T} d={case.d} p={case.p} (rule: {case.rule})  "
            + _fmt(meds)
            + f"  [{time.perf_counter() - t0:.0f}s]"
        )
    for model in models:
        kw = model_kw.get(model)
        for block in blocks:
            for batch in batches:
                t0 = time.perf_counter()
                cands, nts, n_params = e2e_candidates(
                    block, batch, device, sigma=sigma, clip=clip, model_kw=kw, model=model
                )
                notes += [n for n in nts if n not in notes]
                meds = _timed(
                    cands,
                    repeats,
                    device,
                    warmup,
                    timings,
                    dict(kind="e2e", model=model, block=block, B=batch),
                )
                del cands
                gc.collect()
                cost = verify_cost(
                    block, batch, device, sigma=sigma, clip=clip, model_kw=kw, model=model
                )
                e2e_meds.append((model, block, batch, n_params, meds, cost))
                gc.collect()
                say(
                    f"e2e {model} block={block} B={batch}  "
                    + _fmt(meds)
                    + f"  first-step check={cost['verify_s'] * 1e3:.3g}ms"
                    + f"  [{time.perf_counter() - t0:.0f}s]"
                )

    layer_peaks = [{} for _ in layer_meds]
    e2e_peaks = [{} for _ in e2e_meds]
    if memory:
        from .ghost_memory import peaks

        layer_peaks, e2e_peaks, note = peaks(
            [c for c, _ in layer_meds],
            [(mo, b, n) for mo, b, n, *_ in e2e_meds],
            device,
            sigma=sigma,
            clip=clip,
            model_kw=model_kw,
        )
        if note:
            notes.append(note)
        say(f"ghost: peak memory measured [{time.perf_counter() - started:.0f}s so far]")
    peak_of = {("layer", c.B, c.T, c.d, c.p): pk for (c, _), pk in zip(layer_meds, layer_peaks)}
    peak_of.update({("e2e", mo, b, n): pk for (mo, b, n, *_), pk in zip(e2e_meds, e2e_peaks)})
    for t in timings:
        key = (
            (t["kind"], t["B"], t["T"], t["d"], t["p"])
            if t["kind"] == "layer"
            else (t["kind"], t["model"], t["block"], t["B"])
        )
        t["peak_extra_bytes"] = peak_of[key].get(t["candidate"])
    return {
        "layers": [layer_rows(c, m, pk) for (c, m), pk in zip(layer_meds, layer_peaks)],
        "e2e": [
            e2e_row(b, n, np_, m, pk, v, model=mo)
            for (mo, b, n, np_, m, v), pk in zip(e2e_meds, e2e_peaks)
        ],
        "timings": timings,
        "notes": notes,
        "elapsed_s": time.perf_counter() - started,
    }


def _timed(cands, repeats, device, warmup, timings, tags) -> dict[str, float]:
    times = time_alternating(cands, repeats, device, warmup=warmup)
    meds = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        timings.append(
            dict(tags, candidate=k, median_s=meds[k], min_s=min(v), max_s=max(v), repeats=len(v))
        )
    return meds


def _peaks(cands, device) -> dict[str, int | None]:
    time_alternating(cands, 0, device, warmup=1)  # lazily created states exist before
    out = {c.name: peak_extra_bytes(c, device) for c in cands}
    del cands
    gc.collect()
    return out


def _fmt(meds) -> str:
    return "  ".join(f"{k}={v * 1e3:.3g}ms" for k, v in meds.items())


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
        "Issue 16 goals on this run: ghost step / non-private step ≤ "
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


def main(argv=None) -> dict:
    """``python -m bench.ghost``: the ghost part alone; prints the tables, writes the files
    under ``--out`` and returns the results (with "machine" and "command" added)."""
    ap = argparse.ArgumentParser(prog="python -m bench.ghost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--layers",
        nargs="*",
        default=list(DEFAULT_LAYERS),
        help="Linear shapes BxTxDxP (default: %(default)s; none: no per-layer table)",
    )
    ap.add_argument("--blocks", nargs="+", type=int, default=list(DEFAULT_BLOCKS))
    ap.add_argument("--batches", nargs="+", type=int, default=list(DEFAULT_BATCHES))
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
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quiet", action="store_true")
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
    say(
        f"# dpkern ghost bench on {info['cpu']} ({info['cores']} cores, torch threads "
        f"{info['torch_threads']}), load average {info['loadavg'][0]:.1f}"
    )
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
        f"{info['loadavg_end']:.1f}; results in {out})"
    )
    return res


if __name__ == "__main__":
    main()
