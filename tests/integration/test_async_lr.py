"""One meaning of the learning rate under every policy: the job that trains under sync trains under
async and ssp too (digits, 4 workers, 2 shards, momentum at lr 0.1, as a user launches it).

Under sync a round of N pushes is averaged into one update; under async and ssp each push is an
update of its own, so by default each is applied at lr / N: without staleness, N pushes move the
weights as one sync round does.  At the full rate per push (``async_lr = "full"``) the same job ended
at 0.10 to 0.92 under async, as the staleness of the moment had it, and at 0.11 and 0.18 under ssp.  The
rate itself is checked exactly in tests/unit/test_shard_core.py.

Async and ssp orders depend on the scheduler, so one run's accuracy is a draw: on 2 cores ssp at staleness 2 ended
at 0.947-0.983 in 12 runs alone, and once at 0.930 in CI (async once at 0.939) against sync's 0.964, which is the
same every run.  So each is launched RUNS times and the median is compared: it may end up to TOLERANCE below sync,
still far above those failures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

PSGD = shutil.which("psgd") or "psgd"
TOLERANCE = 0.03
RUNS = 3  # launches of each of async and ssp; their median accuracy is compared
JOB = ["--workers", "4", "--shards", "2", "--optimizer", "momentum", "--lr", "0.1", "--epochs", "10"]


def launch(tmp_path: Path, *args: str) -> dict:
    tmp_path.mkdir(exist_ok=True)
    run_dir = tmp_path / "-".join(a.lstrip("-") for a in args)
    argv = [PSGD, "launch", *JOB, *args, "--no-progress", "--json", "--run-dir", str(run_dir)]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert done.returncode == 0, f"{' '.join(argv)}: exit {done.returncode}\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_async_and_ssp_train_at_the_settings_that_train_sync(tmp_path):
    result = launch(tmp_path, "--policy", "sync")
    sync = result["test_accuracy"]
    assert sync > 0.9 and not result["diverged"]
    for policy in (["--policy", "async"], ["--policy", "ssp", "--staleness", "2"]):
        accuracies = sorted(launch(tmp_path / f"run{n}", *policy)["test_accuracy"] for n in range(RUNS))
        median = accuracies[RUNS // 2]
        assert median >= sync - TOLERANCE, (
            f"{' '.join(policy)}: median {median:.3f} of {accuracies} against sync's {sync:.3f}"
        )
        assert not result["diverged"], result["divergence"]  # the divergence guard stays silent
