"""The NCCL id rendezvous (file and tcp, ranks as threads and as processes) and the
GPU-free parts of the nccl backend, driven with fakes: no CuPy, no GPU needed."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
from helpers import Mirror, free_port

from psgd.collective import nccl as nccl_backend
from psgd.collective.base import CollectiveError
from psgd.collective.nccl import NcclCollective, _call_with_deadline, _nccl_dtype, _nccl_op, _wait
from psgd.collective.rendezvous import RendezvousError, exchange
from psgd.compute import backend

ID = list(range(-64, 64))  # the shape of an NCCL unique id: 128 signed chars
NCCL_ID = bytes(range(100, 228))  # what CuPy 14's nccl.get_unique_id() returns: 128 bytes


@pytest.fixture(params=["file", "tcp"])
def spec(request, tmp_path):
    if request.param == "file":
        return f"file:{tmp_path / 'nccl-id.json'}"
    return f"tcp:127.0.0.1:{free_port()}"


def run_ranks(calls, timeout: float = 10.0) -> list:
    """Run each callable in a thread; return its result or the exception it raised, in order."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(fn) for fn in calls]
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result(timeout=timeout))
            except concurrent.futures.TimeoutError:
                pytest.fail(f"a rank was still running after {timeout}s")
            except Exception as exc:
                outcomes.append(exc)
        return outcomes


def rank_call(spec, rank, world, timeout=5.0, ident=ID, delay=0.0):
    def call():
        time.sleep(delay)  # the case under test: a rank that arrives late
        return exchange(spec, rank, world, lambda: list(ident), timeout)

    return call


# ---------------------------------------------------------------- rendezvous


def test_every_rank_gets_rank0s_id(spec, tmp_path):
    outcomes = run_ranks([rank_call(spec, r, 4) for r in range(4)])
    assert outcomes == [ID] * 4
    assert list(tmp_path.iterdir()) == []  # file form: the id and the acks are cleaned up


def test_other_ranks_wait_for_a_late_rank0(spec):
    began = time.monotonic()
    outcomes = run_ranks([rank_call(spec, 0, 3, delay=0.4), rank_call(spec, 1, 3), rank_call(spec, 2, 3)])
    assert outcomes == [ID] * 3
    assert time.monotonic() - began >= 0.4


def test_a_rank_waiting_for_a_rank0_that_never_comes_times_out_helpfully(spec):
    began = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        exchange(spec, 1, 2, lambda: ID, timeout=0.8)
    elapsed = time.monotonic() - began
    assert 0.7 <= elapsed < 3.0
    text = str(info.value)
    assert spec in text and "rank 0" in text and "0.8 s" in text and "check" in text


def test_rank0_names_the_ranks_that_never_came(spec):
    outcomes = run_ranks([rank_call(spec, 0, 4, timeout=0.8), rank_call(spec, 2, 4, timeout=0.8)])
    assert isinstance(outcomes[0], RendezvousError) and outcomes[1] == ID
    assert "rank(s) 1, 3 of 4" in str(outcomes[0])


def test_world_size_1_needs_nobody(spec, tmp_path):
    assert exchange(spec, 0, 1, lambda: bytes([1, 2, 255]), timeout=0.5) == [1, 2, 255]
    assert list(tmp_path.iterdir()) == []


def test_file_world_size_mismatch(tmp_path):
    spec = f"file:{tmp_path / 'id.json'}"
    rank0, rank1 = run_ranks([rank_call(spec, 0, 2, timeout=0.8), rank_call(spec, 1, 3, timeout=0.8)])
    assert isinstance(rank1, RendezvousError)
    assert "group of 2 ranks" in str(rank1) and "group of 3" in str(rank1) and "stale" in str(rank1)
    assert isinstance(rank0, RendezvousError) and "rank(s) 1 of 2" in str(rank0)


