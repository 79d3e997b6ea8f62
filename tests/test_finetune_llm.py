"""``dpkern finetune`` where LLM practitioners work: the built-in Llama (--arch llama),
LoRA adapters (--lora), bfloat16 weights (--bf16), gradient checkpointing, the first-step
update check (the Opacus-820 trap) and the greedy sample of the summary."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal

import pytest
import torch

import dpkern
from dpkern import models
from dpkern.ghost import GhostClipping
from dpkern.cli.__main__ import main
from dpkern.cli.finetune import add_arguments
from dpkern.cli.finetune import job as ft

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("tiny_default_model")

TINY = ["--block-size", 16, "--batch-size", 16, "--micro-batch-size", 8, "--lr", 1e-2]
TINY += ["--quiet"]


def finetune(*argv):
    return main(["finetune", *map(str, argv)])


def read_metrics(out):
    return json.loads((out / "metrics.json").read_text())


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(map(str, argv)))


def test_llama_arch_uses_exact_ghost_clipping_and_is_fixed_on_resume(text_file, tmp_path, capsys):
    out = tmp_path / "llama"
    argv = ["--data", text_file, "--arch", "llama", "--seed", 1, *TINY]
    assert finetune(*argv, "--steps", 2, "--out", out) == 0
    captured = capsys.readouterr()
    assert "per-sample" not in captured.err  # no fallback note: the probe found it exact
    m = read_metrics(out)
    assert m["arch"] == "llama" and m["clipping"] == "ghost" and m["finished"]
    assert "built-in byte-level Llama" in captured.out
    assert json.loads((out / "run_config.json").read_text())["arch"] == "llama"
    model, tok = models.load_model(out)
    cfg = model.config
    assert tok is None and type(model).__name__ == "LlamaForCausalLM"
    assert cfg.num_key_value_heads < cfg.num_attention_heads and not cfg.tie_word_embeddings
    assert cfg.vocab_size == models.BYTE_VOCAB and cfg.eos_token_id == models.EOT_ID
    assert m["num_parameters"] == m["num_parameters_total"] == model.num_parameters()
    assert isinstance(m["sample"], str) and m["sample"].startswith("The Pyth")
    # the architecture is part of the plan: kept on --resume, a change refused
    assert finetune("--resume", out, "--steps", 3, "--arch", "gpt2", "--quiet") == 2
    assert "--arch: cannot be changed on --resume" in capsys.readouterr().err
    assert finetune("--resume", out, "--steps", 3, "--quiet") == 0
    assert read_metrics(out)["arch"] == "llama" and read_metrics(out)["step"] == 3
    # --arch names the built-in model only
    assert finetune("--data", text_file, "--model", out, "--arch", "llama", *TINY) == 2
    assert "--arch" in capsys.readouterr().err


def test_default_shapes_are_alike():
    shape = {"n_embd": 128, "n_layer": 2, "n_head": 4}  # (the real default's)
    n = {a: models.default_model(64, arch=a, **shape).num_parameters() for a in models.ARCHS}
    assert abs(n["llama"] / n["gpt2"] - 1) < 0.02, n


def test_lora_targets_per_model_type():
    gpt2, llama = (models.default_model(16, arch=a) for a in models.ARCHS)
    assert models.lora_targets(gpt2) == (["c_attn", "c_proj", "c_fc"], "dpkern")
    assert models.lora_targets(llama)[0] == [
        *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    ]
    opt = torch.nn.Linear(2, 2)
    opt.config = argparse.Namespace(model_type="opt")  # a type peft knows
    assert models.lora_targets(opt) == (["q_proj", "v_proj"], "peft")
    opt.config.model_type = "no-such-model"
    with pytest.raises(ValueError, match="'no-such-model'.*gpt2, llama.*opt"):
        models.lora_targets(opt)


def _stop_at_step_2(monkeypatch):
    """SIGTERM after the optimizer's step 2 (the run then checkpoints at that boundary)."""
    real = ft.make_optimizer

    def make(*args, **kwargs):
        opt = real(*args, **kwargs)
        step = opt.step

        def step_then_preempt(*a, **k):
            result = step(*a, **k)
            if opt.dp_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return result

        opt.step = step_then_preempt
        return opt

    monkeypatch.setattr(ft, "make_optimizer", make)
    return real


