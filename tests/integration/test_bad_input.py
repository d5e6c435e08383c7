"""A real in-process gRPC shard fed bad input: every refusal has the right status code, a readable
message, and leaves the weights exactly as they were; the server stays up and healthy throughout.

The job is softmax regression on digits in float64 with 2 workers and one
shard, cut by 2048-byte slices into dense0/W#0, dense0/W#256, dense0/W#512
and dense0/b#0.  Worker 0 registers in the fixture; worker 1 never does
(unless a test registers it), so the sync round never closes by accident.
Every RPC carries a timeout, so nothing here can hang.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psgd.config import JobConfig
from psgd.data import datasets
from psgd.job import describe_job
from psgd.partition import PartitionPlan
from psgd.proto import ps_pb2, ps_pb2_grpc
from psgd.server import build_shard
from psgd.server.net.service import ShardServer
from psgd.server.state.core import MAX_CLOCK, ShardCore
from psgd.wire.channel import MAX_MESSAGE_BYTES, SERVICE_NAME
from psgd.worker.client import fetch_weights

RPC_TIMEOUT = 5.0  # seconds; every call here is answered in milliseconds
LR = 0.1
JOB_SETS = [
    "model.name=softmax",
    "cluster.workers=2",
    "cluster.shards=1",
    "train.dtype=float64",
    "optimizer.name=sgd",
    f"optimizer.lr={LR}",
    "cluster.slice_bytes=2048",
]
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)

PROPERTY = settings(
    max_examples=80,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def make_job(*extra: str) -> JobConfig:
    job = JobConfig()
    job = job.apply_sets(JOB_SETS + list(extra))
    return job


@pytest.fixture(scope="module")
def digits():
    return datasets.load_dataset("digits", dtype="float64")


@dataclass
class Shard:
    core: ShardCore
    server: ShardServer
    stub: ps_pb2_grpc.ParameterServerStub
    health: health_pb2_grpc.HealthStub
    channel: grpc.Channel
    keys: dict = field(default_factory=dict)  # each registered worker's registration key

    @property
    def plan(self) -> PartitionPlan:
        return self.core.plan

    @property
    def addresses(self) -> list[str]:
        return [self.server.address]

    def weights(self) -> dict[str, np.ndarray]:
        return fetch_weights(self.addresses, self.plan, request_timeout=RPC_TIMEOUT)

    def register(self, worker: int, clock: int = 0) -> ps_pb2.RegisterReply:
        reply = self.stub.Register(
            ps_pb2.RegisterRequest(
                worker_id=worker,
                plan_hash=self.plan.hash,
                plan_json=json.dumps(self.plan.description()),
                hostname="test",
                pid=1,
                job_json=json.dumps(self.core.identity),
                clock=clock,
            ),
            timeout=RPC_TIMEOUT,
        )
        self.keys[worker] = reply.registration
        return reply

    def push(self, messages: list[ps_pb2.PushMessage]) -> ps_pb2.PushReply:
        """The push, its header given the registration key of the worker it names (as a worker's client does)."""
        messages = list(messages)
        if messages and messages[0].WhichOneof("kind") == "header" and not messages[0].header.registration:
            messages[0].header.registration = self.keys.get(messages[0].header.worker_id, "")
        return self.stub.Push(iter(messages), timeout=RPC_TIMEOUT)

    def status(self) -> ps_pb2.StatusReply:
        return self.stub.Status(ps_pb2.StatusRequest(), timeout=RPC_TIMEOUT)


def start_shard(digits, *sets: str) -> Shard:
    core = build_shard(describe_job(make_job(*sets)), 0)
    server = ShardServer(core, "127.0.0.1:0").start()
    channel = grpc.insecure_channel(server.address)  # default options: it may send more than the server takes
    return Shard(core, server, ps_pb2_grpc.ParameterServerStub(channel), health_pb2_grpc.HealthStub(channel), channel)


def stop_shard(shard: Shard) -> None:
    shard.channel.close()
    shard.server.stop(grace=1.0)


@pytest.fixture
def shard(digits):
    """A sync shard with worker 0 registered and worker 1 not."""
    s = start_shard(digits)
    s.register(0)
    yield s
    stop_shard(s)


@pytest.fixture
def async_shard(digits):
    s = start_shard(digits, "cluster.policy=async")
    s.register(0)
    yield s
    stop_shard(s)


# --- building pushes ------------------------------------------------------------------------


def gradient(plan: PartitionPlan, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {s.name: rng.standard_normal(s.shape) for s in plan.specs}


def header(worker: int = 0, clock: int = 0, base_version: int = 0, dtype: str = "float64") -> ps_pb2.PushMessage:
    return ps_pb2.PushMessage(
        header=ps_pb2.PushHeader(worker_id=worker, clock=clock, base_version=base_version, dtype=dtype)
    )


def chunk(slice_id: int, offset: int, data: bytes) -> ps_pb2.PushMessage:
    return ps_pb2.PushMessage(chunk=ps_pb2.TensorChunk(slice_id=slice_id, offset=offset, data=data))


def slice_payloads(plan: PartitionPlan, grads: dict[str, np.ndarray]) -> list[tuple[int, bytes]]:
    """(slice id, bytes) for every slice of shard 0, in plan order."""
    flat = {name: np.ascontiguousarray(g, dtype=np.float64).reshape(-1) for name, g in grads.items()}
    return [(s.id, flat[s.var][s.start : s.stop].tobytes()) for s in plan.slices_for_shard(0)]


def valid_push(plan: PartitionPlan, grads=None, **head) -> list[ps_pb2.PushMessage]:
    grads = gradient(plan) if grads is None else grads
    return [header(**head)] + [chunk(i, 0, data) for i, data in slice_payloads(plan, grads)]


def refused(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args)
    return info.value


def assert_unchanged(shard: Shard, before: dict[str, np.ndarray]) -> None:
    after = shard.weights()
    assert set(after) == set(before)
    for name in before:
        assert np.array_equal(after[name], before[name]), f"{name} changed"
    assert shard.status().version == 0


def assert_healthy(shard: Shard) -> None:
    for service in ("", SERVICE_NAME):
        reply = shard.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert shard.status().shard == 0


# --- the baseline: what the bad inputs below differ from is accepted ---------------------------


def test_a_valid_push_is_accepted_and_a_round_applies_the_mean(shard):
    plan = shard.plan
    assert [s.key for s in plan.slices] == ["dense0/W#0", "dense0/W#256", "dense0/W#512", "dense0/b#0"]
    before = shard.weights()
    g0, g1 = gradient(plan, 1), gradient(plan, 2)
    reply = shard.push(valid_push(plan, g0))
    assert (reply.outcome, reply.next_clock, reply.version) == ("accumulated", 1, 0)
    assert_unchanged(shard, before)  # the round waits for worker 1
    assert shard.register(1).clock == 0
    reply = shard.push(valid_push(plan, g1, worker=1))
    assert (reply.outcome, reply.version) == ("accumulated", 1)
    after = shard.weights()
    for name in before:
        np.testing.assert_allclose(after[name], before[name] - LR * (g0[name] + g1[name]) / 2, rtol=1e-12)


def test_health_reports_serving_while_up(shard):
    assert_healthy(shard)


# --- bad pushes ---------------------------------------------------------------------------------


def _payload_with(plan: PartitionPlan, slice_index: int, element: int, value: float) -> list[ps_pb2.PushMessage]:
    payloads = slice_payloads(plan, gradient(plan))
    sid, data = payloads[slice_index]
    values = np.frombuffer(data, dtype=np.float64).copy()
    values[element] = value
    payloads[slice_index] = (sid, values.tobytes())
    return [header()] + [chunk(i, 0, d) for i, d in payloads]


def _resized(plan: PartitionPlan, slice_index: int, delta: int) -> list[ps_pb2.PushMessage]:
    payloads = slice_payloads(plan, gradient(plan))
    sid, data = payloads[slice_index]
    payloads[slice_index] = (sid, data + b"\x01" * delta if delta > 0 else data[:delta])
    return [header()] + [chunk(i, 0, d) for i, d in payloads]


def _with_header(plan: PartitionPlan, **head) -> list[ps_pb2.PushMessage]:
    return valid_push(plan, **head)


BAD_PUSHES = {
    # name: (messages from the plan, code, words the message must contain)
    "too-many-bytes": (
        lambda p: _resized(p, 3, 8),
        "INVALID_ARGUMENT",
        ["dense0/b#0", "holds 80 bytes", "88", "wrong shape"],
    ),
    "one-byte-too-many": (lambda p: _resized(p, 0, 1), "INVALID_ARGUMENT", ["dense0/W#0", "holds 2048 bytes"]),
    "too-few-bytes": (
        lambda p: _resized(p, 3, -8),
        "INVALID_ARGUMENT",
        ["incomplete push", "dense0/b#0 (72 of 80 bytes)"],
    ),
    "slice-missing": (lambda p: valid_push(p)[:-1], "INVALID_ARGUMENT", ["incomplete push", "dense0/b#0 (0 of 80"]),
    "float32-dtype": (
        lambda p: _with_header(p, dtype="float32"),
        "INVALID_ARGUMENT",
        ["dtype", "'float32'", "'float64'", "same dtype"],
    ),
    "no-dtype": (lambda p: _with_header(p, dtype=""), "INVALID_ARGUMENT", ["dtype", "(none)", "'float64'"]),
    "nan": (
        lambda p: _payload_with(p, 1, 7, math.nan),
        "INVALID_ARGUMENT",
        ["dense0/W#256", "worker 0", "1 non-finite", "NaN/Inf"],
    ),
    "inf": (lambda p: _payload_with(p, 3, 0, math.inf), "INVALID_ARGUMENT", ["dense0/b#0", "non-finite"]),
    "minus-inf": (lambda p: _payload_with(p, 0, 255, -math.inf), "INVALID_ARGUMENT", ["dense0/W#0", "non-finite"]),
    "unknown-slice": (
        lambda p: valid_push(p) + [chunk(4, 0, b"\0" * 8)],
        "NOT_FOUND",
        ["slice 4", "not held by this shard", "partition plan"],
    ),
    "huge-slice-id": (lambda p: [header(), chunk(2**32 - 1, 0, b"")], "NOT_FOUND", [f"slice {2**32 - 1}"]),
    "out-of-order": (
        lambda p: [header(), chunk(0, 8, b"\0" * 8)],
        "INVALID_ARGUMENT",
        ["dense0/W#0", "chunk at byte 8, expected 0", "in order"],
    ),
    "slice-sent-twice": (
        lambda p: valid_push(p) + [valid_push(p)[1]],
        "INVALID_ARGUMENT",
        ["chunk at byte 0, expected 2048"],
    ),
    "worker-out-of-range": (
        lambda p: _with_header(p, worker=2),
        "INVALID_ARGUMENT",
        ["worker id 2", "out of range", "ids 0..1"],
    ),
    "negative-worker": (lambda p: _with_header(p, worker=-1), "INVALID_ARGUMENT", ["worker id -1", "out of range"]),
    "huge-worker": (lambda p: _with_header(p, worker=2**31 - 1), "INVALID_ARGUMENT", ["out of range"]),
    "no-header": (lambda p: valid_push(p)[1:], "INVALID_ARGUMENT", ["must start with a header"]),
    "empty-stream": (lambda p: [], "INVALID_ARGUMENT", ["must start with a header"]),
    "empty-message": (lambda p: [ps_pb2.PushMessage()], "INVALID_ARGUMENT", ["must start with a header"]),
    "two-headers": (lambda p: valid_push(p) + [header()], "INVALID_ARGUMENT", ["exactly one header"]),
    "two-headers-first": (lambda p: [header()] + valid_push(p), "INVALID_ARGUMENT", ["exactly one header"]),
    "negative-clock": (lambda p: _with_header(p, clock=-1), "INVALID_ARGUMENT", ["clock (-1)", ">= 0"]),
    "most-negative-clock": (lambda p: _with_header(p, clock=-(2**63)), "INVALID_ARGUMENT", [">= 0"]),
    "negative-base-version": (
        lambda p: _with_header(p, base_version=-5),
        "INVALID_ARGUMENT",
        ["base version (-5)", ">= 0"],
    ),
    "base-version-ahead": (
        lambda p: _with_header(p, base_version=3),
        "INVALID_ARGUMENT",
        ["base version 3", "ahead", "version 0"],
    ),
    "clock-from-the-future": (
        lambda p: _with_header(p, clock=1),
        "FAILED_PRECONDITION",
        ["clock 1", "from the future", "round 0 is open"],
    ),
    "huge-clock-sync": (lambda p: _with_header(p, clock=2**62), "FAILED_PRECONDITION", ["from the future"]),
    "largest-clock": (lambda p: _with_header(p, clock=2**63 - 1), "INVALID_ARGUMENT", ["too large"]),
    "unregistered-worker": (
        lambda p: _with_header(p, worker=1),
        "FAILED_PRECONDITION",
        ["worker 1 is not registered", "pending", "register"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_PUSHES))
def test_a_bad_push_is_refused_and_changes_nothing(shard, case):
    build, code, words = BAD_PUSHES[case]
    before = shard.weights()
    err = refused(shard.push, build(shard.plan))
    assert err.code() == getattr(grpc.StatusCode, code), err.details()
    for word in words:
        assert word in err.details(), f"{word!r} not in {err.details()!r}"
    assert_unchanged(shard, before)
    assert_healthy(shard)
    # the refusal left no trace in the protocol state: the valid push for clock 0 is still accepted
    assert shard.push(valid_push(shard.plan)).outcome == "accumulated"


def test_an_oversized_message_is_refused_by_grpc_and_the_server_stays_healthy(shard):
    before = shard.weights()
    big = [header(), chunk(0, 0, b"\0" * (MAX_MESSAGE_BYTES + 1))]
    err = refused(shard.push, big)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    assert "larger than max" in err.details() or "exceeds" in err.details().lower()
    assert_unchanged(shard, before)
    assert_healthy(shard)
    big_register = ps_pb2.RegisterRequest(worker_id=0, plan_hash="x", plan_json=" " * (MAX_MESSAGE_BYTES + 1))
    assert refused(shard.stub.Register, big_register, RPC_TIMEOUT).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_healthy(shard)
    assert shard.push(valid_push(shard.plan)).outcome == "accumulated"


# --- bad pulls, registrations, heartbeats ----------------------------------------------------------


def pull(shard: Shard, worker: int, clock: int, timeout: float = RPC_TIMEOUT) -> list[ps_pb2.TensorChunk]:
    return list(
        shard.stub.Pull(
            ps_pb2.PullRequest(worker_id=worker, clock=clock, registration=shard.keys.get(worker, "")), timeout=timeout
        )
    )


@pytest.mark.parametrize(
    "worker,clock,code,words",
    [
        (1, 0, "FAILED_PRECONDITION", ["worker 1 is not registered", "pending", "register"]),
        (2, 0, "INVALID_ARGUMENT", ["worker id 2", "out of range"]),
        (-2, 0, "INVALID_ARGUMENT", ["worker id -2", "out of range"]),
        (0, -1, "INVALID_ARGUMENT", ["clock -1", "negative"]),
    ],
)
def test_a_bad_pull_is_refused(shard, worker, clock, code, words):
    before = shard.weights()
    err = refused(pull, shard, worker, clock)
    assert err.code() == getattr(grpc.StatusCode, code), err.details()
    for word in words:
        assert word in err.details()
    assert_unchanged(shard, before)


def test_a_pull_for_a_round_that_cannot_close_ends_at_its_deadline(shard):
    err = refused(pull, shard, 0, 1, 0.5)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # usually the shard answers first, just inside the deadline, saying whom it waited for
    if "waited" in err.details():
        assert "worker 1 at clock 0" in err.details()
    assert_healthy(shard)


def test_heartbeat_and_done_from_a_stranger_are_refused(shard):
    err = refused(shard.stub.Heartbeat, ps_pb2.HeartbeatRequest(worker_id=1, clock=0), RPC_TIMEOUT)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "not registered" in err.details()
    err = refused(shard.stub.Heartbeat, ps_pb2.HeartbeatRequest(worker_id=7, clock=0), RPC_TIMEOUT)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in err.details()
    err = refused(shard.stub.Done, ps_pb2.DoneRequest(worker_id=-1, clock=0), RPC_TIMEOUT)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in err.details()


def test_register_with_another_plan_is_refused_with_the_difference(shard, digits):
    before = shard.weights()
    other = PartitionPlan(shard.plan.specs, 1, 1024)
    request = ps_pb2.RegisterRequest(worker_id=1, plan_hash=other.hash, plan_json=json.dumps(other.description()))
    err = refused(shard.stub.Register, request, RPC_TIMEOUT)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert other.hash in err.details() and shard.plan.hash in err.details()
    assert "slice_bytes: worker 1024 vs server 2048" in err.details() and "same job file" in err.details()

    mlp = build_shard(describe_job(make_job("model.name=mlp")), 0).plan
    request = ps_pb2.RegisterRequest(worker_id=1, plan_hash=mlp.hash, plan_json=json.dumps(mlp.description()))
    err = refused(shard.stub.Register, request, RPC_TIMEOUT)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "variables only the worker has" in err.details()

    for plan_json in ("", "{", '{"variables": [[]]}', '{"variables": [{}]}', "[" * 5000 + "]" * 5000):
        request = ps_pb2.RegisterRequest(worker_id=1, plan_hash="0000", plan_json=plan_json)
        err = refused(shard.stub.Register, request, RPC_TIMEOUT)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
        assert "'0000'" in err.details()
    request = ps_pb2.RegisterRequest(worker_id=5, plan_hash=shard.plan.hash)
    assert refused(shard.stub.Register, request, RPC_TIMEOUT).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [w.state for w in shard.status().workers] == ["live", "pending"]
    assert_unchanged(shard, before)
    assert_healthy(shard)


def test_messages_echoing_huge_or_odd_input_stay_readable(shard):
    """Refusals quote what the request sent; the status details must still reach the client (gRPC drops
    trailers over 8-16 KiB with a RESOURCE_EXHAUSTED that hides the real code) and be valid UTF-8."""
    before = shard.weights()
    for dtype in ("x" * 20_000, "\u20ac" * 3000):
        err = refused(shard.push, [header(dtype=dtype)])
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert err.details().startswith("gradient dtype") and "more characters" in err.details()
        assert len(err.details().encode()) <= 6000

    request = ps_pb2.RegisterRequest(worker_id=1, plan_hash="h" * 100_000)
    err = refused(shard.stub.Register, request, RPC_TIMEOUT)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "more characters" in err.details()

    many = {
        "num_shards": 1,
        "slice_bytes": 2048,
        "variables": [[f"block{i}/conv/W", [3, 3, 64, 64], "float64"] for i in range(3000)],
    }
    request = ps_pb2.RegisterRequest(worker_id=1, plan_hash="abc", plan_json=json.dumps(many))
    err = refused(shard.stub.Register, request, RPC_TIMEOUT)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    assert "variables only the worker has: block0/conv/W" in err.details()

    request = ps_pb2.RegisterRequest(
        worker_id=1, plan_hash="abc", plan_json='{"variables": [["\\ud800", [1], "float64"]]}'
    )
    err = refused(shard.stub.Register, request, RPC_TIMEOUT)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "variables only the worker has: \\ud800" in err.details() and "same job file" in err.details()
    assert_unchanged(shard, before)
    assert_healthy(shard)


def test_async_push_clocks_stop_where_the_next_clock_no_longer_fits_int64(async_shard):
    """Async applies a push at the worker's clock; the largest int64 clock would leave a next clock (2**63) that
    no reply and no Status can carry, so it is refused, even from a worker that is there already."""
    shard = async_shard
    shard.register(1, clock=MAX_CLOCK)  # first seen at that clock (the shard started again without a checkpoint)
    before = shard.weights()
    err = refused(shard.push, valid_push(shard.plan, clock=2**63 - 1, worker=1))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "too large" in err.details()
    assert_unchanged(shard, before)
    assert_healthy(shard)
    reply = shard.push(valid_push(shard.plan, clock=MAX_CLOCK, worker=1))
    assert (reply.outcome, reply.next_clock, reply.version) == ("applied", 2**63 - 1, 1)
    assert shard.status().workers[1].clock == 2**63 - 1
    assert_healthy(shard)


# --- random streams ------------------------------------------------------------------------------

SLICE_IDS = st.one_of(st.integers(0, 5), st.integers(0, 2**32 - 1))
OFFSETS = st.one_of(st.sampled_from([0, 1, 8, 80, 1024, 2048]), st.integers(0, 2**64 - 1))
DTYPES = st.one_of(
    st.sampled_from(["float64", "float32", "", "<f8", "f8", "float64 ", "FLOAT64", "int64"]), st.text(max_size=12)
)
WORKERS = st.one_of(st.integers(-2, 3), st.integers(*INT32))
CLOCKS = st.one_of(st.integers(-2, 3), st.integers(*INT64))


@st.composite
def junk_streams(draw) -> list[ps_pb2.PushMessage]:
    """Random headers and chunks.  At most seven chunks of at most 300 bytes carry far fewer than the 5200
    bytes a push must cover, so no such stream is a valid push."""
    messages = []
    for _ in range(draw(st.integers(0, 7))):
        if draw(st.integers(0, 4)) == 0:
            messages.append(header(draw(WORKERS), draw(CLOCKS), draw(CLOCKS), draw(DTYPES)))
        else:
            messages.append(chunk(draw(SLICE_IDS), draw(OFFSETS), draw(st.binary(max_size=300))))
    if draw(st.booleans()):
        messages.insert(
            0,
            header(
                draw(st.integers(-1, 2)),
                draw(st.integers(-1, 2)),
                draw(st.integers(-1, 2)),
                draw(st.sampled_from(["float64", "float32"])),
            ),
        )
    return messages[:7]


MUTATIONS = (
    "nan",
    "truncate",
    "extend",
    "drop",
    "repeat",
    "slice_id",
    "offset",
    "dtype",
    "worker",
    "clock",
    "base_version",
    "no_header",
    "extra_header",
)


@st.composite
def mutated_pushes(draw, plan: PartitionPlan) -> tuple[list[ps_pb2.PushMessage], str, str]:
    """A valid push with exactly one thing wrong; returns (messages, mutation, expected status code)."""
    grads = gradient(plan, draw(st.integers(0, 3)))
    payloads = [(sid, bytearray(data)) for sid, data in slice_payloads(plan, grads)]
    head = {"worker": 0, "clock": 0, "base_version": 0, "dtype": "float64"}
    mutation = draw(st.sampled_from(MUTATIONS))
    k = draw(st.integers(0, len(payloads) - 1))
    code = "INVALID_ARGUMENT"
    extra_header_at = None
    if mutation == "nan":
        values = np.frombuffer(bytes(payloads[k][1]), dtype=np.float64).copy()
        values[draw(st.integers(0, len(values) - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        payloads[k] = (payloads[k][0], bytearray(values.tobytes()))
    elif mutation == "truncate":
        cut = draw(st.integers(1, len(payloads[k][1])))
        payloads[k] = (payloads[k][0], payloads[k][1][:-cut])
    elif mutation == "extend":
        payloads[k] = (payloads[k][0], payloads[k][1] + draw(st.binary(min_size=1, max_size=64)))
    elif mutation == "drop":
        del payloads[k]
    elif mutation == "repeat":
        payloads.insert(draw(st.integers(k + 1, len(payloads))), payloads[k])
    elif mutation == "slice_id":
        payloads[k] = (draw(st.integers(len(plan.slices), 2**32 - 1)), payloads[k][1])
        code = "NOT_FOUND"
    elif mutation == "dtype":
        head["dtype"] = draw(DTYPES.filter(lambda d: d != "float64"))
    elif mutation == "worker":
        head["worker"] = draw(WORKERS.filter(lambda w: w != 0))
        code = "FAILED_PRECONDITION" if head["worker"] == 1 else "INVALID_ARGUMENT"
    elif mutation == "clock":
        head["clock"] = draw(CLOCKS.filter(lambda c: c != 0))
        # sync: a clock > 0 is from the future; one that leaves no next clock in int64 is malformed
        code = "FAILED_PRECONDITION" if 0 < head["clock"] <= MAX_CLOCK else "INVALID_ARGUMENT"
    elif mutation == "base_version":
        head["base_version"] = draw(CLOCKS.filter(lambda c: c != 0))  # negative, or ahead of version 0
    elif mutation == "extra_header":
        extra_header_at = draw(st.integers(1, len(payloads) + 1))
    offsets = [0] * len(payloads)
    if mutation == "offset":
        offsets[k] = draw(OFFSETS.filter(lambda o: o != 0))
    messages = [chunk(sid, off, bytes(data)) for (sid, data), off in zip(payloads, offsets)]
    if mutation != "no_header":
        messages.insert(0, header(**head))
    if extra_header_at is not None:
        messages.insert(extra_header_at, header(**head))
    return messages, mutation, code


ALLOWED_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}


def _check_after_refusal(shard: Shard, initial: dict[int, bytes], err: grpc.RpcError) -> None:
    assert err.code() in ALLOWED_REFUSALS, (err.code(), err.details())
    assert err.details() and "Exception" not in err.details()
    assert {i: w.tobytes() for i, w in shard.core.weights.items()} == initial
    status = shard.status()  # the server is up and answers
    assert status.version == 0


@pytest.mark.slow
@PROPERTY
@given(data=st.data())
def test_random_push_streams_get_a_status_and_never_change_the_weights(shard, data):
    if not hasattr(shard, "initial"):
        shard.initial = {i: w.tobytes() for i, w in shard.core.weights.items()}
        shard.reference = shard.weights()
    if data.draw(st.booleans(), label="mutated"):
        messages, mutation, code = data.draw(mutated_pushes(shard.plan), label="push")
        err = refused(shard.push, messages)
        assert err.code() == getattr(grpc.StatusCode, code), (mutation, err.details())
    else:
        messages = data.draw(junk_streams(), label="push")
        err = refused(shard.push, messages)
    _check_after_refusal(shard, shard.initial, err)
    after = shard.weights()
    assert all(np.array_equal(after[k], shard.reference[k]) for k in after)


@PROPERTY
@given(
    worker=WORKERS,
    plan_hash=st.text(max_size=20),
    plan_json=st.one_of(
        st.text(max_size=60),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=8),
            lambda inner: (
                st.lists(inner, max_size=4)
                | st.dictionaries(st.sampled_from(["num_shards", "slice_bytes", "variables", "x"]), inner, max_size=4)
            ),
            max_leaves=12,
        ).map(json.dumps),
    ),
)
def test_random_registrations_are_refused_with_a_reason(shard, worker, plan_hash, plan_json):
    request = ps_pb2.RegisterRequest(worker_id=worker, plan_hash=plan_hash, plan_json=plan_json)
    try:
        reply = shard.stub.Register(request, timeout=RPC_TIMEOUT)
    except grpc.RpcError as err:
        expected = grpc.StatusCode.INVALID_ARGUMENT if not 0 <= worker < 2 else grpc.StatusCode.FAILED_PRECONDITION
        assert err.code() == expected, err.details()
        assert ("out of range" if expected == grpc.StatusCode.INVALID_ARGUMENT else "same job file") in err.details()
    else:  # only with the right hash, which random text does not hit
        assert plan_hash == shard.plan.hash and reply.worker_id == worker
    assert shard.status().version == 0


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(worker=WORKERS, clock=CLOCKS)
def test_random_pulls_get_an_answer_or_a_status(shard, worker, clock):
    if worker == -1 or (worker == 0 and clock == 0):
        expected = None  # an observer never waits; round 0 is open
    elif not 0 <= worker < 2 or clock < 0:
        expected = grpc.StatusCode.INVALID_ARGUMENT
    elif worker == 1:
        expected = grpc.StatusCode.FAILED_PRECONDITION  # never registered
    else:
        expected = grpc.StatusCode.DEADLINE_EXCEEDED  # round `clock - 1` cannot close without worker 1
    try:
        chunks = pull(shard, worker, clock, 0.3 if expected == grpc.StatusCode.DEADLINE_EXCEEDED else RPC_TIMEOUT)
    except grpc.RpcError as err:
        assert err.code() == expected, (worker, clock, err.details())
    else:
        assert expected is None, (worker, clock)
        assert sum(len(c.data) for c in chunks) == sum(s.nbytes for s in shard.plan.slices)
    assert shard.status().version == 0
