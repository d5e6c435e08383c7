"""Reliability and security with real processes and real sockets; every wait is bounded."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import TOKEN, by_hand_env, free_port_pair, make_job, shards, slice_weights, wait_for

from psgd.config import Deadlines, to_toml
from psgd.errors import Code
from psgd.job import build_job, describe_job, params_to_device
from psgd.link import LinkError
from psgd.link.tcp import DataConnection
from psgd.partition import PartitionPlan
from psgd.proto import ps_pb2, ps_pb2_grpc
from psgd.server import build_shard
from psgd.server.net.service import ShardServer
from psgd.training.evaluation import evaluate
from psgd.wire.channel import open_channel
from psgd.worker.client import PSClient, PSError, fetch_weights
from psgd.worker.exchange import run_worker

PY = sys.executable


# -- authentication ---------------------------------------------------------------------
def test_calls_without_the_token_are_refused_and_change_nothing():
    job = make_job("model.name=softmax", "cluster.workers=1", "cluster.shards=1", "train.epochs=1")
    server = ShardServer(build_shard(describe_job(job), 0), "127.0.0.1:0", token="s3cret").start()
    try:
        before = server.core.flat.copy()
        with grpc.insecure_channel(server.address) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            for metadata in (
                (),
                (("authorization", "Bearer wrong"),),
                (("authorization", "s3cret"),),
                (("authorization", "Bearer s3cret"),),
            ):  # the token itself proves nothing: it is sent
                for call in (
                    lambda: stub.Status(ps_pb2.StatusRequest(), timeout=5, metadata=metadata),
                    lambda: stub.Register(ps_pb2.RegisterRequest(worker_id=0), timeout=5, metadata=metadata),
                    lambda: list(stub.Pull(ps_pb2.PullRequest(worker_id=-1), timeout=5, metadata=metadata)),
                    lambda: stub.Push(
                        iter([ps_pb2.PushMessage(header=ps_pb2.PushHeader())]), timeout=5, metadata=metadata
                    ),
                ):
                    with pytest.raises(grpc.RpcError) as info:
                        call()
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert "token" in info.value.details()
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
        with pytest.raises(LinkError) as info:
            DataConnection("127.0.0.1", server.data.port, 0, server.core.plan.hash, token="wrong", timeout=5)
        assert info.value.code == Code.UNAUTHENTICATED
        plan = server.core.plan
        with pytest.raises(PSError, match="UNAUTHENTICATED"):
            fetch_weights([server.address], plan, request_timeout=5)
        assert np.array_equal(server.core.flat, before) and server.core.version == 0
        result = run_worker(job, 0, [server.address], progress=False, token="s3cret")  # the right token works
        assert result.steps > 0 and server.core.version == result.steps
    finally:
        server.stop(1)


def test_a_shard_started_by_hand_without_a_token_refuses_to_start_unless_told(tmp_path):
    """Found: psgd-server's token defaulted to none, so a job started by hand answered anyone who knew an address.
    Now no job is open by default: without a token the shard refuses to start, saying how to make one; serving
    without one is --no-token, said in a WARNING line."""
    bare = {k: v for k, v in os.environ.items() if k != "PSGD_TOKEN"}
    argv = [PY, "-m", "psgd.cli.server", "--workers", "1", "--shards", "1", "--bind", "127.0.0.1:0"]
    refused = subprocess.run(argv, env=bare, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "needs the job's token" in refused.stderr and "PSGD_TOKEN" in refused.stderr
    assert "--no-token" in refused.stderr and "Traceback" not in refused.stderr
    both = subprocess.run([*argv, "--no-token"], env=by_hand_env(), capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "--no-token and a token" in both.stderr, both.stderr[-2000:]
    port_file = tmp_path / "port"
    with open(tmp_path / "shard.log", "w") as log:
        open_shard = subprocess.Popen(
            [*argv, "--no-token", "--port-file", str(port_file)], env=bare, stdout=subprocess.DEVNULL, stderr=log
        )
    try:
        wait_for(lambda: port_file.exists() or open_shard.poll() is not None, 60, "the shard to serve")
        assert open_shard.poll() is None, (tmp_path / "shard.log").read_text()
        assert "serving WITHOUT a token (--no-token)" in (tmp_path / "shard.log").read_text()
    finally:
        open_shard.send_signal(signal.SIGTERM)
        assert open_shard.wait(30) == 0


def test_a_token_holder_cannot_act_as_a_worker_it_did_not_register_as():
    """The token lets a process into the job, not into another process's registration: a push, pull, heartbeat,
    Done or Rollback as worker 0 without the key worker 0's registration got is refused, counted, and changes
    nothing; so is a data connection claiming worker 0."""
    job = make_job(
        "model.name=softmax", "cluster.workers=1", "cluster.shards=1", "cluster.policy=async", "train.epochs=1"
    )
    server = ShardServer(build_shard(describe_job(job), 0), "127.0.0.1:0", token="s3cret").start()
    try:
        plan = server.core.plan
        grads = {s.name: np.full(s.shape, 0.5, dtype=np.float32) for s in plan.specs}
        with PSClient([server.address], plan, 0, config=job, token="s3cret") as real:
            real.register()
            assert [r.outcome for r in real.push(0, grads)] == ["applied"]
            before, version = server.core.flat.copy(), server.core.version
            meta = ()  # the channel proves the token: what is missing is the registration's key
            with open_channel(server.address, token="s3cret") as channel:
                stub = ps_pb2_grpc.ParameterServerStub(channel)
                calls = {
                    "push": lambda key: stub.Push(
                        iter(
                            [
                                ps_pb2.PushMessage(
                                    header=ps_pb2.PushHeader(
                                        worker_id=0, clock=1, base_version=version, dtype="float32", registration=key
                                    )
                                )
                            ]
                        ),
                        timeout=5,
                        metadata=meta,
                    ),
                    "pull": lambda key: list(
                        stub.Pull(ps_pb2.PullRequest(worker_id=0, clock=1, registration=key), timeout=5, metadata=meta)
                    ),
                    "heartbeat": lambda key: stub.Heartbeat(
                        ps_pb2.HeartbeatRequest(worker_id=0, registration=key), timeout=5, metadata=meta
                    ),
                    "done": lambda key: stub.Done(
                        ps_pb2.DoneRequest(worker_id=0, clock=1, registration=key), timeout=5, metadata=meta
                    ),
                    "rollback": lambda key: stub.Rollback(
                        ps_pb2.RollbackRequest(worker_id=0, to_version=0, cause="x", registration=key),
                        timeout=5,
                        metadata=meta,
                    ),
                }
                for name, call in calls.items():
                    for key in ("", "0" * 32):  # none, and a made-up one
                        with pytest.raises(grpc.RpcError) as info:
                            call(key)
                        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, (name, info.value.details())
                        assert "must carry the key" in info.value.details()
                for worker_id in (99, -7):  # a rollback by a worker the job does not have
                    with pytest.raises(grpc.RpcError) as info:
                        stub.Rollback(ps_pb2.RollbackRequest(worker_id=worker_id, cause="x"), timeout=5, metadata=meta)
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(LinkError) as info:  # the data port: a hello claiming worker 0
                DataConnection("127.0.0.1", server.data.port, 0, plan.hash, token="s3cret", timeout=5)
            assert info.value.code == Code.PERMISSION_DENIED
            with pytest.raises(LinkError) as info:
                DataConnection("127.0.0.1", server.data.port, 0, plan.hash, token="s3cret", timeout=5, key="f" * 32)
            assert info.value.code == Code.PERMISSION_DENIED
            assert np.array_equal(server.core.flat, before) and server.core.version == version
            status = server.core.status()
            assert status["workers"][0]["state"] == "live"  # the Done changed nothing
            assert status["counters"]["impostors"] == 2 * len(calls) + 2
            assert [r.outcome for r in real.push(1, grads)] == ["applied"]  # the real worker goes on
            real.done()
    finally:
        server.stop(1)


def test_a_retried_push_is_applied_once():
    job = make_job("model.name=softmax", "cluster.workers=1", "cluster.shards=2", "cluster.policy=async")
    with shards(job) as (job, servers):
        model = build_job(job).model
        plan = PartitionPlan(model.specs(), 2, job.cluster.links.slice_bytes)
        grads = {s.name: np.full(s.shape, 0.5, dtype=np.float32) for s in plan.specs}
        with PSClient(job.cluster.servers, plan, 0, config=job) as client:
            client.register()
            first = client.push(0, grads)
            again = client.push(0, grads)  # the same push delivered twice (a forced retry)
        assert [r.outcome for r in first] == ["applied", "applied"]
        assert [r.outcome for r in again] == ["duplicate", "duplicate"]
        assert [s.core.version for s in servers] == [1, 1]
        init = model.init(job.train.seed)
        for s in servers:
            for sl, w in slice_weights(s.core):
                expected = init[sl.var].reshape(-1)[sl.start : sl.stop] - 0.05 * 0.5  # one momentum step, lr 0.05
                np.testing.assert_allclose(w, expected, rtol=1e-6)


# -- processes ------------------------------------------------------------------------------
class Cluster:
    """Shard and worker processes for one job file, with fixed ports so a shard can come back."""

    def __init__(self, job, tmp: Path, checkpoint_every: float = 0.3):
        self.tmp = tmp
        taken: set[int] = set()  # gRPC on p, the data path on p + 1; no two shards share one
        self.ports = [free_port_pair(taken=taken) for _ in range(job.cluster.shards)]
        self.job = job.override("cluster.servers", [f"127.0.0.1:{p}" for p in self.ports])
        self.path = tmp / "job.toml"
        self.path.write_text(to_toml(self.job.to_dict()))
        self.ckpt = tmp / "ckpt"
        self.every = checkpoint_every
        self.procs: list[subprocess.Popen] = []

    def start_shard(self, k: int, log_name: str | None = None) -> subprocess.Popen:
        p = subprocess.Popen(
            [
                PY,
                "-m",
                "psgd.cli.server",
                "-c",
                str(self.path),
                "--shard",
                str(k),
                "--checkpoint-dir",
                str(self.ckpt),
                "--checkpoint-every",
                str(self.every),
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.tmp / (log_name or f"shard{k}.log"), "w"),
            env=by_hand_env(),
        )
        self.procs.append(p)
        return p

    def shard_folder(self, k: int) -> Path:
        """Where shard k keeps its checkpoints: DIR/<the job's fingerprint>/shard-k."""
        return self.ckpt / build_shard(describe_job(self.job), k).fingerprint / f"shard-{k}"

    def start_worker(self, r: int, *extra: str) -> subprocess.Popen:
        p = subprocess.Popen(
            [
                PY,
                "-m",
                "psgd.cli.worker",
                "-c",
                str(self.path),
                "--rank",
                str(r),
                "--no-progress",
                "--metrics",
                str(self.tmp / f"w{r}.jsonl"),
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.tmp / f"w{r}.log", "a"),
            env=by_hand_env(),
        )
        self.procs.append(p)
        return p

    def steps(self, r: int) -> list[dict]:
        path = self.tmp / f"w{r}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def status(self):
        plan = PartitionPlan(
            build_job(self.job).model.specs(), self.job.cluster.shards, self.job.cluster.links.slice_bytes
        )
        with PSClient(self.job.cluster.servers, plan, deadlines=Deadlines(request_timeout=10), token=TOKEN) as client:
            client.wait_ready(30)
            return client.status(), fetch_weights(self.job.cluster.servers, plan, token=TOKEN)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def accuracy(job, weights) -> float:
    built = build_job(job)
    return evaluate(
        built.model, params_to_device(weights, built.device), built.dataset.x_test, built.dataset.y_test, built.device
    )[1]