def test_tcp_world_size_mismatch_is_refused_at_once():
    spec = f"tcp:127.0.0.1:{free_port()}"
    began = time.monotonic()
    box: dict = {}

    def client():
        try:
            exchange(spec, 1, 3, lambda: ID, timeout=5.0)
        except RendezvousError as exc:
            box["error"], box["after"] = exc, time.monotonic() - began

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    with pytest.raises(RendezvousError) as info:
        exchange(spec, 0, 2, lambda: ID, timeout=1.0)
    thread.join(5.0)
    assert "refused rank 1" in str(box["error"]) and "same number of workers" in str(box["error"])
    assert box["after"] < 0.9  # the client did not sit out its own 5 s timeout
    assert "rank(s) 1 of 2 never came" in str(info.value) and "refused" in str(info.value)


@pytest.mark.parametrize(
    "bad",
    ["", "nccl", "http://host:80", "file:", "tcp:host", "tcp:host:0", "tcp::29500", "tcp:host:99999", "tcp:host:port"],
)
def test_bad_spec_is_refused(bad):
    with pytest.raises(RendezvousError) as info:
        exchange(bad, 1, 2, lambda: ID, timeout=0.5)
    text = str(info.value)
    assert "tcp:HOST:PORT" in text
    if not bad.startswith("tcp:"):
        assert "file:PATH" in text


@pytest.mark.parametrize("rank, world, timeout", [(2, 2, 1.0), (-1, 2, 1.0), (0, 0, 1.0), (0, 2, 0), (True, 2, 1.0)])
def test_bad_arguments_are_refused(tmp_path, rank, world, timeout):
    with pytest.raises(RendezvousError):
        exchange(f"file:{tmp_path / 'id'}", rank, world, lambda: ID, timeout)


def test_an_id_that_is_not_ints_is_refused(spec):
    with pytest.raises(RendezvousError, match="id must be"):
        exchange(spec, 0, 2, lambda: "not an id", timeout=0.5)


def _raw_request(port: int, payload: dict) -> dict:
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as s:
        data = json.dumps(payload).encode()
        s.sendall(struct.pack("!I", len(data)) + data)
        (n,) = struct.unpack("!I", s.recv(4, socket.MSG_WAITALL))
        return json.loads(s.recv(n, socket.MSG_WAITALL))


def test_tcp_refuses_duplicate_and_out_of_range_ranks():
    port = free_port()
    spec = f"tcp:127.0.0.1:{port}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        server = pool.submit(exchange, spec, 0, 3, lambda: ID, 5.0)
        assert exchange(spec, 1, 3, lambda: None, timeout=5.0) == ID
        with pytest.raises(RendezvousError, match="two processes were started as rank 1"):
            exchange(spec, 1, 3, lambda: None, timeout=5.0)
        assert "out of range" in _raw_request(port, {"rank": 7, "world_size": 3})["error"]
        assert "two processes were started as rank 0" in _raw_request(port, {"rank": 0, "world_size": 3})["error"]
        assert "integer rank" in _raw_request(port, {"hello": 1})["error"]
        assert exchange(spec, 2, 3, lambda: None, timeout=5.0) == ID
        assert server.result(timeout=5.0) == ID


def test_tcp_rank0_says_when_the_port_is_taken():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(RendezvousError, match="cannot listen on 127.0.0.1"):
            exchange(f"tcp:127.0.0.1:{port}", 0, 2, lambda: ID, timeout=0.5)


def test_tcp_client_rejects_a_stranger_on_the_port():
    with socket.socket() as stranger:
        stranger.bind(("127.0.0.1", 0))
        stranger.listen(4)
        port = stranger.getsockname()[1]

        def answer_garbage():
            conn, _ = stranger.accept()
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        threading.Thread(target=answer_garbage, daemon=True).start()
        with pytest.raises(RendezvousError, match="could not get the id"):
            exchange(f"tcp:127.0.0.1:{port}", 1, 2, lambda: ID, timeout=0.6)


