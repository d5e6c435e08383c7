"""psgd bench scaling: its arithmetic on hand-made metrics, its checks of the flags, and a small real run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from psgd.bench.scaling.command import add_arguments, settings_from_args
from psgd.bench.scaling.grid import ALLCORES_LABEL, PEER_ENV, PEER_LABEL, RATIO_LABEL, Run
from psgd.bench.scaling.measure import (
    MeasureError,
    allreduce_rates,
    efficiency,
    ps_rates,
    read_steps,
    single_rates,
    span_rate,
    thread_report,
)
from psgd.bench.scaling.report import markdown, tabulate
from psgd.cli.main import main as psgd_main
from psgd.compute.threads import available_cores

PY = sys.executable
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scaling.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def steps(started: float, walls: list[float], role: str = "worker:0") -> list[dict]:
    """A worker's step records: ``time`` on the shared clock rounded to the millisecond, as MetricsLog writes it."""
    return [{"time": round(started + w, 3), "role": role, "event": "step", "wall": w} for w in walls]


# -- the arithmetic, no processes ----------------------------------------------------------------


def test_span_rate_leaves_out_the_first_step():
    assert span_rate([0.5, 0.6, 0.7, 0.8, 0.9]) == pytest.approx(4 / 0.4)
    with pytest.raises(MeasureError, match="too few"):
        span_rate([0.5])
    with pytest.raises(MeasureError):
        span_rate([0.5, 0.5])


def test_ps_rates_count_steps_while_every_worker_was_stepping():
    # worker 0 steps every 10 ms from t=100.000, worker 1 every 20 ms from t=100.105 (a late start)
    w0 = steps(100.0, [0.01 * k for k in range(1, 31)])  # completions 100.01 .. 100.30
    w1 = steps(100.1, [0.005 + 0.02 * k for k in range(1, 11)], "worker:1")  # 100.125 .. 100.305
    got = ps_rates([w0, w1])
    assert got["method"] == "window"
    # window: (100.125, 100.300]: worker 0 completes 100.13..100.30 (18), worker 1 100.145..100.285 (8)
    assert got["window_s"] == pytest.approx(0.175, abs=1e-6)
    assert got["window_steps"] == 18 + 8
    assert got["steps_per_s"] == pytest.approx(26 / 0.175, rel=1e-6)
    assert got["per_worker_steps_per_s"] == pytest.approx(got["steps_per_s"] / 2)
    assert got["worker_steps_per_s"] == pytest.approx([29 / 0.29, 9 / 0.18])
    assert got["sum_of_rates"] == pytest.approx(100 + 50)
    assert got["steps"] == 40 and got["workers"] == 2
    assert got["start_skew_s"] == pytest.approx(0.115, abs=1e-6)


def test_ps_rates_fall_back_to_the_sum_of_rates_when_workers_barely_overlap():
    w0 = steps(100.0, [0.01 * k for k in range(1, 21)])  # 100.01 .. 100.20
    w1 = steps(100.19, [0.01 * k for k in range(1, 21)], "worker:1")  # 100.20 .. 100.39
    got = ps_rates([w0, w1])
    assert got["method"] == "sum of per-worker rates"
    assert got["steps_per_s"] == pytest.approx(2 * 19 / 0.19)
    assert got["per_worker_steps_per_s"] == pytest.approx(19 / 0.19)


def test_ps_rates_of_one_worker_is_its_own_rate_and_too_little_is_refused():
    got = ps_rates([steps(5.0, [0.2, 0.3, 0.4, 0.6])])
    assert got["steps_per_s"] == pytest.approx(3 / 0.4) and got["method"] == "window"
    with pytest.raises(MeasureError, match="worker 1 recorded 1 step"):
        ps_rates([steps(5.0, [0.2, 0.3]), steps(5.0, [0.2], "worker:1")])
    with pytest.raises(MeasureError):
        ps_rates([])


def test_allreduce_and_single_process_rates():
    records = [{"event": "step", "step": k, "wall": 0.002 * k} for k in range(1, 11)]
    got = allreduce_rates(records, 4)
    assert got["per_worker_steps_per_s"] == pytest.approx(9 / 0.018)
    assert got["steps_per_s"] == pytest.approx(4 * 9 / 0.018) and got["steps"] == 40
    got = single_rates({"steps": 880, "seconds": 0.4, "test_accuracy": 0.9})
    assert got["steps_per_s"] == pytest.approx(2200) and got["per_worker_steps_per_s"] == pytest.approx(2200)
    with pytest.raises(MeasureError):
        single_rates({"steps": 10, "seconds": 0.0})


def test_efficiency_is_aggregate_over_n_times_one_process():
    assert efficiency(300.0, 2, 200.0) == pytest.approx(0.75)
    assert efficiency(300.0, 4, 100.0) == pytest.approx(0.75)
    assert efficiency(300.0, 2, None) is None and efficiency(None, 2, 100.0) is None


