"""Trust nothing unchecked: which shard answered, whether the worker's job is the shard's, and why a call
was refused (a structured reason, not words).

Real gRPC and data-path servers on 127.0.0.1, workers through the training loop or the client.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from helpers import make_job, run_threads

from psgd.config import Deadlines
from psgd.errors import Code
from psgd.job import build_job, describe_job
from psgd.link import LinkError
from psgd.partition import PartitionPlan
from psgd.server import build_shard
from psgd.server.net.service import ShardServer
from psgd.server.state.admission import Roster
from psgd.wire import status
from psgd.worker.client import PSClient, PSError
from psgd.worker.exchange import run_worker


def plan_of(job) -> PartitionPlan:
    return PartitionPlan(build_job(job).model.specs(), job.cluster.shards, job.cluster.links.slice_bytes)


def serve(cores) -> list[ShardServer]:
    return [ShardServer(core, "127.0.0.1:0").start() for core in cores]


def stop(servers) -> None:
    for s in servers:
        s.stop(grace=0.5)


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_two_shards_with_the_same_index_are_found_out_at_once(transport):
    """Shards 0, 0, 2 holding the same number of bytes used to train to the end, shard 1's gradients
    stored as shard 0's slices, with no warning."""
    job = make_job(
        "model.name=softmax",
        "cluster.shards=3",
        "cluster.workers=1",
        "cluster.slice_bytes=512",
        "train.epochs=1",
        "cluster.policy=async",
        f"cluster.transport={transport}",
    )
    servers = serve(
        [build_shard(describe_job(job), 0), build_shard(describe_job(job), 0), build_shard(describe_job(job), 2)]
    )
    try:
        job = job.override("cluster.servers", [s.address for s in servers])
        assert servers[0].core.nbytes == servers[1].core.nbytes  # the case that went unnoticed
        began = time.monotonic()
        with pytest.raises(PSError, match=r"listed as shard 1 of 3, answered as shard 0 of 3") as err:
            run_worker(job, 0, job.cluster.servers, progress=False)
        assert time.monotonic() - began < 10
        assert servers[1].address in str(err.value) and "wrong --shard" in str(err.value)
        assert all(s.core.version == 0 for s in servers)  # nothing was applied anywhere
    finally:
        stop(servers)


@pytest.mark.parametrize(
    "change, field",
    [
        ("cluster.policy=async", "policy: shard 0 sync, worker 0 async"),
        ("cluster.workers=3", "workers: shard 0 2, worker 0 3"),
        ("optimizer.lr=0.5", "optimizer: shard 0 {lr=0.05}, worker 0 {lr=0.5}"),  # only what differs
        (
            "cluster.backup_workers=1",
            "policy_options: shard 0 {backup_workers=0, checkpoint_rounds=100}, worker 0 {backup_workers=1}",
        ),  # sync without backup workers has cuts, with them none
        (
            "cluster.policy=async cluster.async_lr=full",
            "policy_options: shard 0 {async_lr=divided}, worker 0 {async_lr=full}",
        ),
        (
            "cluster.policy=ssp cluster.dc_lambda=0.5",
            "policy_options: shard 0 {dc_lambda=0.0}, worker 0 {dc_lambda=0.5}",
        ),
    ],
)
def test_a_worker_from_another_job_is_refused_when_it_registers_naming_each_field(change, field):
    """``change``: the worker's job differs in it; with two, the first is the shard's too."""
    *both, change = change.split()
    job = make_job("cluster.shards=1", "train.epochs=1", *both)
    servers = serve([build_shard(describe_job(job), 0)])
    try:
        other = make_job("cluster.shards=1", "train.epochs=1", *both, change)
        began = time.monotonic()
        with pytest.raises(PSError, match="job differs from shard 0's") as err:
            run_worker(other, 0, [servers[0].address], progress=False)
        assert time.monotonic() - began < 10, "a permanent refusal must not be retried"
        assert field in str(err.value)
        assert "FAILED_PRECONDITION" in str(err.value)
        assert servers[0].core.roster.workers[0].state == "pending"
    finally:
        stop(servers)


def test_the_rate_of_an_async_push_is_part_of_an_async_jobs_identity_only():
    """Under sync a round is one update whatever async_lr and implicit_momentum say: a sync job's
    fingerprint (and so its checkpoints) does not change with them; an async or ssp job's does."""
    for policy, differs in (("sync", False), ("async", True), ("ssp", True)):
        for key, values in (("async_lr", ("divided", "full")), ("implicit_momentum", ("false", "true"))):
            a, b = (make_job(f"cluster.policy={policy}", f"cluster.{key}={value}") for value in values)
            assert (
                build_shard(describe_job(a), 0).fingerprint != build_shard(describe_job(b), 0).fingerprint
            ) == differs, (policy, key)


