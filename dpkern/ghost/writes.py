"""In-place writes during the recorded forward (a mixin of :class:`.ops.OpRecorder`):
``x[i] = v``, ``index_put_`` and in-place ops change the batch layout of the tensor
written, of its base and of the base's views (SPEC: ghost clipping refuses a write that
mixes samples)."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from .batch import _one as layout_one
from .batch import UNKNOWN, _index_tensors, row_aligned, write_layout
from .batch_ops import EW, KIND

_INDEX_PUT = frozenset({Tensor.index_put_, torch.index_put_})


class WriteTracker:
    """The layout bookkeeping of in-place writes; the state it reads and writes belongs
    to :class:`.capture.Capture` (``_ld``, ``layouts``, ``_written``)."""

    # -- in-place writes --------------------------------------------------------------------
    # A write changes the values of the written tensor and of every tensor sharing its
    # memory: its base (``root``: ``t._base``, or ``t``) and the base's other views. The
    # written tensor's layout is recomputed by the allowlist (:func:`.batch._one`, or
    # :func:`.batch.write_layout` for ``x[i] = v`` / ``index_put_``); unless the write is
    # harmless (constants, or an element-wise op of the tensor with constants), the root's
    # layout follows (kept only through a view holding the root's rows in order,
    # :func:`.batch.row_aligned`), and when it changes, so do the layouts of its views: the
    # tracked ones at once, the untracked ones (views taken while the root did not depend
    # on the samples) when an operation reads them (:meth:`_alias_layout`).

    def _lay(self, t):
        e = self._ld.get(id(t))
        if e is not None and e[0]() is t:
            return e[1]
        wr = self.__dict__.get("_written")
        return self._alias_layout(t, wr[1]) if wr is not None and wr[0] is self._ld else None

    def _alias_layout(self, t, written: dict):
        """The layout of untracked ``t`` if it is a view of a root written with the samples
        (then tracked), else None."""
        b = t._base
        if b is None:
            return None
        r = written.get(id(b))
        if r is None or r() is not b:
            return None
        e = self._ld.get(id(b))
        lb = e[1] if e is not None and e[0]() is b else None
        if lb is None:
            return None
        lay = lb if lb != UNKNOWN and row_aligned(t, b) else UNKNOWN
        self._ld[id(t)] = (weakref.ref(t), lay)
        return lay

    def _on_setitem(self, func, args) -> None:
        """``dest[index] = value`` (returns None: not seen by the rest of :meth:`_on_op`)."""
        if len(args) < 3 or not isinstance(args[0], Tensor):
            return
        dest, index, value = args[0], args[1], args[2]
        tensors = [dest] + _index_tensors(index) + ([value] if isinstance(value, Tensor) else [])
        fd, pd = self._fd, self._pd
        forms = [(t, e[1]) for t in tensors if (e := fd.get(id(t))) is not None and e[0]() is t]
        pend = [(t, e[1]) for t in tensors if (e := pd.get(id(t))) is not None and e[0]() is t]
        root = dest._base if dest._base is not None else dest
        if any(t is dest and f.param.requires_grad for t, f in forms) or (
            id(root) in self._identity and root.requires_grad
        ):
            raise ValueError(
                f"ghost clipping refuses {self.where()}: x[i] = v writes into (a view of) a "
                "trainable parameter, whose per-sample gradient then cannot be proven. "
                "Write into a copy made by an out-of-place operation instead"
            )
        if forms and any(f.param.requires_grad for _, f in forms):
            self._use(func, args, {}, dest, forms, None)
        if pend:
            self._consume_pending(func, args, {}, dest, pend)
        old = self._lay(dest)
        new, harmless = write_layout(dest, old, index, value, self._lay, self._batch)
        if harmless:
            return
        tainted = [(t, la) for t in tensors if (la := self._lay(t)) is not None]
        self._written_into(func, dest, old, new, tainted)

    def _on_write(self, func, args, kwargs, dest, tainted) -> None:
        """``func`` changed ``dest`` in place (``x.copy_(y)``, ``x += y``, ``index_put_``,
        ``F.relu(x, inplace=True)``, ``out=x``); ``tainted``: layouts before the call."""
        B = self._batch
        old = next((la for t, la in tainted if t is dest), None)
        if func in _INDEX_PUT:
            index = args[1] if len(args) > 1 else kwargs.get("indices")
            value = args[2] if len(args) > 2 else kwargs.get("values")
            new, harmless = write_layout(dest, old, tuple(index), value, self._lay, B)
        else:
            new = layout_one(func, args, kwargs, dest, tainted, B)
            harmless = KIND.get(func) == EW and all(t is dest for t, _ in tainted)
        if harmless:
            if new is not None:
                self._ld[id(dest)] = (weakref.ref(dest), new)
            return
        self._written_into(func, dest, old, new, tainted)

    def _written_into(self, func, dest, old, new, tainted) -> None:
        """Layouts after a write of sample-dependent values into ``dest`` (``old``, ``new``:
        its layout before and after), of its root and of the root's other views."""
        ld = self._ld
        new = UNKNOWN if new is None else new
        ld[id(dest)] = (weakref.ref(dest), new)
        root = dest._base if dest._base is not None else dest
        if root is dest:
            old_root = old
        else:
            e = ld.get(id(root))
            old_root = e[1] if e is not None and e[0]() is root else None
            if row_aligned(dest, root):
                cand = new
            elif (  # the whole root reshaped (F.linear's 3-D output): the view's rule
                dest.numel() == root.numel()
                and dest.storage_offset() == root.storage_offset()
                and dest.is_contiguous()
                and root.is_contiguous()
            ):
                shape = tuple(root.shape)
                cand = layout_one(
                    Tensor.reshape, (dest, shape), {}, root, [(dest, new)], self._batch
                )
            else:
                cand = UNKNOWN
            ld[id(root)] = (weakref.ref(root), cand if old_root in (None, cand) else UNKNOWN)
        new_root = ld[id(root)][1]
        if new_root != old_root:
            wr = self.__dict__.get("_written")
            if wr is None or wr[0] is not ld:
                wr = self._written = (ld, {})
            wr[1][id(root)] = weakref.ref(root)
            for k, (r, _) in list(ld.items()):
                t = r()
                if t is not None and t is not dest and t._base is root:
                    keep = new_root != UNKNOWN and row_aligned(t, root)
                    ld[k] = (r, new_root if keep else UNKNOWN)
        for t in (dest, root):
            if ld[id(t)][1] == UNKNOWN and t.requires_grad:
                self._note_mixed(func, t, tainted)

    def _refuse_kept_view(self, func, t: Tensor) -> None:
        """Raise ValueError if ``t``, a view this forward did not make, is a view of a
        trainable parameter (``self.wt = self.weight.T`` in ``__init__``): its use has no
        record, so its gradient would be missing from the norms and the clipped sums. The
        graph-node check of :meth:`backward` misses it once an in-place change of the
        parameter (an optimizer step, an initialisation) has made autograd regenerate the
        view's node inside the forward. Views made inside this forward without a form
        belong to a parameter already marked as having no rule (refused, or handled by
        ``instantiate_unsupported``)."""
        p = t._base
        if not t.requires_grad or id(p) in self._unknown:
            return
        raise ValueError(
            f"ghost clipping: {getattr(func, '__name__', func)} in {self.where()} consumes "
            f"a view of trainable parameter {self._pname(p)} made outside the forward "
            "(kept from __init__ or an earlier step): its gradient there cannot be "
            "clipped per sample. Take the view inside forward (e.g. self.weight.T there)"
        )