def test_read_steps_keeps_only_step_lines(tmp_path):
    path = tmp_path / "worker-0.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [{"event": "step", "wall": 0.1}, {"event": "done", "steps": 1}, {"event": "step", "wall": 0.2}]
        )
        + "\n\n"
    )
    assert [r["wall"] for r in read_steps(path)] == [0.1, 0.2]


def test_thread_report_reads_the_launchers_line():
    line = "21:35:19 launch[15901] INFO 5 process(es) on 16 core(s): 3 BLAS/OpenMP thread(s) each (--threads N)"
    assert thread_report("psgd: something\n" + line) == (
        "5 process(es) on 16 core(s): 3 BLAS/OpenMP thread(s) each (--threads N)",
        3,
    )
    said = "3 process(es) on 16 core(s): BLAS/OpenMP threads as OMP_NUM_THREADS=1 says"
    assert thread_report(said) == (said, 1)
    assert thread_report("final test accuracy: 0.95") == ("", None)


def test_the_plan_runs_the_peer_beside_its_twin_and_flags_fill_in_quick():
    settings = settings_from_args(_args("--quick"))
    assert [(r.row, r.column) for r in settings.plan()] == [
        (w, c) for w in ("64", "512") for c in ("1 process", "sync 1w", "sync 2w", PEER_LABEL, ALLCORES_LABEL)
    ]
    settings = settings_from_args(_args("--quick", "--workers", "1", "--configs", "sync,peer,cnn", "--widths", "128"))
    assert [(r.row, r.column) for r in settings.plan()] == [
        ("128", "sync 1w"),
        ("128", "sync 2w"),
        ("128", PEER_LABEL),
        ("cnn", "sync 1w"),
        ("cnn", "sync 2w"),
        ("cnn", PEER_LABEL),
    ]
    full = settings_from_args(_args())
    assert len(full.plan()) == 8 * 12 and full.repeats == 3 and full.epochs == 20
    assert full.columns() == [
        "1 process",
        "sync 1w",
        "sync 2w",
        "sync 4w",
        "async 1w",
        "async 2w",
        "async 4w",
        "all-reduce 1w",
        "all-reduce 2w",
        "all-reduce 4w",
        PEER_LABEL,
        ALLCORES_LABEL,
    ]
    peer = Run("256", "sync", 2, peer=True)
    argv = peer.argv(3, "DIR", 60)
    assert argv[:2] == ["launch", "--mode"] and "--set" in argv and "model.hidden=[256]" in argv
    no_budget = Run("256", "sync", 2, all_cores=True).argv(3, "DIR", 60)
    assert no_budget[no_budget.index("--threads") + 1] == str(available_cores())
    assert "--threads" not in argv
    assert Run("cnn", "single").argv(3) == [
        "train",
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        "--epochs",
        "3",
        "--model",
        "cnn",
        "--no-progress",
        "--json",
    ]


