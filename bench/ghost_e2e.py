"""The end-to-end DP fine-tuning step of the ghost bench (:mod:`bench.ghost`, measurement
2): the candidates for one step of a model (non-private AdamW, dpkern's ghost clipping with
and without kept per-sample gradients, dpkern's per-sample path, Opacus' fast gradient
clipping, on an untied copy where Opacus refuses tied weights), the one-time cost of ghost
clipping's first-step check, the summary row of one model, block and batch, and issue 16's
goals for that row. The models themselves come from :mod:`bench.ghost_models`."""

from __future__ import annotations

import copy
import time

import torch

import dpkern
from dpkern.models import CausalLMLogits, sample_loss, token_loss

from . import synchronize
from .ghost_models import (
    MODEL_PROSE,
    MODEL_TITLES,
    _batch_ids,
    _opacus_step,
    _quiet,
    _seeded_model,
    _tied,
    _untied_copy,
    is_lora,
    opacus_modes,
    trainable,
)
from .harness import KEY, LR, WEIGHT_DECAY, Candidate

DEFAULT_BLOCKS = (64, 128)
DEFAULT_BATCHES = (16, 32)
#: Issue 16's goals for one DP step on CPU (see :func:`goals`): ghost step / non-private
#: step at most 1.25x (full fine-tuning) or 1.10x (LoRA); Opacus' fast gradient clipping /
#: ghost step at least 2x; the ghost step's peak extra bytes / the non-private step's at
#: most 1.2x.
GOAL_GHOST_RATIO = {"full": 1.25, "lora": 1.10}
GOAL_OPACUS_OVER_GHOST = 2.0
GOAL_PEAK_RATIO = 1.2
E2E_ROLES = (
    "floor:nonprivate",
    "dpkern:ghost",
    "dpkern:ghost-gram",
    "dpkern:per_sample",
    "baseline:opacus",
    "baseline:opacus-untied",
)


