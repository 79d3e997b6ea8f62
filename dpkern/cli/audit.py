"""Audit the privacy of a finetune configuration in one run (dpkern.audit).

Takes the options of ``dpkern finetune`` (the same model, data, optimizer, epsilon,
delta, clipping, micro-batches, --nproc ...) and runs the one-run audit of Steinke, Nasr &
Jagielski (NeurIPS 2023, arXiv 2305.08846) on it: m canaries, each included by a fair
coin, one training run, and a lower bound on epsilon at 95% confidence from how well the
canaries can be told apart (the paper's main theorem; exact binomial tails).

Paths (--path): white-box gradient canaries through the optimizer, clipping and
data-parallel code of the configuration -- "step" (per-sample gradients, step()),
"accumulate" (micro-batches, accumulate()), "ghost" (ghost clipping), "ddp" (--nproc
processes, at least 2), "fsdp" (as ddp, the model sharded by FSDP2, ghost clipping: the
white-box audit of an FSDP2 run) -- and "input": canary blocks of random tokens inserted into the
finetune job's own training data, scored by their loss after training. "auto" (default):
the white-box path that the configuration trains with, then "input"; "all": every path.

Reading the result: a lower bound ABOVE the claimed epsilon proves (at the confidence
level) that the run does not have the claimed guarantee: a bug. A lower bound below it
is expected and proves nothing: the audit is loose (honest runs usually give a bound far
below epsilon). Each white-box path also runs a noise-calibration check: the spread and
shift of the canary scores against those the claimed sigma and C imply (a z-test at level
1e-4 each), which catches a sigma or clip bound that is off by less than the bound can
see; it is a statistical test, not a proof.

Exit codes: 0 every path passes; 1 a lower bound exceeds the claimed epsilon (VIOLATION);
3 a calibration check failed (MISCALIBRATED) and no bound exceeded its claim; 2 bad input
(a one-line error naming the option).

--quick: 500 white-box canaries, and the input path with 256 canary blocks trained for
at most 30 steps (its claim is then the accountant's for those steps): under two minutes
on 2 CPU cores for the default job. Nothing is written except --json.

examples:
  dpkern audit --quick                          # the default finetune job, quickly
  dpkern audit --optimizer dp-sgd --epsilon 3 --clipping per-sample --micro-batch-size 16
  dpkern audit --nproc 2 --path all --json audit.json
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import sys
import time
from pathlib import Path

from .finetune import UsageError
from .finetune.options import add_arguments as add_finetune_arguments

AUDIT_PATHS = ("auto", "step", "accumulate", "ghost", "ddp", "fsdp", "input", "all")
EXIT_PASS, EXIT_VIOLATION, EXIT_USAGE, EXIT_MISCALIBRATED = 0, 1, 2, 3
QUICK = {"canaries": 500, "input_canaries": 256, "input_steps": 30}
DEFAULTS = {"canaries": 1000, "input_canaries": 1000}
#: finetune options an audit has no use for (it trains a new run and saves nothing).
REFUSED = {
    "resume": "an audit trains its own run (audit the configuration, not a checkpoint)",
    "out": "an audit saves no model (use --json for its report)",
    "save_every": "an audit saves no checkpoint",
    "overwrite": "an audit writes no run directory",
    "fsdp": "an audit does not run the job sharded: drop --fsdp; --path fsdp audits the "
    "FSDP2 path with white-box canaries (--nproc processes)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """finetune's options, then the audit's own."""
    add_finetune_arguments(parser)
    for action in parser._actions:  # refused below: not listed in --help
        if action.dest in REFUSED:
            action.help = argparse.SUPPRESS
    g = parser.add_argument_group("audit")
    g.add_argument(
        "--path",
        choices=AUDIT_PATHS,
        default="auto",
        help="what to audit (default auto: the configuration's white-box path, then input)",
    )
    g.add_argument(
        "--canaries",
        type=int,
        metavar="M",
        help=f"white-box canaries per path (default {DEFAULTS['canaries']}; "
        f"--quick {QUICK['canaries']})",
    )
    g.add_argument(
        "--input-canaries",
        type=int,
        metavar="M",
        help=f"canary blocks of the input path (default {DEFAULTS['input_canaries']}; "
        f"--quick {QUICK['input_canaries']})",
    )
    g.add_argument(
        "--confidence",
        type=float,
        default=0.95,
        help="confidence of the lower bound (default 0.95)",
    )
    g.add_argument(
        "--quick",
        action="store_true",
        help="fewer canaries, the input path at most 30 steps (under 2 min on 2 CPU cores)",
    )
    g.add_argument("--json", metavar="PATH", help="also write the report as JSON (- = stdout)")


def run(args: argparse.Namespace) -> int:
    """Run ``dpkern audit``; the exit code (see the module docstring)."""
    try:
        return _run(args)
    except UsageError as exc:
        print(f"dpkern audit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _check(args) -> None:
    for name, why in REFUSED.items():
        value = getattr(args, name, None)
        if value not in (None, False):
            raise UsageError("--" + name.replace("_", "-"), why)
    for name in ("canaries", "input_canaries"):
        v = getattr(args, name)
        if v is not None and v < 2:
            raise UsageError("--" + name.replace("_", "-"), f"must be >= 2, got {v}")
    if not (math.isfinite(args.confidence) and 0.5 <= args.confidence < 1.0):
        raise UsageError("--confidence", f"must be in [0.5, 1), got {args.confidence}")
    if args.lr is not None and not args.lr > 0:
        raise UsageError("--lr", "must be > 0 for an audit (with lr 0 nothing is released)")


def choose_paths(args, clipping: str) -> list[str]:
    """The paths to run, in order (input last: it trains the prepared job)."""
    if args.path == "all":
        return ["step", "accumulate", "ghost", "ddp", "fsdp", "input"]
    if args.path != "auto":
        return [args.path]
    if args.nproc > 1:
        return ["ddp", "input"]
    return ["ghost" if clipping == "ghost" else "accumulate", "input"]


def _run(args) -> int:
    _check(args)
    logging.getLogger("absl").setLevel(logging.ERROR)
    from ..audit import _rng, audit_whitebox
    from ..audit.inputs import audit_job
    from .finetune.job import make_optimizer, prepare

    t0 = time.perf_counter()
    job = prepare(args)  # every finetune check; notes on stderr
    plan = job.plan
    beta = 1.0 - args.confidence
    m = args.canaries or (QUICK if args.quick else DEFAULTS)["canaries"]
    m_input = args.input_canaries or (QUICK if args.quick else DEFAULTS)["input_canaries"]
    rng = _rng(plan.seed)
    paths = choose_paths(args, args.clipping)
    factory = functools.partial(
        make_optimizer, plan, backend=args.backend, sigma=plan.noise_multiplier
    )
    results, skipped = [], []
    for path in paths:
        if path == "input":
            continue
        if path in ("ghost", "fsdp") and plan.optimizer == "dp-macadam":
            skipped.append(f"{path}: dp-macadam cannot use ghost clipping")
            continue
        if path in ("ddp", "fsdp") and job.device.type != "cpu":
            skipped.append(f"{path}: the white-box {path} path runs on CPU (gloo) only")
            continue
        clipping = args.clipping if plan.optimizer != "dp-macadam" else "per-sample"
        if not args.quiet:
            print(f"dpkern audit: white-box path {path} ...", file=sys.stderr, flush=True)
        results.append(
            audit_whitebox(
                factory,
                sample_rate=plan.sample_rate,
                steps=job.steps,
                delta=job.delta,
                path=path,
                canaries=m,
                accountant=plan.accountant,
                beta=beta,
                micro_batch_size=job.micro,
                clipping=clipping,
                nproc=max(2, args.nproc),
                seed=None if plan.seed is None else int(rng.integers(2**62)),
                label=plan.optimizer,
                device=str(job.device),
            )
        )
    if "input" in paths:
        if not args.quiet:
            print("dpkern audit: input path (the finetune job) ...", file=sys.stderr, flush=True)
        steps = min(job.steps, QUICK["input_steps"]) if args.quick else None
        results.append(
            audit_job(args, job, canaries=m_input, delta=job.delta, beta=beta, rng=rng, steps=steps)
        )
    if any(r.violation for r in results):
        code = EXIT_VIOLATION
    elif any(not r.calibration.ok for r in results):
        code = EXIT_MISCALIBRATED
    else:
        code = EXIT_PASS
    report = {
        "confidence": args.confidence,
        "target_epsilon": plan.epsilon,
        "delta": job.delta,
        "noise_multiplier": plan.noise_multiplier,
        "private": plan.noise_seed is None,
        "results": [r.to_dict() for r in results],
        "skipped": skipped,
        "exit_code": code,
        "seconds": time.perf_counter() - t0,
    }
    print(format_table(results, args.confidence, job.delta, skipped))
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return code


def format_table(results, confidence: float, delta: float, skipped=()) -> str:
    """The report: one row per audited path, then how to read it."""
    head = ("path", "optimizer", "backend", "m", "T", "eps lower bound", "claimed eps", "verdict")
    rows = [
        (
            r.path,
            r.optimizer,
            r.backend,
            str(r.canaries),
            str(r.steps),
            f"{r.bound.epsilon:.3f}",
            f"{r.epsilon_claimed:.3f}",
            r.verdict,
        )
        for r in results
    ]
    width = [max(len(x) for x in col) for col in zip(head, *rows)]

    def line(cells):
        return "  ".join(c.ljust(w) for c, w in zip(cells, width)).rstrip()

    out = [
        f"dpkern audit: one-run privacy audit (Steinke, Nasr & Jagielski 2023), "
        f"{confidence:.0%} confidence, delta {delta:.3g}",
        line(head),
        line(["-" * w for w in width]),
        *(line(r) for r in rows),
        "noise calibration (white-box: canary score spread and shift vs what sigma and C imply):",
        *(f"  {r.path}: {r.calibration.summary()}" for r in results),
    ]
    for r in results:
        out += [f"  note ({r.path}): {n}" for n in r.notes]
    out += [f"  skipped {s}" for s in skipped]
    if any(r.violation for r in results):
        out.append(
            "VIOLATION: a lower bound exceeds the claimed epsilon: this setup does NOT have "
            "the claimed guarantee (a bug in the noise, clipping or accounting)."
        )
    else:
        out.append(
            "No bound exceeds its claim. That is expected of an honest run and proves no "
            "privacy: the one-run bound is loose (see README, 'Auditing your setup')."
        )
    if any(not r.calibration.ok for r in results):
        out.append(
            "MISCALIBRATED: the canary scores are not distributed as the claimed sigma and "
            "C imply (a statistical test at the level shown, not a proof)."
        )
    return "\n".join(out)
