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
    """Sets ``p.grad_sample`` for a micro-batch and returns its per-sample losses."""

    def __init__(self, net, mode: str):
        self.mode = mode
        self.net = net
        if mode == "opacus":
            from opacus import GradSampleModule

            self.gsm = GradSampleModule(net, batch_first=True, loss_reduction="sum")

    def __call__(self, ids):
        from ...grad_sample import compute_grad_sample

        if self.mode == "functorch" or ids.shape[0] == 0:
            return compute_grad_sample(self.net, models.sample_loss, ids, ids)
        with warnings.catch_warnings():  # integer inputs: torch notes the hook sees no input grads
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            losses = models.token_loss(self.gsm(ids), ids)
            losses.sum().backward()
        for p in self.net.parameters():
            p.grad = None
        return losses.detach()


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
        why = ghost_probe(net, params, plan.block_size)
    if args.clipping == "ghost":
        require(why is None, "--clipping", why or "")
        return "ghost"
    if args.clipping is None and args.grad_sample != "opacus":
        if why is None:
            return "ghost"
        print(f"dpkern finetune: note: {why}: using --clipping per-sample", file=sys.stderr)
    return "per-sample"


def ghost_probe(net, params, block_size: int) -> str | None:
    """Whether ghost clipping is exact on this model, checked before training: one ghost
    backward with the first-step check (``verify="always"``) on 3 blocks of random token
    ids (never the private data: the answer depends on the model only), through a
    throw-away optimizer that releases nothing. Returns None, or why not (one line)."""
    import dpkern
    from ...ghost import GhostClipping

    vocab = getattr(getattr(net, "model", net), "config", None)
    vocab = getattr(vocab, "vocab_size", models.BYTE_VOCAB)
    gen = torch.Generator().manual_seed(0)
    device = params[0].device
    ids = torch.randint(0, vocab, (3, max(2, min(block_size, 16))), generator=gen).to(device)
    probe = dpkern.DPSGD(
        params,
        lr=0.0,
        max_grad_norm=1e9,
        noise_multiplier=0.0,
        expected_batch_size=3.0,
        backend="torch",
    )
    try:
        with GhostClipping(net, probe, verify="always") as gc:
            gc.clipped_sums(models.token_loss(net(ids), ids))
    except (ValueError, FloatingPointError) as exc:
        first = str(exc).split(". ")[0].split("\n")[0]
        return f"ghost clipping is not exact on this model ({first[:300]})"
    finally:
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

    def __call__(self, ids):
        if ids.shape[0] == 0 and self.placeholder is not None:
            # FSDP2: the forward's all-gathers are collectives; the loss is dropped
            ph = self.placeholder.to(ids.device)
            self.gc.backward(models.token_loss(self.net(ph), ph)[:0])
            return torch.zeros(0, device=ids.device)
        if ids.shape[0] == 0:
            self.gc.add_empty_batch()
            return torch.zeros(0, device=ids.device)
        losses = models.token_loss(self.net(ids), ids)
        self.gc.backward(losses)
        return losses.detach()
