"""Connections that cannot be hoarded: idle or garbage connections to a shard's data port never lock
its workers out, and a refused client learns why.

Shards run in this process (ShardServer with a token) or, for the measured run, as a real psgd-server
process; workers are real (run_worker in a thread of this process); the measured flood comes from
threads of a process of its own.  Every socket has a timeout, every loop is bounded by count and time,
and everything listens on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers import make_job, run_threads, wait_for

from psgd.bench.chaos.processes import end_all
from psgd.config import Deadlines, to_toml
from psgd.errors import Code
from psgd.job import describe_job
from psgd.link import LinkError
from psgd.link.tcp import DataConnection
from psgd.server import build_shard
from psgd.server.net.service import ShardServer
from psgd.wire import protocol
from psgd.worker.client import PSClient, PSError
from psgd.worker.exchange import run_worker

TOKEN = "s3cret-of-this-job"
IO = 10.0  # seconds: every socket's timeout here
CODES = {c.value: c for c in Code}


def tiny_job(*sets: str):
    """Two workers (so the authenticated cap is 4 * 2 + 8 = 16), one shard, a few hundred small steps.
    request_timeout is short so that a locked-out worker fails within the test, not after 60 s."""
    return make_job(
        "model.name=softmax",
        "cluster.workers=2",
        "cluster.shards=1",
        "cluster.policy=async",
        "train.epochs=1",
        "train.batch_size=16",
        "train.eval_every=0",
        "cluster.request_timeout=8",
        "cluster.join_timeout=30",
        *sets,
    )


@contextlib.contextmanager
def token_shards(job, **options):
    """The shards of ``job`` served in this process, wanting the token TOKEN; yields the job with its servers filled
    in, and the shards."""
    servers = []
    try:
        for k in range(job.cluster.shards):
            servers.append(
                ShardServer(build_shard(describe_job(job), k), "127.0.0.1:0", token=TOKEN, **options).start()
            )
        yield job.override("cluster.servers", [s.address for s in servers]), servers
    finally:
        for s in servers:
            s.stop(grace=1.0)


def dial(port: int, timeout: float = IO) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def train_all(job, timeout: float = 60.0):
    """Every worker of ``job`` trained in a thread of this process; their results."""
    return run_threads(
        [
            lambda r=r: run_worker(job, r, job.cluster.servers, progress=False, token=TOKEN)
            for r in range(job.cluster.workers)
        ],
        timeout=timeout,
    )


def test_idle_connections_do_not_lock_the_workers_out():
    """Seventeen connections that never send a byte: the workers (with the token) still train.  Before
    the fix they filled every slot (4 * 2 + 8) for request_timeout, and both workers failed with
    "Connection reset by peer"."""
    job = tiny_job()
    with token_shards(job) as (job, servers):
        port = servers[0].data.port
        idle = [dial(port) for _ in range(17)]
        try:
            started = time.monotonic()
            results = train_all(job)
            took = time.monotonic() - started
        finally:
            for sock in idle:
                sock.close()
        assert all(r.steps > 0 for r in results)
        assert servers[0].core.version == sum(r.steps for r in results)  # async: every push applied
        assert took < 20, f"the workers took {took:.1f}s"


def read_refusal(sock: socket.socket) -> tuple[Code, str]:
    """The error reply a refused connection gets before the shard closes it."""
    magic, status, _, _, _, _, size = protocol.recv_struct(sock, protocol.REPLY)
    assert magic == protocol.DATA_MAGIC and status != 0 and size <= protocol.MAX_ERROR_BYTES
    text = bytearray(size)
    protocol.recv_exact(sock, memoryview(text))
    return CODES[status], text.decode()


def assert_closed(sock: socket.socket) -> None:
    with contextlib.suppress(ConnectionResetError):
        assert sock.recv(100) == b""


@pytest.mark.slow
def test_idle_grpc_streams_cannot_block_the_control_calls_and_are_ended(monkeypatch):
    """Found: without a token, 40 idle Push streams on the gRPC port held every thread of the shard's server for
    as long as they lived; Register, Status and heartbeats waited behind them.  Now pulls and pushes leave the
    control calls threads of their own, and a push that has not arrived by its deadline is cancelled."""
    from psgd.proto import ps_pb2, ps_pb2_grpc
    from psgd.server.net import datapath

    monkeypatch.setattr(datapath, "TRANSFER_GRACE", 3.0)  # an idle push would hold its thread 3 s: long enough to see
    job = tiny_job()
    server = ShardServer(build_shard(describe_job(job), 0), "127.0.0.1:0").start()  # no token: anyone may call
    never = threading.Event()

    def idle():  # a push stream that sends nothing
        never.wait(30)
        return
        yield

    # four connections of ten idle streams each (a channel of its own each: gRPC's channels to one address share
    # one connection otherwise, and 40 streams opened on it before the shard's limit of 16 (STREAMS_PER_CONNECTION)
    # had reached the client were refused, the Status call among them, in 1 of 15 runs)
    channels = [
        grpc.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(4)
    ]
    try:
        streams = [ps_pb2_grpc.ParameterServerStub(channels[i % 4]).Push.future(idle(), timeout=30) for i in range(40)]
        stub = ps_pb2_grpc.ParameterServerStub(channels[0])
        for _ in range(3):  # the control calls are answered at once, on the connection the idle streams crowd too
            began = time.monotonic()
            stub.Status(ps_pb2.StatusRequest(), timeout=5)
            with PSClient(
                [server.address], server.core.plan, 0, deadlines=Deadlines(request_timeout=5), config=job
            ) as client:
                client.register()
            assert time.monotonic() - began < 2.0
        codes = [f.exception(timeout=IO).code() for f in streams]  # every one ended by the shard, within IO
        # (gRPC's client now and then reports a stream the shard cancelled as UNAVAILABLE: seen in 1 of 5 runs)
        assert set(codes) <= {
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.UNAVAILABLE,
        }, codes
    finally:
        never.set()
        for channel in channels:
            channel.close()
        server.stop(1)


def test_a_client_refused_for_its_token_sees_why():
    job = tiny_job()
    with token_shards(job) as (job, servers):
        core, port = servers[0].core, servers[0].data.port
        with pytest.raises(LinkError) as info:
            DataConnection("127.0.0.1", port, 0, core.plan.hash, token="nope", timeout=IO)
        assert info.value.code == Code.UNAUTHENTICATED and "wrong or replayed proof of the token" in info.value.details
        DataConnection("127.0.0.1", port, 0, core.plan.hash, token=TOKEN, timeout=IO).close()  # the right one


@pytest.mark.slow
def test_a_client_whose_hello_comes_too_late_is_told_so(monkeypatch):
    job = tiny_job()
    with token_shards(job, hello_timeout=0.5) as (job, servers):
        core, port = servers[0].core, servers[0].data.port
        with dial(port) as sock:  # sends nothing: the shard gives up after 0.5 s and says why
            started = time.monotonic()
            code, message = read_refusal(sock)
            waited = time.monotonic() - started
            assert_closed(sock)
        assert code == Code.DEADLINE_EXCEEDED and "no hello within 0.5 s" in message, message
        assert 0.3 < waited < 3, f"refused after {waited:.2f}s"

        send = DataConnection._send

        def late(self, op, *args):
            if op == protocol.OP_HELLO:
                time.sleep(1.0)  # the fault: a hello that leaves too late; the shard has already refused the connection
            return send(self, op, *args)

        monkeypatch.setattr(DataConnection, "_send", late)
        with pytest.raises(LinkError) as info:
            DataConnection("127.0.0.1", port, 0, core.plan.hash, token=TOKEN, timeout=IO)
        assert info.value.code == Code.DEADLINE_EXCEEDED and "no hello within 0.5 s" in info.value.details
        # a worker retries it (a slow network may be to blame) and, when it gives up, its error says why
        with PSClient(
            job.cluster.servers, core.plan, 0, deadlines=Deadlines(request_timeout=2.0), token=TOKEN, config=job
        ) as client:
            clock = client.register()
            host = {s.name: np.empty(s.shape, dtype=s.dtype) for s in core.plan.specs}
            with pytest.raises(PSError, match="no hello within 0.5 s"):
                client.pull(clock, host)


def test_idle_connections_beyond_the_cap_evict_the_oldest_and_hold_no_thread():
    """60 silent connections (more than the unauthenticated cap): the oldest are closed, each told why;
    the shard's thread count does not grow with them, and a worker connects at once meanwhile."""
    job = tiny_job()
    with token_shards(job) as (job, servers):
        core, data = servers[0].core, servers[0].data
        threads_before = threading.active_count()
        socks = [dial(data.port) for _ in range(60)]
        try:
            cap = min(data.gate.max_unauthenticated, data.gate.max_per_peer)  # on loopback every peer is one address
            evicted = socks[: 60 - cap]
            for sock in evicted[:5]:
                code, message = read_refusal(sock)
                assert code == Code.UNAVAILABLE and "to make room" in message, message
            wait_for(lambda: len(data.gate._pending) == cap, 5, f"{cap} connections left waiting for their hello")
            assert threading.active_count() <= threads_before + 2  # no thread per socket (2: slack for gRPC's own)
            started = time.monotonic()
            conn = DataConnection("127.0.0.1", data.port, 0, core.plan.hash, token=TOKEN, timeout=IO)
            assert time.monotonic() - started < 1.0
            conn.close()
        finally:
            for sock in socks:
                sock.close()


