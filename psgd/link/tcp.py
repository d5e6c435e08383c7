"""The data link over TCP: pulls and pushes on the shard's plain-TCP data port.

A pull is one request header and the weights received straight into the
worker's arrays with ``recv_into``; a push is one header and the gradient's
bytes sent from views with ``sendmsg`` (see :mod:`psgd.wire.protocol`).  Rows
of embedding tables go with them: a pull's ids after its header and their
values after the weights, a push's rows after its gradient.  The
connection is opened on first use with a hello (worker id, plan hash, a proof of the token: psgd.wire.proofs)
and reopened after it breaks.  The rest goes over gRPC (the control link, :mod:`psgd.link.grpc`), and so do the
tensors of a shard without a data port (``transport = "grpc"`` on its side).

The worker waits :data:`REPLY_MARGIN` seconds longer than the request
timeout for an answer: the shard bounds its own wait (a sync pull) by the
request timeout and then answers why, and that answer should arrive before
the worker gives up on its own.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
from collections.abc import Callable
from typing import TypeVar

from psgd.compute.backend import Device
from psgd.errors import Code
from psgd.link.base import DataLink, LinkError, PushReply, RowsIn, RowsOut
from psgd.link.grpc import ControlLink
from psgd.proto import ps_pb2
from psgd.wire import protocol
from psgd.wire.codec import Codec
from psgd.wire.proofs import Prover
from psgd.wire.rows import sections
from psgd.wire.status import reason_name
from psgd.wire.tls import NO_TLS, TLSFiles

#: Seconds a worker waits for an answer beyond the request timeout, which bounds the shard's own waits.
REPLY_MARGIN = 2.0

T = TypeVar("T")


class DataConnection:
    """One data-path connection to one shard, opened with a hello (worker id, plan hash, a fresh proof of the token
    made for this port, the worker's registration key).

    Raises :class:`LinkError` with the shard's status when it refuses, and
    :class:`protocol.WireError` when the connection breaks."""

    def __init__(
        self,
        host: str,
        port: int,
        worker: int,
        plan_hash: str,
        token: str = "",
        timeout: float = 60.0,
        tls: TLSFiles = NO_TLS,
        shm: str = "",
        busy_poll: float = 0.0,
        key: str = "",
    ):
        try:
            self.sock = socket.create_connection((host, port), timeout=min(timeout, 10.0))
        except OSError as exc:
            raise protocol.WireError(f"cannot connect to the data port {host}:{port}: {exc}") from None
        try:
            protocol.tune(self.sock)
            if tls.enabled:
                try:
                    self.sock.settimeout(min(timeout, 10.0))
                    self.sock = tls.wrap_client(self.sock, host)
                except (ssl.SSLError, OSError) as exc:
                    raise LinkError(
                        Code.UNAVAILABLE if isinstance(exc, socket.timeout) else Code.UNAUTHENTICATED,
                        f"TLS handshake with the data port {host}:{port} failed: {exc}",
                    ) from None
            self.sock.settimeout(timeout + REPLY_MARGIN)
            self._spin = protocol.Spin(self.sock, busy_poll)  # a reply is watched for before the read sleeps
            hello = {
                "proof": Prover(token, f"{host}:{port}").prove("hello"),
                "plan_hash": plan_hash,
                **({"key": key} if key else {}),
                **({"shm": shm} if shm else {}),
            }
            body = json.dumps(hello).encode()
            try:
                self._send(protocol.OP_HELLO, worker, 0, 0, 0, [body], len(body))
            except protocol.WireError as exc:
                self._refused(host, port, exc)
            try:
                size = self._reply()[4]
                #: what the shard offered for a hello that asked for a shared-memory segment (psgd.link.shm)
                self.offer = self._offer(size)
            except protocol.WireError as exc:
                raise protocol.WireError(f"the data port {host}:{port} gave no answer to the hello: {exc}") from None
        except BaseException:  # a refused or broken hello: do not leave the socket to the garbage collector
            self.sock.close()
            raise
        self.worker = worker

    def _offer(self, size: int) -> dict:
        """The hello reply's payload: a JSON object, sent only to a hello that asked for a segment."""
        if not size:
            return {}
        if size > protocol.MAX_HELLO_BYTES:
            raise protocol.WireError("oversized answer to the hello")
        text = bytearray(size)
        protocol.recv_exact(self.sock, memoryview(text))
        try:
            offer = json.loads(text)
        except ValueError:
            offer = None
        if not isinstance(offer, dict):
            raise protocol.WireError("the answer to the hello is not a JSON object")
        return offer

    def _refused(self, host: str, port: int, exc: protocol.WireError):
        """The hello could not be sent: the shard may have refused the connection (full, too late) and
        closed it, saying why first.  Raise its reason (LinkError) if it sent one, else a WireError."""
        try:
            self.sock.settimeout(1.0)
            self._reply()
        except (protocol.WireError, OSError):
            pass
        raise protocol.WireError(f"the data port {host}:{port} closed the connection before the hello: {exc}") from None

    def interrupt(self) -> None:
        """End a call blocked on this connection (from another thread); the connection is then dead."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _send(
        self, op: int, worker: int, clock: int, base_version: int, dtype_code: int, payload: list, size: int
    ) -> None:
        head = protocol.REQUEST.pack(protocol.DATA_MAGIC, op, dtype_code, worker, clock, base_version, size)
        protocol.send_buffers(self.sock, [head, *payload])

    def _reply(self) -> tuple:
        magic, status, outcome, version, next_clock, staleness, size = self._spin.read(
            lambda: protocol.recv_struct(self.sock, protocol.REPLY)
        )
        if magic != protocol.DATA_MAGIC:
            raise protocol.WireError("the data port did not answer with the psgd protocol")
        if status:
            if size > protocol.MAX_ERROR_BYTES:
                raise protocol.WireError("oversized error message")
            text = bytearray(size)
            protocol.recv_exact(self.sock, memoryview(text))
            raise LinkError(
                protocol.status_code(status),
                text.decode("utf-8", "replace"),  # its outcome byte is
                reason_name(outcome),
                next_clock,
            )  # its reason, its next clock a ROLLED_BACK's clock
        return outcome, version, next_clock, staleness, size

    def _ask(self, clock: int, rows: RowsOut | None, into: list[memoryview]) -> tuple[int, int, int, list]:
        """Send a pull (with the ids of ``rows``, by table, where given); its answer (:meth:`_answer`)."""
        if rows:
            payload, n = sections({table: (ids, None) for table, (ids, _) in rows.items()})
            self._send(protocol.OP_PULL_ROWS, self.worker, clock, 0, 0, payload, n)
        else:
            self._send(protocol.OP_PULL, self.worker, clock, 0, 0, [], 0)
        return self._answer(rows, into)

    def _answer(self, rows: RowsOut | None, into: list[memoryview]) -> tuple[int, int, int, list]:
        """A pull's reply: its version, slot and sequence number, and the views its row values are to be received
        into, once its size is checked."""
        _, version, slot, seq, size = self._reply()
        values = [memoryview(out.reshape(-1)).cast("B") for _, out in (rows or {}).values() if out.size]
        expected = sum(v.nbytes for v in into) + sum(v.nbytes for v in values)
        if size != expected:
            raise protocol.WireError(
                f"the shard sent {size} bytes of weights and rows, the plan and the rows asked for say {expected}"
            )
        return version, slot, seq, values

    def pull(self, clock: int, into: list[memoryview], rows: RowsOut | None = None) -> int:
        """Receive the shard's weights straight into ``into`` (slice order), and the rows of ``rows`` (table ->
        (ids, the array their values fill)) after them; returns the version."""
        return self._take(self._ask(clock, rows, into), into)

    def _take(self, answer: tuple[int, int, int, list], into: list[memoryview]) -> int:
        """Receive the weights (and rows) of a pull's ``answer``; its version."""
        version, _, _, values = answer
        for view in [*into, *values]:
            protocol.recv_exact(self.sock, view)
        return version

    def push_pull(
        self,
        clock: int,
        base_version: int,
        dtype_code: int,
        payload: list,
        size: int,
        into: list[memoryview],
        got: dict,
        **take,
    ) -> tuple[PushReply, int | None]:
        """Push ``clock``'s gradient and receive the weights of ``clock + 1`` into ``into`` from the same answer
        (OP_PUSH_PULL); the push's reply goes into ``got["push"]`` once it came (a break after it is the pull's
        alone).  None for the version where the shard said why the pull could not go."""
        got["push"] = reply = self.push(clock, base_version, dtype_code, payload, size, op=protocol.OP_PUSH_PULL)
        if got.get("cut"):  # the worker is stopping: it waits for no weights now (see TcpData.interrupt)
            raise protocol.WireError("the worker is stopping")
        try:
            return reply, self._take(self._answer(None, into), into, **take)
        except LinkError:  # answered in full: the connection goes on
            return reply, None

    def _rows_after(self, rows: RowsIn | None) -> list:
        """What follows a push's gradient: the bytes of its rows and their sections (nothing without rows)."""
        if not rows:
            return []
        payload, n = sections(rows)
        return [protocol.ROWS_LENGTH.pack(n), *payload]

    def push(
        self,
        clock: int,
        base_version: int,
        dtype_code: int,
        payload: list,
        size: int,
        rows: RowsIn | None = None,
        op: int = protocol.OP_PUSH,
    ) -> PushReply:
        """Send a gradient, and the row gradients of ``rows`` after it; a large gradient waits for the shard's
        go-ahead before its payload."""
        op, after = (protocol.OP_PUSH_ROWS if rows else op), self._rows_after(rows)
        if protocol.wants_go_ahead(size):
            self._send(op, self.worker, clock, base_version, dtype_code, [], size)
            if self._reply()[0] != protocol.READY:
                raise protocol.WireError("the shard answered a push header without its go-ahead")
            protocol.send_buffers(self.sock, [*payload, *after])
        else:
            self._send(op, self.worker, clock, base_version, dtype_code, [*payload, *after], size)
        outcome, version, next_clock, staleness, _ = self._reply()
        return PushReply(protocol.OUTCOMES[outcome], next_clock, version, staleness)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class TcpData(DataLink):
    """Pulls and pushes on the data port the shard gave at registration, each on a connection of its own, opened
    by ``opener`` where it gives one (the shared-memory data link's: :mod:`psgd.link.shm`), else a plain one."""

    via = "tcp"

    def __init__(
        self, control: ControlLink, device: Device, opener: Callable[[str], DataConnection | None] | None = None
    ):
        super().__init__(control, device)
        self.opener = opener
        self.data_port = 0
        self._key = ""  # the registration the connections' hellos give
        # one connection for pulls and one for pushes, so that a pull may run while a push is in flight
        # (overlap): a connection carries one call at a time
        self._conns: dict[str, DataConnection | None] = {"pull": None, "push": None}
        self._pending: dict | None = None  # the push and pull in flight: its push's reply once it came
        self._interrupted = False

    def registered(self, reply: ps_pb2.RegisterReply) -> bool:
        if reply.data_port != self.data_port or reply.registration != self._key:  # a restarted shard may listen
            self.reset()  # elsewhere (and the connections' hellos gave the old key)
        self.data_port, self._key = reply.data_port, reply.registration
        return bool(self.data_port)

    def _connection(self, purpose: str) -> DataConnection:
        conn = self._conns[purpose]
        if conn is None:
            ep = self.endpoint
            conn = self.opener(purpose) if self.opener is not None else None
            if conn is None:
                conn = DataConnection(
                    ep.host,
                    self.data_port,
                    ep.worker_id,
                    ep.plan_hash,
                    ep.token,
                    ep.request_timeout,
                    ep.tls,
                    busy_poll=ep.busy_poll,
                    key=self.control.registration,
                )
            self._conns[purpose] = conn
        return conn

    def over(self, purpose: str, fn: Callable[[DataConnection], T]) -> T:
        """``fn(connection)`` on the ``purpose`` ("pull" or "push") connection; a broken connection is
        dropped (reopened next time) and reported as UNAVAILABLE, which the caller may retry.  Where one cannot
        be opened, the shard may have restarted at another data port (:meth:`_moved`)."""
        try:
            conn = self._connection(purpose)
        except protocol.WireError as err:
            self._moved()
            raise LinkError(Code.UNAVAILABLE, f"data connection: {err}") from None
        try:
            return fn(conn)
        except protocol.WireError as err:
            self._drop(purpose)
            raise LinkError(Code.UNAVAILABLE, f"data connection: {err}") from None

    def _moved(self) -> None:
        """The data port could not be reached: ask the shard over gRPC where it listens now.  A restarted shard
        takes a free port unless one is named, and knows this worker no more: NOT_REGISTERED then, on which the
        worker registers again and hears the new port, rather than retrying one nobody holds until a heartbeat
        tells it.  A shard that does not answer over gRPC either is down: the caller retries as before."""
        try:
            now = self.control.status().data_port
        except LinkError:
            return
        if now != self.data_port:
            raise LinkError(
                Code.FAILED_PRECONDITION,
                f"shard {self.endpoint.shard} listens on data port "
                f"{now or 'none'} now, not {self.data_port}: it restarted",
                reason="NOT_REGISTERED",
            )

    def pull(self, clock: int, views: list[memoryview], rows: RowsOut | None = None) -> int:
        return self.over("pull", lambda conn: conn.pull(clock, views, rows))

    def push(
        self, clock: int, base_version: int, codec: Codec, parts: list[memoryview], rows: RowsIn | None = None
    ) -> PushReply:
        size = sum(memoryview(p).nbytes for p in parts)
        return self.over("push", lambda conn: conn.push(clock, base_version, codec.code, parts, size, rows))

    def push_pull(
        self, clock: int, base_version: int, codec: Codec, parts: list, views: list[memoryview]
    ) -> tuple[PushReply, int | None]:
        size = sum(memoryview(p).nbytes for p in parts)
        return self.pushed_then(
            lambda conn, got: conn.push_pull(clock, base_version, codec.code, parts, size, views, got)
        )

    def pushed_then(self, call) -> tuple[PushReply, int | None]:
        """``call(push connection, got)`` (a push and pull); where the connection broke after the push's reply
        came (in ``got``), that reply and no version: the weights are pulled on their own then."""
        got: dict = {}
        self._pending = got
        if self._interrupted:  # cut before this began (it stays cut: the worker is stopping), after its push
            got["cut"] = True
        try:
            return self.over("push", lambda conn: call(conn, got))
        except LinkError:
            if "push" in got:
                return got["push"], None
            raise
        finally:
            self._pending = None

    def interrupt(self) -> None:
        """End a pull in flight: on the pull connection, or the pull half of a push and pull once its push's reply
        came.  A push is never cut: the shard may have applied it, and its worker must hear so."""
        self._interrupted = True  # for good: the worker is stopping
        pending = self._pending
        if pending is not None:  # a push and pull: its push goes on to its reply, its pull half is cut
            pending["cut"] = True
        for purpose, conn in list(self._conns.items()):
            if conn is not None and (purpose == "pull" or pending is not None and "push" in pending):
                conn.interrupt()

    def _drop(self, purpose: str) -> None:
        conn, self._conns[purpose] = self._conns[purpose], None
        if conn is not None:
            conn.close()

    def reset(self) -> None:
        """Drop the data connections; the next calls open new ones."""
        for purpose in self._conns:
            self._drop(purpose)

    def close(self) -> None:
        self.reset()
