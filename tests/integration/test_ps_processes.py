"""Real psgd-server / psgd-worker processes on 127.0.0.1; every wait is bounded."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TOKEN, by_hand_env, wait_for

from psgd.config import JobConfig, to_toml
from psgd.job import build_job
from psgd.partition import PartitionPlan
from psgd.worker.client import PSClient

PY = sys.executable


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", *argv], capture_output=True, text=True, timeout=timeout, env=by_hand_env(PYTHONUNBUFFERED="1")
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy, extra, target",
    [
        ("sync", [], 0.97),
        ("async", [], 0.95),
        ("ssp", ["--staleness", "2"], 0.95),
    ],
)
def test_launch_trains_digits_with_every_policy(policy, extra, target, tmp_path):
    start = time.monotonic()
    done = run_cli(
        "psgd.cli.main",
        "launch",
        "--policy",
        policy,
        *extra,
        "--json",
        "--no-progress",
        "--run-dir",
        str(tmp_path),
        "--timeout",
        "110",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["policy"] == policy
    assert result["test_accuracy"] >= target
    assert time.monotonic() - start < 60
    assert len(result["versions"]) == 2 and min(result["versions"]) > 0
    for r in range(2):
        steps = [json.loads(line) for line in (tmp_path / f"worker-{r}.jsonl").read_text().splitlines()]
        assert steps[-1]["event"] == "done" and steps[-1]["steps"] > 0
        assert result["worker_steps"][r] == steps[-1]["clock"]
    assert result["steps"] == sum(result["worker_steps"])
    assert 'servers = ["127.0.0.1:' in (tmp_path / "job.toml").read_text()  # the job file all processes read


@contextlib.contextmanager
def processes():
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def start_servers(job: JobConfig, tmp_path: Path, procs: list) -> list[str]:
    path = tmp_path / "job.toml"
    path.write_text(to_toml(job.to_dict()))
    files = []
    for k in range(job.cluster.shards):
        files.append(tmp_path / f"shard-{k}.addr")
        procs.append(
            subprocess.Popen(
                [
                    PY,
                    "-m",
                    "psgd.cli.server",
                    "-c",
                    str(path),
                    "--shard",
                    str(k),
                    "--bind",
                    "127.0.0.1:0",
                    "--port-file",
                    str(files[-1]),
                ],
                env=by_hand_env(),
                stdout=subprocess.DEVNULL,
                stderr=open(tmp_path / f"shard-{k}.log", "w"),
            )
        )
    addresses = wait_for(
        lambda: all(f.exists() for f in files) and [f.read_text().strip() for f in files], 60, "servers to start"
    )
    job = job.override("cluster.servers", addresses)
    path.write_text(to_toml(job.to_dict()))
    return addresses


@pytest.mark.slow
def test_sigkilled_worker_is_dropped_after_its_lease_and_the_others_finish(tmp_path):
    job = JobConfig()
    job = job.apply_sets(
        [
            "model.name=softmax",
            "train.epochs=40",
            "cluster.policy=sync",
            "cluster.workers=3",
            "cluster.shards=2",
            "cluster.lease_seconds=2",
        ]
    )
    with processes() as procs:
        addresses = start_servers(job, tmp_path, procs)
        workers = []
        for r in range(3):
            workers.append(
                subprocess.Popen(
                    [
                        PY,
                        "-m",
                        "psgd.cli.worker",
                        "-c",
                        str(tmp_path / "job.toml"),
                        "--rank",
                        str(r),
                        "--no-progress",
                        "--metrics",
                        str(tmp_path / f"w{r}.jsonl"),
                    ],
                    env=by_hand_env(),
                    stdout=subprocess.DEVNULL,
                    stderr=open(tmp_path / f"w{r}.log", "w"),
                )
            )
        procs += workers
        victim_log = tmp_path / "w2.jsonl"
        wait_for(
            lambda: victim_log.exists() and len(victim_log.read_text().splitlines()) >= 20,
            60,
            "worker 2 to take 20 steps",
        )
        workers[2].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        for w in workers[:2]:
            assert w.wait(120) == 0, (tmp_path / "w0.log").read_text()[-2000:]
        total = 40 * (1438 // 3 // 32)
        for r in range(2):
            last = json.loads((tmp_path / f"w{r}.jsonl").read_text().splitlines()[-1])
            assert last["event"] == "done" and last["clock"] == total
        plan = PartitionPlan(build_job(job).model.specs(), 2, job.cluster.links.slice_bytes)
        with PSClient(addresses, plan, token=TOKEN) as client:
            for status in client.status():
                states = {w.worker_id: w.state for w in status.workers}
                assert states == {0: "done", 1: "done", 2: "expired"}
                assert status.version == total  # every round closed exactly once
        assert time.monotonic() - killed_at < 60


def test_a_second_worker_of_the_same_rank_is_refused_naming_the_first(tmp_path):
    """Two psgd-worker --rank 0 of one job (a typo in a hosts list) both registered, the shard logging only
    "continues at clock 46", and trained as one rank; now the second is refused and exits 1, the first
    trains on.  The first runs on this host and is alive, so the second gives up at once; it used to retry for a
    lease (a restarted worker waits that long for its old process's), and took the rank from a first paused past
    its lease (found by the chaos suite: seed 7, run 6), which was then refused and exited 1."""
    job = JobConfig()
    job = job.apply_sets(
        [
            "model.name=softmax",
            "train.epochs=20000",
            "cluster.policy=async",
            "cluster.workers=2",
            "cluster.shards=1",
            "cluster.lease_seconds=30",
        ]
    )
    assert job.cluster.deadlines.request_timeout == 60
    with processes() as procs:
        start_servers(job, tmp_path, procs)
        argv = [PY, "-m", "psgd.cli.worker", "-c", str(tmp_path / "job.toml"), "--rank", "0", "--no-progress"]
        first = subprocess.Popen(
            argv + ["--metrics", str(tmp_path / "first.jsonl")],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "first.log", "w"),
            env=by_hand_env(),
        )
        procs.append(first)
        steps = tmp_path / "first.jsonl"
        wait_for(lambda: steps.exists() and len(steps.read_text().splitlines()) >= 5, 60, "the first worker's steps")
        began = time.monotonic()
        second = subprocess.run(argv, capture_output=True, text=True, timeout=90, env=by_hand_env())
        took = time.monotonic() - began
        assert second.returncode == 1, second.stderr[-2000:]
        assert took < 15, f"the second worker gave up after {took:.0f}s"
        assert "ALREADY_EXISTS" in second.stderr and f"pid {first.pid}" in second.stderr, second.stderr[-2000:]
        assert f"It is: pid {first.pid} runs on this host" in second.stderr, second.stderr[-2000:]
        assert "second psgd-worker started with rank 0" in second.stderr and "Traceback" not in second.stderr
        taken = len(steps.read_text().splitlines())
        wait_for(lambda: len(steps.read_text().splitlines()) > taken + 5, 30, "the first worker to train on")
        assert first.poll() is None
    shard_log = (tmp_path / "shard-0.log").read_text()
    assert shard_log.count("worker 0 registered") == 1, shard_log[-2000:]


@pytest.mark.parametrize("module", ["psgd.cli.server", "psgd.cli.worker"])
def test_a_model_too_large_for_the_machine_is_refused_in_one_line_before_allocating(module):
    """model.hidden=[1000000000] ended in a numpy traceback ("Unable to allocate 477. GiB") once the shard
    began to make its variables; a model of 100 GiB would rather have started allocating."""
    where = ["--bind", "127.0.0.1:0"] if module == "psgd.cli.server" else ["--rank", "0", "--no-progress"]
    done = run_cli(
        module,
        *where,
        "--workers",
        "1",
        "--shards",
        "1",
        "--servers",
        "127.0.0.1:9",
        "--set",
        "model.hidden=[1000000000]",
        timeout=60,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]
    assert "75,000,000,010 parameters of float32" in done.stderr and "GiB of memory" in done.stderr


def test_wrong_address_fails_fast_with_a_clear_message():
    done = run_cli(
        "psgd.cli.worker",
        "--rank",
        "0",
        "--workers",
        "1",
        "--shards",
        "1",
        "--servers",
        "127.0.0.1:9",
        "--set",
        "cluster.join_timeout=1",
        "--no-progress",
        timeout=60,
    )
    assert done.returncode == 1
    assert "cannot reach shard(s) at 127.0.0.1:9 within 1s" in done.stderr
    assert "Traceback" not in done.stderr


def test_worker_with_another_model_is_refused_with_the_difference(tmp_path):
    job = JobConfig()
    job = job.apply_sets(["cluster.workers=1", "cluster.shards=1"])
    with processes() as procs:
        addresses = start_servers(job, tmp_path, procs)
        done = run_cli(
            "psgd.cli.worker",
            "--rank",
            "0",
            "--workers",
            "1",
            "--shards",
            "1",
            "--servers",
            addresses[0],
            "--set",
            "model.hidden=[10]",
            "--no-progress",
            timeout=60,
        )
    assert done.returncode == 1
    assert "FAILED_PRECONDITION" in done.stderr and "partition plan" in done.stderr
    assert "dense0/W: worker shape (64, 10)" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("module", ["psgd.cli.server", "psgd.cli.worker", "psgd.cli.main"])
def test_help_explains(module):
    done = run_cli(module, "--help", timeout=60)
    assert done.returncode == 0 and "usage:" in done.stdout
    if module != "psgd.cli.main":
        assert "examples:" in done.stdout
        for flag in ("--config", "--policy", "--servers", "--workers", "--shards"):
            assert flag in done.stdout
