"""psgd bench overlap: its flags, and a small real run started as users start psgd."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from psgd.bench import overlap


@pytest.mark.slow
def test_a_run_of_one_async_worker_measures_both_paths_and_the_two_parts(tmp_path):
    out, picture = tmp_path / "overlap.json", tmp_path / "timeline.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "psgd.cli.main",
            "bench",
            "overlap",
            "--models",
            "quarter",
            "--workers",
            "1",
            "--kinds",
            "async",
            "--epochs",
            "1",
            "--json",
            str(out),
            "--timeline",
            str(picture),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "timeline of async 1w" in done.stdout
    assert "steps/s off" in done.stdout and "async 1w" in done.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["model"] == "quarter" and row["kind"] == "async" and row["workers"] == 1
    assert [r["overlap"] for r in row["runs"]] == [False, True]
    assert all("cluster.overlap=" + ("true" if r["overlap"] else "false") in r["command"] for r in row["runs"])
    assert row["compute_s"] > 0 and row["comm_s"] > 0 and row["steps_per_s_off"] > 0 and row["steps_per_s_on"] > 0
    assert row["on_over_max"] == pytest.approx(row["step_on_s"] / max(row["compute_s"], row["comm_s"]))
    assert row["speedup"] == pytest.approx(row["step_off_s"] / row["step_on_s"])


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--models", "huge"], "--models: unknown huge"),
        (["--kinds", "bsp"], "--kinds: unknown bsp"),
        (["--workers", "x"], "--workers: expected whole numbers"),
        (["--epochs", "0"], "at least 1"),
    ],
)
def test_bad_flags_are_refused_in_one_line(flags, said):
    done = subprocess.run(
        [sys.executable, "-m", "psgd.cli.main", "bench", "overlap", *flags], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_timeline_shows_a_push_and_the_next_pull_at_once(tmp_path):
    """From a worker's step records with spans (what the loop writes with overlap on), one lane per thread."""
    records = []
    for clock in range(6):
        t = clock * 0.1
        records.append(
            {
                "event": "step",
                "clock": clock,
                "wall": t + 0.1,
                "spans": {"compute": [t, t + 0.02], "push": [t + 0.02, t + 0.09], "pull": [t - 0.08, t]},
            }
        )
    log = tmp_path / "worker-0.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    overlap.draw_timeline(log, tmp_path / "t.png", "test")
    assert (tmp_path / "t.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="6 step\\(s\\) with spans, 8 wanted"):
        overlap.draw_timeline(log, tmp_path / "u.png", "test", steps=8)


def test_the_command_line_of_a_run_is_what_a_user_types(tmp_path):
    argv = overlap.launch_argv("sync", 2, 1536, True, 1, tmp_path, 60)
    assert argv[:6] == ["launch", "--mode", "ps", "--policy", "sync", "--shards"]
    assert "cluster.overlap=true" in argv and "model.hidden=[1536, 1536]" in argv
    assert overlap.model_bytes(3072) == 4 * 9_670_666
