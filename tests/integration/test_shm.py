"""The same-host link through shared memory: segments (names, permissions, cleanup), who gets one, hostile
requests over it, consistency under concurrent pushes, the fallback to TCP, and no segment left behind
after a shard or a worker is killed.

The hostile-input shard is test_datapath's (sync softmax in float64, one shard, worker 0 registered,
round 0 never closes), so no valid push changes its weights.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from psgd.config import to_toml
from psgd.link import protocol, segment
from psgd.link.shm import ShmLink
from psgd.server import build_shard
from psgd.server.datapath import DataServer
from psgd.server.store import PARALLEL_BYTES
from psgd.server.service import ShardServer
from psgd.worker.client import PSClient, PSError

from helpers import make_job, run_threads, shards
from test_datapath import (FATAL_PUSHES, HOSTILE_SETS, INVALID, IO, OK, UNAUTHENTICATED, Shard, assert_closed,
                           assert_serves, dial, expect, request, send_hello, valid_gradient, wait_for)

pytestmark = [pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered in reduce:RuntimeWarning"),
              pytest.mark.skipif(not segment.host_id(), reason="this machine has no /dev/shm")]

PY = sys.executable


@pytest.fixture(scope="module")
def hostile():
    core = build_shard(make_job(*HOSTILE_SETS), 0)
    core.register(0, core.plan.hash)
    server = ShardServer(core, "127.0.0.1:0", request_timeout=IO).start()
    try:
        yield Shard(core, server, core.flat.tobytes())
    finally:
        server.stop(grace=1.0)


@pytest.fixture
def shard(hostile):
    """The hostile-input shard; after the test it must still serve, with its weights unchanged, and no
    segment of its job but its weights may be left in /dev/shm."""
    yield hostile
    assert_serves(hostile)
    assert segment.leftovers(hostile.core.fingerprint) == [hostile.server.data._weights.path.name]


@contextlib.contextmanager
def with_segment(shard: Shard, purpose: str, worker: int = 0, port: int | None = None, token: str = ""):
    """A raw data connection that asked for a ``purpose`` segment, and the segment, mapped."""
    sock = dial(shard.port if port is None else port)
    body = json.dumps({"token": token, "plan_hash": shard.plan.hash, "shm": purpose}).encode()
    send_hello(sock, shard.plan.hash, worker=worker, body=body)
    magic, status, _, _, _, _, size = protocol.recv_struct(sock, protocol.REPLY)
    assert magic == protocol.DATA_MAGIC and status == 0
    text = bytearray(size)
    protocol.recv_exact(sock, memoryview(text))
    offer = json.loads(text)
    seg = segment.attach(offer["segment"], offer["bytes"], bytes.fromhex(offer["nonce"]))
    try:
        yield sock, seg, offer
    finally:
        seg.close()
        sock.close()


def shm_reply(sock):
    """A reply on a connection with a segment: its size counts the bytes in the segment, none follow."""
    magic, status, outcome, version, next_clock, staleness, size = protocol.recv_struct(sock, protocol.REPLY)
    assert magic == protocol.DATA_MAGIC
    message = ""
    if status:
        text = bytearray(size)
        protocol.recv_exact(sock, memoryview(text))
        message = text.decode()
    return grpc.StatusCode.OK if not status else status, outcome, version, size, message


# --- segments -----------------------------------------------------------------------------------


def test_a_segment_is_owner_only_named_by_the_scheme_and_checked_by_its_nonce():
    seg = segment.create("0123abcd", 3, "push", 4096)
    try:
        mode = os.stat(seg.path).st_mode
        assert stat.S_IMODE(mode) == 0o600
        assert seg.path.parent == Path("/dev/shm")
        assert seg.path.name.startswith(f"psgd-0123abcd-s3-{os.getpid()}-") and seg.path.name.endswith("-push")
        assert segment.leftovers("0123abcd") == [seg.path.name]
        with pytest.raises(segment.SegmentError, match="does not carry the nonce"):
            segment.attach(seg.path.name, 4096, bytes(16))
        with pytest.raises(segment.SegmentError, match="is not 4064 bytes long"):
            segment.attach(seg.path.name, 4000, seg.nonce)
        with pytest.raises(segment.SegmentError, match="not a psgd segment name"):
            segment.attach("../etc/passwd", 4096, seg.nonce)
        other = segment.attach(seg.path.name, 4096, seg.nonce)
        seg.data[:5] = b"hello"
        assert bytes(other.data[:5]) == b"hello"  # one memory
        other.close()
        reader = segment.attach(seg.path.name, 4096, seg.nonce, writable=False)
        with pytest.raises(TypeError):
            reader.data[:1] = b"x"  # mapped read-only
        reader.close()
    finally:
        seg.unlink()
        seg.close()
    assert segment.leftovers("0123abcd") == []


def test_a_shard_starting_removes_its_jobs_segments_whose_process_is_gone():
    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait(30)
    job = make_job(*HOSTILE_SETS)
    core = build_shard(job, 0)
    names = [f"psgd-{core.fingerprint}-s0-{dead.pid}-{'ab' * 8}-weights",  # this shard's, its process gone
             f"psgd-{core.fingerprint}-s0-{os.getpid()}-{'cd' * 8}-push",   # a live process's
             f"psgd-{core.fingerprint}-s1-{dead.pid}-{'ef' * 8}-push",      # another shard's
             f"psgd-0000000000000000-s0-{dead.pid}-{'01' * 8}-push"]      # another job's
    for name in names:
        fd = os.open(segment.SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
    try:
        data = DataServer(core, request_timeout=IO).start()
        assert [n for n in segment.leftovers(core.fingerprint) if n.endswith("-weights")] == \
            [data._weights.path.name]  # its own, just made
        data.stop()
        left = {p.name for p in segment.SHM_DIR.iterdir()}
        assert names[0] not in left and set(names[1:]) <= left
    finally:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment.SHM_DIR / name)


# --- who gets a segment -----------------------------------------------------------------------------


def test_a_pull_reads_the_shards_weights_and_holds_updates_back_until_released(shard):
    with with_segment(shard, "pull") as (sock, seg, offer):
        assert offer["segment"].endswith("-weights") and offer["bytes"] == shard.core.nbytes
        request(sock, protocol.OP_PULL)
        code, _, version, size, _ = shm_reply(sock)
        assert code == OK and size == shard.core.nbytes and version == 0
        assert bytes(seg.data[:size]) == shard.initial
        assert shard.core.store._readers == 1  # a live read: an update would wait for the release
        request(sock, protocol.OP_RELEASE)
        wait_for(lambda: shard.core.store._readers == 0, "the release")
        assert (segment.SHM_DIR / offer["segment"]).exists()  # the weights keep their name while the shard serves


def test_a_push_segments_name_is_gone_once_the_worker_makes_its_first_request(shard):
    with with_segment(shard, "push") as (sock, seg, offer):
        assert offer["segment"].endswith("-push") and (segment.SHM_DIR / offer["segment"]).exists()
        g = valid_gradient(shard.plan)
        seg.data[:g.nbytes] = g.tobytes()
        request(sock, protocol.OP_PUSH, size=g.nbytes)
        assert shm_reply(sock)[0] == OK
        assert not (segment.SHM_DIR / offer["segment"]).exists()


@pytest.mark.parametrize("after", [protocol.OP_PULL, protocol.OP_PUSH, 9])
def test_a_pull_from_shared_memory_must_be_released_before_anything_else(shard, after):
    with with_segment(shard, "pull") as (sock, seg, _):
        request(sock, protocol.OP_PULL)
        assert shm_reply(sock)[0] == OK
        request(sock, after)
        expect(sock, INVALID, "must be answered with a release")
        assert_closed(sock)
    wait_for(lambda: shard.core.store._readers == 0, "the live read to end with the connection")


def test_a_release_without_a_pull_is_refused(shard):
    with with_segment(shard, "pull") as (sock, seg, _):
        request(sock, protocol.OP_RELEASE)
        expect(sock, INVALID, "a release without a pull")
        assert_closed(sock)


def test_a_pull_never_released_holds_updates_back_only_until_the_request_timeout(shard):
    data = DataServer(shard.core, request_timeout=1.0, idle_timeout=IO).start()
    try:
        with with_segment(shard, "pull", port=data.port) as (sock, seg, _):
            request(sock, protocol.OP_PULL)
            assert shm_reply(sock)[0] == OK
            assert shard.core.store._readers == 1
            began = time.monotonic()
            wait_for(lambda: shard.core.store._readers == 0, "the timeout to end the read", timeout=IO)
            assert 0.8 <= time.monotonic() - began <= IO
            assert_closed(sock)
    finally:
        data.stop()


def test_a_token_protected_shard_makes_no_segment_before_the_token_is_right(shard):
    data = DataServer(shard.core, token="s3cret", request_timeout=IO, idle_timeout=IO).start()
    try:
        before = segment.leftovers(shard.core.fingerprint)
        with dial(data.port) as sock:
            body = json.dumps({"token": "wrong", "plan_hash": shard.plan.hash, "shm": "push"}).encode()
            send_hello(sock, shard.plan.hash, body=body)
            expect(sock, UNAUTHENTICATED, "wrong or missing token")
        assert segment.leftovers(shard.core.fingerprint) == before == [shard.server.data._weights.path.name]  # no push one
        with with_segment(shard, "push", port=data.port, token="s3cret") as (sock, seg, offer):
            g = valid_gradient(shard.plan)
            seg.data[:g.nbytes] = g.tobytes()
            request(sock, protocol.OP_PUSH, size=g.nbytes)
            code, outcome, _, _, _ = shm_reply(sock)
            assert code == OK and protocol.OUTCOMES[outcome] in ("accumulated", "duplicate")
    finally:
        data.stop()


@pytest.mark.parametrize("worker, shm, words", [(-1, "pull", "workers only"), (0, "both", "not 'both'"),
                                                (0, "../x", "not '../x'")])
def test_an_observer_or_an_unknown_purpose_gets_no_segment(shard, worker, shm, words):
    with dial(shard.port) as sock:
        body = json.dumps({"token": "", "plan_hash": shard.plan.hash, "shm": shm}).encode()
        send_hello(sock, shard.plan.hash, worker=worker, body=body)
        expect(sock, INVALID, words)


# --- hostile requests over a segment --------------------------------------------------------------------


@pytest.mark.parametrize("case", [c for c in FATAL_PUSHES if c != "empty"])
def test_a_push_of_the_wrong_size_or_dtype_is_refused_and_the_connection_closed(shard, case):
    code, size, words = FATAL_PUSHES[case]
    before = shard.state()
    with with_segment(shard, "push") as (sock, seg, _):
        seg.data[:] = b"\x01" * seg.size  # whatever is in the segment, the header decides
        request(sock, protocol.OP_PUSH, code=code, size=size(shard))
        expect(sock, INVALID, *words)
        assert_closed(sock)
    assert shard.state() == before


@pytest.mark.parametrize("purpose, op", [("pull", protocol.OP_PUSH), ("push", protocol.OP_PULL)])
def test_a_segment_serves_only_what_it_was_asked_for(shard, purpose, op):
    before = shard.state()
    with with_segment(shard, purpose) as (sock, seg, _):
        request(sock, op, size=shard.core.nbytes if op == protocol.OP_PUSH else 0)
        expect(sock, INVALID, f"shared memory is for {'pulls' if purpose == 'pull' else 'pushes'}")
        assert_closed(sock)
    assert shard.state() == before


def test_a_nan_written_into_the_segment_is_refused_and_the_connection_goes_on(shard):
    before = shard.state()
    with with_segment(shard, "push") as (sock, seg, _):
        g = valid_gradient(shard.plan)
        g[100] = np.nan
        seg.data[:g.nbytes] = g.tobytes()
        request(sock, protocol.OP_PUSH, size=g.nbytes)
        expect(sock, INVALID, "non-finite")
        assert shard.state() == before
        g[100] = 0.5
        seg.data[:g.nbytes] = g.tobytes()
        request(sock, protocol.OP_PUSH, size=g.nbytes)
        assert shm_reply(sock)[0] == OK


# --- consistency ------------------------------------------------------------------------------------


def test_a_pull_never_sees_half_an_update_while_pushes_are_applied(tmp_path):
    """Async, 2 shards of a model cut in many slices (updated by several threads): one worker pushes a
    gradient of ones, again and again, while another pulls.  Every update moves every weight by the same
    -lr, so every pull must find weights that moved by one and the same multiple of lr everywhere, and its
    version must say how many."""
    lr = 0.5
    job = make_job("model.name=mlp", "model.hidden=[32768]", "train.dtype=float64", "optimizer.name=sgd",
                   f"optimizer.lr={lr}", "cluster.policy=async", "cluster.workers=2", "cluster.shards=2",
                   "cluster.transport=shm")
    with shards(job) as servers:
        plan = servers[0].core.plan
        assert all(s.core.nbytes >= PARALLEL_BYTES and len(s.core.slices) > 2 for s in servers)
        ones = {s.name: np.ones(s.shape) for s in plan.specs}
        with PSClient(job.cluster.servers, plan, 0, request_timeout=IO, transport="shm", job=job) as pusher, \
                PSClient(job.cluster.servers, plan, 1, request_timeout=IO, transport="shm", job=job) as puller:
            pusher.register(), puller.register()
            assert all(isinstance(link, ShmLink) and link.shared for link in pusher.links + puller.links)
            initial = {s.name: np.empty(s.shape) for s in plan.specs}
            puller.pull(0, initial)
            pushes, done, seen = 60, threading.Event(), []

            def push() -> int:
                try:
                    for clock in range(pushes):
                        assert [r.outcome for r in pusher.push(clock, ones)] == ["applied", "applied"]
                finally:
                    done.set()
                return pushes

            def pull() -> int:  # as often as it can while the pushes go on (at most 5,000 times)
                host = {s.name: np.empty(s.shape) for s in plan.specs}
                while not done.is_set() and len(seen) < 5000:
                    versions = puller.pull(0, host)
                    seen.extend(versions)
                    for k in range(len(servers)):
                        moved = np.concatenate([(host[sl.var].reshape(-1)[sl.start:sl.stop]
                                                 - initial[sl.var].reshape(-1)[sl.start:sl.stop])
                                                for sl in plan.slices_for_shard(k)])
                        np.testing.assert_allclose(moved, -lr * versions[k], rtol=0, atol=1e-9)
                return pushes

            assert run_threads([push, pull], timeout=120) == [pushes, pushes]
            assert len(set(seen) - {0, pushes}) >= 2  # pulls came while pushes were being applied
        assert [s.core.version for s in servers] == [pushes, pushes]


def test_a_retried_push_over_shared_memory_is_applied_once(monkeypatch):
    job = make_job("model.name=softmax", "train.dtype=float64", "optimizer.name=sgd", "optimizer.lr=0.1",
                   "cluster.policy=async", "cluster.workers=1", "cluster.shards=1", "cluster.transport=shm")
    with shards(job) as servers:
        server = servers[0]
        real, calls = server.core.push, []

        def push_then_break(*args, **kwargs):
            result = real(*args, **kwargs)
            calls.append(result.outcome)
            if len(calls) == 1:  # applied, but the reply never reaches the worker
                with server.data._lock:
                    conns = list(server.data._conns)
                for conn in conns:
                    conn.shutdown(2)
            return result

        monkeypatch.setattr(server.core, "push", push_then_break)
        plan = server.core.plan
        grads = {s.name: np.full(s.shape, 0.25) for s in plan.specs}
        with PSClient(job.cluster.servers, plan, 0, request_timeout=IO, transport="shm", job=job) as client:
            clock = client.register()
            assert client.links[0].shared
            before = server.core.flat.copy()
            replies = client.push(clock, grads)
        assert [r.outcome for r in replies] == ["duplicate"] and calls == ["applied", "duplicate"]
        np.testing.assert_array_equal(server.core.flat, before - 0.1 * 0.25)
        assert server.core.version == 1
        assert segment.leftovers(server.core.fingerprint) == [server.data._weights.path.name]  # no push segment
    assert segment.leftovers(server.core.fingerprint) == []  # a stopped shard removes its weights' name


# --- falling back to the data port ---------------------------------------------------------------------


class Lines(logging.Handler):
    """The shm link's log records, whatever another test did to logging's configuration."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def caplog():
    lines, logger = Lines(), logging.getLogger("psgd.link.shm")
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(lines)
    logger.setLevel(level)