def test_refusals_are_summed_up_in_the_log_not_one_line_each():
    job = tiny_job()
    with token_shards(job) as (job, servers):
        core, port = servers[0].core, servers[0].data.port
        body = json.dumps({"proof": "wrong", "plan_hash": core.plan.hash}).encode()
        hello = protocol.REQUEST.pack(protocol.DATA_MAGIC, protocol.OP_HELLO, 0, 0, 0, 0, len(body)) + body
        records: list[logging.LogRecord] = []
        keep = logging.Handler(logging.WARNING)
        keep.emit = records.append  # on the logger itself: psgd's loggers may not propagate (psgd.observe.logs)
        logger = logging.getLogger("psgd.server.net.gatekeeper")
        logger.addHandler(keep)
        try:
            for _ in range(150):
                with dial(port) as sock:
                    sock.sendall(hello)
                    assert read_refusal(sock)[0] == Code.UNAUTHENTICATED
            servers[0].data.stop()  # writes what is still counted
        finally:
            logger.removeHandler(keep)
        lines = [r.getMessage() for r in records]
        assert 1 <= len(lines) <= 3, lines
        assert any(
            re.search(
                r"refused \d+ data connection\(s\) from 127\.0\.0\.1 in the last \d+s "
                r"\(no proof of the token\)",
                line,
            )
            for line in lines
        ), lines
        counted = sum(int(m.group(1)) for line in lines if (m := re.search(r"refused (\d+) ", line)))
        assert counted + sum("refused a data connection" in line for line in lines) == 150, lines