def test_rank0_replaces_a_stale_file_from_another_run(tmp_path):
    path = tmp_path / "id.json"
    path.write_text(json.dumps({"world_size": 5, "id": [9] * 128}))
    (tmp_path / "id.json.ack-1").write_text("{}")  # a stale ack must not count as rank 1's
    spec = f"file:{path}"
    # rank 1 starts first and sees the stale file (wrong world size): it must keep waiting, not fail
    outcomes = run_ranks([rank_call(spec, 0, 2, delay=0.3), rank_call(spec, 1, 2)])
    assert outcomes == [ID, ID]
    assert list(tmp_path.iterdir()) == []


def test_a_partly_written_file_is_waited_out(tmp_path):
    path = tmp_path / "id.json"
    path.write_text('{"world_size": 2, "id": [1, 2')  # a non-atomic writer, caught mid-write
    with pytest.raises(RendezvousError, match="unreadable"):
        exchange(f"file:{path}", 1, 2, lambda: ID, timeout=0.3)


def test_file_rank0_says_when_it_cannot_write(tmp_path):
    with pytest.raises(RendezvousError, match="directory exists"):
        exchange(f"file:{tmp_path / 'missing' / 'id.json'}", 0, 2, lambda: ID, timeout=0.5)


CHILD = """
import json, sys
from psgd.collective.rendezvous import exchange
spec, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
print(json.dumps(exchange(spec, rank, world, lambda: list(range(-64, 64)), 15.0)))
"""


