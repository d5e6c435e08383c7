"""``psgd report RUN`` on a run folder someone else wrote: no write through a planted symlink, no module run from
the current folder, no file that is not a regular file, no line read whole past 1 MiB, and malformed lines skipped
and counted; each a line and an exit status, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from psgd.cli.main import main
from psgd.ops.report import LONGEST_LINE, ReportError, draw, summarise

STEP = {"event": "step", "clock": 0, "loss": 2.0, "staleness": 0, "seconds": {"compute": 0.01}}
DONE = {"event": "done", "seconds": 1.0, "steps": 1, "test_accuracy": 0.5}


def run_folder(path: Path, *lines: str | bytes) -> Path:
    path.mkdir()
    with open(path / "worker-0.jsonl", "wb") as f:
        for line in (json.dumps(STEP), *lines, json.dumps(DONE)):
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return path


@pytest.fixture
def own_path(monkeypatch):
    """psgd report takes the current folder off the import path: give it a copy of this process's own."""
    monkeypatch.setattr(sys, "path", list(sys.path))


def test_the_png_is_never_written_through_a_planted_symlink(tmp_path, capsys, own_path):
    pytest.importorskip("matplotlib")
    run = run_folder(tmp_path / "run")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (run / "report.png").symlink_to(victim)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert "report.png is a symbolic link" in err and len(err.strip().splitlines()) == 1, err
    assert victim.read_text() == "precious\n" and (run / "report.png").is_symlink()


def test_the_png_is_written_whole_or_not_at_all(tmp_path, capsys, own_path):
    pytest.importorskip("matplotlib")
    run = run_folder(tmp_path / "run")
    assert main(["report", str(run)]) == 0
    assert (run / "report.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in run.iterdir()) == ["report.png", "worker-0.jsonl"]  # no temporary file left


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_a_metrics_file_that_is_not_a_regular_file_is_refused(kind, tmp_path, capsys, own_path):
    run = tmp_path / "run"
    run.mkdir()
    metrics = run / "worker-0.jsonl"
    if kind == "fifo":
        os.mkfifo(metrics)  # opened for reading, it would wait for a writer for ever
    elif kind == "device":
        metrics.symlink_to("/dev/zero")  # read whole, it would fill the memory
    else:
        metrics.mkdir()
    assert main(["report", str(run), "--no-png"]) == 2
    err = capsys.readouterr().err
    assert "worker-0.jsonl: not a regular file" in err and len(err.strip().splitlines()) == 1, err


def test_a_job_file_that_is_not_a_regular_file_is_refused(tmp_path, capsys, own_path):
    run = run_folder(tmp_path / "run")
    os.mkfifo(run / "job.toml")
    assert main(["report", str(run), "--no-png"]) == 2
    assert "job.toml: not a regular file" in capsys.readouterr().err


def test_malformed_lines_are_skipped_and_counted_in_one_line(tmp_path, capsys, own_path):
    run = run_folder(
        tmp_path / "run",
        "[]",
        "12",
        "null",
        '"step"',
        "{",
        b"\xff\xfe",
        '{"event": 3}',
        '{"event": "step", "loss": "x"}',
        '{"event": "step", "seconds": 5}',
        '{"event": "step", "seconds": {"compute": "slow"}}',
        '{"event": "step", "staleness": [1]}',
        '{"event": "step", "clock": "c"}',
        '{"event": "eval", "test_accuracy": "high"}',
        '{"event": "eval", "step": {}, "test_accuracy": 0.9}',
        '{"event": "done", "seconds": "x"}',
        '{"event": "done", "steps": 1.5}',
        json.dumps(STEP),
    )
    assert main(["report", str(run), "--no-png"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    said = [line for line in out.splitlines() if "skipped" in line]
    assert said == ["    skipped: 16 malformed line(s)"], out
    assert "1 steps in 1.0s" in out and "test accuracy 0.5000" in out


def test_a_line_over_1_mib_is_skipped_without_being_read_whole(tmp_path):
    huge = '{"event": "step", "pad": "' + "x" * (16 * LONGEST_LINE) + '"}'
    run = run_folder(tmp_path / "run", huge, json.dumps(STEP))
    tracemalloc.start()
    try:
        report = summarise(run)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * LONGEST_LINE, peak  # half the line: it was never held whole
    (worker,) = report.workers
    assert (worker.malformed, worker.too_long) == (0, 1)
    assert "    skipped: 1 line(s) longer than 1 MiB" in report.lines()
    assert worker.steps == 1 and len(worker.losses) == 2


def test_a_worker_file_whose_name_is_not_a_rank_is_passed_over(tmp_path):
    run = run_folder(tmp_path / "run")
    (run / "worker-x.jsonl").write_text(json.dumps(STEP) + "\n")
    assert [w.name for w in summarise(run).workers] == ["worker-0"]


def test_draw_refuses_a_symlink_from_python_too(tmp_path):
    pytest.importorskip("matplotlib")
    report = summarise(run_folder(tmp_path / "run"))
    (tmp_path / "out.png").symlink_to(tmp_path / "elsewhere.png")
    with pytest.raises(ReportError, match="is a symbolic link"):
        draw(report, tmp_path / "out.png")
    assert not (tmp_path / "elsewhere.png").exists()


PLANTED = """\
from pathlib import Path
Path(__file__).with_name("RAN").write_text("the planted module ran")
raise SystemExit(99)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["psgd", "python -m psgd.cli.main"])
def test_report_imports_nothing_from_the_current_folder(how, tmp_path):
    """A matplotlib.py (or numpy.py) in the folder a user runs psgd report from is never imported."""
    run = run_folder(tmp_path / "run")
    here = tmp_path / "here"
    here.mkdir()
    for name in ("matplotlib", "numpy", "tomllib") if how == "psgd" else ("matplotlib",):  # -m runs numpy's first
        (here / f"{name}.py").write_text(PLANTED)
    command = [str(Path(sys.executable).parent / "psgd")] if how == "psgd" else [sys.executable, "-m", "psgd.cli.main"]
    done = subprocess.run([*command, "report", str(run)], cwd=here, capture_output=True, text=True, timeout=120)
    assert not (here / "RAN").exists(), done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
