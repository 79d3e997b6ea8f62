"""``dpkern finetune`` with counter-based sampling: --nproc takes the single-process steps,
privacy units (documents, users), fixed-shape batches, and their bad input."""

from __future__ import annotations

import collections
import json
import random

import pytest

from dpkern.accounting import get_noise_multiplier, overflow_delta
import torch

from dpkern.cli.__main__ import main

from conftest import WORDS

pytestmark = pytest.mark.usefixtures("tiny_default_model")

TINY = ["--block-size", "16", "--micro-batch-size", "8", "--lr", "1e-2", "--quiet"]


def finetune(*argv):
    return main(["finetune", *map(str, argv)])


def read_metrics(out):
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture
def users_file(tmp_path):
    """A .jsonl corpus of 30 users with 1 to 8 lines each (user 0 with 40)."""
    rng = random.Random(0)
    rows = []
    for u in range(30):
        for _ in range(40 if u == 0 else rng.randint(1, 8)):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))) + "."
            rows.append({"text": text, "author": f"user{u}" if u % 2 else u})
    rng.shuffle(rows)
    path = tmp_path / "users.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _tiny_gpt2_dir(path):
    """A saved tiny GPT-2 without dropout (spawned workers load the same init)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=300,
        n_positions=32,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


def test_nproc_takes_the_single_process_steps(text_file, tmp_path):
    """Same --seed (sampling) and --noise-seed: 1, 2 and 3 processes end with the same
    model, up to the float summation order (DP-SGD: no Adam normalisation of roundoff)."""
    from safetensors.torch import load_file

    model = _tiny_gpt2_dir(tmp_path / "tiny")
    common = ["--model", model, "--data", text_file, "--steps", 3, "--batch-size", 16]
    common += ["--seed", 3, "--noise-seed", 4, "--optimizer", "dp-sgd", "--lr", 0.5, *TINY]
    finals = []
    for nproc in (1, 2, 3):
        out = tmp_path / f"n{nproc}"
        assert finetune(*common, "--nproc", nproc, "--out", out) == 0
        finals.append(load_file(out / "model.safetensors"))
        assert read_metrics(out)["nproc"] == nproc
    init = load_file(model / "model.safetensors")
    assert any((finals[0][k] - init[k]).abs().max() > 1e-3 for k in init if k in finals[0])
    for other in finals[1:]:
        for k in finals[0]:
            torch.testing.assert_close(other[k], finals[0][k], rtol=1e-5, atol=1e-6)


def test_user_level_run_names_the_unit_and_counts_users(users_file, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--data", users_file, "--privacy-unit", "user", "--user-field", "author"]
    assert finetune(*argv, "--batch-size", 6, "--steps", 3, "--out", out, *TINY) == 0
    captured = capsys.readouterr()
    assert "using --clipping per-sample" in captured.err  # ghost clips blocks alone
    # 20-30 users: the default delta 1/N^1.1 is ~0.03, said loudly
    assert "warning: the default delta 1/N^1.1 =" in captured.err
    m = read_metrics(out)
    assert m["privacy_unit"] == "user" and 20 <= m["n_units"] < 30
    assert m["sample_rate"] == pytest.approx(6 / m["n_units"])
    assert m["target_delta"] == pytest.approx(1 / m["n_units"] ** 1.1)
    # no exact block or byte count: with users as the unit it would publish the sum of
    # the users' sizes, which one user moves (only N, the accountant's, is shown)
    assert m["n_train_blocks"] is None and m["n_val_blocks"] is None
    assert m["expected_tokens_per_second"] is None and m["expected_units_per_second"] > 0
    data = [ln for ln in captured.out.splitlines() if ln.strip().startswith("data")]
    assert len(data) == 1 and "bytes" not in data[0] and "blocks" not in data[0]
    assert "units/s at the expected batch" in captured.out
    unit = [ln for ln in captured.out.splitlines() if ln.strip().startswith("unit")]
    assert len(unit) == 1 and f"{m['n_units']} training users" in unit[0]
    assert "--user-field author" in unit[0]
    config = json.loads((out / "run_config.json").read_text())
    assert config["privacy_unit"] == "user" and config["user_field"] == "author"
    assert config["n_train"] is None and config["n_val"] is None  # block counts: private
    # a resume keeps the unit; changing it is refused
    assert finetune("--resume", out, "--steps", 4, "--quiet") == 0
    assert read_metrics(out)["step"] == 4 and read_metrics(out)["privacy_unit"] == "user"
    assert finetune("--resume", out, "--steps", 5, "--privacy-unit", "block", "--quiet") == 2
    assert "--privacy-unit: cannot be changed on --resume" in capsys.readouterr().err


def test_document_level_run(users_file, tmp_path):
    out = tmp_path / "run"
    argv = ["--data", users_file, "--privacy-unit", "document", "--batch-size", 8]
    assert finetune(*argv, "--steps", 2, "--out", out, *TINY) == 0
    m = read_metrics(out)
    lines = sum(1 for ln in users_file.read_text().splitlines() if ln.strip())
    assert m["privacy_unit"] == "document" and m["n_units"] < lines  # short lines: no block


def test_unit_truncation_and_sigma_do_not_depend_on_unit_sizes(users_file, tmp_path, capsys):
    """--max-batch-size with users as units: the overflow bound, its delta charge and the
    sigma calibrated with it are functions of N users, q, B_max and the cap only. Two
    datasets of the same users, one user's size changed, publish the same numbers."""
    rows = [json.loads(ln) for ln in users_file.read_text().splitlines() if ln.strip()]
    other = tmp_path / "other.jsonl"
    lines = collections.Counter(str(r["author"]) for r in rows)
    small = min(lines, key=lines.get)  # a user below the cap: one more line moves its size
    extra = [r for r in rows if str(r["author"]) == small][:1]
    other.write_text("\n".join(json.dumps(r) for r in rows + extra) + "\n")
    got = []
    for k, data in enumerate((users_file, other)):
        out = tmp_path / f"run{k}"
        argv = ["--data", data, "--privacy-unit", "user", "--user-field", "author"]
        argv += ["--batch-size", 4, "--max-blocks-per-unit", 12, "--max-batch-size", 180]
        assert finetune(*argv, "--steps", 1, "--out", out, "--quiet", *TINY) == 0
        m = read_metrics(out)
        got.append(
            (m["n_units"], m["noise_multiplier"], m["batch_overflow_probability"])
            + (m["delta_batch_truncation"],)
        )
    assert got[0] == got[1] and got[0][2] > 0
    # a B_max below the expected batch: the bound's expected batch (27 users x 12 x q)
    # and the smallest B_max that would do, never the real block count
    argv = ["--data", users_file, "--privacy-unit", "user", "--user-field", "author"]
    argv += ["--batch-size", 4, "--max-blocks-per-unit", 12, "--max-batch-size", 4]
    assert finetune(*argv, "--steps", 1, "--out", tmp_path / "small", *TINY) == 2
    err = capsys.readouterr().err
    n = got[0][0]
    assert f"expected batch of {4 / n * n * 12:.1f} blocks at most (users" in err, err
    assert "use at least 180" in err and "(q * blocks)" not in err, err


