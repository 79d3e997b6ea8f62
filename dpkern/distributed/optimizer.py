"""The data-parallel DP optimizer: all-reduce of the clipped sums once per logical step,
then every rank runs the same fused noise + update (SPEC section 3: the noise is a pure
function of the key, the step and the global element index)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..guards import refuse_grad_scaler
from ..optim import DPOptimizer
from .fsdp import reduce_scatter_clipped_sums
from .lockstep import (
    _BUCKET_NUMEL,
    _CONFIG,
    _KEY,
    _OK,
    _PER_SAMPLE,
    _SECURE,
    _STEP,
    DistributedDPError,
    _device,
    _gather_checks,
    raise_if_any_failed,
    _raise_on_mismatch,
    sync_key,
)
from ..sharding import chunk_rows, is_sharded


def all_reduce_clipped_sums(
    optimizer: DPOptimizer, group=None, bucket_numel: int = _BUCKET_NUMEL
) -> None:
    """Sum ``optimizer.clipped_sum_buffers()`` over the ranks of ``group``, in place.

    The buffers (fp32, one per trainable parameter, zeros where a rank had no sample) are
    flattened into buckets of at most ``bucket_numel`` elements (a single larger tensor
    gets its own) and all-reduced with SUM, so afterwards every rank holds the clipped sum
    over the global batch. A collective: every rank must call it once per logical step.
    No noise is involved (each rank adds the identical noise locally in ``step()``)."""
    bucket: list[Tensor] = []

    def flush():
        if bucket:
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            pos = 0
            for b in bucket:
                b.copy_(flat[pos : pos + b.numel()].view_as(b))
                pos += b.numel()
            bucket.clear()

    size = 0
    for buf in optimizer.clipped_sum_buffers():
        if size + buf.numel() > bucket_numel:
            flush()
            size = 0
        bucket.append(buf)
        size += buf.numel()
    flush()


def disable_gradient_allreduce(ddp_model) -> None:
    """Replace DDP's all-reduce of ``.grad`` by a no-op hook (PyTorch's ``noop_hook``).

    DP training reads ``grad_sample`` (per-sample gradients) and all-reduces the clipped
    sums itself (:func:`all_reduce_clipped_sums`); DDP's average of the raw gradients would
    only cost bandwidth. Call once, right after wrapping the model."""
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

    ddp_model.register_comm_hook(None, noop_hook)


class DistributedDPOptimizer:
    """A DP optimizer (:mod:`dpkern.optim`) stepping in lockstep over a process group.

    Every rank wraps its own optimizer over its own replica of the model::

        opt = DistributedDPOptimizer(DPAdamW(model.parameters(), lr=1e-3,
                                             max_grad_norm=1.0, noise_multiplier=1.1,
                                             expected_batch_size=q * N))   # GLOBAL B_e
        for batch in loader:                    # DistributedPoissonSampler: may be empty
            compute per-sample gradients of the LOCAL batch (or none if it is empty)
            opt.step()                          # every rank, every step
            opt.zero_grad()

    ``step()`` = local ``accumulate()`` (if this rank has ``grad_sample``), lockstep check
    (:func:`verify_lockstep`, which also tells every rank whether another one failed),
    all-reduce of the clipped sums, then the inner ``step()``: noise from the shared key
    and step, normalised by the global ``expected_batch_size``. Micro-batches: call
    ``accumulate()`` after each but the last (local, no communication).

    Sharded (FSDP2 DTensor) parameters: no all-reduce (the sums reach the shards by
    reduce-scatter, see the module docstring); per-sample inputs are validated on every
    rank before the per-sample norms are all-reduced, so a bad input raises on every rank.

    Construction runs :func:`sync_key` (a collective). Other attributes (``param_groups``,
    ``state``, ``stats`` -- local counts --, ``dp_step``, ``noise_multiplier``, ...) are the
    inner optimizer's; give LR schedulers ``opt.optimizer``.

    Args:
        optimizer: a :class:`dpkern.optim.DPOptimizer`, identically configured on every rank.
        group: the process group (None = the default group).
        bucket_numel: elements per all-reduce bucket.
    Raises:
        TypeError: ``optimizer`` is not a DPOptimizer.
        DistributedDPError: ranks disagree (at construction, or at any step: the
            lockstep check, one 48-byte all-gather, runs before each), or a rank failed
            its local step in ``step()`` (its closure, an earlier error in the logical
            batch, the clipping) or ``accumulate()`` (it re-raises its own error, the
            others this one); the logical batch is then dropped on every rank and
            parameters and optimizer state are untouched everywhere. Errors raised by
            ``GhostClipping.backward`` are local under DDP: they end that rank's logical
            batch, so the next ``step()`` raises on every rank and drops it (call it on
            every rank, then ``zero_grad()``); under FSDP2 they are raised on every
            rank.
    """

    def __init__(self, optimizer: DPOptimizer, group=None, *, bucket_numel: int = _BUCKET_NUMEL):
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(f"expected a dpkern DPOptimizer, got {type(optimizer).__name__}")
        self.optimizer, self.group = optimizer, group
        self.bucket_numel = int(bucket_numel)
        self.sharded = any(is_sharded(p) for p in optimizer.trainable_params())
        sync_key(optimizer, group)

    def __getattr__(self, name):
        if name == "optimizer":  # not set yet (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def _has_grad_sample(self) -> bool:
        return any(
            getattr(p, "grad_sample", None) is not None for p in self.optimizer.trainable_params()
        )

    def accumulate(self) -> None:
        """Fold this rank's micro-batch into its local clipped sum (no communication).

        Sharded (FSDP2) parameters: a collective (the per-sample norms are all-reduced),
        preceded by a check that every rank's inputs are valid, so a bad input raises on
        every rank instead of leaving the others waiting."""
        try:
            if self.sharded:
                error = None
                try:
                    self.optimizer.check_inputs()
                except Exception as exc:  # noqa: BLE001 (re-raised by _agree, after agreeing)
                    error = exc
                self._agree(
                    error,
                    self._has_grad_sample(),
                    (_PER_SAMPLE,),
                    "have invalid per-sample gradients or a failed logical batch; "
                    "nothing was accumulated on any rank",
                )
            self.optimizer.accumulate()
        except BaseException as exc:  # ends the logical batch, as the inner accumulate()
            self.optimizer._fail_batch(exc, "accumulate()")
            raise

    def _agree(self, error, per_sample: bool, columns, failure: str) -> None:
        """The lockstep all-gather with this rank's outcome: re-raise this rank's
        ``error``, else DistributedDPError if another rank failed (``failure`` says
        what happened) or the ``columns`` of the check differ across ranks."""
        table = _gather_checks(self.optimizer, self.group, ok=error is None, per_sample=per_sample)
        failed = [r for r, ok in enumerate(table[:, _OK].tolist()) if not ok]
        if error is not None:
            raise error
        if failed:
            raise DistributedDPError(f"ranks {failed} {failure}")
        _raise_on_mismatch(self.optimizer, table, self.group, columns)

    def accumulate_clipped(
        self,
        clipped_sums: Sequence[Tensor | None],
        batch_size: int = 0,
        *,
        clipped_samples: int = 0,
        nonfinite_samples: int = 0,
    ) -> None:
        """Add this rank's clipped sums (ghost clipping: pass the wrapper to
        :class:`dpkern.ghost.GhostClipping`) and its sample counts; see the inner optimizer.

        DDP: local, summed over ranks at ``step()``. FSDP2: plain full-shape sums are
        reduce-scattered right away (:func:`reduce_scatter_clipped_sums`, a collective:
        every rank calls it, ``None`` entries count as zeros); DTensor sums (FSDP's own
        reduce-scattered ``p.grad``) are already global and are taken as they are."""
        try:
            clipped_sums = list(clipped_sums)
            if self.sharded and not any(is_sharded(s) for s in clipped_sums if s is not None):
                clipped_sums = reduce_scatter_clipped_sums(
                    self.optimizer.trainable_params(), clipped_sums, self.bucket_numel
                )
            self.optimizer.accumulate_clipped(
                clipped_sums,
                batch_size,
                clipped_samples=clipped_samples,
                nonfinite_samples=nonfinite_samples,
            )
        except BaseException as exc:  # ends the logical batch, as the inner call
            self.optimizer._fail_batch(exc, "accumulate_clipped()")
            raise

    @torch.no_grad()
    def step(self, closure=None):
        """One global DP step (a collective: every rank calls it, empty batch or not).

        Returns the closure's loss (local) or None. Raises TypeError under AMP's
        GradScaler (every rank, before any collective: see :func:`refuse_grad_scaler`)."""
        refuse_grad_scaler(self)
        loss, error, per_sample = None, None, False
        try:  # this rank's outcome joins the agreement: no rank releases a failed batch
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self.optimizer._check_can_release()  # (StepInterrupted on this rank)
            self.optimizer._check_batch_usable()  # (an earlier failure on this rank)
            per_sample = self._has_grad_sample()
            if per_sample:  # sharded: local validation only, the clipping all-reduces norms
                (self.optimizer.check_inputs if self.sharded else self.optimizer.accumulate)()
        except BaseException as exc:  # (re-raised by _agree, after agreeing)
            error = exc
        try:
            self._agree(
                error,
                per_sample,
                (_SECURE, _CONFIG, _STEP, _KEY) + ((_PER_SAMPLE,) if self.sharded else ()),
                "failed their local step (the clipping, the closure, or an earlier "
                "error in this logical batch); the logical batch was dropped on every "
                "rank, nothing was updated",
            )
            if per_sample and self.sharded:  # every rank: same rows, all-reduced norms,
                self.optimizer.accumulate()  # so a non-finite row fails on every rank
            if not self.sharded:  # FSDP: the reduce-scatter / shard_grad_samples summed
                all_reduce_clipped_sums(self.optimizer, self.group, self.bucket_numel)
            self.optimizer.step()
        except BaseException:  # drop the logical batch (on every rank when they agreed
            self.optimizer.drop_batch()  # to fail; a retry would all-reduce again)
            self.optimizer.zero_grad()
            raise
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self, full: bool = False) -> dict:
        """The inner optimizer's state_dict. DDP: identical on every rank (save rank
        0's). FSDP2: this rank's shards of the states (every rank saves its own), or with
        ``full=True`` every state gathered to its parameter's full shape (a collective;
        identical on every rank: save rank 0's; the same file a single process writes)."""
        sd = self.optimizer.state_dict()
        if not (full and self.sharded):
            return sd
        from torch.distributed.tensor import DTensor

        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = {}
        for idx, st in sorted(sd["state"].items()):  # the same order on every rank
            p, st = params[idx], dict(st)  # (a copy: sd's dicts are the live state)
            for k, v in sorted(st.items()):
                if isinstance(v, Tensor) and v.dim() > 0 and is_sharded(p):
                    st[k] = DTensor.from_local(
                        v,
                        p.device_mesh,
                        p.placements,
                        run_check=False,
                        shape=p.shape,
                        stride=p.stride(),
                    ).full_tensor()
            state[idx] = st
        return {**sd, "state": state}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load on every rank, then :func:`sync_key` (secure mode: rank 0's fresh key).

        FSDP2: accepts this rank's shards or a full state_dict (``state_dict(full=True)``
        or a single-process checkpoint): full-shape states are cut to this rank's rows.

        Raises: the inner optimizer's error on a rank whose state_dict does not fit, and
        DistributedDPError on the others, which then restore their previous state (all
        ranks keep the old state, and their keys stay in lockstep)."""
        if self.sharded:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            state = {}
            for idx, st in state_dict.get("state", {}).items():
                p, st = params[idx] if 0 <= idx < len(params) else None, dict(st)
                if p is not None and is_sharded(p):
                    mesh = p.device_mesh
                    first, end = chunk_rows(p.shape[0], mesh.size(), mesh.get_local_rank())
                    for k, v in st.items():
                        if isinstance(v, Tensor) and v.dim() > 0 and v.shape == p.shape:
                            st[k] = v[first:end]
                state[idx] = st
            state_dict = {**state_dict, "state": state}
        failed = self.optimizer._failed  # (StepInterrupted: its state_dict() refuses)
        backup, error = None if failed else self.optimizer.state_dict(), None
        try:
            self.optimizer.load_state_dict(state_dict)
        except (ValueError, KeyError, TypeError) as exc:
            error = exc
        try:  # every rank loaded, or none keeps the new state (no rank left waiting)
            raise_if_any_failed(error, self.group, _device(self.optimizer), "load_state_dict")
        except DistributedDPError:
            if backup is not None:
                self.optimizer.load_state_dict(backup)
            else:  # nothing to restore: still interrupted, as on the failed ranks
                self.optimizer._failed = failed
            raise
        finally:
            sync_key(self.optimizer, self.group)
