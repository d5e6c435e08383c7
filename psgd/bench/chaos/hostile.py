"""The clients of the faults that come from outside a job's processes, started from the observer's host: the
``hostile`` fault's idle connections and connections sending random bytes against the shards' ports
(:data:`HOSTILE`), and the stopped worker's pull that the ``stop-mid-pull`` fault leaves unfinished
(:data:`HOLD`)."""

from __future__ import annotations

import contextlib
import random
import socket
import time
from typing import Any, Sequence

from psgd.link import protocol
from psgd.tls import NO_TLS


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



def hold_pulls(targets: Sequence[Sequence[Any]], sizes: Sequence[int], worker: int, plan_hash: str,
               seconds: float) -> dict:
    """Worker ``worker``'s pull from each (host, data port) whose shard holds ``sizes`` bytes of weights, asked
    for and left unfinished for ``seconds``, as a worker stopped in the middle of it leaves it: over shared
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