def test_fixed_shape_run_charges_truncation_and_resumes(text_file, tmp_path):
    out = tmp_path / "run"
    argv = ["--data", text_file, "--batch-size", 16, "--max-batch-size", 60, "--seed", 1]
    assert finetune(*argv, "--steps", 3, "--out", out, "--epsilon-curve", *TINY) == 0
    m = read_metrics(out)
    assert m["max_batch_size"] == 60 and 0 < m["batch_overflow_probability"] < 1e-12
    want = m["delta_mechanism"] + m["delta_noise_tail"] + m["delta_batch_truncation"]
    assert m["delta"] == pytest.approx(want, rel=1e-12) and m["delta_batch_truncation"] > 0
    # sigma was calibrated for what the truncation leaves: the total stays within the
    # target (the noise tail, ~1e-16 relative, is reported on top)
    assert m["delta_mechanism"] < m["target_delta"]
    assert m["delta"] <= m["target_delta"] + m["delta_noise_tail"]
    eps_t = m["target_epsilon"]
    charge = overflow_delta(m["steps"] * m["batch_overflow_probability"], eps_t)
    assert m["delta_mechanism"] == pytest.approx(m["target_delta"] - charge, rel=1e-12)
    sigma = get_noise_multiplier(
        eps_t, m["delta_mechanism"], m["sample_rate"], m["steps"], m["accountant"]
    )
    assert m["noise_multiplier"] == pytest.approx(sigma, rel=1e-12)
    curve = m["epsilon_curve"]
    assert [c["delta"] for c in curve] == sorted(c["delta"] for c in curve)
    assert any(c["delta"] == m["delta_mechanism"] and c["epsilon"] == m["epsilon"] for c in curve)
    assert finetune("--resume", out, "--steps", 4, "--quiet") == 0
    assert read_metrics(out)["step"] == 4


