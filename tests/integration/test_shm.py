"""The same-host link through shared memory: segments (names, who may map them), who gets one, hostile
requests over it, consistency under concurrent pushes, the fallback to TCP, and no segment left behind
after a shard or a worker is killed.

The hostile-input shard is test_datapath's (sync softmax in float64, one shard, worker 0 registered,
round 0 never closes), so no valid push changes its weights.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import by_hand_env, make_job, run_threads, shards, wait_for
from test_datapath import (  # noqa: F401  (fixtures: test_datapath's hostile-input shard)
    FATAL_PUSHES,
    HOSTILE_SETS,
    INVALID,
    IO,
    LR,
    OK,
    UNAUTHENTICATED,
    Shard,
    assert_closed,
    assert_serves,
    dial,
    digits64,
    expect,
    hostile,
    request,
    send_hello,
    valid_gradient,
)

import psgd
from psgd.config import Deadlines, Links, to_toml
from psgd.errors import Code
from psgd.job import describe_job
from psgd.link.shm import SHARED_FROM_BYTES, ShmData
from psgd.server import build_shard
from psgd.server.net import handout as handout_module
from psgd.server.net.datapath import DataServer
from psgd.server.net.handout import Handout
from psgd.server.net.service import ShardServer
from psgd.wire import protocol, segment
from psgd.wire.proofs import Prover
from psgd.wire.sweep import PARALLEL_BYTES
from psgd.worker.client import PSClient

pytestmark = [
    pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in reduce:RuntimeWarning"),
    pytest.mark.lacks(not segment.host_id(), reason="this machine's /proc does not say who shares memory"),
]

PY = sys.executable


@pytest.fixture
def shard(hostile):
    """The hostile-input shard; after the test it must still serve, with its weights unchanged, and hold no
    push segment (its connections have ended)."""
    yield hostile
    assert_serves(hostile)
    wait_for(lambda: not pushes_mapped(hostile.core.fingerprint), IO, "the push segments to be closed")


def pushes_mapped(job: str) -> list[str]:
    """This process's mappings of job ``job``'s push segments (the in-process shards' and the test's)."""
    return [n for n in segment.mapped(os.getpid(), job) if n.endswith("-push")]


@contextlib.contextmanager
def with_segment(shard: Shard, purpose: str, worker: int = 0, port: int | None = None, token: str = ""):
    """A raw data connection that asked for a ``purpose`` segment, and the segment, mapped."""
    sock = dial(shard.port if port is None else port)
    proof = Prover(token, f"127.0.0.1:{sock.getpeername()[1]}").prove("hello")
    body = json.dumps({"proof": proof, "plan_hash": shard.plan.hash, "shm": purpose, "key": shard.key(worker)}).encode()
    send_hello(sock, shard.plan.hash, worker=worker, body=body)
    magic, status, _, _, _, _, size = protocol.recv_struct(sock, protocol.REPLY)
    assert magic == protocol.DATA_MAGIC and status == 0
    text = bytearray(size)
    protocol.recv_exact(sock, memoryview(text))
    offer = json.loads(text)
    seg = segment.attach(offer, offer["bytes"], writable=purpose == "push")
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
    return Code.of(status), outcome, version, size, message


# --- segments -----------------------------------------------------------------------------------


@pytest.fixture
def handout():
    h = Handout("0123abcd", 3).start()
    yield h
    h.stop()


def test_a_segment_is_a_sealed_memory_file_handed_over_for_a_ticket_and_checked_before_it_is_mapped(
    handout, monkeypatch
):
    seg = segment.create("0123abcd", 3, "push", 4096)

    def fresh(**changes) -> dict:
        return {**handout.offer(seg), **changes}

    try:
        offer = fresh()
        assert offer["name"] == f"psgd-0123abcd-s3-{os.getpid()}-push"
        assert offer["socket"].startswith(f"@psgd-0123abcd-s3-{os.getpid()}-") and "fd" not in offer
        assert not list(Path("/dev/shm").glob("*0123abcd*"))  # no file to remove anywhere
        for bad, words in [
            (fresh(nonce="00" * 16), "does not carry the nonce"),
            (fresh(name="psgd-0123abcd-s3-1-push"), "is not the memory file"),
            (fresh(name="../../etc/passwd"), "not the name of a psgd segment"),
            (fresh(socket="@elsewhere"), "not the name of a psgd shard's socket"),
            (fresh(ticket="00" * 32), "handed nothing over"),
            ({"name": "x"}, "not a segment offer"),
        ]:
            with pytest.raises(segment.SegmentError, match=words):
                segment.attach(bad, 4096)
        with pytest.raises(segment.SegmentError, match="is not 4064 bytes long"):
            segment.attach(fresh(), 4000)
        other = segment.attach(offer, 4096)
        with pytest.raises(segment.SegmentError, match="handed nothing over"):
            segment.attach(offer, 4096)  # a ticket is good once
        monkeypatch.setattr(handout_module, "TICKET_SECONDS", 0.0)
        with pytest.raises(segment.SegmentError, match="handed nothing over"):
            segment.attach(fresh(), 4096)  # and only for a while
        monkeypatch.undo()
        seg.data[:5] = b"hello"
        assert bytes(other.data[:5]) == b"hello"  # one memory
        other.close()
        reader = segment.attach(fresh(), 4096, writable=False)
        with pytest.raises(TypeError):
            reader.data[:1] = b"x"  # mapped read-only
        reader.close()
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 0)  # sealed: nobody can cut the memory from under the shard
        assert segment.mapped(os.getpid(), "0123abcd") == [offer["name"]]
        stale = fresh()
    finally:
        seg.close()
    assert segment.mapped(os.getpid(), "0123abcd") == []  # closed and unmapped
    late = segment.attach(stale, 4096)  # a ticket hands over its own segment's file, never what took its number
    assert late.name == offer["name"] and bytes(late.data[:5]) == b"hello"
    late.close()


def test_the_weights_handed_over_cannot_be_written_through_any_descriptor(handout):
    seg = segment.create("0123abcd", 3, "weights", 4096, slots=2)
    try:
        seg.slot(1)[:5] = b"hello"  # the shard's own mapping, made before the seal, stays writable
        offer = handout.offer(seg)
        fd = segment._handed(offer["socket"], bytes.fromhex(offer["ticket"]))
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(fd, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x", segment.HEADER)
            again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # a new description of the same file
            try:
                with pytest.raises(PermissionError):
                    mmap.mmap(again, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(again)
            with mmap.mmap(fd, segment.HEADER + 2 * 4096, prot=mmap.PROT_READ) as view:
                assert view[segment.HEADER + 4096 : segment.HEADER + 4101] == b"hello"
        finally:
            os.close(fd)
    finally:
        seg.close()


#: what a process of the shard's own user, without the token, tries against it (prints what it got)
ATTACK = r"""
import json, os, socket, sys
pid, out, opened, fds = int(sys.argv[1]), {}, [], []
try:
    entries = os.listdir(f"/proc/{pid}/fd")
    out["fd_listing"] = "listed"
