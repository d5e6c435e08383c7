"""The divergence guard as a user meets it: one WARNING line from the process that saw the run diverge,
``"diverged"`` in ``--json``, and status 3 with ``--fail-on-divergence``; nothing of it on a run that
trains.  The guard's rules are checked one by one in tests/unit/test_divergence.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

PSGD = shutil.which("psgd") or "psgd"


def psgd(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    argv = [PSGD, *args, "--no-progress", "--json"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert done.returncode in (0, 3), f"{' '.join(argv)}: exit {done.returncode}\n{done.stderr[-3000:]}"
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def warnings_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " WARNING " in line and "training diverged" in line]


def test_a_single_process_run_at_too_high_a_rate_is_told_and_fails_when_asked(tmp_path):
    rc, result, stderr = psgd(tmp_path, "train", "--lr", "3", "--epochs", "3", "--fail-on-divergence")
    assert rc == 3 and result["diverged"] is True
    assert result["divergence"]["by"] == "local" and "lr = 3" in result["divergence"]["advice"]
    assert len(warnings_of(stderr)) == 1, stderr
    rc, result, _ = psgd(tmp_path, "train", "--lr", "3", "--epochs", "3")
    assert rc == 0 and result["diverged"] is True  # told, but the exit status is the user's choice


def test_a_run_that_trains_is_left_alone(tmp_path):
    rc, result, stderr = psgd(tmp_path, "train", "--epochs", "3", "--fail-on-divergence")
    assert rc == 0 and result["diverged"] is False and result["divergence"] is None
    assert result["test_accuracy"] > 0.8 and not warnings_of(stderr)


@pytest.mark.slow
def test_an_async_job_at_the_full_rate_per_push_is_told_why(tmp_path):
    """Four async workers each applying momentum 0.9 at lr 0.5: the weights blow up.  The launcher repeats the
    worker's line (the worker's own went to its log) and names the async remedy."""
    rc, result, stderr = psgd(
        tmp_path,
        "launch",
        "--workers",
        "4",
        "--shards",
        "2",
        "--policy",
        "async",
        "--optimizer",
        "momentum",
        "--lr",
        "0.5",
        "--epochs",
        "4",
        "--set",
        'cluster.async_lr="full"',
        "--run-dir",
        str(tmp_path / "run"),
        "--fail-on-divergence",
    )
    assert rc == 3 and result["diverged"] is True, result
    divergence = result["divergence"]
    assert 'async_lr = "divided"' in divergence["advice"]
    told = warnings_of(stderr)
    assert len(told) == 1 and told[0].split(" WARNING ", 1)[1].startswith(f"{divergence['by']}: "), stderr
    if divergence["by"] != "launcher":
        worker = divergence["by"].split()[1]
        lines = (tmp_path / "run" / f"worker-{worker}.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines if json.loads(x)["event"] == "diverged"] == [divergence["step"]]
