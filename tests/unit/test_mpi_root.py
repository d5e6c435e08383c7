"""All-reduce over MPI started as root: Open MPI's mpiexec refuses root unless two variables say the user
means it (MPICH's does not ask).  The launcher sets them for its ranks and says so in one line; fake
``mpiexec`` scripts stand in for each MPI's."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from psgd.collective import BackendUnavailable
from psgd.config import JobConfig
from psgd.launcher import allreduce, launch, layout
from psgd.launcher.layout import OPEN_MPI_AS_ROOT, mpi_environment
from psgd.launcher.supervise import LaunchError

#: the first line of ``mpiexec --version`` of each (Open MPI 4.1 and 5.0, MPICH 4.2's Hydra)
VERSIONS = {
    "open mpi 4": "mpiexec (OpenRTE) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/",
    "open mpi 5": "mpiexec (Open MPI) 5.0.3\n\nReport bugs to https://www.open-mpi.org/community/help/",
    "mpich": "HYDRA build details:\n    Version:                                 4.2.1",
}


def fake_mpiexec(folder: Path, which: str) -> Path:
    """An mpiexec that answers --version as ``which`` does; started with ranks, it writes its environment
    to env.txt beside it and exits 0 (its ranks saved nothing)."""
    path = folder / "mpiexec"
    version = VERSIONS[which].replace("'", "")
    path.write_text(
        f"#!/bin/sh\nif [ \"$1\" = --version ]; then printf '%s\\n' '{version}'; exit 0; fi\nenv > '{folder}/env.txt'\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def as_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    for name in OPEN_MPI_AS_ROOT:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("which", ["open mpi 4", "open mpi 5"])
def test_open_mpi_as_root_gets_the_two_variables(tmp_path, as_root, which):
    env, said = mpi_environment(str(fake_mpiexec(tmp_path, which)))
    assert env == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    assert "running as root with Open MPI's mpiexec" in said
    assert "OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1" in said


def test_mpich_as_root_needs_nothing(tmp_path, as_root):
    assert mpi_environment(str(fake_mpiexec(tmp_path, "mpich"))) == ({}, "")


def test_open_mpi_needs_nothing_when_not_root_or_when_the_user_said_so(tmp_path, monkeypatch, as_root):
    mpiexec = str(fake_mpiexec(tmp_path, "open mpi 5"))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert mpi_environment(mpiexec) == ({}, "")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    for name in OPEN_MPI_AS_ROOT:
        monkeypatch.setenv(name, "1")
    assert mpi_environment(mpiexec) == ({}, "")


def test_an_mpiexec_that_does_not_answer_is_left_to_fail_where_it_starts(tmp_path, as_root):
    assert mpi_environment(str(tmp_path / "no-such-mpiexec")) == ({}, "")


@pytest.mark.parametrize("which, told", [("open mpi 5", True), ("mpich", False)])
def test_launch_gives_open_mpis_ranks_the_variables_and_says_so(tmp_path, monkeypatch, caplog, as_root, which, told):
    mpiexec = fake_mpiexec(tmp_path, which)
    monkeypatch.setattr(allreduce, "find_mpiexec", lambda: str(mpiexec))
    caplog.set_level(logging.INFO, logger="psgd")
    job = JobConfig.from_dict({"cluster": {"workers": 2}})
    with pytest.raises(LaunchError, match="rank 0 finished without saving"):
        launch(job, mode="allreduce", backend="mpi", run_dir=str(tmp_path / "run"), progress=False, timeout=60)
    got = dict(line.split("=", 1) for line in (tmp_path / "env.txt").read_text().splitlines() if "=" in line)
    assert all(got.get(name) == "1" for name in OPEN_MPI_AS_ROOT) == told
    notices = [r.getMessage() for r in caplog.records if "Open MPI" in r.getMessage()]
    assert len(notices) == told


def test_a_machine_without_mpiexec_is_told_how_to_install_one(tmp_path, monkeypatch):
    """No mpiexec beside this Python nor on PATH: a one-line error naming the install command, not a NameError."""
    monkeypatch.setattr(layout.sys, "executable", str(tmp_path / "python3"))
    monkeypatch.setattr(layout.shutil, "which", lambda name: None)
    with pytest.raises(BackendUnavailable, match=r"install one in psgd's folder with `.*\[mpi\]"):
        layout.find_mpiexec()
