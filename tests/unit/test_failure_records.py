"""A launch's failures as records: the supervisor makes one for each child it saw fail (its role and rank, its
pid, its exit code or the signal that killed it, when, its log and the log's last lines), carried by the error
that ends the launch and said in its last lines, one line per failure."""

from __future__ import annotations

import sys
import time

import pytest

from psgd.launcher.supervise import Children, LaunchError, wait_all

FAILS = {
    "exit code 3": "import sys; print('worker 1: no data here', file=sys.stderr); sys.exit(3)",
    "SIGKILL": "import os, signal; print('worker 1: going', flush=True); os.kill(os.getpid(), signal.SIGKILL)",
}


def launch_of(tmp_path, source: str) -> tuple[LaunchError, int, float]:
    """One child, ``worker 1``, running ``source`` under the supervisor until it fails: the error, its pid and the
    time it was started."""
    before = time.time()
    children = Children()
    child = children.start("worker 1", [sys.executable, "-c", source], tmp_path / "worker-1.log")
    try:
        with pytest.raises(LaunchError) as failed:
            wait_all([child], children.procs, children, time.monotonic() + 30, 30, tmp_path)
    finally:
        children.stop_all(grace=1.0)
    return failed.value, child.popen.pid, before


@pytest.mark.parametrize("how", sorted(FAILS))
def test_a_child_that_fails_is_recorded_whole(tmp_path, how):
    error, pid, before = launch_of(tmp_path, FAILS[how])
    (failure,) = error.failures
    assert (failure.role, failure.rank, failure.pid, failure.log) == ("worker", 1, pid, str(tmp_path / "worker-1.log"))
    if how == "SIGKILL":
        assert (failure.exit_code, failure.signal) == (None, "SIGKILL")
        assert failure.last_lines == ("worker 1: going",)
    else:
        assert (failure.exit_code, failure.signal) == (3, None)
        assert failure.last_lines == ("worker 1: no data here",)
    assert before <= failure.time <= time.time() and 0 <= failure.seconds <= time.time() - before
    assert failure.record() == {
        "role": "worker",
        "rank": 1,
        "pid": pid,
        "exit_code": failure.exit_code,
        "signal": failure.signal,
        "time": failure.time,
        "seconds": failure.seconds,
        "log": str(tmp_path / "worker-1.log"),
        "last_lines": list(failure.last_lines),
    }
    last = str(error).splitlines()[-1]  # the launch's last line names it: role, rank, how it ended, its log
    assert last.startswith(f"  worker 1: {how}, ") and last.endswith(f"; log {tmp_path / 'worker-1.log'}"), last


def test_only_the_children_that_failed_are_recorded(tmp_path):
    """A child still running, or one that finished well, when another fails is no failure of its own."""
    children = Children()
    well = children.start("worker 0", [sys.executable, "-c", "pass"], tmp_path / "worker-0.log")
    well.popen.wait(30)
    running = children.start(
        "shard 0", [sys.executable, "-c", "import signal; signal.pause()"], tmp_path / "shard-0.log"
    )
    bad = children.start("replica 0", [sys.executable, "-c", "raise SystemExit(5)"], tmp_path / "replica-0.log")
    try:
        with pytest.raises(LaunchError) as failed:
            wait_all([well, bad], children.procs, children, time.monotonic() + 30, 30, tmp_path)
    finally:
        children.stop_all(grace=1.0)
    assert running.popen.returncode is not None
    assert [(f.role, f.rank, f.exit_code) for f in failed.value.failures] == [("replica", 0, 5)]


def test_a_launch_that_ran_out_of_time_has_no_failure_to_record(tmp_path):
    children = Children()
    slow = children.start(
        "worker 0", [sys.executable, "-c", "import signal; signal.pause()"], tmp_path / "worker-0.log"
    )
    try:
        with pytest.raises(LaunchError, match="did not finish within") as failed:
            wait_all([slow], children.procs, children, time.monotonic() + 0.2, 0.2, tmp_path)
    finally:
        children.stop_all(grace=1.0)
    assert failed.value.failures == ()


def test_psgd_launch_raises_the_error_that_carries_them_under_psgds_own_name():
    import psgd

    assert psgd.LaunchError is LaunchError and issubclass(LaunchError, psgd.PsgdError)