except OSError as exc:
    entries, out["fd_listing"] = [], type(exc).__name__
for n in entries:
    try:
        if "memfd:psgd" in os.readlink(f"/proc/{pid}/fd/{n}"):
            os.close(os.open(f"/proc/{pid}/fd/{n}", os.O_RDWR))
            opened.append(n)
    except OSError:
        pass
try:
    open(f"/proc/{pid}/mem", "rb").close()
    out["mem"] = "opened"
except OSError as exc:
    out["mem"] = type(exc).__name__
names = [line.split()[-1] for line in open("/proc/net/unix").read().splitlines()[1:] if "@psgd-" in line]
for name in names:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect("\0" + name[1:])
        s.sendall(os.urandom(32))
        fds += socket.recv_fds(s, 1, 4)[1]
print(json.dumps({**out, "opened": opened, "sockets": len(names), "fds": len(fds)}))
"""


def _as_one_user(folder: Path) -> list[str]:
    """What runs a command as the user the shard and the attacker share: this one, or nobody when the tests run
    as root (who may open anything).  For nobody, a mount namespace of the command's own lays what this Python
    and psgd need over an empty folder in place of each folder on their way that only root may enter (/root,
    a virtual environment in a private temporary folder), at the same paths."""
    if os.geteuid() != 0:
        return []
    needed = {Path(p).resolve() for p in (sys.executable, sys.prefix, sys.base_prefix, Path(psgd.__file__).parent)}
    closed: dict[Path, set[str]] = {}  # a folder others may not enter -> its entries on the way to what is needed
    for path in needed:
        for parent in path.parents:
            if parent != Path("/") and not parent.stat().st_mode & 0o001:
                closed.setdefault(parent, set()).add(path.relative_to(parent).parts[0])
    lines, n = ["set -e"], 0
    for where in sorted(closed, key=lambda d: len(d.parts)):  # outer folders first
        entries = sorted(closed[where])
        for i, name in enumerate(entries, start=n):
            (folder / f"hold{i}").mkdir()
            lines.append(f'mount --bind "{where}/{name}" "{folder}/hold{i}"')
        lines.append(f'mount -t tmpfs -o mode=0755,size=1m psgd-test "{where}"')
        for i, name in enumerate(entries, start=n):
            lines.append(f'mkdir "{where}/{name}" && mount --move "{folder}/hold{i}" "{where}/{name}"')
        n += len(entries)
    lines.append('exec setpriv --reuid=65534 --regid=65534 --clear-groups -- "$@"')
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", "\n".join(lines), "sh"]


@contextlib.contextmanager
def _shard_as_one_user(*sets: str) -> Iterator[tuple[list[str], dict, Path, str, subprocess.Popen]]:
    """Shard 0 of a job with token (async, shared memory) run as the user its workers and attackers share
    (:func:`_as_one_user`): yields that prefix, the environment with the token, the job file, the shard's
    address and its process."""
    folder = Path(tempfile.mkdtemp(prefix="psgd-shm-user-"))
    folder.chmod(0o777)
    job = make_job("cluster.policy=async", "cluster.shards=1", "cluster.transport=shm", *sets)
    job_path = folder / "job.toml"
    job_path.write_text(to_toml(job.to_dict()))
    job_path.chmod(0o644)
    env = {**os.environ, "PSGD_TOKEN": "s3cret-token-of-the-job", "HOME": str(folder)}
    user = _as_one_user(folder)
    shard = subprocess.Popen(
        [
            *user,
            PY,
            "-m",
            "psgd.cli.server",
            "-c",
            str(job_path),
            "--shard",
            "0",
            "--bind",
            "127.0.0.1:0",
            "--port-file",
            str(folder / "port"),
        ],
        env=env,
        cwd=folder,
        stdout=subprocess.DEVNULL,
        stderr=(folder / "shard.log").open("w"),
    )
    try:
        try:
            address = _wait_file(folder / "port", shard, "the shard's port file")
        except AssertionError:
            raise AssertionError(
                f"the shard, run as {user or 'this user'}, did not start: {(folder / 'shard.log').read_text()[-2000:]}"
            ) from None
        yield user, env, job_path, address, shard
        uid = next(
            line.split()[1]
            for line in Path(f"/proc/{shard.pid}/status").read_text().splitlines()
            if line.startswith("Uid:")
        )
        assert int(uid) == (65534 if user else os.getuid())  # the shard ran as the attacker's user, never root
    finally:
        shard.terminate()
        shard.wait(30)
        shutil.rmtree(folder, ignore_errors=True)


def _train(user: list[str], env: dict, job_path: Path, address: str, rank: int = 0) -> subprocess.Popen:
    """``psgd-worker --rank rank`` of the job, as ``user``."""
    return subprocess.Popen(
        [
            *user,
            PY,
            "-m",
            "psgd.cli.worker",
            "-c",
            str(job_path),
            "--rank",
            str(rank),
            "--servers",
            address,
            "--no-progress",
        ],
        env=env,
        cwd=job_path.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_process_of_the_shards_own_user_without_the_token_gets_no_segment():
    """Found: any process of the shard's user could open /proc/<shard>/fd/<n> (the weights' memory file) read-write
    and write NaN into the live weights.  Now the shard's /proc is closed to it and the descriptors go only for
    tickets; a worker with the token still trains through shared memory."""
    with _shard_as_one_user("model.name=softmax", "cluster.workers=1", "train.epochs=1") as (
        user,
        env,
        job_path,
        address,
        shard,
    ):
        worker = _train(user, env, job_path, address)
        _, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err[-2000:]
        assert "through shared memory" not in err  # no fallback line: it trained through it
        attacker_env = {k: v for k, v in env.items() if k != "PSGD_TOKEN"}
        attack = subprocess.run(
            [*user, PY, "-c", ATTACK, str(shard.pid)],
            env=attacker_env,
            cwd=job_path.parent,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert attack.returncode == 0, attack.stderr[-2000:]
        got = json.loads(attack.stdout)
        assert got["fd_listing"] == "PermissionError" and got["opened"] == [] and got["mem"] == "PermissionError"
        assert got["sockets"] >= 1 and got["fds"] == 0, got  # it found the socket; no ticket, no descriptor


#: a worker of the job (rank 1, with the token) that rewrites its push segment, zeros then NaN again and again,
#: while its pushes of zeros are read from it, then pulls the weights (prints what it got)
REWRITE = r"""
import json, sys, threading
import numpy as np
from psgd.config import Deadlines, JobConfig, Links
from psgd.job import describe_job
from psgd.worker.client import PSClient, PSError
job = JobConfig.load(sys.argv[1])
plan = describe_job(job).plan
zeros = {s.name: np.zeros(s.shape, s.dtype) for s in plan.specs}
got, stop = {"applied": 0, "refused": 0, "errors": []}, threading.Event()
with PSClient([sys.argv[2]], plan, 1, deadlines=Deadlines(request_timeout=10), links=Links(transport="shm"),
              config=job, token=sys.argv[4]) as client:
    client.register()
    client.push(0, zeros)
    link = client.links[0]
    seg = link.data.tcp._conns["push"].seg
    got["via"] = link.via
    values = np.frombuffer(seg.data, dtype=plan.specs[0].dtype, count=sum(s.size for s in plan.specs))

    def rewrite():
        while not stop.is_set():
            values[:] = np.nan
            values[:] = 0.0

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        clock = 1
        for _ in range(1, int(sys.argv[3])):
            try:
                client.push(clock, zeros)
                got["applied"] += 1
                clock += 1  # a refused push leaves the worker's clock where it was
            except PSError as exc:
                got["refused"] += 1
                if "non-finite" not in str(exc) and len(got["errors"]) < 3:
                    got["errors"].append(str(exc))
    finally:
        stop.set()
        writer.join()
    weights = {s.name: np.empty(s.shape, s.dtype) for s in plan.specs}
    client.pull(0, weights)
    got["finite"] = all(bool(np.isfinite(w).all()) for w in weights.values())
