"""The clients of the faults that come from outside a job's processes, started from the observer's host: the
``hostile`` fault's idle connections and connections sending random bytes against the shards' ports
(:data:`HOSTILE`), the stopped worker's pull that the ``stop-mid-pull`` fault leaves unfinished
(:data:`HOLD`), the ``trickled-push`` fault's pushes sent a byte at a time (:data:`TRICKLE`), and the
``outsider``'s calls in a live worker's name without its registration (:data:`OUTSIDER`), the ``squatter``
at a dead shard process's address (:data:`SQUATTER`), the ``insider-follower``'s claims to be a primary's replica
(:data:`FOLLOW_AS`), and the push made after a primary restarted at the job's end (:data:`PUSH_ONCE`).  The
``flood``'s idle connections are ``psgd bench flood``'s (:func:`psgd.bench.flood.start_flood`)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import time
from collections.abc import Sequence
from typing import Any

from psgd.wire import protocol
from psgd.wire.tls import NO_TLS

HOSTILE = """
import json, sys
from psgd.bench.chaos.hostile import hostile
print(json.dumps(hostile(**json.loads(sys.argv[1]))))
"""

HOLD = """
import json, sys
from psgd.bench.chaos.hostile import hold_pulls
print(json.dumps(hold_pulls(**json.loads(sys.argv[1]))))
"""

TRICKLE = """
import json, sys
from psgd.bench.chaos.hostile import trickle_pushes
print(json.dumps(trickle_pushes(**json.loads(sys.argv[1]))))
"""

OUTSIDER = """
import json, sys
from psgd.bench.chaos.hostile import outsider
print(json.dumps(outsider(**json.loads(sys.argv[1]))))
"""

SQUATTER = """
import json, sys
from psgd.bench.chaos.hostile import squat
print(json.dumps(squat(**json.loads(sys.argv[1]))))
"""

FOLLOW_AS = """
import json, sys
from psgd.bench.chaos.hostile import follow_as
print(json.dumps(follow_as(**json.loads(sys.argv[1]))))
"""

PUSH_ONCE = """
import json, sys
from psgd.bench.chaos.hostile import push_once
print(json.dumps(push_once(**json.loads(sys.argv[1]))))
"""


def hostile(targets: Sequence[Sequence[Any]], count: int, seconds: float, seed: int = 0) -> dict:
    """Hold ``count`` idle TCP connections and ``count`` connections sending random bytes against each
    (host, port) for ``seconds``; reconnects those the peer closes (bounded).  Returns what happened."""
    rng = random.Random(seed)
    stats = {"opened": 0, "refused": 0, "closed_by_peer": 0, "bytes_sent": 0}
    budget = [20 * count * len(targets)]  # connection attempts in all, reconnections included

    def connect(host: str, port: int) -> socket.socket | None:
        if budget[0] <= 0:
            return None
        budget[0] -= 1
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(1.0)
        try:
            s.connect((host, int(port)))
        except OSError:
            stats["refused"] += 1
            s.close()
            return None
        s.setblocking(False)
        stats["opened"] += 1
        return s

    idle = [connect(h, p) for h, p in targets for _ in range(count)]
    noisy = [[connect(h, p), (h, p)] for h, p in targets for _ in range(count)]
    end = time.monotonic() + seconds
    for _ in range(int(seconds / 0.05) + 1):
        if time.monotonic() >= end:
            break
        for pair in noisy:
            s, (host, port) = pair
            if s is None:
                pair[0] = connect(host, port)
                continue
            try:
                stats["bytes_sent"] += s.send(rng.randbytes(rng.randint(1, 512)))
            except BlockingIOError:
                pass
            except OSError:
                stats["closed_by_peer"] += 1
                s.close()
                pair[0] = None
        time.sleep(0.05)  # the pace of the noise, not synchronization
    for s in idle + [pair[0] for pair in noisy]:
        if s is None:
            continue
        with contextlib.suppress(OSError):
            if s.recv(1) == b"":
                stats["closed_by_peer"] += 1
        s.close()
    return stats


def hold_pulls(
    targets: Sequence[Sequence[Any]], sizes: Sequence[int], worker: int, plan_hash: str, seconds: float
) -> dict:
    """Worker ``worker``'s pull from each (host, data port) whose shard holds ``sizes`` bytes of weights, asked
    for and left unfinished for ``seconds``, as a worker stopped in the middle of it leaves it.  Made from outside
    the worker's process, it lacks the key of the worker's registration: a shard refuses its hello while the rank
    is live (counted as refused), and serves it as a stranger's only once the rank is not.  Over shared
    memory where the shard offers it (answered, its version never released), else over TCP (a small receive
    window, nothing read: the shard's read of a model that fits the socket buffers ends once its bytes are in
    them).  The connections are a worker's own (psgd.link.shm, psgd.link.tcp).  Returns what was left
    unfinished."""
    from psgd.link import LinkError
    from psgd.link.shm import NoSegment, ShmConnection
    from psgd.link.tcp import DataConnection

    stats = {"unfinished": 0, "shm": 0, "refused": 0}
    held: list = []
    try:
        for (host, port), size in zip(targets, sizes):
            try:
                try:
                    conn = ShmConnection(host, int(port), worker, plan_hash, "", 5.0, NO_TLS, "pull", int(size))
                except NoSegment:  # no shared memory with this shard: its data port as it is
                    conn = DataConnection(host, int(port), worker, plan_hash, timeout=5.0)
                held.append(conn)
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                conn._send(protocol.OP_PULL, worker, 0, 0, 0, [], 0)
                if isinstance(conn, ShmConnection):
                    conn._reply()  # answered: its version is held until a release that never comes
                    stats["shm"] += 1
                stats["unfinished"] += 1
            except (OSError, protocol.WireError, LinkError):
                stats["refused"] += 1
        time.sleep(seconds)  # how long the pull stays unfinished is the fault
    finally:
        for conn in held:
            conn.close()
    return stats


def trickle_pushes(
    targets: Sequence[Sequence[Any]],
    sizes: Sequence[int],
    worker: int,
    unregistered: int,
    plan_hash: str,
    seconds: float,
    pace: float = 0.25,
) -> dict:
    """Against each (host, data port) whose shard holds ``sizes`` bytes: ``unregistered`` connections that say
    hello as an observer (no worker: never registered) and one as worker ``worker`` (live, but this process has
    not its registration's key: refused at its hello while the rank is live), each
    sending the header of a push of the shard's size and then its payload one byte every ``pace`` seconds,
    until the shard closes it or ``seconds`` pass.  The token is the environment's, as a worker's.  Returns how
    many were opened and refused, how many the shard closed, and the longest any stayed open (seconds)."""
    from psgd.link import LinkError
    from psgd.link.tcp import DataConnection

    token = os.environ.get("PSGD_TOKEN", "")
    stats = {"opened": 0, "refused": 0, "closed_by_peer": 0, "longest": 0.0, "open_at_end": 0}
    conns: list[tuple[Any, float]] = []
    try:
        for (host, port), size in zip(targets, sizes):
            for who in [protocol.OBSERVER] * unregistered + [worker]:
                try:
                    conn = DataConnection(host, int(port), who, plan_hash, token, timeout=5.0)
                    conn._send(protocol.OP_PUSH, who, 1 << 30, 0, 0, [], int(size))
                except (OSError, protocol.WireError, LinkError):
                    stats["refused"] += 1
                    continue
                conn.sock.setblocking(False)
                conns.append((conn, time.monotonic()))
                stats["opened"] += 1
        end = time.monotonic() + seconds
        while conns and time.monotonic() < end:
            for item in list(conns):
                conn, began = item
                try:
                    while conn.sock.recv(4096):  # an error reply may come before the close
                        pass
                    closed = True
                except BlockingIOError:
                    try:
                        conn.sock.send(b"\0")
                        closed = False
                    except BlockingIOError:
                        closed = False
                    except OSError:
                        closed = True
                except OSError:
                    closed = True
                if closed:
                    stats["closed_by_peer"] += 1
                    stats["longest"] = round(max(stats["longest"], time.monotonic() - began), 2)
                    conns.remove(item)
                    conn.close()
            time.sleep(pace)  # the trickle's pace is the fault
        stats["open_at_end"] = len(conns)
        if conns:
            stats["longest"] = round(max([stats["longest"]] + [time.monotonic() - b for _, b in conns]), 2)
    finally:
        for conn, _ in conns:
            conn.close()
    return stats


def outsider(targets: Sequence[Sequence[Any]], slices: Sequence[Sequence[dict]], worker: int, plan_hash: str) -> dict:
    """What a process that holds the job's token (the environment's) but never registered tries against each shard
    (gRPC address, data port; its slices as dicts): a push in live worker ``worker``'s name at a clock no worker
    reaches, a pull, Done and Rollback in its name (with a registration key it guessed), following the shard with
    the token in its hello, and a Status without the token.  Every one must be refused.  Returns how many were
    tried and refused, and what was accepted."""
    import secrets
    from dataclasses import replace

    from psgd.link import LinkError, open_link
    from psgd.link.base import Endpoint, ProtocolError
    from psgd.partition import Slice
    from psgd.wire.codec import codec_for

    token = os.environ.get("PSGD_TOKEN", "")
    stats: dict[str, Any] = {"tried": 0, "refused": 0, "accepted": []}
    for k, ((address, data_port), held) in enumerate(zip(targets, slices)):
        ours = [Slice(**d) for d in held]
        ep = Endpoint(address, k, ours, worker, plan_hash, token, request_timeout=10.0)
        link, bare = open_link("grpc", ep), open_link("grpc", replace(ep, token=""))
        link.control.registration = secrets.token_hex(16)  # a guess at the worker's key
        buffers = [bytearray(sl.nbytes) for sl in ours]
        host = address.rpartition(":")[0].strip("[]")
        tries = {
            f"a push as worker {worker} at clock 10^12": lambda: link.push(
                10**12, 0, codec_for(None), [memoryview(b) for b in buffers]
            ),
            f"a pull as worker {worker}": lambda: link.pull(0, [memoryview(b) for b in buffers]),
            f"Done as worker {worker}": lambda: link.done(10**12),
            f"Rollback in worker {worker}'s name": lambda: link.rollback(0, "an outsider's cause"),
            "Status without the token": bare.status,
            "following with the token in its hello": lambda: _follow_in_clear(host, int(data_port), token, plan_hash),
        }
        try:
            for what, call in tries.items():
                stats["tried"] += 1
                try:
                    call()
                except (LinkError, ProtocolError, protocol.WireError, OSError):
                    stats["refused"] += 1
                else:
                    stats["accepted"].append(f"shard {k}: {what}")
        finally:
            link.close()
            bare.close()
    return stats


def _follow_in_clear(host: str, port: int, token: str, plan_hash: str) -> None:
    """A hello that asks to follow the shard and sends the token itself (a peer proves it instead); returns when
    it is accepted, raises WireError when it is refused."""
    body = json.dumps({"token": token, "plan_hash": plan_hash, "follow": True}).encode()
    with contextlib.closing(socket.create_connection((host, port), timeout=5.0)) as sock:
        protocol.send_buffers(
            sock,
            [
                protocol.REQUEST.pack(protocol.DATA_MAGIC, protocol.OP_HELLO, 0, protocol.OBSERVER, 0, 0, len(body)),
                body,
            ],
        )
        magic, op, _, _, _, _, _ = protocol.recv_struct(sock, protocol.REPLY)
        if magic != protocol.DATA_MAGIC or op != 0:
            raise protocol.WireError("refused")


def squat(address: str, shard: int, seconds: float, replay_to: str = "") -> dict:
    """A process without the job's token at the gRPC address of shard ``shard``'s dead process, for ``seconds``: it
    answers every Status as the shard's primary that took over 99 times (a claim to lead), and keeps what each
    caller sent; then it replays each call it heard, as it heard it, to ``replay_to`` (the live process of the
    pair).  Returns whether it could bind the address, how many calls came, whether any carried the job's token
    (the environment's: this process knows it only to look for it) or any replay was answered ("problems")."""
    from concurrent import futures

    import grpc

    from psgd.proto import ps_pb2, ps_pb2_grpc
    from psgd.wire.channel import open_channel

    token = os.environ.get("PSGD_TOKEN", "")
    heard: list[tuple] = []

    class Squatter(ps_pb2_grpc.ParameterServerServicer):
        def Status(self, request, context):
            heard.append(tuple((m.key, m.value) for m in context.invocation_metadata() if m.key == "authorization"))
            return ps_pb2.StatusReply(
                shard=shard, role="primary", version=10**9, data_port=1, counters_json=json.dumps({"failovers": 99})
            )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    ps_pb2_grpc.add_ParameterServerServicer_to_server(Squatter(), server)
    try:
        bound = bool(server.add_insecure_port(address))
    except RuntimeError:
        bound = False
    if bound:
        server.start()
        time.sleep(seconds)  # how long it squats is the fault
        server.stop(0)
    answered = 0
    if replay_to:
        with open_channel(replay_to) as channel:  # no token of its own: only what it heard
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            for metadata in heard[:20]:
                try:
                    stub.Status(ps_pb2.StatusRequest(), timeout=2.0, metadata=metadata)
                    answered += 1
                except grpc.RpcError:
                    pass
    said = [" ".join(str(v) for _, v in h) for h in heard]
    problems = [f"a process without the token at {address} was sent the job's token"] * (
        bool(token) and any(token in s for s in said)
    )
    if answered:
        problems.append(
            f"the process at {replay_to} answered {answered} call(s) that a process without the token "
            f"heard at {address} and replayed"
        )
    return {"bound": bound, "calls": len(heard), "problems": problems}


def follow_as(host: str, port: int, claims: Sequence[str], plan_hash: str) -> dict:
    """A holder of the job's token (the environment's) asks to follow the primary whose data port is ``host``:``port``
    once per address of ``claims``, saying each time that it is the replica listening there (with a ticket of its
    own, which the process at that address does not hold).  Each must be refused: the connection closed instead of
    the primary's state sent.  Returns how many were tried and refused, and which were accepted."""
    import secrets

    from psgd.server.durable import stream

    token = os.environ.get("PSGD_TOKEN", "")
    stats: dict[str, Any] = {"tried": 0, "refused": 0, "accepted": []}
    for claim in claims:
        stats["tried"] += 1
        try:
            sock = stream.connect(host, int(port), claim, token, plan_hash, NO_TLS, 10.0, secrets.token_hex(16))
        except protocol.WireError:
            stats["refused"] += 1
            continue
        try:  # the primary asks at the claimed address first (a Status call): then it sends its state, or closes
            magic, kind = protocol.recv_struct(sock, stream.FRAME)[:2]
            if magic == stream.MAGIC and kind == stream.STATE:
                stats["accepted"].append(f"following as the replica at {claim}")
            else:
                stats["refused"] += 1
        except (protocol.WireError, OSError):
            stats["refused"] += 1
        finally:
            sock.close()
    return stats


def push_once(config: str, worker: int, timeout: float) -> dict:
    """Worker ``worker`` of the job file ``config`` registers again (with the environment's token) and pushes one
    gradient of zeros at the clock the shards give it, as a worker that comes back after the job's end does; returns
    that clock and each shard's outcome."""
    import numpy as np

    from psgd.config import Deadlines, JobConfig
    from psgd.job import describe_job
    from psgd.worker.client import PSClient

    job = JobConfig.load(config)
    plan = describe_job(job).plan
    zeros = {s.name: np.zeros(s.shape, dtype=s.dtype) for s in plan.specs}
    with PSClient(
        job.cluster.servers,
        plan,
        worker,
        deadlines=Deadlines(request_timeout=timeout),
        recovery=job.cluster.recovery,
        config=job,
        token=os.environ.get("PSGD_TOKEN", ""),
    ) as client:
        clock = client.register()
        return {"clock": clock, "outcomes": [r.outcome for r in client.push(clock, zeros)]}
