"""The logical batch of a DP optimizer: micro-batches folded into fp32 clipped sums
(:meth:`LogicalBatch.accumulate`, :meth:`LogicalBatch.accumulate_clipped`) until one
``step()`` adds the noise once (SPEC section 2).

What this layer guarantees: a logical batch whose release call raised is never released
(a retry cannot be told apart from the next batch: a sample drawn in both would add up to
2C under one noise draw); the clipping bound stays the one its micro-batches were clipped
at; the un-noised sums are never saved (:class:`dpkern.optim.base.DPOptimizer` holds them
in ``_accum`` and leaves them out of ``state_dict``, pickles and ``stats``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import functional as F
from ..sharding import local_shard
from .inputs import check_clipped_sums


class LogicalBatch:
    """Mixin of :class:`dpkern.optim.base.DPOptimizer`: the accumulation of a logical
    batch over micro-batches. Uses the optimizer's ``_accum`` (parameter -> fp32 clipped
    sum), ``_accum_max_grad_norm``, ``_batch_failed`` and its validation methods."""

    def _check_batch_usable(self) -> None:
        """Raise ValueError when the accumulated logical batch may not be released: a
        ``step()``, ``accumulate()`` or ``accumulate_clipped()`` raised after micro-batches
        were accumulated. What comes next cannot be told apart from the next logical
        batch or a repeat of a micro-batch (a sample counted twice, or drawn in two
        Poisson batches, would add up to 2C under one noise draw and one accounted
        step)."""
        if self._batch_failed is not None and self._accum:
            raise ValueError(
                f"{self._batch_failed}: the micro-batches accumulated for that logical "
                "batch cannot be released any more (a retry could count a sample twice "
                "or join the next batch's); call zero_grad() to drop them, then start "
                "the next logical batch"
            )
        C = self._accum_max_grad_norm
        if self._accum and C is not None and self.max_grad_norm != C:
            raise ValueError(
                f"max_grad_norm changed from {C!r} to {self.max_grad_norm!r} within a "
                f"logical batch: its accumulated micro-batches were clipped at {C!r}, so "
                "noise scaled to the new value would not cover them; set it back for "
                "this batch, and change it only between logical batches (after step(), "
                "or after drop_batch())"
            )

    def _accumulated(self) -> None:
        """A micro-batch was folded into ``_accum``: remember the C it was clipped at."""
        self._accum_max_grad_norm = self.max_grad_norm

    def _clear_accum(self) -> None:
        self._accum.clear()
        self._accum_max_grad_norm = None

    def _fail_batch(self, exc: BaseException, what: str) -> None:
        """A release call raised: consume this micro-batch's ``grad_sample`` (a later
        backward must not add to it: Opacus' hooks append) and, when micro-batches were
        accumulated, refuse that logical batch (see _check_batch_usable).
        Parameters and optimizer state are untouched."""
        self._consume_grad_samples()
        if self._accum:
            self._batch_failed = f"{what} raised {type(exc).__name__}"

    def drop_batch(self) -> None:
        """Drop the logical batch accumulated so far: nothing of it is released, and this
        micro-batch's ``p.grad_sample`` is consumed. Call it when an error outside
        dpkern's calls (your forward, a data loader) interrupts a logical batch that you
        then abandon; ``zero_grad()`` keeps accumulated micro-batches otherwise (they
        belong to the logical batch), and the next logical batch's step would release
        them with its own. Errors of ``step()``, ``accumulate()``,
        ``accumulate_clipped()`` and ``GhostClipping.backward`` end the batch by
        themselves (see ``step()``)."""
        self._consume_grad_samples()
        self._clear_accum()
        self._batch_failed = None

    @torch.no_grad()
    @torch._disable_dynamo
    def accumulate(self) -> None:
        """Fold the current micro-batch's clipped per-sample gradients into the logical
        batch (fp32 buffers) and consume ``p.grad_sample``. No noise is added here.

        Raises: ValueError (no, stale or inconsistent grad_sample; or the logical batch
        can no longer be released), FloatingPointError (non-finite with
        nonfinite="error"). Any error ends the logical batch, as in ``step()``: the
        micro-batches accumulated before it are refused until ``zero_grad()`` drops them
        (an error after a write, out of memory or Ctrl-C, may leave buffers partly
        written; a repeat of the micro-batch would count it twice)."""
        self._check_can_release()
        self._check_batch_usable()
        try:  # any error ends the logical batch (a retry could count a sample twice)
            groups, _, _, new_buffers = self._groups(for_accumulate=True)
            result = F.accumulate_groups(
                groups,
                step=self._dp_step + 1,
                max_grad_norm=self.max_grad_norm,
                backend=self.backend,
                nonfinite=self.nonfinite,
                reduce=self._reduce(),
            )
            self._accum.update(new_buffers)
            self._accumulated()
            self._record(result, step=False)
            self._consume_grad_samples()
        except BaseException as exc:
            self._fail_batch(exc, "accumulate()")
            raise

    def trainable_params(self) -> list[Tensor]:
        """Trainable parameters in noise-index order (param_groups order, frozen skipped)."""
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def clipped_sum_buffers(self) -> list[Tensor]:
        """The logical batch's fp32 clipped-sum buffers, one per trainable parameter
        (created as zeros where missing), e.g. for an all-reduce across data-parallel
        ranks before ``step()``. Un-noised private sums: never log or save them."""
        out = []
        for p in self.trainable_params():
            if p not in self._accum:
                self._accum[p] = torch.zeros_like(
                    local_shard(p)[0], dtype=torch.float32, memory_format=torch.contiguous_format
                )
            out.append(self._accum[p])
        return out

    @torch.no_grad()
    @torch._disable_dynamo
    def accumulate_clipped(
        self,
        clipped_sums,
        batch_size: int = 0,
        *,
        clipped_samples: int = 0,
        nonfinite_samples: int = 0,
    ) -> None:
        """Add clipped sums computed elsewhere (ghost clipping, book-keeping) to the
        logical batch; the next ``step()`` adds noise once and updates.

        Args:
            clipped_sums: one entry per ``trainable_params()`` entry, ``None`` or a tensor
                shaped like the parameter holding sum_i c_i g_i with every sample's
                gradient clipped to norm <= max_grad_norm over all parameters (for
                DP-MacAdam: the sum of clipped whitened rows). FSDP2: the DTensor
                ``p.grad`` FSDP reduce-scattered (its local shard is used).
            batch_size: samples in this micro-batch; clipped_samples: how many of them
                were clipped (c_i < 1); nonfinite_samples: how many were dropped as
                non-finite. For ``stats`` only (exact counts, kept in memory only).
        Raises: ValueError (wrong count, shape, device, non-finite values; or the logical
        batch can no longer be released). Any error ends the logical batch, as in
        ``step()``: the sums accumulated before it are refused until ``zero_grad()``
        drops them."""
        self._check_can_release()
        self._check_batch_usable()
        try:  # any error ends the logical batch (a retry could count a sample twice)
            clipped_sums = check_clipped_sums(clipped_sums, self.trainable_params())
            for s, buf in zip(clipped_sums, self.clipped_sum_buffers(), strict=True):
                if s is not None:
                    buf += s.float()
            self._accumulated()
            self.stats["samples"] += int(batch_size)
            self.stats["clipped_samples"] += int(clipped_samples)
            self.stats["nonfinite_samples"] += int(nonfinite_samples)
        except BaseException as exc:
            self._fail_batch(exc, "accumulate_clipped()")
            raise
