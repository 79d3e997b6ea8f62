"""`dpkern finetune`: no silent reuse, leak or data loss.

Exact data-dependent counts stay out of every output; --seed never fixes the noise (only
--noise-seed does, and such a run says it is not private); --overwrite replaces only a
dpkern run directory; a checkpoint keeps the files dpkern did not write; SIGTERM stops at
a step boundary with a checkpoint and exit code 143; --delta >= 1/N warns; a too large
--block-size is reported as such."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from dpkern import sampling
from dpkern.cli.finetune import job as ft
from dpkern.cli.__main__ import main

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
NOT_PRIVATE = "not private: the noise key is known"
EXACT_COUNT_KEYS = {
    "stats",
    "optimizer_stats",
    "clipped_samples",
    "nonfinite_samples",
    "samples",
    "tokens",
}


pytestmark = pytest.mark.usefixtures("tiny_default_model")


def finetune(*argv):
    return main(["finetune", *map(str, argv)])


def read_json(path):
    return json.loads(path.read_text())


@pytest.fixture
def optimizers(monkeypatch):
    """Every optimizer the finetune job builds (to read its in-memory state afterwards)."""
    made = []
    real = ft.make_optimizer

    def make(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(ft, "make_optimizer", make)
    return made


def _keys(obj):
    """Every dict key in a nested structure."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _keys(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _keys(v)


def _files(directory):
    return sorted(p for p in directory.rglob("*") if p.is_file())


def _tiny_gpt2_dir(path, **extra):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=300,
        n_positions=32,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        **extra,
    )
    GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


# -- 3: exact, un-noised counts never leave the process -----------------------------------


def test_no_exact_data_dependent_counts_in_any_output(text_file, tmp_path, capsys, optimizers):
    out = tmp_path / "run"
    assert finetune("--data", text_file, "--steps", 4, "--out", out, "--save-every", 2, *TINY) == 0
    printed = capsys.readouterr()
    stats = dict(getattr(optimizers[-1], "stats", {}))
    assert stats.get("samples", 0) > 0  # (the optimizer did count them, in memory)
    files = _files(out)
    assert {p.name for p in files} >= {"run_config.json", "metrics.json", "trainer_state.pt"}
    for path in files:
        raw = path.read_bytes()
        for word in (b"clipped_samples", b"nonfinite_samples", b"optimizer_stats"):
            assert word not in raw, (path.name, word)
        if path.suffix == ".json":
            found = EXACT_COUNT_KEYS & set(_keys(json.loads(raw)))
        elif path.suffix == ".pt":
            found = EXACT_COUNT_KEYS & set(_keys(torch.load(path, weights_only=True)))
        else:
            continue
        assert not found, (path.name, found)
        if path.suffix == ".json":  # the training loss: exact on the private data, un-noised
            assert not [k for k in _keys(json.loads(raw)) if "train_loss" in str(k)], path.name
    text = (printed.out + printed.err).replace(str(tmp_path), "<tmp>")  # (pytest-63/...)
    assert "clipped" not in text and "nonfinite" not in text
    expected = 4 * 16  # steps x expected batch: public
    m = read_json(out / "metrics.json")
    # numbers the summary shows that are public: the plan's, and the data's block counts
    # (a run drew 63 samples = 1,008 tokens, and the data had 1,008 training blocks)
    public = {expected, expected * 16, m["n_train_blocks"], m["n_val_blocks"]}
    for exact in (stats["samples"], stats["samples"] * 16):
        if exact in public:
            continue  # (then the exact count says nothing the public numbers do not)
        for shown in (f"{exact:,}", str(exact)):
            assert not re.search(rf"(?<![\d.,]){re.escape(shown)}(?![\d,]|\.\d)", text), (
                exact,
                text,
            )
    assert "tokens/s at the expected batch" in printed.out
    assert m["expected_tokens_per_second"] > 0


# -- 4: --seed is not the noise key; --noise-seed says "not private" ----------------------


