"""Spawned gloo/NCCL worker processes that end cleanly (``dpkern finetune --nproc``,
``dpkern audit --path ddp``).

torch 2.13's gloo backend occasionally aborts a rank that has finished its work, at
interpreter teardown ("terminate called without an active exception", SIGABRT): a C++
thread still joinable when its static owner is destroyed. The run itself was complete, but
``torch.multiprocessing`` reports the rank as killed and the parent would call a finished
run a failure. Two defences, used together:

- :func:`end_worker`: a worker that has written its results, destroyed its process group
  and recorded that it finished calls this last: the exit handlers run, stdio is flushed
  and the process leaves with ``os._exit``, skipping the interpreter teardown where the
  abort happens;
- :func:`finished_before_dying`: the parent still treats a worker killed by a signal as a
  success only when every rank had recorded that it finished (a marker file each rank
  writes after its work and, for rank 0, its saves): a rank killed earlier is a failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["end_worker", "finished_before_dying", "mark_finished", "marker"]


def marker(tmp: str | os.PathLike, rank: int, prefix: str = "done") -> Path:
    """The file rank ``rank`` writes in the run's temporary directory when it finished."""
    return Path(tmp, f"{prefix}{rank}")


def mark_finished(tmp: str | os.PathLike, rank: int, text: str = "0", prefix: str = "done"):
    """Record that ``rank`` finished (after its results are written); ``text``: what the
    parent reads back (finetune: the rank's exit code)."""
    marker(tmp, rank, prefix).write_text(text)


def finished_before_dying(exc, tmp: str | os.PathLike, world: int, prefix: str = "done") -> bool:
    """Whether a worker failure ``exc`` (torch's ``ProcessException``) came after the run
    was over: the worker was killed by a signal and every one of the ``world`` ranks had
    written its :func:`marker`. A rank that raised or exited non-zero, or any failure
    before every marker exists, is a failed run."""
    if not getattr(exc, "signal_name", None):
        return False
    return all(marker(tmp, r, prefix).is_file() for r in range(world))


def end_worker(code: int = 0):
    """Leave this worker process now with ``code``: run the Python exit handlers
    (``atexit``: multiprocessing's finalizers unlink its semaphores, else the parent's
    resource tracker warns of leaked ones), flush stdout and stderr, and ``os._exit``,
    skipping the interpreter's teardown (module and C++ static destruction, where gloo
    aborts). Call it only as a worker's last statement, after
    ``dist.destroy_process_group()`` and :func:`mark_finished`: nothing after it runs
    (no ``finally`` block)."""
    import atexit

    try:
        atexit._run_exitfuncs()
    except BaseException:  # (a failing handler must not turn a finished run into a failure)
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # (closed or redirected away: nothing to keep)
            pass
    os._exit(code)