def _args(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def _record(row, column, kind, workers, rate, peer=False, error=None, threads=None):
    r = {"row": row, "column": column, "kind": kind, "workers": workers, "peer": peer, "blas_threads": threads}
    if error:
        r["error"] = error
    else:
        r.update(steps_per_s=rate, per_worker_steps_per_s=rate / workers)
    return r


def test_table_medians_efficiency_and_peer_ratio_from_hand_made_runs():
    settings = settings_from_args(
        _args("--widths", "64,512", "--workers", "2", "--configs", "single,sync,allreduce,peer", "--repeats", "3")
    )
    records = []
    for rate in (1000.0, 900.0, 1100.0):
        records += [
            _record("64", "1 process", "single", 1, rate),
            _record("64", "sync 2w", "sync", 2, rate * 1.5, threads=1),
            _record("64", PEER_LABEL, "sync", 2, rate * 1.5, peer=True, threads=1),
            _record("512", "1 process", "single", 1, rate / 2),
        ]
    records += [
        _record("512", "sync 2w", "sync", 2, 40.0, threads=8),
        _record("512", PEER_LABEL, "sync", 2, 800.0, peer=True, threads=1),
        _record("512", "sync 2w", "sync", 2, 0, error="exit status 1: psgd: error: boom"),
    ]
    table = tabulate(records, settings, {"allreduce": "mpi4py is not installed"})
    assert table["columns"] == ["1 process", "sync 2w", "all-reduce 2w", PEER_LABEL]
    assert table["steps_per_s"]["64"]["1 process"] == pytest.approx(1000)  # the median of three
    assert table["steps_per_s"]["64"]["sync 2w"] == pytest.approx(1500)
    assert table["per_worker_steps_per_s"]["64"]["sync 2w"] == pytest.approx(750)
    assert table["efficiency"]["64"]["sync 2w"] == pytest.approx(1500 / (2 * 1000))
    assert table["peer_ratio"]["64"] == pytest.approx(1.0)
    assert table["steps_per_s"]["512"]["sync 2w"] == pytest.approx(40)  # the failed repeat is left out
    assert table["peer_ratio"]["512"] == pytest.approx(0.05)
    assert table["steps_per_s"]["512"]["all-reduce 2w"] == "skipped"
    assert table["blas_threads"]["512"]["sync 2w"] == [8]
    text = markdown(
        {
            "table": table,
            "settings": settings.to_dict(),
            "thread_env": {},
            "skipped": {"allreduce": "mpi4py is not installed"},
            "machine": "m",
            "runs": records,
            "seconds": 1.0,
            "load_average": {"before": [0, 0, 0], "after": [0, 0, 0]},
        }
    )
    first = text.split("\n\n")[1].splitlines()
    assert first[0] == f"| model | 1 process | sync 2w | all-reduce 2w | {PEER_LABEL} | {RATIO_LABEL} |"
    assert first[2] == "| MLP 64 | 1,000 | 1,500 | skipped | 1,500 | 1.00 |"
    assert first[3] == "| MLP 512 | 500 | 40.0 | skipped | 800 | 0.05 (< 0.8) |"
    assert "all-reduce: skipped: mpi4py is not installed" in text
    assert "| MLP 512 | 0.04 | skipped | 0.80 |" in text  # efficiency: 40 / (2 x 500), 800 / (2 x 500)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--widths", "64,lots"], ["--widths", "'64,lots'"]),
        (["--widths", "0"], ["--widths", "at least 1"]),
        (["--workers", ","], ["--workers", "at least one"]),
        (["--configs", "sync,warp"], ["--configs: unknown warp", "choose from"]),
        (["--configs", "cnn"], ["nothing to run"]),
        (["--widths", "", "--configs", "sync"], ["nothing to run"]),
        (["--epochs", "0"], ["--epochs must be at least 1"]),
        (["--epochs", "two"], ["--epochs", "'two'"]),
        (["--repeats", "0"], ["--repeats must be at least 1"]),
        (["--timeout", "-5"], ["--timeout must be at least"]),
    ],
)
def test_bad_flags_are_one_line_errors_before_anything_runs(argv, words, tmp_path, capsys):
    out = tmp_path / "out"
    assert psgd_main(["bench", "scaling", "--out", str(out), "--no-progress", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()
    assert captured.err.startswith("psgd: error: ") and captured.err.count("\n") == 1, captured.err
    for word in words:
        assert word in captured.err, (word, captured.err)


# -- a real run ------------------------------------------------------------------------------------


def test_a_quick_run_writes_the_table_json_and_plot(tmp_path):
    out, extra = tmp_path / "out", tmp_path / "all.json"
    done = subprocess.run(
        [
            PY,
            "-m",
            "psgd.cli.main",
            "bench",
            "scaling",
            "--quick",
            "--widths",
            "64",
            "--out",
            str(out),
            "--json",
            str(extra),
            "--timeout",
            "120",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {"table.md", "scaling.json", "scaling.png"}
    assert (out / "scaling.png").read_bytes()[:8] == PNG_SIGNATURE
    for column in ("1 process", "sync 1w", "sync 2w", PEER_LABEL, ALLCORES_LABEL):
        assert f"MLP 64 | {column} #0: " in done.stderr  # one line per finished run under the progress bar
    table = (out / "table.md").read_text()
    assert table in done.stdout
    head, rule, *rows = table.split("\n\n")[1].splitlines()
    assert head == f"| model | 1 process | sync 1w | sync 2w | {PEER_LABEL} | {ALLCORES_LABEL} | {RATIO_LABEL} |"
    assert [r.split(" | ")[0] for r in rows] == ["| MLP 64"]

    result = json.loads((out / "scaling.json").read_text())
    assert json.loads(extra.read_text())["table"] == result["table"]
    assert result["machine"] and result["cores"] >= 1 and result["settings"]["epochs"] == 1
    runs = result["runs"]
    assert [r["column"] for r in runs] == ["1 process", "sync 1w", "sync 2w", PEER_LABEL, ALLCORES_LABEL]
    for r in runs:
        assert not r.get("error"), r
        assert r["steps_per_s"] > 0 and r["per_worker_steps_per_s"] > 0
        assert r["command"].startswith("psgd train " if r["kind"] == "single" else "psgd launch --mode ps ")
        assert r["env"] == (PEER_ENV if r["peer"] else {})  # nothing set for the as-shipped runs
        assert ("--threads" in r["command"]) == r["all_cores"]
    t = result["table"]
    single = t["steps_per_s"]["64"]["1 process"]
    assert single == pytest.approx(runs[0]["steps_per_s"])
    for col, n in (("sync 1w", 1), ("sync 2w", 2), (PEER_LABEL, 2), (ALLCORES_LABEL, 2)):
        assert t["efficiency"]["64"][col] == pytest.approx(t["steps_per_s"]["64"][col] / (n * single))
        assert t["per_worker_steps_per_s"]["64"][col] == pytest.approx(t["steps_per_s"]["64"][col] / n)
    cells = t["steps_per_s"]["64"]
    assert t["peer_ratio"]["64"] == pytest.approx(cells["sync 2w"] / cells[PEER_LABEL])


def test_the_script_is_the_same_command():
    done = subprocess.run([PY, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "psgd bench scaling" in done.stdout and "estimate" in done.stdout
