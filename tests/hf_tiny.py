"""Tiny Hugging Face models built from configs in code (no downloads), for the ghost
clipping model matrix (tests/test_ghost_models.py).

Every config: hidden 16, 1 layer, 2 heads, vocab 64, every dropout probability 0 and
``attn_implementation="eager"``. The models stay in train mode (``model.train()``): with
dropout 0 the forward is deterministic, and train mode is what DP training runs (eval mode
could hide a train-only code path). Weights are re-drawn with a fixed seed (std 0.2, norm
weights around 1) so that no gradient is trivially zero (HF inits biases, norm weights and
LoRA-B at constants).

``build(name)`` returns a :class:`Tiny`: the model, its task (``"causal"``, ``"cls"`` or
``"seq2seq"``) and its padding token. ``None`` when transformers lacks the class.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

V, D, FF, H = 64, 16, 32, 2
NUM_LABELS = 3
MAX_POS = 32


@dataclass
class Tiny:
    name: str
    model: nn.Module
    task: str  # "causal" | "cls" | "seq2seq"
    pad: int  # padding token id (never drawn as a real token)


def _llama_like(cls_name, **extra):
    def make(t):
        kw = dict(
            vocab_size=V,
            hidden_size=D,
            intermediate_size=FF,
            num_hidden_layers=1,
            num_attention_heads=H,
            num_key_value_heads=H,
            max_position_embeddings=MAX_POS,
            attention_dropout=0.0,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        )
        cfg = getattr(t, cls_name.replace("ForCausalLM", "Config"))(**{**kw, **extra})
        return getattr(t, cls_name), cfg

    return make


def _gpt2(t):
    return t.GPT2LMHeadModel, t.GPT2Config(
        vocab_size=V,
        n_positions=MAX_POS,
        n_embd=D,
        n_layer=1,
        n_head=H,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _neox(t):
    return t.GPTNeoXForCausalLM, t.GPTNeoXConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=FF,
        num_hidden_layers=1,
        num_attention_heads=H,
        max_position_embeddings=MAX_POS,
        rotary_pct=0.5,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _opt(t):
    return t.OPTForCausalLM, t.OPTConfig(
        vocab_size=V,
        hidden_size=D,
        ffn_dim=FF,
        num_hidden_layers=1,
        num_attention_heads=H,
        word_embed_proj_dim=D,
        max_position_embeddings=MAX_POS,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    )


def _phi(t):
    return t.PhiForCausalLM, t.PhiConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=FF,
        num_hidden_layers=1,
        num_attention_heads=H,
        max_position_embeddings=MAX_POS,
        partial_rotary_factor=0.5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _falcon(t):
    return t.FalconForCausalLM, t.FalconConfig(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=1,
        num_attention_heads=H,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=MAX_POS,
    )


def _bloom(t):
    return t.BloomForCausalLM, t.BloomConfig(
        vocab_size=V,
        hidden_size=D,
        n_layer=1,
        n_head=H,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _gptj(t):
    return t.GPTJForCausalLM, t.GPTJConfig(
        vocab_size=V,
        n_positions=MAX_POS,
        n_embd=D,
        n_layer=1,
        n_head=H,
        rotary_dim=4,
        n_inner=FF,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def _biogpt(t):
    return t.BioGptForCausalLM, t.BioGptConfig(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=1,
        num_attention_heads=H,
        intermediate_size=FF,
        max_position_embeddings=MAX_POS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )


def _bert(t):
    return t.BertForSequenceClassification, t.BertConfig(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=1,
        num_attention_heads=H,
        intermediate_size=FF,
        max_position_embeddings=MAX_POS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0,
        num_labels=NUM_LABELS,
        pad_token_id=0,
    )


def _roberta(t):
    return t.RobertaForSequenceClassification, t.RobertaConfig(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=1,
        num_attention_heads=H,
        intermediate_size=FF,
        max_position_embeddings=MAX_POS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0,
        num_labels=NUM_LABELS,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )


def _distilbert(t):
    return t.DistilBertForSequenceClassification, t.DistilBertConfig(
        vocab_size=V,
        dim=D,
        n_layers=1,
        n_heads=H,
        hidden_dim=FF,
        max_position_embeddings=MAX_POS,
        dropout=0.0,
        attention_dropout=0.0,
        seq_classif_dropout=0.0,
        num_labels=NUM_LABELS,
        pad_token_id=0,
    )


def _t5(t):
    return t.T5ForConditionalGeneration, t.T5Config(
        vocab_size=V,
        d_model=D,
        d_kv=8,
        d_ff=FF,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=H,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


def _bart(t):
    return t.BartForConditionalGeneration, t.BartConfig(
        vocab_size=V,
        d_model=D,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=H,
        decoder_attention_heads=H,
        encoder_ffn_dim=FF,
        decoder_ffn_dim=FF,
        max_position_embeddings=MAX_POS,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        classifier_dropout=0.0,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )


CAUSAL = {
    "gpt2": _gpt2,
    "llama": _llama_like("LlamaForCausalLM"),
    "mistral": _llama_like("MistralForCausalLM", sliding_window=None),
    "qwen2": _llama_like("Qwen2ForCausalLM", num_key_value_heads=1),  # GQA
    "gemma": _llama_like("GemmaForCausalLM", head_dim=8, tie_word_embeddings=True),
    "gpt_neox": _neox,
    "opt": _opt,
    "phi": _phi,
    "falcon": _falcon,
    "bloom": _bloom,
    "gptj": _gptj,
    "biogpt": _biogpt,
}
CLS = {"bert": _bert, "roberta": _roberta, "distilbert": _distilbert}
SEQ2SEQ = {"t5": _t5, "bart": _bart}
TASK = {
    **{k: "causal" for k in CAUSAL},
    **{k: "cls" for k in CLS},
    **{k: "seq2seq" for k in SEQ2SEQ},
}
FACTORIES = {**CAUSAL, **CLS, **SEQ2SEQ}


def randomize(model: nn.Module, seed: int = 0) -> None:
    """Re-draw every parameter (std 0.2; 1-D norm-like weights 1 + 0.2 N)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.2
            if (
                p.dim() == 1
                and ("norm" in n or "ln" in n or "layernorm" in n.lower())
                and n.endswith("weight")
            ):
                r += 1.0
            p.copy_(r.to(p.dtype))


