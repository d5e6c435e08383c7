"""What a worker says last, as a user reads it: what it did in plain words, the test accuracy of the weights its last
step left where it evaluates, and a plain line (and no racing bar) when it is started again for a finished job."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers import make_job, run_threads, shards

from psgd.cli import worker as psgd_worker
from psgd.worker.exchange import run_worker

pytestmark = pytest.mark.usefixtures("keep_signal_handlers")  # psgd-worker's main() takes the stop signals


def test_a_workers_last_line_says_what_it_did_and_the_accuracy_its_last_step_left(tmp_path):
    run = tmp_path / "run"
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
            str(run),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    final = re.search(r"final test accuracy: (\d\.\d{4})", out.stdout + out.stderr)[1]
    first, second = (
        [line for line in (run / f"worker-{r}.log").read_text().splitlines() if " done: " in line] for r in (0, 1)
    )
    assert len(first) == len(second) == 1
    # sync: the weights worker 0 read after its last push are the job's final ones, which the launcher evaluates
    assert re.search(
        r"worker 0 done: 44 steps in [\d.]+s \(its pushes, counted at each of 2 shard\(s\): 88 added to "
        rf"a round\); test accuracy {final} of the weights its last step left \(versions 44, 44\)$",
        first[0],
    ), first
    assert re.search(
        r"worker 1 done: 44 steps in [\d.]+s \(its pushes, counted at each of 2 shard\(s\): 88 added to "
        r"a round\)$",
        second[0],
    ), second
    assert "accumulated" not in first[0] + second[0]
    # digits' MLP: a step's gradient takes a fraction of its exchange, and the launch says so with the ways out
    assert "the exchange, not the compute, bounds this job's step" in out.stderr and "--mode allreduce" in out.stderr


def test_the_bound_is_said_only_where_the_exchange_takes_longer_than_the_compute():
    from psgd.launcher.result import exchange_bound

    def steps(compute, moving):
        return [
            {"event": "step", "seconds": {"weights": moving / 2, "compute": compute, "exchange": moving / 2}}
            for _ in range(4)
        ] + [{"event": "done"}]

    first = steps(0.004, 0.001)
    assert exchange_bound(first + steps(0.004, 0.002)) is None
    assert exchange_bound(first + steps(0.001, 0.009)).startswith(
        "the exchange, not the compute, bounds this job's step: a worker's step took 7.50 ms, 2.50 of them computing "
        "its gradient and 5.00"
    )


def test_a_worker_started_again_for_a_finished_job_says_so(capsys):
    sets = ("model.name=softmax", "cluster.workers=2", "cluster.shards=2", "cluster.policy=sync", "train.epochs=1")
    job = make_job(*sets)
    with shards(job) as (job, _):
        run_threads([lambda r=r: run_worker(job, r, job.cluster.servers, progress=False) for r in (0, 1)], 120)
        capsys.readouterr()
        argv = ["--rank", "0", "--servers", ",".join(job.cluster.servers), *(a for s in sets for a in ("--set", s))]
        assert psgd_worker.main(argv) == 0
    err = capsys.readouterr().err
    assert "worker 0: nothing to do, the job is already finished (its shards are past its last step, 22)" in err
    assert " done: 0 steps" not in err
    assert not re.search(r"\d+(\.\d+)?step/s", err), err  # the bar shows no rate for steps it did not take


def test_a_worker_that_does_not_evaluate_shows_no_accuracy_on_its_bar(capsys):
    """Worker 1 evaluates nothing (rank 0 does): its bar showed acc=nan all run long."""
    job = make_job(
        "model.name=softmax", "cluster.workers=2", "cluster.shards=1", "cluster.policy=async", "train.epochs=2"
    )
    with shards(job) as (job, _):
        run_threads(
            [
                lambda: run_worker(job, 0, job.cluster.servers, progress=False),
                lambda: run_worker(job, 1, job.cluster.servers, progress=True),
            ],
            120,
        )
    err = capsys.readouterr().err
    assert "worker 1" in err and "loss=" in err and "acc=" not in err


def _launch(run, *extra: str, terminal: bool = False) -> str:
    """``psgd launch`` with its progress shown, its stderr a pipe or (``terminal``) a pseudo-terminal; its output."""
    argv = [
        sys.executable,
        "-m",
        "psgd.cli.main",
        "launch",
        "--workers",
        "2",
        "--shards",
        "1",
        "--epochs",
        "2",
        "--run-dir",
        str(run),
        *extra,
    ]
    if terminal:  # script(1) gives the command a terminal (of 120 columns) and copies what it writes there
        argv = ["script", "-qec", "stty cols 120 rows 40; " + " ".join(argv), "/dev/null"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


@pytest.mark.slow
def test_the_shown_workers_log_file_holds_its_whole_log_and_a_pipe_gets_its_lines_not_a_bar(tmp_path):
    """Worker 0's log file stayed empty while the terminal showed its bar; and where the launch's output went to a
    file or a pipe, the bar's redraws littered it and worker 0's lines were nowhere."""
    piped = _launch(tmp_path / "piped")
    assert "\r" not in piped and "step/s" not in piped  # no bar redrawn into a pipe ...
    assert re.search(r"worker:0\[\d+\] INFO worker 0 of 2: ", piped)  # ... worker 0's lines instead
    kept = (tmp_path / "piped" / "worker-0.log").read_text()
    assert "INFO worker 0 of 2: " in kept and " done: " in kept, kept
    if subprocess.run(["script", "--version"], capture_output=True).returncode != 0:
        pytest.skip("script(1) is not here to give psgd launch a terminal")
    shown = _launch(tmp_path / "shown", terminal=True)
    assert "step/s" in shown and not re.search(r"worker:0\[\d+\] INFO", shown)  # a bar and warnings only
    kept = (tmp_path / "shown" / "worker-0.log").read_text()
    assert "INFO worker 0 of 2: " in kept and " done: " in kept, kept  # and the whole log in its file


def test_a_worker_started_by_hand_with_its_output_in_a_file_writes_its_lines_not_a_bar(capsys, monkeypatch):
    """psgd-worker started by hand with its output sent to a file drew its bar there, redraw after redraw, and wrote
    no epoch lines (psgd launch already gave its workers --no-progress where its own output was no terminal)."""
    # these shards keep no token: neither does this worker, whatever a benchmark run earlier in this process left in
    # PSGD_TOKEN (psgd.bench.chaos.processes.job_token sets it for the processes a benchmark starts)
    monkeypatch.delenv("PSGD_TOKEN", raising=False)
    sets = ("model.name=softmax", "cluster.workers=1", "cluster.shards=1", "train.epochs=2")
    job = make_job(*sets)
    with shards(job) as (job, _):
        capsys.readouterr()
        argv = ["--rank", "0", "--servers", ",".join(job.cluster.servers), *(a for s in sets for a in ("--set", s))]
        assert psgd_worker.main(argv) == 0  # its stderr is no terminal here
    err = capsys.readouterr().err
    assert "\r" not in err and not re.search(r"step/s|\d+%\|", err), err
    assert re.search(r"worker 0: epoch 2/2, step \d+/\d+: test accuracy 0\.\d{4}", err), err
    assert "worker 0 done: " in err