def _one_step(job, caplog, rank: int = 0) -> list:
    plan = build_shard(job, 0).plan
    with contextlib.nullcontext():
        with PSClient(job.cluster.servers, plan, rank, request_timeout=IO, transport=job.cluster.transport,
                      job=job) as client:
            clock = client.register()
            host = {s.name: np.empty(s.shape, dtype=s.dtype) for s in plan.specs}
            client.pull(clock, host)
            client.push(clock, {s.name: np.zeros(s.shape, dtype=s.dtype) for s in plan.specs})
            client.pull(clock + 1, host)
            return [(link.via, link.shared) for link in client.links]


def test_a_shard_offering_no_shared_memory_is_used_over_tcp_with_one_line_saying_why(caplog):
    job = make_job("model.name=softmax", "cluster.policy=async", "cluster.workers=1", "cluster.shards=1",
                   "cluster.transport=tcp")
    with shards(job) as servers:  # the shard's side says tcp: it offers no segments
        job.override("cluster.transport", "shm")
        assert _one_step(job, caplog) == [("tcp", False)]
        assert servers[0].data.shm is False
    lines = [r for r in caplog.records if "not through shared memory" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "offers no shared memory" in lines[0].getMessage()


def test_a_shard_on_another_host_is_used_over_tcp(caplog, monkeypatch):
    job = make_job("model.name=softmax", "cluster.policy=async", "cluster.workers=1", "cluster.shards=1")
    with shards(job) as servers:  # it advertised this machine's identity; the worker now has another one
        monkeypatch.setattr(segment, "host_id", lambda: "another-host")
        assert _one_step(job, caplog) == [("tcp", False)]
        assert servers[0].data._segments == set()
    lines = [r for r in caplog.records if "not through shared memory" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO  # transport = "auto": as expected, not a warning
    assert "on another host" in lines[0].getMessage()


def test_a_segment_that_cannot_be_made_leaves_the_connection_on_tcp(caplog, monkeypatch, tmp_path):
    job = make_job("model.name=softmax", "cluster.policy=async", "cluster.workers=1", "cluster.shards=1")
    with shards(job):
        def full(*args):
            raise segment.SegmentError("cannot size /dev/shm/psgd-...: [Errno 28] No space left on device")

        monkeypatch.setattr(segment, "create", full)
        assert _one_step(job, caplog) == [("tcp", False)]
    lines = [r for r in caplog.records if "not through shared memory" in r.getMessage()]
    assert len(lines) == 1 and "could not make a segment" in lines[0].getMessage()


# --- killed processes leave nothing behind ----------------------------------------------------------


def _server(job_path: Path, port_file: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(["psgd-server", "-c", str(job_path), "--shard", "0", "--bind", "127.0.0.1:0",
                             "--port-file", str(port_file)], stdout=subprocess.DEVNULL,
                            stderr=log.open("w"), start_new_session=True)


def _wait_file(path: Path, proc: subprocess.Popen, what: str, timeout: float = 60) -> str:
    end = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert proc.poll() is None, f"{what} exited early"
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)
    return path.read_text().strip()


def _worker(job_path: Path, address: str, metrics: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(["psgd-worker", "-c", str(job_path), "--rank", "0", "--servers", address,
                             "--no-progress", "--metrics", str(metrics)], stdout=subprocess.DEVNULL,
                            stderr=log.open("w"), start_new_session=True)


def _stepping(metrics: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not (metrics.exists() and '"event": "step"' in metrics.read_text()):
        assert proc.poll() is None, "the worker exited before its first step"
        assert time.monotonic() < end, "timed out waiting for the worker's first step"
        time.sleep(0.05)


@pytest.mark.parametrize("killed", ["shard", "worker"])
def test_no_segment_is_left_after_the_shard_or_the_worker_is_killed(tmp_path, killed):
    """A killed worker leaves nothing; a killed shard leaves its weights' name, which the next shard of the
    job removes when it starts; a shard stopped with SIGTERM removes its own."""
    job = make_job("model.name=mlp", "model.hidden=[64]", "cluster.policy=async", "cluster.workers=1",
                   "cluster.shards=1", "train.epochs=200", "cluster.transport=shm")
    job_path = tmp_path / "job.toml"
    job_path.write_text(to_toml(job.to_dict()))
    fingerprint = build_shard(job, 0).fingerprint

    def names_of(proc) -> list[str]:
        return [n for n in segment.leftovers(fingerprint) if f"-s0-{proc.pid}-" in n]

    shard = _server(job_path, tmp_path / "port", tmp_path / "shard.log")
    worker = again = None
    try:
        address = _wait_file(tmp_path / "port", shard, "the shard's port file")
        worker = _worker(job_path, address, tmp_path / "m.jsonl", tmp_path / "worker.log")
        _stepping(tmp_path / "m.jsonl", worker)
        assert "through shared memory" not in (tmp_path / "worker.log").read_text()  # no fallback line
        weights = names_of(shard)
        assert len(weights) == 1 and weights[0].endswith("-weights")
        assert segment.leftovers(fingerprint) == weights  # the push segment's name went with the first push
        for proc, kinds in ((worker, {"weights", "push (deleted)"}), (shard, {"weights", "push (deleted)"})):
            maps = Path(f"/proc/{proc.pid}/maps").read_text()  # both map both: the weights and the push segment
            assert {k for k in ("weights", "push (deleted)")
                    if f"/dev/shm/psgd-{fingerprint}-s0-{shard.pid}-" in maps and f"-{k}" in maps} == kinds
        victim = shard if killed == "shard" else worker
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(30)
        assert segment.leftovers(fingerprint) == weights  # a killed worker leaves nothing; a shard, its weights
        again = _server(job_path, tmp_path / "port2", tmp_path / "shard2.log") if killed == "shard" else None
        if again is not None:  # the next start removes what the killed shard left, and makes its own
            _wait_file(tmp_path / "port2", again, "the restarted shard's port file")
            assert segment.leftovers(fingerprint) == names_of(again) != []
        for proc in (again, shard if killed == "worker" else None):
            if proc is not None:
                os.killpg(proc.pid, signal.SIGTERM)
                assert proc.wait(30) is not None
        assert segment.leftovers(fingerprint) == []  # stopped: nothing left
    finally:
        for proc in (worker, shard, again):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
    stale = [n for n in segment.leftovers(fingerprint)]
    for name in stale:  # a failed run must not leave its segments to the next test
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment.SHM_DIR / name)
    assert stale == []
