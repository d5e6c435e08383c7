"""The plain-TCP bulk data path of in-process shards: same results as gRPC, compression, hostile peers,
reconnects and the connection limit.

Every socket here has a timeout and every thread join is bounded, so nothing
can hang.  The weights are read straight from ``core.flat`` (the servers run
in this process), never through the data path under test.

The hostile-input shard is sync softmax regression on digits in float64 with
two workers and one shard, cut by 2048-byte slices into dense0/W#0,
dense0/W#256, dense0/W#512 and dense0/b#0 (650 values, 5200 bytes).  Worker 0
is registered, worker 1 never is, so round 0 never closes and no push can
change the weights: every valid push is accumulated (or, once clock 0 was
pushed, a duplicate), and the round's accumulator holds exactly the one valid
gradient the tests push.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import json
import re
import socket
import struct
import time
import tracemalloc
import warnings
from dataclasses import dataclass

import numpy as np
import pytest
from helpers import make_job, run_threads, shards, slice_weights, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psgd.config import ConfigError, Deadlines, Links
from psgd.data import datasets
from psgd.errors import Code
from psgd.job import describe_job
from psgd.link import LinkError
from psgd.link.tcp import DataConnection
from psgd.partition import PartitionPlan
from psgd.server import build_shard
from psgd.server.net import datapath
from psgd.server.net.datapath import DataServer
from psgd.server.net.service import ShardServer
from psgd.server.state.core import ShardCore
from psgd.wire import protocol
from psgd.wire.proofs import Prover
from psgd.worker.client import PSClient, PSError, process_incarnation

pytestmark = [
    # an exception escaping a server thread (a connection ending without an answer) fails the test
    pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning"),
    # the shard's finiteness check sums the gradient: a signaling NaN raises numpy's "invalid" flag there
    pytest.mark.filterwarnings("ignore:invalid value encountered in reduce:RuntimeWarning"),
]

IO = 5.0  # seconds: the timeout of every socket and client here; every answer comes in milliseconds
LR = 0.1
HOSTILE_SETS = [
    "model.name=softmax",
    "cluster.workers=2",
    "cluster.shards=1",
    "train.dtype=float64",
    "optimizer.name=sgd",
    f"optimizer.lr={LR}",
    "cluster.slice_bytes=2048",
    "cluster.lease_seconds=600",
    "cluster.join_timeout=600",
]
CODE = {c.value: c for c in Code}
OK = Code.OK
INVALID, PRECONDITION = Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION
UNAUTHENTICATED = Code.UNAUTHENTICATED


@pytest.fixture(scope="module")
def digits64():
    return datasets.load_dataset("digits", dtype="float64")


# --- raw protocol helpers -------------------------------------------------------------------------


@dataclass
class Reply:
    code: Code
    outcome: int
    version: int
    next_clock: int
    staleness: int
    size: int
    message: str = ""
    payload: bytes = b""


def dial(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=IO)


def request(
    sock: socket.socket,
    op: int,
    *,
    worker: int = 0,
    clock: int = 0,
    base: int = 0,
    code: int = 0,
    size: int | None = None,
    payload: bytes = b"",
    magic: bytes = protocol.DATA_MAGIC,
) -> None:
    size = len(payload) if size is None else size
    sock.sendall(protocol.REQUEST.pack(magic, op, code, worker, clock, base, size) + payload)


def send_hello(
    sock: socket.socket,
    plan_hash: str,
    *,
    worker: int = 0,
    token="",
    body: bytes | None = None,
    size: int | None = None,
    key: str = "",
) -> None:
    if body is None:
        proof = Prover(token, f"127.0.0.1:{sock.getpeername()[1]}").prove("hello")
        body = json.dumps({"proof": proof, "plan_hash": plan_hash, **({"key": key} if key else {})}).encode()
    request(sock, protocol.OP_HELLO, worker=worker, size=size, payload=body if size is None else b"")


def read_reply(sock: socket.socket, pull_bytes: int = 0) -> Reply:
    magic, status, outcome, version, next_clock, staleness, size = protocol.recv_struct(sock, protocol.REPLY)
    assert magic == protocol.DATA_MAGIC
    reply = Reply(CODE[status], outcome, version, next_clock, staleness, size)
    if status:
        assert size <= protocol.MAX_ERROR_BYTES
        text = bytearray(size)
        protocol.recv_exact(sock, memoryview(text))
        reply.message = text.decode("utf-8", "replace")
    elif size:
        assert size == pull_bytes, f"{size} payload bytes, expected {pull_bytes}"
        data = bytearray(size)
        protocol.recv_exact(sock, memoryview(data))
        reply.payload = bytes(data)
    return reply


def expect(sock: socket.socket, code: Code, *words: str) -> Reply:
    reply = read_reply(sock)
    assert reply.code == code, reply
    for word in words:
        assert word in reply.message, f"{word!r} not in {reply.message!r}"
    return reply


def assert_closed(sock: socket.socket) -> None:
    """The server closed ``sock`` (EOF or reset), and sent nothing more."""
    sock.settimeout(IO)
    try:
        extra = sock.recv(1 << 16)
    except ConnectionResetError:
        return
    assert extra == b"", f"unexpected bytes after the last reply: {extra[:60]!r}"


def kill_data_connections(server: ShardServer) -> int:
    """Break every data connection of ``server`` from the server's side; returns how many there were."""
    with server.data._lock:
        conns = list(server.data._conns)
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
    return len(conns)


# --- the hostile-input shard -----------------------------------------------------------------------


@dataclass
class Shard:
    core: ShardCore
    server: ShardServer
    initial: bytes  # the weights, which nothing here may change

    @property
    def plan(self) -> PartitionPlan:
        return self.core.plan

    @property
    def port(self) -> int:
        return self.server.data.port

    def key(self, worker: int = 0) -> str:
        """The registration key of ``worker`` (registered with the core directly, as this process's clients)."""
        return self.core.roster.workers[worker].key if 0 <= worker < self.core.num_workers else ""

    def hello(self, worker: int = 0, port: int | None = None) -> socket.socket:
        sock = dial(self.port if port is None else port)
        send_hello(sock, self.plan.hash, worker=worker, key=self.key(worker))
        assert read_reply(sock).code == OK
        return sock

    def state(self) -> tuple:
        return self.core.flat.tobytes(), self.core.version, self.core.round.flat.tobytes()


def valid_gradient(plan: PartitionPlan) -> np.ndarray:
    """The one valid gradient pushed here, as the shard's flat payload (float64, slice order)."""
    return np.random.default_rng(11).standard_normal(sum(s.size for s in plan.slices_for_shard(0)))


