"""The first-step check of ghost clipping: exact per-sample norms by an independent route.

Ghost clipping's norms come from rules (:mod:`.capture`, :mod:`.norms`): what a covered
layer's recorded input and output gradient give. A model that uses a parameter in a way no
rule foresees (a subclass of a covered layer whose forward adds a term, a position
embedding indexed without a batch dimension, a weight also used outside its module, a
custom autograd Function) can get wrong per-sample norms without any error: wrong clip
factors, so the step does not have the sensitivity the privacy accounting assumes.

So :class:`dpkern.ghost.GhostClipping` checks the first logical batch by default
(``verify="first"``; ``"always"``: every call; ``"off"``: never). Before the capture's
backward consumes the graph, it takes a few sample rows ``i`` and computes autograd's own
gradient of that sample's loss through the same forward graph (the same dropout masks):
``torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True)``. No
ghost rule is involved. The per-parameter squared norms of these exact gradients
(float64) are then compared with the ghost ones.

Rows: up to :data:`ROWS` (4): the first, the last and evenly spaced ones between; B = 1:
that one; B = 0: nothing to check, the check waits for the next call.

Tolerance: in row ``i``, with ``E_ik`` the exact and ``G_ik`` the ghost squared norm of
parameter ``k`` and ``E_i = sum_k E_ik``, parameter ``k`` disagrees when
``|G_ik - E_ik| > rtol * max(E_i, 1e-12 max_j E_j)``, and the row when
``|sum_k G_ik - E_i|`` exceeds the same bound. The bound is relative to the whole
sample's squared norm, so a parameter holding a tiny share of the gradient cannot raise a
false alarm from rounding, while any parameter whose share is wrong by more than ``rtol``
of the total is named. The floor (the largest checked sample's norm over a million,
squared) only matters for a sample whose gradient is ~0; it depends neither on units nor
on ``max_grad_norm``. ``rtol`` is 1e-4 (float32 / float64 models), 1e-2 when a trainable
parameter is float16 / bfloat16 or autocast is on while ``clipped_sums`` runs; set
``GhostClipping.verify_rtol`` to override. Rows whose ghost or exact norm is non-finite
are left to the optimizer's ``nonfinite`` policy (not compared); a non-finite sample
usually makes autograd's gradient of every row non-finite (0 x NaN in the shared graph),
and when no row could be compared the check stays pending for the next call.

A mismatch raises ValueError naming the parameters whose contribution disagrees, with the
relative disagreements of the worst row (never the norms themselves: they are private),
before anything is added to the optimizer.
Cost (once, with ``"first"``): up to 4 more backward passes through the batch's graph and
one model-sized gradient at a time (``GhostClipping.verify_seconds``; measured by
``python -m bench.ghost``). Under FSDP2 the check is skipped with a warning (the exact
gradients of DTensor parameters would need the backward's collectives on every rank).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from ..sharding import is_sharded

__all__ = [
    "MODES",
    "ROWS",
    "RTOL",
    "RTOL_LOW_PRECISION",
    "FLOOR",
    "Verifier",
    "pick_rows",
    "default_rtol",
    "disagreement",
]

MODES = ("first", "always", "off")
ROWS = 4
RTOL = 1e-4
RTOL_LOW_PRECISION = 1e-2
FLOOR = 1e-12  # of the largest checked squared norm: the floor of each row's scale
_LOW = (torch.float16, torch.bfloat16)


def pick_rows(B: int, k: int = ROWS) -> list[int]:
    """Up to ``k`` sample rows of a batch of ``B``: the first, the last and evenly spaced
    ones between (``[]`` for B = 0, ``[0]`` for B = 1)."""
    if B <= 0:
        return []
    if B <= k:
        return list(range(B))
    return sorted({round(j * (B - 1) / (k - 1)) for j in range(k)})


def default_rtol(params, device: torch.device | None = None) -> float:
    """:data:`RTOL`, or :data:`RTOL_LOW_PRECISION` for float16 / bfloat16 parameters or
    under autocast (on ``device``'s type)."""
    if any(p.dtype in _LOW for p in params):
        return RTOL_LOW_PRECISION
    kinds = {"cpu"} | ({device.type} if device is not None else set())
    for kind in kinds:
        try:
            if torch.is_autocast_enabled(kind):
                return RTOL_LOW_PRECISION
        except (TypeError, RuntimeError):  # an older torch, or a device type without it
            if kind != "cpu" and torch.is_autocast_enabled():
                return RTOL_LOW_PRECISION
    return RTOL


def disagreement(ghost: Tensor, exact: Tensor):
    """Compare per-parameter squared norms ``[rows, P]`` (float64, finite rows).

    Returns: ``(rel, total_rel)``: ``|ghost - exact|`` per parameter ``[rows, P]`` and of
    the totals ``[rows]``, divided by each row's scale ``max(E_i, FLOOR * max_j E_j)``
    (``E_i``: the exact total; at least 1e-300); a value above ``rtol`` disagrees."""
    totals = exact.sum(1)
    floor = max(FLOOR * float(totals.max()), 1e-300) if totals.numel() else 1e-300
    scale = totals.clamp_min(floor)
    rel = (ghost - exact).abs() / scale[:, None]
    total_rel = (ghost.sum(1) - exact.sum(1)).abs() / scale
    return rel, total_rel


@dataclass
class _Pending:
    rows: list[int]
    exact: Tensor | None  # [rows, P] float64 on the CPU
    error: Exception | None  # autograd failed on the independent route
    seconds: float


@contextlib.contextmanager
def _not_recorded(capture):
    """Backward passes run for the check are not uses: forwards re-run in them (a
    non-reentrant checkpoint's recomputation) must not be recorded. The capture ignores
    them while ``_in_backward`` is set (as in its own backward)."""
    prev = getattr(capture, "_in_backward", False)
    capture._in_backward = True
    try:
        yield
    finally:
        capture._in_backward = prev


class Verifier:
    """State of the check for one :class:`~dpkern.ghost.GhostClipping` (see module doc).

    Args: mode: one of :data:`MODES`; model: for parameter names; params: the optimizer's
    trainable parameters (norm order); sharded: FSDP2 (the check is skipped, warned once).
    Attributes: ``done`` (a check passed), ``seconds`` (wall time of all checks so far),
    ``checks`` (how many ran), ``rtol`` (None: :func:`default_rtol`).
    Raises: ValueError for an unknown mode."""

    def __init__(self, mode: str, model: torch.nn.Module, params, *, sharded: bool = False):
        if mode not in MODES:
            raise ValueError(f"invalid verify={mode!r}: expected one of {MODES}")
        self.mode = mode
        self.params = list(params)
        names: dict[int, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), n)
        self.names = [f"{names.get(id(p), '?')} (shape {tuple(p.shape)})" for p in self.params]
        self.sharded = sharded or any(is_sharded(p) for p in self.params)
        self.done = False
        self.seconds = 0.0
        self.checks = 0
        self.rtol: float | None = None
        self._warned = False

    def due(self, losses: Tensor) -> bool:
        """Whether this call is checked: the mode asks for it, and ``losses`` is a
        non-empty ``[B]`` tensor requiring grad (otherwise the capture's own errors, or
        nothing to check for B = 0)."""
        if self.mode == "off" or (self.mode == "first" and self.done):
            return False
        if self.sharded:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "ghost clipping: verify skipped under FSDP2 (exact per-sample "
                    "gradients of sharded parameters would need collectives); "
                    "check the model unsharded (one process) first",
                    stacklevel=3,
                )
            return False
        return (
            isinstance(losses, Tensor)
            and losses.dim() == 1
            and losses.shape[0] > 0
            and losses.requires_grad
        )

    def exact(self, losses: Tensor, capture) -> _Pending:
        """Autograd's per-parameter squared norms of the chosen rows, before the capture's
        backward (the graph is retained). An autograd failure is kept, to be raised after
        the capture's backward if that one does not raise a clearer error first."""
        t0 = time.perf_counter()
        rows = pick_rows(losses.shape[0])
        out, err = [], None
        try:
            with _not_recorded(capture):
                for i in rows:
                    grads = torch.autograd.grad(
                        losses[i], self.params, retain_graph=True, allow_unused=True
                    )
                    zero = torch.zeros((), dtype=torch.float64, device=losses.device)
                    out.append(
                        torch.stack(
                            [
                                g.detach().double().square().sum() if g is not None else zero
                                for g in grads
                            ]
                        ).cpu()
                    )
                    del grads
        except RuntimeError as exc:
            err = exc
        exact = torch.stack(out) if out and err is None else None
        return _Pending(rows, exact, err, time.perf_counter() - t0)

    def compare(
        self, pending: _Pending, per_param: list[Tensor | None], device: torch.device | None = None
    ) -> None:
        """Compare the ghost per-parameter squared norms (``per_param[k]``: ``[B]`` or None
        for an unused parameter) with the pending exact ones; raises ValueError on a
        mismatch (see module doc). Marks the check done when at least one row compared."""
        t0 = time.perf_counter()
        try:
            self._compare(pending, per_param, device)
        finally:
            self.seconds += pending.seconds + time.perf_counter() - t0
            self.checks += 1

    def _compare(self, pending, per_param, device) -> None:
        if pending.error is not None:
            raise RuntimeError(
                "ghost clipping verify: autograd could not compute the exact "
                "per-sample gradients of the check (torch.autograd.grad of "
                f"one sample's loss): {pending.error}"
            ) from pending.error
        rows = pending.rows
        idx = torch.tensor(rows)
        k = len(rows)
        ghost = (
            torch.stack(
                [
                    n.detach()[idx.to(n.device)].double().cpu()
                    if n is not None
                    else torch.zeros(k, dtype=torch.float64)
                    for n in per_param
                ],
                1,
            )
            if per_param
            else torch.zeros(k, 0, dtype=torch.float64)
        )
        exact = pending.exact if pending.exact is not None else torch.zeros_like(ghost)
        ok = torch.isfinite(ghost).all(1) & torch.isfinite(exact).all(1)
        if not ok.any():
            return  # nothing comparable: the check stays pending
        ghost, exact = ghost[ok], exact[ok]
        rows = [r for r, good in zip(rows, ok.tolist()) if good]
        rtol = self.rtol if self.rtol is not None else default_rtol(self.params, device)
        rel, total_rel = disagreement(ghost, exact)
        bad = (rel > rtol).any(0)
        if not bad.any() and not (total_rel > rtol).any():
            self.done = True
            return
        worst_param = rel.max(0).values
        if not bad.any():  # many small per-parameter errors: name the largest
            bad[worst_param.argsort(descending=True)[:3]] = True
        order = [j for j in worst_param.argsort(descending=True).tolist() if bad[j]]
        w = int(torch.maximum(rel.max(1).values, total_rel).argmax())
        shown = order[:8]
        more = f" and {len(order) - len(shown)} more" if len(order) > len(shown) else ""
        # (relative errors only: a sample's exact gradient norms are private data, and this
        # message may be pasted into a bug report)
        detail = "; ".join(f"{self.names[j]}: {rel[w, j]:.2g}" for j in shown)
        raise ValueError(
            "ghost clipping verify: the ghost per-sample gradient norms disagree with "
            "autograd's exact per-sample gradients of the same forward (sample rows "
            f"{rows} of this batch, tolerance {rtol:g} of each sample's squared norm). "
            "Parameter(s) whose contribution disagrees: "
            + ", ".join(self.names[j] for j in shown)
            + more
            + f". Worst row {rows[w]}: the ghost squared norm is off by {total_rel[w]:.2g} of "
            "the exact one; per parameter, the disagreement as a share of the sample's "
            f"squared norm: {detail} (no norm itself is shown: it is private data). "
            "Clipping by these norms would not bound each "
            "sample's contribution (not DP). Either the losses are not per-sample (losses[i] "
            "must depend on sample i alone: no batch mean, sum or other batch statistic in "
            "it, e.g. l * l.mean() or l / l.sum()), or the model uses these parameters in a "
            "way the ghost rules do not foresee (e.g. a subclass of a covered layer whose forward "
            "adds a term, a parameter also used outside its module, a custom autograd "
            "Function, an input without a batch dimension). Use the per-sample path "
            "(dpkern.grad_sample.compute_grad_sample + optimizer.step()) for this model, "
            "and please report it. Nothing was added to the optimizer."
        )
