"""What a :class:`~dpkern.integrations.transformers.DPTrainer` writes and logs: the
privacy record (``dpkern_privacy.json``) beside the model and in every checkpoint, the
ledger checked on resume, the privacy spent logged with the loss, and the exact training
loss kept out of every file it saves or shares. A mixin over ``transformers.Trainer``
(``DPTrainer(PrivateSaving, Trainer)``): each method calls the Trainer's own."""

from __future__ import annotations

import contextlib

from ..guard import _inner
from .records import build_record, write_record

__all__ = ["PrivateSaving"]

#: Log keys never passed on: ``grad_norm`` is the norm of ``.grad`` (not the released
#: gradient; an exact un-noised statistic if anything filled it).
_DROPPED_LOGS = ("grad_norm",)
#: Logged live (console, report_to), never written to a file dpkern's Trainer saves or
#: shares (trainer_state.json, the model card, save_metrics' json): the exact, un-noised
#: training loss.
_UNSAVED_LOGS = ("loss", "train_loss")


class PrivateSaving:
    """The saving and logging overrides of :class:`DPTrainer` (see the module doc); uses
    its ``privacy``, ``_plan``, ``accountant``, ``privacy_spent()`` and ``_accounted``."""

    def _record(self) -> dict:
        rec = build_record(
            self.privacy, self._plan, self.accountant, _inner(self.optimizer).dp_step
        )
        spent = self.privacy_spent()
        rec.update({k: v for k, v in spent.items() if k not in ("private", "steps")})
        return rec

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``, and once training started the privacy record
        (``dpkern_privacy.json``: ledger, epsilon) beside the model, so that a later run
        from this directory is told its ledger starts at zero."""
        # (a checkpoint's record is written with its optimizer state, once)
        into_checkpoint = _internal_call and output_dir not in (None, self.args.output_dir)
        with self._averaged_weights(not into_checkpoint):
            super().save_model(output_dir, _internal_call)
        if (
            self._plan is not None
            and self.optimizer is not None
            and self.args.should_save
            and not into_checkpoint
        ):
            write_record(output_dir or self.args.output_dir, self._record())

    @contextlib.contextmanager
    def _averaged_weights(self, swap: bool):
        """A schedule-free optimizer in train mode (the parameters hold y): the model is
        saved with the average x (what schedule-free trains for; schedulefree's
        ``optimizer.eval()`` before saving), then set back to y. Not for checkpoints:
        their y and the optimizer state (z, train mode) resume together."""
        opt = _inner(self.optimizer) if self.optimizer is not None else None
        train_mode = swap and any(g.get("train_mode") for g in getattr(opt, "param_groups", ()))
        if train_mode:
            opt.eval()
        try:
            yield
        finally:
            if train_mode:
                opt.train()

    def save_metrics(self, split, metrics, combined: bool = True) -> None:
        """``Trainer.save_metrics`` without the exact training loss (``train()``'s
        ``metrics["train_loss"]``, which ``run_clm``-style scripts save to
        ``train_results.json`` / ``all_results.json``)."""
        kept = {k: v for k, v in metrics.items() if k not in _UNSAVED_LOGS}
        super().save_metrics(split, kept, combined)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            write_record(output_dir, self._record())

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        opt, done = _inner(self.optimizer), self.accountant.steps
        if not opt.dp_step == done == self.state.global_step:
            raise ValueError(
                f"DPTrainer: {checkpoint} does not fit together: optimizer at step "
                f"{opt.dp_step}, privacy ledger at {done}, Trainer at {self.state.global_step}"
            )
        self._accounted = opt.dp_step

    @contextlib.contextmanager
    def _history_without_loss(self):
        """``state.log_history`` without the training loss while a file is written from
        it (a checkpoint's or save_state's trainer_state.json, the model card)."""
        history = self.state.log_history
        self.state.log_history = [
            {k: v for k, v in e.items() if k not in _UNSAVED_LOGS} for e in history
        ]
        try:
            yield
        finally:
            self.state.log_history = history

    def _save_checkpoint(self, model, trial) -> None:
        with self._history_without_loss():
            super()._save_checkpoint(model, trial)

    def save_state(self) -> None:
        """``Trainer.save_state`` without the training loss in trainer_state.json."""
        with self._history_without_loss():
            super().save_state()

    def create_model_card(self, *args, **kwargs) -> None:
        """``Trainer.create_model_card`` without the training loss."""
        with self._history_without_loss():
            super().create_model_card(*args, **kwargs)

    def log(self, logs: dict, start_time=None) -> None:
        """``Trainer.log`` with the privacy spent next to the training loss (``epsilon``,
        or ``epsilon_if_noise_key_were_secret``), without ``grad_norm``."""
        for key in _DROPPED_LOGS:
            logs.pop(key, None)
        if (
            ("loss" in logs or "train_loss" in logs)
            and self._plan is not None
            and self.optimizer is not None
        ):
            spent = self.privacy_spent()
            key = "epsilon" if self.privacy.private else "epsilon_if_noise_key_were_secret"
            logs[key] = spent[key]
            if "train_loss" in logs:
                logs.update(
                    delta=spent["delta"],
                    noise_multiplier=self._plan["noise_multiplier"],
                    sample_rate=self._plan["sample_rate"],
                )
        super().log(logs, start_time)

    def floating_point_ops(self, inputs) -> int:
        """0: the Trainer's count multiplies the sampled tokens (a data-dependent count)."""
        return 0
