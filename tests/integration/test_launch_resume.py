"""A stopped psgd launch resumes: Ctrl-C stops every process, the shards write their last checkpoints in the run
folder and the launcher says how to continue; psgd launch --resume RUN goes on from them and ends where the same
job run without a stop ends, to the bit (sync, float64)."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
from helpers import assert_rejoined_at_once, wait_for

PSGD = shutil.which("psgd") or "psgd"
JOB = ["--epochs", "150", "--set", "train.dtype=float64", "--no-progress"]


def steps_done(run) -> int:
    path = run / "worker-0.jsonl"
    return path.read_text().count('"event": "step"') if path.exists() else 0


@pytest.mark.slow
def test_a_launch_stopped_with_ctrl_c_resumes_and_ends_where_an_unstopped_one_ends(tmp_path):
    whole = subprocess.run(
        [PSGD, "launch", *JOB, "--run-dir", str(tmp_path / "whole"), "--save", str(tmp_path / "whole.npz")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert whole.returncode == 0, whole.stderr

    run = tmp_path / "run"
    launch = subprocess.Popen(
        [PSGD, "launch", *JOB, "--run-dir", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(lambda: steps_done(run) > 300 or launch.poll() is not None, 120, "300 steps of worker 0")
        assert launch.poll() is None, "the job ended before it could be stopped"
        launch.send_signal(signal.SIGINT)
        _, err = launch.communicate(timeout=60)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 128 + signal.SIGINT, err
    assert f"continue with psgd launch --no-progress --resume {run}" in err  # the flags RUN/job.toml does not keep
    stopped_at = steps_done(run)
    assert 300 < stopped_at < 150 * 22  # stopped halfway, not at the end

    again = subprocess.run([PSGD, "launch", *JOB, "--run-dir", str(run)], capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and f"continue it with psgd launch --resume {run}" in again.stderr

    began = time.monotonic()
    resumed = subprocess.run(
        [PSGD, "launch", "--resume", str(run), "--no-progress", "--save", str(tmp_path / "resumed.npz")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert time.monotonic() - began < 300
    assert "restored version" in (run / "shard-0.log").read_text()
    assert_rejoined_at_once(run, resumed.stderr)  # not taken for "a second psgd-worker": no WARNING, no wait
    whole_weights, resumed_weights = np.load(tmp_path / "whole.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(whole_weights.files) == sorted(resumed_weights.files)
    for name in whole_weights.files:
        np.testing.assert_array_equal(resumed_weights[name], whole_weights[name], err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["psgd launch", "psgd.launch"])
def test_a_resumed_launch_keeps_its_earlier_logs_and_its_report_counts_the_whole_run(tmp_path, how):
    """A finished job resumed (nothing left to do): each log keeps the first part's lines, a line says where the
    run resumed, and psgd report counts the steps of the whole run, not the no steps of its last part."""
    run = tmp_path / "run"
    if how == "psgd launch":
        for again in ([], ["--resume", str(run)]):
            done = subprocess.run(
                [PSGD, "launch", "--no-progress", *(again or ["--epochs", "2", "--run-dir", str(run)])],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stderr
    else:
        import psgd

        for resume in (False, True):
            psgd.launch("mlp", "digits", epochs=2, run_dir=run, resume=resume, progress=False, timeout=120)
    for name in ("worker-0", "worker-1", "shard-0"):
        text = (run / f"{name}.log").read_text()
        assert text.count("---- resumed at ") == 1, text
        first, resumed = text.split("---- resumed at ")
        assert "joining" in first and "joining" in resumed or name.startswith("shard"), text
    first = (run / "worker-0.log").read_text().split("---- resumed at ")[0]
    assert "worker 0 done: 44 steps" in first  # the first part's lines, kept
    said = subprocess.run([PSGD, "report", str(run), "--no-png"], capture_output=True, text=True, timeout=60)
    assert said.returncode == 0, said.stderr
    for rank in (0, 1):  # (was "0 steps in 0.0s (0 steps/s)": the last part's count)
        assert re.search(rf"\n  worker-{rank}: 44 steps in [0-9.]+s over 2 parts \([0-9,]+ steps/s\)", said.stdout), (
            said.stdout
        )
