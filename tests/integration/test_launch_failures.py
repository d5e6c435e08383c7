"""A launch whose process fails says which, how and where, as records: ``psgd run --json`` and ``psgd launch
--json`` print ``"failures"`` (role, rank, pid, exit code or signal, when, log, its last lines) on stdout, and the
launch's last lines on stderr name each failure, one line each; a launch that finished carries none."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wait_for
from test_launch_signals import kill_leftovers, processes_mentioning, started_training

pytestmark = pytest.mark.lacks(not Path("/proc/self/cmdline").exists(), reason="needs /proc to list processes")

#: a psgd run script whose rank 1 cannot find its data and exits 3; rank 0 finishes at once
EXITS_3 = """import os, sys
if os.environ["PSGD_RANK"] == "1":
    print("rank 1: no data in /nowhere", file=sys.stderr)
    sys.exit(3)
"""


def psgd(folder: Path, *argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "psgd.cli.main", *argv],
        cwd=folder,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def failed_as_json(launcher: subprocess.Popen) -> tuple[list[dict], list[str]]:
    """The failures a failed launch printed with --json, and its stderr's lines."""
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 1, err
    assert "Traceback" not in err, err
    said = json.loads(out.splitlines()[-1])
    assert f"psgd: error: {said['error']}\n" in err
    return said["failures"], err.splitlines()


@pytest.mark.slow
def test_a_worker_that_exits_with_a_code_is_recorded_with_its_code_and_its_error(tmp_path):
    (tmp_path / "fails.py").write_text(EXITS_3)
    launcher = psgd(
        tmp_path, "run", "--json", "--run-dir", str(tmp_path / "run"), "--workers", "2", "--shards", "1", "fails.py"
    )
    (failure,), err = failed_as_json(launcher)
    log = str(tmp_path / "run" / "worker-1.log")
    assert {k: failure[k] for k in ("role", "rank", "exit_code", "signal", "log")} == {
        "role": "worker",
        "rank": 1,
        "exit_code": 3,
        "signal": None,
        "log": log,
    }
    assert failure["last_lines"][-1] == "rank 1: no data in /nowhere" and failure["seconds"] > 0
    assert err[-1].startswith("  worker 1: exit code 3, ") and err[-1].endswith(f"; log {log}"), err


@pytest.mark.slow
def test_a_worker_killed_by_a_signal_is_recorded_with_the_signals_name(tmp_path):
    run = tmp_path / "run"
    launcher = psgd(tmp_path, "launch", "--json", "--run-dir", str(run), "--epochs", "400", "--no-progress")
    try:
        wait_for(lambda: started_training(run), 120, "both workers' first step")
        (pid,) = [
            pid
            for pid, cmdline in processes_mentioning(str(run / "job.toml"))
            if "psgd.cli.worker" in cmdline and "--rank 1 " in cmdline
        ]
        os.kill(pid, signal.SIGKILL)
        (failure,), err = failed_as_json(launcher)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        kill_leftovers(run)
    log = str(run / "worker-1.log")
    assert {k: failure[k] for k in ("role", "rank", "pid", "exit_code", "signal", "log")} == {
        "role": "worker",
        "rank": 1,
        "pid": pid,
        "exit_code": None,
        "signal": "SIGKILL",
        "log": log,
    }
    assert err[-1].startswith("  worker 1: SIGKILL, ") and f"pid {pid}; log {log}" in err[-1], err


@pytest.mark.slow
def test_a_launch_that_finished_carries_no_failure(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "psgd.cli.main",
            "launch",
            "--json",
            "--run-dir",
            "run",
            "--epochs",
            "1",
            "--no-progress",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["failures"] == []