def push_valid(shard: Shard, sock: socket.socket) -> Reply:
    g = valid_gradient(shard.plan)
    request(sock, protocol.OP_PUSH, clock=0, payload=g.tobytes())
    reply = read_reply(sock)
    assert reply.code == OK, reply
    assert protocol.OUTCOMES[reply.outcome] in ("accumulated", "duplicate") and reply.next_clock == 1, reply
    return reply


def assert_serves(shard: Shard) -> None:
    """A fresh connection still gets a pull and a valid push; the weights are as they were, and the round
    holds exactly the valid gradient."""
    conn = DataConnection("127.0.0.1", shard.port, 0, shard.plan.hash, timeout=IO, key=shard.key(0))
    try:
        out = bytearray(shard.core.nbytes)
        assert conn.pull(0, [memoryview(out)]) == 0
        assert bytes(out) == shard.initial
        g = valid_gradient(shard.plan)
        reply = conn.push(0, 0, 0, [g], g.nbytes)
        assert reply.outcome in ("accumulated", "duplicate") and (reply.version, reply.next_clock) == (0, 1)
    finally:
        conn.close()
    assert shard.core.flat.tobytes() == shard.initial and shard.core.version == 0
    assert np.array_equal(shard.core.round.flat, valid_gradient(shard.plan))


@pytest.fixture(scope="module")
def hostile(digits64):
    core = build_shard(describe_job(make_job(*HOSTILE_SETS)), 0)
    assert [s.key for s in core.slices.values()] == ["dense0/W#0", "dense0/W#256", "dense0/W#512", "dense0/b#0"]
    core.register(0, core.plan.hash, incarnation=process_incarnation())  # as this process's clients do
    server = ShardServer(core, "127.0.0.1:0", request_timeout=IO).start()
    try:
        yield Shard(core, server, core.flat.tobytes())
    finally:
        server.stop(grace=1.0)


@pytest.fixture
def shard(hostile):
    """The hostile-input shard; after the test it must still serve, with its weights unchanged."""
    yield hostile
    assert_serves(hostile)


@pytest.fixture(scope="module")
def token_port(hostile):
    """A second data server for the same core that wants the token "s3cret"."""
    data = DataServer(hostile.core, token="s3cret", request_timeout=IO, idle_timeout=IO).start()
    try:
        yield data.port
    finally:
        data.stop()


# --- the data path gives the same results as gRPC -----------------------------------------------


def connections(link) -> dict:
    """The data connections (pull, push) of ``link``'s data link over the data port, whatever carries its bytes
    (none over gRPC)."""
    return getattr(getattr(link.data, "tcp", link.data), "_conns", {})


def _sync_run(job, grads, steps: int, transport: str):
    with shards(job) as (job, servers):
        plan = servers[0].core.plan
        clients = [
            PSClient(
                job.cluster.servers,
                plan,
                w,
                deadlines=Deadlines(request_timeout=IO),
                links=Links(transport=transport),
                config=job,
            )
            for w in range(2)
        ]
        try:
            assert [c.register() for c in clients] == [0, 0]
            assert all(link.kind == transport for c in clients for link in c.links)
            assert transport == "grpc" or all(link.data_port for c in clients for link in c.links)
            assert transport != "shm" or all(link.shared for c in clients for link in c.links)

            def loop(w: int) -> list[dict[str, np.ndarray]]:
                host = {s.name: np.full(s.shape, np.nan, dtype=s.dtype) for s in plan.specs}
                seen = []
                for clock in range(steps):
                    clients[w].pull(clock, host)
                    seen.append({k: v.copy() for k, v in host.items()})
                    replies = clients[w].push(clock, grads[w][clock])
                    assert [r.outcome for r in replies] == ["accumulated"] * plan.num_shards
                clients[w].pull(steps, host)
                seen.append({k: v.copy() for k, v in host.items()})
                return seen

            seen = run_threads([lambda w=w: loop(w) for w in range(2)], timeout=60)
            used = {
                any(conn is not None for conn in connections(c.links[k]).values())
                for c in clients
                for k in range(plan.num_shards)
            }
            conns = sum(len(s.data._conns) for s in servers)
            result = {
                "flats": [s.core.flat.copy() for s in servers],
                "versions": [s.core.version for s in servers],
                "seen": seen,
                "used": used,
                "conns": conns,
                "cores": [s.core for s in servers],
            }
        finally:
            for c in clients:
                c.close()
    return result


@pytest.mark.parametrize("go_ahead", [False, True], ids=["one-message-pushes", "pushes-wait-for-go-ahead"])
def test_sync_job_gives_bitwise_the_same_weights_over_shared_memory_the_data_path_and_grpc(monkeypatch, go_ahead):
    if go_ahead:  # every push of this small model waits for READY, as a large model's do
        monkeypatch.setattr(protocol, "GO_AHEAD_BYTES", 1)
    job = make_job(
        "model.name=softmax",
        "train.dtype=float64",
        "optimizer.name=sgd",
        f"optimizer.lr={LR}",
        "cluster.policy=sync",
        "cluster.workers=2",
        "cluster.shards=2",
        "cluster.slice_bytes=1024",
    )
    steps = 3
    specs = PartitionPlan(build_shard(describe_job(job), 0).plan.specs, 2, 1024).specs
    rng = np.random.default_rng(2)
    grads = [[{s.name: rng.standard_normal(s.shape) for s in specs} for _ in range(steps)] for _ in range(2)]
    tcp = _sync_run(job, grads, steps, "tcp")
    rpc = _sync_run(job, grads, steps, "grpc")
    shm = _sync_run(job, grads, steps, "shm")

    assert tcp["used"] == {True} and tcp["conns"] == 8  # a pull and a push connection per worker and shard
    assert shm["used"] == {True} and shm["conns"] == 8  # the same, their bytes through shared memory
    assert rpc["used"] == {False} and rpc["conns"] == 0  # gRPC only
    assert shm["versions"] == tcp["versions"]
    for a, b in zip(shm["flats"], tcp["flats"]):
        assert a.tobytes() == b.tobytes()
    assert sum(len(c.slices) for c in tcp["cores"]) > len(specs)  # tensors were cut
    assert tcp["versions"] == rpc["versions"] == [steps, steps]
    for a, b in zip(tcp["flats"], rpc["flats"]):
        assert a.tobytes() == b.tobytes()
    # every pull, by either worker over any transport, saw bitwise the same weights
    for clock in range(steps + 1):
        views = [run["seen"][w][clock] for run in (tcp, rpc, shm) for w in range(2)]
        for name in views[0]:
            assert all(v[name].tobytes() == views[0][name].tobytes() for v in views[1:]), (clock, name)
    # and they are sync SGD on the mean gradient, step by step
    expected = {k: v.copy() for k, v in tcp["seen"][0][0].items()}
    for clock in range(steps):
        for name in expected:
            expected[name] -= np.multiply((grads[0][clock][name] + grads[1][clock][name]) * 0.5, LR)
            assert expected[name].tobytes() == tcp["seen"][0][clock + 1][name].tobytes(), (clock, name)
    for core, flat in zip(tcp["cores"], tcp["flats"]):
        for i, (a, b) in core.offsets.items():
            sl = core.slices[i]
            assert flat[a:b].tobytes() == expected[sl.var].reshape(-1)[sl.start : sl.stop].tobytes()