class _RecordingSampler(sampling.PoissonBatchSampler):
    recorded: list = []

    def batch(self, step):
        batch = super().batch(step)
        _RecordingSampler.recorded.append(batch.indices[batch.mask].tolist())
        return batch


def _run_recorded(monkeypatch, out, *argv):
    """Run finetune; return (initial parameters, sampled batches, final weights)."""
    from safetensors.torch import load_file

    initial = []
    real = ft.make_optimizer

    def make(plan, params, *args, **kwargs):
        initial.append([p.detach().clone() for p in params])
        return real(plan, params, *args, **kwargs)

    monkeypatch.setattr(ft, "make_optimizer", make)
    monkeypatch.setattr(sampling, "PoissonBatchSampler", _RecordingSampler)
    _RecordingSampler.recorded = []
    assert finetune(*argv, "--out", out) == 0
    return initial[0], list(_RecordingSampler.recorded), load_file(out / "model.safetensors")


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_seed_fixes_init_and_sampling_not_the_noise(text_file, tmp_path, monkeypatch, capsys):
    common = ["--data", text_file, "--steps", 3, "--seed", 11, *TINY]
    init_a, batches_a, final_a = _run_recorded(monkeypatch, tmp_path / "a", *common)
    init_b, batches_b, final_b = _run_recorded(monkeypatch, tmp_path / "b", *common)
    assert _same(init_a, init_b) and batches_a == batches_b and any(batches_a)
    assert not all(torch.equal(final_a[k], final_b[k]) for k in final_a)  # secret noise keys
    out = capsys.readouterr().out
    assert NOT_PRIVATE not in out and "epsilon" in out
    for run in ("a", "b"):
        config = read_json(tmp_path / run / "run_config.json")
        assert config["seed"] == 11 and config["noise_seed"] is None
        assert "privacy" not in config
        state = torch.load(tmp_path / run / "trainer_state.pt", weights_only=True)
        assert "seed" not in state["optimizer"]["dp"]
    # --noise-seed: the same noise too, hence the same model; and it is not private
    noisy = [*common, "--noise-seed", 5]
    _, batches_c, final_c = _run_recorded(monkeypatch, tmp_path / "c", *noisy)
    _, batches_d, final_d = _run_recorded(monkeypatch, tmp_path / "d", *noisy)
    assert batches_c == batches_d == batches_a
    assert all(torch.equal(final_c[k], final_d[k]) for k in final_c)
    out = capsys.readouterr().out
    privacy = [ln for ln in out.splitlines() if ln.strip().startswith("privacy")]
    assert len(privacy) == 2 and all(NOT_PRIVATE in ln and "epsilon" not in ln for ln in privacy), (
        out
    )
    m = read_json(tmp_path / "c" / "metrics.json")
    assert m["privacy"] == NOT_PRIVATE and m["private"] is False and "epsilon" not in m
    assert 0 < m["epsilon_if_noise_key_were_secret"] <= 8
    config = read_json(tmp_path / "c" / "run_config.json")
    assert config["privacy"] == NOT_PRIVATE and "epsilon" not in config
    assert config["noise_seed"] == 5


def test_secure_run_directory_never_holds_the_noise_key(
    text_file, tmp_path, monkeypatch, optimizers
):
    drawn = []
    real_urandom = os.urandom

    def urandom(n):  # every secret the run draws (the noise key, the sampler's seed, ...)
        drawn.append(real_urandom(n))
        return drawn[-1]

    monkeypatch.setattr(os, "urandom", urandom)
    out = tmp_path / "run"
    assert finetune("--data", text_file, "--steps", 2, "--seed", 11, "--out", out, *TINY) == 0
    assert finetune("--resume", out, "--steps", 3, "--quiet") == 0  # a fresh key
    assert all(opt.secure for opt in optimizers) and len(optimizers) == 2
    secrets = [b for b in drawn if len(b) >= 8]
    assert len(secrets) >= 2
    needles = set()
    for b in secrets:
        b = b[:8]
        for v in (int.from_bytes(b, "little"), int.from_bytes(b, "big")):
            needles |= {
                str(v).encode(),
                str(v >> 1).encode(),
                f"{v:x}".encode(),
                f"{v:016x}".encode(),
            }
        needles |= {b, b[::-1]}
    for path in _files(out):
        raw = path.read_bytes()
        for needle in needles:
            assert needle not in raw, (path.name, needle)