def e2e_candidates(
    block: int,
    batch: int,
    device,
    *,
    sigma: float = 1.0,
    clip: float = 1.0,
    model_kw: dict | None = None,
    opacus: bool = True,
    model: str = "gpt2",
) -> tuple[list[Candidate], list[str], int]:
    """(candidates, notes, trainable parameter count) for one DP step of
    ``build_model(model, block, **model_kw)`` (default: the default GPT-2) on random ids
    ``[batch, block]`` (the same ids for every model).

    Each candidate owns a deep copy of the same initial model (its ``.model`` attribute)
    and its optimizer (``.optimizer``, over the trainable parameters only: the LoRA
    adapters of a LoRA model). The Opacus candidate is probed with one step at build time; when
    Opacus refuses the model the refusal goes to the notes (and, for tied weights, an
    untied copy is used instead; see the module docstring)."""
    device = torch.device(device)
    base = _seeded_model(model, block, model_kw).to(device)
    ids = _batch_ids(block, batch).to(device)
    n_params = sum(p.numel() for p in trainable(base))
    title = MODEL_PROSE.get(model, model)
    cands, notes = [], []
    if is_lora(model):
        cfg = base.peft_config["default"]
        share = n_params / sum(p.numel() for p in base.parameters())
        notes.append(  # (the same for every block: a note once per model)
            f"{MODEL_TITLES[model]}: peft LoRA r {cfg.r}, alpha {cfg.lora_alpha:g}, dropout "
            f"{cfg.lora_dropout:g} on {', '.join(sorted(cfg.target_modules))}: {n_params:,} "
            f"trainable parameters (~{share:.0%} of the model; every optimizer holds only "
            "these, the base is frozen)"
        )

    net = CausalLMLogits(copy.deepcopy(base))
    adamw = torch.optim.AdamW(trainable(net), lr=LR, weight_decay=WEIGHT_DECAY)

    def nonprivate():
        adamw.zero_grad(set_to_none=True)
        token_loss(net(ids), ids).mean().backward()
        adamw.step()

    cands.append(Candidate("floor", "nonprivate", _quiet(nonprivate)))
    cands[-1].model, cands[-1].optimizer = net, adamw

    def dp_opt(model):
        return dpkern.DPAdamW(
            trainable(model),
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            max_grad_norm=clip,
            noise_multiplier=sigma,
            expected_batch_size=batch,
            seed=KEY,
        )

    from dpkern.ghost import GhostClipping

    g_net = CausalLMLogits(copy.deepcopy(base))
    g_opt = dp_opt(g_net)
    # hooks live as long as the candidate; the one-time first-step check is timed apart
    ghost = GhostClipping(g_net, g_opt, verify="off").attach()

    def ghost_step():
        ghost.backward(token_loss(g_net(ids), ids))
        g_opt.step()

    cands.append(Candidate("dpkern", "ghost", _quiet(ghost_step)))
    cands[-1].model, cands[-1].optimizer = g_net, g_opt

    gg_net = CausalLMLogits(copy.deepcopy(base))
    gg_opt = dp_opt(gg_net)
    ghost_gram = GhostClipping(gg_net, gg_opt, verify="off", keep_bytes=0).attach()

    def ghost_gram_step():
        ghost_gram.backward(token_loss(gg_net(ids), ids))
        gg_opt.step()

    cands.append(Candidate("dpkern", "ghost-gram", _quiet(ghost_gram_step)))
    cands[-1].model, cands[-1].optimizer = gg_net, gg_opt

    from dpkern.grad_sample import compute_grad_sample

    p_net = CausalLMLogits(copy.deepcopy(base))
    p_opt = dp_opt(p_net)

    def per_sample_step():
        compute_grad_sample(p_net, sample_loss, ids, ids)
        p_opt.step()

    cands.append(Candidate("dpkern", "per_sample", _quiet(per_sample_step)))
    cands[-1].model, cands[-1].optimizer = p_net, p_opt

    if opacus:
        try:
            import opacus as _opacus  # noqa: F401
        except ImportError:
            notes.append("Opacus not installed: no Opacus candidate")
            return cands, notes, n_params
        modes = opacus_modes(base)
        what = {
            "ghost": "ghost norms",
            "hooks": "per-sample gradients by its hooks",
            "functorch": "per-sample gradients by its functorch fallback",
        }
        notes.append(
            f"Opacus on the {title}: "
            + "; ".join(f"{what[k]} for {', '.join(v)}" for k, v in modes.items())
        )
        variants = [("opacus", lambda: copy.deepcopy(base))]
        if _tied(base):
            variants.append(("opacus-untied", lambda: _untied_copy(base)))
        for variant, make in variants:
            m = make()
            try:
                step = _opacus_step(m, batch, ids, sigma=sigma, clip=clip)
                step()  # probe: Opacus raises in its hooks on models it cannot serve
            except (NotImplementedError, ValueError, RuntimeError) as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                notes.append(
                    f"Opacus fast gradient clipping ({variant}) refused the "
                    f"{title}: {type(exc).__name__}: {first}"
                )
                if "tying" not in first:
                    break  # an untied copy would not help
                continue
            if variant == "opacus-untied":
                notes.append(
                    f"baseline:opacus-untied runs on a copy of the {title} with an "
                    f"untied lm-head (+{base.get_output_embeddings().weight.numel()} "
                    "parameters; the same FLOPs)"
                )
            cands.append(Candidate("baseline", variant, step))
            cands[-1].model, cands[-1].optimizer = m, step.optimizer
            break
    return cands, notes, n_params


