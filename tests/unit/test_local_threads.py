"""Training in one process (``psgd train``, ``psgd.train``) picks its BLAS/OpenMP threads as ``psgd launch`` picks
each of its processes' (:func:`psgd.compute.threads.budget`), and says so in one line.  It took every core without
a word, and on a busy machine an epoch took several times as long as with one thread."""

from __future__ import annotations

import numpy as np
import pytest

import psgd
from psgd.cli.main import main
from psgd.compute import threads


@pytest.fixture
def three_cores(monkeypatch):
    """A machine of 3 cores and no thread variable set; the threads a run gives its BLAS pools, kept (not applied)."""
    for name in threads.THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "available_cores", lambda: 3)
    given = []
    monkeypatch.setattr(threads, "apply", lambda n: given.append(n) or f"{n} thread(s)")
    return given


def blobs(n=120):
    rng = np.random.default_rng(1)
    y = rng.integers(0, 3, n)
    return (rng.normal(size=(n, 4)) + 3.0 * np.eye(3, 4)[y]).astype("float32"), y


def said(records) -> list[str]:
    return [r.getMessage() for r in records if "BLAS" in r.getMessage()]


def test_psgd_train_from_python_picks_its_threads_as_launch_does_and_says_so(three_cores, caplog, monkeypatch):
    caplog.set_level("INFO", logger="psgd")
    psgd.train("softmax", blobs(), epochs=1, progress=False)
    assert three_cores == [3]  # a lone process: every core, as psgd launch gives one
    assert said(caplog.records) == [
        "1 process(es) on 3 core(s): 3 BLAS/OpenMP thread(s) each (--threads N or OMP_NUM_THREADS to change)"
    ]
    caplog.clear()
    psgd.train("softmax", blobs(), epochs=1, progress=False, threads=2)
    assert three_cores == [3, 2]
    assert said(caplog.records) == [
        "1 process(es) on 3 core(s): 2 BLAS/OpenMP thread(s) each (--threads N to change)"
    ]  # as a resumed launch, whose job file holds its count, says it
    caplog.clear()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    psgd.train("softmax", blobs(), epochs=1, progress=False)
    assert three_cores == [3, 2, 0]  # the user's variable rules
    assert said(caplog.records) == ["1 process(es) on 3 core(s): BLAS/OpenMP threads as OMP_NUM_THREADS=1 says"]


def test_psgd_train_picks_its_threads_once_and_says_so_in_one_line(three_cores, capsys):
    assert main(["train", "--model", "softmax", "--epochs", "1", "--no-progress", "--threads", "2"]) == 0
    assert three_cores == [2]
    lines = [line for line in capsys.readouterr().err.splitlines() if "BLAS" in line]
    assert len(lines) == 1 and lines[0].endswith(
        " INFO 1 process(es) on 3 core(s): 2 BLAS/OpenMP thread(s) each (--threads N to change)"
    ), lines