def test_lora_trains_only_the_adapters_and_resume_equals_the_uninterrupted_run(
    text_file, tmp_path, monkeypatch
):
    from safetensors.torch import load_file

    common = ["--data", text_file, "--lora", 2, "--seed", 3, "--noise-seed", 4, *TINY]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert finetune(*common, "--steps", 4, "--out", full) == 0
    real = _stop_at_step_2(monkeypatch)
    assert finetune(*common, "--steps", 4, "--out", cut) == 143
    assert read_metrics(cut)["step"] == 2
    monkeypatch.setattr(ft, "make_optimizer", real)
    assert finetune("--resume", cut, "--quiet") == 0
    m, m_cut = read_metrics(full), read_metrics(cut)
    assert m_cut["step"] == 4 and m_cut["noise_multiplier"] == m["noise_multiplier"]
    a, b = (load_file(d / "adapter_model.safetensors") for d in (full, cut))
    assert a.keys() == b.keys() and all("lora_" in k for k in a)
    for k in a:  # (ghost clipping's per-step route choice rounds differently)
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    # only the adapters are trained: they alone are counted (norms, noise, its tail) ...
    assert m["num_parameters"] == sum(v.numel() for v in a.values())
    assert m["num_parameters"] < m["num_parameters_total"] / 5 and m["clipping"] == "ghost"
    # ... and the base is saved as initialised (--seed), loadable on its own
    base, _ = models.load_model(full / "base_model")
    init = models.default_model(16, seed=3)
    for (k, v), w in zip(base.state_dict().items(), init.state_dict().values()):
        assert torch.equal(v, w), k
    config = json.loads((full / "adapter_config.json").read_text())
    assert config["r"] == 2 and config["lora_alpha"] == 4 and not (full / "README.md").exists()


def _first_step_norms(*argv):
    """The job's first-step per-sample norms (its ghost clipping, the first-step check
    included) on the first training blocks."""
    job = ft.prepare(parse(*argv))
    assert job.plan.noise_multiplier > 0 and type(job.per_sample).__name__ == "Ghost"
    ids = job.train[:6].to(job.device)
    _, norms = job.per_sample.gc.clipped_sums(models.token_loss(job.net(ids), ids))
    job.per_sample.gc.detach()
    return job, norms.double()


