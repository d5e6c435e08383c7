"""The data port's gatekeeper: accepting connections and checking their hellos.

Connections cannot be hoarded.  Until its hello has been checked (token, plan,
worker id) a connection is *unauthenticated* and holds no thread: one
gatekeeper thread accepts connections, reads their hellos without blocking and
hands each authenticated one to the :class:`~psgd.server.net.datapath.DataServer`,
which serves it on a thread of its own.  Unauthenticated connections have
their own small cap (MAX_UNAUTHENTICATED, at most MAX_UNAUTHENTICATED_PER_PEER
from one address), separate from the cap on served ones (4 per worker + 8);
when it is full a new connection evicts the oldest unauthenticated one (those
that have sent nothing first), so a worker, whose hello arrives with its
connection, always finds room; on loopback, where every peer is 127.0.0.1,
this eviction is what protects the workers.  A hello must arrive within
``hello_timeout`` (2 s), new connections are accepted at ACCEPT_RATE per
second at most (bounding what a flood costs this process), every refusal is
answered with an error reply saying why where the protocol allows it, and
refusals are summed up in the log every REFUSAL_LOG_SECONDS instead of one
line each.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable

from psgd.server.net import hello
from psgd.server.net.tokens import Here, Proofs
from psgd.server.state.core import ShardCore
from psgd.wire import protocol

log = logging.getLogger(__name__)


#: Connections accepted whose hello has not been checked yet, at most (then the oldest is evicted) ...
MAX_UNAUTHENTICATED = 32
#: ... and at most this many of them from one address.
MAX_UNAUTHENTICATED_PER_PEER = 16
#: New connections accepted per second at most, in bursts of up to ACCEPT_BURST: a flood of
#: connections then costs this process a bounded share of one core, whatever its rate.  A worker
#: waits its turn in the listen backlog (BACKLOG): well under a second.
ACCEPT_RATE, ACCEPT_BURST, BACKLOG = 1000.0, 256, 512
#: Connections accepted in one go before the gatekeeper looks at the hellos in progress again.
_ACCEPT_BATCH = 64
#: Refused connections are summed up in the log at most once per this many seconds.
REFUSAL_LOG_SECONDS = 5.0

#: Takes an authenticated connection ``(sock, peer, worker)``: None once it is taken, else the refusal
#: ``(code, message, reason)`` the gatekeeper sends before closing it.
#: (connection, peer, worker id, the hello's wish for a shared-memory segment: "", "pull" or "push", the worker's
#: registration key)
HandOver = Callable[[socket.socket, tuple, int, str, str], "tuple[str, str, str] | None"]


class Gatekeeper:
    """Accepts connections on the listening socket ``sock`` (non-blocking; the gatekeeper closes it on
    :meth:`stop`) and passes each one whose hello checks out to ``hand_over``."""

    def __init__(
        self,
        core: ShardCore,
        sock: socket.socket,
        *,
        token: str,
        tls: ssl.SSLContext | None,
        hello_timeout: float,
        max_unauthenticated: int,
        max_per_peer: int,
        hand_over: HandOver,
        here: Here | None = None,
    ):
        self.core, self.sock, self.tls = core, sock, tls
        host, port = sock.getsockname()[:2]  # the token, which a hello proves: once, made for this port
        self.proofs = Proofs(token, here or Here(host), lambda: port)
        self.hello_timeout = hello_timeout
        self.max_unauthenticated = max(1, max_unauthenticated)
        self.max_per_peer = max(1, min(max_per_peer, self.max_unauthenticated))
        self._hand_over = hand_over
        self._stop = threading.Event()
        # touched by the gatekeeper's thread only
        self._pending: set[_Pending] = set()  # accepted, hello not checked yet
        self._selector = selectors.DefaultSelector()
        self._listening = False
        self._tokens, self._refilled = float(ACCEPT_BURST), time.monotonic()
        self._refusals = _RefusalLog(core.shard, REFUSAL_LOG_SECONDS)
        self._thread = threading.Thread(target=self._gatekeep, name=f"shard{core.shard}-data", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting: the listening socket is closed, which wakes the gatekeeper at once."""
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass

    def join(self, timeout: float) -> None:
        if self._thread.ident is not None:  # a gatekeeper stopped before it started has nothing to wait for
            self._thread.join(timeout)

    def _gatekeep(self) -> None:
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                self._tokens = min(float(ACCEPT_BURST), self._tokens + (now - self._refilled) * ACCEPT_RATE)
                self._refilled = now
                if not self._listen(self._tokens >= 1):
                    return
                try:
                    events = self._selector.select(self._wait(now))
                except (OSError, ValueError):
                    if self._stop.is_set():
                        return
                    raise
                for key, _ in events:
                    if key.data is None:
                        if not self._accept_some():
                            return
                    elif key.data in self._pending:
                        self._advance(key.data)
                now = time.monotonic()
                for p in [p for p in self._pending if p.deadline <= now]:
                    self._refuse(
                        p,
                        "DEADLINE_EXCEEDED",
                        f"no hello within {self.hello_timeout:g} s: a data "
                        "connection must open with its psgd hello at once",
                        "no hello in time",
                    )
                self._refusals.flush(now)
        except Exception:  # a bug here would silently close the data port: say so loudly
            log.exception("shard %d: the data port stopped accepting connections", self.core.shard)
            raise
        finally:
            for p in list(self._pending):
                self._forget(p)
                _close(p.sock)
            self._refusals.flush(time.monotonic(), force=True)
            self._selector.close()

    def _listen(self, on: bool) -> bool:
        """Watch the listening socket for new connections, or not (no accept tokens left); False once
        the server is stopping."""
        if self._stop.is_set():
            return False
        if on != self._listening:
            try:
                if on:
                    self._selector.register(self.sock, selectors.EVENT_READ, None)
                else:
                    self._selector.unregister(self.sock)
            except (OSError, ValueError, KeyError):  # the listening socket was closed by stop()
                return False
            self._listening = on
        return True

    def _wait(self, now: float) -> float:
        """How long the gatekeeper may sleep: until the next hello deadline, accept token or log line."""
        wake = now + 0.5
        if self._pending:
            wake = min(wake, min(p.deadline for p in self._pending))
        if self._tokens < 1:
            wake = min(wake, now + (1 - self._tokens) / ACCEPT_RATE)
        due = self._refusals.due()
        if due is not None:
            wake = min(wake, due)
        return max(0.0, wake - now)

    def _accept_some(self) -> bool:
        """Accept what the tokens allow (at most _ACCEPT_BATCH); False once the server is stopping."""
        for _ in range(_ACCEPT_BATCH):
            if self._tokens < 1:
                break
            try:
                conn, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                break
            except OSError as exc:
                if self._stop.is_set():
                    return False
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("shard %d: cannot accept a data connection: %s; pausing 0.1 s", self.core.shard, exc)
                    if self._pending:
                        self._evict(list(self._pending))
                    self._tokens = -0.1 * ACCEPT_RATE  # accept nothing for 0.1 s
                    break
                raise
            self._tokens -= 1
            self._admit(conn, peer)
        return True

    def _admit(self, conn: socket.socket, peer) -> None:
        """Hold a new connection until its hello comes, making room for it first."""
        host = str(peer[0])
        mine = [p for p in self._pending if p.host == host]
        if len(mine) >= self.max_per_peer:
            self._evict(mine)
        elif len(self._pending) >= self.max_unauthenticated:
            counts: dict[str, int] = {}
            for p in self._pending:
                counts[p.host] = counts.get(p.host, 0) + 1
            heaviest = max(counts, key=counts.__getitem__)  # the address that holds the most slots pays
            self._evict([p for p in self._pending if p.host == heaviest])
        try:
            conn.setblocking(False)
            protocol.tune(conn)
        except OSError:  # already reset by the peer
            _close(conn)
            return
        now = time.monotonic()
        p = _Pending(conn, peer, now, now + self.hello_timeout, tls=self.tls is not None)
        self._pending.add(p)
        self._selector.register(conn, selectors.EVENT_READ, p)
        self._advance(p)  # a worker's hello is usually here already

    def _evict(self, candidates: list[_Pending]) -> None:
        victim = min(candidates, key=lambda p: (p.progress, p.accepted))  # silent ones first, then the oldest
        self._refuse(
            victim,
            "UNAVAILABLE",
            f"shard {self.core.shard} closed this data connection to make room: "
            f"too many connections were waiting for their hello (at most {self.max_unauthenticated}, "
            f"{self.max_per_peer} from one address)",
            "evicted waiting for its hello",
        )

    def _advance(self, p: _Pending) -> None:
        """Read what has come of ``p``'s hello (never blocking); check it once it is whole."""
        try:
            if p.state == "tls" and not self._tls_start(p):
                return
            if p.state == "handshake":
                p.sock.do_handshake()
                p.state = "header"
            while True:
                if p.got < len(p.buf):
                    n = p.sock.recv_into(memoryview(p.buf)[p.got :])
                    if n == 0:
                        self._drop(p, "closed before its hello")
                        return
                    p.progress, p.got = True, p.got + n
                    continue
                if p.state == "header":
                    magic, op, _, worker, _, _, size = protocol.REQUEST.unpack(p.buf)
                    if magic != protocol.DATA_MAGIC or op != protocol.OP_HELLO or size > protocol.MAX_HELLO_BYTES:
                        raise hello.Refusal(
                            "INVALID_ARGUMENT", "a data connection must start with a psgd hello", "not a psgd hello"
                        )
                    p.worker, p.state, p.buf, p.got = worker, "body", bytearray(size), 0
                    continue
                checked = hello.check(
                    p.buf,
                    p.worker,
                    proofs=self.proofs,
                    plan_hash=self.core.plan.hash,
                    shard=self.core.shard,
                    roster=self.core.roster,
                )
                self._authenticated(p, *checked)
                return
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            self._want(p, selectors.EVENT_READ)
        except ssl.SSLWantWriteError:
            self._want(p, selectors.EVENT_WRITE)
        except hello.Refusal as r:
            self._refuse(p, r.code, str(r), r.reason)
        except (ssl.SSLError, OSError, ValueError) as exc:
            if p.state in ("tls", "handshake"):
                self._refuse(p, "UNAUTHENTICATED", f"TLS handshake failed: {exc}", "TLS handshake failed", reply=False)
            else:
                self._drop(p, f"broken before its hello: {exc}")

    def _tls_start(self, p: _Pending) -> bool:
        """Start the TLS handshake of ``p``; a plaintext psgd hello is told that this port wants TLS."""
        head = p.sock.recv(len(protocol.DATA_MAGIC), socket.MSG_PEEK)
        if not head:
            self._drop(p, "closed before its hello")
            return False
        if head == protocol.DATA_MAGIC:
            self._refuse(
                p,
                "FAILED_PRECONDITION",
                f"the data port of shard {self.core.shard} speaks TLS only: give "
                "the worker the job's TLS settings (--tls-ca, and --tls-cert/--tls-key for mutual TLS)",
                "plaintext hello to a TLS port",
                reply=True,
            )
            return False
        self._selector.unregister(p.sock)
        p.sock = self.tls.wrap_socket(p.sock, server_side=True, do_handshake_on_connect=False)  # detaches the raw one
        self._selector.register(p.sock, p.events, p)
        p.state, p.progress = "handshake", True
        return True

    def _want(self, p: _Pending, events: int) -> None:
        if events != p.events:
            p.events = events
            self._selector.modify(p.sock, events, p)

    def _authenticated(self, p: _Pending, worker: int, shm: str, key: str) -> None:
        """Hand ``p`` over to be served; refuse it if it cannot be."""
        self._forget(p)
        refusal = self._hand_over(p.sock, p.peer, worker, shm, key)
        if refusal is not None:
            self._refuse(p, *refusal)

    def _refuse(self, p: _Pending, code: str, message: str, reason: str, reply: bool | None = None) -> None:
        """Close ``p``, first telling the peer why (never blocking), and count it for the log."""
        self._forget(p)
        if reply if reply is not None else p.state not in ("tls", "handshake"):
            try:
                p.sock.send(protocol.error_reply(code, message))
            except (OSError, ValueError):
                pass
        self._refusals.note(p.host, reason, time.monotonic())
        _close(p.sock)

    def _drop(self, p: _Pending, why: str) -> None:
        log.debug("shard %d: data connection from %s %s", self.core.shard, p.peer, why)
        self._forget(p)
        _close(p.sock)

    def _forget(self, p: _Pending) -> None:
        if p in self._pending:
            self._pending.discard(p)
            try:
                self._selector.unregister(p.sock)
            except (KeyError, ValueError, OSError):
                pass