def verify_cost(
    block: int,
    batch: int,
    device,
    *,
    sigma: float = 1.0,
    clip: float = 1.0,
    model_kw: dict | None = None,
    model: str = "gpt2",
) -> dict:
    """The one-time cost of ghost clipping's first-step check (``verify="first"``) on the
    e2e workload: one ghost DP step of a fresh copy of the same model and batch.

    Returns: {"verify_s": the check's wall time (``GhostClipping.verify_seconds``),
    "first_step_s": that whole first step (check included)}."""
    from dpkern.ghost import GhostClipping

    device = torch.device(device)
    net = CausalLMLogits(_seeded_model(model, block, model_kw).to(device))
    ids = _batch_ids(block, batch).to(device)
    opt = dpkern.DPAdamW(
        trainable(net),
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=clip,
        noise_multiplier=sigma,
        expected_batch_size=batch,
        seed=KEY,
    )
    with GhostClipping(net, opt) as ghost:

        def step():
            ghost.backward(token_loss(net(ids), ids))
            opt.step()

        synchronize(device)
        t0 = time.perf_counter()
        _quiet(step)()
        synchronize(device)
        first = time.perf_counter() - t0
    if not ghost.verified:
        raise AssertionError("ghost bench: the first-step check did not run")
    return {"verify_s": ghost.verify_seconds, "first_step_s": first}


def e2e_row(
    block: int,
    batch: int,
    n_params: int,
    medians: dict[str, float],
    peaks: dict[str, int | None],
    verify: dict | None = None,
    model: str = "gpt2",
) -> dict:
    """One summary row of ``model``: medians (s), ratios to the non-private step, peak
    extra bytes (and the part beyond the non-private step's peak); with ``verify`` (see
    :func:`verify_cost`) the first-step check's seconds and its ratio to the ghost step."""
    base = medians["floor:nonprivate"]
    base_peak = peaks.get("floor:nonprivate")
    row = dict(model=model, block=block, batch=batch, params=n_params)
    for name in E2E_ROLES:
        key = name.split(":")[1].replace("-", "_")
        t = medians.get(name)
        row[f"{key}_s"] = t
        row[f"{key}_ratio"] = t / base if t is not None else None
        pk = peaks.get(name)
        row[f"{key}_peak_bytes"] = pk
        row[f"{key}_peak_over_nonprivate_bytes"] = (
            pk - base_peak if pk is not None and base_peak is not None else None
        )
    v = (verify or {}).get("verify_s")
    row["verify_s"] = v
    row["verify_over_ghost"] = v / row["ghost_s"] if v is not None and row["ghost_s"] else None
    row.update(goals(row))
    return row


def goals(row: dict) -> dict:
    """Issue 16's goals for one e2e row (see :data:`GOAL_GHOST_RATIO`): {
    "goal_ghost_ratio": the bound on ghost / non-private (1.25 full fine-tuning, 1.10
    LoRA), "goal_ghost_met"; "opacus_over_ghost": Opacus' fast gradient clipping step /
    the ghost step (its untied copy where Opacus refuses the tied model), "goal_opacus_met"
    (>= 2); "peak_ratio": the ghost step's peak extra bytes / the non-private step's (the
    memory one step adds on top of the model, its optimizer states and the batch, measured
    in a fresh process on CPU), "goal_peak_met" (<= 1.2)}. A ``*_met`` is None where its
    figure is missing."""
    bound = GOAL_GHOST_RATIO["lora" if is_lora(row.get("model", "gpt2")) else "full"]
    ghost, ratio = row.get("ghost_s"), row.get("ghost_ratio")
    opacus = row.get("opacus_s") if row.get("opacus_s") is not None else row.get("opacus_untied_s")
    over = opacus / ghost if opacus is not None and ghost else None
    gp, npk = row.get("ghost_peak_bytes"), row.get("nonprivate_peak_bytes")
    peak = gp / npk if gp is not None and npk else None

    def met(value, ok):
        return None if value is None else bool(ok(value))

    return {
        "goal_ghost_ratio": bound,
        "goal_ghost_met": met(ratio, lambda r: r <= bound),
        "opacus_over_ghost": over,
        "goal_opacus_met": met(over, lambda r: r >= GOAL_OPACUS_OVER_GHOST),
        "peak_ratio": peak,
        "goal_peak_met": met(peak, lambda r: r <= GOAL_PEAK_RATIO),
    }
