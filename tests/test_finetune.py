"""End-to-end tests of ``dpkern finetune`` (in-process, tiny model, tiny fresh text)."""

from __future__ import annotations

import json

import pytest
import torch

from dpkern import backends, data, models
from dpkern.cli.__main__ import main


pytestmark = pytest.mark.usefixtures("tiny_default_model")


TINY = [
    "--block-size",
    "16",
    "--batch-size",
    "16",
    "--micro-batch-size",
    "8",
    "--lr",
    "1e-2",
    "--quiet",
]


def finetune(*argv):
    return main(["finetune", *map(str, argv)])


def read_metrics(out):
    return json.loads((out / "metrics.json").read_text())


def test_end_to_end_loss_drops_and_budget_is_met(text_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert finetune("--data", text_file, "--steps", 25, "--epsilon", 8, "--out", out, *TINY) == 0
    m = read_metrics(out)
    for key in (
        "epsilon",
        "delta",
        "noise_multiplier",
        "sample_rate",
        "step",
        "val_loss_before",
        "val_loss_after",
        "val_perplexity_before",
        "val_perplexity_after",
        "expected_tokens_per_second",
        "train_seconds",
    ):
        assert key in m, key
    assert m["step"] == 25 and m["finished"]
    assert m["val_loss_after"] < m["val_loss_before"] - 0.3
    assert 0.95 * 8 <= m["epsilon"] <= 8
    n = m["n_train_blocks"]
    assert m["target_delta"] == pytest.approx(1 / n**1.1)
    assert m["sample_rate"] == pytest.approx(16 / n)
    assert m["noise_multiplier"] > 0
    for f in ("config.json", "model.safetensors", "run_config.json", "trainer_state.pt"):
        assert (out / f).is_file(), f
    reloaded, tok = models.load_model(out)
    assert tok is None and reloaded.config.vocab_size == models.BYTE_VOCAB
    summary = capsys.readouterr().out
    assert "perplexity" in summary and "epsilon" in summary and "sigma" in summary
    # the summary names what backend="auto" ran on (cpp where it is built, else torch)
    ran = "cpp" if backends.is_available("cpp") else "torch"
    assert f"backend auto ({ran})" in summary and m["backend_resolved"] == f"auto ({ran})"


def test_resume_continues_from_saved_step(text_file, tmp_path, capsys):
    first, second = tmp_path / "a", tmp_path / "b"
    common = ["--data", text_file, *TINY]
    assert finetune(*common, "--steps", 4, "--seed", 7, "--out", first) == 0
    m1 = read_metrics(first)
    # the plan is finished: resuming without more steps is an error, nothing written
    assert finetune("--resume", first, "--quiet", "--out", second) == 2
    assert "--steps" in capsys.readouterr().err and not second.exists()
    # changing the plan on resume is refused
    assert finetune("--resume", first, "--steps", 8, "--lr", 0.5, "--out", second) == 2
    assert "--lr" in capsys.readouterr().err
    assert (
        finetune("--resume", first, "--steps", 8, "--epsilon", 10, "--out", second, "--quiet") == 0
    )
    printed = capsys.readouterr()
    assert "steps 4 -> 8" in printed.out
    sigma2 = read_metrics(second)["noise_multiplier"]
    assert f"sigma recalibrated {m1['noise_multiplier']:.4g} -> {sigma2:.4g}" in printed.err
    assert "(steps 4 -> 8, epsilon 8 -> 10)" in printed.err, printed.err
    m2 = read_metrics(second)
    assert m2["step"] == 8
    assert m2["val_loss_initial"] == m1["val_loss_before"]
    assert 0.95 * 10 <= m2["epsilon"] <= 10
    state = torch.load(second / "trainer_state.pt", weights_only=True)
    history = state["accountant"]["history"]
    assert history[0] == [
        pytest.approx(m1["noise_multiplier"]),
        pytest.approx(m1["sample_rate"]),
        4,
    ]
    assert sum(r[2] for r in history) == 8
    assert "seed" not in state["optimizer"]["dp"]  # --seed is not the noise key
    assert state["optimizer"]["state"]  # Adam moments were saved and restored
    # a secure run never writes its key
    assert finetune(*common, "--steps", 2, "--out", tmp_path / "c", "--overwrite") == 0
    assert (
        "seed"
        not in torch.load(tmp_path / "c" / "trainer_state.pt", weights_only=True)["optimizer"]["dp"]
    )


def test_empty_poisson_batches_are_handled(text_file, tmp_path):
    out = tmp_path / "run"
    # expected batch 1 of a few hundred blocks: most batches are empty
    assert (
        finetune(
            "--data",
            text_file,
            "--block-size",
            16,
            "--batch-size",
            1,
            "--steps",
            6,
            "--quiet",
            "--optimizer",
            "dp-sgd",
            "--out",
            out,
        )
        == 0
    )
    m = read_metrics(out)
    assert m["step"] == 6 and m["finished"]


@pytest.mark.parametrize(
    "optimizer", ["dp-adambc", "dp-macadam", "dp-sgd-schedulefree", "dp-adamw-schedulefree"]
)
def test_other_optimizers_run(text_file, tmp_path, optimizer):
    out = tmp_path / "run"
    assert (
        finetune("--data", text_file, "--steps", 3, "--optimizer", optimizer, "--out", out, *TINY)
        == 0
    )
    assert read_metrics(out)["optimizer"] == optimizer


def _tiny_gpt2_dir(path, vocab_size=300, n_positions=32, **extra):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        **{
            "vocab_size": vocab_size,
            "n_positions": n_positions,
            "n_embd": 32,
            "n_layer": 1,
            "n_head": 2,
            "bos_token_id": 0,
            "eos_token_id": 0,
            **extra,
        }
    )
    GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