def build(name: str, seed: int = 0) -> Tiny | None:
    """The tiny ``name`` model in train mode (fp32), or None when transformers lacks it."""
    import transformers as t

    try:
        cls, cfg = FACTORIES[name](t)
    except AttributeError:
        return None
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg)
    randomize(model, seed)
    model.train()
    return Tiny(
        name, model, TASK[name], int(cfg.pad_token_id if cfg.pad_token_id is not None else 0)
    )


def lora_llama(seed: int = 0) -> Tiny | None:
    """Llama with PEFT LoRA (r = 4) on q/v/o/gate projections; only LoRA is trainable
    (base weights frozen, LoRA-B random instead of zero). None without peft."""
    try:
        import peft
    except ImportError:
        return None
    base = build("llama", seed)
    cfg = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        init_lora_weights=False,
        target_modules=["q_proj", "v_proj", "o_proj", "gate_proj"],
    )
    model = peft.get_peft_model(base.model, cfg)
    model.train()
    return Tiny("lora_llama", model, "causal", base.pad)


def collate(features: list[dict]) -> dict:
    """Right padding with id 0 to the longest example of the batch (dynamic padding): the
    Trainer tests' collator. ``input_ids`` [B, T] long, ``attention_mask`` 1 on real
    tokens, ``labels`` the ids with padding set to -100; other fields are dropped."""
    T = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), T, dtype=torch.long)
    mask = torch.zeros(len(features), T, dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = f["input_ids"]
        mask[i, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