def test_fixed_shape_ghost_equals_per_sample(text_file, tmp_path):
    """Padding is masked out: the ghost and per-sample paths take the same step on a
    padded batch (same seeds)."""
    from safetensors.torch import load_file

    common = ["--data", text_file, "--steps", 2, "--batch-size", 16, "--max-batch-size", 60]
    common += ["--seed", 2, "--noise-seed", 3, "--optimizer", "dp-sgd", *TINY]
    outs = {}
    for clipping in ("ghost", "per-sample"):
        outs[clipping] = tmp_path / clipping
        assert finetune(*common, "--clipping", clipping, "--out", outs[clipping]) == 0
    a, b = (load_file(o / "model.safetensors") for o in outs.values())
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def _bad(tmp_path, text_file, users_file):
    return {
        "user without field": (["--data", users_file, "--privacy-unit", "user"], "--user-field"),
        "field without user": (["--data", users_file, "--user-field", "author"], "--user-field"),
        "missing user field": (
            ["--data", users_file, "--privacy-unit", "user", "--user-field", "nobody"],
            "--user-field",
        ),
        "document of a txt": (
            ["--data", text_file, "--privacy-unit", "document"],
            "--privacy-unit",
        ),
        "b_max below expected": (
            ["--data", text_file, "--batch-size", 16, "--max-batch-size", 15],
            "--max-batch-size",
        ),
        "b_max truncates": (
            ["--data", text_file, "--batch-size", 16, "--max-batch-size", 20],
            "--max-batch-size",
        ),
        "b_max zero": (["--data", text_file, "--max-batch-size", 0], "--max-batch-size"),
        "units without cap": (
            [
                *["--data", users_file, "--privacy-unit", "user", "--user-field", "author"],
                *["--batch-size", 4, "--max-batch-size", 400],
            ],
            "--max-blocks-per-unit",
        ),
        "cap of blocks": (
            ["--data", text_file, "--max-blocks-per-unit", 2],
            "--max-blocks-per-unit",
        ),
        "ghost with users": (
            [
                *["--data", users_file, "--privacy-unit", "user", "--user-field", "author"],
                *["--clipping", "ghost", "--batch-size", 4],
            ],
            "--clipping",
        ),
        "batch above units": (
            ["--data", users_file, "--privacy-unit", "document", "--batch-size", 10**4],
            "--batch-size",
        ),
    }


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, text_file, users_file, capsys):
    for name, (argv, option) in _bad(tmp_path, text_file, users_file).items():
        out = tmp_path / f"out-{name.replace(' ', '-')}"
        assert finetune(*argv, "--steps", 3, "--out", out, *TINY) == 2, name
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "Traceback" not in err, (name, err)
        assert err.startswith(f"dpkern finetune: error: {option}:"), (name, err)
        assert not out.exists(), name
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a b c", "author": "x"}\n{"text": "d e f"}\n')
    out = tmp_path / "out-bad"
    argv = ["--data", bad, "--privacy-unit", "user", "--user-field", "author", "--out", out]
    assert finetune(*argv, *TINY) == 2
    assert 'bad.jsonl:2: no "author" field' in capsys.readouterr().err and not out.exists()