# --- the must-show figure: a worker under a flood of idle and garbage connections ---------------------

#: Held in a process of its own (so that its threads do not compete with the worker for this process's
#: lock): IDLE connections that send nothing and GARBAGE ones that send 64 random bytes, each re-opened
#: as soon as the shard closes it, until stdin closes or LIMIT seconds pass.  Prints "flooding" once every
#: connection has been opened and at least one re-opened, then, at the end, its counts as JSON.
FLOOD = r"""
import json, os, socket, sys, threading, time
port, idle, garbage, limit = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
stop, lock = threading.Event(), threading.Lock()
counts = {"connections": 0, "told_why": 0, "connect_errors": 0}
opened = set()  # the holders that have had a connection
def add(key):
    with lock:
        counts[key] += 1
def hold(i, send):
    end = time.monotonic() + limit
    for _ in range(1_000_000):
        if stop.is_set() or time.monotonic() > end:
            return
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=1)
        except OSError:
            add("connect_errors")
            stop.wait(0.05)  # a moment before connecting again
            continue
        add("connections")
        with lock:
            opened.add(i)
        with sock:
            got = b""
            try:
                if send:
                    sock.sendall(os.urandom(64))
                while not stop.is_set():  # until the shard closes it
                    try:
                        chunk = sock.recv(4096)
                    except socket.timeout:
                        continue
                    if not chunk:
                        break
                    got += chunk
            except OSError:
                pass
            if got[:4] == b"PSG1":
                add("told_why")
threads = [threading.Thread(target=hold, args=(i, i >= idle), daemon=True) for i in range(idle + garbage)]
for t in threads:
    t.start()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
end = time.monotonic() + limit
while not stop.is_set() and time.monotonic() < end:
    with lock:
        full = len(opened) == idle + garbage and counts["connections"] > idle + garbage
    if full:
        print("flooding", flush=True)
        break
    stop.wait(0.01)  # polling with a deadline (the flood's limit)
stop.wait(end - time.monotonic())
stop.set()
for t in threads:
    t.join(3)
print(json.dumps(counts), flush=True)
"""