# --- gradient compression ----------------------------------------------------------------------


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Finite float32 ``x`` rounded to bfloat16 (nearest, ties to even) and widened back, independently of
    psgd.wire.codec: integer arithmetic on the bit patterns."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.int64)
    low, high = bits & 0xFFFF, bits >> 16
    up = (low > 0x8000) | ((low == 0x8000) & (high & 1 == 1))
    return ((high + up) << 16).astype(np.uint32).view(np.float32).reshape(x.shape)


ROUND = {None: lambda g: g, "float16": lambda g: g.astype(np.float16).astype(np.float32), "bfloat16": bf16_round}
WORKER_FOR = {None: 0, "float16": 1, "bfloat16": 2}  # async: each test pushes as its own worker
LINKS = ("shm", "tcp", "grpc")  # [cluster] transport


@pytest.fixture(scope="module")
def async32():
    job = make_job(
        "model.name=softmax",
        "train.dtype=float32",
        "optimizer.name=sgd",
        f"optimizer.lr={LR}",
        "cluster.policy=async",
        "cluster.workers=4",
        "cluster.shards=2",
        "cluster.slice_bytes=1024",
        "cluster.lease_seconds=600",
        "cluster.join_timeout=600",
    )
    with shards(job) as (job, servers):
        yield job, servers


def _expected(servers, before: list[np.ndarray], grads: dict[str, np.ndarray]) -> list[np.ndarray]:
    out = []
    for server, flat in zip(servers, before):
        flat = flat.copy()
        for i, (a, b) in server.core.offsets.items():
            sl = server.core.slices[i]
            flat[a:b] -= np.multiply(grads[sl.var].reshape(-1)[sl.start : sl.stop], LR / 4)  # async: lr / workers
        out.append(flat)
    return out


