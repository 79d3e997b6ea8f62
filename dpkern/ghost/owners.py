"""Which module's per-sample replay counts each parameter use, under
``instantiate_unsupported=True`` (a mixin of :class:`.ops.OpRecorder`): every use is
counted once, by one replayed call around it or by its ruled record, or refused."""

from __future__ import annotations

import sys

from torch import nn

_CALL_IMPL = nn.Module._call_impl.__code__


class ReplayOwners:
    """The module calls running at a use, the modules owning a parameter, and the
    refusals of uses no replay can count; the state belongs to :class:`.capture.Capture`
    (``module_names``, ``owners``, ``_unknown``)."""

    # -- instantiate_unsupported: which uses the per-sample pass of a module replays ----------
    # A module owning a parameter that an operation without a rule consumes gets a per-sample
    # pass (:func:`.backward.generic_rows`): each of its recorded calls is replayed on each
    # sample, giving the per-sample gradients of its own parameters through the uses made
    # inside that call (and the modules it calls), and the ruled records whose ``module`` is
    # it are dropped. So each use of a parameter must be counted exactly once: by one
    # replayed call around it, or by its record (``module`` None or not replayed).

    def _calls(self) -> list:
        """The model's modules whose call is running, innermost first (read off the Python
        stack, like ``current_module``)."""
        names, f, out = self.module_names, sys._getframe(2), []
        while f is not None:
            if f.f_code is _CALL_IMPL:
                m = f.f_locals.get("self")
                if m in names:
                    out.append(m)
            f = f.f_back
        return out

    def _owners_of(self, p) -> tuple:
        """The modules that register ``p`` (several when it is tied)."""
        owners = self.__dict__.get("_owner_map")
        if owners is None:  # (``self.owners`` is fixed at construction)
            owners = {}
            for m, own in self.owners.items():
                for q in own.values():
                    if m not in owners.setdefault(id(q), ()):
                        owners[id(q)] += (m,)
            self._owner_map = owners
        return owners.get(id(p), ())

    def _generic(self, m) -> bool:
        """Whether ``m`` gets the per-sample pass so far (a parameter of it has no rule)."""
        return any(id(q) in self._unknown for q in self.owners.get(m, {}).values())

    def _unruled(self, where: str, forms, calls: list) -> None:
        """The parameters of ``forms`` are consumed by an operation without a rule (``where``)
        during the module calls ``calls``: their modules will get the per-sample pass, which
        replays this use only if exactly one call of a module that owns the parameter is
        running. Raise ValueError otherwise (a use outside its module's forward would be left
        out of the per-sample norm; one inside nested calls of two owners counted twice)."""
        names = self.module_names
        for _, f in forms:
            p = f.param
            owners = self._owners_of(p)
            around = [m for m in calls if m in owners]
            if p.requires_grad and len(around) != 1:
                mods = ", ".join(names[m] for m in owners)
                if not around:
                    why = (
                        f"outside the forward of its module {mods}: it is used outside its "
                        "module's forward, which the per-sample pass (it replays only the "
                        "module's own calls, one sample at a time) cannot replay, so this "
                        "use's gradient would be left out of the per-sample norm. Move the "
                        "operation into that module's forward (or give the parameter to the "
                        "module that runs it)"
                    )
                else:
                    why = (
                        "inside nested calls of modules that all own it ("
                        + ", ".join(names[m] for m in around)
                        + "): the per-sample pass of each would replay this use, counting "
                        "it more than once in the per-sample norm. Register the parameter in "
                        "one of them only"
                    )
                raise ValueError(
                    f"ghost clipping (instantiate_unsupported): trainable parameter "
                    f"{self._pname(p)} is consumed by {where}, an operation without a ghost "
                    f"rule, {why}; or use the per-sample path "
                    "(dpkern.grad_sample.compute_grad_sample). Nothing was updated"
                )
            if id(p) not in self._unknown:
                self._unknown[id(p)] = where
                for rec in self._records:  # (those made before its modules got the pass)
                    if getattr(rec, "replayers", None) and set(owners) & rec.replayers:
                        self._refuse_part_replayed(rec, rec.replayers)

    def _replayed_by(self, params: list, calls: list) -> tuple:
        """``(module, replayers)`` for the records of a ruled use of ``params`` during the
        module calls ``calls``: ``module`` is the one running call of a module that owns
        every one of them (the record is dropped if that module gets the per-sample pass,
        whose replay of the call then counts the use), or None when no owner of any of them
        is running (the record always counts). Otherwise (owners of only some of them
        running, or two nested ones): ``(None, those modules)``, refused by
        :meth:`_refuse_part_replayed` if one gets the per-sample pass (its replay would count
        the use for its parameters while the record counts it again, or the record dropped
        would lose the others')."""
        around = [tuple(m for m in calls if m in self._owners_of(p)) for p in params]
        first = around[0]
        if len(first) <= 1 and all(a == first for a in around):
            return (first[0] if first else None), None
        return None, frozenset(m for a in around for m in a)

    def _refuse_part_replayed(self, rec, replayers) -> None:
        bad = [m for m in replayers if self._generic(m)]
        if not bad:
            return
        names = self.module_names
        raise ValueError(
            f"ghost clipping (instantiate_unsupported): {rec.where} consumes "
            + ", ".join(self._pname(p) for p in rec.params)
            + f" during the call of {', '.join(names[m] for m in replayers)}, and "
            + ", ".join(names[m] for m in bad)
            + " gets the per-sample pass (one of its parameters has no ghost rule): that "
            "pass would replay this use for its own parameters only (or more than once), so "
            "the per-sample norm would miss or double-count part of it. Use each parameter "
            "in its own module's forward, or use the per-sample path "
            "(dpkern.grad_sample.compute_grad_sample). Nothing was updated"
        )
