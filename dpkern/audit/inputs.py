"""Input-space canaries for the finetune job: canary blocks in the training data.

Canary j is a block of ``block_size`` uniformly random token ids (fresh for every audit,
so no canary is in the data by accident). Each is appended to the job's training blocks
by a fair coin; the job then trains exactly as ``dpkern finetune`` does (the same
:func:`~dpkern.cli.finetune.job.prepare`, the same loop, Poisson sampling of every block
at the job's rate q): one block is the job's privacy unit, so the accountant's epsilon
for (sigma, q, T) applies to every canary. The auditor sees the initial weights (they
do not depend on the data) and the trained ones: canary j's score is its loss before
minus its loss after training (the mean next-token loss of the block), a black-box
score; the guesses and the bound are those of :mod:`.bound`.

There is no noise model for black-box scores: the calibration check is reported as not
available (the white-box paths carry it). Data-parallel jobs (``--nproc``) are trained
in one process here; their path is audited white-box."""

from __future__ import annotations

import contextlib
import io
import math
import time

import numpy as np
import torch

from . import _faults
from .bound import delta_note, lower_bound_from_scores
from .calibration import not_available


def block_losses(net, blocks: torch.Tensor, batch: int, device) -> np.ndarray:
    """Mean next-token loss of each block [N, T] (eval mode, no grad)."""
    from .. import models

    was = net.training
    net.eval()
    out = []
    with torch.no_grad():
        for i in range(0, blocks.shape[0], batch):
            ids = blocks[i : i + batch].to(device)
            out.append(models.token_loss(net(ids), ids).double().cpu())
    net.train(was)
    return torch.cat(out).numpy()


def vocab_size(job) -> int:
    """Token ids the canaries draw from: the byte alphabet, or the tokenizer's vocab."""
    from .. import models

    if job.tokenizer is None:
        return models.BYTE_VOCAB - 1  # bytes; the end-of-text id is never drawn
    cfg = getattr(job.model, "config", None)
    return int(getattr(cfg, "vocab_size", None) or len(job.tokenizer))


def audit_job(args, job, *, canaries: int, delta: float, beta: float, rng, steps=None):
    """Insert canary blocks into a prepared finetune ``job``, train it (in this process),
    and bound epsilon from the canaries' losses.

    Args:
        args: the finetune options (``dpkern audit`` takes finetune's), already checked.
        job: :func:`dpkern.cli.finetune.job.prepare`'s Job (consumed: it is trained).
        canaries: m. delta: the audited delta. beta: 1 - confidence.
        rng: numpy Generator of the coins, the canary tokens and the tie-breaking.
        steps: train this many steps instead of the job's (its sigma unchanged; the claim
            is then the accountant's for the shorter run).
    Returns: an :class:`dpkern.audit.AuditResult`."""
    from ..accounting import get_epsilon
    from ..cli.finetune.launch import train_with_warnings
    from . import AuditResult, backend_label, coins

    t0 = time.perf_counter()
    plan = job.plan
    if steps is not None and steps < job.steps:
        job.steps = plan.steps = int(steps)
    m = int(canaries)
    gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
    blocks = torch.randint(0, vocab_size(job), (m, plan.block_size), generator=gen)
    included = coins(m, rng)
    before = block_losses(job.net, blocks, args.eval_batch_size, job.device)
    job.train = torch.cat([job.train, blocks[torch.as_tensor(included)]])
    _faults.apply(job.optimizer)
    sigma = float(plan.noise_multiplier)
    with contextlib.redirect_stdout(io.StringIO()):  # finetune's summary is not ours
        code = train_with_warnings(args, job)
    if code != 0:
        raise RuntimeError(f"the finetune job stopped with exit code {code}")
    after = block_losses(job.net, blocks, args.eval_batch_size, job.device)
    bound = lower_bound_from_scores(before - after, included, delta, beta, generator=rng)
    claimed = get_epsilon(sigma, plan.sample_rate, job.steps, delta, plan.accountant)
    notes = [n for n in (delta_note(m, delta, beta),) if n]
    if getattr(args, "nproc", 1) > 1:
        notes.append("input path trained in one process (the ddp path is audited white-box)")
    if plan.noise_seed is not None:
        notes.append("--noise-seed: the noise key is known (the claim assumes it secret)")
    inner = job.optimizer
    return AuditResult(
        path="input",
        optimizer=plan.optimizer,
        backend=backend_label(str(getattr(inner, "backend", args.backend)), job.device),
        canaries=m,
        steps=int(job.steps),
        sample_rate=float(plan.sample_rate),
        noise_multiplier=sigma,
        max_grad_norm=float(plan.max_grad_norm),
        delta=float(delta),
        epsilon_claimed=float(claimed),
        bound=bound,
        calibration=not_available("black-box scores", math.nan, sigma),
        seconds=time.perf_counter() - t0,
        notes=notes,
    )
