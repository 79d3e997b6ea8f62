"""Where the time of one ghost-clipped DP step goes, phase by phase, against the
non-private step: the measurement behind the speed notes of issues 13 and 16.

    python -m bench.ghost_breakdown                          # llama and gpt2, 16 x 64
    python -m bench.ghost_breakdown --models llama-lora --blocks 64 128 --threads 2

Per model, block and batch, a non-private step and a ghost step (each on its own copy of
the same seeded model and the same token blocks as :mod:`bench.ghost_e2e`) run
alternately for ``--repeats`` rounds after ``--warmup`` untimed ones; each phase is timed
by ``time.perf_counter`` around it, and the table gives each phase's median (ms). CPU
only: on a GPU the phases would need a device synchronisation each, which changes what is
measured.

Phases of the non-private step: ``forward``, ``loss`` (``token_loss(...).mean()``),
``backward`` (autograd, weight gradients included), ``optimizer step`` (AdamW), plus
``zero_grad``. Phases of the ghost step (:class:`dpkern.ghost.GhostClipping` with
``verify="off"``, :class:`dpkern.DPAdamW`):

- ``forward``: with the capture active; ``of which capture``: that forward minus the
  same model's forward with the capture detached (timed in the same round);
- ``loss``: the per-sample ``token_loss``;
- ``backward``: :meth:`Capture.backward` (autograd through the recorded edges, without
  the summed gradients of the weights formed per sample, plus the per-sample gradients
  formed during it);
- ``form kept + norms``: :class:`dpkern.ghost.plan.Plan` (the kept per-sample gradients
  formed after the backward, and their squared norms);
- ``total norms``, ``clipped sums``: ``Plan.norm_sq`` and ``Plan.sums``;
- ``clip factors, checks``: the rest of ``GhostClipping.backward``;
- ``accumulate``: ``optimizer.accumulate_clipped``; ``optimizer step``: noise + AdamW.

The phases are disjoint parts of one step, so their medians add up to about the step's
median (printed as ``sum of phases`` beside the measured ``step``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch

import dpkern
from dpkern.models import CausalLMLogits, token_loss

from .ghost_e2e import DEFAULT_BATCHES
from .ghost_models import E2E_MODELS, MODEL_TITLES, _batch_ids, _seeded_model, trainable
from .harness import KEY, LR, WEIGHT_DECAY, machine_info, set_threads

NONPRIVATE = ("zero_grad", "forward", "loss", "backward", "optimizer step")
GHOST = (
    "forward",
    "of which capture",
    "loss",
    "backward",
    "form kept + norms",
    "total norms",
    "clipped sums",
    "clip factors, checks",
    "accumulate",
    "optimizer step",
)
#: ghost phases inside ``GhostClipping.backward`` (the rest of it is "clip factors, checks")
_INSIDE = ("backward", "form kept + norms", "total norms", "clipped sums", "accumulate")


class _Clock:
    """Seconds per phase of one step (``with clock("name"): ...``; nested phases are
    timed separately and subtracted by the caller)."""

    def __init__(self):
        self.t: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            with self(name):
                return fn(*args, **kwargs)

        return timed


@contextlib.contextmanager
def _timed_plan(clock: _Clock):
    """Time :class:`~dpkern.ghost.plan.Plan`'s construction, ``norm_sq`` and ``sums``."""
    from dpkern.ghost import plan as plan_mod

    cls = plan_mod.Plan
    saved = {k: cls.__dict__[k] for k in ("__init__", "norm_sq", "sums")}
    names = {"__init__": "form kept + norms", "norm_sq": "total norms", "sums": "clipped sums"}
    try:
        for k, fn in saved.items():
            setattr(cls, k, clock.wrap(names[k], fn))
        yield
    finally:
        for k, fn in saved.items():
            setattr(cls, k, fn)


