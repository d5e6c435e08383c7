"""How a shard hands its shared-memory segments to the workers the data port let in, and to no one else.

A segment is a memory file the shard keeps open (:mod:`psgd.wire.segment`).  Its descriptor goes to
a worker over a Unix-domain socket (an abstract name, ``@psgd-<job>-s<shard>-<pid>-<random>``, so no
file is left anywhere) with SCM_RIGHTS, in exchange for a ticket: 32 random bytes that the data port
sends the worker in its answer to a hello that passed the token check, good once and for
TICKET_SECONDS.  A process that knows the socket's name (``/proc/net/unix`` lists it) but has no
ticket gets nothing.  The shard also makes itself non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``), so
its ``/proc/<pid>/fd`` is closed to the other processes of its own user: a descriptor cannot be taken
from there either.  What a worker can do with a descriptor it was given, the segment's seals decide
(the weights cannot be written through any new mapping, no segment can be shrunk or grown).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import secrets
import socket
import threading
import time

from psgd.wire import segment

log = logging.getLogger(__name__)

TICKET_BYTES = 32
TICKET_SECONDS = 10.0
ANSWER_SECONDS = 1.0  # how long one connection to the socket may take to send its ticket
_PR_SET_DUMPABLE = 4


def not_dumpable() -> None:
    """Close this process's ``/proc/<pid>`` (descriptors, memory) to every other process of its user."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise segment.SegmentError(f"cannot make the shard non-dumpable: {os.strerror(ctypes.get_errno())}")


class Handout:
    """The Unix-domain socket that hands out segments' descriptors for tickets (see the module docstring)."""

    def __init__(self, job: str, shard: int):
        self.name = f"@psgd-{job}-s{shard}-{os.getpid()}-{secrets.token_hex(8)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind("\0" + self.name[1:])
            self._sock.listen(64)
        except OSError as exc:
            self._sock.close()
            raise segment.SegmentError(f"cannot listen on the Unix-domain socket {self.name}: {exc}") from None
        self._tickets: dict[bytes, tuple[int, float]] = {}  # ticket -> (its own copy of the descriptor, expiry)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"shard{shard}-handout")

    def start(self) -> Handout:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        if self._thread.ident is not None:
            self._thread.join(5)
        with self._lock:
            for fd, _ in self._tickets.values():
                os.close(fd)
            self._tickets.clear()

    def offer(self, seg: segment.Segment) -> dict:
        """What a worker needs to take ``seg``: its description, this socket's name and a new ticket.  The ticket
        holds a descriptor of its own, so it hands over ``seg``'s file even if ``seg`` is closed meanwhile (and
        never whatever took its descriptor's number)."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            for old in [t for t, (_, expiry) in self._tickets.items() if expiry <= now]:
                os.close(self._tickets.pop(old)[0])
            self._tickets[ticket] = (os.dup(seg.fd), now + TICKET_SECONDS)
        return {**seg.offer(), "socket": self.name, "ticket": ticket.hex()}

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._stop.is_set():
                    return
                continue
            with conn:
                try:
                    self._answer(conn)
                except OSError as exc:
                    log.debug("segment handout: a connection ended: %s", exc)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(ANSWER_SECONDS)
        ticket = b""
        while len(ticket) < TICKET_BYTES:
            piece = conn.recv(TICKET_BYTES - len(ticket))
            if not piece:
                return
            ticket += piece
        with self._lock:
            fd, expiry = self._tickets.pop(ticket, (-1, 0.0))
        try:
            if fd < 0 or expiry <= time.monotonic():
                conn.sendall(b"\x00")
                return
            socket.send_fds(conn, [b"\x01"], [fd])
        finally:
            if fd >= 0:
                os.close(fd)
