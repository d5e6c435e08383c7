"""The ``hostile`` fault's client: idle connections and connections sending random bytes against the shards'
ports; :data:`HOSTILE` is the script a run starts it with (from the observer's host)."""

from __future__ import annotations

import contextlib
import random
import socket
import time
from typing import Any, Sequence


HOSTILE = """
import json, sys
from psgd.bench.chaos.hostile import hostile
print(json.dumps(hostile(**json.loads(sys.argv[1]))))
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

