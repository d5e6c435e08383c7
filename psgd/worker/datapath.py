"""The worker's end of the bulk data path (see :mod:`psgd.server.datapath`)."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl

import grpc

from psgd import wire
from psgd.status import reason_name

_STATUS = {code.value[0]: code for code in grpc.StatusCode}


class DataStatus(Exception):
    """The shard answered a data-path request with an error status."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = ""):
        super().__init__(message)
        self.code, self.message, self.reason = code, message, reason


class DataConnection:
    """One data-path connection to one shard, opened with a hello (worker id, plan hash, token)."""

    def __init__(self, host: str, port: int, worker: int, plan_hash: str, token: str = "", timeout: float = 60.0,
                 tls=None):
        try:
            self.sock = socket.create_connection((host, port), timeout=min(timeout, 10.0))
        except OSError as exc:
            raise wire.WireError(f"cannot connect to the data port {host}:{port}: {exc}") from None
        try:
            wire.tune(self.sock)
            if tls is not None and tls.enabled:
                try:
                    self.sock.settimeout(min(timeout, 10.0))
                    self.sock = tls.wrap_client(self.sock, host)
                except (ssl.SSLError, OSError) as exc:
                    raise DataStatus(grpc.StatusCode.UNAVAILABLE if isinstance(exc, socket.timeout)
                                     else grpc.StatusCode.UNAUTHENTICATED,
                                     f"TLS handshake with the data port {host}:{port} failed: {exc}") from None
            self.sock.settimeout(timeout)
            body = json.dumps({"token": token, "plan_hash": plan_hash}).encode()
            try:
                self._send(wire.OP_HELLO, worker, 0, 0, 0, [body], len(body))
            except wire.WireError as exc:
                self._refused(host, port, exc)
            try:
                self._reply()
            except wire.WireError as exc:
                raise wire.WireError(f"the data port {host}:{port} gave no answer to the hello: {exc}") from None
        except BaseException:  # a refused or broken hello: do not leave the socket to the garbage collector
            self.sock.close()
            raise
        self.worker = worker

    def _refused(self, host: str, port: int, exc: wire.WireError):
        """The hello could not be sent: the shard may have refused the connection (full, too late) and
        closed it, saying why first.  Raise its reason (DataStatus) if it sent one, else a WireError."""
        try:
            self.sock.settimeout(1.0)
            self._reply()
        except (wire.WireError, OSError):
            pass
        raise wire.WireError(f"the data port {host}:{port} closed the connection before the hello: {exc}") from None

    def interrupt(self) -> None:
        """End a call blocked on this connection (from another thread); the connection is then dead."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _send(self, op: int, worker: int, clock: int, base_version: int, dtype_code: int,
              payload: list, size: int) -> None:
        head = wire.REQUEST.pack(wire.DATA_MAGIC, op, dtype_code, worker, clock, base_version, size)
        wire.send_buffers(self.sock, [head, *payload])

    def _reply(self) -> tuple:
        magic, status, outcome, version, next_clock, staleness, size = wire.recv_struct(self.sock, wire.REPLY)
        if magic != wire.DATA_MAGIC:
            raise wire.WireError("the data port did not answer with the psgd protocol")
        if status:
            if size > wire.MAX_ERROR_BYTES:
                raise wire.WireError("oversized error message")
            text = bytearray(size)
            wire.recv_exact(self.sock, memoryview(text))
            raise DataStatus(_STATUS.get(status, grpc.StatusCode.UNKNOWN), text.decode("utf-8", "replace"),
                             reason_name(outcome))  # an error reply's outcome byte is its reason
        return outcome, version, next_clock, staleness, size

    def pull(self, clock: int, into: list[memoryview]) -> int:
        """Receive the shard's weights straight into ``into`` (slice order); returns the version."""
        self._send(wire.OP_PULL, self.worker, clock, 0, 0, [], 0)
        _, version, _, _, size = self._reply()
        expected = sum(v.nbytes for v in into)
        if size != expected:
            raise wire.WireError(f"the shard sent {size} bytes of weights, the plan says {expected}")
        for view in into:
            wire.recv_exact(self.sock, view)
        return version

    def push(self, clock: int, base_version: int, dtype_code: int, payload: list, size: int) -> tuple:
        """Send a gradient; returns (outcome, version, next clock, staleness).

        A large one waits for the shard's go-ahead before its payload (see :mod:`psgd.wire`)."""
        if wire.wants_go_ahead(size):
            self._send(wire.OP_PUSH, self.worker, clock, base_version, dtype_code, [], size)
            if self._reply()[0] != wire.READY:
                raise wire.WireError("the shard answered a push header without its go-ahead")
            wire.send_buffers(self.sock, payload)
        else:
            self._send(wire.OP_PUSH, self.worker, clock, base_version, dtype_code, payload, size)
        outcome, version, next_clock, staleness, _ = self._reply()
        return wire.OUTCOMES[outcome], version, next_clock, staleness

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
