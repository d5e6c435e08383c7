"""What a shard receives a push into: a bounded pool of receive buffers, and the gradient read off a socket or
out of a segment into one (decoded on the way where the job compresses gradients).  Shared by the data path
(:mod:`psgd.server.net.datapath`) and its combined push-and-pull."""

from __future__ import annotations

import socket
import threading

import numpy as np

from psgd.server.errors import ShardError
from psgd.wire import protocol
from psgd.wire.codec import Codec


class BufferPool:
    """At most ``limit`` receive buffers of ``nbytes`` each, reused across pushes.

    Bounds the memory concurrent pushes can take: the ``limit + 1``-th push
    waits (within its timeout) for a buffer instead of allocating one.
    """

    def __init__(self, nbytes: int, limit: int = 2):
        self.nbytes = nbytes
        self._free: list[bytearray] = []
        self._made = 0
        self._limit = limit
        self._cond = threading.Condition()

    def acquire(self, timeout: float) -> bytearray:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free or self._made < self._limit, timeout):
                raise ShardError(
                    "RESOURCE_EXHAUSTED", f"no receive buffer free within {timeout:.1f}s: too many pushes at once"
                )
            if self._free:
                return self._free.pop()
            self._made += 1
        return bytearray(self.nbytes)

    def release(self, buf: bytearray) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()


STAGE_ELEMS = 1 << 20


def decode_gradient(src: memoryview, buf: memoryview, codec: Codec, count: int) -> None:
    """Decode ``count`` compressed gradient values, written by ``codec`` into ``src`` (a segment), into ``buf``."""
    out = np.frombuffer(buf, dtype=np.float32, count=count)
    wire = np.frombuffer(src, dtype=np.uint16, count=count)
    for start in range(0, count, STAGE_ELEMS):
        stop = min(count, start + STAGE_ELEMS)
        codec.decode(wire[start:stop], out[start:stop])


def drain(conn: socket.socket, size: int, deadline: float) -> None:
    """Read and drop ``size`` bytes (a refused push's payload) by ``deadline``, holding no receive buffer."""
    scratch = memoryview(bytearray(min(size, 1 << 16)))
    while size > 0:
        n = min(size, len(scratch))
        protocol.recv_exact(conn, scratch[:n], deadline)
        size -= n


def receive_gradient(conn: socket.socket, buf: memoryview, codec: Codec, count: int, deadline: float) -> None:
    """Receive ``count`` gradient values into ``buf`` as ``codec`` wrote them, by ``deadline`` (monotonic).

    Compressed gradients (float16, bfloat16) are received in pieces into a
    small staging buffer and decoded into place, so they never need a second
    full-size buffer.
    """
    if not codec.compresses:
        protocol.recv_exact(conn, buf, deadline)
        return
    out = np.frombuffer(buf, dtype=np.float32, count=count)
    stage = np.empty(min(count, STAGE_ELEMS), dtype=np.uint16)
    for start in range(0, count, STAGE_ELEMS):
        n = min(STAGE_ELEMS, count - start)
        piece = stage[:n]
        protocol.recv_exact(conn, memoryview(piece), deadline)
        codec.decode(piece, out[start : start + n])