def _gradients(plan: PartitionPlan, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    grads = {
        s.name: (rng.standard_normal(s.shape) * 10.0 ** rng.integers(-6, 2, s.shape)).astype(np.float32)
        for s in plan.specs
    }
    first = next(iter(grads.values())).reshape(-1)
    first[:4] = [0.0, -0.0, 1.0, -0.375]  # exact in every format
    return grads


@pytest.mark.parametrize("link", LINKS)
@pytest.mark.parametrize("wire_dtype", [None, "float16", "bfloat16"])
def test_compressed_pushes_apply_the_rounded_gradient_exactly(async32, wire_dtype, link):
    job, servers = async32
    plan = servers[0].core.plan
    grads = _gradients(plan, 5)
    rounded = {k: ROUND[wire_dtype](g) for k, g in grads.items()}
    if wire_dtype:
        assert any(not np.array_equal(rounded[k], grads[k]) for k in grads)  # the format does round
        smallest = 2.0**-14 if wire_dtype == "float16" else 2.0**-126  # below: subnormal, absolute error only
        g, r = (
            np.concatenate([g.reshape(-1) for g in grads.values()]),
            np.concatenate([r.reshape(-1) for r in rounded.values()]),
        )
        normal = np.abs(g) >= smallest
        rel = np.abs(r[normal] - g[normal]) / np.abs(g[normal])
        assert rel.max() <= (2.0**-8 if wire_dtype == "bfloat16" else 2.0**-11)  # half an ulp
        assert np.all(np.abs(r[~normal] - g[~normal]) <= smallest * 2.0**-10)
    with PSClient(
        job.cluster.servers,
        plan,
        WORKER_FOR[wire_dtype],
        deadlines=Deadlines(request_timeout=IO),
        links=Links(transport=link, wire_dtype=wire_dtype or ""),
        config=job,
    ) as client:
        clock = client.register()
        before = [s.core.flat.copy() for s in servers]
        versions = [s.core.version for s in servers]
        received = [s.core.counters["bytes_in"] for s in servers]
        for _ in range(2):  # a second push reuses the client's packing buffers
            replies = client.push(clock, grads)
            assert [r.outcome for r in replies] == ["applied", "applied"]
            expected = _expected(servers, before, rounded)
            for server, want in zip(servers, expected):
                assert server.core.flat.tobytes() == want.tobytes()
            before, clock = expected, clock + 1
        assert [s.core.version for s in servers] == [v + 2 for v in versions]
        itemsize = 2 if wire_dtype else 4  # the shards count the bytes as they came over the wire
        assert [s.core.counters["bytes_in"] - r for s, r in zip(servers, received)] == [
            2 * s.core.flat.size * itemsize for s in servers
        ]
        if link == "tcp":
            assert all(connections(link)["push"] is not None for link in client.links)  # it went over the data path
        host = {s.name: np.empty(s.shape, dtype=s.dtype) for s in plan.specs}
        client.pull(clock, host)
        for server in servers:
            for sl, w in slice_weights(server.core):
                assert host[sl.var].reshape(-1)[sl.start : sl.stop].tobytes() == w.tobytes()


def _poison(servers, grads: dict[str, np.ndarray], bits: int) -> None:
    """Put the float32 bit pattern ``bits`` into one element of every shard's part of ``grads``."""
    for server in servers:
        sl = next(iter(server.core.slices.values()))
        grads[sl.var].reshape(-1).view(np.uint32)[sl.start + 3] = bits


@pytest.mark.parametrize("wire_dtype", [None, "float16", "bfloat16"])
@pytest.mark.parametrize("bits", [0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0x7F800000], ids=hex)
def test_nan_and_inf_gradients_are_refused_whatever_the_wire_dtype(async32, wire_dtype, bits):
    """Compression must not turn a NaN into a number the shard would apply."""
    job, servers = async32
    plan = servers[0].core.plan
    grads = _gradients(plan, 6)
    _poison(servers, grads, bits)
    before = [(s.core.flat.tobytes(), s.core.version) for s in servers]
    with PSClient(
        job.cluster.servers,
        plan,
        3,
        deadlines=Deadlines(request_timeout=IO),
        links=Links(wire_dtype=wire_dtype or ""),
        config=job,
    ) as client:
        clock = client.register()
        with pytest.raises(PSError) as info:
            client.push(clock, grads)
    assert info.value.code == INVALID and "non-finite" in str(info.value), str(info.value)
    assert [(s.core.flat.tobytes(), s.core.version) for s in servers] == before


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_a_float16_overflow_is_refused_not_applied_as_infinity(async32):
    job, servers = async32
    plan = servers[0].core.plan
    grads = _gradients(plan, 7)
    _poison(servers, grads, int(np.array([1.0e5], dtype=np.float32).view(np.uint32)[0]))
    before = [s.core.flat.tobytes() for s in servers]
    with PSClient(
        job.cluster.servers,
        plan,
        3,
        deadlines=Deadlines(request_timeout=IO),
        links=Links(wire_dtype="float16"),
        config=job,
    ) as client:
        clock = client.register()
        with pytest.raises(PSError) as info:
            client.push(clock, grads)
    assert info.value.code == INVALID and "non-finite" in str(info.value)
    assert [s.core.flat.tobytes() for s in servers] == before
    # bfloat16 has float32's range: the same gradient goes through.  (A new client: the failed push may
    # still be running on the other shard when PSClient.push raises.)
    with PSClient(
        job.cluster.servers,
        plan,
        3,
        deadlines=Deadlines(request_timeout=IO),
        links=Links(wire_dtype="bfloat16"),
        config=job,
    ) as client:
        assert client.register() == clock
        assert [r.outcome for r in client.push(clock, grads)] == ["applied", "applied"]


def test_compression_of_float64_variables_is_refused_by_the_client(hostile):
    for wire_dtype in ("float16", "bfloat16"):
        with pytest.raises(PSError, match="needs float32 variables"):
            PSClient(["127.0.0.1:1"], hostile.plan, 0, links=Links(wire_dtype=wire_dtype))
    with pytest.raises(ConfigError, match=re.escape('[cluster] wire_dtype must be "", "float16" or "bfloat16"')):
        Links(wire_dtype="int8")  # refused before any client takes it


# --- timeouts -----------------------------------------------------------------------------------


def test_a_pull_that_waits_out_the_request_timeout_hears_why_from_the_shard(hostile):
    """The shard bounds a waiting pull by the request timeout and then says what it waited for; the
    worker's end waits a little longer than that, so it hears the shard's answer instead of timing out
    on its own at the same moment with nothing to say."""
    job = make_job(*HOSTILE_SETS, "cluster.request_timeout=1")
    server = ShardServer(hostile.core, "127.0.0.1:0", request_timeout=job.cluster.deadlines.request_timeout).start()
    try:
        client = PSClient(
            [server.address],
            hostile.plan,
            0,
            deadlines=Deadlines(request_timeout=job.cluster.deadlines.request_timeout),
            retry_deadline=0.0,
            config=job,
        )
        with client:
            client.register()
            host = {s.name: np.empty(s.shape, dtype=s.dtype) for s in hostile.plan.specs}
            with pytest.raises(PSError) as info:
                client.pull(1, host)  # round 0 never closes: worker 1 never comes
    finally:
        server.stop(grace=1.0)
    assert info.value.code == Code.DEADLINE_EXCEEDED, info.value
    assert "other workers still expected: worker 1" in str(info.value)


# --- reconnects ---------------------------------------------------------------------------------


@pytest.mark.parametrize("link", ["shm", "tcp"])
def test_a_connection_broken_by_the_server_is_reopened_and_the_call_succeeds(async32, link):
    job, servers = async32
    plan = servers[0].core.plan
    grads = _gradients(plan, 8)
    with PSClient(
        job.cluster.servers, plan, 3, deadlines=Deadlines(request_timeout=IO), links=Links(transport=link), config=job
    ) as client:
        clock = client.register()
        host = {s.name: np.empty(s.shape, dtype=s.dtype) for s in plan.specs}
        client.pull(clock, host)
        for step in range(3):
            purpose = "pull" if step % 2 else "push"  # the connection the step's call goes over
            old = [connections(link)[purpose] for link in client.links]
            assert all(kill_data_connections(s) >= 1 for s in servers)
            before = [s.core.flat.copy() for s in servers]
            versions = [s.core.version for s in servers]
            if step % 2:
                client.pull(clock, host)
                for server in servers:
                    for sl, w in slice_weights(server.core):
                        assert host[sl.var].reshape(-1)[sl.start : sl.stop].tobytes() == w.tobytes()
            else:
                assert [r.outcome for r in client.push(clock, grads)] == ["applied", "applied"]
                for server, want in zip(servers, _expected(servers, before, grads)):
                    assert server.core.flat.tobytes() == want.tobytes()
                assert [s.core.version for s in servers] == [v + 1 for v in versions]
                clock += 1
            assert all(
                new is not None and new is not was
                for new, was in zip([connections(link)[purpose] for link in client.links], old)
            )


@pytest.mark.parametrize("link", ["shm", "tcp"])
def test_a_push_whose_reply_is_lost_is_retried_and_applied_once(async32, monkeypatch, link):
    job, servers = async32
    plan = servers[0].core.plan
    grads = _gradients(plan, 9)
    for server in servers:
        real = server.core.push
        calls = []

        def push_then_break(*args, _real=real, _server=server, _calls=calls, **kwargs):
            result = _real(*args, **kwargs)
            _calls.append(result.outcome)
            if len(_calls) == 1:  # applied, but the reply never reaches the worker
                kill_data_connections(_server)
            return result

        monkeypatch.setattr(server.core, "push", push_then_break)
        server.calls = calls
    with PSClient(
        job.cluster.servers, plan, 3, deadlines=Deadlines(request_timeout=IO), links=Links(transport=link), config=job
    ) as client:
        clock = client.register()
        client.pull(clock, {s.name: np.empty(s.shape, dtype=s.dtype) for s in plan.specs})
        before = [s.core.flat.copy() for s in servers]
        versions = [s.core.version for s in servers]
        replies = client.push(clock, grads)
    assert [r.outcome for r in replies] == ["duplicate", "duplicate"]  # the retry, recognized
    assert [r.next_clock for r in replies] == [clock + 1] * 2
    assert [s.calls for s in servers] == [["applied", "duplicate"]] * 2
    assert [s.core.version for s in servers] == [v + 1 for v in versions]
    for server, want in zip(servers, _expected(servers, before, grads)):
        assert server.core.flat.tobytes() == want.tobytes()


# --- hostile peers: the hello -------------------------------------------------------------------


@pytest.mark.parametrize("first", ["pull", "push", "bad-magic", "zero-op", "unknown-op"])
def test_a_connection_must_start_with_a_hello(shard, first):
    sock = dial(shard.port)
    with sock:
        if first == "pull":
            request(sock, protocol.OP_PULL)
        elif first == "push":
            request(sock, protocol.OP_PUSH, size=shard.core.nbytes)  # the header only: nothing is read after it
        elif first == "bad-magic":
            request(sock, protocol.OP_HELLO, magic=b"PSG0", size=0)
        elif first == "zero-op":
            request(sock, 0)
        else:
            request(sock, 200)
        expect(sock, INVALID, "must start with a psgd hello")
        assert_closed(sock)


@pytest.mark.parametrize("junk", [b"", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"PSG1\x01"])
def test_a_peer_that_sends_less_than_a_header_and_hangs_up_is_dropped(shard, junk):
    sock = dial(shard.port)
    with sock:
        sock.sendall(junk)
        sock.shutdown(socket.SHUT_WR)
        assert_closed(sock)


def test_a_valid_hello_is_answered_with_the_version(shard):
    with shard.hello(0) as sock:
        request(sock, protocol.OP_PULL)
        reply = read_reply(sock, shard.core.nbytes)
        assert reply.code == OK and reply.payload == shard.initial and reply.version == 0


@pytest.mark.parametrize("worker", [2, -2, 2**31 - 1, -(2**31)])
def test_a_hello_with_an_out_of_range_worker_is_refused(shard, worker):
    with dial(shard.port) as sock:
        send_hello(sock, shard.plan.hash, worker=worker)
        expect(sock, INVALID, f"worker id {worker}", "out of range")
        assert_closed(sock)


@pytest.mark.parametrize("plan_hash", ["", "0000", "x" * 20_000])
def test_a_hello_with_another_plan_is_refused(shard, plan_hash):
    with dial(shard.port) as sock:
        send_hello(sock, plan_hash)
        reply = expect(sock, PRECONDITION, "partition plan")
        assert shard.plan.hash not in reply.message  # a peer that does not know the job learns nothing of it
        assert len(reply.message.encode()) <= protocol.MAX_ERROR_BYTES
        assert_closed(sock)


@pytest.mark.parametrize("size", [protocol.MAX_HELLO_BYTES + 1, 1 << 30, 2**63, 2**64 - 1])
def test_an_oversized_hello_is_refused_without_allocating_it(shard, size):
    tracemalloc.start()
    try:
        with dial(shard.port) as sock:
            send_hello(sock, shard.plan.hash, size=size)
            expect(sock, INVALID, "must start with a psgd hello")
            assert_closed(sock)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak} bytes allocated for a hello declaring {size}"


