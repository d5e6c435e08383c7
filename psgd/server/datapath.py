"""The bulk data path: pulls and pushes over a plain TCP connection beside gRPC.

gRPC costs several copies per tensor byte (protobuf messages, HTTP/2 frames,
Python objects per chunk); here a pull is one header and one ``sendmsg`` of
the shard's snapshot buffer, and a push is received straight into a reused
buffer with ``recv_into``.  The shard core does all the checking, exactly as
for gRPC, and errors come back as the same status codes.

One thread serves one connection (a worker keeps one per shard).  Every read
has a timeout, payload sizes come from the partition plan, and a connection
that breaks the protocol is answered with an error and closed.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import ssl
import threading

import grpc
import numpy as np

from psgd import wire
from psgd.server.core import ShardCore, ShardError

log = logging.getLogger(__name__)

_CODES = {code.name: code.value[0] for code in grpc.StatusCode}
_OUTCOME_CODES = {name: i for i, name in enumerate(wire.OUTCOMES)}


class DataServer:
    """Accepts data-path connections for one shard on ``host:port`` (0: a free port)."""

    def __init__(self, core: ShardCore, host: str = "127.0.0.1", port: int = 0, *, token: str = "",
                 request_timeout: float = 60.0, idle_timeout: float = 600.0, max_connections: int | None = None,
                 tls: ssl.SSLContext | None = None):
        self.core, self.token, self.tls = core, token, tls
        self.request_timeout, self.idle_timeout = request_timeout, idle_timeout
        self.max_connections = max_connections or 4 * core.num_workers + 8
        self.sock = socket.create_server((host, port), backlog=64)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._accepter = threading.Thread(target=self._accept, name=f"shard{core.shard}-data", daemon=True)

    def start(self) -> "DataServer":
        self._accepter.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop at once
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        with self._lock:
            for conn in list(self._conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._accepter.join(5)

    # -- connections ------------------------------------------------------------
    def _accept(self) -> None:
        self.sock.settimeout(0.5)
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                if len(self._conns) >= self.max_connections:
                    log.warning("shard %d: refusing a data connection from %s: %d already open",
                                self.core.shard, peer, len(self._conns))
                    conn.close()
                    continue
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                             name=f"shard{self.core.shard}-data-{peer[1]}").start()

    def _serve(self, conn: socket.socket, peer) -> None:
        raw = conn
        try:
            wire.tune(conn)
            conn.settimeout(self.request_timeout)
            if self.tls is not None:
                try:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                except (ssl.SSLError, OSError) as exc:
                    raise _Fatal(f"TLS handshake failed: {exc}") from None
                with self._lock:
                    self._conns.discard(raw)
                    self._conns.add(conn)
            worker = self._hello(conn)
            while not self._stop.is_set():
                conn.settimeout(self.idle_timeout)
                header = wire.recv_struct(conn, wire.REQUEST)
                conn.settimeout(self.request_timeout)
                self._request(conn, worker, header)
        except wire.WireError as exc:
            log.debug("shard %d: data connection from %s ended: %s", self.core.shard, peer, exc)
        except _Fatal as exc:
            log.warning("shard %d: closing the data connection from %s: %s", self.core.shard, peer, exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._conns.discard(raw)
            conn.close()

    def _reply_error(self, conn: socket.socket, err: ShardError) -> None:
        message = err.message.encode("utf-8", "replace")[:wire.MAX_ERROR_BYTES]
        wire.send_buffers(conn, [wire.REPLY.pack(wire.DATA_MAGIC, _CODES[err.code], 0, 0, 0, 0, len(message)),
                                 message])

    def _hello(self, conn: socket.socket) -> int:
        magic, op, _, worker, _, _, size = wire.recv_struct(conn, wire.REQUEST)
        if magic != wire.DATA_MAGIC or op != wire.OP_HELLO or size > wire.MAX_HELLO_BYTES:
            self._fatal(conn, "INVALID_ARGUMENT", "a data connection must start with a psgd hello")
        body = bytearray(size)
        wire.recv_exact(conn, memoryview(body))
        try:
            hello = json.loads(body)
            token, plan_hash = str(hello.get("token", "")), str(hello.get("plan_hash", ""))
        except (ValueError, AttributeError, RecursionError):  # RecursionError: deeply nested JSON
            self._fatal(conn, "INVALID_ARGUMENT", "the hello is not a JSON object")
        # surrogatepass: JSON may carry lone surrogates ("\ud800"), which plain UTF-8 cannot encode
        if not hmac.compare_digest(token.encode("utf-8", "surrogatepass"),
                                   self.token.encode("utf-8", "surrogatepass")):
            self._fatal(conn, "UNAUTHENTICATED", "wrong or missing token")
        if plan_hash != self.core.plan.hash:
            self._fatal(conn, "FAILED_PRECONDITION", f"partition plan {plan_hash!r} differs from shard "
                        f"{self.core.shard}'s {self.core.plan.hash!r}")
        if worker != -1:
            try:
                self.core._check_worker(worker)
            except ShardError as err:
                self._fatal(conn, err.code, err.message)
        wire.send_buffers(conn, [wire.REPLY.pack(wire.DATA_MAGIC, 0, 0, self.core.version, 0, 0, 0)])
        return worker

    def _fatal(self, conn: socket.socket, code: str, message: str):
        try:
            self._reply_error(conn, ShardError(code, message))
        except wire.WireError:
            pass
        raise _Fatal(message)

    # -- requests -------------------------------------------------------------------
    def _request(self, conn: socket.socket, worker: int, header: tuple) -> None:
        magic, op, dtype_code, _, clock, base_version, size = header
        if magic != wire.DATA_MAGIC or op not in (wire.OP_PULL, wire.OP_PUSH):
            self._fatal(conn, "INVALID_ARGUMENT", "not a psgd data request")
        if op == wire.OP_PULL:
            if size:
                self._fatal(conn, "INVALID_ARGUMENT", "a pull carries no payload")
            self._pull(conn, worker, clock)
        else:
            self._push(conn, worker, clock, base_version, dtype_code, size)

    def _pull(self, conn: socket.socket, worker: int, clock: int) -> None:
        try:
            snap = self.core.pull_live(worker, clock, self.request_timeout)
        except ShardError as err:
            self._reply_error(conn, err)
            return
        with snap:
            head = wire.REPLY.pack(wire.DATA_MAGIC, 0, 0, snap.version, 0, 0, len(snap.buffer))
            wire.send_buffers(conn, [head, snap.buffer])

    def _push(self, conn: socket.socket, worker: int, clock: int, base_version: int, dtype_code: int,
              size: int) -> None:
        core = self.core
        wire_dtype = wire.WIRE_DTYPES.get(dtype_code, "?") or core.dtype
        compressed = core.dtype == "float32" and wire_dtype in ("float16", "bfloat16")
        if wire_dtype != core.dtype and not compressed:
            self._fatal(conn, "INVALID_ARGUMENT", f"gradient wire dtype code {dtype_code} cannot carry "
                        f"{core.dtype} variables")
        expected = core.flat.size * wire.WIRE_ITEMSIZE[wire_dtype]
        if size != expected:
            self._fatal(conn, "INVALID_ARGUMENT", f"push of {size} bytes, shard {core.shard} expects {expected} "
                        f"({core.flat.size} {wire_dtype} values): wrong shape or dtype")
        try:
            buf = core.receive_buffers.acquire(self.request_timeout)
        except ShardError as err:
            self._fatal(conn, err.code, err.message)
        try:
            if wire.wants_go_ahead(size):
                wire.send_buffers(conn, [wire.REPLY.pack(wire.DATA_MAGIC, 0, wire.READY, core.version, 0, 0, 0)])
            _receive_gradient(conn, memoryview(buf), wire_dtype, core.flat.size)
            try:
                result = core.push(worker, clock, base_version, core.gradient_views(buf))
            except ShardError as err:
                self._reply_error(conn, err)
                return
        finally:
            core.receive_buffers.release(buf)
        wire.send_buffers(conn, [wire.REPLY.pack(wire.DATA_MAGIC, 0, _OUTCOME_CODES[result.outcome],
                                                 result.version, result.next_clock, result.staleness, 0)])


class _Fatal(Exception):
    """The connection cannot go on (protocol broken); it is closed after the error reply."""


_STAGE_ELEMS = 1 << 20


def _receive_gradient(conn: socket.socket, buf: memoryview, wire_dtype: str, count: int) -> None:
    """Receive ``count`` gradient values into ``buf`` (float32 or the variables' dtype).

    Compressed gradients (float16, bfloat16) are received in pieces into a
    small staging buffer and widened into place, so they never need a
    second full-size buffer.
    """
    if wire.WIRE_ITEMSIZE[wire_dtype] * count == len(buf):
        wire.recv_exact(conn, buf)
        return
    out = np.frombuffer(buf, dtype=np.float32, count=count)
    stage = np.empty(min(count, _STAGE_ELEMS), dtype=np.uint16)
    for start in range(0, count, _STAGE_ELEMS):
        n = min(_STAGE_ELEMS, count - start)
        piece = stage[:n]
        wire.recv_exact(conn, memoryview(piece))
        if wire_dtype == "float16":
            np.copyto(out[start:start + n], piece.view(np.float16))
        else:
            wire.from_bfloat16(piece, out[start:start + n])