def breakdown(
    model: str = "llama",
    block: int = 64,
    batch: int = 16,
    *,
    repeats: int = 7,
    warmup: int = 2,
    sigma: float = 1.0,
    clip: float = 1.0,
    model_kw: dict | None = None,
) -> dict:
    """Medians (seconds) of every phase of the non-private and the ghost step of ``model``
    (a name of :data:`bench.ghost_models.E2E_MODELS`) on ``[batch, block]`` token blocks,
    on CPU: {"model", "block", "batch", "nonprivate": {phase: s}, "ghost": {phase: s},
    "nonprivate_step_s", "ghost_step_s" (medians of the whole steps), "ratio"}.
    ``model_kw``: shape overrides of :func:`bench.ghost_models.build_model` (tests)."""
    from dpkern.ghost import GhostClipping

    base = _seeded_model(model, block, model_kw)
    ids = _batch_ids(block, batch)
    net = CausalLMLogits(copy.deepcopy(base))
    adamw = torch.optim.AdamW(trainable(net), lr=LR, weight_decay=WEIGHT_DECAY)
    g_net = CausalLMLogits(copy.deepcopy(base))
    g_opt = dpkern.DPAdamW(
        trainable(g_net),
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=clip,
        noise_multiplier=sigma,
        expected_batch_size=batch,
        seed=KEY,
    )
    ghost = GhostClipping(g_net, g_opt, verify="off").attach()
    clock = _Clock()
    cap_backward = ghost.capture.backward
    ghost.capture.backward = clock.wrap("backward", cap_backward)
    accumulate, dp_step = g_opt.accumulate_clipped, g_opt.step
    g_opt.accumulate_clipped = clock.wrap("accumulate", accumulate)

    def nonprivate():
        with clock("zero_grad"):
            adamw.zero_grad(set_to_none=True)
        with clock("forward"):
            out = net(ids)
        with clock("loss"):
            loss = token_loss(out, ids).mean()
        with clock("backward"):
            loss.backward()
        with clock("optimizer step"):
            adamw.step()

    def ghost_step():
        with clock("re-attach"):  # (not part of a step: subtracted below)
            ghost.detach()
        with clock("idle forward"):
            g_net(ids)  # the same forward without the capture (its graph is dropped)
        with clock("re-attach"):
            ghost.attach()
        with clock("forward"):
            out = g_net(ids)
        with clock("loss"):
            losses = token_loss(out, ids)
        with clock("ghost backward"):
            ghost.backward(losses)
        with clock("optimizer step"):
            dp_step()

    rows = {"nonprivate": {k: [] for k in NONPRIVATE}, "ghost": {k: [] for k in GHOST}}
    steps = {"nonprivate": [], "ghost": []}
    try:
        with _timed_plan(clock), torch.enable_grad():
            for r in range(warmup + repeats):
                order = [("nonprivate", nonprivate), ("ghost", ghost_step)]
                for name, fn in order if r % 2 == 0 else order[::-1]:
                    clock.t = {}
                    t0 = time.perf_counter()
                    fn()
                    total = time.perf_counter() - t0
                    if r < warmup:
                        continue
                    t = clock.t
                    if name == "ghost":
                        total -= t["idle forward"] + t["re-attach"]
                        t["of which capture"] = t["forward"] - t["idle forward"]
                        t["clip factors, checks"] = t["ghost backward"] - sum(
                            t.get(k, 0.0) for k in _INSIDE
                        )
                    steps[name].append(total)
                    for k in rows[name]:
                        rows[name][k].append(t.get(k, 0.0))
    finally:
        ghost.detach()
    res = {"model": model, "block": block, "batch": batch}
    for name in rows:
        res[name] = {k: statistics.median(v) for k, v in rows[name].items()}
        res[f"{name}_step_s"] = statistics.median(steps[name])
    res["ratio"] = res["ghost_step_s"] / res["nonprivate_step_s"]
    return res


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def markdown(res: dict) -> str:
    """One table: each phase's median (ms) in the two steps, then their sums and the
    measured steps."""
    npv, gh = res["nonprivate"], res["ghost"]
    lines = [
        f"{MODEL_TITLES.get(res['model'], res['model'])}, B {res['batch']} x block "
        f"{res['block']}: ghost step / non-private step = {res['ratio']:.2f}x",
        "",
        "| phase | non-private ms | ghost ms |",
        "|---|---|---|",
    ]
    for k in dict.fromkeys(NONPRIVATE[:1] + GHOST):
        if k == "of which capture":
            lines.append(f"| (of which capture) | – | {_ms(gh[k])} |")
            continue
        a = _ms(npv[k]) if k in npv else "–"
        b = _ms(gh[k]) if k in gh else "–"
        lines.append(f"| {k} | {a} | {b} |")
    sum_np = sum(npv.values())
    sum_gh = sum(v for k, v in gh.items() if k != "of which capture")
    lines.append(f"| sum of phases | {_ms(sum_np)} | {_ms(sum_gh)} |")
    lines.append(
        f"| step (measured) | {_ms(res['nonprivate_step_s'])} | {_ms(res['ghost_step_s'])} |"
    )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(
        prog="python -m bench.ghost_breakdown", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--models",
        nargs="+",
        choices=E2E_MODELS,
        default=["llama", "gpt2"],
        help="models (default: %(default)s)",
    )
    ap.add_argument("--blocks", nargs="+", type=int, default=[64], help="(default: %(default)s)")
    ap.add_argument(
        "--batches",
        nargs="+",
        type=int,
        default=[DEFAULT_BATCHES[0]],
        help="(default: %(default)s)",
    )
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds (default: %(default)s)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    ap.add_argument(
        "--default-malloc",
        action="store_true",
        help="glibc's default malloc (default: freed memory kept, as dpkern finetune runs)",
    )
    ap.add_argument("--quiet", action="store_true", help="print nothing")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or min(args.batches) < 1 or min(args.blocks) < 2:
        ap.error("--repeats and --batches must be >= 1, --warmup >= 0, --blocks >= 2")
    if args.threads:
        set_threads(args.threads)
    if not args.default_malloc:
        from dpkern.cli.heap import keep_freed_memory

        keep_freed_memory()
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    info = machine_info("cpu")
    say(
        f"# ghost step breakdown on {info['cpu']} ({info['cores']} cores, torch threads "
        f"{info['torch_threads']}), load average {info['loadavg'][0]:.1f}; medians of "
        f"{args.repeats} alternating rounds\n"
    )
    out = []
    for model in args.models:
        for block in args.blocks:
            for batch in args.batches:
                res = breakdown(model, block, batch, repeats=args.repeats, warmup=args.warmup)
                out.append(res)
                say(markdown(res) + "\n")
    return out


if __name__ == "__main__":
    main()
