"""The convergence lab (psgd bench convergence): its parts, and a --quick run of the whole lab."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from psgd.bench import LabConfig, LabResult, RunResult, parse_contender, parse_scenario, preset
from psgd.bench.convergence import summarize
from psgd.bench.labresult import load_result
from psgd.bench.observe import Sample, allreduce_points, percentile, ps_points
from psgd.bench.report import markdown_table
from psgd.config import ConfigError

POINT_KEYS = {
    "wall",
    "steps",
    "updates",
    "loss",
    "test_loss",
    "test_accuracy",
    "staleness_p50",
    "staleness_p99",
    "bytes",
}
SUMMARY_KEYS = {
    "time_to_target",
    "updates_to_target",
    "steps_to_target",
    "final_accuracy",
    "train_seconds",
    "steps_per_s",
    "updates_per_s",
    "staleness_p50",
    "staleness_p99",
    "bytes",
}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# -- parts, no processes -------------------------------------------------------------


def test_contenders_and_scenarios_parse():
    assert parse_contender("sync").sets == ("cluster.policy=sync",)
    assert parse_contender("ssp:4").sets == ("cluster.policy=ssp", "cluster.staleness=4")
    assert parse_contender("backup:1").sets == ("cluster.policy=sync", "cluster.backup_workers=1")
    assert parse_contender("allreduce").mode == "allreduce"
    for bad in ("ssp", "ssp:x", "backup:0", "bsp", "async:2"):
        with pytest.raises(ConfigError):
            parse_contender(bad)
    assert parse_scenario("none").delay == "" and parse_scenario("none").name == "no-straggler"
    assert parse_scenario("slowdown:4@0").name == "slowdown-4-at0"
    with pytest.raises(ConfigError, match="unknown kind"):
        parse_scenario("slow:4")


def test_config_is_checked_before_anything_runs():
    config = preset("quick")
    config.policies = ["backup:2"]  # as many backup workers as workers
    with pytest.raises(ConfigError, match="fewer backup workers"):
        config.check()
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("huge")


def test_percentile_of_a_histogram():
    assert percentile([0] * 16, 0.5) is None
    assert percentile([10, 0, 0], 0.5) == 0
    assert percentile([50, 49, 1], 0.5) == 0
    assert percentile([50, 49, 1], 0.99) == 1
    assert percentile([50, 40, 10], 0.99) == 2


def _sample(t, version, pulls, nbytes, acc, hist=(3, 1)):
    return Sample(t, [version, version], pulls, nbytes, list(hist), {"late": 0}, 1.0, acc)


def test_ps_points_share_the_clock_of_the_first_step_and_leave_out_observer_bytes():
    steps = [
        {"time": 100.5, "wall": 0.5, "loss": 2.0, "role": "w0"},  # worker loop started at 100.0
        {"time": 100.7, "wall": 0.6, "loss": 1.0, "role": "w1"},  # started at 100.1
        {"time": 101.2, "wall": 1.2, "loss": 0.5, "role": "w0"},
    ]
    samples = [_sample(99.0, 0, 1, 1000, 0.1), _sample(100.8, 2, 2, 5000, 0.5), _sample(101.5, 3, 3, 9000, 0.9)]
    first = {"wall": 0.0, "steps": 0, "updates": 0, "test_accuracy": 0.1}
    points = ps_points(samples, steps, 100.0, model_bytes=1000, first=first)
    assert [p["wall"] for p in points] == [0.0, 0.8, 1.5]  # the sample before the start is dropped
    assert [p["steps"] for p in points[1:]] == [2, 3]
    assert [p["updates"] for p in points[1:]] == [2, 3]
    assert [p["bytes"] for p in points[1:]] == [3000, 6000]
    assert points[1]["loss"] == pytest.approx(1.5) and points[2]["loss"] == pytest.approx(3.5 / 3, abs=1e-5)
    summary = summarize(points, 0.5, train_seconds=1.2)
    assert summary["time_to_target"] == 0.8 and summary["updates_to_target"] == 2
    assert summary["final_accuracy"] == 0.9 and summary["steps_per_s"] == pytest.approx(2.5)
    assert summarize(points, 0.95, 1.2)["time_to_target"] is None


def test_allreduce_points_count_n_gradients_per_step_and_ring_bytes():
    lines = [{"time": 10.0 + 0.1 * s, "wall": 0.1 * s, "clock": s - 1, "loss": 1.0, "role": "r0"} for s in range(1, 5)]
    evals = [
        {"time": 10.2, "wall": 0.2, "step": 2, "test_accuracy": 0.5},
        {"time": 10.4, "wall": 0.4, "step": 4, "test_accuracy": 0.7},
    ]
    points = allreduce_points(lines, evals, workers=4, model_bytes=100, first={"wall": 0.0})
    assert [(p["steps"], p["updates"]) for p in points[1:]] == [(8, 2), (16, 4)]
    assert [p["bytes"] for p in points[1:]] == [2 * 2 * 3 * 100, 4 * 2 * 3 * 100]
    assert points[1]["wall"] == pytest.approx(0.2)


def test_table_has_one_row_per_policy_with_medians():
    def run(policy, repeat, ttt):
        summary = {
            "time_to_target": ttt,
            "updates_to_target": 10,
            "steps_to_target": 40,
            "final_accuracy": 0.9,
            "train_seconds": 1.0,
            "steps_per_s": 100.0 + repeat,
            "updates_per_s": 25.0,
            "staleness_p50": 0,
            "staleness_p99": 1,
            "bytes": 2e6,
        }
        return RunResult(f"s/{policy}", "s", "", policy, policy, "ps", {}, [], [{}, {}], summary, None, repeat)

    runs = [
        run("sync", 0, 1.0),
        run("async", 0, None),
        run("sync", 1, 3.0),
        run("async", 1, 0.5),
        run("sync", 2, 2.0),
        run("async", 2, None),
    ]
    table = markdown_table(LabResult(LabConfig(repeats=3), "m", 1, 4, runs, 1.0, {}, {}))
    rows = [line.split("|")[1:-1] for line in table.splitlines()]
    assert len(rows) == 4 and set(rows[1]) == {"---"}
    sync, asyn = ([c.strip() for c in r] for r in rows[2:])
    assert sync[:4] == ["s", "sync", "3/3", "2.00 (1.00-3.00)"] and sync[8] == "101.0 (100.0-102.0)"
    assert sync[6] == "0.900"  # the same in every repeat: no spread shown
    assert asyn[2:4] == ["1/3", "not reached"]  # the median run did not reach the target


def test_the_answer_shows_the_spread_and_is_no_finer_than_the_evaluation_interval():
    """A median's least and most over the repeats beside it; a ratio of times to target measured 0.05 s apart is
    a tie within that, and otherwise has the digits its error leaves standing (it said 2.17x for 0.09 s against
    0.04)."""
    from psgd.bench.answer import as_long, recommend

    assert as_long(0.09, 0.04, 0.05) == "as long, to within the 0.05 s between evaluations"
    assert as_long(2.0, 1.0, 0.05) == "2.0x as long"
    assert as_long(0.3, 0.1, 0.05) == "0.20 s later"  # 0.1 s measured 0.05 s apart: no ratio to speak of
    assert as_long(30.0, 10.0, 0.02) == "3.00x as long"

    def run(policy, repeat, ttt):
        summary = {"time_to_target": ttt, "final_accuracy": 0.9, "steps_per_s": 100.0}
        return RunResult(f"s/{policy}", "s", "", policy, policy, "ps", {}, [], [{}, {}], summary, None, repeat)

    runs = [run("sync", r, t) for r, t in enumerate((1.0, 3.0, 2.0))] + [
        run("async", r, t) for r, t in enumerate((0.5, 0.6, 0.7))
    ]
    text = recommend(LabResult(LabConfig(repeats=3, eval_interval=0.05), "m", 1, 4, runs, 1.0, {}, {}))
    assert "async reached it first, in 0.60 s (0.50-0.70 s over the repeats)" in text
    assert "sync next, 3.3x as long (2.00 s (1.00-3.00 s over the repeats), final 0.900)" in text


# -- the whole lab, --quick, as a user runs it ------------------------------------------------


@pytest.fixture(scope="module")
def quick_lab(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("lab")
    proc = subprocess.run(
        [sys.executable, "-m", "psgd.cli.main", "bench", "convergence", "--quick", "--out", str(out), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    return out, proc


def test_quick_lab_runs_every_policy_and_scenario(quick_lab):
    out, proc = quick_lab
    assert proc.returncode == 0, proc.stderr[-3000:]
    lab = json.loads((out / "lab.json").read_text())
    config = preset("quick")
    assert {r["key"] for r in lab["runs"]} == {f"{s.name}/{p}" for s in config.scenarios() for p in config.policies}
    assert lab["machine"] and lab["parameters"] > 0 and lab["axes"]
    for run in lab["runs"]:
        assert run["error"] is None, run["error"]
        if run["scenario"] == "no-straggler":
            assert run["delay"] == "" and "--delay" not in run["worker_args"]
        else:  # the injected delay is part of the run's recorded configuration
            assert run["delay"] == "slowdown:4@0" and run["worker_args"][:2] == ["--delay", "slowdown:4@0"]
        assert run["job"]["cluster"]["workers"] == 2
        assert SUMMARY_KEYS <= set(run["summary"])
        points = run["points"]
        assert len(points) >= 3
        for p in points:
            assert set(p) == POINT_KEYS
            assert 0.0 <= p["test_accuracy"] <= 1.0
        for a, b in zip(points, points[1:]):
            assert a["wall"] <= b["wall"] and a["updates"] <= b["updates"] and a["steps"] <= b["steps"]
        assert run["summary"]["time_to_target"] is not None, f"{run['key']} never reached {config.target_accuracy}"
        gradients = 2 * 4 * (1438 // 64)  # 2 workers, 4 epochs, 22 batches of 32 per worker per epoch
        assert points[-1]["steps"] == gradients
        assert points[-1]["updates"] == (gradients if run["policy"] == "async" else gradients // 2)


def test_quick_lab_table_is_well_formed(quick_lab):
    out, proc = quick_lab
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (out / "table.md").read_text()
    printed = proc.stdout.splitlines()[:-1]  # (the last line names the files)
    assert printed[0].split()[:7] == ["scenario,", "policy", "reached", "time", "to", "target", "s"]
    assert max(len(line) for line in printed) <= 80  # no terminal here: 80 columns, the table in blocks
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines() if line.startswith("|")]
    head, sep, body = rows[0], rows[1], rows[2:]
    assert head[:4] == ["scenario", "policy", "reached", "time to target s"] and "MB moved" in head
    assert all(c == "---" for c in sep) and len(sep) == len(head)
    assert len(body) == 6
    for row in body:
        assert len(row) == len(head) and row[2] == "1/1"
        for cell in row[3:]:
            float(cell)  # every figure is a number


def test_quick_lab_plots_are_pngs_with_a_line_per_policy(quick_lab):
    import matplotlib.image

    out, proc = quick_lab
    assert proc.returncode == 0, proc.stderr[-3000:]
    for scenario in ("no-straggler", "slowdown-4-at0"):
        for metric in ("accuracy", "loss"):
            path = out / f"{metric}-{scenario}.png"
            data = path.read_bytes()
            assert data[:8] == PNG_SIGNATURE and len(data) > 20_000
            image = matplotlib.image.imread(path)
            assert image.shape == (720, 2250, 4)  # 15 x 4.8 inches at 150 dpi, RGBA
            assert image[..., :3].std() > 0.05  # not a blank canvas
    image = matplotlib.image.imread(out / "summary.png")  # time to target, a bar per policy and scenario
    assert image.shape[2] == 4 and image[..., :3].std() > 0.05


def test_quick_lab_ends_with_an_answer_in_words(quick_lab):
    out, proc = quick_lab
    summary = (out / "summary.md").read_text()
    assert " ".join(summary.split()) in " ".join(proc.stdout.split())  # wrapped to the terminal's width
    situations = [line for line in summary.splitlines() if line.startswith("**")]
    assert [line.split("**")[1] for line in situations] == [
        "loopback, no straggler",
        "loopback, worker 0 four times slower",
    ]
    for line in situations:
        assert "reached it first, in" in line and "final accuracy" in line


def test_quick_lab_can_be_redrawn_from_its_json(quick_lab, tmp_path):
    out, proc = quick_lab
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = load_result(out / "lab.json")
    assert len(result.runs) == 6
    redo = subprocess.run(
        [
            sys.executable,
            "-m",
            "psgd.cli.main",
            "bench",
            "convergence",
            "--from",
            str(out / "lab.json"),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert redo.returncode == 0, redo.stderr[-3000:]
    assert (tmp_path / "table.md").read_text() == (out / "table.md").read_text()
    assert (tmp_path / "accuracy-no-straggler.png").exists()


@pytest.mark.slow
def test_a_redrawn_lab_leaves_the_labs_own_files_and_says_it_ran_nothing(quick_lab, tmp_path):
    """--from without --out writes under runs/convergence/ of the current folder, not beside the lab (which, in a
    checkout, rewrote the committed results); --out naming the lab's own folder is refused."""
    out, proc = quick_lab
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    redo = subprocess.run(
        [sys.executable, "-m", "psgd.cli.main", "bench", "convergence", "--from", str(out / "lab.json")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert redo.returncode == 0, redo.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert (tmp_path / "runs" / "convergence" / "quick-redrawn" / "table.md").exists()
    assert f"6 runs read from {out / 'lab.json'} (they took" in redo.stdout and "none run" in redo.stdout
    same = subprocess.run(
        [
            sys.executable,
            "-m",
            "psgd.cli.main",
            "bench",
            "convergence",
            "--from",
            str(out / "lab.json"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert same.returncode == 2 and "would replace the lab's own table and plots" in same.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