def test_ranks_as_processes(spec):
    world = 3
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    procs = []
    try:
        for rank in [2, 1, 0]:  # rank 0 last: the others must wait for it
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", CHILD, spec, str(rank), str(world)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
        results = [p.communicate(timeout=20) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert json.loads(out) == ID


# ---------------------------------------------------------------- nccl backend: pure helpers

FAKE_NCCL_CONSTANTS = dict(
    NCCL_SUM=0, NCCL_MAX=2, NCCL_MIN=3, NCCL_INT32=2, NCCL_INT64=4, NCCL_FLOAT16=6, NCCL_FLOAT32=7, NCCL_FLOAT64=8
)


def test_nccl_dtypes_and_ops_map_to_the_bindings_constants():
    fake = types.SimpleNamespace(**FAKE_NCCL_CONSTANTS)
    assert [_nccl_dtype(np.dtype(d), fake) for d in ["float16", "float32", "float64", "int32", "int64"]] == [
        6,
        7,
        8,
        2,
        4,
    ]
    assert _nccl_dtype(np.float32, fake) == 7
    assert [_nccl_op(op, fake) for op in ["sum", "max", "min"]] == [0, 2, 3]


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int8", "complex64", ">f4", "U3"])
def test_unsupported_dtypes_are_refused(dtype):
    with pytest.raises(CollectiveError, match="cannot reduce .* use one of float16, float32"):
        _nccl_dtype(np.dtype(dtype), types.SimpleNamespace(**FAKE_NCCL_CONSTANTS))


def test_unknown_reduction_is_refused():
    with pytest.raises(CollectiveError, match="unknown reduction 'prod'"):
        _nccl_op("prod", types.SimpleNamespace(**FAKE_NCCL_CONSTANTS))


def test_wait_returns_once_done():
    polls = iter([False, False, False, True])
    aborted = []
    _wait(lambda: next(polls), 5.0, lambda: aborted.append(1))
    assert not aborted


def test_wait_calls_on_timeout_and_raises_for_a_stream_that_never_finishes():
    aborted = []

    def on_timeout():
        aborted.append(time.monotonic())
        raise CollectiveError("rank 3: all-reduce of 4 bytes did not complete within 0.2 s")

    began = time.monotonic()
    with pytest.raises(CollectiveError, match="did not complete within 0.2 s"):
        _wait(lambda: False, 0.2, on_timeout)
    assert len(aborted) == 1 and 0.19 <= aborted[0] - began < 1.0


def test_wait_raises_even_when_on_timeout_does_not():
    with pytest.raises(CollectiveError, match="did not complete within"):
        _wait(lambda: False, 0.05, lambda: None)


def test_wait_with_a_fake_clock_backs_off_and_never_oversleeps():
    now = [0.0]
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        now[0] += s

    with pytest.raises(CollectiveError):
        _wait(lambda: False, 0.01, lambda: None, clock=lambda: now[0], sleep=sleep)
    assert sleeps[1] > sleeps[0] and max(sleeps) <= 1e-3
    assert sum(sleeps) == pytest.approx(0.01)


def test_wait_lets_errors_from_done_through():
    def broken():
        raise RuntimeError("NCCL_ERROR_REMOTE")

    with pytest.raises(RuntimeError, match="REMOTE"):
        _wait(broken, 1.0, lambda: None)


def test_call_with_deadline():
    assert _call_with_deadline(lambda: 42, 1.0, lambda: None) == 42
    with pytest.raises(ValueError, match="boom"):
        _call_with_deadline(lambda: (_ for _ in ()).throw(ValueError("boom")), 1.0, lambda: None)
    release = threading.Event()
    called = []
    with pytest.raises(CollectiveError, match="did not complete"):
        _call_with_deadline(lambda: release.wait(5.0), 0.1, lambda: called.append(1))
    release.set()
    assert called == [1]


# ---------------------------------------------------------------- nccl backend with fake bindings


class FakeArray:
    """Enough of a CuPy array for the backend: host data, a pointer, a device id."""

    def __init__(self, host, device_id=0):
        self.host = np.asarray(host)
        self.dtype, self.shape = self.host.dtype, self.host.shape
        self.size, self.nbytes = self.host.size, self.host.nbytes
        self.flags = self.host.flags
        self.data = types.SimpleNamespace(ptr=self.host.ctypes.data)
        self.device = types.SimpleNamespace(id=device_id)

    def __getitem__(self, key):
        return FakeArray(self.host[key])


class FakeCudaRuntimeError(RuntimeError):
    def __init__(self, status):
        super().__init__(f"cudaErrorIllegalAddress: an illegal memory access was encountered (status {status})")
        self.status = status


class FakeStream:
    """A stream as CuPy 14 has it: ``done`` is ``streamQuery(ptr) == 0``, so it never raises."""

    def __init__(self):
        self.status, self.ptr = 0, 1234  # 0 success, 600 cudaErrorNotReady, anything else an error
        self.queries, self.once = 0, []  # once: answers given before status, first one first

    def query(self, ptr):
        assert ptr == self.ptr
        self.queries += 1
        return self.once.pop(0) if self.once else self.status

    @property
    def done(self):
        return self.query(self.ptr) == 0


class FakeComm:
    instances: list = []

    def __init__(self, ndev, comm_id, rank):
        if not isinstance(comm_id, bytes):  # CuPy 14: NcclCommunicator(int ndev, bytes commId, int rank)
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(comm_id).__name__})")
        self.args, self.calls, self.aborted, self.destroyed, self.async_error = (ndev, comm_id, rank), [], 0, 0, None
        FakeComm.instances.append(self)

    def allReduce(self, send, recv, count, datatype, op, stream):
        self.calls.append(("allReduce", send, recv, count, datatype, op, stream))

    def bcast(self, buf, count, datatype, root, stream):
        self.calls.append(("bcast", buf, count, datatype, root, stream))

    def check_async_error(self):
        self.async_checks = getattr(self, "async_checks", 0) + 1
        if self.async_error is not None:
            raise self.async_error

    def abort(self):
        self.aborted += 1

    def destroy(self):
        self.destroyed += 1