def test_a_hello_of_exactly_the_largest_size_is_read(shard):
    empty = json.dumps({"plan_hash": shard.plan.hash, "key": shard.key(0), "pad": ""}).encode()
    body = json.dumps(
        {"plan_hash": shard.plan.hash, "key": shard.key(0), "pad": "x" * (protocol.MAX_HELLO_BYTES - len(empty))}
    ).encode()
    assert len(body) == protocol.MAX_HELLO_BYTES
    with dial(shard.port) as sock:
        send_hello(sock, shard.plan.hash, body=body)
        assert read_reply(sock).code == OK


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"\xff\xfe{}",
        b"[]",
        b"null",
        b'"token"',
        b"12",
        b"[" * 60_000,
        b"{" * 30_000,
        b'{"plan_hash": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
    ],
    ids=[
        "empty",
        "open-brace",
        "not-utf8",
        "list",
        "null",
        "string",
        "number",
        "deep-list",
        "deep-object",
        "deep-hash",
    ],
)
def test_a_hello_that_is_not_a_json_object_is_refused(shard, body):
    with dial(shard.port) as sock:
        send_hello(sock, shard.plan.hash, body=body)
        expect(sock, INVALID, "not a JSON object")
        assert_closed(sock)


@pytest.mark.parametrize(
    "hello",
    [
        {"plan_hash": "HASH"},
        {"proof": "", "plan_hash": "HASH"},
        {"proof": "wrong", "plan_hash": "HASH"},
        {"token": "s3cret", "plan_hash": "HASH"},
        {"proof": "s3cret", "plan_hash": "HASH"},
        {"proof": "ANOTHER", "plan_hash": "HASH"},
        {"proof": "ELSEWHERE", "plan_hash": "HASH"},
        {"proof": None, "plan_hash": "HASH"},
        {"proof": 123, "plan_hash": "HASH"},
        {"proof": "\ud800", "plan_hash": "HASH"},
        {"proof": "wrong", "plan_hash": "another plan"},
    ],
    ids=lambda h: repr(h.get("proof", h.get("token", "(none)"))) + ("" if h["plan_hash"] == "HASH" else "+plan"),
)
def test_a_hello_without_a_right_proof_of_the_token_is_unauthenticated(shard, token_port, hello):
    """Neither the token itself nor a proof made with another token or for another address opens a connection."""
    made = {
        "ANOTHER": Prover("another", f"127.0.0.1:{token_port}").prove("hello"),
        "ELSEWHERE": Prover("s3cret", f"127.0.0.1:{token_port + 1}").prove("hello"),
    }
    body = json.dumps({k: (shard.plan.hash if v == "HASH" else made.get(v, v)) for k, v in hello.items()}).encode()
    with dial(token_port) as sock:
        send_hello(sock, shard.plan.hash, body=body)
        reply = expect(sock, UNAUTHENTICATED, "token")
        assert shard.plan.hash not in reply.message  # nothing about the job to a stranger
        assert_closed(sock)


def test_the_right_token_opens_the_connection(shard, token_port):
    conn = DataConnection("127.0.0.1", token_port, 0, shard.plan.hash, token="s3cret", timeout=IO, key=shard.key(0))
    try:
        out = bytearray(shard.core.nbytes)
        conn.pull(0, [memoryview(out)])
        assert bytes(out) == shard.initial
    finally:
        conn.close()
    with pytest.raises(LinkError) as info:
        DataConnection("127.0.0.1", token_port, 0, shard.plan.hash, token="nope", timeout=IO)
    assert info.value.code == UNAUTHENTICATED
    with pytest.raises(LinkError) as info:
        DataConnection("127.0.0.1", token_port, 0, "0000", token="s3cret", timeout=IO)
    assert info.value.code == PRECONDITION