def test_resume_keeps_a_noise_seed_and_a_secure_run_stays_secure(text_file, tmp_path, capsys):
    seeded, secure = tmp_path / "seeded", tmp_path / "secure"
    assert (
        finetune("--data", text_file, "--steps", 2, "--noise-seed", 5, "--out", seeded, *TINY) == 0
    )
    assert finetune("--data", text_file, "--steps", 2, "--out", secure, *TINY) == 0
    capsys.readouterr()
    assert finetune("--resume", seeded, "--steps", 3, "--noise-seed", 6) == 2
    assert capsys.readouterr().err.startswith("dpkern finetune: error: --noise-seed:")
    assert finetune("--resume", secure, "--steps", 3, "--noise-seed", 6) == 2
    err = capsys.readouterr().err
    assert err.startswith("dpkern finetune: error: --noise-seed:") and "secret" in err
    assert finetune("--resume", seeded, "--steps", 3, "--quiet") == 0
    assert finetune("--resume", secure, "--steps", 3, "--quiet") == 0
    out = capsys.readouterr().out.split("dpkern finetune: done")
    assert NOT_PRIVATE in out[1] and NOT_PRIVATE not in out[2]
    assert read_json(seeded / "run_config.json")["noise_seed"] == 5
    assert read_json(seeded / "metrics.json")["privacy"] == NOT_PRIVATE
    assert (
        torch.load(seeded / "trainer_state.pt", weights_only=True)["optimizer"]["dp"]["seed"] == 5
    )
    assert read_json(secure / "run_config.json")["noise_seed"] is None
    assert read_json(secure / "metrics.json")["private"] is True
    assert (
        "seed" not in torch.load(secure / "trainer_state.pt", weights_only=True)["optimizer"]["dp"]
    )