@pytest.mark.slow
def test_a_sigkilled_shard_restarts_from_its_checkpoint_and_training_completes(tmp_path):
    sets = ("cluster.policy=sync", "cluster.workers=2", "cluster.shards=2", "train.epochs=40")
    total = 40 * (1438 // 2 // 32)
    reference = json.loads(
        subprocess.run(
            [PY, "-m", "psgd.cli.main", "launch", "--no-progress", "--json", *sum((["--set", s] for s in sets), [])],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    )["test_accuracy"]

    cluster = Cluster(make_job(*sets), tmp_path)
    try:
        shard0 = cluster.start_shard(0)
        cluster.start_shard(1)
        workers = [cluster.start_worker(r) for r in range(2)]
        wait_for(lambda: len(cluster.steps(0)) >= total // 3, 60, "a third of the run")
        shard0.send_signal(signal.SIGKILL)
        shard0.wait(10)
        manifests = sorted(cluster.shard_folder(0).glob("ckpt-*.json"), key=lambda p: int(p.stem[5:]))
        last_checkpoint = int(manifests[-1].stem[5:])
        statuses, _ = _status_of_shard(cluster, 1)
        upper_bound_at_kill = statuses.version + 1  # in sync, shard 0 was at most one round ahead of shard 1
        cluster.start_shard(0, "shard0-restarted.log")
        for w in workers:
            assert w.wait(120) == 0, (tmp_path / "w0.log").read_text()[-3000:]
        statuses, weights = cluster.status()
    finally:
        cluster.close()
    restarted = json.loads(statuses[0].counters_json)
    assert restarted["restored_version"] == last_checkpoint > 0
    assert "restored version" in (tmp_path / "shard0-restarted.log").read_text()
    lost = statuses[1].version - statuses[0].version  # rounds shard 0 never applied
    assert statuses[1].version == total
    assert 0 <= lost <= upper_bound_at_kill - last_checkpoint, (lost, upper_bound_at_kill, last_checkpoint)
    acc = accuracy(cluster.job, weights)
    assert abs(acc - reference) <= 0.01, (acc, reference)
    for r in range(2):
        assert cluster.steps(r)[-1]["event"] == "done"


def _status_of_shard(cluster: Cluster, k: int):
    with open_channel(cluster.job.cluster.servers[k], token=TOKEN) as channel:
        return ps_pb2_grpc.ParameterServerStub(channel).Status(ps_pb2.StatusRequest(), timeout=10), None


def test_sigterm_stops_a_shard_gracefully_with_a_last_checkpoint_and_a_worker_after_its_step(tmp_path):
    cluster = Cluster(
        make_job(
            "model.name=softmax", "cluster.policy=async", "cluster.workers=1", "cluster.shards=1", "train.epochs=400"
        ),
        tmp_path,
        checkpoint_every=60,
    )
    try:
        shard = cluster.start_shard(0)
        worker = cluster.start_worker(0)
        wait_for(lambda: len(cluster.steps(0)) >= 50, 60, "50 steps")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
        steps = cluster.steps(0)
        assert steps[-1]["event"] == "done" and steps[-1]["steps"] < 400 * 44  # it left early, cleanly
        status, _ = _status_of_shard(cluster, 0)
        assert status.workers[0].state == "done" and status.version == steps[-1]["steps"]
        shard.send_signal(signal.SIGTERM)
        assert shard.wait(30) == 0
    finally:
        cluster.close()
    newest = max(int(p.stem[5:]) for p in cluster.shard_folder(0).glob("ckpt-*.json"))
    assert newest == status.version  # the last checkpoint holds every applied update


def test_a_shard_whose_last_checkpoint_fails_exits_non_zero_saying_so(tmp_path):
    """A shard whose final checkpoint could not be written (a full disk) logged it and exited 0: whoever
    restarts it from that folder loses the updates since the last one, and nothing said so."""
    cluster = Cluster(
        make_job(
            "model.name=softmax", "cluster.policy=async", "cluster.workers=1", "cluster.shards=1", "train.epochs=400"
        ),
        tmp_path,
        checkpoint_every=3600,
    )
    try:
        shard = cluster.start_shard(0)
        worker = cluster.start_worker(0)
        wait_for(lambda: len(cluster.steps(0)) >= 20, 60, "20 steps")
        shutil.rmtree(cluster.ckpt, ignore_errors=True)
        cluster.ckpt.write_text("not a folder")  # the checkpoint folder cannot be written any more
        taken = len(cluster.steps(0))
        wait_for(lambda: len(cluster.steps(0)) >= taken + 10, 60, "10 steps more")  # updates no checkpoint holds
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
        shard.send_signal(signal.SIGTERM)
        assert shard.wait(30) == 1
    finally:
        cluster.close()
    log = (tmp_path / "shard0.log").read_text()
    assert "last checkpoint" in log and "failed" in log and "Traceback" not in log, log[-2000:]


@pytest.mark.slow
def test_a_killed_worker_restarts_and_continues_where_it_was(tmp_path):
    cluster = Cluster(
        make_job(
            "model.name=softmax",
            "cluster.policy=async",
            "cluster.workers=2",
            "cluster.shards=1",
            "train.epochs=20",
            "cluster.lease_seconds=2",
        ),
        tmp_path,
    )
    total = 20 * (1438 // 2 // 32)
    try:
        cluster.start_shard(0)
        first = cluster.start_worker(1)
        wait_for(lambda: len(cluster.steps(1)) >= 30, 60, "worker 1's first 30 steps")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        killed_at = cluster.steps(1)[-1]["clock"]
        again = cluster.start_worker(1)
        w0 = cluster.start_worker(0)
        assert again.wait(120) == 0 and w0.wait(120) == 0
    finally:
        cluster.close()
    clocks = [s["clock"] for s in cluster.steps(1) if s["event"] == "step"]
    resumed = clocks[clocks.index(killed_at) + 1]
    assert killed_at < resumed <= killed_at + 2  # continued from its clock, not from 0
    assert cluster.steps(1)[-1]["event"] == "done" and cluster.steps(1)[-1]["clock"] == total
