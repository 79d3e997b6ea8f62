"""How the finetune job clips: per-sample gradients (torch.func or Opacus'
GradSampleModule) or ghost clipping (dpkern.ghost), chosen per model; ghost clipping is
probed on random token ids before training (never on the private data)."""

from __future__ import annotations

import sys
import warnings

import torch

from ... import models
from .options import require
from .plan import Plan


class PerSample:
    """Sets ``p.grad_sample`` for a micro-batch and returns its per-sample losses.

    ``mask`` (bool ``[B]``, fixed-shape batches): padding rows are run (static shapes)
    and then dropped from ``p.grad_sample`` and the losses, so they reach neither the
    norms nor the counts. :meth:`units` clips a privacy unit's blocks together."""

    def __init__(self, net, mode: str, loop: bool = False):
        self.mode = mode
        self.net = net
        self.method = "loop" if loop else "auto"  # (gradient checkpointing: no vmap)
        if mode == "opacus":
            from opacus import GradSampleModule

            self.gsm = GradSampleModule(net, batch_first=True, loss_reduction="sum")

    def _params(self):
        return [p for p in self.net.parameters() if p.requires_grad]

    def __call__(self, ids, mask=None):
        from ...grad_sample import compute_grad_sample

        if self.mode == "functorch" or ids.shape[0] == 0:
            losses = compute_grad_sample(self.net, models.sample_loss, ids, ids, method=self.method)
        else:
            with warnings.catch_warnings():  # integer inputs: the hook sees no input grads
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                losses = models.token_loss(self.gsm(ids), ids)
                weights = losses if mask is None else losses * mask.to(losses.dtype)
                weights.sum().backward()
            for p in self.net.parameters():
                p.grad = None
            losses = losses.detach()
        if mask is not None:
            keep = mask.to(ids.device)
            for p in self._params():
                if getattr(p, "grad_sample", None) is not None:
                    p.grad_sample = p.grad_sample[keep]
            losses = losses[keep]
        return losses

    def units(self, ids, unit_ids, micro: int):
        """Per-unit rows for whole privacy units: ``ids`` ``[R, T]`` holds the blocks of
        one or more units (``unit_ids`` ``[R]``, contiguous per unit). Per-sample
        gradients are computed ``micro`` rows at a time and summed per unit (also across
        passes, for a unit of more than ``micro`` blocks), then ``p.grad_sample`` is set to
        ``[units, *p.shape]``: the optimizer clips ||sum of the unit's gradients||.
        Returns the per-block losses."""
        from ...sampling import group_grad_samples

        params = self._params()
        running, running_ids, losses = None, None, []
        for s in range(0, ids.shape[0], micro):
            sub_units = unit_ids[s : s + micro]
            losses.append(self(ids[s : s + micro]))
            rows = group_grad_samples([p.grad_sample for p in params], sub_units)
            for p in params:
                p.grad_sample = None
            ids_here = torch.unique(sub_units)
            if running is not None:
                rows = [None if a is None else torch.cat([a, b]) for a, b in zip(running, rows)]
                ids_here = torch.cat([running_ids, ids_here])
                rows = group_grad_samples(rows, ids_here)
                ids_here = torch.unique(ids_here)
            running, running_ids = rows, ids_here
        for p, g in zip(params, running or [None] * len(params)):
            p.grad_sample = g
        return torch.cat(losses) if losses else torch.zeros(0)


def unit_chunks(unit_ids: torch.Tensor, micro: int) -> list[tuple[int, int]]:
    """Row ranges ``(start, end)`` of whole units, each at most ``micro`` rows unless it
    is a single unit with more (then :meth:`PerSample.units` sums its passes).
    ``unit_ids`` is contiguous per unit (the sampler groups rows by unit)."""
    if unit_ids.numel() == 0:
        return []
    _, counts = torch.unique_consecutive(unit_ids, return_counts=True)
    chunks, start, size = [], 0, 0
    for c in counts.tolist():
        if size and size + c > micro:
            chunks.append((start, start + size))
            start, size = start + size, 0
        size += c
    chunks.append((start, start + size))
    return chunks


UNITS_NEED_PER_SAMPLE = (
    "ghost clipping clips each block alone; --privacy-unit document/user clips the sum "
    "of a unit's blocks, which needs per-sample gradients (--clipping per-sample, "
    "without --fsdp)"
)


FSDP_NEEDS_GHOST = (
    "needs ghost clipping (dp-macadam and --clipping per-sample materialise "
    "per-sample gradients, which the finetune job does not shard)"
)