def test_bf16_run_and_its_norms_within_1e2_of_fp32(text_file, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "bf16"
    argv = ["--data", text_file, "--seed", 5, *TINY]
    assert finetune(*argv, "--bf16", "--steps", 2, "--out", out) == 0
    m = read_metrics(out)
    assert m["bf16"] and m["clipping"] == "ghost" and isinstance(m["sample"], str)
    assert {v.dtype for v in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    state = torch.load(out / "trainer_state.pt", weights_only=True)["optimizer"]["state"]
    moments = {v.dtype for st in state.values() for k, v in st.items() if k != "step"}
    assert moments == {torch.float32}  # (Adam's moments, as for fp32 weights)
    assert finetune("--resume", out, "--steps", 3, "--quiet") == 0  # bf16 kept
    assert read_metrics(out)["bf16"] and read_metrics(out)["step"] == 3
    # the first step's per-sample norms: the bf16 model within 1e-2 of the fp32 one
    job16, n16 = _first_step_norms(*argv, "--bf16")
    job32, n32 = _first_step_norms(*argv)
    assert {p.dtype for p in job16.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in job32.model.parameters()} == {torch.float32}
    assert n16.dtype == n32.dtype and (n32 > 0).all()
    torch.testing.assert_close(n16, n32, rtol=1e-2, atol=0)


def test_stochastic_rounding_needs_bf16_and_reaches_the_optimizer(text_file, tmp_path, capsys):
    argv = ["--data", text_file, "--seed", 5, *TINY, "--steps", 1]
    assert finetune(*argv, "--stochastic-rounding") == 2
    assert "--stochastic-rounding: rounds bfloat16 weights: it needs --bf16" in (
        capsys.readouterr().err
    )
    out = tmp_path / "sr"
    assert finetune(*argv, "--bf16", "--stochastic-rounding", "--out", out) == 0
    assert "bfloat16 weights (stochastic rounding)" in capsys.readouterr().out
    m = read_metrics(out)
    assert m["bf16"] and m["stochastic_rounding"]
    assert json.loads((out / "run_config.json").read_text())["stochastic_rounding"] is True
    state = torch.load(out / "trainer_state.pt", weights_only=True)["optimizer"]
    assert state["dp"]["stochastic_rounding"] is True
    job = ft.prepare(parse("--resume", out, "--steps", 2))  # kept on --resume
    assert job.plan.stochastic_rounding and job.optimizer.stochastic_rounding


def test_a_model_the_optimizer_does_not_update_stops_the_run(
    text_file, tmp_path, monkeypatch, capsys
):
    """The Opacus-820 trap: the optimizer holds tensors the model does not use (as after
    moving the model once the optimizer exists), or a step leaves the parameters as they
    were: a one-line error, exit 1, nothing saved (dpkern.integrations.guard)."""
    real = ft.make_optimizer

    def elsewhere(plan, params, *args, **kwargs):
        return real(plan, [torch.nn.Parameter(p.detach().clone()) for p in params], *args, **kwargs)

    out = tmp_path / "run"
    argv = ["--data", text_file, "--steps", 2, "--out", out, *TINY]
    monkeypatch.setattr(ft, "make_optimizer", elsewhere)
    assert finetune(*argv, "--clipping", "per-sample") == 1
    err = capsys.readouterr().err
    assert "moved to another device" in err and not out.exists()

    def undone(*args, **kwargs):
        opt = real(*args, **kwargs)
        step, params = opt.step, [p for g in opt.param_groups for p in g["params"]]

        def step_undone(*a, **k):
            before = [p.detach().clone() for p in params]
            result = step(*a, **k)
            with torch.no_grad():
                for p, b in zip(params, before):
                    p.copy_(b)
            return result

        opt.step = step_undone
        return opt

    monkeypatch.setattr(ft, "make_optimizer", undone)
    assert finetune(*argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did not change in the first step" in err[0] and not out.exists()


@pytest.mark.parametrize("arch", models.ARCHS)
def test_gradient_checkpointing_keeps_ghost_norms_exact(arch):
    """Checkpointed blocks are recomputed in the backward (counted), and the ghost norms
    still equal one-sample-at-a-time autograd's (tests/test_ghost_models.py's helpers)."""
    import hf_tiny
    from test_ghost_models import RTOL, ghost, true_norms

    model = models.default_model(8, arch=arch, seed=0)
    models.enable_checkpointing(model)
    model.train()
    calls = []
    block = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))[0]
    block.mlp.register_forward_pre_hook(lambda *_: calls.append(1))  # (inside the checkpoint)
    tiny = hf_tiny.Tiny(arch, model, "causal", 0)
    g = torch.Generator().manual_seed(0)
    batch = {"ids": torch.randint(0, models.BYTE_VOCAB, (3, 8), generator=g), "mask": None}
    want, _ = true_norms(tiny, batch)
    assert len(calls) == 2 * 3  # a forward and its recomputation per sample
    _, norms, _ = ghost(tiny, batch)
    assert len(calls) >= 2 * 3 + 2  # (and again: the first-step check's own backward)
    torch.testing.assert_close(norms.double(), want, rtol=RTOL, atol=0)


@pytest.mark.parametrize("verify", ["first", "off"])
def test_reentrant_gradient_checkpointing_is_refused_and_nothing_is_updated(verify):
    """transformers' reentrant checkpointing (use_reentrant=True) re-runs each block in a
    nested .backward() that ghost clipping's autograd.grad cannot take part in: a
    ValueError saying to use use_reentrant=False, nothing accumulated or stepped."""
    import hf_tiny

    model = models.default_model(8, arch="llama", seed=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    tiny = hf_tiny.Tiny("llama", model, "causal", 0)
    opt = dpkern.DPSGD(
        model.parameters(),
        lr=0.1,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=3,
        seed=0,
    )
    before = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(0)
    batch = {"ids": torch.randint(0, models.BYTE_VOCAB, (3, 8), generator=g), "mask": None}
    from test_ghost_models import losses_of

    with GhostClipping(model, opt, verify=verify) as gc:
        with pytest.raises(ValueError, match=r"reentrant.*use_reentrant': False"):
            gc.backward(losses_of(tiny, batch))
    with pytest.raises(ValueError, match="no parameter has a grad_sample"):
        opt.step()  # nothing was accumulated: no batch to step on
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_lora_bf16_checkpointed_llama_run_and_its_sample(text_file, tmp_path, capsys):
    out = tmp_path / "all"
    argv = ["--data", text_file, "--arch", "llama", "--lora", 2, "--bf16", "--steps", 2]
    argv += ["--gradient-checkpointing", "--seed", 1, "--out", out]
    assert finetune(*argv, *TINY[:-1]) == 0  # (not --quiet: the summary shows the sample)
    captured = capsys.readouterr()
    m = read_metrics(out)
    assert m["clipping"] == "ghost" and m["gradient_checkpointing"] and m["bf16"]
    assert m["lora"] == 2 and m["arch"] == "llama" and "per-sample" not in captured.err
    assert isinstance(m["sample"], str) and m["sample"].startswith("The Pyth")
    assert f"  sample      {m['sample']!r}" in captured.out
    assert "LoRA r 2 (alpha 4)" in captured.out and "gradient checkpointing" in captured.out
    # per-sample clipping works with checkpointing too (one sample at a time, a note)
    one = tmp_path / "per-sample"
    argv = ["--data", text_file, "--gradient-checkpointing", "--clipping", "per-sample"]
    assert finetune(*argv, "--steps", 1, "--out", one, *TINY) == 0
    assert "one sample at a time" in capsys.readouterr().err
    assert math.isfinite(read_metrics(one)["val_loss_after"])


@pytest.mark.parametrize(
    "argv,option",
    [
        (["--lora", 0], "--lora"),
        (["--lora-alpha", 4], "--lora-alpha"),
        (["--lora", 2, "--lora-dropout", 1], "--lora-dropout"),
        (["--lora", 2, "--lora-alpha", -1], "--lora-alpha"),
    ],
)
def test_bad_lora_options_are_one_line_errors(argv, option, text_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert finetune("--data", text_file, *argv, "--out", out, *TINY) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dpkern finetune: error: {option}:"), err
    assert not out.exists()


def test_a_lora_run_directory_is_a_model_for_a_further_run(text_file, tmp_path, capsys):
    """--model DIR of a --lora run: without --lora, every weight of the model it trained
    (the adapters merged into the base) is fine-tuned; with --lora R, its adapters are
    trained further (rank and alpha kept; another rank or alpha is a one-line error);
    both resume, and every directory loads as a model that generates."""
    lora, full, more = tmp_path / "lora", tmp_path / "full", tmp_path / "more"
    common = ["--data", text_file, "--steps", 2, *TINY]
    assert finetune(*common, "--lora", 2, "--seed", 3, "--out", lora) == 0
    m_lora = read_metrics(lora)
    # the directory is the model it trained: the base with the adapter merged in
    merged, tok = models.load_model(lora)
    assert tok is None and type(merged).__name__ == "GPT2LMHeadModel"
    assert all(p.requires_grad for p in merged.parameters())
    base, _ = models.load_model(lora / "base_model")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = models.load_lora(base, lora, trainable=False)(input_ids=ids).logits
        fresh, _ = models.load_model(lora / "base_model")
        assert not torch.allclose(fresh(input_ids=ids).logits, want)  # (the adapter moved)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
    assert models.generate_sample(merged).startswith("The Pyth")
    # a full fine-tune of that model: it starts where the LoRA run ended
    assert finetune(*common, "--model", lora, "--out", full) == 0
    assert "earlier dpkern finetune run" in capsys.readouterr().err
    m = read_metrics(full)
    assert m["val_loss_before"] == pytest.approx(m_lora["val_loss_after"], rel=1e-5)
    assert m["lora"] is None and m["num_parameters"] == m["num_parameters_total"]
    assert isinstance(m["sample"], str) and (full / "model.safetensors").is_file()
    assert finetune("--resume", full, "--steps", 3, "--quiet") == 0
    assert read_metrics(full)["step"] == 3
    # --lora R with the run's rank: its adapters, trained further on the same base
    assert finetune(*common, "--model", lora, "--lora", 2, "--out", more) == 0
    m = read_metrics(more)
    assert m["val_loss_before"] == pytest.approx(m_lora["val_loss_after"], rel=1e-5)
    assert (m["lora"], m["lora_alpha"]) == (2, 4) and m["num_parameters"] == m_lora[
        "num_parameters"
    ]
    config = json.loads((more / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(lora / "base_model") and config["r"] == 2
    assert not (more / "base_model").exists()  # (the base stays the LoRA run's)
    assert finetune("--resume", more, "--steps", 3, "--quiet") == 0
    assert read_metrics(more)["step"] == 3
    capsys.readouterr()
    peft_model = models.load_lora(models.load_model(lora / "base_model")[0], more, trainable=False)
    assert models.generate_sample(peft_model).startswith("The Pyth")
    assert models.generate_sample(models.load_model(more)[0]).startswith("The Pyth")
    # another rank or alpha would be new adapters: refused, saying what to do
    for argv, option, says in (
        (["--lora", 3], "--lora", "pass --lora 2 to train them further, or leave --lora out"),
        (["--lora", 2, "--lora-alpha", 8], "--lora-alpha", "trained with alpha 4"),
    ):
        out = tmp_path / "never"
        assert finetune(*common, "--model", lora, *argv, "--out", out) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"dpkern finetune: error: {option}:"), err
        assert says in err[0] and not out.exists()


def test_a_moved_lora_run_still_loads_and_a_missing_base_is_one_line(text_file, tmp_path, capsys):
    import shutil

    lora = tmp_path / "lora"
    argv = ["--data", text_file, "--steps", 1, *TINY]
    assert finetune(*argv, "--lora", 2, "--out", lora) == 0
    moved = shutil.move(lora, tmp_path / "moved")  # its base_model/ moves with it
    assert type(models.load_model(moved)[0]).__name__ == "GPT2LMHeadModel"
    shutil.rmtree(tmp_path / "moved" / "base_model")  # a base that is nowhere local
    out = tmp_path / "never"
    assert finetune(*argv, "--model", moved, "--out", out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dpkern finetune: error: --model:"), err
    assert "base_model_name_or_path" in err[0] and "not a local model directory" in err[0]
    assert not out.exists()