class _Pending:
    """A connection accepted but not yet authenticated, its hello read by the gatekeeper piece by piece."""

    __slots__ = ("sock", "peer", "host", "accepted", "deadline", "state", "buf", "got", "worker", "progress", "events")

    def __init__(self, sock: socket.socket, peer, now: float, deadline: float, tls: bool):
        self.sock, self.peer, self.host = sock, peer, str(peer[0])
        self.accepted, self.deadline = now, deadline
        self.state = "tls" if tls else "header"  # tls -> handshake -> header -> body
        self.buf, self.got, self.worker = bytearray(protocol.REQUEST.size), 0, 0
        self.progress = False  # has the peer sent anything yet?
        self.events = selectors.EVENT_READ


def _close(sock: socket.socket) -> None:
    """Close a connection that is being refused: what the peer sent is read first (a close with unread
    bytes would reset the connection, and could destroy the error reply before the peer reads it)."""
    try:
        for _ in range(4):
            if not sock.recv(1 << 16):
                break
    except (OSError, ValueError):
        pass
    try:
        sock.shutdown(socket.SHUT_WR)
    except (OSError, ValueError):
        pass
    sock.close()


class _RefusalLog:
    """Refused connections, counted by address and reason and written in one burst of lines per
    ``every`` seconds at most; the first one after a quiet spell is written at once."""

    MAX_LINES = 4  # (address, reason) lines per burst; the rest are summed up in one more line
    MAX_KEYS = 256  # counters kept at most; further addresses are counted together

    def __init__(self, shard: int, every: float):
        self.shard, self.every = shard, every
        self.counts: dict[tuple[str, str], int] = {}
        self.last = -float("inf")  # when lines were last written

    def note(self, host: str, reason: str, now: float) -> None:
        if not self.counts and now - self.last >= self.every:
            log.warning("shard %d: refused a data connection from %s (%s)", self.shard, host, reason)
            self.last = now
            return
        key = (host, reason)
        if key not in self.counts and len(self.counts) >= self.MAX_KEYS:
            key = ("other addresses", reason)
        self.counts[key] = self.counts.get(key, 0) + 1

    def due(self) -> float | None:
        """When the next lines are due (None: nothing to write)."""
        return self.last + self.every if self.counts else None

    def flush(self, now: float, force: bool = False) -> None:
        if not self.counts or (now - self.last < self.every and not force):
            return
        window = min(now - self.last, 10 * self.every)
        ranked = sorted(self.counts.items(), key=lambda kv: -kv[1])
        for (host, reason), n in ranked[: self.MAX_LINES]:
            log.warning(
                "shard %d: refused %d data connection(s) from %s in the last %.0fs (%s)",
                self.shard,
                n,
                host,
                window,
                reason,
            )
        rest = ranked[self.MAX_LINES :]
        if rest:
            log.warning(
                "shard %d: refused %d more data connection(s) from %d other address(es) or reason(s) in the last %.0fs",
                self.shard,
                sum(n for _, n in rest),
                len(rest),
                window,
            )
        self.counts.clear()
        self.last = now
