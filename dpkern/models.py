"""Causal language models for ``dpkern finetune``: a small default built in code, or a
local Hugging Face directory (never a download).

The default is a GPT-2-architecture model (Radford et al. 2019, transformers'
``GPT2LMHeadModel``) with a byte-level vocabulary: ids 0..255 are the UTF-8 bytes and
256 is an end-of-text token, so no tokenizer file is needed; ``arch="llama"`` builds a
Llama-style one instead (``LlamaForCausalLM``: RMSNorm, rotary positions, SwiGLU,
grouped-query attention, an untied head) with the same vocabulary and about as many
parameters. Also here: a short greedy sample from a fixed public prompt. LoRA adapters
(peft) live in :mod:`dpkern.lora`, whose names are re-exported here.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .lora import (  # noqa: F401  (re-exported: dpkern.models.add_lora etc.)
    LORA_BASE_DIR,
    LORA_TARGETS,
    adapter_base,
    adapter_config,
    add_lora,
    base_of,
    base_state_dict,
    is_adapter_dir,
    load_lora,
    lora_config,
    lora_targets,
)


#: Byte-level vocabulary: 256 byte values + one end-of-text id.
BYTE_VOCAB = 257
EOT_ID = 256

#: The default model's shape (about 0.44 M parameters at block 64): small enough that the
#: default private run takes a few minutes on 2 CPU cores.
DEFAULT_SHAPE = {"n_embd": 128, "n_layer": 2, "n_head": 4}

#: The built-in architectures (``dpkern finetune --arch``).
ARCHS = ("gpt2", "llama")


def default_model(
    block_size: int,
    *,
    n_embd: int | None = None,
    n_layer: int | None = None,
    n_head: int | None = None,
    seed: int | None = None,
    arch: str = "gpt2",
) -> nn.Module:
    """A freshly initialised byte-level causal LM (transformers) with context
    ``block_size`` and no dropout (DP noise already regularises; dropout would also make
    the per-sample gradients of torch.func random), eager attention.

    ``arch="gpt2"``: ``GPT2LMHeadModel`` (learned positions, LayerNorm, GELU MLP, head
    tied to the embedding). ``arch="llama"``: ``LlamaForCausalLM`` (rotary positions,
    RMSNorm, SwiGLU MLP of width 2.75 n_embd, ``n_head // 2`` key-value heads, untied
    head): 435 k parameters at the default shape and block 64, GPT-2 438 k.

    Args: block_size >= 2 (the context length); n_embd (divisible by n_head, and giving
    an even head size for llama), n_layer, n_head: None = :data:`DEFAULT_SHAPE` (read at
    call time); seed: initialise reproducibly with torch.manual_seed(seed) when given;
    arch: one of :data:`ARCHS`.
    Raises: ValueError for an invalid shape or architecture."""
    n_embd = DEFAULT_SHAPE["n_embd"] if n_embd is None else n_embd
    n_layer = DEFAULT_SHAPE["n_layer"] if n_layer is None else n_layer
    n_head = DEFAULT_SHAPE["n_head"] if n_head is None else n_head
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}: expected one of {', '.join(ARCHS)}")
    if block_size < 2 or n_layer < 1 or n_head < 1 or n_embd < 1 or n_embd % n_head:
        raise ValueError(
            f"invalid model shape: block_size={block_size}, n_embd={n_embd}, "
            f"n_layer={n_layer}, n_head={n_head} (n_embd must divide by n_head)"
        )
    if arch == "llama":
        return _default_llama(block_size, n_embd, n_layer, n_head, seed)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=BYTE_VOCAB,
        n_positions=block_size,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=EOT_ID,
        eos_token_id=EOT_ID,
        attn_implementation="eager",
    )  # see load_model
    if seed is not None:
        torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def _default_llama(block_size: int, n_embd: int, n_layer: int, n_head: int, seed) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (n_embd // n_head) % 2:
        raise ValueError(
            f"invalid model shape: head size {n_embd // n_head} (n_embd={n_embd} / "
            f"n_head={n_head}) must be even for rotary positions"
        )
    config = LlamaConfig(
        vocab_size=BYTE_VOCAB,
        hidden_size=n_embd,
        intermediate_size=max(1, round(2.75 * n_embd)),
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=max(1, n_head // 2) if n_head % 2 == 0 else n_head,
        max_position_embeddings=block_size,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        bos_token_id=EOT_ID,
        eos_token_id=EOT_ID,
        attn_implementation="eager",
    )
    if seed is not None:
        torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def enable_checkpointing(model: nn.Module) -> None:
    """Activation (gradient) checkpointing with ``use_reentrant=False`` (the blocks'
    activations are recomputed in the backward). Raises ValueError for a model that does
    not support it."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    kw = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:  # (transformers >= 5.x; gradient_checkpointing_enable before)
        enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


