"""dpkern.distributed.processes: spawned workers that end cleanly past gloo's occasional
abort at interpreter exit, and a parent that tells a finished run from a failed one."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from dpkern.distributed.processes import finished_before_dying, mark_finished, marker


def _killed(rank=1):
    return ProcessExitedException(
        f"process {rank} terminated with signal SIGABRT",
        error_index=rank,
        error_pid=123,
        exit_code=-6,
        signal_name="SIGABRT",
    )


def test_a_rank_killed_after_every_rank_finished_is_not_a_failed_run(tmp_path):
    """A rank killed by a signal is a success only once every rank wrote its marker (a
    rank killed before that is a failed run, as is a non-zero exit or a traceback)."""
    mark_finished(tmp_path, 0)
    assert not finished_before_dying(_killed(), tmp_path, 2)  # rank 1 never finished
    mark_finished(tmp_path, 1)
    assert finished_before_dying(_killed(), tmp_path, 2)
    assert not finished_before_dying(_killed(), tmp_path, 3)  # rank 2 never finished
    exited = ProcessExitedException(
        "process 1 terminated with exit code 1", error_index=1, error_pid=123, exit_code=1
    )
    raised = ProcessRaisedException("Traceback ...", error_index=1, error_pid=123)
    assert not finished_before_dying(exited, tmp_path, 2)
    assert not finished_before_dying(raised, tmp_path, 2)


def test_markers_have_a_prefix_and_carry_text(tmp_path):
    mark_finished(tmp_path, 0, "143", prefix="rc")
    assert marker(tmp_path, 0, "rc").read_text() == "143"
    assert not finished_before_dying(_killed(0), tmp_path, 1)  # (the "done" markers)
    assert finished_before_dying(_killed(0), tmp_path, 1, prefix="rc")


def test_end_worker_runs_exit_handlers_flushes_and_skips_teardown(tmp_path):
    """Buffered output survives; atexit handlers run (a multiprocessing lock is cleaned
    up: no leaked-semaphore warning); finally blocks and module teardown do not; the code
    is the process's exit status."""
    script = textwrap.dedent(
        """
        import atexit, multiprocessing as mp, sys
        from dpkern.distributed.processes import end_worker
        class Teardown:
            def __del__(self):
                print("TEARDOWN")
        keep = Teardown()
        lock = mp.get_context("spawn").Lock()
        atexit.register(lambda: print("ATEXIT", end=" "))
        sys.stdout.write("buffered ")
        try:
            end_worker(3)
        finally:
            print("FINALLY")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 3, out.stderr
    assert out.stdout == "buffered ATEXIT ", out.stdout
    assert "leaked" not in out.stderr, out.stderr