class FakeDevice:
    is_gpu, index = True, 0

    def __init__(self, stream):
        self.used, self.current, self.entered = 0, 0, []  # current: the thread's current device, as CuPy has it
        runtime = types.SimpleNamespace(
            streamQuery=stream.query, CUDARuntimeError=FakeCudaRuntimeError, getDevice=lambda: self.current
        )
        cuda = types.SimpleNamespace(
            Device=self._device, get_current_stream=lambda: self._stream(stream), runtime=runtime
        )
        self.xp = types.SimpleNamespace(cuda=cuda)

    @contextlib.contextmanager
    def _device(self, index):  # cupy.cuda.Device(index) as a context: current inside, the previous one after
        previous, self.current = self.current, index
        self.entered.append(index)
        try:
            yield
        finally:
            self.current = previous

    def _stream(self, stream):
        assert self.current == self.index, "the stream is looked up on another device than the rank's"
        return stream

    def use(self):
        self.used += 1

    def asarray(self, a):
        return FakeArray(np.array(a))

    def __str__(self):
        return "cuda:0"


@pytest.fixture
def fake_gpu(monkeypatch):
    """Patch the nccl backend onto fake bindings and a fake device; returns (stream, device)."""
    FakeComm.instances = []
    fake = types.SimpleNamespace(**FAKE_NCCL_CONSTANTS, NcclCommunicator=FakeComm, get_unique_id=lambda: NCCL_ID)
    stream = FakeStream()
    device = FakeDevice(stream)
    monkeypatch.setattr(nccl_backend, "nccl_module", lambda: fake)
    monkeypatch.setattr(nccl_backend, "get_device", lambda d: device)
    monkeypatch.setattr(nccl_backend, "is_device_array", lambda a: isinstance(a, FakeArray))
    monkeypatch.setattr(nccl_backend, "to_host", lambda a: a.host.copy())
    return stream, device


def make_group(tmp_path, timeout=5.0):
    return NcclCollective(0, 1, "cuda:0", rendezvous=f"file:{tmp_path / 'id.json'}", timeout=timeout)


def test_nccl_collective_drives_the_bindings(fake_gpu, tmp_path):
    stream, device = fake_gpu
    group = make_group(tmp_path)
    comm = FakeComm.instances[0]
    assert comm.args == (1, NCCL_ID, 0) and device.used == 1 and group.backend == "nccl"
    a = FakeArray(np.arange(6, dtype=np.float32))
    assert group.allreduce_(a, op="max") is a
    assert comm.calls[-1] == ("allReduce", a.data.ptr, a.data.ptr, 6, 7, 2, stream.ptr)
    b = FakeArray(np.arange(3, dtype=np.int64))
    assert group.broadcast_(b, root=0) is b
    assert comm.calls[-1] == ("bcast", b.data.ptr, 3, 4, 0, stream.ptr)
    group.barrier()
    assert comm.calls[-1][0] == "allReduce" and comm.calls[-1][3:6] == (1, 2, 2)  # 1 int32, max
    group.check_agreement("plan", "the plan")
    assert comm.calls[-1][3:6] == (2, 4, 2)  # the digest: 2 int64, max
    group.allreduce_(FakeArray(np.zeros(0, np.float32)))  # nothing to reduce: no NCCL call
    assert comm.calls[-1][3:6] == (2, 4, 2)
    group.close()
    group.close()
    assert comm.destroyed == 1 and comm.aborted == 0
    with pytest.raises(CollectiveError, match="closed"):
        group.barrier()
    assert list(tmp_path.iterdir()) == []


def test_nccl_collective_refuses_what_it_cannot_reduce(fake_gpu, tmp_path):
    group = make_group(tmp_path)
    with pytest.raises(CollectiveError, match="needs device \\(CuPy\\) arrays .* numpy.ndarray"):
        group.allreduce_(np.zeros(3, np.float32))
    with pytest.raises(CollectiveError, match="cannot reduce uint8"):
        group.allreduce_(FakeArray(np.zeros(3, np.uint8)))
    with pytest.raises(CollectiveError, match="on cuda:1"):
        group.allreduce_(FakeArray(np.zeros(3, np.float32), device_id=1))
    with pytest.raises(CollectiveError, match="contiguous"):
        group.allreduce_(FakeArray(np.zeros((4, 4), np.float32))[:, 1])
    with pytest.raises(CollectiveError, match="unknown reduction"):
        group.allreduce_(FakeArray(np.zeros(3, np.float32)), op="prod")
    with pytest.raises(CollectiveError, match="root must be in 0..0"):
        group.broadcast_(FakeArray(np.zeros(3, np.float32)), root=1)
    assert FakeComm.instances[0].calls == [] and FakeComm.instances[0].aborted == 0


