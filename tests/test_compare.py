"""`dpkern compare`: the --quick run end to end, learning-rate selection on the validation
split only, privacy spent per cell, the digits task's data and model, CLI errors."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import random
import shlex
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as TF

from dpkern.accounting import get_epsilon, get_noise_multiplier
from dpkern.cli import compare
from dpkern.cli.__main__ import main
from dpkern.grad_sample import compute_grad_sample


def _read_csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_quick_end_to_end(tmp_path, capsys):
    eps = round(random.uniform(1.0, 8.0), 2)
    out = tmp_path / "res"
    rc = main(
        [
            "compare",
            "--task",
            "digits",
            "--quick",
            "--epsilons",
            str(eps),
            "9",
            "--out-dir",
            str(out),
        ]
    )
    assert rc == 0
    runs = _read_csv(out / "runs.csv")
    summary = _read_csv(out / "summary.csv")
    # --quick: first epsilon only, one seed, two optimizers, one learning rate each
    assert len(runs) == 2 and len(summary) == 2
    assert {r["optimizer"] for r in summary} == set(compare.QUICK_OPTIMIZERS)
    assert set(runs[0]) == set(compare.CSV_RUN_FIELDS)
    assert set(summary[0]) == set(compare.CSV_SUMMARY_FIELDS)
    for r in runs:
        assert float(r["epsilon"]) == eps and r["seed"] == "0"
        spent = float(r["epsilon_spent"])
        # never over budget, and calibrated (not a trivially tiny epsilon from huge noise)
        assert 0.9 * eps < spent <= eps
        indep = get_epsilon(
            float(r["noise_multiplier"]),
            float(r["sample_rate"]),
            int(r["steps"]),
            float(r["delta"]),
        )
        assert spent == pytest.approx(indep, rel=1e-4)
        assert 0.0 <= float(r["val_metric"]) <= 100.0
        assert 0.0 <= float(r["test_metric"]) <= 100.0
    for r in summary:
        assert float(r["epsilon_spent_max"]) <= eps and r["seeds"] == "1"
    table = (out / "table.md").read_text()
    rows = [ln for ln in table.splitlines() if ln.startswith("| dp-")]
    assert len(rows) == 6  # two optimizers: metric, lr/epsilon and lr-sensitivity tables
    assert table.count(f"ε = {eps:g}") == 3 and "ε = 9" not in table
    assert all(ln.count("|") == 3 for ln in rows)  # name + one epsilon column
    assert "(1 seed)" in rows[0] and "±" not in rows[0]  # no spread from one seed
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "lr_sensitivity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "learning-rate sensitivity" in table and "| 0.00 |" in table  # (one lr each:
    assert "nothing measured, 0 by construction" in table  # said so)
    assert "accuracy (%) on the validation split" in table and "validation test" not in table
    printed = capsys.readouterr().out
    assert "| dp-sgd |" in printed and "DP-SGD" not in printed
    # each run's noise key is its seed: every output says the runs are not private
    assert "not private: the noise key is known" in printed
    assert "not private: the noise key is known" in table


def _parse(command):
    """The options of a ``dpkern compare ...`` command line (as ``run`` receives them)."""
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    argv = shlex.split(command)
    assert argv[:2] == ["dpkern", "compare"], command
    return parser.parse_args(argv[2:])


def test_quick_echoes_exactly_the_command_that_ran(tmp_path, capsys):
    """table.md's first line is the command that ran: it plans the same runs, and shows
    only the epsilons, seeds and optimizers that --quick kept, with every value exact."""
    out = tmp_path / "res"
    argv = [
        "--task",
        "digits",
        "--quick",
        "--epsilons",
        "2.5",
        "9",
        "--seeds",
        "3",
        "--optimizers",
        "all",
        "--delta",
        "1.2345678e-03",
        "--max-grad-norm",
        "0.7",
        "--batch-size",
        "48",
        "--out-dir",
        str(out),
    ]
    assert main(["compare", *argv]) == 0
    # delta >= 1/N (N = 1257 training images) is allowed, with a one-line warning
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert len(warnings) == 1 and "--delta 0.00123457 is not well below 1/N" in warnings[0]
    first = (out / "table.md").read_text().splitlines()[0]
    assert first.startswith("`") and first.endswith("`"), first
    command = first.strip("`")
    ran = compare.plan(_parse("dpkern compare " + " ".join(argv)), compare._task("digits"))
    again = _parse(command)
    assert compare.plan(again, compare._task("digits")) == ran
    assert again.epsilons == [2.5] and again.seeds == 1 and again.delta == 1.2345678e-03
    assert again.optimizers == [c.optimizer for c in ran]  # dp-sgd dp-adamw
    rows = _read_csv(out / "runs.csv")
    assert [(r["optimizer"], float(r["lr"])) for r in rows] == [(c.optimizer, c.lr) for c in ran]
    # echoing the echoed command gives the same command
    assert compare.command_line(again, compare._task("digits"), ran) == command


def _row(opt, eps, seed, lr, val, test):
    return dict(
        task="digits",
        optimizer=opt,
        epsilon=eps,
        seed=seed,
        lr=lr,
        val_metric=val,
        test_metric=test,
        epsilon_spent=eps * 0.99,
        noise_multiplier=1.0,
        steps=10,
    )


@pytest.mark.parametrize("higher_is_better", [True, False])
def test_select_uses_validation_only(higher_is_better):
    rng = random.Random()
    seeds = rng.randint(2, 5)
    sign = 1 if higher_is_better else -1
    rows = []
    # lr 0.1: best on validation, worst on test; lr 0.2: the opposite
    for seed in range(seeds):
        rows.append(
            _row("dp-adam", 3.0, seed, 0.1, 50 + sign * 10 + rng.random(), rng.uniform(0, 10))
        )
        rows.append(
            _row("dp-adam", 3.0, seed, 0.2, 50 - sign * 10 + rng.random(), rng.uniform(90, 99))
        )
    rows.append(_row("dp-sgd", 3.0, 0, 1.0, 1.0, 2.0))
    summary = compare.select(rows, higher_is_better)
    assert [(r["optimizer"], r["epsilon"]) for r in summary] == [("dp-adam", 3.0), ("dp-sgd", 3.0)]
    best = summary[0]
    assert best["lr"] == 0.1 and best["seeds"] == seeds
    tests = torch.tensor([r["test_metric"] for r in rows if r["lr"] == 0.1], dtype=torch.float64)
    assert best["test_mean"] == pytest.approx(tests.mean().item())
    assert best["test_std"] == pytest.approx(tests.std(unbiased=True).item())
    assert summary[1]["test_std"] == 0.0  # one seed


@pytest.mark.parametrize("higher_is_better", [True, False])
def test_sensitivity_is_the_spread_of_validation_means(higher_is_better):
    """best - worst of the per-lr validation means over seeds; the test metric plays no
    part; a diverged lr (nan) makes the spread infinite, never hides."""
    rng = random.Random()
    seeds = rng.randint(2, 4)
    vals = {lr: [rng.uniform(10, 90) for _ in range(seeds)] for lr in (1e-3, 3e-3, 1e-2, 3e-2)}
    rows = [
        _row("dp-lion", 7.0, s, lr, v[s], rng.uniform(0, 100))
        for lr, v in vals.items()
        for s in range(seeds)
    ]
    rows += [_row("dp-sgd", 7.0, 0, 0.5, 40.0, 1.0), _row("dp-sgd", 7.0, 0, 1.0, float("nan"), 1.0)]
    lion, sgd = compare.sensitivity(rows, higher_is_better)
    means = {lr: sum(v) / seeds for lr, v in vals.items()}
    assert lion["spread"] == pytest.approx(max(means.values()) - min(means.values()))
    pick = max if higher_is_better else min
    assert lion["lr_best"] == pick(means, key=means.get)
    assert [lr for lr, _ in lion["points"]] == sorted(vals)
    assert sgd["spread"] == math.inf and sgd["lr_best"] == 0.5
    table = compare.sensitivity_table([lion, sgd], SimpleNamespace(metric="accuracy (%)"))
    assert "(a x2-x30 range of lr)" in table and "| dp-sgd | inf ↓ |" in table  # best: 0.5 < 1
    mark = {1e-3: " ↓", 3e-2: " ↑"}.get(lion["lr_best"], "")
    assert f"| dp-lion | {lion['spread']:.2f}{mark} |" in table
    assert "the grid may not bracket" in table
    huge = dict(sgd, spread=2.6224e30, lr_best=1.0)  # a run diverged to a huge perplexity
    assert "| dp-sgd | 2.6e+30 ↑ |" in compare.sensitivity_table(
        [huge], SimpleNamespace(metric="x")
    )


def test_train_one_refuses_overspent_epsilon():
    # sigma below the calibrated one spends more than the target: must raise, not report
    q, steps, eps, delta = 0.05, 5, 2.0, 1e-5
    sigma = get_noise_multiplier(eps, delta, q, steps)
    cfg = compare.RunConfig(
        "digits", "dp-sgd", eps, 0, 0.1, 0.5 * sigma, q, steps, delta, 1.0, 0.0, "auto", "rdp"
    )
    with pytest.raises(RuntimeError, match="spent epsilon"):
        compare.train_one(cfg)
    ok = compare.train_one(dataclasses.replace(cfg, noise_multiplier=sigma))
    assert ok["epsilon_spent"] <= eps and ok["steps"] == steps


def test_digits_splits_fixed_disjoint_stratified():
    a, b = compare.digits_splits(), compare.digits_splits()
    sizes = {k: v[0].shape[0] for k, v in a.items()}
    assert sum(sizes.values()) == 1797 and sizes["train"] > 4 * sizes["test"]
    for k in a:
        assert torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1])
        assert a[k][0].shape[1:] == (1, 8, 8) and a[k][0].dtype == torch.float32
        assert 0.0 <= a[k][0].min() and a[k][0].max() <= 1.0
        counts = torch.bincount(a[k][1], minlength=10).float() / sizes[k]
        assert counts.min() > 0.07 and counts.max() < 0.13  # stratified: ~10% per class
    # no image of the test split appears in train or val (rows compared exactly)
    flat = {k: {tuple(x.flatten().tolist()) for x in v[0]} for k, v in a.items()}
    dup_total = 1797 - len(flat["train"] | flat["val"] | flat["test"])
    dup_within = sum(a[k][0].shape[0] - len(flat[k]) for k in a)
    assert dup_total == dup_within  # every duplicate image lies inside one split


def test_digits_cnn_is_per_sample():
    # no cross-sample operation: a sample's gradient does not depend on the rest of the batch
    model = compare.DigitsCNN()
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    x, y = torch.rand(5, 1, 8, 8), torch.randint(0, 10, (5,))
    compute_grad_sample(model, TF.cross_entropy, x, y)
    batch = [p.grad_sample[2].clone() for p in model.parameters()]
    compute_grad_sample(model, TF.cross_entropy, x[2:3], y[2:3])
    for g, p in zip(batch, model.parameters()):
        torch.testing.assert_close(g, p.grad_sample[0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--optimizers", "adagrad"], "--optimizers"),
        (["--optimizers", "sgd"], "--optimizers"),  # one spelling: finetune's dp-sgd
        (["--optimizers", "adamw_bc"], "--optimizers"),
        (["--epsilons", "-1"], "--epsilons"),
        (["--seeds", "0"], "--seeds"),
        (["--delta", "1.5"], "--delta"),
    ],
)
def test_bad_options_exit_2(argv, option, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--out-dir", str(tmp_path), *argv])
    assert exc.value.code == 2
    assert option in capsys.readouterr().err


@pytest.mark.slow
def test_text_quick_one_step(tmp_path):
    # the finetune job's model and data; perplexity: lower is better, bounded by the vocab
    out = tmp_path / "text"
    rc = main(
        [
            "compare",
            "--task",
            "text",
            "--quick",
            "--epochs",
            "0.01",
            "--epsilons",
            "4",
            "--optimizers",
            "dp-adam",
            "--out-dir",
            str(out),
        ]
    )
    assert rc == 0
    runs = _read_csv(out / "runs.csv")
    assert len(runs) == 1 and runs[0]["steps"] == "1" and runs[0]["optimizer"] == "dp-adam"
    assert float(runs[0]["epsilon_spent"]) <= 4.0
    for key in ("val_metric", "test_metric"):
        assert 1.0 < float(runs[0][key]) < 2 * 257  # near-uniform at init, never below 1
    assert "perplexity" in (out / "table.md").read_text()


def _runs_csv(path, rows):
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(compare.CSV_RUN_FIELDS))
        w.writeheader()
        for r in rows:
            w.writerow(r)


def _full_row(opt, eps, seed, lr, val, test):
    return dict(
        _row(opt, eps, seed, lr, val, test),
        noise_multiplier=1.5,
        sample_rate=0.05,
        steps=295,
        epsilon_spent=0.99 * eps,
        delta=1e-5,
        seconds=3.0,
        cpu_seconds=2.5,
    )


def test_from_runs_rebuilds_the_report_of_several_files(tmp_path, capsys):
    """Two runs.csv files of different optimizers make one report, the same as one file
    holding both; nothing is trained; bad inputs are one-line errors, nothing written."""
    rng = random.Random()

    def rows(opt, lrs):
        return [
            _full_row(opt, e, s, lr, rng.uniform(50, 90), rng.uniform(50, 90))
            for e in (1.0, 3.0)
            for s in range(3)
            for lr in lrs
        ]

    a, b = rows("dp-sgd", (0.25, 0.5)), rows("dp-lion", (1e-3, 3e-3, 1e-2))
    _runs_csv(tmp_path / "a.csv", a)
    _runs_csv(tmp_path / "b.csv", b)
    _runs_csv(tmp_path / "ab.csv", a + b)
    two, one = tmp_path / "two", tmp_path / "one"
    argv = ["compare", "--from-runs", str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]
    assert main([*argv, "--out-dir", str(two)]) == 0
    assert main(["compare", "--from-runs", str(tmp_path / "ab.csv"), "--out-dir", str(one)]) == 0
    summary = _read_csv(two / "summary.csv")
    assert {(r["optimizer"], r["epsilon"]) for r in summary} == {
        (o, e) for o in ("dp-sgd", "dp-lion") for e in ("1", "3")
    }
    assert summary == _read_csv(one / "summary.csv")
    want = compare.select(compare.read_runs([tmp_path / "ab.csv"]), True)
    assert [float(r["test_mean"]) for r in summary] == pytest.approx(
        [r["test_mean"] for r in want], rel=1e-5
    )
    table = (two / "table.md").read_text()
    assert "30 runs rebuilt from 2 file(s)" in table and "not private" in table
    assert "learning-rate sensitivity" in table and not (two / "runs.csv").exists()
    capsys.readouterr()
    (tmp_path / "c.csv").write_text("task,optimizer\ndigits,dp-sgd\n")
    _runs_csv(tmp_path / "d.csv", [dict(r, delta=1e-6) for r in b])
    bad = [
        ([tmp_path / "a.csv", tmp_path / "ab.csv"], "is also in"),  # the same runs twice
        ([tmp_path / "nope.csv"], "no such file"),
        ([tmp_path / "c.csv"], "not a runs.csv"),
        ([tmp_path / "a.csv", tmp_path / "d.csv"], "mix deltas"),
    ]
    for files, msg in bad:
        out = tmp_path / "never"
        assert main(["compare", "--from-runs", *map(str, files), "--out-dir", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and msg in err, err
        assert not out.exists()


def test_first_seed_runs_later_seeds_and_echoes_them():
    """--first-seed 1 --seeds 2 plans seeds 1 and 2 only (to merge with seed 0's runs by
    --from-runs); the echoed command plans the same runs."""
    task = compare._task("digits")
    args = _parse("dpkern compare --task digits --epsilons 3 --seeds 2 --first-seed 1 "
                  "--optimizers dp-sgd")  # fmt: skip
    ran = compare.plan(args, task)
    assert sorted({c.seed for c in ran}) == [1, 2]
    command = compare.command_line(args, task, ran)
    assert "--first-seed 1" in command
    assert compare.plan(_parse(command), task) == ran
    zero = compare.plan(_parse("dpkern compare --task digits --epsilons 3 --seeds 2 "
                               "--optimizers dp-sgd"), task)  # fmt: skip
    assert sorted({c.seed for c in zero}) == [0, 1]
    assert "--first-seed" not in compare.command_line(_parse("dpkern compare"), task, zero)


def test_text_without_transformers_is_one_line_error(tmp_path, capsys, monkeypatch):
    """--task text without transformers: one line naming the extra, exit 2, nothing
    written (not a traceback from inside the run after runs.csv was opened); --from-runs
    of text runs still reports (it trains nothing)."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    out = tmp_path / "res"
    assert main(["compare", "--task", "text", "--quick", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "transformers" in err and "dpkern[llm]" in err, err
    assert not out.exists()
    _runs_csv(
        tmp_path / "text.csv", [dict(_full_row("dp-sgd", 3.0, 0, 0.1, 20.0, 21.0), task="text")]
    )
    assert main(["compare", "--from-runs", str(tmp_path / "text.csv"), "--out-dir", str(out)]) == 0
    assert "perplexity" in (out / "table.md").read_text()


def test_from_runs_warns_about_the_options_it_ignores(tmp_path, capsys):
    rows = [_full_row("dp-sgd", 1.0, s, lr, 60.0 + s, 70.0) for s in range(2) for lr in (0.1, 1)]
    _runs_csv(tmp_path / "a.csv", rows)
    argv = ["compare", "--from-runs", str(tmp_path / "a.csv"), "--out-dir", str(tmp_path / "o")]
    assert main(argv) == 0
    assert "warning" not in capsys.readouterr().err  # only --out-dir given: it is used
    assert main([*argv, "--epsilons", "2", "--seeds", "5", "--quick", "--task", "text"]) == 0
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert len(warnings) == 1, warnings
    for option in ("--epsilons", "--seeds", "--quick", "--task"):
        assert option in warnings[0]
    assert "--out-dir" not in warnings[0] and "--optimizers" not in warnings[0]


def test_help_says_what_runs():
    """The help of the options and the description match what the command does."""
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    helps = {a.option_strings[-1]: a.help or "" for a in parser._actions if a.option_strings}
    assert (
        "--first-seed .. --first-seed+N-1" in helps["--seeds"] and "0..N-1" not in helps["--seeds"]
    )
    for name in compare.TASKS:  # --quick: each task's own short run, not "one epoch"
        task = compare._task(name, training=False)
        assert f"{name} {task.quick_epochs:g} epoch" in helps["--quick"]
        assert f"{task.epochs:g} for {name}" in helps["--epochs"]
    assert "one epoch" not in helps["--quick"]
    for option, default in (("--task", "digits"), ("--delta", "1e-5"), ("--accountant", "rdp")):
        assert f"(default: {default})" in helps[option], option
    assert "lr_sensitivity.png" in helps["--out-dir"]
    doc = " ".join(compare.__doc__.split())
    assert "after --from-runs the first line is the rebuild command" in doc
