"""psgd bench flood: its checks of the flags, and a small real run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from psgd.bench import flood

PY = sys.executable


def bench(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "psgd.cli.main", "bench", "flood", *argv], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--seconds", "0"], ["--seconds must be positive"]),
        (["--connections", "-1"], ["--connections must be at least 0"]),
    ],
)
def test_bad_flags_are_one_line_errors_before_anything_runs(argv, words):
    done = bench(*argv, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == "" and done.stderr.startswith("psgd: error: ") and done.stderr.count("\n") == 1
    assert all(w in done.stderr for w in words), done.stderr


def test_a_workers_steps_are_counted_between_two_times(tmp_path):
    records = tmp_path / "worker0.jsonl"
    records.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"event": "eval", "time": 1.5},
                {"event": "step", "time": 1.0},
                {"event": "step", "time": 2.0},
                {"event": "step", "time": 3.0},
            ]
        )
        + "\n{\"event\": \"step\", \"ti"
    )  # a line still being written
    assert flood._steps(records, 1.0, 3.0) == 2


@pytest.mark.slow
def test_a_flood_past_the_cap_leaves_the_shard_training_answering_and_checkpointing(tmp_path):
    """1,500 connections, more than the gRPC port takes (1,024): in both floods the worker trains on, Status is
    answered, a new worker joins, checkpoints are written, and the shard holds fewer descriptors than the flood
    opened connections.  About 30 s."""
    out = tmp_path / "flood.json"
    done = bench("--seconds", "1.5", "--connections", "1500", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    for kind in ("idle", "reopened"):
        figures = result[kind]
        assert figures["versions_per_s"] > 0 and figures["status_answered"] >= 1, figures
        assert figures["checkpoints_written"] >= 1 and figures["new_worker_first_step_s"] > 0, figures
        assert figures["descriptors_held_at_most"] < 1500 and figures["flood"]["opened"] >= 1500, figures
        assert figures["background_errors"] in (0, None) and not figures["checkpoint_failures"], figures