def test_a_refused_hello_leaves_no_socket_open_on_the_worker(shard, token_port):
    codes = []
    gc.collect()  # sockets other tests left to the collector are not this test's business
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for token, plan_hash in (("nope", shard.plan.hash), ("s3cret", "0000")):
            try:
                DataConnection("127.0.0.1", token_port, 0, plan_hash, token=token, timeout=IO)
            except LinkError as exc:
                codes.append(exc.code)
        gc.collect()
    assert codes == [UNAUTHENTICATED, PRECONDITION]
    leaked = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not [m for m in leaked if f"raddr=('127.0.0.1', {token_port})" in m], leaked


def test_a_second_hello_on_a_connection_is_refused(shard):
    with shard.hello(0) as sock:
        send_hello(sock, shard.plan.hash, size=0)
        expect(sock, INVALID, "not a psgd data request")
        assert_closed(sock)


# --- hostile peers: requests ----------------------------------------------------------------------


def _nbytes(shard: Shard, itemsize: int) -> int:
    return shard.core.flat.size * itemsize


FATAL_PUSHES = {
    # name: (dtype code, declared bytes (from a shard), words)
    "one-value-too-many": (0, lambda s: _nbytes(s, 8) + 8, ["push of 5208 bytes", "expects 5200", "wrong shape"]),
    "one-byte-short": (0, lambda s: _nbytes(s, 8) - 1, ["push of 5199 bytes", "expects 5200"]),
    "empty": (0, lambda s: 0, ["push of 0 bytes"]),
    "huge": (0, lambda s: 2**64 - 1, [f"push of {2**64 - 1} bytes"]),
    "float64-code-short": (2, lambda s: _nbytes(s, 4), ["expects 5200"]),
    "float32-code": (1, lambda s: _nbytes(s, 4), ["wire dtype code 1", "float64"]),
    "float16-code": (3, lambda s: _nbytes(s, 2), ["float16 on the wire", "needs float32 variables", "float64"]),
    "bfloat16-code": (4, lambda s: _nbytes(s, 2), ["bfloat16 on the wire", "needs float32 variables"]),
    "unknown-code": (5, lambda s: _nbytes(s, 8), ["wire dtype code 5"]),
    "code-255": (255, lambda s: _nbytes(s, 8), ["wire dtype code 255"]),
}


@pytest.mark.parametrize("case", list(FATAL_PUSHES))
def test_a_push_of_the_wrong_size_or_dtype_is_refused_and_the_connection_closed(shard, case):
    """The payload cannot be skipped safely (its size is the sender's word), so the connection ends after
    the error; only the header is sent, so the error reply is never lost to a reset."""
    code, size, words = FATAL_PUSHES[case]
    before = shard.state()
    with shard.hello(0) as sock:
        request(sock, protocol.OP_PUSH, code=code, size=size(shard))
        expect(sock, INVALID, *words)
        assert_closed(sock)
    assert shard.state() == before


def test_a_push_with_a_wrong_size_and_its_payload_does_not_hurt_the_server(shard):
    """A peer that sends the payload anyway may see the error or a reset; either way nothing changes."""
    before = shard.state()
    with shard.hello(0) as sock:
        payload = np.ones(shard.core.flat.size + 1).tobytes()
        with contextlib.suppress(ConnectionError):
            request(sock, protocol.OP_PUSH, payload=payload)
            try:
                expect(sock, INVALID, "wrong shape")
            except protocol.WireError:
                pass
    assert shard.state() == before


def test_float64_named_explicitly_is_the_variables_own_dtype(shard):
    with shard.hello(0) as sock:
        g = valid_gradient(shard.plan)
        request(sock, protocol.OP_PUSH, code=2, payload=g.tobytes())
        reply = read_reply(sock)
        assert reply.code == OK and protocol.OUTCOMES[reply.outcome] in ("accumulated", "duplicate")


def _with_value(shard: Shard, index: int, value: float) -> bytes:
    g = valid_gradient(shard.plan).copy()
    g[index] = value
    return g.tobytes()


RECOVERABLE = {
    # name: (hello worker, request fields, code, words)
    "nan": (
        0,
        lambda s: dict(payload=_with_value(s, 300, np.nan)),
        INVALID,
        ["dense0/W#256", "1 non-finite", "NaN/Inf"],
    ),
    "inf": (0, lambda s: dict(payload=_with_value(s, 649, np.inf)), INVALID, ["dense0/b#0", "non-finite"]),
    "minus-inf": (0, lambda s: dict(payload=_with_value(s, 0, -np.inf)), INVALID, ["dense0/W#0", "non-finite"]),
    "clock-from-the-future": (0, lambda s: dict(clock=1), PRECONDITION, ["clock 1", "from the future"]),
    "huge-clock": (0, lambda s: dict(clock=2**62), PRECONDITION, ["from the future"]),
    "largest-clock": (0, lambda s: dict(clock=2**63 - 1), INVALID, ["too large"]),
    "negative-clock": (0, lambda s: dict(clock=-1), INVALID, ["clock (-1)", ">= 0"]),
    "negative-base-version": (0, lambda s: dict(base=-3), INVALID, ["base version (-3)"]),
    "base-version-ahead": (0, lambda s: dict(base=4), INVALID, ["base version 4", "ahead"]),
    "unregistered-worker": (1, lambda s: {}, PRECONDITION, ["worker 1 is not registered", "register"]),
    "header-names-another-worker": (1, lambda s: dict(worker=0), PRECONDITION, ["worker 1 is not registered"]),
    "observer": (-1, lambda s: {}, INVALID, ["worker id -1", "out of range"]),
}


@pytest.mark.parametrize("case", list(RECOVERABLE))
def test_a_refused_push_leaves_the_connection_usable(shard, case):
    """Refusals of a well-formed push are answered, and the same connection carries on."""
    worker, fields, code, words = RECOVERABLE[case]
    fields = fields(shard)
    payload = fields.pop("payload", valid_gradient(shard.plan).tobytes())
    before = shard.state()
    with shard.hello(worker) as sock:
        request(sock, protocol.OP_PUSH, payload=payload, **fields)
        expect(sock, code, *words)
        assert shard.state() == before
        request(sock, protocol.OP_PUSH, payload=payload, **fields)  # again: the same answer
        expect(sock, code, *words)
        request(sock, protocol.OP_PULL)  # a pull on the same connection
        reply = read_reply(sock, shard.core.nbytes)
        if worker == 1:
            assert reply.code == PRECONDITION
        else:
            assert reply.code == OK and reply.payload == shard.initial
    if worker == 0:  # and a valid push on a connection that saw the refusal
        with shard.hello(0) as sock:
            request(sock, protocol.OP_PUSH, payload=payload, **fields)
            expect(sock, code)
            push_valid(shard, sock)
    assert shard.state()[:2] == before[:2]