def choose_clipping(args, plan: Plan, net, params) -> str:
    """--clipping: ghost by default where dpkern.ghost covers every trainable layer;
    dp-macadam (whitened clipping) and --grad-sample opacus need per-sample gradients."""
    from ... import rules
    from ...ghost import supports

    ghost_ok = rules.by_cli_name(plan.optimizer).ghost  # False: dp-macadam
    require(
        not getattr(args, "fsdp", False) or (ghost_ok and args.clipping != "per-sample"),
        "--fsdp",
        FSDP_NEEDS_GHOST,
    )
    if plan.privacy_unit != "block":
        # a unit's norm is ||sum of its blocks' gradients||: per-sample gradients, summed
        require(not getattr(args, "fsdp", False), "--fsdp", UNITS_NEED_PER_SAMPLE)
        require(args.clipping != "ghost", "--clipping", UNITS_NEED_PER_SAMPLE)
        if args.clipping is None:
            print(
                f"dpkern finetune: note: --privacy-unit {plan.privacy_unit} clips the sum of "
                "a unit's per-block gradients: using --clipping per-sample",
                file=sys.stderr,
            )
        return "per-sample"
    if not ghost_ok:
        require(
            args.clipping != "ghost",
            "--clipping",
            f"ghost clipping cannot serve {plan.optimizer} (it clips whitened per-sample "
            "gradients); use per-sample",
        )
        if args.clipping is None:
            print(
                f"dpkern finetune: note: {plan.optimizer} clips whitened per-sample "
                "gradients: using --clipping per-sample",
                file=sys.stderr,
            )
        return "per-sample"
    ok, uncovered = supports(net, params)
    why = "ghost clipping does not cover " + ", ".join(uncovered) if not ok else None
    if (
        why is None
        and args.clipping != "per-sample"
        and args.grad_sample != "opacus"
        and not getattr(args, "fsdp", False)
    ):
        why = ghost_probe(
            net, params, plan.block_size, train=bool(getattr(args, "gradient_checkpointing", 0))
        )
    if args.clipping == "ghost":
        require(why is None, "--clipping", why or "")
        return "ghost"
    if args.clipping is None and args.grad_sample != "opacus":
        if why is None:
            return "ghost"
        print(f"dpkern finetune: note: {why}: using --clipping per-sample", file=sys.stderr)
    return "per-sample"


def ghost_probe(net, params, block_size: int, train: bool = False) -> str | None:
    """Whether ghost clipping is exact on this model, checked before training: one ghost
    backward with the first-step check (``verify="always"``) on 3 blocks of random token
    ids (never the private data: the answer depends on the model only), through a
    throw-away optimizer that releases nothing. ``train``: probe in training mode (where
    gradient checkpointing recomputes the blocks in the backward). Returns None, or why
    not (one line)."""
    import dpkern
    from ...ghost import GhostClipping

    vocab = getattr(getattr(net, "model", net), "config", None)
    vocab = getattr(vocab, "vocab_size", models.BYTE_VOCAB)
    gen = torch.Generator().manual_seed(0)
    device = params[0].device
    ids = torch.randint(0, vocab, (3, max(2, min(block_size, 16))), generator=gen).to(device)
    with warnings.catch_warnings():  # a probe: no step is released, no noise is due
        warnings.filterwarnings("ignore", message="dpkern: noise_multiplier=0")
        probe = dpkern.DPSGD(
            params,
            lr=0.0,
            max_grad_norm=1e9,
            noise_multiplier=0.0,
            expected_batch_size=3.0,
            backend="torch",
        )
    was_training = net.training
    net.train(train or was_training)
    try:
        with GhostClipping(net, probe, verify="always") as gc:
            gc.clipped_sums(models.token_loss(net(ids), ids))
    except (ValueError, FloatingPointError) as exc:
        first = str(exc).split(". ")[0].split("\n")[0]
        return f"ghost clipping is not exact on this model ({first[:300]})"
    finally:
        net.train(was_training)
        for p in params:
            p.grad = None
    return None


class Ghost:
    """Ghost clipping + book-keeping (dpkern.ghost): one backward per micro-batch adds its
    clipped sum into the optimizer's buffers; returns the per-sample losses."""

    accumulates = True  # the micro-batch is already in the optimizer's buffers

    def __init__(self, net, optimizer, placeholder=None):
        from ...ghost import GhostClipping

        self.gc = GhostClipping(net, optimizer).attach()
        self.net = net
        self.placeholder = placeholder  # FSDP2: one block run by a rank without samples

    def __call__(self, ids, mask=None):
        """``mask`` (fixed-shape batches): padding rows' losses are multiplied by 0, so
        their gradients, norms and clipped contributions are exactly 0."""
        if ids.shape[0] == 0 and self.placeholder is not None:
            # FSDP2: the forward's all-gathers are collectives; the loss is dropped
            ph = self.placeholder.to(ids.device)
            self.gc.backward(models.token_loss(self.net(ph), ph)[:0])
            return torch.zeros(0, device=ids.device)
        if ids.shape[0] == 0:
            self.gc.add_empty_batch()
            return torch.zeros(0, device=ids.device)
        losses = models.token_loss(self.net(ids), ids)
        if mask is None:
            self.gc.backward(losses)
            return losses.detach()
        keep = mask.to(losses.device)
        self.gc.backward(losses * keep.to(losses.dtype))
        return losses.detach()[keep]
