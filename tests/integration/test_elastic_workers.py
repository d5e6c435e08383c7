"""A job with a range of workers, started by hand as a user does (psgd-server and psgd-worker processes on 127.0.0.1):
a third worker joins it running (``--rank auto``) and makes steps of its own, and a worker that leaves does not hold a
sync job.  Every wait is bounded."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import TOKEN, by_hand_env, wait_for
from test_ps_processes import PY, processes, start_servers

from psgd.config import JobConfig
from psgd.job import build_job
from psgd.partition import PartitionPlan
from psgd.worker.client import PSClient


def elastic_job(policy: str, lease: float = 30.0) -> JobConfig:
    return JobConfig().apply_sets(
        [
            "model.name=softmax",
            "train.epochs=5000",  # runs until the test stops it
            f"cluster.policy={policy}",
            'cluster.workers="2:3"',
            "cluster.shards=2",
            f"cluster.lease_seconds={lease}",
        ]
    )


def worker(tmp_path: Path, name: str, rank: str) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "-m", "psgd.cli.worker", "-c", str(tmp_path / "job.toml"), "--rank", rank, "--no-progress"]
        + ["--metrics", str(tmp_path / f"{name}.jsonl")],
        env=by_hand_env(),
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / f"{name}.log", "w"),
    )


def steps(tmp_path: Path, name: str) -> list[dict]:
    path = tmp_path / f"{name}.jsonl"
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")]  # (the last may be half written)
    return [r for r in map(json.loads, lines) if "loss" in r]


def statuses(job: JobConfig, addresses: list[str]) -> list:
    plan = PartitionPlan(build_job(job).model.specs(), job.cluster.shards, job.cluster.links.slice_bytes)
    with PSClient(addresses, plan, token=TOKEN) as client:
        return client.status()


def stop_all(procs: list[subprocess.Popen], tmp_path: Path) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        assert p.wait(60) == 0, [f.read_text()[-1500:] for f in sorted(tmp_path.glob("*.log"))]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["sync", "async", "ssp", "local"])
def test_a_third_worker_joins_a_running_job_and_makes_steps_of_its_own(policy, tmp_path):
    job = elastic_job(policy)
    with processes() as procs:
        addresses = start_servers(job, tmp_path, procs)
        first = [worker(tmp_path, f"w{r}", str(r)) for r in (0, 1)]
        procs += first
        wait_for(lambda: all(len(steps(tmp_path, f"w{r}")) >= 20 for r in (0, 1)), 90, "workers 0 and 1 to train")
        joiner = worker(tmp_path, "joiner", "auto")
        procs.append(joiner)
        wait_for(lambda: len(steps(tmp_path, "joiner")) >= 20, 90, "the joining worker to take 20 steps")
        joined = steps(tmp_path, "joiner")
        assert "worker:2[" in (tmp_path / "joiner.log").read_text()  # shard 0 gave it the one free rank
        assert all(not r.get("outcomes") or "rejected" not in r["outcomes"] for r in joined)
        before = {r: len(steps(tmp_path, f"w{r}")) for r in (0, 1)}
        wait_for(
            lambda: all(len(steps(tmp_path, f"w{r}")) >= before[r] + 10 for r in (0, 1)),
            60,
            "workers 0 and 1 to train on beside the joiner",
        )
        for status in statuses(job, addresses):
            counters = json.loads(status.counters_json)
            assert counters["workers_range"] == [2, 3]
            assert {w.worker_id: w.state for w in status.workers} == {0: "live", 1: "live", 2: "live"}
        said = subprocess.run(
            [PY, "-m", "psgd.cli.main", "status", *addresses, "--sample", "0"],
            capture_output=True,
            text=True,
            timeout=60,
            env=by_hand_env(),
        )
        assert "3 worker(s) training, range 2:3" in said.stdout, said.stdout + said.stderr
        if policy == "sync":  # it trains in the job's rounds: its clocks are theirs
            theirs = {r["clock"] for r in steps(tmp_path, "w0")}
            assert {r["clock"] for r in joined} <= theirs
        stop_all([*first, joiner], tmp_path)


@pytest.mark.slow
def test_a_worker_that_leaves_does_not_hold_a_sync_job_and_frees_its_rank(tmp_path):
    job = elastic_job("sync", lease=60.0)  # a worker that held the rounds would hold them a minute
    with processes() as procs:
        addresses = start_servers(job, tmp_path, procs)
        ranked = [worker(tmp_path, f"w{r}", str(r)) for r in (0, 1, 2)]
        procs += ranked
        wait_for(lambda: all(len(steps(tmp_path, f"w{r}")) >= 20 for r in (0, 1, 2)), 90, "three workers to train")
        ranked[2].send_signal(signal.SIGTERM)
        assert ranked[2].wait(30) == 0, (tmp_path / "w2.log").read_text()[-2000:]
        before = len(steps(tmp_path, "w0"))
        wait_for(lambda: len(steps(tmp_path, "w0")) >= before + 30, 30, "worker 0 to take 30 rounds without worker 2")
        for status in statuses(job, addresses):
            assert {w.worker_id: w.state for w in status.workers}[2] == "left"
        again = worker(tmp_path, "again", "auto")  # the freed rank is the one a new worker takes
        procs.append(again)
        wait_for(lambda: len(steps(tmp_path, "again")) >= 5, 90, "a new worker to take the freed rank and train")
        assert "worker:2[" in (tmp_path / "again.log").read_text()
        stop_all([ranked[0], ranked[1], again], tmp_path)


@pytest.mark.slow
def test_psgd_scale_grows_and_shrinks_a_running_launch(tmp_path):
    run = tmp_path / "run"
    argv = [PY, "-m", "psgd.cli.main", "launch", "--model", "softmax", "--epochs", "400", "--policy", "sync"]
    argv += ["--workers", "2:3", "--shards", "2", "--no-progress", "--json", "--run-dir", str(run), "--timeout", "240"]
    with processes() as procs:
        launch = subprocess.Popen(argv, env=by_hand_env(), stdout=subprocess.PIPE, stderr=open(tmp_path / "l.log", "w"))
        procs.append(launch)
        wait_for(lambda: len(steps(run, "worker-0")) >= 20, 90, "the launch's worker 0 to train")
        assert not (run / "worker-2.jsonl").exists()  # it starts with the fewest
        grown = subprocess.run(
            [PY, "-m", "psgd.cli.main", "scale", str(run), "--workers", "3"], capture_output=True, text=True, timeout=60
        )
        assert grown.returncode == 0, grown.stderr
        assert "for 3 worker(s) (its range: 2:3)" in grown.stdout
        wait_for(lambda: len(steps(run, "worker-2")) >= 20, 90, "the worker the launch started to train")
        shrunk = subprocess.run(
            [PY, "-m", "psgd.cli.main", "scale", str(run), "--workers", "2"], capture_output=True, text=True, timeout=60
        )
        assert shrunk.returncode == 0, shrunk.stderr
        wait_for(lambda: "worker 2 left the job" in (run / "shard-0.log").read_text(), 60, "worker 2 to leave")
        out, _ = launch.communicate(timeout=240)
        assert launch.returncode == 0, (tmp_path / "l.log").read_text()[-3000:]
        result = json.loads(out)
        assert result["test_accuracy"] > 0.9
        assert result["worker_steps"][2] > 0 and result["failures"] == []
        assert sum(result["worker_steps"]) == 400 * (1438 // 32)  # every batch of the job, once


@pytest.mark.parametrize(
    "workers, said",
    [
        ("4", "has a fixed 4 worker(s): start it with --workers MIN:MAX to scale it"),
        ("2:3", "--workers 5 is outside the job's range 2:3"),
    ],
)
def test_psgd_scale_refuses_what_it_cannot_do_in_one_line(workers, said, tmp_path):
    (tmp_path / "job.toml").write_text(f'[cluster]\nworkers = "{workers}"\n')
    done = subprocess.run(
        [PY, "-m", "psgd.cli.main", "scale", str(tmp_path), "--workers", "5"], capture_output=True, text=True
    )
    assert done.returncode == 2 and said in done.stderr and len(done.stderr.splitlines()) == 1


def test_a_request_no_launch_takes_is_an_error_that_says_so(tmp_path):
    from psgd.launcher.scale import SCALE_FILE, ask

    (tmp_path / "job.toml").write_text('[cluster]\nworkers = "1:3"\n')
    with pytest.raises(Exception, match="no launch took the request") as info:
        ask(tmp_path, 2, within=0.3)
    assert type(info.value).__name__ == "LaunchError" and not (tmp_path / SCALE_FILE).exists()


def done_record(tmp_path: Path, name: str) -> dict:
    lines = (tmp_path / f"{name}.jsonl").read_text().splitlines()
    return next(r for r in map(json.loads, reversed(lines)) if r.get("event") == "done")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["sync", "async", "local"])
def test_every_batch_of_the_job_is_trained_once_across_a_join_and_a_leave(policy, tmp_path):
    """Shard 0 hands each step its batch (psgd.data.blocks): the job's 150 epochs of 44 batches are trained once
    each, by whoever trains when, with a worker joining and another leaving half-way."""
    job = elastic_job(policy).override("train.epochs", 150)
    total = 150 * (1438 // 32)
    with processes() as procs:
        addresses = start_servers(job, tmp_path, procs)
        first = [worker(tmp_path, f"w{r}", str(r)) for r in (0, 1)]
        procs += first
        wait_for(lambda: len(steps(tmp_path, "w0")) >= 200, 90, "worker 0 to take 200 steps")
        joiner = worker(tmp_path, "joiner", "auto")
        procs.append(joiner)
        wait_for(lambda: len(steps(tmp_path, "joiner")) >= 50, 90, "the joining worker to take 50 steps")
        first[1].send_signal(signal.SIGTERM)  # leaves in the middle of the job
        for p in (*first, joiner):
            assert p.wait(120) == 0, [f.read_text()[-1500:] for f in sorted(tmp_path.glob("*.log"))]
        trained = {name: done_record(tmp_path, name)["steps"] for name in ("w0", "w1", "joiner")}
        assert sum(trained.values()) == total, trained
        assert all(n > 0 for n in trained.values()) and trained["w1"] < trained["w0"]
        batches = json.loads(statuses(job, addresses)[0].counters_json)["batches"]
        assert batches["total"] == total and batches["left"] == 0
