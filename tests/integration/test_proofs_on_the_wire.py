"""Without TLS, no call sends the token: each proves it with a proof made for one address, good once there
(psgd.wire.proofs, psgd.server.net.tokens).  A stranger at a shard's address (a dead shard's port taken) hears no
token, and what it hears cannot be replayed to the live shard; a call read off the wire cannot be replayed to the
shard it was made for."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from concurrent import futures

import grpc
import pytest
from helpers import TOKEN, make_job, wait_for

from psgd.job import describe_job
from psgd.link import LinkError
from psgd.link.tcp import DataConnection
from psgd.ops.reach import Connect, read_status
from psgd.proto import ps_pb2, ps_pb2_grpc
from psgd.server import build_shard
from psgd.server.net.service import ShardServer
from psgd.wire import protocol
from psgd.worker.client import PSClient, PSError


class _Heard(grpc.ServerInterceptor):
    """Keeps each call's metadata, as whoever holds a shard's address (or reads its traffic) would."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []

    def intercept_service(self, continuation, details):
        self.calls.append((details.method, tuple(details.invocation_metadata or ())))
        return continuation(details)


class _Stranger(ps_pb2_grpc.ParameterServerServicer):
    """A process without the token at a shard's gRPC address: answers nothing, hears everything."""

    def Status(self, request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "gone")

    def Register(self, request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "gone")


@contextlib.contextmanager
def _stranger():
    heard = _Heard()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[heard])
    ps_pb2_grpc.add_ParameterServerServicer_to_server(_Stranger(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", heard
    finally:
        server.stop(0)


@contextlib.contextmanager
def _data_stranger():
    """A process at a data port that keeps the first hello it hears, and answers it with nothing."""
    listener = socket.create_server(("127.0.0.1", 0))
    heard: list[bytes] = []

    def hear():
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(5)
                head = protocol.recv_struct(conn, protocol.REQUEST)
                heard.append(protocol.recv_bytes(conn, head[-1]))

    thread = threading.Thread(target=hear, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], heard
    finally:
        listener.close()
        thread.join(5)


def _shard(**kwargs) -> ShardServer:
    job = make_job("model.name=softmax", "cluster.workers=1", "cluster.shards=1", "cluster.policy=async")
    return ShardServer(build_shard(describe_job(job), 0), "127.0.0.1:0", token=TOKEN, **kwargs).start(), job


def _said(metadata: tuple) -> str:
    return " ".join(str(v) for _, v in metadata)


def test_a_stranger_at_a_shards_address_hears_no_token_and_cannot_replay_what_it_heard():
    """Found: a stranger at a dead shard's ports received ``Bearer <token>`` from workers and ``psgd status``, and the
    token in data-port hellos; Status proofs it heard were accepted by the live shard.  Now each call carries a proof
    made for the address it was sent to: the stranger hears no token, and the live shard refuses what it heard."""
    shard, job = _shard()
    try:
        plan = shard.core.plan
        with _stranger() as (address, heard):
            with pytest.raises(PSError):
                with PSClient([address], plan, 0, config=job, token=TOKEN, retry_deadline=2.0) as client:
                    client.register()
            with pytest.raises(grpc.RpcError):
                read_status(address, Connect(timeout=1.0, token=TOKEN))
            wait_for(lambda: len(heard.calls) >= 2, 10, "the stranger to hear a registration and a Status")
        said = _said(tuple(m for _, meta in heard.calls for m in meta))
        assert TOKEN not in said and "Proof " in said, heard.calls
        with _data_stranger() as (port, hellos):
            with pytest.raises((LinkError, protocol.WireError)):
                DataConnection("127.0.0.1", port, 0, plan.hash, TOKEN, timeout=2.0)
            wait_for(lambda: hellos, 10, "the stranger's data port to hear a hello")
        assert TOKEN not in hellos[0].decode("utf-8", "replace") and json.loads(hellos[0])["proof"]

        with grpc.insecure_channel(shard.address) as channel:  # what it heard, replayed to the live shard
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            for method, metadata in heard.calls:
                call = {
                    "/psgd.v1.ParameterServer/Status": lambda: stub.Status(
                        ps_pb2.StatusRequest(), timeout=5, metadata=metadata
                    ),
                    "/psgd.v1.ParameterServer/Register": lambda: stub.Register(
                        ps_pb2.RegisterRequest(worker_id=0), timeout=5, metadata=metadata
                    ),
                }[method]
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, info.value.details())
        with contextlib.closing(socket.create_connection(("127.0.0.1", shard.data.port), timeout=5)) as sock:
            protocol.send_buffers(
                sock,
                [protocol.REQUEST.pack(protocol.DATA_MAGIC, protocol.OP_HELLO, 0, 0, 0, 0, len(hellos[0])), hellos[0]],
            )
            _, op, _, _, _, _, size = protocol.recv_struct(sock, protocol.REPLY)
            assert op != 0 and "proof of the token" in protocol.recv_bytes(sock, size).decode()
    finally:
        shard.stop(grace=0)


def test_a_call_read_off_the_wire_is_refused_when_replayed():
    """Found: a process reading loopback took the token and worker 0's key, and a replayed ``Done`` as worker 0 was
    accepted.  Now a call's proof is good once: the same Done, replayed with what it carried, is refused."""
    heard = _Heard()
    shard, job = _shard(interceptors=[heard])
    try:
        with PSClient([shard.address], shard.core.plan, 0, config=job, token=TOKEN) as client:
            client.register()
            key, clock = client.links[0].registration, client.clock
            client.done()
        method, metadata = next((m, meta) for m, meta in heard.calls if m.endswith("/Done"))
        assert TOKEN not in _said(metadata)
        with grpc.insecure_channel(shard.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                ps_pb2_grpc.ParameterServerStub(channel).Done(
                    ps_pb2.DoneRequest(worker_id=0, clock=clock, registration=key), timeout=5, metadata=metadata
                )
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()
    finally:
        shard.stop(grace=0)
