"""The files psgd writes into a run folder (psgd.observe.files, psgd.launcher.folder): never through a symbolic link
or into a FIFO planted where one goes, the job's data and token private to their user, and a folder that holds
another run's files refused unless it is resumed."""

from __future__ import annotations

import os
import stat
import sys

import numpy as np
import pytest
from helpers import refused_at_a_fifo

from psgd.errors import InputError


@pytest.fixture
def planted(tmp_path):
    """A victim file of the user's, and a link to it where a run's file goes."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    return run, victim


@pytest.mark.parametrize("how", ["w", "a"])
def test_a_run_file_is_never_written_through_a_symbolic_link(planted, how):
    from psgd.observe.files import open_own

    run, victim = planted
    (run / "shard-0.log").symlink_to(victim)
    with pytest.raises(InputError, match=f"^{run / 'shard-0.log'}: a symbolic link where psgd writes its own file"):
        open_own(run / "shard-0.log", how)
    assert victim.read_text() == "precious\n"


def test_a_run_file_that_is_a_fifo_is_refused_without_waiting_for_a_reader(tmp_path):
    from psgd.observe.files import open_own

    os.mkfifo(tmp_path / "worker-0.jsonl")
    said = refused_at_a_fifo(
        tmp_path / "worker-0.jsonl", lambda: open_own(tmp_path / "worker-0.jsonl", "a"), InputError
    )
    assert "not a regular file" in str(said)


def test_a_private_file_is_its_users_alone_even_where_one_was_there(tmp_path):
    from psgd.observe.files import open_own, read_own

    (tmp_path / ".token").write_text("old\n")
    (tmp_path / ".token").chmod(0o644)
    with open_own(tmp_path / ".token", "w", private=True) as f:
        f.write("new\n")
    assert stat.S_IMODE((tmp_path / ".token").stat().st_mode) == 0o600
    assert read_own(tmp_path / ".token") == "new\n" and read_own(tmp_path / "none") is None
    (tmp_path / "link").symlink_to(tmp_path / ".token")
    with pytest.raises(InputError, match="a symbolic link"):
        read_own(tmp_path / "link")


def test_the_metrics_lines_and_rows_are_never_written_through_a_link(planted):
    from psgd.observe.progress import MetricsLog

    run, victim = planted
    (run / "worker-0.csv").symlink_to(victim)  # the CSV rows were appended to the victim
    with pytest.raises(InputError, match="worker-0.csv: a symbolic link"):
        MetricsLog(run / "worker-0.jsonl", "worker:0")
    assert victim.read_text() == "precious\n"


def test_a_childs_log_is_never_written_through_a_link(planted):
    from psgd.launcher.supervise import Children

    run, victim = planted
    (run / "shard-0.log").symlink_to(victim)  # the log's target was emptied
    with pytest.raises(InputError, match="shard-0.log: a symbolic link"):
        Children().start("shard 0", ["true"], run / "shard-0.log")
    assert victim.read_text() == "precious\n"


def test_the_data_a_launch_writes_for_its_workers_is_its_users_alone(tmp_path):
    from psgd.api import _written

    rng = np.random.default_rng(0)
    data = (rng.normal(size=(40, 3)), rng.integers(0, 2, 40))
    _written(data, None, tmp_path, "float32")
    assert stat.S_IMODE((tmp_path / "data.npz").stat().st_mode) == 0o600  # was 0644: readable by everyone
    with np.load(tmp_path / "data.npz", allow_pickle=False) as written:
        np.testing.assert_array_equal(written["x_train"].shape[1:], (3,))
    (tmp_path / "data.npz").unlink()
    (tmp_path / "data.npz").symlink_to(tmp_path / "elsewhere.npz")
    with pytest.raises(InputError, match="data.npz: a symbolic link"):
        _written(data, None, tmp_path, "float32")
    assert not (tmp_path / "elsewhere.npz").exists()


@pytest.mark.parametrize("left", ["job.toml", "worker-0.jsonl", "shard-0.log", "checkpoints/ckpt-1.npz"])
def test_a_folder_holding_another_runs_files_is_refused_unless_resumed(tmp_path, left):
    from psgd.launcher.folder import claim

    (tmp_path / left).parent.mkdir(exist_ok=True)
    (tmp_path / left).write_text("")
    with pytest.raises(
        InputError,
        match=f"^{tmp_path} holds the files of an earlier run \\({left}\\): continue it "
        f"with psgd launch --resume {tmp_path}, or give another --run-dir",
    ):
        claim(tmp_path, resume=False)
    claim(tmp_path, resume=True)


def test_a_folder_holding_another_runs_ca_is_refused_unless_resumed(tmp_path):
    """A launch into it would sign its certificate with that run's CA key, kept there by someone else."""
    from psgd.launcher.certs import job_tls
    from psgd.launcher.folder import claim

    job_tls(tmp_path)
    with pytest.raises(InputError, match=f"^{tmp_path} holds the files of an earlier run \\(tls\\)"):
        claim(tmp_path, resume=False)
    claim(tmp_path, resume=True)


def test_a_new_or_unrelated_folder_is_a_run_folder(tmp_path):
    from psgd.launcher.folder import claim

    claim(tmp_path / "new", resume=False)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "checkpoints").mkdir()  # empty: no run's
    claim(tmp_path, resume=False)
    with pytest.raises(InputError, match="continue it with psgd run --resume .* train.py"):
        (tmp_path / "job.toml").write_text("")
        claim(tmp_path, resume=False, script=("train.py",))


def test_a_resumed_launch_keeps_the_logs_of_its_stopped_part_and_a_fresh_one_starts_them_anew(tmp_path):
    from psgd.launcher.supervise import Children

    log = tmp_path / "worker-0.log"
    log.write_text("worker 0: stopping at step 128 as asked\n")
    said = [sys.executable, "-c", "print('worker 0: starting at clock 128')"]
    children = Children(resumed=True)
    children.start("worker 0", said, log).popen.wait(30)
    children.stop_all(grace=1.0)
    lines = log.read_text().splitlines()
    assert lines[0] == "worker 0: stopping at step 128 as asked" and lines[-1] == "worker 0: starting at clock 128"
    assert len(lines) == 3 and lines[1].startswith("---- resumed at ") and "the run's earlier part" in lines[1], lines

    children = Children()
    children.start("worker 0", said, log).popen.wait(30)
    children.stop_all(grace=1.0)
    assert log.read_text().splitlines() == ["worker 0: starting at clock 128"]  # a fresh run's log is its own