def test_a_stalled_all_reduce_aborts_the_communicator(fake_gpu, tmp_path):
    stream, _ = fake_gpu
    group = make_group(tmp_path, timeout=0.3)
    stream.status = 600  # cudaErrorNotReady
    began = time.monotonic()
    with pytest.raises(CollectiveError) as info:
        group.allreduce_(FakeArray(np.zeros(4, np.float32)))
    assert 0.25 <= time.monotonic() - began < 2.0
    text = str(info.value)
    assert text.startswith("rank 0: all-reduce (sum) of 16 bytes did not complete within 0.3 s")
    assert "another rank has probably died or stalled" in text
    comm = FakeComm.instances[0]
    assert comm.aborted == 1
    with pytest.raises(CollectiveError, match="aborted after an earlier failure"):
        group.barrier()
    group.close()
    assert comm.destroyed == 0  # an aborted communicator is not destroyed as well


def test_an_nccl_async_error_aborts_at_once(fake_gpu, tmp_path):
    stream, _ = fake_gpu
    group = make_group(tmp_path, timeout=30.0)
    stream.status = 600  # cudaErrorNotReady
    comm = FakeComm.instances[0]
    comm.async_error = RuntimeError("NCCL_ERROR_REMOTE_ERROR: remote process exited")
    began = time.monotonic()
    with pytest.raises(CollectiveError, match="broadcast from rank 0 of 12 bytes failed .*REMOTE") as info:
        group.broadcast_(FakeArray(np.zeros(3, np.float32)))
    assert time.monotonic() - began < 1.0 and comm.aborted == 1
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_cuda_error_on_the_stream_aborts_at_once(fake_gpu, tmp_path):
    stream, _ = fake_gpu
    group = make_group(tmp_path, timeout=30.0)
    stream.status = 700  # cudaErrorIllegalAddress: the all-reduce will never finish
    began = time.monotonic()
    with pytest.raises(CollectiveError, match="all-reduce \\(sum\\) of 16 bytes failed .*illegal memory access"):
        group.allreduce_(FakeArray(np.zeros(4, np.float32)))
    assert time.monotonic() - began < 1.0 and FakeComm.instances[0].aborted == 1


def test_queued_all_reduces_return_at_once_and_are_waited_for_under_the_watchdog(fake_gpu, tmp_path):
    """What overlap does on a GPU: inside queued() an all-reduce only queues (it returns while its stream is
    still busy); wait_queued() then waits for the stream, and a stream that never finishes is aborted."""
    stream, _ = fake_gpu
    group = make_group(tmp_path, timeout=0.2)
    assert group.queues
    stream.status = 600  # cudaErrorNotReady: the stream is busy
    with group.queued():
        group.allreduce_(FakeArray(np.zeros(4, np.float32)))
        group.allreduce_(FakeArray(np.zeros(8, np.float32)))
    assert [c[3] for c in FakeComm.instances[0].calls] == [4, 8]
    with pytest.raises(CollectiveError, match="the all-reduces of step 3 did not complete within 0.2 s"):
        group.wait_queued("the all-reduces of step 3")
    assert FakeComm.instances[0].aborted == 1
    stream.status = 0
    with pytest.raises(CollectiveError, match="aborted"):  # outside queued() again: waits, and refuses
        group.allreduce_(FakeArray(np.zeros(4, np.float32)))