def test_an_older_seeded_checkpoint_resumes_as_not_private(text_file, tmp_path, capsys):
    """Before --noise-seed, --seed was the noise key (kept in the optimizer state): such a
    checkpoint's key is known, so its resumed run must not claim an epsilon."""
    out = tmp_path / "old"
    assert (
        finetune(
            "--data", text_file, "--steps", 2, "--seed", 7, "--noise-seed", 7, "--out", out, *TINY
        )
        == 0
    )
    config = read_json(out / "run_config.json")  # as the older dpkern wrote it
    for key in ("written_by", "checkpoint", "privacy", "noise_seed"):
        config.pop(key)
    config["epsilon"] = config.pop("epsilon_for_noise_calibration")
    (out / "run_config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert finetune("--resume", out, "--steps", 3, "--quiet") == 0
    assert NOT_PRIVATE in capsys.readouterr().out
    assert read_json(out / "metrics.json")["privacy"] == NOT_PRIVATE
    assert read_json(out / "run_config.json")["noise_seed"] == 7


# -- 15: --overwrite replaces only a dpkern run directory ---------------------------------


def _snapshot(directory):
    return {p: p.read_bytes() for p in _files(directory)}


def _refused(capsys, *argv):
    code = finetune(*argv, "--steps", 2, "--overwrite", *TINY)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert err.startswith("dpkern finetune: error: --overwrite: refusing to replace"), err
    return err


def test_overwrite_refuses_the_current_directory_and_its_parents(
    text_file, tmp_path, monkeypatch, capsys
):
    work = tmp_path / "work"
    work.mkdir()
    data = work / "train.txt"
    shutil.copy(text_file, data)
    (work / "run_config.json").write_text(json.dumps({"written_by": "dpkern finetune"}))
    monkeypatch.chdir(work)
    before = _snapshot(tmp_path)
    assert "current directory" in _refused(capsys, "--data", "train.txt", "--out", ".")
    assert "current directory" in _refused(capsys, "--data", "train.txt", "--out", "..")
    assert "current directory" in _refused(capsys, "--data", "train.txt", "--out", tmp_path.parent)
    assert _snapshot(tmp_path) == before


def test_overwrite_refuses_a_directory_holding_data_or_model(text_file, tmp_path, capsys):
    # a real dpkern run directory, in which the user keeps the data and a model
    run = tmp_path / "run"
    assert finetune("--data", text_file, "--steps", 1, "--out", run, *TINY) == 0
    data = run / "sub" / "corpus.txt"
    data.parent.mkdir()
    shutil.copy(text_file, data)
    model = _tiny_gpt2_dir(run / "my-model")
    before = _snapshot(run)
    assert "--data" in _refused(capsys, "--data", data, "--out", run)
    assert "--model" in _refused(capsys, "--data", text_file, "--model", model, "--out", run)
    assert "--model" in _refused(capsys, "--data", text_file, "--model", model, "--out", model)
    # --resume from inside it, writing to it: the resumed run would be deleted
    inner = run / "inner"
    assert finetune("--data", text_file, "--steps", 1, "--out", inner, *TINY) == 0
    before = _snapshot(run)
    code = finetune("--resume", inner, "--steps", 2, "--out", run, "--overwrite", "--quiet")
    err = capsys.readouterr().err
    assert (
        code == 2 and err.startswith("dpkern finetune: error: --overwrite:") and "--resume" in err
    )
    assert _snapshot(run) == before


def test_overwrite_refuses_a_directory_dpkern_did_not_write(text_file, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "run_config.json").write_text('{"something": "else"}')
    before = _snapshot(out)
    assert "not a dpkern run directory" in _refused(capsys, "--data", text_file, "--out", out)
    assert _snapshot(out) == before


def test_overwrite_replaces_a_dpkern_run_directory(text_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert finetune("--data", text_file, "--steps", 2, "--out", out, *TINY) == 0
    old = _snapshot(out)
    (out / "notes.txt").write_text("mine")
    # a file of the previous checkpoint that the new one does not write is removed
    config = read_json(out / "run_config.json")
    config["checkpoint"]["files"].append("model-old.safetensors")
    (out / "run_config.json").write_text(json.dumps(config))
    (out / "model-old.safetensors").write_bytes(b"stale")
    assert finetune("--data", text_file, "--steps", 3, "--out", out, "--overwrite", *TINY) == 0
    assert read_json(out / "metrics.json")["step"] == 3
    assert (out / "model.safetensors").read_bytes() != old[out / "model.safetensors"]
    assert not (out / "model-old.safetensors").exists()
    assert (out / "notes.txt").read_text() == "mine"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no staging left


# -- 16: a checkpoint replaces only what dpkern writes ------------------------------------


def test_resume_keeps_files_dpkern_did_not_write(text_file, tmp_path):
    out = tmp_path / "run"
    assert finetune("--data", text_file, "--steps", 2, "--out", out, *TINY) == 0
    (out / "notes.txt").write_text("my notes")
    (out / "plots").mkdir()
    (out / "plots" / "loss.png").write_bytes(b"png")
    assert finetune("--resume", out, "--steps", 4, "--save-every", 1, "--quiet") == 0
    assert read_json(out / "metrics.json")["step"] == 4
    assert (out / "notes.txt").read_text() == "my notes"
    assert (out / "plots" / "loss.png").read_bytes() == b"png"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


# -- 17: SIGTERM: checkpoint at a step boundary, one line, exit 143 -----------------------


def test_sigterm_in_process_checkpoints_and_restores_handlers(
    text_file, tmp_path, capsys, monkeypatch
):
    class NotHandled(Exception):
        pass

    def ours(signum, frame):  # (without the CLI's handler the test fails, not the runner)
        raise NotHandled(signum)

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
    previous = signal.signal(signal.SIGTERM, ours)
    try:
        out = tmp_path / "run"
        assert finetune("--data", text_file, "--steps", 50, "--out", out, *TINY) == 143
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dpkern finetune: stopped by SIGTERM at step 2/50")
    assert f"--resume {out}" in err[0]
    m = read_json(out / "metrics.json")
    assert m["step"] == 2 and not m["finished"]
    monkeypatch.setattr(ft, "make_optimizer", real)
    assert finetune("--resume", out, "--steps", 4, "--quiet") == 0
    assert read_json(out / "metrics.json")["step"] == 4


def _preempt(tmp_path, argv, out, kill):
    """Start ``python -m dpkern finetune argv``, wait for its first checkpoint (it saves
    every step), then ``kill(proc)``; returns (exit code, stderr)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpkern", "finetune", *map(str, argv)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not (out / "run_config.json").is_file():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.05)
        kill(proc)
        _, err = proc.communicate(timeout=120)
        return proc.returncode, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _check_stopped(code, err, out):
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 143, err
    assert len(lines) == 1 and lines[0].startswith("dpkern finetune: stopped by SIGTERM"), err
    step = read_json(out / "metrics.json")["step"]
    assert step >= 1 and f"at step {step}/" in lines[0]
    assert finetune("--resume", out, "--steps", step + 1, "--quiet") == 0
    assert read_json(out / "metrics.json")["step"] == step + 1


@pytest.mark.slow
def test_sigterm_subprocess_exits_143_and_resumes(text_file, tmp_path):
    out = tmp_path / "run"
    model = _tiny_gpt2_dir(tmp_path / "tiny")
    argv = [
        "--model",
        model,
        "--data",
        text_file,
        "--steps",
        100000,
        "--save-every",
        1,
        "--out",
        out,
        *TINY,
    ]
    code, err = _preempt(tmp_path, argv, out, lambda p: p.send_signal(signal.SIGTERM))
    _check_stopped(code, err, out)


@pytest.mark.slow
def test_sigterm_to_the_nproc_parent_reaches_the_workers(text_file, tmp_path):
    out = tmp_path / "run"
    model = _tiny_gpt2_dir(tmp_path / "tiny")
    argv = [
        "--model",
        model,
        "--data",
        text_file,
        "--nproc",
        2,
        "--steps",
        100000,
        "--save-every",
        1,
        "--out",
        out,
        *TINY,
    ]
    # to the parent only (as a container runtime does): it forwards to its workers
    code, err = _preempt(tmp_path, argv, out, lambda p: p.send_signal(signal.SIGTERM))
    _check_stopped(code, err, out)
    assert read_json(out / "metrics.json")["segments"][0]["nproc"] == 2


# -- 19: --delta >= 1/N warns; --block-size errors name --block-size ----------------------


def test_delta_not_below_one_over_n_warns(text_file, tmp_path, capsys):
    assert finetune("--data", text_file, "--steps", 1, "--delta", 0.5, *TINY) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dpkern finetune: warning: --delta 0.5"), err
    assert "1/N" in err[0]
    assert finetune("--data", text_file, "--steps", 1, "--delta", 1e-9, *TINY) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--block-size", 100_000], "--block-size"),  # fewer tokens than one block
        (["--block-size", 4096], "--block-size"),  # fewer blocks than the batch
        (["--block-size", 16, "--batch-size", 10**6], "--batch-size"),  # no block size helps
        (["--batch-size", 10**6], "--batch-size"),
    ],
)
def test_block_and_batch_size_errors_name_the_right_option(
    text_file, tmp_path, capsys, argv, option
):
    out = tmp_path / "never"
    assert finetune("--data", text_file, "--steps", 2, "--quiet", "--out", out, *argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"dpkern finetune: error: {option}:"), err
    assert not out.exists()


def test_version_option(capsys):
    import dpkern

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"dpkern {dpkern.__version__}\n"
