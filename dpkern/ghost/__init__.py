"""Ghost clipping + book-keeping: DP fine-tuning without per-sample gradients.

Per-sample gradients cost B x (model size) memory. Ghost clipping computes each sample's
gradient norm from every layer's input A and output gradient G (:mod:`.norms`), and
book-keeping builds the clipped sum ``sum_i c_i g_i`` as one GEMM per layer
(:mod:`.bookkeeping`), both from ONE backward pass (:mod:`.capture`). Where a layer's
per-sample gradients are cheaper to form than its Gram norm, they are formed once (the
weight-gradient GEMM, batched) and reused for the norm and the sum, within a memory budget
(``keep_bytes``; :mod:`.plan` chooses the route per parameter). The sum then goes to
the optimizer's summed-gradient path (``optimizer.accumulate_clipped``) and
``optimizer.step()`` adds the Gaussian noise once and updates: the same DP step as the
per-sample path (SPEC sections 2-4), to float32 rounding.

Usage in your own loop::

    opt = dpkern.DPAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0,
                         noise_multiplier=sigma, expected_batch_size=256)
    with dpkern.ghost.GhostClipping(model, opt) as gc:
        for logical_batch in loader:                       # Poisson-sampled
            for x, y in micro_batches(logical_batch):      # gradient accumulation
                losses = per_sample_loss(model(x), y)      # float [B]: NOT averaged
                gc.backward(losses)                        # clip + sum into opt's buffers
            opt.step()                                     # noise once, update

``gc.backward`` replaces ``loss.backward()``: it never fills ``p.grad`` (the accumulator is
the optimizer's fp32 buffer, never aliasing ``.grad``). An empty micro-batch (B = 0) is
fine; for one the model cannot run on, call ``gc.add_empty_batch()`` (under FSDP2: run the
forward on a placeholder sample and call ``gc.backward(losses[:0])``). Forwards run under
``torch.no_grad()`` (evaluation) are not recorded.

Covered layers: ``nn.Linear``, transformers' ``Conv1D`` (GPT-2), ``nn.Embedding``
(``padding_idx`` respected), ``nn.LayerNorm``, ``nn.RMSNorm``; tied weights (embedding
<-> lm-head) get the exact norm of the sum of both uses. Any other trainable layer type
is an error naming the parameter, unless ``instantiate_unsupported=True``.
The first logical batch is checked (``verify="first"``, :mod:`.verify`): a few samples'
exact gradients by ordinary autograd against the ghost norms; a mismatch (a use of a
parameter that no rule foresees) is a ValueError naming the parameters.
DP-MacAdam clips whitened per-sample gradients, which ghost norms cannot give: use the
per-sample path (``dpkern.grad_sample.compute_grad_sample`` + ``optimizer.step()``).

Sources: Li et al. 2022 (arXiv 2110.05679, ghost clipping); Bu et al. 2023 (arXiv
2210.00038, book-keeping); Goodfellow 2015 (per-example norms of a Linear layer).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import backends
from ..functional import clip_factors
from .bookkeeping import clipped_sum
from .capture import Capture, module_kind
from .norms import DEFAULT_CHUNK_BYTES
from .plan import Plan
from .verify import Verifier

__all__ = ["GhostClipping", "module_kind", "supports"]

NORM_BACKENDS = ("auto", "torch", "triton")


def supports(model: torch.nn.Module, params=None) -> tuple[bool, list[str]]:
    """Whether ghost clipping can cover every trainable parameter of ``model``, as far as
    the modules alone tell: coverage is decided per operation at the first forward (a use
    without a rule is an error naming it, and ``verify="first"`` checks the norms).

    Args: params: the parameters to check (default: the model's trainable ones).
    Returns: ``(ok, names)`` where ``names`` lists the parameters of modules ghost clipping
    refuses by construction (``nn.Embedding`` with ``max_norm`` or
    ``scale_grad_by_freq``; batch norm in training mode) as ``"name (ModuleType)"``."""
    params = [p for p in (params if params is not None else model.parameters()) if p.requires_grad]
    ids = {id(p) for p in params}
    bad = []
    for mname, m in model.named_modules():
        refused = module_kind(m) is None or (
            isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training
        )
        if refused:
            bad += [
                f"{mname + '.' if mname else ''}{n} ({type(m).__name__})"
                for n, p in m.named_parameters(recurse=False)
                if id(p) in ids
            ]
    return not bad, bad


class GhostClipping:
    """Ghost-clipped, book-kept DP gradients for ``optimizer`` from one backward pass.

    Args:
        model: the module whose forward computes the losses (batch-first inputs).
        optimizer: a dpkern optimizer (DPSGD, DPAdam, DPAdamBC, DPAdamW, DPAdamWBC), or a
            :class:`dpkern.distributed.DistributedDPOptimizer` over one (DDP: local sums,
            all-reduced at ``step()``; FSDP2: each micro-batch's full-shape sums are
            reduce-scattered to the shards); norms run over its ``trainable_params()``,
            clipping at its ``max_grad_norm``, non-finite samples follow its
            ``nonfinite`` policy.
        instantiate_unsupported: give uncovered layer types per-sample gradients by
            torch.func (memory B x their parameter count) instead of raising.
        backend: Linear Gram-path norms: ``"auto"`` (the fused Triton kernel for CUDA
            tensors when triton is installed, else the PyTorch reference), ``"torch"``,
            ``"triton"``.
        chunk_bytes: temporary memory per chunk of samples in the reference norms.
        keep_bytes: memory for per-sample gradients formed once and kept from the norm to
            the clipped sum, for the parameters where that is cheaper than the Gram route
            (:mod:`dpkern.ghost.plan`; exact either way). None (default): the larger of
            256 MiB and the bytes of the step's recorded activations and output
            gradients; 0: every parameter takes the ghost route.
        check: debugging aid: also compute autograd's summed gradient and raise
            RuntimeError if the unclipped sum rebuilt from the recorded uses differs
            (a parameter used outside its module's forward). Costs one GEMM per layer.
        verify: ``"first"`` (default): before the first micro-batch with samples is
            clipped, compare its ghost per-sample norms with the exact ones of a few
            samples (``torch.autograd.grad`` of each one's loss through the same graph)
            and raise ValueError naming the parameters whose contribution disagrees
            (rtol 1e-4 of the sample's squared norm in float32, 1e-2 in float16 /
            bfloat16; see :mod:`dpkern.ghost.verify`); ``"always"``: every call;
            ``"off"``: never. Skipped (warned once) under FSDP2. Its wall time, once:
            ``verify_seconds`` (up to 4 extra backward passes); ``verified``: a check passed.
    Raises:
        ValueError: DP-MacAdam; an uncovered trainable parameter (named); an invalid
            backend or verify mode; a parameter the model does not own; a
            ``torch.compile`` wrapper as ``model`` (pass ``model._orig_mod``).

    Use as a context manager (hooks attached inside), or call ``attach()`` / ``detach()``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer,
        *,
        instantiate_unsupported: bool = False,
        backend: str = "auto",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        keep_bytes: int | None = None,
        check: bool = False,
        verify: str = "first",
    ):
        from ..optim import DPOptimizer

        inner = getattr(optimizer, "optimizer", optimizer)  # DistributedDPOptimizer
        if isinstance(inner, DPOptimizer) and not inner.rule.ghost:  # (DP-MacAdam)
            raise ValueError(
                f"ghost clipping cannot serve {inner.rule.title}: it clips whitened "
                "per-sample gradients (g_i - m_hat) / b, whose norms ghost "
                "clipping cannot compute; use the per-sample path "
                "(dpkern.grad_sample.compute_grad_sample + optimizer.step())"
            )
        if not isinstance(inner, DPOptimizer):
            raise ValueError(
                f"ghost clipping needs a dpkern optimizer, got {type(optimizer).__name__}"
            )
        if backend not in NORM_BACKENDS:
            raise ValueError(f"invalid backend={backend!r}: expected one of {NORM_BACKENDS}")
        if hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
            raise ValueError(
                "ghost clipping records the eager forward of each operation: pass the "
                "uncompiled module (model._orig_mod, the one torch.compile wrapped), not the "
                "torch.compile wrapper"
            )
        self.optimizer = optimizer
        self.backend = backend
        self.chunk_bytes = int(chunk_bytes)
        self.keep_bytes = None if keep_bytes is None else int(keep_bytes)
        self.check = check
        self.sharded = bool(getattr(optimizer, "sharded", False))  # FSDP2 wrapper
        if hasattr(model, "reshard") and callable(model.reshard):
            # FSDP2: after a no_grad forward (evaluation) the root keeps its parameters
            # unsharded, registered as plain tensors instead of the optimizer's DTensors
            model.reshard()
        self.capture = Capture(
            model, optimizer.trainable_params(), instantiate_unsupported=instantiate_unsupported
        )
        self._verifier = Verifier(verify, model, self.capture.params, sharded=self.sharded)
        self.verify = verify

    @property
    def verified(self) -> bool:
        """True once a first-step check (``verify``) has passed."""
        return self._verifier.done

    @property
    def verify_seconds(self) -> float:
        """Wall time (s) of the first-step checks so far (0.0 before any)."""
        return self._verifier.seconds

    @property
    def verify_rtol(self) -> float | None:
        """The check's relative tolerance (None: 1e-4, 1e-2 for float16 / bfloat16
        parameters or under autocast); settable."""
        return self._verifier.rtol

    @verify_rtol.setter
    def verify_rtol(self, value: float | None) -> None:
        self._verifier.rtol = None if value is None else float(value)

    # -- hooks -----------------------------------------------------------------------------
    def attach(self) -> "GhostClipping":
        """Install the forward hooks; returns self."""
        self.capture.attach()
        return self

    def detach(self) -> None:
        """Remove the hooks (and drop unconsumed records)."""
        self.capture.detach()

    def discard(self) -> None:
        """Forget forwards recorded since the last backward (e.g. a forward with grad
        enabled whose loss is not trained on)."""
        self.capture.discard()

    def __enter__(self) -> "GhostClipping":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    # -- the step ----------------------------------------------------------------------------
    def _outer_fn(self, device: torch.device):
        want = self.backend
        if want == "torch" or (want == "auto" and device.type != "cuda"):
            return None
        try:
            from .triton_norms import gram_norm_sq
        except ImportError as exc:
            if want == "triton":
                raise RuntimeError(f"backend='triton' needs triton: {exc}") from None
            return None
        if device.type != "cuda" and not backends.triton_interpret():
            raise RuntimeError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1)")
        return gram_norm_sq

    def clipped_sums(self, losses: Tensor) -> tuple[list[Tensor | None], Tensor]:
        """One backward of ``losses.sum()``; per-sample norms, clip factors and the clipped
        sums, without touching the optimizer.

        Args: losses: float ``[B]`` per-sample losses of the recorded forward(s).
        Returns: ``(sums, norms)``: ``sums[k]`` float32 shaped like
            ``optimizer.trainable_params()[k]`` (None: unused this step, zero), holding
            ``sum_i c_i g_i`` with ``c_i = min(1, C / (n_i + 1e-6))``; ``norms`` ``[B]``,
            float32, float64 for a float64 model (private: never log them). Each
            squared norm is clamped at 0 before the square root: float rounding in the
            Gram path and tied cross terms can make a tiny one slightly negative, which
            must not become a NaN (a finite sample reported non-finite).
        Raises: ValueError (see :meth:`Capture.backward`; ``verify``: ghost and exact
            norms disagree), FloatingPointError (a non-finite sample under
            ``nonfinite="error"``), RuntimeError (``check``)."""
        params = self.capture.params
        pending = (
            self._verifier.exact(losses, self.capture) if self._verifier.due(losses) else None
        )  # before the graph is consumed
        B, uses, summed, formed = self.capture.backward(
            losses, check=self.check, keep_bytes=self.keep_bytes, early=not self.sharded
        )
        device = losses.device
        plan = Plan(
            params,
            uses,
            B,
            outer_fn=self._outer_fn(device),
            chunk_bytes=self.chunk_bytes,
            keep_bytes=self.keep_bytes,
            keep_uses=summed is not None,
            device=device,
            formed=formed,
        )
        each = None
        if pending is not None:
            each = plan.each()
            self._verifier.compare(pending, each, device)
        norm_sq = plan.norm_sq(each)
        norms = norm_sq.sqrt()
        finite = torch.isfinite(norms)
        bad = (~finite).nonzero().flatten().tolist()
        if bad and self.optimizer.nonfinite == "error":
            raise FloatingPointError(
                f"non-finite per-sample gradient (NaN/Inf, or a squared norm overflowing "
                f"float32) in sample rows {bad[:20]}{' ...' if len(bad) > 20 else ''}; "
                "nothing was updated (pass nonfinite='zero' to drop such samples)"
            )
        c = clip_factors(
            torch.where(finite, norms, torch.zeros_like(norms)), self.optimizer.max_grad_norm
        )
        drop = None
        if bad:
            drop = ~finite
            c = torch.where(finite, c, torch.zeros_like(c))
        sums = plan.sums(c, drop)
        if summed is not None:
            self._check(params, plan.uses, summed, B)
        self._last = (B, int((finite & (c < 1.0)).sum()) if B else 0, len(bad))
        return sums, norms

    def _check(self, params, uses, summed, B) -> None:
        ones = torch.ones(
            B,
            dtype=torch.float32,
            device=summed[0].device if summed and summed[0] is not None else None,
        )
        for p, u, g in zip(params, uses, summed):
            mine = clipped_sum(u, p.shape, ones) if u else torch.zeros(p.shape, device=p.device)
            ref = g.float() if g is not None else torch.zeros_like(mine)
            ref = ref.to(mine.device)
            atol = 1e-5 * max(1.0, float(ref.abs().max())) if ref.numel() else 0.0
            if not torch.allclose(mine, ref, rtol=1e-4, atol=atol):  # (fp32 summation order)
                raise RuntimeError(
                    f"ghost clipping check: the recorded uses of "
                    f"{self.capture._pname(p)} do not rebuild its gradient "
                    "(it is used outside its module's recorded forward)"
                )

    def add_empty_batch(self) -> None:
        """Record an empty micro-batch without a forward (Poisson sampling may draw one;
        many models cannot run on B = 0): ``optimizer.step()`` then adds the noise alone.

        Not under FSDP2 (a sharded :class:`~dpkern.distributed.DistributedDPOptimizer`):
        there every rank must run the model, whose all-gathers are collectives. A rank
        with no sample runs the forward on a placeholder (any one sample, e.g. a row of
        padding) and calls ``gc.backward(losses[:0])``: zero samples are added, and the
        forward and backward join the other ranks' collectives.

        Raises: RuntimeError under FSDP2 (instead of leaving the other ranks waiting)."""
        if self.sharded:
            raise RuntimeError(
                "add_empty_batch cannot be used under FSDP2: every rank must "
                "run the model's forward and backward (FSDP all-gathers are "
                "collectives); run the forward on a placeholder sample and "
                "call gc.backward(losses[:0])"
            )
        self.optimizer.accumulate_clipped([None] * len(self.capture.params), batch_size=0)

    def backward(self, losses: Tensor) -> None:
        """Replace ``losses.sum().backward()``: add this micro-batch's clipped sum into the
        optimizer's fp32 buffers (``optimizer.accumulate_clipped``); call
        ``optimizer.step()`` after the last micro-batch of the logical batch.

        Args: losses: float ``[B]`` per-sample losses. Raises: see :meth:`clipped_sums`;
        nothing is added to the optimizer when it raises, and the error ends the logical
        batch (the micro-batches accumulated before it are refused until
        ``optimizer.zero_grad()`` drops them, SPEC section 9). Under FSDP2 (a sharded
        DistributedDPOptimizer) an error found after the backward (a non-finite sample,
        a batch mismatch) is raised on every rank: the others get DistributedDPError."""
        try:
            sums, _ = self.clipped_sums(losses)
        except BaseException as exc:  # ends the logical batch (SPEC 9), as accumulate() does
            self.optimizer._fail_batch(exc, "GhostClipping.backward()")
            if self.sharded and isinstance(exc, (ValueError, FloatingPointError)):
                from ..distributed.fsdp import mesh_group  # the other ranks wait in the
                from ..distributed.lockstep import raise_if_any_failed  # reduce-scatter's

                params = self.capture.params  # validity check: fail them too
                raise_if_any_failed(exc, mesh_group(params), params[0].device, "ghost clipping")
            raise
        B, clipped, nonfinite = self._last
        self.optimizer.accumulate_clipped(
            sums, batch_size=B, clipped_samples=clipped, nonfinite_samples=nonfinite
        )
