"""What a run folder gives a user to look at: CSV rows and TensorBoard's event files beside the JSON lines (the event
files read back here with TensorBoard's own reader), and ``psgd report RUN``, a run's summary in lines and its curves
as a PNG."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A two-worker sync launch of the digits' MLP for two epochs, as a user starts it."""
    folder = tmp_path_factory.mktemp("launch") / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "psgd.cli.main",
            "launch",
            "--workers",
            "2",
            "--shards",
            "2",
            "--epochs",
            "2",
            "--no-progress",
            "--run-dir",
            str(folder),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return folder


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_every_worker_writes_its_curves_as_tensorboard_event_files(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for rank in (0, 1):
        board = EventAccumulator(str(run / "tensorboard" / f"worker-{rank}"))
        board.Reload()
        tags = board.Tags()["scalars"]
        assert {"train/loss", "seconds/compute", "seconds/exchange"} <= set(tags), tags
        losses = board.Scalars("train/loss")
        steps = [rec for rec in _lines(run / f"worker-{rank}.jsonl") if rec["event"] == "step"]
        assert losses and losses[0].step == steps[0]["clock"] + 1 and losses[-1].step <= len(steps)
        first = steps[0]["loss"]
        assert losses[0].value == pytest.approx(first, rel=1e-6)
    evals = [rec for rec in _lines(run / "worker-0.jsonl") if rec["event"] == "eval"]
    board = EventAccumulator(str(run / "tensorboard" / "worker-0"))
    board.Reload()
    accuracy = board.Scalars("eval/test_accuracy")
    assert [(a.step, round(a.value, 6)) for a in accuracy] == [(e["step"], round(e["test_accuracy"], 6)) for e in evals]


def test_every_worker_writes_its_steps_and_evaluations_as_csv_rows(run):
    for rank in (0, 1):
        lines = _lines(run / f"worker-{rank}.jsonl")
        with open(run / f"worker-{rank}.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        wanted = [rec for rec in lines if rec["event"] in ("step", "eval")]
        assert [r["event"] for r in rows] == [rec["event"] for rec in wanted]
        for row, rec in zip(rows, wanted):
            if rec["event"] == "step":
                assert int(row["step"]) == rec["clock"] + 1 and float(row["loss"]) == rec["loss"]
                assert float(row["exchange_seconds"]) == rec["seconds"]["exchange"] and row["test_accuracy"] == ""
            else:
                assert int(row["step"]) == rec["step"] and float(row["test_accuracy"]) == rec["test_accuracy"]


def test_psgd_report_says_what_each_worker_did_and_draws_the_curves(run, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "psgd.cli.main", "report", str(run), "--png", str(tmp_path / "r.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"run {run}: mlp on digits, sync, 2 worker(s), 2 shard(s)"
    done = [rec for rec in _lines(run / "worker-0.jsonl") if rec["event"] == "done"][0]
    assert lines[1].startswith(f"  worker-0: 44 steps in {done['seconds']:.1f}s (")
    assert lines[1].endswith(f"; test accuracy {done['test_accuracy']:.4f}")
    assert lines[2] == "    staleness median 0, max 0"
    assert lines[3].startswith("    a step: weights ") and ", exchange " in lines[3]
    assert lines[4].startswith("  worker-1: 44 steps in ") and "test accuracy" not in lines[4]
    assert lines[7] == f"curves: {tmp_path / 'r.png'}"
    assert max(len(line) for line in lines[1:7]) <= 80, lines
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_psgd_report_of_a_folder_that_is_not_a_run_says_so(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "psgd.cli.main", "report", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "holds no metrics lines (worker-R.jsonl)" in out.stderr, out.stderr


def test_a_launch_never_writes_through_links_planted_in_its_run_folder(tmp_path):
    """A link named shard-0.log had its target emptied, one named worker-0.csv had rows appended to its target; a
    folder of an earlier run is refused unless resumed, and a resumed one is written without following links."""
    run = tmp_path / "run"
    run.mkdir()
    victims = {name: tmp_path / f"victim-{name}" for name in ("shard-0.log", "worker-0.csv")}
    for name, victim in victims.items():
        victim.write_text("precious\n")
        (run / name).symlink_to(victim)
    launch = [sys.executable, "-m", "psgd.cli.main", "launch", "--no-progress"]
    small = ["--workers", "1", "--shards", "1", "--epochs", "1"]
    done = subprocess.run([*launch, *small, "--run-dir", str(run)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"psgd: error: {run} holds the files of an earlier run "
        f"(shard-0.log): continue it with psgd launch --resume {run}, or give "
        "another --run-dir"
    )
    (run / "job.toml").write_text("[train]\nepochs = 1\n[cluster]\nworkers = 1\nshards = 1\n")
    done = subprocess.run([*launch, "--resume", str(run)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        f"psgd: error: {run / 'shard-0.log'}: a symbolic link where psgd writes its own file"
    )
    assert all(victim.read_text() == "precious\n" for victim in victims.values())
