"""Model builders of the ghost bench (:mod:`bench.ghost`): the end-to-end models by name
(the default GPT-2, the Llama-style model, and both wrapped by peft LoRA adapters), their
seeded initial weights and random token blocks shared by every candidate, the trainable
parameters, tied-weight detection and an untied copy, and the Opacus fast-gradient-clipping
helpers (which module types Opacus serves by ghost norms, hooks or functorch, and one
Opacus DP step). Also :func:`_quiet`, which runs a step with autograd on and Opacus'
warnings off."""

from __future__ import annotations

import copy
import warnings
import zlib

import torch

from dpkern.models import BYTE_VOCAB, CausalLMLogits, default_model, token_loss

from .harness import LR, WEIGHT_DECAY

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
#: The Llama-style model's shape (:func:`llama_model`'s defaults).
LLAMA_SHAPE = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 344,
}
OPACUS_QUIET = (
    "Full backward hook is firing",
    "Using a non-full backward hook",
    "Secure RNG turned off",
    "Optimal order is the largest alpha",
)


def _quiet(fn):
    """``fn`` with autograd on (the report times under no_grad) and Opacus' chatter off."""

    def run():
        with torch.enable_grad(), warnings.catch_warnings():
            for msg in OPACUS_QUIET:
                warnings.filterwarnings("ignore", message=msg)
            return fn()

    return run


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