def test_local_hf_model_dir_loads_via_model(text_file, tmp_path, capsys):
    src = _tiny_gpt2_dir(tmp_path / "tiny-gpt2")
    out = tmp_path / "run"
    assert finetune("--model", src, "--data", text_file, "--steps", 3, "--out", out, *TINY) == 0
    assert str(src) in capsys.readouterr().out
    loaded, _ = models.load_model(out)
    assert loaded.config.vocab_size == 300 and loaded.config.n_positions == 32


def test_model_from_an_earlier_run_says_its_ledger_starts_at_zero(text_file, tmp_path, capsys):
    src = _tiny_gpt2_dir(tmp_path / "tiny-gpt2")
    first, second = tmp_path / "first", tmp_path / "second"
    assert finetune("--model", src, "--data", text_file, "--steps", 1, "--out", first, *TINY) == 0
    assert "earlier dpkern finetune run" not in capsys.readouterr().err
    argv = ("--model", first, "--data", text_file, "--steps", 1, "--out", second, *TINY)
    assert finetune(*argv) == 0
    err = capsys.readouterr().err
    assert "earlier dpkern finetune run" in err and "composition of both" in err
    (src / "dpkern_privacy.json").write_text("{}")  # what DPTrainer.save_model writes
    argv = ("--model", src, "--data", text_file, "--steps", 1, "--out", tmp_path / "third")
    assert finetune(*argv, *TINY) == 0
    err = capsys.readouterr().err
    assert "earlier DPTrainer run (its dpkern_privacy.json)" in err and "composition" in err
    # an earlier run with a known noise seed was not private: no composition is claimed
    (src / "dpkern_privacy.json").write_text('{"private": false}')
    argv = ("--model", src, "--data", text_file, "--steps", 1, "--out", tmp_path / "fourth")
    assert finetune(*argv, *TINY) == 0
    err = capsys.readouterr().err
    assert "was not private" in err and "no privacy guarantee" in err and "composition" not in err
    seeded = tmp_path / "seeded"
    argv = ("--model", src, "--data", text_file, "--steps", 1, "--noise-seed", 3)
    assert finetune(*argv, "--out", seeded, *TINY) == 0
    capsys.readouterr()
    argv = ("--model", seeded, "--data", text_file, "--steps", 1, "--out", tmp_path / "fifth")
    assert finetune(*argv, *TINY) == 0
    assert "earlier dpkern finetune run that was not private" in capsys.readouterr().err