# -- a greedy sample ---------------------------------------------------------------------------


#: The fixed public prompt of the summary's sample (never taken from the training data).
SAMPLE_PROMPT = "The Python "
SAMPLE_TOKENS = 40


def generate_sample(model, tokenizer=None, *, prompt: str = SAMPLE_PROMPT, new_tokens=None):
    """Greedy continuation (``model.generate``, no sampling) of the public ``prompt``:
    at most ``new_tokens`` (default :data:`SAMPLE_TOKENS`) new tokens, fewer where the
    context length ends first (the prompt is cut to half of it). Byte-level ids (no
    ``tokenizer``) are decoded as UTF-8 with ``errors="replace"``. Returns prompt +
    continuation."""
    new_tokens = SAMPLE_TOKENS if new_tokens is None else new_tokens
    device = next(model.parameters()).device
    if tokenizer is None:
        ids = list(prompt.encode("utf-8"))
    else:
        ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ctx = context_length(model)
    if ctx is not None:
        ids = ids[: max(1, ctx // 2)]
        new_tokens = max(0, min(new_tokens, ctx - len(ids)))
    x = torch.tensor([ids], dtype=torch.long, device=device)
    if new_tokens == 0:
        return _decode(ids, tokenizer)
    cfg = model.config
    eos = getattr(cfg, "eos_token_id", None)
    pad = getattr(cfg, "pad_token_id", None)
    pad = pad if pad is not None else (eos if isinstance(eos, int) else 0)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                do_sample=False,
                num_beams=1,
                pad_token_id=pad,
                use_cache=True,
            )
    finally:
        model.train(was_training)
    return _decode(out[0].tolist(), tokenizer)


def _decode(ids: list[int], tokenizer) -> str:
    if tokenizer is None:
        return bytes(t for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")
    return tokenizer.decode(ids, skip_special_tokens=True)


def load_model(path: str | Path, attn_implementation: str | None = "eager"):
    """Load a local Hugging Face causal LM directory, offline.

    ``attn_implementation="eager"`` (default) suits per-sample gradients with torch.func:
    vmap has no batching rule for the fused CPU attention kernel (it falls back to a slow
    per-sample loop with a warning). None keeps the model's own choice.

    A LoRA adapter directory (:func:`is_adapter_dir`: a ``dpkern finetune --lora`` run, or
    any peft ``save_pretrained``) is the model it trained: its base (:func:`adapter_base`)
    with the adapter merged into the weights (peft's ``merge_and_unload``), a plain model
    of the base's class; the tokenizer is the adapter directory's, else the base's.

    Returns: (model, tokenizer or None): the model from
    ``AutoModelForCausalLM.from_pretrained(path, local_files_only=True)``; the tokenizer
    from ``AutoTokenizer`` when the directory has one (else None: byte-level ids are used,
    which needs ``vocab_size >= 256``).
    Raises: ValueError with a one-line reason when ``path`` is not a directory or holds
    no loadable causal LM (or no loadable LoRA adapter and base)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory")
    if is_adapter_dir(path):
        return _load_merged(path, attn_implementation)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json: not a Hugging Face model directory")
    try:
        kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kw)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path} is not a loadable causal language model: {first}") from None
    tokenizer = _load_tokenizer(path)
    if tokenizer is None and model.config.vocab_size < 256:
        raise ValueError(
            f"{path} has no tokenizer and vocab_size={model.config.vocab_size} < 256, "
            "so byte-level ids do not fit"
        )
    return model, tokenizer


def _load_tokenizer(path: Path):
    """``AutoTokenizer`` of ``path`` when it has tokenizer files, else None."""
    from transformers import AutoTokenizer

    if not any(
        (path / f).is_file()
        for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    ):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path}: tokenizer files present but unloadable: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}"
        ) from None


def _load_merged(path: Path, attn_implementation: str | None):
    """:func:`load_model` of a LoRA adapter directory: the base with the adapter merged."""
    model, tokenizer = load_model(adapter_base(path), attn_implementation)
    try:
        merged = load_lora(model, path, trainable=False).merge_and_unload()
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{path}: the LoRA adapter does not load: {first}") from None
    merged.requires_grad_(True)  # (peft froze the base: trainable, as any loaded model)
    return merged, _load_tokenizer(path) or tokenizer


def context_length(model: nn.Module) -> int | None:
    """The model's maximum sequence length from its config (n_positions /
    max_position_embeddings), or None when the config does not say."""
    cfg = model.config
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# -- the language-modelling objective, shared by finetune and compare ----------------------
class CausalLMLogits(torch.nn.Module):
    """``input_ids [B, T] -> logits [B, T, V]`` of a Hugging Face causal LM.

    ``explicit_positions=True`` passes ``position_ids`` of shape [B, T]: models otherwise
    build them as [1, T], and Opacus' hooks would take that 1 for the batch dimension of
    the position embedding (wrong per-sample gradients)."""

    def __init__(self, model, explicit_positions: bool = False):
        super().__init__()
        self.model = model
        self.explicit_positions = explicit_positions

    def forward(self, input_ids):
        kw = {}
        if self.explicit_positions:
            B, T = input_ids.shape
            kw["position_ids"] = torch.arange(T, device=input_ids.device).repeat(B, 1)
        return self.model(input_ids=input_ids, use_cache=False, **kw).logits


def token_loss(logits, ids):
    """Mean next-token cross-entropy of each sample: float32 ``[B]``."""
    import torch.nn.functional as F

    lg = logits[:, :-1].float()
    ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return ce.view(ids.shape[0], -1).mean(1)


def per_sample_causal_lm_loss(
    logits,
    labels,
    *,
    normalizer: float = 1.0,
    attention_mask=None,
    ignore_index: int = -100,
):
    """Per-sample next-token cross-entropy of a causal LM, one loss per sample that
    depends on that sample alone: the DP-SGD per-sample loss (never averaged over the batch).

    ``loss[i] = sum over valid t >= 1 of CE(logits[i, t - 1], labels[i, t]) / normalizer``,
    a target position t being valid when ``labels[i, t] != ignore_index`` and, when
    ``attention_mask`` is given, ``attention_mask[i, t] != 0``. Labels are unshifted (the
    Hugging Face convention: the position-t logits predict token t + 1; the shift is done
    here).

    The divisor is a constant: a public number that depends on no sample, e.g. 1 (the
    sum, the default) or the block size the data is tokenised to (a mean-token scale).
    Dividing by the realised number of valid tokens of the batch (what
    ``model(labels=...).loss`` and the Trainer's ``num_items_in_batch`` do) would make
    each sample's loss, and so its gradient and its clip factor, depend on the other
    samples' lengths.

    Args:
        logits: float ``[B, T, V]`` (any float dtype; the cross-entropy is computed in
            float32).
        labels: integer ``[B, T]`` target token ids, ``ignore_index`` where no loss is
            taken (padding, prompt tokens).
        normalizer: the constant divisor (a finite float > 0, dimensionless).
        attention_mask: optional ``[B, T]`` (0 = padding): masked targets take no loss.
        ignore_index: the label id of positions without a loss (default -100, as
            ``torch.nn.CrossEntropyLoss`` and Hugging Face).
    Returns:
        float32 ``[B]`` (0 for a sample without a valid target; ``[0]`` when B = 0).
    Raises:
        ValueError: mismatched shapes, or ``normalizer`` not a finite number > 0."""
    import math

    import torch.nn.functional as F

    if (
        isinstance(normalizer, bool)
        or not isinstance(normalizer, (int, float))
        or not math.isfinite(normalizer)
        or normalizer <= 0
    ):
        raise ValueError(f"invalid normalizer={normalizer!r}: expected a finite number > 0")
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits [B, T, V] and labels [B, T], got {tuple(logits.shape)} "
            f"and {tuple(labels.shape)}"
        )
    if attention_mask is not None and attention_mask.shape != labels.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, labels {tuple(labels.shape)}"
        )
    B, T = labels.shape
    if T < 2:
        return logits.new_zeros(B, dtype=torch.float32) + 0.0 * logits.float().sum()
    target = labels[:, 1:]
    if attention_mask is not None:
        target = target.masked_fill(attention_mask[:, 1:] == 0, ignore_index)
    ce = F.cross_entropy(
        logits[:, :-1].float().transpose(1, 2),
        target.long(),
        ignore_index=ignore_index,
        reduction="none",
    )  # [B, T - 1], 0 at ignored targets
    return ce.sum(1) / float(normalizer)


def sample_loss(logits, ids):
    """Sum of the per-sample mean next-token losses (the loss torch.func differentiates per sample)."""
    return token_loss(logits, ids).sum()


def evaluate(net, blocks, batch: int, device) -> float:
    """Mean next-token loss (nats/token) of ``blocks`` [N, T]."""
    was_training = net.training
    net.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, blocks.shape[0], batch):
            ids = blocks[i : i + batch].to(device)
            total += float(token_loss(net(ids), ids).sum())
            count += ids.shape[0]
    net.train(was_training)
    return total / count
