"""Nothing left behind: the files through which processes found each other go when the processes do.

``psgd-server --port-file`` removes its file when it stops (SIGTERM or every worker done), unless a shard
started since has written its own address there; ``psgd launch`` removes every ``shard-K.addr`` of its run
folder when it ends, however it ends, even for a shard that was killed and could not remove its own."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import by_hand_env, wait_for

PSGD = shutil.which("psgd") or "psgd"
SERVER = shutil.which("psgd-server") or "psgd-server"


def start_server(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    port_file = tmp_path / "shard.addr"
    proc = subprocess.Popen(
        [SERVER, "--bind", "127.0.0.1:0", "--port-file", str(port_file), "--workers", "1", "-q", *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=by_hand_env(),
    )
    wait_for(
        lambda: proc.poll() is not None or (port_file.exists() and port_file.read_text().strip()),
        60,
        "the shard's port file",
    )
    assert proc.poll() is None, proc.stderr.read()
    return proc, port_file


def test_psgd_server_removes_its_port_file_when_it_stops(tmp_path):
    proc, port_file = start_server(tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.stderr.read()
    assert not port_file.exists()
    assert list(tmp_path.iterdir()) == []  # nor its temporary file


def test_a_port_file_another_shard_has_written_since_is_left_alone(tmp_path):
    proc, port_file = start_server(tmp_path)
    port_file.write_text("127.0.0.1:23456\n")  # a shard restarted on the same file owns it now
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.stderr.read()
    assert port_file.read_text() == "127.0.0.1:23456\n"


def handoff_files(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.suffix == ".addr" or p.name.startswith("nccl-id"))


@pytest.mark.slow
def test_launch_leaves_no_address_files_when_it_finishes(tmp_path):
    run = tmp_path / "run"
    done = subprocess.run(
        [PSGD, "launch", "--run-dir", str(run), "--epochs", "1", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "final test accuracy" in done.stdout
    assert handoff_files(run) == []
    assert (run / "job.toml").exists() and (run / "shard-0.log").exists()  # what the user reads is kept


def shard_pids(run: Path) -> list[int]:
    """The pids of this run's psgd-server processes (their command line names its job file)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"psgd.cli.server" in cmdline and str(run / "job.toml").encode() in cmdline:
                pids.append(int(entry.name))
    return pids


@pytest.mark.slow
@pytest.mark.lacks(not Path("/proc/self/cmdline").exists(), reason="needs /proc to find the shards")
@pytest.mark.parametrize("how", ["SIGTERM to the launch", "a shard killed"])
def test_launch_leaves_no_address_files_however_it_ends(tmp_path, how):
    run = tmp_path / "run"
    launch = subprocess.Popen(
        [PSGD, "launch", "--run-dir", str(run), "--epochs", "400", "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: (run / "worker-0.jsonl").exists() and (run / "worker-0.jsonl").stat().st_size > 0,
            60,
            "worker 0's first step",
        )
        assert handoff_files(run) == ["shard-0.addr", "shard-1.addr"]
        if how == "a shard killed":
            (pid,) = [p for p in shard_pids(run) if f"--shard\0{0}" in open(f"/proc/{p}/cmdline").read()]
            os.kill(pid, signal.SIGKILL)  # it cannot remove its own file: the launch does
        else:
            launch.send_signal(signal.SIGTERM)
        _, err = launch.communicate(timeout=60)
        assert launch.returncode != 0, err
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait(10)
    assert handoff_files(run) == []


def test_a_launch_keeps_its_run_where_the_user_sees_it_and_says_where(tmp_path):
    """Without --run-dir: runs/DATE-TIME-MODE under the current folder (as TensorBoard and Hydra keep runs), named
    in the last line, where every launch left a /tmp/psgd-run-* folder nobody was told about."""
    import tempfile

    before = set(Path(tempfile.gettempdir()).glob("psgd-run-*"))
    done = subprocess.run(
        [PSGD, "launch", "--epochs", "1", "--no-progress"], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.endswith("-ps") and len(run.name) == len("20261127-134512-ps")
    assert f"logs in runs/{run.name}; weights saved to runs/{run.name}/final.npz)" in done.stdout
    assert (run / "job.toml").exists() and (run / "worker-1.log").read_text()
    assert set(Path(tempfile.gettempdir()).glob("psgd-run-*")) == before