def memory(pid: int) -> dict[str, float]:
    """VmHWM (peak) and VmRSS of a process, in MB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


@contextlib.contextmanager
def flood(port: int, idle: int, garbage: int, limit: float):
    """IDLE + GARBAGE connections held against ``port`` from threads of another process; yields a dict
    that holds the flood's counts once it has ended."""
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOOD, str(port), str(idle), str(garbage), str(limit)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    counts: dict = {}
    try:
        # bounded by the flood's limit: every connection opened, and the first ones already closed and re-opened
        first = proc.stdout.readline().strip()
        assert first == "flooding", f"the flood never reached full strength: {first or 'no output'}"
        yield counts
    finally:
        proc.stdin.close()  # the flood ends
        try:
            proc.wait(10)
            counts.update(json.loads(proc.stdout.read().strip().splitlines()[-1]))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)


@pytest.mark.slow
def test_a_worker_trains_at_full_speed_under_a_flood_of_idle_and_garbage_connections(tmp_path):
    """100 idle and 100 garbage connections, re-opened as the shard closes them, against a psgd-server
    process with a token: a worker started afterwards trains at 0.8x or more of its undisturbed rate (a 0.5x
    floor is asserted, see below), and
    the shard's peak memory grows by 50 MB at most.  Before the fix the worker could not even connect.

    Softmax regression (a few hundred microseconds a step) is the hardest case: whatever the flood costs
    the shard shows in every step.  Each run trains a fresh rank of an async job, ~2800 steps; undisturbed
    and disturbed runs alternate, three each, and their medians are compared."""
    job = make_job(
        "model.name=softmax",
        "cluster.workers=8",
        "cluster.shards=1",
        "cluster.policy=async",
        "train.epochs=250",
        "train.batch_size=16",
        "train.eval_every=0",
        "cluster.request_timeout=20",
        "cluster.join_timeout=600",
        "cluster.lease_seconds=600",
    )
    path = tmp_path / "job.toml"
    path.write_text(to_toml(job.to_dict()))
    log_path = tmp_path / "shard.log"
    with open(log_path, "w") as log_file:
        shard = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "psgd.cli.server",
                "-c",
                str(path),
                "--shard",
                "0",
                "--bind",
                "127.0.0.1:0",
                "--token",
                TOKEN,
            ],
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
    try:
        found = wait_for(
            lambda: re.search(r"serving on (\S+), data port (\d+)", log_path.read_text()), 60, "the shard to start"
        )
        address, data_port = found.group(1), int(found.group(2))
        rates: dict[str, list[float]] = {"undisturbed": [], "disturbed": []}
        counts = []
        rank = 0

        def run(kind: str) -> None:
            nonlocal rank
            walls = []
            result = run_worker(
                job, rank, [address], progress=False, token=TOKEN, on_step=lambda point: walls.append(point["wall"])
            )
            rank += 1
            assert result.steps == len(walls) > 50
            skip = 10  # the first steps warm up
            rates[kind].append((len(walls) - 1 - skip) / (walls[-1] - walls[skip]))

        run("undisturbed")  # warms up this process too; not counted
        rates["undisturbed"].clear()
        peak = None
        for _ in range(3):
            run("undisturbed")
            peak = peak or memory(shard.pid)  # the undisturbed peak: before any flood
            with flood(data_port, idle=100, garbage=100, limit=30) as count:
                run("disturbed")
                during = memory(shard.pid)
            counts.append(count)
        after = memory(shard.pid)
        undisturbed, disturbed = (statistics.median(rates[k]) for k in ("undisturbed", "disturbed"))
        print(
            f"steps/s undisturbed {undisturbed:.0f} {[round(r) for r in rates['undisturbed']]}, disturbed "
            f"{disturbed:.0f} {[round(r) for r in rates['disturbed']]} ({disturbed / undisturbed:.2f}x); shard "
            f"VmHWM {peak['VmHWM']:.1f} MB undisturbed, {after['VmHWM']:.1f} MB after, VmRSS {during['VmRSS']:.1f} "
            f"MB during the last flood; flood {counts}"
        )
        assert all(c["connections"] > 200 and c["told_why"] > 100 for c in counts), counts
        # The goal is 0.8x (figures in benchmarks/RESULTS.md, from quiet runs of this test); on a shared
        # 2-core machine a neighbour's load moves single runs by 20-30%, so the test holds a floor that still
        # tells a working defence (0.9x when quiet) from a broken one (the worker locked out, or crawling).
        assert disturbed >= 0.5 * undisturbed, rates
        assert after["VmHWM"] - peak["VmHWM"] <= 50, (peak, after)
    finally:
        end_all([shard])
    refusals = [line for line in log_path.read_text().splitlines() if "refused" in line]
    assert len(refusals) <= 60, f"{len(refusals)} log lines about refusals"


