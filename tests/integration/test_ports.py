"""A job's ports on one machine, as a user writes them: shards started by hand at consecutive ports train; a port
another process holds is named with its holder and the way out, in one line, before anything waits; psgd doctor
flags a job file that gives one port to two of its processes.  Every wait is bounded."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import by_hand_env

from psgd.bench.chaos.processes import free_port_pair
from psgd.config import Deadlines, JobConfig, Links, to_toml

PY = sys.executable
ENV = by_hand_env(PYTHONUNBUFFERED="1")


def write_job(tmp_path: Path, *sets: str) -> Path:
    job = JobConfig()
    job = job.apply_sets(["model.name=softmax", "train.epochs=1", "cluster.policy=async", *sets])
    path = tmp_path / "job.toml"
    path.write_text(to_toml(job.to_dict()))
    return path


@pytest.mark.slow
def test_two_shards_started_by_hand_at_consecutive_ports_train_to_the_end(tmp_path):
    """The README's "start each process yourself" on one machine, with the ports nearly every user writes."""
    port = free_port_pair()  # p and p + 1 free just now
    path = write_job(
        tmp_path, "cluster.shards=2", "cluster.workers=2", f"cluster.servers=127.0.0.1:{port},127.0.0.1:{port + 1}"
    )
    procs = []
    try:
        for k in range(2):
            procs.append(
                subprocess.Popen(
                    [PY, "-m", "psgd.cli.server", "-c", str(path), "--shard", str(k), "--exit-when-done"],
                    env=ENV,
                    stdout=subprocess.DEVNULL,
                    stderr=open(tmp_path / f"shard-{k}.log", "w"),
                )
            )
        for r in range(2):
            procs.append(
                subprocess.Popen(
                    [PY, "-m", "psgd.cli.worker", "-c", str(path), "--rank", str(r), "--no-progress"],
                    env=ENV,
                    stdout=subprocess.DEVNULL,
                    stderr=open(tmp_path / f"worker-{r}.log", "w"),
                )
            )
        deadline = time.monotonic() + 90
        codes = [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    logs = {f.name: f.read_text()[-800:] for f in sorted(tmp_path.glob("*.log"))}
    assert codes == [0, 0, 0, 0], logs


@pytest.fixture
def held_port():
    """A port another process listens on (its pid and the port)."""
    holder = subprocess.Popen(
        [
            PY,
            "-c",
            "import socket, sys; s = socket.create_server(('127.0.0.1', 0)); "
            "print(s.getsockname()[1], flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield holder.pid, int(holder.stdout.readline())
    finally:
        holder.kill()
        holder.wait(10)


@pytest.mark.parametrize("where", ["flag", "job file"])
def test_a_data_port_another_process_holds_is_named_with_its_holder_and_the_way_out(tmp_path, held_port, where):
    pid, port = held_port
    sets = ["cluster.shards=1", "cluster.workers=1"] + ([f"cluster.data_ports={port}"] if where == "job file" else [])
    path = write_job(tmp_path, *sets)
    flag = ["--data-port", str(port)] if where == "flag" else []
    done = subprocess.run(
        [PY, "-m", "psgd.cli.server", "-c", str(path), "--shard", "0", "--bind", "127.0.0.1:0", *flag],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert f"cannot listen on its data port 127.0.0.1:{port}" in lines[0]
    assert f"pid {pid}:" in lines[0] and "--data-port or [cluster] data_ports" in lines[0]
    assert "leave both out and it takes a free one" in lines[0]


def test_a_grpc_port_another_process_holds_is_named_as_such(tmp_path, held_port):
    pid, port = held_port
    path = write_job(tmp_path, "cluster.shards=1", "cluster.workers=1")
    done = subprocess.run(
        [PY, "-m", "psgd.cli.server", "-c", str(path), "--shard", "0", "--bind", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert f"cannot listen on its gRPC port 127.0.0.1:{port}" in lines[0] and f"pid {pid}:" in lines[0]
    assert "[cluster] servers" in lines[0]


def test_doctor_flags_a_job_file_whose_shards_ports_overlap_on_one_host(tmp_path):
    port = free_port_pair()  # p and p + 1 free just now
    path = write_job(
        tmp_path,
        "cluster.shards=2",
        "cluster.workers=2",
        f"cluster.servers=127.0.0.1:{port},localhost:{port + 1}",
        f"cluster.data_ports={port + 1},{port + 2}",
    )
    done = subprocess.run(
        [PY, "-m", "psgd.cli.main", "doctor", "-c", str(path), "--timeout", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert done.returncode == 1
    line = next((x for x in done.stdout.splitlines() if "ports:" in x), "")
    assert "FAIL" in line and f"127.0.0.1:{port + 1} is shard 0's data port and shard 1's gRPC port" in line, (
        done.stdout
    )


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_worker_rejoins_a_shard_restarted_at_another_data_port_at_its_first_failed_call(transport, caplog):
    """A restarted shard takes a new free data port (none named): the worker's next call to the old one is refused,
    and it asks the shard over gRPC where it listens now and registers again at once, rather than retrying a port
    nobody holds until its next heartbeat (a third of the lease: here longer than the retries)."""
    import logging

    import numpy as np
    from helpers import make_job

    from psgd.job import describe_job
    from psgd.server import build_shard
    from psgd.server.net.service import ShardServer
    from psgd.worker.client import PSClient

    job = make_job(
        "model.name=softmax",
        "cluster.policy=async",
        "cluster.workers=1",
        "cluster.shards=1",
        "cluster.lease_seconds=600",
        f"cluster.transport={transport}",
    )
    address = f"127.0.0.1:{free_port_pair()}"
    server = ShardServer(build_shard(describe_job(job), 0), address, request_timeout=5, transport=transport).start()
    try:
        plan = server.core.plan
        host = {s.name: np.empty(s.shape, dtype=s.dtype) for s in plan.specs}
        with PSClient(
            [address], plan, 0, deadlines=Deadlines(request_timeout=5), links=Links(transport=transport), config=job
        ) as client:
            clock = client.register()
            client.pull(clock, host)
            before = client.links[0].data_port
            server.stop(grace=1.0)
            server = ShardServer(
                build_shard(describe_job(job), 0), address, request_timeout=5, transport=transport
            ).start()
            assert server.data.port != before
            with caplog.at_level(logging.WARNING, logger="psgd.worker.client"):
                client.pull(clock, host)
            assert client.links[0].data_port == server.data.port
            assert "no longer knows worker 0 (restarted?): registering again" in caplog.text
    finally:
        server.stop(grace=1.0)