def test_secure_sampling_key_never_reaches_the_run_directory(users_file, tmp_path, monkeypatch):
    """Without --seed the sampling key is a secret from os.urandom: no file of the run
    holds it (nor the noise key), in any common encoding."""
    import os

    from dpkern.sampling import stream

    drawn, keys = [], []
    real_urandom, real_key = os.urandom, stream.sampling_key

    def urandom(n):
        drawn.append(real_urandom(n))
        return drawn[-1]

    def sampling_key(seed=None):
        keys.append(real_key(seed))
        return keys[-1]

    monkeypatch.setattr(os, "urandom", urandom)
    monkeypatch.setattr(stream, "sampling_key", sampling_key)
    monkeypatch.setattr("dpkern.sampling.poisson.sampling_key", sampling_key)
    out = tmp_path / "run"
    argv = ["--data", users_file, "--privacy-unit", "user", "--user-field", "author"]
    assert finetune(*argv, "--batch-size", 6, "--steps", 2, "--out", out, *TINY) == 0
    secret = [k for k in keys if not k.seeded]
    assert secret and all(not k.seeded for k in secret)
    needles = set()
    for b in [k._value.to_bytes(8, "little") for k in secret] + [d[:8] for d in drawn]:
        for v in (int.from_bytes(b, "little"), int.from_bytes(b, "big")):
            needles |= {str(v).encode(), f"{v:x}".encode(), f"{v:016x}".encode()}
        needles |= {b, b[::-1]}
    for path in out.rglob("*"):
        if path.is_file():
            raw = path.read_bytes()
            assert not any(n in raw for n in needles if len(n) >= 8), path.name


def test_units_are_summed_across_micro_batches_before_clipping():
    """PerSample.units: a unit with more blocks than a micro-batch is summed over its
    passes, so the optimizer sees the same unit rows whatever the micro-batch size."""
    from dpkern import models
    from dpkern.cli.finetune.clipping import PerSample, unit_chunks
    from dpkern.grad_sample import compute_grad_sample
    from dpkern.sampling import group_grad_samples

    torch.manual_seed(0)
    net = models.CausalLMLogits(models.default_model(16, seed=0))
    params = [p for p in net.parameters() if p.requires_grad]
    ids = torch.randint(0, 256, (11, 16))
    units = torch.tensor([4, 4, 4, 4, 4, 4, 4, 7, 9, 9, 9])
    compute_grad_sample(net, models.sample_loss, ids, ids)
    want = group_grad_samples([p.grad_sample for p in params], units)
    for micro in (2, 3, 100):
        assert unit_chunks(units, micro)[0] == ((0, 7) if micro < 7 else (0, 11))
        got_rows = None
        for a, b in unit_chunks(units, micro):
            PerSample(net, "functorch").units(ids[a:b], units[a:b], micro)
            rows = [p.grad_sample for p in params]
            got_rows = rows if got_rows is None else [torch.cat(x) for x in zip(got_rows, rows)]
        for g, w in zip(got_rows, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert unit_chunks(units, 3) == [(0, 7), (7, 8), (8, 11)]


def test_summary_model_line_says_resumed_and_from_what():
    """A resumed run's summary names the run it resumed and the model it came from (a
    run started with --model kept only the model before)."""
    import types

    from dpkern.cli.finetune.summary import _model_line

    m = {"num_parameters_total": 2.5e6, "num_parameters": 1000}
    base = dict(lora=None, bf16=False, stochastic_rounding=False, block_size=64, arch="gpt2")
    plan = types.SimpleNamespace(model="runs/r_lora", **base)
    line = _model_line(plan, types.SimpleNamespace(resume="runs/r2"), m)
    assert line.startswith("(resumed) runs/r2, from runs/r_lora: 2.50 M parameters")
    plan = types.SimpleNamespace(model=None, **base)
    line = _model_line(plan, types.SimpleNamespace(resume=None), m)
    assert line.startswith("built-in byte-level GPT-2: 2.50 M parameters, block 64")
    line = _model_line(plan, types.SimpleNamespace(resume="runs/r1"), m)
    assert line.startswith("(resumed) runs/r1, from built-in byte-level GPT-2")