def test_an_all_reduce_checks_its_array_every_time_after_the_first_full_check(fake_gpu, tmp_path):
    """(type, dtype, op) is checked once; a refusal is never remembered, and device and contiguity are checked
    on every call: what was refused the first time is refused every time after, between accepted calls."""
    group = make_group(tmp_path)
    comm = FakeComm.instances[0]
    refusals = [
        (np.zeros(3, np.float32), "sum", "needs device \\(CuPy\\) arrays .* numpy.ndarray"),
        (FakeArray(np.zeros(3, np.uint8)), "sum", "cannot reduce uint8"),
        (FakeArray(np.zeros(3, np.float32), device_id=1), "sum", "all-reduce of an array on cuda:1"),
        (FakeArray(np.zeros((4, 4), np.float32))[:, 1], "sum", "contiguous .* shape \\(4,\\)"),
        (FakeArray(np.zeros(3, np.float32)), "prod", "unknown reduction 'prod'"),
        (FakeArray(np.zeros(3, np.float32)), ["sum"], "unknown reduction \\['sum'\\]"),
    ]
    for round_ in range(3):
        good = FakeArray(np.arange(3, dtype=np.float32))
        assert group.allreduce_(good) is good
        assert comm.calls[-1] == ("allReduce", good.data.ptr, good.data.ptr, 3, 7, 0, 1234)
        for array, op, message in refusals:
            with pytest.raises(CollectiveError, match=message):
                group.allreduce_(array, op=op)
        assert len(comm.calls) == round_ + 1 and comm.aborted == 0
    other = FakeArray(np.arange(5, dtype=np.float64))  # another dtype and op after the remembered ones
    group.allreduce_(other, op="min")
    assert comm.calls[-1] == ("allReduce", other.data.ptr, other.data.ptr, 5, 8, 3, 1234)


def test_the_memo_of_checked_arrays_stays_bounded(fake_gpu, tmp_path, monkeypatch):
    monkeypatch.setattr(nccl_backend, "_MAX_CHECKED", 2)
    group = make_group(tmp_path)
    for dtype, op in [(np.float32, "sum"), (np.float64, "max"), (np.int32, "min"), (np.float32, "sum")]:
        group.allreduce_(FakeArray(np.zeros(2, dtype)), op=op)
        assert len(group._checked) <= 2
    assert [c[4:6] for c in FakeComm.instances[0].calls] == [(7, 0), (8, 2), (2, 3), (7, 0)]


def test_an_all_reduce_that_has_finished_costs_one_stream_query_and_no_device_switch(fake_gpu, tmp_path):
    stream, device = fake_gpu
    group = make_group(tmp_path)
    comm = FakeComm.instances[0]
    checks, queries = comm.async_checks, stream.queries
    for n in range(1, 6):
        group.allreduce_(FakeArray(np.zeros(n, np.float32)))
    assert stream.queries - queries == 5 and comm.async_checks == checks  # finished: no watchdog polling
    assert device.entered == []  # the rank's device was current: no cupy.cuda.Device context


def test_an_all_reduce_switches_to_the_ranks_device_when_another_is_current(fake_gpu, tmp_path):
    stream, device = fake_gpu
    group = make_group(tmp_path, timeout=0.2)
    device.current = 1
    a = FakeArray(np.zeros(4, np.float32))
    group.allreduce_(a)  # the fake's stream lookup asserts that cuda:0 is current
    assert device.entered == [0] and device.current == 1
    stream.status = 600  # and the watchdog's wait happens there as well
    with pytest.raises(CollectiveError, match="did not complete within 0.2 s"):
        group.allreduce_(a)
    assert device.entered == [0, 0] and device.current == 1


