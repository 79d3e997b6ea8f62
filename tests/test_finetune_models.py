"""``dpkern finetune --model DIR`` on Hugging Face causal LMs other than GPT-2: ghost
clipping whenever it is exact (checked before training on random token ids), per-sample
gradients otherwise with a one-line note, and never a traceback."""

from __future__ import annotations

import pytest

import hf_tiny
from dpkern.ghost import rules
from test_finetune import TINY, finetune

transformers = pytest.importorskip("transformers")

V = 300  # >= 256: the byte tokenizer needs it


def _config(name):
    tf = transformers
    common = {
        "vocab_size": V,
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 64,
    }
    return {
        "llama": lambda: tf.LlamaForCausalLM(
            tf.LlamaConfig(**common, intermediate_size=64, num_key_value_heads=1)
        ),
        "opt": lambda: tf.OPTForCausalLM(
            tf.OPTConfig(
                vocab_size=V,
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                ffn_dim=64,
                max_position_embeddings=64,
                word_embed_proj_dim=32,
            )
        ),
        "falcon": lambda: tf.FalconForCausalLM(
            tf.FalconConfig(
                vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2
            )
        ),
        "biogpt": lambda: tf.BioGptForCausalLM(tf.BioGptConfig(**common, intermediate_size=64)),
    }[name]()


def _model_dir(tmp_path, name):
    path = tmp_path / name
    model = _config(name)
    model.config.bos_token_id = model.config.eos_token_id = 0
    model.config.pad_token_id = 0
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("name", ["llama", "opt", "falcon", "biogpt"])
def test_finetune_uses_ghost_clipping_on_hf_causal_lms(name, text_file, tmp_path, capsys):
    src, out = _model_dir(tmp_path, name), tmp_path / "run"
    assert finetune("--model", src, "--data", text_file, "--steps", 2, "--out", out, *TINY) == 0
    captured = capsys.readouterr()
    assert "clipping ghost" in captured.out and "note:" not in captured.err
    assert (out / "metrics.json").exists()


@pytest.mark.parametrize("name", sorted(set(hf_tiny.CAUSAL) - {"llama", "opt", "falcon", "biogpt"}))
def test_finetune_uses_ghost_clipping_on_every_tiny_causal_lm(name, text_file, tmp_path, capsys):
    """The rest of tests/hf_tiny.py's causal LMs (GPT-2, Mistral, Qwen2, Gemma, GPT-NeoX,
    Phi, BLOOM, GPT-J), saved with a byte-sized vocabulary: ghost clipping (checked
    exact before training), no note, no traceback."""
    cls, cfg = hf_tiny.CAUSAL[name](transformers)
    cfg.vocab_size = V
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = 0
    src, out = tmp_path / name, tmp_path / "run"
    cls(cfg).save_pretrained(src)
    assert finetune("--model", src, "--data", text_file, "--steps", 2, "--out", out, *TINY) == 0
    captured = capsys.readouterr()
    assert "clipping ghost" in captured.out and "note:" not in captured.err
    assert (out / "metrics.json").exists()


def test_finetune_falls_back_to_per_sample_with_a_note(text_file, tmp_path, capsys, monkeypatch):
    """A model whose parameters meet an operation without a ghost rule (here: the rules for
    element-wise products removed, so Llama's RMSNorm weights have none) trains with
    per-sample gradients after a one-line note."""
    for f in list(rules.RULES):
        if rules.RULES[f].name == "mul":
            monkeypatch.delitem(rules.RULES, f)
    src, out = _model_dir(tmp_path, "llama"), tmp_path / "run"
    assert finetune("--model", src, "--data", text_file, "--steps", 2, "--out", out, *TINY) == 0
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if "note:" in line]
    assert len(notes) == 1 and "ghost clipping is not exact on this model" in notes[0]
    assert "using --clipping per-sample" in notes[0]
    assert "clipping per-sample" in captured.out


def test_forced_ghost_on_an_uncovered_model_is_a_one_line_error(
    text_file, tmp_path, capsys, monkeypatch
):
    for f in list(rules.RULES):
        if rules.RULES[f].name == "mul":
            monkeypatch.delitem(rules.RULES, f)
    src = _model_dir(tmp_path, "llama")
    assert (
        finetune("--model", src, "--data", text_file, "--steps", 2, "--clipping", "ghost", *TINY)
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--clipping" in err[0] and "not exact" in err[0]
