"""The TCP data path's protocol, what both ends agree on (the worker's :mod:`psgd.link.tcp`, the
shard's :mod:`psgd.server.net.datapath`).

Beside gRPC (the control plane: register, heartbeat, done, status, and a
pull/push fallback), every shard listens on a plain TCP port for pulls and
pushes.  A connection starts with HELLO (worker id, plan hash, token); then
each request is one fixed header and, for a push, the gradient bytes of the
shard's slices in slice order; each reply is one fixed header and, for a
pull, the weight bytes in the same order, or an error message.  Payload
sizes are fixed by the partition plan, so neither side ever allocates what
the other declares.

A push of at least GO_AHEAD_BYTES waits, after its header, for a reply with
the outcome code READY (the shard has checked the header and has a receive
buffer for it) before it sends the payload.  Besides sparing a refused push
its payload, the short exchange keeps Linux from treating the connection as
interactive: a large transfer that follows one in the other direction
straight away is otherwise paced by delayed ACKs, and a 40 MB push took
twice as long as the pull before it (benchmarks/RESULTS.md).  Smaller
pushes go in one message: below 4 MiB the round trip cost more than it saved.  A client may always
send the payload without waiting; the shard reads it after its READY.

Rows of embedding tables ride with the pull or push they belong to (:mod:`psgd.wire.rows` writes and reads
them): a pull with rows is OP_PULL_ROWS, whose payload is a section of ids per table, and whose reply carries
the rows' values, table by table in the order asked, after the weights; a push with rows is OP_PUSH_ROWS, its
payload followed by ROWS_LENGTH (the bytes of the rows) and a section of ids and values per table.  Their sizes
are bounded by the tables' shapes and at most ``psgd.wire.rows.MAX_ROWS`` rows a table, and they are read block
by block as they come.

One round trip a step: OP_PUSH_PULL is a push (its header and payload as OP_PUSH's) whose reply is followed by
the reply to a pull of the next clock (its clock + 1), as OP_PULL's, once the policy lets that pull go (under sync,
when the round the push belongs to closes).  A refused push is answered with its error alone; a pull that cannot
go after an applied push is answered with the push's reply and then the pull's error, and the worker pulls again
on its own.  It carries no rows: a model with embedding tables pulls the rows of each step with its weights.

A hello may ask for shared memory (``"shm": "pull"`` or ``"push"``, see :mod:`psgd.link.shm`); its reply
then carries a JSON offer, and the connection's replies carry no tensor bytes: a pull's reply says the
weights may be read from the shard's weights segment, and the worker answers with RELEASE (a header, no
reply) once it has copied them; a push's header says its bytes are in the push segment.  The pull half of an
OP_PUSH_PULL on a push connection reads the weights segment the same way (the worker has it mapped through its
pull connection), and is released on the push connection.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import time

from psgd import policy
from psgd.errors import Code, TransportError

DATA_MAGIC = b"PSG1"
OP_HELLO, OP_PULL, OP_PUSH, OP_RELEASE, OP_PULL_ROWS, OP_PUSH_ROWS, OP_PUSH_PULL = 1, 2, 3, 4, 5, 6, 7
OPS = {
    OP_HELLO: "hello",
    OP_PULL: "pull",
    OP_PUSH: "push",
    OP_RELEASE: "release",
    OP_PULL_ROWS: "pull",
    OP_PUSH_ROWS: "push",
    OP_PUSH_PULL: "push and pull",
}
PULLS, PUSHES = (OP_PULL, OP_PULL_ROWS), (OP_PUSH, OP_PUSH_ROWS, OP_PUSH_PULL)
#: magic, op, wire dtype code, worker id, clock, base version, payload bytes
REQUEST = struct.Struct("<4sBBxxiqqQ")
#: magic, status (a psgd.errors.Code number), outcome code, version, next clock, staleness, payload bytes
REPLY = struct.Struct("<4sBBxxqqqQ")
#: the bytes of a push's rows, after its gradient (OP_PUSH_ROWS)
ROWS_LENGTH = struct.Struct("<Q")
MAX_HELLO_BYTES = 64 << 10
MAX_ERROR_BYTES = 8 << 10
#: a push reply's outcome code indexes this
OUTCOMES = tuple(policy.OUTCOMES.values())
#: the worker id of an observer (``psgd export``, ``status``): it may pull, never push
OBSERVER = -1
#: the outcome code of a push's go-ahead (status 0, no payload)
READY = 255
GO_AHEAD_BYTES = 4 << 20


def as_worker(worker_id: int) -> int | None:
    """The shard core's name for a request's worker id: None for an observer."""
    return None if worker_id == OBSERVER else worker_id


def error_reply(code: str, message: str, reason: int = 0, rewind_to: int = 0) -> bytes:
    """An error reply: the status ``code`` (a psgd.errors.Code name), ``message`` cut to MAX_ERROR_BYTES, in
    the outcome byte the reason the client acts on (:func:`psgd.wire.status.reason_number`), and in the next
    clock the clock a ROLLED_BACK refusal says to continue from."""
    text = message.encode("utf-8", "replace")[:MAX_ERROR_BYTES]
    return REPLY.pack(DATA_MAGIC, Code[code].value, reason, 0, rewind_to, 0, len(text)) + text


def status_code(number: int) -> Code:
    """The status code an error reply's status number names (UNKNOWN for a number that is none)."""
    return Code.of(number)


