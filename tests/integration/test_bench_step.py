"""psgd bench step: a small real run started as users start psgd, and its flags."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_a_small_run_measures_the_step_where_it_goes_and_its_floor(tmp_path):
    out = tmp_path / "step.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "psgd.cli.main",
            "bench",
            "step",
            "--widths",
            "64",
            "--steps",
            "16",
            "--runs",
            "shm,tcp",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (row,) = json.loads(out.read_text())["widths"]
    assert row["width"] == 64 and row["bytes"] == 4 * (1024 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10)
    assert row["floor_exchange_ms"] > 0 and row["floor_steps_per_s"] < row["alone"]["steps_per_s"]
    for run in ("shm", "tcp"):
        r = row[run]
        assert r["steps"] == 16 and r["steps_per_s"] > 0 and 0 <= r["test_accuracy"] <= 1
        assert r["compute_ms"] > 0 and r["exchange_ms"] > 0
        assert r["shard_receive_ms"] > 0 and r["shard_apply_ms"] > 0  # the launch's "shard_seconds"
    assert "floor of a step behind a shard" in done.stdout


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--runs", "bsp"], "--runs: unknown bsp"),
        (["--widths", "x"], "--widths: expected whole numbers"),
        (["--steps", "2"], "at least 8"),
    ],
)
def test_bad_flags_are_refused_in_one_line(flags, said):
    done = subprocess.run(
        [sys.executable, "-m", "psgd.cli.main", "bench", "step", *flags], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr
