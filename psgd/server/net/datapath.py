"""The bulk data path: pulls and pushes over a plain TCP connection beside gRPC.

gRPC costs several copies per tensor byte (protobuf messages, HTTP/2 frames, Python objects per chunk); here a pull
is one header and one ``sendmsg`` of the shard's snapshot buffer, and a push is received straight into a reused buffer
with ``recv_into``.  A push or pull received here goes to the request handler gRPC's go to
(:mod:`psgd.server.net.handler`): the same checks, and errors come back as the same codes.

One thread serves one authenticated connection (a worker keeps one per shard; a replica's goes to
:mod:`psgd.server.durable.replica`).  Every read has a timeout, payload sizes come from the partition plan, and a
connection that breaks the protocol is answered with an error and closed.  Connections are accepted, and their hellos
checked, by the gatekeeper (:mod:`psgd.server.net.gatekeeper`), which holds no thread per connection until it is
authenticated: connections cannot be hoarded.

Rows of embedding tables go over the connection with the pull or push they belong to (OP_PULL_ROWS,
OP_PUSH_ROWS in :mod:`psgd.wire.protocol`), through shared memory or not.

A worker on the same host may ask in its hello for a shared-memory segment
(:mod:`psgd.wire.segment`); the connection then carries only the headers, and
the bytes go through the segment: the weights live there (two slots, see
:mod:`psgd.server.state.store`), a pull's reply says which slot holds its version, and a push is copied
out of it into a receive buffer, and checked there, before it is applied.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
import time
import weakref

import numpy as np

from psgd.errors import PsgdError
from psgd.server.errors import ShardError
from psgd.server.net.gatekeeper import BACKLOG, MAX_UNAUTHENTICATED, MAX_UNAUTHENTICATED_PER_PEER, Gatekeeper
from psgd.server.net.handler import PullRequest, PushRequest, RequestHandler
from psgd.server.net.handout import Handout, not_dumpable
from psgd.server.net.receive import BufferPool, decode_gradient, drain, receive_gradient
from psgd.server.net.tokens import Here
from psgd.server.state import store
from psgd.server.state.core import PushResult, ShardCore
from psgd.wire import protocol, segment, status
from psgd.wire.codec import Codec, CodecError, by_code
from psgd.wire.rows import RowCollector, RowsError, read_sections, sections_bytes

log = logging.getLogger(__name__)

_OUTCOME_CODES = {name: i for i, name in enumerate(protocol.OUTCOMES)}
#: A transfer must be done within TRANSFER_GRACE seconds plus one second per MIN_TRANSFER_RATE bytes (and the
#: request timeout): 100 MB has 105 s at most.  A push over the socket that has not arrived by then is cut off
#: (a trickle of a byte every few seconds cannot hold a receive buffer); a pull still being read by then may
#: lose its version to an update that needs the memory (psgd.server.state.store), and its connection is closed.
MIN_TRANSFER_RATE = 1e6
TRANSFER_GRACE = 5.0


def transfer_seconds(size: int, request_timeout: float) -> float:
    """How long a transfer of ``size`` bytes may take (see MIN_TRANSFER_RATE), over any link."""
    return min(request_timeout, TRANSFER_GRACE + size / MIN_TRANSFER_RATE)


class DataServer:
    """Accepts data-path connections for one shard on ``host:port`` (0: a free port)."""

    def __init__(
        self,
        core: ShardCore,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str = "",
        request_timeout: float = 60.0,
        idle_timeout: float = 600.0,
        max_connections: int | None = None,
        hello_timeout: float = 2.0,
        max_unauthenticated: int = MAX_UNAUTHENTICATED,
        max_per_peer: int = MAX_UNAUTHENTICATED_PER_PEER,
        tls: ssl.SSLContext | None = None,
        shm: bool = True,
        busy_poll: float = 0.0,
        here: Here | None = None,
    ):
        self.core, self.requests = core, RequestHandler(core)
        sock = socket.create_server((host, port), backlog=BACKLOG)  # first: a port it cannot have leaves nothing
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        #: seconds a serving thread watches for a connection's next request before it sleeps ([cluster] busy_poll_us)
        self.busy_poll = busy_poll
        #: whether a worker on this host may pull from the weights in shared memory and push through a segment
        #: ([cluster] transport auto or shm)
        self.shm = shm
        self._weights: segment.Segment | None = None
        self._handout: Handout | None = None
        self.receive_buffers = BufferPool(core.nbytes, limit=2)
        #: (dim, dtype) of each embedding table's rows: what rows on the wire are read against
        self.row_shapes = core.tables.shapes()
        if shm:
            try:
                not_dumpable()  # before any segment exists: none can be taken from this process's /proc
                self._weights = _share_weights(core)
                self._handout = Handout(core.fingerprint, core.shard)
            except segment.SegmentError as exc:
                log.warning(
                    "shard %d: no shared memory for workers on this host (%s); they use the data port", core.shard, exc
                )
                self.shm = False
        self.request_timeout, self.idle_timeout = request_timeout, idle_timeout
        #: authenticated connections served at once (one thread each)
        self.max_connections = max_connections or 4 * core.num_workers + 8
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()  # authenticated, each served by its thread
        self._lock = threading.Lock()
        self._served = threading.Lock()  # the counters of requests served, and the seconds they took
        self.gate = Gatekeeper(
            core,
            sock,
            token=token,
            here=here,
            tls=tls,
            hello_timeout=hello_timeout,
            max_unauthenticated=max_unauthenticated,
            max_per_peer=max_per_peer,
            hand_over=self._hand_over,
        )

    @property
    def descriptors(self) -> int:
        """The most descriptors this port's connections take at once: those served and those not yet checked."""
        return self.max_connections + self.gate.max_unauthenticated

    def start(self) -> DataServer:
        if self._handout is not None:
            self._handout.start()
        self.gate.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.gate.stop()  # wakes the gatekeeper at once
        with self._lock:
            for conn in list(self._conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self.gate.join(5)
        if self._handout is not None:
            self._handout.stop()

    # -- serving an authenticated connection -----------------------------------------------------
    def _hand_over(
        self, conn: socket.socket, peer, worker: int, shm: str = "", key: str = ""
    ) -> tuple[str, str, str] | None:
        """Serve ``conn`` (authenticated by the gatekeeper) on a thread of its own, if the cap on served
        connections allows; else the refusal (code, message, reason) to send it."""
        with self._lock:
            if len(self._conns) >= self.max_connections:
                return (
                    "UNAVAILABLE",
                    f"shard {self.core.shard} already serves {self.max_connections} data "
                    "connections, the most it takes (4 per worker + 8)",
                    "too many data connections",
                )
            self._conns.add(conn)
        try:
            threading.Thread(
                target=self._serve,
                args=(conn, peer, worker, shm, key),
                daemon=True,
                name=f"shard{self.core.shard}-data-{peer[1]}",
            ).start()
        except RuntimeError as exc:  # no thread to be had
            with self._lock:
                self._conns.discard(conn)
            return (
                "UNAVAILABLE",
                f"shard {self.core.shard} cannot serve another connection: {exc}",
                "no thread for it",
            )
        return None

    def _serve(self, conn: socket.socket, peer, worker: int, shm: str = "", key: str = "") -> None:
        seg = None
        try:
            conn.settimeout(self.request_timeout)
            if shm == "follow":  # a replica of this shard (psgd.server.durable.replica): it takes the connection over
                return (
                    self.core.replication.serve_follower(conn)
                    if self.core.replication is not None
                    else self._fatal(conn, "FAILED_PRECONDITION", f"shard {self.core.shard} keeps no replica")
                )
            seg, offer = self._segment_for(worker, shm)
            protocol.send_buffers(
                conn, [protocol.REPLY.pack(protocol.DATA_MAGIC, 0, 0, self.core.version, 0, 0, len(offer)), offer]
            )
            spin = protocol.Spin(conn, self.busy_poll)  # the next request is watched for before the read sleeps
            while not self._stop.is_set():
                conn.settimeout(self.idle_timeout)
                header = spin.read(lambda: protocol.recv_struct(conn, protocol.REQUEST))
                began = time.thread_time()  # this thread's CPU time: the shard's work, not its waits
                conn.settimeout(self.request_timeout)
                answered = self._request(conn, worker, header, seg, shm, key) or time.thread_time()
                with self._served:  # the shard's own share of a step (psgd bench comm --parts latency)
                    self.core.counters["data_requests"] += 1
                    self.core.counters["data_cpu_seconds"] += answered - began
        except protocol.WireError as exc:
            log.debug("shard %d: data connection from %s ended: %s", self.core.shard, peer, exc)
        except _Fatal as exc:
            log.warning("shard %d: closing the data connection from %s: %s", self.core.shard, peer, exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            if shm == "push" and seg is not None:  # its memory goes once the worker has let go of it too
                seg.close()
            conn.close()

    def _segment_for(self, worker: int, shm: str) -> tuple[segment.Segment | None, bytes]:
        """The segment a hello asked for (the weights for pulls, a new one for pushes) and the offer that says
        how to map it; an offer saying why not where this shard offers none (the worker then uses the connection as it
        is, and says why); nothing for a hello that did not ask."""
        if not shm:
            return None, b""
        if not self.shm or self._weights is None or self._handout is None:
            return None, json.dumps(
                {
                    "refused": f"shard {self.core.shard} offers no shared memory "
                    "([cluster] transport = \"tcp\" on its side)"
                }
            ).encode()
        if shm == "pull":
            seg = self._weights
        else:
            try:
                seg = segment.create(self.core.fingerprint, self.core.shard, "push", self.core.nbytes)
            except segment.SegmentError as exc:
                log.warning("shard %d: no shared-memory segment for worker %d: %s", self.core.shard, worker, exc)
                return None, json.dumps({"refused": f"shard {self.core.shard} made no segment: {exc}"}).encode()
        return seg, json.dumps(self._handout.offer(seg)).encode()

    def _reply_error(self, conn: socket.socket, err: ShardError, prefix: bytes = b"") -> None:
        protocol.send_buffers(
            conn, [prefix, protocol.error_reply(err.code, err.message, status.reason_number(err.reason), err.rewind_to)]
        )

    def _fatal(self, conn: socket.socket, code: str, message: str):
        try:
            self._reply_error(conn, ShardError(code, message))
        except protocol.WireError:
            pass
        raise _Fatal(message)

    # -- requests -------------------------------------------------------------------
    def _request(
        self,
        conn: socket.socket,
        worker: int,
        header: tuple,
        seg: segment.Segment | None = None,
        purpose: str = "",
        key: str = "",
    ) -> float | None:
        """Serve one request of ``worker`` (``key``: its registration's, from the hello); this thread's CPU time
        when its answer went out where the request went on after it (a pull through shared memory waits for the
        worker's release), else None."""
        magic, op, dtype_code, _, clock, base_version, size = header
        if magic != protocol.DATA_MAGIC or op not in protocol.PULLS + protocol.PUSHES:
            self._fatal(
                conn,
                "INVALID_ARGUMENT",
                "not a psgd data request" if op != protocol.OP_RELEASE else "a release without a pull to release",
            )
        if seg is not None and op not in (protocol.PULLS if purpose == "pull" else protocol.PUSHES):
            self._fatal(
                conn,
                "INVALID_ARGUMENT",
                f"a {protocol.OPS[op]} on a connection whose shared memory "
                f"is for {'pulls' if purpose == 'pull' else 'pushes'}",
            )
        if op == protocol.OP_PULL and size:
            self._fatal(conn, "INVALID_ARGUMENT", "a pull carries no payload")
        if op in protocol.PULLS:
            return self._pull(
                conn,
                worker,
                clock,
                seg,
                self._asked(conn, worker, size) if op == protocol.OP_PULL_ROWS else {},
                key=key,
            )
        result = self._push(conn, worker, clock, base_version, dtype_code, size, seg, op == protocol.OP_PUSH_ROWS, key)
        if result is None:  # refused, and answered
            return None
        pushed = protocol.REPLY.pack(
            protocol.DATA_MAGIC,
            0,
            _OUTCOME_CODES[result.outcome],
            result.version,
            result.next_clock,
            result.staleness,
            0,
        )
        if op != protocol.OP_PUSH_PULL:
            protocol.send_buffers(conn, [pushed])
            return None
        if not result.pull_ready:  # the pull waits (for the round to close): the push is answered at once
            protocol.send_buffers(conn, [pushed])
            pushed = b""
        return self._pull(conn, worker, clock + 1, self._weights if seg is not None else None, prefix=pushed, key=key)

    # -- rows of embedding tables --------------------------------------------------------------------------
    def _read_rows(
        self, conn: socket.socket, size: int, began: float, collector: RowCollector, allowed_before: int = 0
    ) -> None:
        """Read ``size`` bytes of row sections into ``collector``, by the deadline of ``allowed_before`` + ``size``
        bytes counted from ``began``; a stream out of step (rows that do not fit, too slow) is closed."""
        limit = sections_bytes(collector.tables, collector.with_values)
        if size > limit:
            self._fatal(
                conn,
                "INVALID_ARGUMENT",
                f"{collector.what}: {size:,} bytes of rows, more than the {limit:,} its tables' rows may take",
            )
        deadline = began + transfer_seconds(allowed_before + size, self.request_timeout)
        try:
            read_sections(lambda n: protocol.recv_bytes(conn, n, deadline), size, collector)
        except RowsError as exc:
            self._fatal(conn, "INVALID_ARGUMENT", str(exc))
        except protocol.TooSlow as exc:
            self._fatal(
                conn,
                "DEADLINE_EXCEEDED",
                f"{collector.what}: its {size:,} bytes of rows did not arrive in time ({exc})",
            )

    def _asked(self, conn: socket.socket, worker: int, size: int) -> dict[str, np.ndarray]:
        """The ids a pull asks for (OP_PULL_ROWS), by table."""
        asked = RowCollector(self.row_shapes, False, f"pull by worker {worker}")
        self._read_rows(conn, size, time.monotonic(), asked)
        return asked.lookups()

    def _pushed_rows(self, conn: socket.socket, worker: int, began: float, size: int, codec: Codec, keep=True):
        """The rows after a push's gradient (OP_PUSH_ROWS), their values written by ``codec``: (ids, values) by
        table; a refused push's (``keep`` false) are read past, unparsed and unkept."""
        pushed = RowCollector(self.row_shapes, True, f"push from worker {worker}", codec)
        try:
            (length,) = protocol.recv_struct(
                conn, protocol.ROWS_LENGTH, began + transfer_seconds(size, self.request_timeout)
            )
            if not keep and length <= sections_bytes(pushed.tables, True):
                drain(conn, length, began + transfer_seconds(size + length, self.request_timeout))
                return {}
        except protocol.TooSlow as exc:
            self._fatal(conn, "DEADLINE_EXCEEDED", f"push from worker {worker}: its rows did not come ({exc})")
        self._read_rows(conn, length, began, pushed, size)
        return pushed.rows()

    def _pull(
        self,
        conn: socket.socket,
        worker: int,
        clock: int,
        seg: segment.Segment | None = None,
        lookups: dict[str, np.ndarray] | None = None,
        prefix: bytes = b"",
        key: str = "",
    ) -> float | None:
        """Answer a pull of ``clock`` by ``worker`` (``key``: its registration's; the weights segment ``seg``:
        through shared memory), its reply after ``prefix`` (the reply to the push of an OP_PUSH_PULL) in the same
        send; through shared memory, when the answer went out (the worker's release comes after)."""

        def revoke() -> None:  # the read is past its hold and an update needs its memory: no more of it is sent
            conn.shutdown(socket.SHUT_RDWR)

        try:
            pulled = self.requests.pull(
                PullRequest(
                    worker,
                    clock,
                    self.request_timeout,
                    key,
                    lookups or {},
                    live=True,
                    on_revoke=revoke,
                    hold=transfer_seconds(self.core.nbytes, self.request_timeout),
                )
            )
        except ShardError as err:
            self._reply_error(conn, err, prefix)
            return None
        with pulled:
            snap = pulled.read
            values = [pulled.rows[table] for table in lookups or {}]
            n = len(snap.buffer)
            size = n + sum(v.nbytes for v in values)
            if seg is None:
                head = protocol.REPLY.pack(protocol.DATA_MAGIC, 0, 0, snap.version, 0, 0, size)
                protocol.send_buffers(conn, [prefix, head, snap.buffer, *values])
                return None
            # The worker copies the weights out of the reply's slot now, and checks its sequence number after;
            # the slot stays theirs until it says it is done (or its hold has passed and an update needs it).
            head = protocol.REPLY.pack(protocol.DATA_MAGIC, 0, 0, snap.version, snap.slot, snap.seq, size)
            protocol.send_buffers(conn, [prefix, head, *values])
            answered = time.thread_time()
            magic, op, *_ = protocol.recv_struct(conn, protocol.REQUEST)
            if magic != protocol.DATA_MAGIC or op != protocol.OP_RELEASE:
                self._fatal(conn, "INVALID_ARGUMENT", "a pull from shared memory must be answered with a release")
            return answered

    def _push(
        self,
        conn: socket.socket,
        worker: int,
        clock: int,
        base_version: int,
        dtype_code: int,
        size: int,
        seg: segment.Segment | None = None,
        with_rows: bool = False,
        key: str = "",
    ) -> PushResult | None:
        """Receive and apply a push of ``worker`` (``key``: its registration's); what it did, to answer (None: it
        was refused, and the refusal sent)."""
        core, began = self.core, time.monotonic()
        try:
            codec = by_code(dtype_code, core.dtype)
        except CodecError as exc:
            self._fatal(conn, "INVALID_ARGUMENT", str(exc))
        itemsize = codec.wire_itemsize(core.dtype)
        expected = core.flat.size * itemsize
        if size != expected:
            self._fatal(
                conn,
                "INVALID_ARGUMENT",
                f"push of {size} bytes, shard {core.shard} expects {expected} "
                f"({core.flat.size} values of {itemsize} bytes): wrong shape or dtype",
            )
        # Every push lands in a receive buffer of the shard's own before it is checked, so what is checked is
        # what is applied: a segment's writer could change its bytes after a check.  Only a registered worker
        # takes a buffer, and a push over the socket must arrive by its deadline, at MIN_PUSH_RATE at least: a
        # trickled push cannot hold a buffer.
        allowed = transfer_seconds(size, self.request_timeout)
        try:
            self.requests.admit(worker, key)
            buf = self.receive_buffers.acquire(self.request_timeout)
        except ShardError as err:  # refused before it takes a buffer; the connection goes on
            if seg is None and not protocol.wants_go_ahead(size):  # its payload follows the header: let it pass
                try:
                    drain(conn, size, began + allowed)
                except protocol.TooSlow as exc:
                    self._fatal(
                        conn,
                        "DEADLINE_EXCEEDED",
                        f"refused push of {size} bytes from worker {worker} "
                        f"did not arrive within {allowed:.1f}s ({exc})",
                    )
            if with_rows and (seg is not None or not protocol.wants_go_ahead(size)):  # and its rows
                self._pushed_rows(conn, worker, began, size, codec, keep=False)
            self._reply_error(conn, err)
            return None
        largest = None  # the largest magnitude of the gradient, where the receive measured it
        try:
            if seg is not None and codec.compresses:  # decoded into the buffer, as from the socket
                decode_gradient(seg.data[:size], memoryview(buf), codec, core.flat.size)
            elif seg is not None:  # copied and measured in one pass (the check made on it is the core's)
                largest = core.store.sweep.copy_checked(
                    np.frombuffer(buf, core.dtype, core.flat.size), np.frombuffer(seg.data, core.dtype, core.flat.size)
                )
            else:
                if protocol.wants_go_ahead(size):
                    ready = protocol.REPLY.pack(protocol.DATA_MAGIC, 0, protocol.READY, core.version, 0, 0, 0)
                    protocol.send_buffers(conn, [ready])
                try:
                    receive_gradient(conn, memoryview(buf), codec, core.flat.size, began + allowed)
                except protocol.TooSlow as exc:
                    self._fatal(
                        conn,
                        "DEADLINE_EXCEEDED",
                        f"push of {size} bytes from worker {worker} did not "
                        f"arrive within {allowed:.1f}s ({exc}): at least {MIN_TRANSFER_RATE / 1e6:g} MB/s",
                    )
            with self._served:  # the push's receive: off the socket, or copied out of the segment, and checked
                core.counters["receive_seconds"] += time.monotonic() - began
            rows = self._pushed_rows(conn, worker, began, size, codec) if with_rows else None
            grads = core.store.gradient_views(buf)
            try:
                result = self.requests.push(PushRequest(worker, clock, base_version, grads, size, key, rows, largest))
            except ShardError as err:
                self._reply_error(conn, err)
                return None
        finally:
            self.receive_buffers.release(buf)
        return result


#: shard core -> the segment its weights live in (a core may have several data servers; they share it)
_shared: weakref.WeakKeyDictionary[ShardCore, segment.Segment] = weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()


def _share_weights(core: ShardCore) -> segment.Segment:
    """``core``'s weights, moved (once) into a shared-memory segment that workers on this host pull from; the
    arrays stay there for good."""
    with _shared_lock:
        seg = _shared.get(core)
        if seg is None:
            seg = segment.create(core.fingerprint, core.shard, "weights", core.nbytes, slots=store.SLOTS)
            core.place_weights(seg.arrays(core.flat.dtype, core.flat.size), seg.seq_array())
            _shared[core] = seg
        return seg


class _Fatal(PsgdError):
    """The connection cannot go on (protocol broken); it is closed after the error reply."""