def test_a_large_push_gets_the_go_ahead_before_its_payload_is_read(shard, monkeypatch):
    monkeypatch.setattr(protocol, "GO_AHEAD_BYTES", 1)  # the hostile shard's pushes count as large
    before = shard.state()
    g = valid_gradient(shard.plan)
    with shard.hello(0) as sock:
        request(sock, protocol.OP_PUSH, clock=0, size=g.nbytes)  # the header alone
        ready = read_reply(sock)
        assert (ready.code, ready.outcome, ready.size) == (OK, protocol.READY, 0)
        assert shard.state() == before  # nothing happens until the payload is there
        sock.sendall(g.tobytes())
        reply = read_reply(sock)
        assert reply.code == OK and protocol.OUTCOMES[reply.outcome] in ("accumulated", "duplicate"), reply
        # a client may also send the payload without waiting: READY comes, then the outcome
        request(sock, protocol.OP_PUSH, clock=0, payload=g.tobytes())
        assert read_reply(sock).outcome == protocol.READY
        assert protocol.OUTCOMES[read_reply(sock).outcome] == "duplicate"


def test_a_refused_large_push_header_is_answered_before_any_payload(shard, monkeypatch):
    """A push of the wrong size is refused on its header: the error comes instead of READY."""
    monkeypatch.setattr(protocol, "GO_AHEAD_BYTES", 1)
    before = shard.state()
    with shard.hello(0) as sock:
        request(sock, protocol.OP_PUSH, clock=0, size=shard.core.nbytes + 8)
        reply = expect(sock, INVALID, "wrong shape")
        assert reply.outcome != protocol.READY
        assert_closed(sock)
    assert shard.state() == before


def test_the_client_gives_up_on_a_shard_that_answers_a_push_header_with_something_else(monkeypatch):
    """A peer that answers a large push's header with an outcome instead of READY broke the protocol."""
    monkeypatch.setattr(protocol, "GO_AHEAD_BYTES", 1)
    listener = socket.create_server(("127.0.0.1", 0))

    def fake_shard():
        conn, _ = listener.accept()
        with conn:
            size = protocol.recv_struct(conn, protocol.REQUEST)[-1]
            protocol.recv_exact(conn, memoryview(bytearray(size)))  # the hello's body
            conn.sendall(protocol.REPLY.pack(protocol.DATA_MAGIC, 0, 0, 0, 0, 0, 0))
            protocol.recv_struct(conn, protocol.REQUEST)  # the push header
            conn.sendall(protocol.REPLY.pack(protocol.DATA_MAGIC, 0, 0, 1, 1, 0, 0))  # "applied", not READY
            conn.recv(1)  # until the client hangs up

    with listener, concurrent.futures.ThreadPoolExecutor(1) as pool:
        served = pool.submit(fake_shard)
        conn = DataConnection("127.0.0.1", listener.getsockname()[1], 0, "plan", timeout=IO)
        try:
            g = np.zeros(4)
            with pytest.raises(protocol.WireError, match="without its go-ahead"):
                conn.push(0, 0, 0, [g], g.nbytes)
        finally:
            conn.close()
        served.result(timeout=IO)


@pytest.mark.parametrize(
    "clock, code, words", [(-1, INVALID, ["clock -1", "negative"]), (-(2**63), INVALID, ["negative"])]
)
def test_a_bad_pull_is_answered_and_the_connection_goes_on(shard, clock, code, words):
    with shard.hello(0) as sock:
        request(sock, protocol.OP_PULL, clock=clock)
        expect(sock, code, *words)
        request(sock, protocol.OP_PULL, clock=0)
        assert read_reply(sock, shard.core.nbytes).payload == shard.initial


def test_a_pull_with_a_payload_is_refused_and_the_connection_closed(shard):
    with shard.hello(0) as sock:
        request(sock, protocol.OP_PULL, size=8)
        expect(sock, INVALID, "a pull carries no payload")
        assert_closed(sock)