def test_opacus_grad_sample_matches_functorch():
    pytest.importorskip("opacus")
    from dpkern.cli.finetune.clipping import PerSample
    from dpkern.models import CausalLMLogits

    model = models.default_model(8)
    net = CausalLMLogits(model, explicit_positions=True)
    ids = torch.randint(0, 256, (5, 8))
    loss_f = PerSample(net, "functorch")(ids)
    ref = {n: p.grad_sample.clone() for n, p in model.named_parameters()}
    loss_o = PerSample(net, "opacus")(ids)
    torch.testing.assert_close(loss_o, loss_f, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():  # includes the tied embedding / lm_head
        torch.testing.assert_close(p.grad_sample, ref[n], rtol=1e-4, atol=1e-6, msg=n)


def test_opacus_mode_runs_end_to_end(text_file, tmp_path):
    pytest.importorskip("opacus")
    assert (
        finetune(
            "--data",
            text_file,
            "--steps",
            2,
            "--grad-sample",
            "opacus",
            "--out",
            tmp_path / "run",
            *TINY,
        )
        == 0
    )


def _bad_cases(tmp_path, text_file):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"text": "fine"}\n{"txt": "no text field"}\n')
    not_model = tmp_path / "not-a-model"
    not_model.mkdir()
    (not_model / "weights.bin").write_bytes(b"0")
    wrong_model = tmp_path / "wrong-model"
    wrong_model.mkdir()
    (wrong_model / "config.json").write_text(json.dumps({"model_type": "vit"}))
    return {
        "missing data": (["--data", tmp_path / "nope.txt"], "--data"),
        "empty data": (["--data", empty], "--data"),
        "not utf-8": (["--data", binary], "--data"),
        "bad jsonl": (["--data", bad_jsonl], "--data"),
        "data is a directory": (["--data", tmp_path], "--data"),
        "not a model dir": (["--data", text_file, "--model", not_model], "--model"),
        "not a causal LM": (["--data", text_file, "--model", wrong_model], "--model"),
        "missing model": (["--data", text_file, "--model", tmp_path / "nope"], "--model"),
        "epsilon zero": (["--data", text_file, "--epsilon", 0], "--epsilon"),
        "epsilon negative": (["--data", text_file, "--epsilon", -1], "--epsilon"),
        "delta zero": (["--data", text_file, "--delta", 0], "--delta"),
        "delta one": (["--data", text_file, "--delta", 1], "--delta"),
        # no sigma <= 1e6 reaches it (RDP's order grid bottoms out near 0.36 at this delta)
        "budget too small": (
            ["--data", text_file, "--epsilon", 0.01, "--delta", 1e-12],
            "--epsilon",
        ),
        "batch larger than data": (
            ["--data", text_file, "--block-size", 16, "--batch-size", 10**6],
            "--batch-size",
        ),
        "block larger than context": (
            [
                "--data",
                text_file,
                "--model",
                _tiny_gpt2_dir(tmp_path / "m", n_positions=8),
                "--block-size",
                16,
            ],
            "--block-size",
        ),
        "max grad norm": (["--data", text_file, "--max-grad-norm", 0], "--max-grad-norm"),
        # fewer tokens than one block, or fewer blocks than the batch: the block size
        "text too short": (
            ["--data", empty.with_name("short.txt"), "--block-size", 16],
            "--block-size",
        ),
        "block larger than data": (["--data", text_file, "--block-size", 4096], "--block-size"),
        "resume not a checkpoint": (["--resume", not_model], "--resume"),
    }


def test_bad_input_one_line_error_exit_2_nothing_written(tmp_path, text_file, capsys):
    (tmp_path / "short.txt").write_text("too short")
    for name, (argv, option) in _bad_cases(tmp_path, text_file).items():
        out = tmp_path / f"out-{name.replace(' ', '-')}"
        steps = [] if "--steps" in argv else ["--steps", 3]
        assert finetune(*argv, *steps, "--out", out, "--quiet") == 2, name
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "Traceback" not in err, (name, err)
        assert err.startswith(f"dpkern finetune: error: {option}:"), (name, err)
        assert not out.exists(), name