def test_the_refusal_carries_its_reason_and_differences_as_a_status_detail():
    job = make_job("cluster.shards=1")
    servers = serve([build_shard(describe_job(job), 0)])
    try:
        other = make_job("cluster.shards=1", "cluster.policy=ssp")
        with grpc.insecure_channel(servers[0].address) as channel:
            from grpc_status import rpc_status

            from psgd.proto import ps_pb2, ps_pb2_grpc

            stub = ps_pb2_grpc.ParameterServerStub(channel)
            client = PSClient([servers[0].address], plan_of(other), 0, config=other)
            request = client._register_request()
            client.close()
            with pytest.raises(grpc.RpcError) as err:
                stub.Register(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert status.reason_of(err.value) == "JOB_MISMATCH"
            info = ps_pb2.ErrorInfo()
            rpc_status.from_call(err.value).details[0].Unpack(info)
            # each difference is cut to 160 bytes, so that twelve of them fit in the trailer beside the message
            assert list(info.differences) == [
                "policy: shard 0 sync, worker 0 ssp",
                "policy_options: shard 0 {backup_workers=0, checkpoint_rounds=100}, "
                "worker 0 {async_lr=divided, dc_adaptive=False, dc_lam ... (46 more "
                "characters)",
            ]
            request.job_json = ""
            with pytest.raises(grpc.RpcError) as err:
                stub.Register(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no job identity" in err.value.details()
    finally:
        stop(servers)


@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc"])
def test_a_forgotten_worker_registers_again_because_of_the_reason_not_the_words(monkeypatch, transport):
    """The shard's message no longer says "register again": the client acts on the reason alone."""
    original = Roster.live

    def reworded(self, worker, key, renew=True):
        try:
            return original(self, worker, key, renew)
        except Exception as exc:
            exc.message = "this shard has no record of you"  # what people read; the client must not care
            exc.args = (exc.message,)
            raise

    monkeypatch.setattr(Roster, "live", reworded)
    job = make_job("cluster.shards=1", "cluster.workers=1", "cluster.policy=async", f"cluster.transport={transport}")
    servers = serve([build_shard(describe_job(job), 0)])
    try:
        plan = plan_of(job)
        with PSClient([servers[0].address], plan, 0, deadlines=Deadlines(request_timeout=5), config=job) as client:
            client.register()
            grads = {s.name: np.full(s.shape, 1e-3, dtype=s.dtype) for s in plan.specs}
            client.push(0, grads)
            core = servers[0].core
            with core.lock:  # the shard forgets the worker, as after a restart or an expired lease
                core.roster.workers[0].state = "expired"
            replies = client.push(1, grads)
            assert replies[0].outcome == "applied"
            assert core.roster.workers[0].state == "live" and core.version == 2
    finally:
        stop(servers)


def test_the_data_path_reports_the_reason_too():
    job = make_job("cluster.shards=1", "cluster.workers=1", "cluster.policy=async")
    servers = serve([build_shard(describe_job(job), 0)])
    try:
        from psgd.link.tcp import DataConnection

        plan = plan_of(job)
        with PSClient([servers[0].address], plan, 0, deadlines=Deadlines(request_timeout=5), config=job) as client:
            client.register()
        conn = DataConnection(
            "127.0.0.1", servers[0].data.port, 0, plan.hash, "", 5.0, key=servers[0].core.roster.workers[0].key
        )
        try:
            with servers[0].core.lock:
                servers[0].core.roster.workers[0].state = "expired"
            with pytest.raises(LinkError) as err:
                conn.pull(0, [memoryview(bytearray(s.nbytes)) for s in plan.slices_for_shard(0)])
            assert err.value.reason == "NOT_REGISTERED" and err.value.code == Code.FAILED_PRECONDITION
        finally:
            conn.close()
    finally:
        stop(servers)


def test_workers_of_one_job_still_train_together():
    job = make_job("cluster.shards=2", "cluster.workers=2", "train.epochs=1", "model.name=softmax")
    servers = serve([build_shard(describe_job(job), k) for k in range(2)])
    try:
        job = job.override("cluster.servers", [s.address for s in servers])
        results = run_threads(
            [lambda r=r: run_worker(job, r, job.cluster.servers, progress=False) for r in range(2)], timeout=120
        )
        assert [r.steps for r in results] == [results[0].steps] * 2 and results[0].steps > 0
    finally:
        stop(servers)


def test_a_mismatch_echoing_huge_input_still_arrives_with_its_reason():
    """The reason's trailer repeats the message: both must stay under the clients' 8 KiB limit."""
    import json

    from psgd.proto import ps_pb2, ps_pb2_grpc

    job = make_job("cluster.shards=1")
    servers = serve([build_shard(describe_job(job), 0)])
    try:
        core = servers[0].core
        hostile = {key: "\u20ac" * 20_000 for key in core.identity}
        hostile["plan"] = core.plan.hash
        request = ps_pb2.RegisterRequest(worker_id=0, plan_hash=core.plan.hash, job_json=json.dumps(hostile))
        with grpc.insecure_channel(servers[0].address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                ps_pb2_grpc.ParameterServerStub(channel).Register(request, timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        assert status.reason_of(err.value) == "JOB_MISMATCH"
        assert "more characters" in err.value.details()
    finally:
        stop(servers)