def test_truncated_pushes_release_their_buffers(shard):
    """More truncated pushes than the shard has receive buffers: each one's buffer comes back."""
    before = shard.state()
    payload = valid_gradient(shard.plan).tobytes()
    for cut in (1, 100, len(payload) // 2, len(payload) - 1, len(payload) - 8):
        with shard.hello(0) as sock:
            request(sock, protocol.OP_PUSH, size=len(payload), payload=payload[:cut])
            sock.shutdown(socket.SHUT_WR)
            assert_closed(sock)
    assert shard.state() == before
    pool = shard.server.data.receive_buffers
    wait_for(lambda: len(pool._free) == pool._made, IO, "every receive buffer back in the pool")


def test_a_silent_or_stalled_peer_is_dropped_after_the_timeouts(hostile):
    shard = hostile
    data = DataServer(shard.core, request_timeout=0.3, idle_timeout=0.6, hello_timeout=0.3).start()
    try:
        started = time.monotonic()
        with (
            dial(data.port) as silent,
            shard.hello(0, port=data.port) as idle,
            shard.hello(0, port=data.port) as stalled,
        ):
            request(stalled, protocol.OP_PUSH, size=shard.core.nbytes, payload=b"\0" * 100)
            expect(silent, Code.DEADLINE_EXCEEDED, "no hello within 0.3 s")  # told why, then closed
            expect(stalled, Code.DEADLINE_EXCEEDED, "did not arrive within 0.3s", "at least 1 MB/s")
            for sock in (silent, stalled, idle):
                assert_closed(sock)
            assert time.monotonic() - started < 3.0
        pool = data.receive_buffers
        wait_for(lambda: len(pool._free) == pool._made, IO, "the stalled push's buffer back in the pool")
        wait_for(lambda: not data._conns, IO, "the connections to be forgotten")
    finally:
        data.stop()
    assert_serves(shard)


def test_trickled_pushes_cannot_hold_the_receive_buffers(hostile, monkeypatch):
    """The data port has 2 receive buffers; a connection sending a push a byte at a time kept one for good,
    unregistered ones included, and after two a real worker failed with RESOURCE_EXHAUSTED."""
    monkeypatch.setattr(datapath, "TRANSFER_GRACE", 1.0)
    shard = hostile
    data = DataServer(shard.core, request_timeout=IO, idle_timeout=IO).start()
    g = valid_gradient(shard.plan).tobytes()
    try:
        with (
            shard.hello(1, port=data.port) as a,
            shard.hello(1, port=data.port) as b,
            shard.hello(0, port=data.port) as trickle,
            shard.hello(0, port=data.port) as real,
        ):
            for sock in (a, b):  # worker 1 is not registered: it takes no buffer
                request(sock, protocol.OP_PUSH, size=len(g), payload=g[:1])
            began = time.monotonic()
            reply = push_valid(shard, real)  # served at once, not after the request timeout
            assert time.monotonic() - began < IO / 2, reply
            request(trickle, protocol.OP_PUSH, size=len(g), payload=g[:1])  # registered: cut off by its deadline
            expect(trickle, Code.DEADLINE_EXCEEDED, "did not arrive within 1.0s", "at least 1 MB/s")
            assert time.monotonic() - began < IO
            for sock in (a, b):
                expect(sock, Code.DEADLINE_EXCEEDED, "refused push", "did not arrive")
        pool = data.receive_buffers
        wait_for(lambda: len(pool._free) == pool._made, IO, "every receive buffer back in the pool")
    finally:
        data.stop()
    assert_serves(shard)


def test_connections_beyond_the_limit_are_closed_and_the_others_keep_working(hostile):
    shard = hostile
    data = DataServer(shard.core, request_timeout=IO, idle_timeout=IO, max_connections=3).start()
    socks = []
    try:
        for _ in range(10):  # peers that reset before their hello do not keep a slot
            with dial(data.port) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        wait_for(lambda: not data._conns, IO, "the reset connections to be forgotten")
        for _ in range(3):
            socks.append(shard.hello(-1, port=data.port))
        wait_for(lambda: len(data._conns) == 3, IO, "three connections")
        extra = [dial(data.port) for _ in range(3)]
        for sock in extra:  # the limit counts served connections: one more hello is refused, saying why
            send_hello(sock, shard.plan.hash, worker=-1)
            expect(sock, Code.UNAVAILABLE, "already serves 3 data connections")
            assert_closed(sock)
            sock.close()
        with pytest.raises(LinkError, match="already serves 3 data connections") as info:
            DataConnection("127.0.0.1", data.port, -1, shard.plan.hash, timeout=IO)
        assert info.value.code == Code.UNAVAILABLE  # retried by the client, like a lost connection
        for sock in socks:
            request(sock, protocol.OP_PULL)
            assert read_reply(sock, shard.core.nbytes).payload == shard.initial
        socks.pop().close()
        wait_for(lambda: len(data._conns) == 2, IO, "a connection to be freed")
        socks.append(shard.hello(-1, port=data.port))  # there is room again
        request(socks[-1], protocol.OP_PULL)
        assert read_reply(socks[-1], shard.core.nbytes).payload == shard.initial
    finally:
        for sock in socks:
            sock.close()
        data.stop()
    assert_serves(shard)


def test_many_concurrent_connections_get_whole_snapshots(shard):
    def puller(n: int) -> int:
        with shard.hello(-1) as sock:
            for _ in range(n):
                request(sock, protocol.OP_PULL)
                assert read_reply(sock, shard.core.nbytes).payload == shard.initial
        return n

    assert run_threads([lambda: puller(20) for _ in range(6)], timeout=30) == [20] * 6


# --- hostile peers: random bytes --------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_shard(digits64):
    """An async shard (pulls never wait) served by a bare data server."""
    core = build_shard(describe_job(make_job(*HOSTILE_SETS, "cluster.policy=async")), 0)
    core.register(0, core.plan.hash)
    data = DataServer(core, request_timeout=IO, idle_timeout=IO).start()
    try:
        yield core, data
    finally:
        data.stop()


INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)


@st.composite
def sessions(draw, plan_hash: str) -> bytes:
    """Random bytes, often framed like the protocol.  They carry at most ~2.5 KB in all, less than the
    5200 bytes of any push this shard applies, so none can change the weights."""
    parts = []
    if draw(st.booleans()):
        body = json.dumps({"plan_hash": plan_hash}).encode()
        parts.append(
            protocol.REQUEST.pack(
                protocol.DATA_MAGIC, protocol.OP_HELLO, 0, draw(st.sampled_from([-1, 0, 1, 2])), 0, 0, len(body)
            )
            + body
        )
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.integers(0, 3)) == 0:
            parts.append(draw(st.binary(max_size=200)))
            continue
        magic = draw(st.sampled_from([protocol.DATA_MAGIC, protocol.DATA_MAGIC, b"PSG0", b"\0\0\0\0"]))
        op = draw(
            st.one_of(st.sampled_from([protocol.OP_PULL, protocol.OP_PUSH, protocol.OP_HELLO]), st.integers(0, 255))
        )
        code = draw(st.one_of(st.integers(0, 5), st.integers(0, 255)))
        size = draw(
            st.one_of(
                st.sampled_from([0, 8, 2600, 1300, 5200, 5199, 5201, protocol.MAX_HELLO_BYTES + 1]),
                st.integers(0, 2**64 - 1),
            )
        )
        payload = draw(st.binary(max_size=400))
        parts.append(
            protocol.REQUEST.pack(
                magic,
                op,
                code,
                draw(st.one_of(st.integers(-2, 2), INT32)),
                draw(st.one_of(st.integers(-2, 2), INT64)),
                draw(st.one_of(st.integers(-1, 1), INT64)),
                size,
            )
            + payload
        )
    return b"".join(parts)


@settings(
    max_examples=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_random_bytes_get_answers_or_a_closed_connection_never_a_change(fuzz_shard, data):
    core, server = fuzz_shard
    blob = data.draw(sessions(core.plan.hash), label="bytes")
    before = (core.flat.tobytes(), core.version)
    with dial(server.port) as sock:
        with contextlib.suppress(OSError):  # the server may hang up before it has read everything
            sock.sendall(blob)
            sock.shutdown(socket.SHUT_WR)
        received = bytearray()
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 16):  # until the server hangs up; the timeout bounds it
                received += chunk
    # whatever came back is whole replies
    at = 0
    while at + protocol.REPLY.size <= len(received):
        magic, status, _, _, _, _, size = protocol.REPLY.unpack_from(received, at)
        assert magic == protocol.DATA_MAGIC
        assert CODE[status] in (OK, INVALID, PRECONDITION, Code.PERMISSION_DENIED), (
            CODE[status],
            bytes(received[at + 40 : at + 200]),
        )  # (a hello as worker 0 without its key)
        assert size in (0, core.nbytes) if status == 0 else size <= protocol.MAX_ERROR_BYTES
        at += protocol.REPLY.size + size
    assert at == len(received) or len(received) - at < protocol.REPLY.size  # a reset may cut the last one
    assert (core.flat.tobytes(), core.version) == before
    conn = DataConnection("127.0.0.1", server.port, 0, core.plan.hash, timeout=IO, key=core.roster.workers[0].key)
    try:
        out = bytearray(core.nbytes)
        conn.pull(0, [memoryview(out)])
        assert bytes(out) == before[0]
    finally:
        conn.close()