def wants_go_ahead(payload_bytes: int) -> bool:
    """Whether a push of ``payload_bytes`` waits for the shard's READY before its payload."""
    return payload_bytes >= GO_AHEAD_BYTES


class WireError(TransportError):
    """The peer broke the data-path protocol or went away."""


class TooSlow(WireError):
    """The peer sent too slowly: its bytes had not all come by the deadline."""


def tune(sock: socket.socket) -> None:
    """Options for every data-path socket: no Nagle delay.  Buffer sizes are left to the kernel:
    setting SO_SNDBUF/SO_RCVBUF turns Linux's autotuning off, which made pushes slower here."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


#: how long a waiting end of a data connection watches for the peer's next bytes before it sleeps in the kernel,
#: where each process has a core of its own (psgd launch's choice for [cluster] busy_poll_us = -1)
BUSY_POLL_US = 1000
#: after a watch that saw nothing, the reads that sleep at once before the next watch: twice as many after each
#: miss in a row, up to this many
MOST_SKIPPED = 64


class Spin:
    """A short watch for a socket's next bytes before the blocking read that follows it.

    Waking a process that sleeps in the kernel costs most of a loopback round trip on a VM (64 bytes between two
    processes here: 89 µs blocking, 15 µs watching; benchmarks/RESULTS.md), so where the answer is due within a
    small step's time the waiting end watches first (``poll`` with no timeout, the GIL let go each time) for up to
    ``seconds``.  A watch that saw nothing makes the next reads sleep at once, twice as many after each miss in a
    row, so an idle or slow peer costs a watch now and then, not a core."""

    def __init__(self, sock: socket.socket, seconds: float):
        self.sock, self.ns = sock, int(seconds * 1e9)
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)
        self._skip, self._after_miss = 0, 1

    def read(self, read):
        """``read()``, after watching for its bytes; what it returned."""
        if self._skip:
            self._skip -= 1
        elif self.ns > 0 and not (isinstance(self.sock, ssl.SSLSocket) and self.sock.pending()):
            poll, clock = self._poll.poll, time.perf_counter_ns
            end = clock() + self.ns
            while not poll(0):
                if clock() >= end:
                    self._skip, self._after_miss = self._after_miss, min(2 * self._after_miss, MOST_SKIPPED)
                    break
            else:
                self._after_miss = 1
        return read()


def recv_exact(sock: socket.socket, into: memoryview, deadline: float | None = None) -> None:
    """Fill ``into`` from ``sock`` or raise WireError (the peer closed, or the timeout passed); with a
    ``deadline`` (time.monotonic), :class:`TooSlow` once it has passed (the socket's own timeout is
    left as it was)."""
    view = into.cast("B") if into.format != "B" or into.ndim != 1 else into
    got, n = 0, len(view)
    timeout = sock.gettimeout()
    try:
        while got < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TooSlow(f"{got} of {n} bytes by the deadline")
                sock.settimeout(left)
            try:
                k = sock.recv_into(view[got:], min(n - got, 8 << 20))
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TooSlow(f"{got} of {n} bytes by the deadline") from None
                raise WireError(f"timed out after {got} of {n} bytes") from None
            except OSError as exc:
                raise WireError(f"connection failed: {exc}") from None
            if k == 0:
                raise WireError(f"connection closed after {got} of {n} bytes")
            got += k
    finally:
        if deadline is not None:
            sock.settimeout(timeout)


def recv_struct(sock: socket.socket, fmt: struct.Struct, deadline: float | None = None) -> tuple:
    return fmt.unpack(recv_bytes(sock, fmt.size, deadline))


def recv_bytes(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """The next ``n`` bytes from ``sock`` (see :func:`recv_exact`)."""
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf), deadline)
    return buf


def send_buffers(sock: socket.socket, buffers: list) -> None:
    """Send every buffer, in order, with as few system calls as the kernel allows."""
    views = [memoryview(b).cast("B") for b in buffers if len(memoryview(b).cast("B"))]
    try:
        if isinstance(sock, ssl.SSLSocket):  # TLS sockets have no sendmsg: one buffer at a time
            for view in views:
                sock.sendall(view)
            return
        while views:
            sent = sock.sendmsg(views[:512])
            while views and sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            if sent:
                views[0] = views[0][sent:]
    except TimeoutError:
        raise WireError("timed out while sending") from None
    except OSError as exc:
        raise WireError(f"connection failed: {exc}") from None