def test_existing_out_is_never_clobbered_without_overwrite(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    assert finetune("--data", text_file, "--steps", 2, "--out", out, *TINY) == 2
    assert "--out" in capsys.readouterr().err
    assert (out / "precious.txt").read_text() == "keep me"
    # not a dpkern run directory: --overwrite refuses it too (tests/test_cli_safety.py)
    assert finetune("--data", text_file, "--steps", 2, "--out", out, "--overwrite", *TINY) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["precious.txt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_data_reading_and_blocks(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"text": "héllo"}\n\n{"text": "world"}\n')
    text = data.read_text(jsonl)
    assert text == "héllo" + data.DOC_SEPARATOR + "world"
    ids = data.byte_encode(text)
    assert ids.dtype == torch.int64 and ids.numel() == len(text.encode()) and int(ids.max()) < 256
    blocks = data.make_blocks(ids, 4)
    assert blocks.shape == (ids.numel() // 4, 4)
    train, val = data.split_blocks(blocks, 0.25)
    assert train.shape[0] + val.shape[0] == blocks.shape[0] and val.shape[0] >= 1
    train2, val2 = data.split_blocks(blocks, 0.25)
    assert torch.equal(val, val2)  # the same split every run
    assert len(data.default_text()) > 100_000


def test_ghost_clipping_is_the_default_and_equals_the_per_sample_path(text_file, tmp_path, capsys):
    """Same seeds, same data: ghost clipping (the default) and materialised per-sample
    gradients give the same run (same noise, same clipped sums up to fp32 rounding)."""
    runs = {}
    for mode in ("ghost", "per-sample"):
        out = tmp_path / mode
        args = [
            "--data",
            text_file,
            "--steps",
            4,
            "--seed",
            3,
            "--noise-seed",
            3,
            "--out",
            out,
            *TINY,
        ]
        if mode == "per-sample":
            args += ["--clipping", mode]
        assert finetune(*args) == 0
        runs[mode] = read_metrics(out)
        assert f"clipping {mode}" in capsys.readouterr().out
    assert runs["ghost"]["val_loss_after"] == pytest.approx(
        runs["per-sample"]["val_loss_after"], rel=1e-4
    )


def test_ghost_clipping_refuses_dp_macadam(text_file, tmp_path, capsys):
    code = finetune(
        "--data",
        text_file,
        "--steps",
        2,
        "--optimizer",
        "dp-macadam",
        "--clipping",
        "ghost",
        "--out",
        tmp_path / "x",
        *TINY,
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--clipping" in err[0]
    assert not (tmp_path / "x").exists()


# -- data parallelism (--nproc): spawned workers, gloo on CPU ------------------------------


def _nproc_run(tmp_path, text_file, *extra):
    """A 2-process run on a tiny saved GPT-2 (spawned workers do not see the monkeypatched
    default shape, so the model comes from a directory both sides load)."""
    model = _tiny_gpt2_dir(tmp_path / "tiny-gpt2")
    out = tmp_path / "run"
    code = finetune(
        "--model", model, "--data", text_file, "--nproc", 2, "--out", out, *TINY, *extra
    )
    return code, out


def test_nproc_2_secure_mode(text_file, tmp_path):
    code, out = _nproc_run(tmp_path, text_file, "--steps", 3)
    assert code == 0
    m = read_metrics(out)
    assert m["nproc"] == 2 and m["step"] == 3 and m["val_loss_after"] < m["val_loss_before"]
    assert "seed" not in torch.load(out / "trainer_state.pt", weights_only=True)["optimizer"]["dp"]


def test_seed_makes_a_model_with_dropout_reproducible(text_file, tmp_path):
    from safetensors.torch import load_file

    model = _tiny_gpt2_dir(tmp_path / "tiny", resid_pdrop=0.1)  # dropout on
    outs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    for out, seed in zip(outs, (4, 4, 5)):  # (--noise-seed: the same noise in all three)
        assert (
            finetune(
                "--model",
                model,
                "--data",
                text_file,
                "--steps",
                2,
                "--seed",
                seed,
                "--noise-seed",
                1,
                "--out",
                out,
                *TINY,
            )
            == 0
        )
    a, b, c = (load_file(o / "model.safetensors") for o in outs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_nproc_2_fsdp_equals_ddp_and_resumes(text_file, tmp_path):
    """--fsdp shards the model (one FSDP2 unit per block): with a seed, the same run as DDP
    (no dropout: its masks are not seeded per rank), and the checkpoint holds the FULL
    model, so it resumes with or without --fsdp.

    DP-SGD, not an Adam-type rule: the two runs differ by float rounding (~1e-8: FSDP's
    gathered parameters feed the GEMMs from other buffers), which Adam's normalised first
    update lr * g / (|g| + eps) turns into lr-sized flips wherever the noisy g ~ 0 (about
    one run in eight failed a 1e-6 comparison). Gathered Adam states are compared with
    the single process in test_distributed.py (state_dict(full=True))."""
    from safetensors.torch import load_file

    model = _tiny_gpt2_dir(
        tmp_path / "tiny", n_layer=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    common = ("--data", text_file, "--nproc", 2, *TINY, "--optimizer", "dp-sgd", "--lr", 0.5)
    runs = {}
    for name, extra in (("ddp", ()), ("fsdp", ("--fsdp",))):
        runs[name] = tmp_path / name
        assert (
            finetune(
                *common,
                "--model",
                model,
                "--seed",
                3,
                "--noise-seed",
                3,
                "--steps",
                4,
                "--out",
                runs[name],
                *extra,
            )
            == 0
        )
    m = read_metrics(runs["ddp"])  # the data-parallel run is calibrated to the budget ...
    assert m["nproc"] == 2 and m["step"] == 4 and m["finished"] and not m["fsdp"]
    assert not m["private"] and "epsilon" not in m  # (a known noise key)
    eps = m["epsilon_if_noise_key_were_secret"]
    assert 0.95 * 8 <= eps <= 8
    assert m["sample_rate"] == pytest.approx(16 / m["n_train_blocks"])  # the GLOBAL rate
    assert m["val_loss_after"] < m["val_loss_before"] - 0.1
    state = torch.load(runs["ddp"] / "trainer_state.pt", weights_only=True)
    assert state["optimizer"]["dp"]["seed"] == 3 and state["step"] == 4
    m_fsdp = read_metrics(runs["fsdp"])  # ... and so is the sharded one, the same way
    assert m_fsdp["fsdp"] and m_fsdp["step"] == 4
    assert m_fsdp["epsilon_if_noise_key_were_secret"] == eps
    # rank 0 keeps half of the parameters under --fsdp (DP-SGD without momentum: no state
    # but a scalar step per parameter)
    full, half = m["bytes_per_rank"], m_fsdp["bytes_per_rank"]
    assert full["optimizer_state"] == half["optimizer_state"] < 0.01 * full["params"]
    assert 0.4 * full["params"] < half["params"] < 0.6 * full["params"], (full, half)
    for mm in (m, m_fsdp):
        assert mm["segments"] == [
            {"steps": [0, 4], "nproc": 2, "fsdp": mm["fsdp"], "train_seconds": mm["train_seconds"]}
        ]
    a, b = (load_file(runs[n] / "model.safetensors") for n in ("fsdp", "ddp"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=k)
    sa, sb = (
        torch.load(runs[n] / "trainer_state.pt", weights_only=True)["optimizer"]
        for n in ("fsdp", "ddp")
    )
    assert sa["state"] == sb["state"]
    assert all(
        v.numel() == 1 for st in sb["state"].values() for v in st.values() if torch.is_tensor(v)
    )  # no momentum (at most a scalar step per parameter)
    assert sa["dp"] == sb["dp"]
    # resume the sharded run's checkpoint without --fsdp, and the DDP one with it
    for name, extra in (("fsdp", ()), ("ddp", ("--fsdp",))):
        assert finetune(*common, "--steps", 6, "--resume", runs[name], *extra) == 0
    a, b = (load_file(runs[n] / "model.safetensors") for n in ("fsdp", "ddp"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=k)
    m2 = read_metrics(runs["ddp"])
    assert m2["fsdp"] and m2["step"] == 6
    assert [(g["steps"], g["fsdp"]) for g in m2["segments"]] == [([0, 4], False), ([4, 6], True)]


def _bar_epsilon(err):
    """The epsilon on the progress bar's last line (tqdm redraws with carriage returns)."""
    shown = [part for part in err.replace("\r", "\n").splitlines() if "eps=" in part]
    assert shown, err
    return shown[-1].split("eps=")[1].split(",")[0].rstrip("]")


@pytest.mark.parametrize("stop_at", [None, 2])
def test_progress_bar_ends_with_the_accountants_epsilon(
    text_file, tmp_path, capsys, monkeypatch, stop_at
):
    import os
    import signal

    from dpkern.cli.finetune import job as ft
    from dpkern.cli.finetune import loop

    monkeypatch.setattr(loop, "EPS_REFRESH_S", 1e9)  # only the first and last step refresh
    real = ft.make_optimizer

    def make(*args, **kwargs):  # SIGTERM after step ``stop_at`` (the CLI stops there)
        opt = real(*args, **kwargs)
        step = opt.step

        def step_then_preempt(*a, **k):
            result = step(*a, **k)
            if opt.dp_step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)
            return result

        opt.step = step_then_preempt
        return opt

    monkeypatch.setattr(ft, "make_optimizer", make)
    out = tmp_path / "run"
    argv = [a for a in TINY if a != "--quiet"]
    code = finetune(
        "--data", text_file, "--steps", 4 if stop_at is None else 50, "--out", out, *argv
    )
    assert code == (0 if stop_at is None else 143)
    m = read_metrics(out)
    assert m["step"] == (stop_at or 4)
    assert _bar_epsilon(capsys.readouterr().err) == f"{m['epsilon']:.2f}"


def test_bar_epsilon_is_recomputed_on_a_new_step_after_the_interval_or_at_the_end():
    from dpkern.cli.finetune.loop import _BarEpsilon

    class Accountant:
        calls = 0

        def get_epsilon(self, delta):
            self.calls += 1
            return float(self.calls)

    acc = Accountant()
    slow = _BarEpsilon(acc, 1e-5, step=0, interval=1e9)
    assert slow.at(1) == 1.0  # the first value is computed
    assert slow.at(2) == 1.0 and slow.at(3) == 1.0  # within the interval: kept
    assert slow.at(4, final=True) == 2.0 and slow.at(4, final=True) == 2.0  # once per step
    fast = _BarEpsilon(acc, 1e-5, step=0, interval=0.0)
    assert [fast.at(1), fast.at(1), fast.at(2)] == [3.0, 3.0, 4.0]  # each new step


def test_missing_transformers_is_a_one_line_error(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "transformers.utils", None)
    assert finetune("--steps", 1, "--quiet") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'dpkern[llm]'" in err, err
    assert err.startswith("dpkern finetune: error: the finetune job needs transformers"), err
    # the option is named only when it was given
    assert finetune("--model", "some-dir", "--steps", 1, "--quiet") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpkern finetune: error: --model: the finetune job needs"), err


@pytest.mark.parametrize(
    "argv", [["--steps", "abc"], ["--optimizer", "dp-foo"], ["--no-such-option"]]
)
def test_malformed_options_are_one_line_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        finetune(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("dpkern") and " error: " in err, err


def test_nproc_bad_input_exits_2_before_spawning(text_file, tmp_path, capsys):
    for argv, option in (
        (["--nproc", 0], "--nproc"),
        (["--nproc", -3], "--nproc"),
        (["--fsdp"], "--fsdp"),
        (["--nproc", 2, "--fsdp", "--optimizer", "dp-macadam"], "--fsdp"),
        (["--nproc", 2, "--fsdp", "--clipping", "per-sample"], "--fsdp"),
        (["--nproc", 2, "--epsilon", 0], "--epsilon"),
        (["--nproc", 2, "--device", "cpu", "--batch-size", 10**6], "--batch-size"),
    ):
        out = tmp_path / "never"
        assert finetune("--data", text_file, "--steps", 2, "--out", out, "--quiet", *argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith(f"dpkern finetune: error: {option}:"), err
        assert not out.exists()


def test_an_unusable_device_exits_2_before_building(text_file, tmp_path, capsys):
    bad = ["meta", "cuda:99"] + ([] if torch.cuda.is_available() else ["cuda"])
    if not torch.backends.mps.is_available():
        bad.append("mps")
    for device in bad:
        out = tmp_path / "never"
        argv = ("--data", text_file, "--steps", 2, "--out", out, "--quiet", "--device", device)
        assert finetune(*argv) == 2, device
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("dpkern finetune: error: --device:"), err
        assert not out.exists()


# -- the default learning rate: each optimizer's own (RuleSpec.finetune_lr) ----------------
def _parser():
    import argparse

    from dpkern.cli.finetune import add_arguments

    # (wide: argparse would wrap the help at hyphens, "dp-sgd-" / "schedulefree")
    parser = argparse.ArgumentParser(
        formatter_class=lambda prog: argparse.HelpFormatter(prog, width=9999)
    )
    add_arguments(parser)
    return parser


def _parse(*argv):
    return _parser().parse_args(list(map(str, argv)))


def test_every_optimizer_has_its_own_default_lr_in_the_plan_and_the_help():
    from dpkern import rules
    from dpkern.cli.finetune.plan import plan_from_args

    lrs = {}
    for spec in rules.RULES.values():
        assert isinstance(spec.finetune_lr, float) and spec.finetune_lr > 0, spec.cli_name
        plan = plan_from_args(_parse("--optimizer", spec.cli_name), None)
        assert plan.lr == spec.finetune_lr, spec.cli_name
        lrs[spec.cli_name] = plan.lr
        given = plan_from_args(_parse("--optimizer", spec.cli_name, "--lr", 0.25), None)
        assert given.lr == 0.25  # an explicit --lr wins
    assert plan_from_args(_parse(), None).lr == lrs["dp-adamw"]  # the default optimizer's
    # not one value for all: SGD-type steps are orders of magnitude above Adam-type ones
    assert lrs["dp-sgd"] > 10 * lrs["dp-adamw"] and len(set(lrs.values())) > 3
    help_text = _parser().format_help()
    assert "learning rate (default: the optimizer's own," in help_text
    for name, lr in lrs.items():
        assert f"{name} {lr:g}" in help_text, name


def test_the_resolved_lr_is_what_the_run_records_and_resume_keeps(
    text_file, tmp_path, monkeypatch, capsys
):
    import dataclasses

    from dpkern import rules
    from dpkern.cli.finetune import job as ft

    spec = rules.by_cli_name("dp-sgd")
    out = tmp_path / "sgd"
    tiny = [a for a in TINY if a not in ("--lr", "1e-2")]
    argv = ["--data", text_file, "--optimizer", "dp-sgd", "--steps", 2, *tiny]
    assert finetune(*argv, "--out", out) == 0
    assert f"dp-sgd, lr {spec.finetune_lr:g}," in capsys.readouterr().out
    assert read_metrics(out)["lr"] == spec.finetune_lr
    assert json.loads((out / "run_config.json").read_text())["lr"] == spec.finetune_lr
    state = torch.load(out / "trainer_state.pt", weights_only=True)["optimizer"]
    assert state["param_groups"][0]["lr"] == spec.finetune_lr
    # the default changes (a new dpkern): a resumed run keeps the lr it was planned with
    monkeypatch.setitem(rules._REGISTRY, "sgd", dataclasses.replace(spec, finetune_lr=123.0))
    job = ft.prepare(_parse("--resume", out, "--steps", 3))
    assert job.plan.lr == spec.finetune_lr
    assert job.optimizer.param_groups[0]["lr"] == spec.finetune_lr
    assert finetune("--resume", out, "--steps", 3, "--quiet") == 0
    assert read_metrics(out)["lr"] == spec.finetune_lr and read_metrics(out)["step"] == 3
    # ... while a new run takes the new default, and an explicit --lr wins
    assert ft.prepare(_parse(*argv)).plan.lr == 123.0
    assert finetune(*argv, "--lr", 0.5, "--out", tmp_path / "given") == 0
    assert read_metrics(tmp_path / "given")["lr"] == 0.5
