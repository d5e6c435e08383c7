"""Many hosts without Docker: shards and workers in network namespaces made by this test, on their own
addresses, train the digits across a bridge.

The topology lives entirely inside namespaces the test creates (names carry this process's id, so parallel
runs do not collide): a hub namespace holds a bridge, and each host namespace has one end of a veth pair
(``eth0``, an address in 10.99.0.0/24) whose other end is on the bridge. Nothing on the machine's own
interfaces or routes is touched, and no traffic leaves the namespaces. Where namespaces cannot be made (not
root, no CAP_SYS_ADMIN, no ``ip``), the test is skipped with the reason (failed under PSGD_REQUIRE_NET=1).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import by_hand_env, skip_or_fail, wait_for

from psgd.bench.netns import IP, Namespaces, NetworkError, unavailable
from psgd.config import JobConfig, to_toml

PY = sys.executable
SUBNET = "10.99.0"
HOSTS = {"s0": f"{SUBNET}.10", "s1": f"{SUBNET}.11", "w0": f"{SUBNET}.20", "w1": f"{SUBNET}.21"}
PORT = 50051


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([IP, *args], capture_output=True, text=True, timeout=20, check=check)


class Hosts(Namespaces):
    """The chaos suite's namespaces (a bridge in a hub, a veth per host), with processes "on" each host:
    ``Hosts.run(name, argv)`` starts one."""

    def __init__(self):
        super().__init__(HOSTS)
        self.procs: list[subprocess.Popen] = []

    def run(self, host: str, argv: list[str], log: Path) -> subprocess.Popen:
        proc = subprocess.Popen(
            [*self.prefix(host), *argv],
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),
            stdin=subprocess.DEVNULL,
            text=True,
            env=by_hand_env(PYTHONUNBUFFERED="1"),
        )
        self.procs.append(proc)
        return proc

    def call(self, host: str, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*self.prefix(host), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=by_hand_env(PYTHONUNBUFFERED="1"),
        )

    def rx_bytes(self, host: str) -> int:
        stats = json.loads(ip("-n", self.ns(host), "-s", "-j", "link", "show", "eth0").stdout)
        return int(stats[0]["stats64"]["rx"]["bytes"])

    def close(self) -> list[str]:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        return super().close()


@pytest.fixture
def hosts():
    why = unavailable()
    if why:
        skip_or_fail(f"cannot create network namespaces here: {why}")
    h = Hosts()
    try:
        try:
            h.build()
        except NetworkError as exc:  # e.g. a kernel without bridge or veth support
            skip_or_fail(f"cannot build the test network: {exc}")
        yield h
    finally:
        h.close()
        left = ip("netns", "list", check=False).stdout
        assert h.tag not in left, f"namespaces left behind: {left}"


EVALUATE = """
import json, os, sys
from psgd.config import JobConfig
from psgd.partition import PartitionPlan
from psgd.training.evaluation import evaluate
from psgd.job import build_job
from psgd.worker.client import fetch_weights
job = JobConfig.load(sys.argv[1])
built = build_job(job)
plan = PartitionPlan(built.model.specs(), job.cluster.shards, job.cluster.links.slice_bytes)
weights = fetch_weights(job.cluster.servers, plan, request_timeout=30, token=os.environ["PSGD_TOKEN"])
loss, acc = evaluate(built.model, weights, built.dataset.x_test, built.dataset.y_test, built.device)
print(json.dumps({"test_accuracy": acc, "test_loss": loss}))
"""


@pytest.mark.slow
def test_shards_and_workers_on_separate_hosts_train_digits_to_97_percent(hosts, tmp_path):
    job = JobConfig()  # the MLP on the bundled digits, 30 epochs, momentum SGD
    job = job.apply_sets(
        [
            "cluster.policy=sync",
            "cluster.shards=2",
            "cluster.workers=2",
            "cluster.join_timeout=60",
            "cluster.request_timeout=30",
        ]
    )
    job = job.override("cluster.servers", [f"{HOSTS['s0']}:{PORT}", f"{HOSTS['s1']}:{PORT}"])
    job = job.override("cluster.data_ports", [PORT + 1, PORT + 1])  # named, as for a firewall between machines
    path = tmp_path / "job.toml"
    path.write_text(to_toml(job.to_dict()))
    start = time.monotonic()

    shards = []
    for k in range(2):
        port_file = tmp_path / f"shard-{k}.addr"
        shards.append(
            hosts.run(
                f"s{k}",
                [
                    PY,
                    "-m",
                    "psgd.cli.server",
                    "-c",
                    str(path),
                    "--shard",
                    str(k),
                    "--bind",
                    f"{HOSTS[f's{k}']}:{PORT}",
                    "--port-file",
                    str(port_file),
                ],
                tmp_path / f"shard-{k}.log",
            )
        )
    files = [tmp_path / f"shard-{k}.addr" for k in range(2)]

    def listening():
        for k, s in enumerate(shards):
            if s.poll() is not None:
                pytest.fail(
                    f"shard {k} exited with status {s.returncode}: {(tmp_path / f'shard-{k}.log').read_text()[-2000:]}"
                )
        return all(f.exists() for f in files) and [f.read_text().strip() for f in files]

    bound = wait_for(listening, 60, "the shards to listen")
    assert bound == list(job.cluster.servers)

    # the preflight check, from a worker's host: names, both ports and the plan of each shard across the bridge
    doctor = hosts.call("w0", [PY, "-m", "psgd.cli.main", "doctor", "-c", str(path)])
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    for k in range(2):
        address = f"{HOSTS[f's{k}']}:{PORT}"
        assert f"shard {k} at {address}: resolves to {HOSTS[f's{k}']}\n" in doctor.stdout
        assert f"shard {k} at {address}: data port {PORT + 1} accepts connections" in doctor.stdout
        assert f"shard {k} at {address}: answers as shard {k} of 2" in doctor.stdout

    workers = [
        hosts.run(
            f"w{r}",
            [
                PY,
                "-m",
                "psgd.cli.worker",
                "-c",
                str(path),
                "--rank",
                str(r),
                "--no-progress",
                "--json",
                "--metrics",
                str(tmp_path / f"worker-{r}.jsonl"),
            ],
            tmp_path / f"worker-{r}.log",
        )
        for r in range(2)
    ]
    for r, w in enumerate(workers):
        try:
            out, _ = w.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker {r} did not finish within 120s: {(tmp_path / f'worker-{r}.log').read_text()[-2000:]}")
        assert w.returncode == 0, (tmp_path / f"worker-{r}.log").read_text()[-3000:]
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["rank"] == r and summary["clock"] == 30 * (1438 // 2 // 32)

    # what the shards say, seen from the other worker's host
    status = hosts.call("w1", [PY, "-m", "psgd.cli.main", "status", *job.cluster.servers, "--sample", "0", "--json"])
    assert status.returncode == 0, status.stdout + status.stderr
    view = json.loads(status.stdout)
    assert [s["shard"] for s in view["shards"]] == [0, 1] and all(s["health"] == "SERVING" for s in view["shards"])
    assert [(w["worker_id"], w["state"]) for w in view["workers"]] == [(0, "done"), (1, "done")]

    evaluated = hosts.call("w0", [PY, "-c", EVALUATE, str(path)])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    accuracy = json.loads(evaluated.stdout)["test_accuracy"]
    assert accuracy >= 0.97

    # the tensors really crossed the bridge: each shard received every worker's pushes over its eth0
    pushes = 2 * 30 * (1438 // 2 // 32)
    for k in range(2):
        assert hosts.rx_bytes(f"s{k}") > pushes * 1000
    for k, s in enumerate(shards):
        s.send_signal(signal.SIGTERM)
        assert s.wait(30) == 0, (tmp_path / f"shard-{k}.log").read_text()[-2000:]
    assert time.monotonic() - start < 90