# -- the gRPC port ------------------------------------------------------------------------------------------
#: The shard's descriptors, as ``ulimit -n`` in the shell of the user who starts it sets them.
DESCRIPTORS = 256


def checkpointed(root: Path) -> int:
    """The newest version checkpointed under ``root`` (-1: none)."""
    found = [int(p.stem.split("-")[1]) for p in root.glob("**/ckpt-*.json")]
    return max(found, default=-1)


@pytest.mark.slow
def test_idle_connections_to_the_grpc_port_up_to_the_descriptor_limit_leave_a_shard_working(tmp_path):
    """More idle connections to a shard's gRPC port than the shard has descriptors, none with the token: the shard
    still answers Status, a worker that comes then joins and trains, and checkpoints go on being written, with no
    thread of the shard dead.  Before the bound, every descriptor went to the flood: Status timed out, the worker
    never joined, and the checkpoint thread died of "Too many open files", never to write again."""
    job = tiny_job("cluster.workers=1")
    path = tmp_path / "job.toml"
    path.write_text(to_toml(job.to_dict()))
    root, log_path = tmp_path / "ckpt", tmp_path / "shard.log"
    exe = Path(sys.executable).with_name("psgd-server")
    argv = " ".join(
        [
            str(exe) if exe.exists() else f"{sys.executable} -m psgd.cli.server",
            "-c",
            str(path),
            "--shard",
            "0",
            "--bind",
            "127.0.0.1:0",
            "--checkpoint-dir",
            str(root),
            "--checkpoint-every",
            "0.2",
        ]
    )
    with open(log_path, "w") as log_file:  # started as a user with `ulimit -n` in their shell starts it
        shard = subprocess.Popen(
            ["bash", "-c", f"ulimit -n {DESCRIPTORS} && exec {argv} --token {TOKEN}"],
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
    held: list[socket.socket] = []
    try:
        found = wait_for(lambda: re.search(r"serving on (\S+),", log_path.read_text()), 60, "the shard to start")
        address = found.group(1)
        port = int(address.rpartition(":")[2])
        job = job.override("cluster.servers", [address])
        wait_for(lambda: checkpointed(root) >= 0, 30, "the shard's first checkpoint")
        for _ in range(DESCRIPTORS + 64):  # more than the shard has descriptors, all held, none sending a byte
            try:
                held.append(dial(port, timeout=1.0))
            except OSError:  # the listen backlog is full: the shard accepts no more just now
                break
        assert len(held) > DESCRIPTORS / 2, f"only {len(held)} connections opened"

        def status() -> subprocess.CompletedProcess:
            psgd = Path(sys.executable).with_name("psgd")
            return subprocess.run(
                [str(psgd), "status", "--sample", "0", "--timeout", "10", "--token", TOKEN, "--json", address],
                capture_output=True,
                text=True,
                timeout=60,
            )

        asked = status()
        assert asked.returncode == 0, asked.stdout + asked.stderr
        results = train_all(job, timeout=90)  # a worker that comes now joins and trains
        assert results[0].steps > 0
        wait_for(
            lambda: checkpointed(root) >= results[0].steps,
            30,
            f"a checkpoint of version {results[0].steps} (the newest is {checkpointed(root)})",
        )
        asked = status()
        assert asked.returncode == 0, asked.stdout + asked.stderr
    finally:
        for sock in held:
            sock.close()
        end_all([shard])
    text = log_path.read_text()
    assert "Exception in thread" not in text and "Traceback" not in text, text[-3000:]
