"""SIGINT (Ctrl-C) and SIGTERM (a cluster preemption) as a request to stop at the next
step boundary, where the job checkpoints, prints one line and exits with 128 + the
signal number (130, 143)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """While entered, SIGINT and SIGTERM set :attr:`signum` (the first one received)
    instead of raising KeyboardInterrupt or terminating; ``on_signal(signum)`` is called
    for each one (the --nproc parent forwards them to its workers). The previous handlers
    are restored on exit. Outside the main thread (where Python cannot install handlers)
    it does nothing."""

    def __init__(self, on_signal: Callable[[int], None] | None = None):
        self.signum: int | None = None
        self.on_signal = on_signal
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
        if self.on_signal is not None:
            self.on_signal(signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        """128 + the signal number (the shell's convention): 130 for SIGINT, 143 for SIGTERM."""
        return 128 + int(self.signum or signal.SIGINT)
