"""A pull whose reader stops delays only itself, over every link: the stopped reader keeps the version it
asked for, whole, and every other worker's pushes and pulls go on at their pace.

The shard is async, one shard, two workers, an MLP of about 17 MB in float32 (more than a loopback
socket buffers, so a TCP reader that stops reading stops the shard's send).  Worker 0 is the stopped
reader, on a raw connection the test drives: over TCP it asks for the weights and reads none of them,
over shared memory it is answered and never releases, over gRPC it reads one chunk of the stream.
Worker 1 is a real client.  The shard's request timeout (30 s) is far longer than the bound each of
worker 1's calls must meet.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time

import grpc
import numpy as np
import pytest
from helpers import make_job, shards, slice_weights, wait_for

from psgd.config import Deadlines, Links
from psgd.proto import ps_pb2, ps_pb2_grpc
from psgd.server.net import datapath
from psgd.wire import protocol, segment
from psgd.worker.client import PSClient

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")

IO = 10.0  # worker 1's request timeout; the shard's is 30 s
STEP_BOUND = 3.0  # seconds: what one of worker 1's steps may take (milliseconds when nothing holds it back)
LINKS = ("tcp", "shm", "grpc")


@pytest.fixture(scope="module")
def big():
    job = make_job(
        "model.name=mlp",
        "model.hidden=[2048,2048]",
        "train.dtype=float32",
        "optimizer.name=sgd",
        "optimizer.lr=0.01",
        "cluster.policy=async",
        "cluster.workers=2",
        "cluster.shards=1",
        "cluster.request_timeout=30",
        "cluster.lease_seconds=600",
        "cluster.join_timeout=600",
    )
    with shards(job) as (job, servers):
        yield job, servers[0]


def _hello(port: int, plan_hash: str, shm: str = "", key: str = "") -> tuple[socket.socket, dict]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    sock.settimeout(IO)
    sock.connect(("127.0.0.1", port))
    body = {"plan_hash": plan_hash, "key": key, **({"shm": shm} if shm else {})}
    payload = json.dumps(body).encode()
    sock.sendall(protocol.REQUEST.pack(protocol.DATA_MAGIC, protocol.OP_HELLO, 0, 0, 0, 0, len(payload)) + payload)
    magic, status, _, _, _, _, size = protocol.recv_struct(sock, protocol.REPLY)
    assert magic == protocol.DATA_MAGIC and status == 0
    offer = bytearray(size)
    protocol.recv_exact(sock, memoryview(offer))
    return sock, json.loads(offer) if size else {}


def _pull_request(sock: socket.socket) -> None:
    sock.sendall(protocol.REQUEST.pack(protocol.DATA_MAGIC, protocol.OP_PULL, 0, 0, 0, 0, 0))


@contextlib.contextmanager
def stopped_reader(link: str, server):
    """Worker 0, stopped in the middle of a pull; yields a function that finishes the pull (reads the rest)
    and returns the bytes it got."""
    core = server.core
    if link == "grpc":
        channel = grpc.insecure_channel(server.address)
        stream = ps_pb2_grpc.ParameterServerStub(channel).Pull(
            ps_pb2.PullRequest(worker_id=0, clock=0, registration=core.roster.workers[0].key), timeout=60
        )
        first = next(stream)

        def finish() -> bytes:
            out = bytearray(core.nbytes)
            for chunk in [first, *stream]:
                a, b = core.offsets[chunk.slice_id]
                at = a * 4 + chunk.offset
                out[at : at + len(chunk.data)] = chunk.data
            return bytes(out)

        try:
            yield finish
        finally:
            stream.cancel()
            channel.close()
        return
    sock, offer = _hello(
        server.data.port, core.plan.hash, shm="pull" if link == "shm" else "", key=core.roster.workers[0].key
    )
    seg = segment.attach(offer, offer["bytes"], writable=False) if link == "shm" else None
    try:
        _pull_request(sock)
        if seg is not None:
            magic, status, _, _, slot, seq, size = protocol.recv_struct(sock, protocol.REPLY)
            assert magic == protocol.DATA_MAGIC and status == 0 and size == core.nbytes

            def finish() -> bytes:  # the slot the reply named, its sequence number unchanged
                held = bytes(seg.slot(slot)[:size])
                assert seg.seq(slot) == seq
                return held
        else:

            def finish() -> bytes:
                magic, status, _, _, _, _, size = protocol.recv_struct(sock, protocol.REPLY)
                assert magic == protocol.DATA_MAGIC and status == 0 and size == core.nbytes
                out = bytearray(size)
                protocol.recv_exact(sock, memoryview(out))
                return bytes(out)

        yield finish
    finally:
        if seg is not None:
            seg.close()
        sock.close()


@pytest.mark.parametrize("link", LINKS)
def test_a_stopped_reader_delays_no_other_worker_and_keeps_its_version_whole(big, link):
    job, server = big
    core, plan = server.core, server.core.plan
    host = {s.name: np.empty(s.shape, dtype=s.dtype) for s in plan.specs}
    grads = {s.name: np.full(s.shape, 1e-3, dtype=s.dtype) for s in plan.specs}
    with (
        PSClient(job.cluster.servers, plan, 0, deadlines=Deadlines(request_timeout=IO), config=job) as holder,
        PSClient(
            job.cluster.servers,
            plan,
            1,
            deadlines=Deadlines(request_timeout=IO),
            links=Links(transport=link),
            config=job,
        ) as other,
    ):
        holder.register()
        clock = other.register()
        before, version = core.flat.tobytes(), core.version
        with stopped_reader(link, server) as finish:
            steps = []
            for _ in range(4):
                began = time.monotonic()
                other.pull(clock, host)
                assert [r.outcome for r in other.push(clock, grads)] == ["applied"]
                clock += 1
                steps.append(time.monotonic() - began)
            assert max(steps) < STEP_BOUND, f"worker 1's steps took {steps} s while worker 0 was stopped"
            assert core.version == version + 4 and core.flat.tobytes() != before
            assert finish() == before  # the stopped reader's version, whole, whatever was applied meanwhile


def test_a_stopped_shared_memory_reader_is_found_out_when_its_version_had_to_go(big, monkeypatch):
    """Two stopped readers hold both versions the shard keeps: an update waits for the older one only until
    its hold has passed, then takes its memory; the reader, when it goes on, sees that its copy is torn."""
    job, server = big
    plan = server.core.plan
    monkeypatch.setattr(datapath, "TRANSFER_GRACE", 0.5)
    monkeypatch.setattr(datapath, "MIN_TRANSFER_RATE", 1e12)
    grads = {s.name: np.full(s.shape, 1e-3, dtype=s.dtype) for s in plan.specs}
    with (
        PSClient(job.cluster.servers, plan, 0, deadlines=Deadlines(request_timeout=IO), config=job) as holder,
        PSClient(
            job.cluster.servers,
            plan,
            1,
            deadlines=Deadlines(request_timeout=IO),
            links=Links(transport="tcp"),
            config=job,
        ) as other,
    ):
        holder.register()
        clock = other.register()
        first, offer = _hello(server.data.port, plan.hash, shm="pull", key=server.core.roster.workers[0].key)
        seg = segment.attach(offer, offer["bytes"], writable=False)
        try:
            _pull_request(first)
            reply = protocol.recv_struct(first, protocol.REPLY)
            held_slot, held_seq = reply[4], reply[5]  # a pull's reply: next clock is the slot, staleness its seq
            assert other.push(clock, grads)[0].outcome == "applied"  # a copy: the first read keeps its slot
            with stopped_reader("tcp", server):  # the second holds the other one
                began = time.monotonic()
                assert other.push(clock + 1, grads)[0].outcome == "applied"
                assert 0.3 < time.monotonic() - began < STEP_BOUND
            assert seg.seq(held_slot) != held_seq  # its version was taken: the copy is torn
            wait_for(lambda: _closed(first), IO, "the revoked reader's connection to be closed")
        finally:
            seg.close()
            first.close()


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def test_a_worker_whose_copy_was_torn_pulls_again_and_gets_a_whole_version(big, monkeypatch):
    """Worker 0 is stopped in the middle of its copy out of shared memory, long enough to lose its version; when
    it goes on, it finds the copy torn and pulls again: what it ends with is one whole version."""
    import threading

    from psgd.link import shm

    job, server = big
    core, plan = server.core, server.core.plan
    monkeypatch.setattr(datapath, "TRANSFER_GRACE", 0.5)
    monkeypatch.setattr(datapath, "MIN_TRANSFER_RATE", 1e12)
    copying, go_on, calls = threading.Event(), threading.Event(), []
    real_copy = shm.copy_views

    def stopped_copy(pairs):
        calls.append(1)
        if len(calls) == 1:  # the first copy of the first pull
            copying.set()
            assert go_on.wait(IO)
        real_copy(pairs)

    monkeypatch.setattr(shm, "copy_views", stopped_copy)
    grads = {s.name: np.full(s.shape, 1e-3, dtype=s.dtype) for s in plan.specs}
    host = {s.name: np.empty(s.shape, dtype=s.dtype) for s in plan.specs}
    with (
        PSClient(
            job.cluster.servers,
            plan,
            0,
            deadlines=Deadlines(request_timeout=IO),
            links=Links(transport="shm"),
            config=job,
        ) as stopped,
        PSClient(
            job.cluster.servers,
            plan,
            1,
            deadlines=Deadlines(request_timeout=IO),
            links=Links(transport="tcp"),
            config=job,
        ) as other,
    ):
        clock0, clock1 = stopped.register(), other.register()
        assert stopped.links[0].shared
        pulled = run_in_thread(lambda: stopped.pull(clock0, host))
        assert copying.wait(IO)
        assert other.push(clock1, grads)[0].outcome == "applied"  # made in the other slot
        with stopped_reader("tcp", server):  # which is now read too: the next update takes worker 0's
            assert other.push(clock1 + 1, grads)[0].outcome == "applied"
        revoked = core.store.counters["revoked_reads"]
        go_on.set()
        version = pulled()
        assert version == [core.version] and core.store.counters["revoked_reads"] == revoked
        for sl, w in slice_weights(core):
            assert host[sl.var].reshape(-1)[sl.start : sl.stop].tobytes() == w.tobytes()
        assert len(calls) > 1  # it copied again


def run_in_thread(fn):
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return lambda: future.result(timeout=2 * IO)