def test_an_async_error_is_raised_by_the_first_all_reduce_that_has_not_finished(fake_gpu, tmp_path):
    """A call whose stream has finished is complete (its peers did their part); a dead peer stops the next
    call from finishing, and that one polls NCCL's error at once."""
    stream, _ = fake_gpu
    group = make_group(tmp_path, timeout=30.0)
    comm = FakeComm.instances[0]
    comm.async_error = RuntimeError("NCCL_ERROR_REMOTE_ERROR: remote process exited")
    group.allreduce_(FakeArray(np.zeros(4, np.float32)))
    stream.status = 600  # cudaErrorNotReady
    began = time.monotonic()
    with pytest.raises(CollectiveError, match="all-reduce \\(sum\\) of 16 bytes failed .*REMOTE") as info:
        group.allreduce_(FakeArray(np.zeros(4, np.float32)))
    assert time.monotonic() - began < 1.0 and comm.aborted == 1
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_stream_error_seen_by_the_first_query_is_not_lost(fake_gpu, tmp_path):
    """The first query's answer goes to the watchdog as its first poll, not asked again (an error a query
    reports once must still abort)."""
    stream, _ = fake_gpu
    group = make_group(tmp_path, timeout=30.0)
    stream.once = [700]  # cudaErrorIllegalAddress, then the stream looks finished
    with pytest.raises(CollectiveError, match="all-reduce \\(sum\\) of 16 bytes failed .*illegal memory"):
        group.allreduce_(FakeArray(np.zeros(4, np.float32)))
    assert FakeComm.instances[0].aborted == 1


def test_an_all_reduce_still_running_at_the_first_query_is_waited_for(fake_gpu, tmp_path):
    stream, _ = fake_gpu
    group = make_group(tmp_path, timeout=30.0)
    comm = FakeComm.instances[0]
    checks = comm.async_checks
    stream.once = [600, 600, 600]  # busy at the first query and two more, then finished
    group.allreduce_(FakeArray(np.zeros(4, np.float32)))
    # the first query's answer is the first poll's: 4 queries, 4 polls each checking NCCL's errors first
    assert stream.queries == 4 and comm.async_checks - checks == 4 and comm.aborted == 0


def test_a_stalled_all_reduce_after_finished_ones_is_aborted(fake_gpu, tmp_path):
    stream, _ = fake_gpu
    group = make_group(tmp_path, timeout=0.2)
    for _ in range(3):
        group.allreduce_(FakeArray(np.zeros(4, np.float32)))
    stream.status = 600
    began = time.monotonic()
    with pytest.raises(
        CollectiveError,
        match="rank 0: all-reduce \\(sum\\) of 16 bytes did not complete within "
        "0.2 s: another rank has probably died or stalled",
    ):
        group.allreduce_(FakeArray(np.zeros(4, np.float32)))
    assert 0.15 <= time.monotonic() - began < 2.0 and FakeComm.instances[0].aborted == 1


def test_a_backend_that_cannot_queue_says_so():
    with pytest.raises(CollectiveError, match="the mirror backend cannot leave an all-reduce queued"):
        with Mirror(2).queued():
            pass


def test_nccl_collective_needs_a_gpu_device(fake_gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(nccl_backend, "get_device", lambda d: backend.CPU)
    with pytest.raises(CollectiveError, match="--device cuda:N"):
        make_group(tmp_path)
    assert FakeComm.instances == []


@pytest.mark.parametrize("rank, world", [(1, 1), (-1, 2), (0, 0)])
def test_nccl_collective_checks_rank_and_world(fake_gpu, tmp_path, rank, world):
    with pytest.raises(CollectiveError, match="rank|world size"):
        NcclCollective(rank, world, "cuda:0", rendezvous=f"file:{tmp_path / 'id'}")


def test_nccl_backend_says_what_to_install_without_cupy():
    if backend.cuda_available():
        pytest.skip("this machine has CuPy and a GPU")
    try:
        backend.nccl_module()
    except backend.DeviceError:
        pass
    else:
        pytest.skip("CuPy's NCCL bindings import here")
    with pytest.raises(backend.DeviceError, match="pip install"):
        NcclCollective(0, 1, "cpu")