print(json.dumps(got))
"""


def test_a_push_rewritten_in_its_segment_while_the_shard_reads_it_never_reaches_the_weights():
    """Found: a push was checked in its segment and applied from it later, so its writer (a worker with the token)
    could rewrite the checked zeros with NaN and the weights became NaN.  Here the shard, the writer and another
    worker run as one non-root user; the writer rewrites its segment, zeros then NaN, all the time its pushes of
    zeros are read: each is applied as the zeros it was checked as or refused, and the other worker trains on."""
    with _shard_as_one_user(
        "model.name=mlp", "model.hidden=[256]", "cluster.workers=2", "optimizer.name=sgd", "train.epochs=2"
    ) as (user, env, job_path, address, shard):
        trainer = _train(user, env, job_path, address, rank=0)
        token_free = {k: v for k, v in env.items() if k != "PSGD_TOKEN"}
        attack = subprocess.run(
            [*user, PY, "-c", REWRITE, str(job_path), address, "400", env["PSGD_TOKEN"]],
            env=token_free,
            cwd=job_path.parent,
            capture_output=True,
            text=True,
            timeout=120,
        )
        out, err = trainer.communicate(timeout=120)
        assert attack.returncode == 0, attack.stderr[-2000:]
        got = json.loads(attack.stdout)
        assert got["via"] == "shm" and not got["errors"], got
        assert got["refused"] >= 1 and got["applied"] >= 1, got  # the rewrites landed while the shard read
        assert got["finite"], got
        assert trainer.returncode == 0, err[-2000:]


# --- who gets a segment -----------------------------------------------------------------------------


def test_a_pull_reads_the_shards_weights_and_keeps_its_slot_until_released(shard):
    with with_segment(shard, "pull") as (sock, seg, offer):
        assert offer["name"].endswith("-weights") and offer["bytes"] == shard.core.nbytes
        request(sock, protocol.OP_PULL)
        code, _, version, size, _ = shm_reply(sock)
        assert code == OK and size == shard.core.nbytes and version == 0
        assert bytes(seg.data[:size]) == shard.initial
        assert [r["worker"] for r in shard.core.store.reads()] == [0]  # a live read: its slot is kept for it
        request(sock, protocol.OP_RELEASE)
        wait_for(lambda: not shard.core.store.reads(), IO, "the release")


def test_a_push_segment_is_the_connections_and_goes_with_it(shard):
    with with_segment(shard, "push") as (sock, seg, offer):
        assert offer["name"].endswith("-push") and pushes_mapped(shard.core.fingerprint) == [offer["name"]]
        g = valid_gradient(shard.plan)
        seg.data[: g.nbytes] = g.tobytes()
        request(sock, protocol.OP_PUSH, size=g.nbytes)
        assert shm_reply(sock)[0] == OK
    wait_for(lambda: not pushes_mapped(shard.core.fingerprint), IO, "the shard to close the connection's segment")


@pytest.mark.parametrize("after", [protocol.OP_PULL, protocol.OP_PUSH, 9])
def test_a_pull_from_shared_memory_must_be_released_before_anything_else(shard, after):
    with with_segment(shard, "pull") as (sock, seg, _):
        request(sock, protocol.OP_PULL)
        assert shm_reply(sock)[0] == OK
        request(sock, after)
        expect(sock, INVALID, "must be answered with a release")
        assert_closed(sock)
    wait_for(lambda: not shard.core.store.reads(), IO, "the live read to end with the connection")


def test_a_release_without_a_pull_is_refused(shard):
    with with_segment(shard, "pull") as (sock, seg, _):
        request(sock, protocol.OP_RELEASE)
        expect(sock, INVALID, "a release without a pull")
        assert_closed(sock)


def test_a_pull_never_released_ends_with_its_connection_at_the_request_timeout(shard):
    data = DataServer(shard.core, request_timeout=1.0, idle_timeout=IO).start()
    try:
        with with_segment(shard, "pull", port=data.port) as (sock, seg, _):
            request(sock, protocol.OP_PULL)
            assert shm_reply(sock)[0] == OK
            assert len(shard.core.store.reads()) == 1
            began = time.monotonic()
            wait_for(lambda: not shard.core.store.reads(), IO, "the timeout to end the read")
            assert 0.8 <= time.monotonic() - began <= IO
            assert_closed(sock)
    finally:
        data.stop()


def test_a_token_protected_shard_makes_no_segment_before_the_token_is_right(shard):
    data = DataServer(shard.core, token="s3cret", request_timeout=IO, idle_timeout=IO).start()
    try:
        with dial(data.port) as sock:
            body = json.dumps({"proof": "wrong", "plan_hash": shard.plan.hash, "shm": "push"}).encode()
            send_hello(sock, shard.plan.hash, body=body)
            expect(sock, UNAUTHENTICATED, "wrong or replayed proof of the token")
        assert pushes_mapped(shard.core.fingerprint) == []  # no segment made for it
        with with_segment(shard, "push", port=data.port, token="s3cret") as (sock, seg, offer):
            g = valid_gradient(shard.plan)
            seg.data[: g.nbytes] = g.tobytes()
            request(sock, protocol.OP_PUSH, size=g.nbytes)
            code, outcome, _, _, _ = shm_reply(sock)
            assert code == OK and protocol.OUTCOMES[outcome] in ("accumulated", "duplicate")
    finally:
        data.stop()


@pytest.mark.parametrize(
    "worker, shm, words", [(-1, "pull", "workers only"), (0, "both", "not 'both'"), (0, "../x", "not '../x'")]
)
def test_an_observer_or_an_unknown_purpose_gets_no_segment(shard, worker, shm, words):
    with dial(shard.port) as sock:
        body = json.dumps({"plan_hash": shard.plan.hash, "shm": shm}).encode()
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
        seg.data[: g.nbytes] = g.tobytes()
        request(sock, protocol.OP_PUSH, size=g.nbytes)
        expect(sock, INVALID, "non-finite")
        assert shard.state() == before
        g[100] = 0.5
        seg.data[: g.nbytes] = g.tobytes()
        request(sock, protocol.OP_PUSH, size=g.nbytes)
        assert shm_reply(sock)[0] == OK


def test_what_is_checked_is_what_is_applied(monkeypatch):
    """A push was checked in its segment and applied from it: its writer, holding a pull open so that the
    apply waited, rewrote the checked gradient with NaN and the shard applied it (non-finite weights)."""
    job = make_job(*HOSTILE_SETS, "cluster.policy=async")
    core = build_shard(describe_job(job), 0)
    core.register(0, core.plan.hash)
    shard = Shard(core, ShardServer(core, "127.0.0.1:0", request_timeout=IO).start(), core.flat.tobytes())
    checked = core.store.unfit
    try:
        with with_segment(shard, "push") as (sock, seg, _):
            g = valid_gradient(shard.plan)
            seg.data[: g.nbytes] = g.tobytes()

            def check_then_rewrite(grads, largest=None):
                found = checked(grads, largest)
                seg.data[: g.nbytes] = np.full_like(g, np.nan).tobytes()  # the worker writes after the check
                return found

            monkeypatch.setattr(core.store, "unfit", check_then_rewrite)
            request(sock, protocol.OP_PUSH, size=g.nbytes)
            assert shm_reply(sock)[0] == OK
            assert core.version == 1
    finally:
        shard.server.stop(grace=1.0)
    assert np.isfinite(core.flat).all()
    initial = np.frombuffer(shard.initial, dtype=core.flat.dtype)
    assert np.allclose(core.flat, initial - LR / 2 * g)  # the checked gradient, at lr / workers


# --- consistency ------------------------------------------------------------------------------------


def test_a_pull_never_sees_half_an_update_while_pushes_are_applied(tmp_path):
    """Async, 2 shards of a model cut in many slices (updated by several threads): one worker pushes a
    gradient of ones, again and again, while another pulls.  Every update moves every weight by the same
    step (lr / 2: async applies each of 2 workers' pushes at lr / workers), so every pull must find weights
    that moved by one and the same multiple of that step everywhere, and its version must say how many."""
    lr = 0.5
    step = lr / 2
    job = make_job(
        "model.name=mlp",
        "model.hidden=[32768]",
        "train.dtype=float64",
        "optimizer.name=sgd",
        f"optimizer.lr={lr}",
        "cluster.policy=async",
        "cluster.workers=2",
        "cluster.shards=2",
        "cluster.transport=shm",
    )
    with shards(job) as (job, servers):
        plan = servers[0].core.plan
        assert all(s.core.nbytes >= PARALLEL_BYTES and len(s.core.slices) > 2 for s in servers)
        ones = {s.name: np.ones(s.shape) for s in plan.specs}
        with (
            PSClient(
                job.cluster.servers,
                plan,
                0,
                deadlines=Deadlines(request_timeout=IO),
                links=Links(transport="shm"),
                config=job,
            ) as pusher,
            PSClient(
                job.cluster.servers,
                plan,
                1,
                deadlines=Deadlines(request_timeout=IO),
                links=Links(transport="shm"),
                config=job,
            ) as puller,
        ):
            pusher.register(), puller.register()
            assert all(isinstance(link.data, ShmData) and link.shared for link in pusher.links + puller.links)
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
                        moved = np.concatenate(
                            [
                                (
                                    host[sl.var].reshape(-1)[sl.start : sl.stop]
                                    - initial[sl.var].reshape(-1)[sl.start : sl.stop]
                                )
                                for sl in plan.slices_for_shard(k)
                            ]
                        )
                        np.testing.assert_allclose(moved, -step * versions[k], rtol=0, atol=1e-9)
                return pushes

            assert run_threads([push, pull], timeout=120) == [pushes, pushes]
            assert len(set(seen) - {0, pushes}) >= 2  # pulls came while pushes were being applied
        assert [s.core.version for s in servers] == [pushes, pushes]


def test_a_retried_push_over_shared_memory_is_applied_once(monkeypatch):
    job = make_job(
        "model.name=softmax",
        "train.dtype=float64",
        "optimizer.name=sgd",
        "optimizer.lr=0.1",
        "cluster.policy=async",
        "cluster.workers=1",
        "cluster.shards=1",
        "cluster.transport=shm",
    )
    with shards(job) as (job, servers):
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
        with PSClient(
            job.cluster.servers,
            plan,
            0,
            deadlines=Deadlines(request_timeout=IO),
            links=Links(transport="shm"),
            config=job,
        ) as client:
            clock = client.register()
            assert client.links[0].shared
            before = server.core.flat.copy()
            replies = client.push(clock, grads)
        assert [r.outcome for r in replies] == ["duplicate"] and calls == ["applied", "duplicate"]
        np.testing.assert_array_equal(server.core.flat, before - 0.1 * 0.25)
        assert server.core.version == 1
        wait_for(lambda: not pushes_mapped(server.core.fingerprint), IO, "the push segments to be closed")


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
    plan = build_shard(describe_job(job), 0).plan
    with contextlib.nullcontext():
        with PSClient(
            job.cluster.servers,
            plan,
            rank,
            deadlines=Deadlines(request_timeout=IO),
            links=job.cluster.links,
            config=job,
        ) as client:
            clock = client.register()
            host = {s.name: np.empty(s.shape, dtype=s.dtype) for s in plan.specs}
            client.pull(clock, host)
            client.push(clock, {s.name: np.zeros(s.shape, dtype=s.dtype) for s in plan.specs})
            client.pull(clock + 1, host)
            return [(link.via, link.shared) for link in client.links]


def test_a_shard_offering_no_shared_memory_is_used_over_tcp_with_one_line_saying_why(caplog):
    job = make_job(
        "model.name=softmax", "cluster.policy=async", "cluster.workers=1", "cluster.shards=1", "cluster.transport=tcp"
    )
    with shards(job) as (job, servers):  # the shard's side says tcp: it offers no segments
        job = job.override("cluster.transport", "shm")
        assert _one_step(job, caplog) == [("tcp", False)]
        assert servers[0].data.shm is False
    lines = [r for r in caplog.records if "not through shared memory" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "offers no shared memory" in lines[0].getMessage()


def test_a_shard_on_another_host_is_used_over_tcp(caplog, monkeypatch):
    job = make_job("model.name=softmax", "cluster.policy=async", "cluster.workers=1", "cluster.shards=1")
    with shards(job) as (job, servers):  # it advertised this machine's identity; the worker now has another one
        monkeypatch.setattr(segment, "host_id", lambda: "another-host")
        assert _one_step(job, caplog) == [("tcp", False)]
        assert pushes_mapped(servers[0].core.fingerprint) == []  # it never asked for a segment
    lines = [r for r in caplog.records if "not through shared memory" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO  # transport = "auto": as expected, not a warning
    assert "on another host" in lines[0].getMessage()


@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_a_small_shard_is_used_over_tcp_unless_the_job_insists_on_shared_memory(caplog, transport):
    """A step of a small model over shared memory costs more than over the socket (the release, and the shard's
    wake-up for it): "auto" takes the socket for a shard of fewer than SHARED_FROM_BYTES, "shm" does not."""
    job = make_job(
        "model.name=softmax",
        "cluster.policy=async",
        "cluster.workers=1",
        "cluster.shards=1",
        f"cluster.transport={transport}",
    )
    with shards(job) as (job, servers):
        assert servers[0].core.nbytes < SHARED_FROM_BYTES
        assert _one_step(job, caplog) == ([("tcp", False)] if transport == "auto" else [("shm", True)])
    lines = [r for r in caplog.records if "not through shared memory" in r.getMessage()]
    if transport == "auto":
        assert len(lines) == 1 and lines[0].levelno == logging.INFO
        assert f"its slices take {servers[0].core.nbytes:,} bytes" in lines[0].getMessage()
        assert 'transport = "shm" uses it anyway' in lines[0].getMessage()  # the way to it, not what the job said
    else:
        assert lines == []


def test_a_segment_that_cannot_be_made_leaves_the_connection_on_tcp(caplog, monkeypatch, tmp_path):
    job = make_job(
        "model.name=softmax", "cluster.policy=async", "cluster.workers=1", "cluster.shards=1", "cluster.transport=shm"
    )
    with shards(job) as (job, _):

        def full(*args):
            raise segment.SegmentError("cannot reserve 5264 bytes of shared memory: [Errno 28] No space left on device")

        monkeypatch.setattr(segment, "create", full)
        assert _one_step(job, caplog) == [("tcp", False)]
    lines = [r for r in caplog.records if "not through shared memory" in r.getMessage()]
    assert len(lines) == 1 and "made no segment" in lines[0].getMessage()


# --- killed processes leave nothing behind ----------------------------------------------------------


def _server(job_path: Path, port_file: Path, log: Path, port: str = "127.0.0.1:0") -> subprocess.Popen:
    return subprocess.Popen(
        ["psgd-server", "-c", str(job_path), "--shard", "0", "--bind", port, "--port-file", str(port_file)],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        start_new_session=True,
        env=by_hand_env(),
    )


def _wait_file(path: Path, proc: subprocess.Popen, what: str, timeout: float = 60) -> str:
    def written() -> str:
        assert proc.poll() is None, f"{what} exited early"
        return path.exists() and path.read_text().strip()

    return wait_for(written, timeout, what)


def _worker(job_path: Path, address: str, metrics: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            "psgd-worker",
            "-c",
            str(job_path),
            "--rank",
            "0",
            "--servers",
            address,
            "--no-progress",
            "--metrics",
            str(metrics),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        start_new_session=True,
        env=by_hand_env(),
    )


def _stepping(metrics: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    def stepped() -> bool:
        assert proc.poll() is None, "the worker exited before its first step"
        return metrics.exists() and '"event": "step"' in metrics.read_text()

    wait_for(stepped, timeout, "the worker's first step")


@pytest.mark.parametrize("killed", ["shard", "worker"])
def test_no_segment_is_left_after_the_shard_or_the_worker_is_killed(tmp_path, killed):
    """Shard and worker map the weights and the worker's push segment, memory files with no name in any
    folder. A killed worker's push segment goes when the shard sees its connection end; a killed shard's
    go when the worker, reconnecting to the restarted shard, lets go of them: nothing is left."""
    job = make_job(
        "model.name=mlp",
        "model.hidden=[64]",
        "cluster.policy=async",
        "cluster.workers=1",
        "cluster.shards=1",
        "train.epochs=200",
        "cluster.transport=shm",
        "cluster.request_timeout=5",
    )
    job_path = tmp_path / "job.toml"
    job_path.write_text(to_toml(job.to_dict()))
    fp = build_shard(describe_job(job), 0).fingerprint
    shard = _server(job_path, tmp_path / "port", tmp_path / "shard.log")
    worker = again = None

    def of(proc) -> list[str]:
        return [f"psgd-{fp}-s0-{proc.pid}-{kind}" for kind in ("push", "weights")]

    try:
        address = _wait_file(tmp_path / "port", shard, "the shard's port file")
        worker = _worker(job_path, address, tmp_path / "m.jsonl", tmp_path / "worker.log")
        _stepping(tmp_path / "m.jsonl", worker)
        assert "through shared memory" not in (tmp_path / "worker.log").read_text()  # no fallback line
        assert segment.mapped(worker.pid, fp) == segment.mapped(shard.pid, fp) == of(shard)
        if killed == "worker":
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(30)
            wait_for(
                lambda: segment.mapped(shard.pid, fp) == [of(shard)[1]],
                30,
                "the shard to let go of the dead worker's push segment",
            )
        else:
            os.killpg(shard.pid, signal.SIGKILL)
            shard.wait(30)
            again = _server(job_path, tmp_path / "port2", tmp_path / "shard2.log", port=address)
            _wait_file(tmp_path / "port2", again, "the restarted shard's port file")
            wait_for(
                lambda: segment.mapped(worker.pid, fp) == of(again),
                60,
                "the worker to move to the restarted shard's segments and let go of the killed one's",
            )
        assert not list(Path("/dev/shm").glob(f"*{fp}*"))
    finally:
        for proc in (worker, shard, again):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
