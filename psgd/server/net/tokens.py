"""The token check of a shard's calls: the proofs that a caller holds the job's token (psgd.wire.proofs), each
accepted once, at the address it names only if that is this process's (:class:`Here`); and the proofs with which
the processes of a pair show each other that an answer comes from a holder of the token.

No call sends the token: a gRPC call carries ``authorization: Proof WHEN SESSION COUNT TO MAC`` and a data-port
hello its ``"proof"`` (psgd.server.net.hello).  A shard accepts a proof when its time is within :data:`PROOF_SECONDS`
of its own clock, it names this process's port and no other machine of the job, and its
count was not used before in its session (each session's counts are remembered in a window of :data:`WINDOW`).  A
Status answer carries a keyed hash of the caller's fresh challenge and of what the answer says (:func:`answer`), so
that a claim to lead made by a process without the token is not believed.  Without a token (``--no-token``) there
is nothing to prove, and nothing is checked.
"""

from __future__ import annotations

import hmac
import socket
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from psgd.wire.proofs import PROOF_METADATA_KEY, PROOF_SECONDS, mac, parse

#: the most sessions remembered at once (a session is a caller's run of proofs): beyond it, proofs of new sessions
#: are refused until old ones expire
MOST_SESSIONS = 20_000
#: how many counts below a session's highest are still told apart (calls in flight at once, arriving in any order);
#: a proof further behind is refused
WINDOW = 4096
#: the most host names whose being this machine's is remembered
_MOST_NAMES = 256
#: seconds the job's addresses are kept before they are read again
JOB_SECONDS = 10.0


class Here:
    """Where this process listens (``host``), and the addresses of its job's shard processes now (``job()``: [cluster]
    servers and replica_servers).  A proof names the address its call was made to; it is accepted only at that
    port, and not where it names another machine of the job (:meth:`answers_to`): what a process at a dead shard's
    address heard is no good at the live one, on this machine or another.  An address that is neither this
    machine's nor the job's is one this port is reached through (a published or forwarded port, a load balancer)."""

    def __init__(self, host: str = "", job: Callable[[], Sequence[str]] = tuple):
        self.host, self.job = host.strip("[]"), job
        self._local: dict[str, bool] = {}
        self._lock = threading.Lock()
        self._hosts: tuple[float, set[str]] = (-float("inf"), set())  # the job's hosts, and when they were read

    def answers_to(self, to: str, port: int) -> bool:
        """Whether a call made to ``to`` (host:port) may have reached this process, listening on ``port``."""
        host, _, number = to.rpartition(":")
        host = host.strip("[]")
        if not number.isdigit() or int(number) != port or not host:
            return False
        if (host == self.host and host not in ("0.0.0.0", "::")) or self._is_local(host):
            return True
        return host not in self._job_hosts()  # else another machine of the job's

    def _job_hosts(self) -> set[str]:
        """The hosts of the job's addresses, read again at most every JOB_SECONDS (a launch writes them into the
        job file once every shard has bound its port, and ``job()`` may read that file)."""
        now = time.monotonic()
        with self._lock:
            read, hosts = self._hosts
        if now - read > JOB_SECONDS:
            hosts = {a.rpartition(":")[0].strip("[]") for a in self.job()}
            with self._lock:
                self._hosts = (now, hosts)
        return hosts

    def _is_local(self, host: str) -> bool:
        """Whether ``host`` names this machine: one of its addresses can be bound here."""
        with self._lock:
            known = self._local.get(host)
        if known is not None:
            return known
        try:
            found = {info[4][0]: info[0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)}
        except (OSError, UnicodeError, ValueError):
            found = {}
        local = False
        for address, family in found.items():
            try:
                with socket.socket(family, socket.SOCK_DGRAM) as probe:
                    probe.bind((address, 0))
                local = True
                break
            except OSError:
                continue
        with self._lock:
            if len(self._local) < _MOST_NAMES:
                self._local[host] = local
        return local


class Proofs:
    """Checks proofs (psgd.wire.proofs) made for this process (``here``, listening on ``port()``), each accepted
    once while its time is within PROOF_SECONDS."""

    def __init__(self, token: str, here: Here | None = None, port: Callable[[], int] = lambda: 0):
        self.token, self.here, self.port = token, here or Here(), port
        self._lock = threading.Lock()
        self._sessions: dict[str, list[int]] = {}  # session -> [highest count, window of counts seen, latest time]

    def check(self, proof: str, purpose: str) -> bool:
        parsed = parse(proof)
        if parsed is None:
            return False
        when, session, count, to, given = parsed
        now = time.time()
        if abs(now - when) > PROOF_SECONDS or count < 1:
            return False
        if not hmac.compare_digest(
            given.encode("ascii", "replace"), mac(self.token, "call", purpose, to, when, session, count).encode()
        ):
            return False
        if not self.here.answers_to(to, self.port()):
            return False  # made for another process: received by whoever held that address
        return self._first(session, count, when, now)

    def _first(self, session: str, count: int, when: int, now: float) -> bool:
        """Whether ``count`` is new in ``session`` (then remembered)."""
        with self._lock:
            seen = self._sessions.get(session)
            if seen is None:
                if len(self._sessions) >= MOST_SESSIONS:
                    self._sessions = {s: v for s, v in self._sessions.items() if now - v[2] <= PROOF_SECONDS}
                if len(self._sessions) >= MOST_SESSIONS:
                    return False  # too many sessions within their time to remember another
                self._sessions[session] = [count, 1, when]
                return True
            highest, window, latest = seen
            if count > highest:
                window = ((window << min(count - highest, WINDOW)) | 1) & ((1 << WINDOW) - 1)
                highest = count
            else:
                bit = 1 << (highest - count) if highest - count < WINDOW else 0
                if not bit or window & bit:
                    return False  # replayed, or too far behind to tell
                window |= bit
            # a session is forgotten only once every proof it accepted is too old to be accepted again
            seen[:] = [highest, window, max(latest, when)]
            return True


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call without a proof of the shared token made for this process (metadata
    ``authorization: Proof ...``, :class:`Proofs`)."""

    def __init__(self, token: str, here: Here | None = None, port: Callable[[], int] = lambda: 0):
        self._proofs = Proofs(token, here, port)

        def refuse(request, context):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing, wrong or replayed proof of the token: pass --token or set PSGD_TOKEN to the job's token",
            )

        self._refusals = {
            (False, False): grpc.unary_unary_rpc_method_handler(refuse),
            (False, True): grpc.unary_stream_rpc_method_handler(refuse),
            (True, False): grpc.stream_unary_rpc_method_handler(refuse),
            (True, True): grpc.stream_stream_rpc_method_handler(refuse),
        }

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith("/grpc.health.v1.Health/"):
            return continuation(handler_call_details)  # health checks stay open, as orchestrators expect
        for key, value in handler_call_details.invocation_metadata or ():
            if key == PROOF_METADATA_KEY:
                given = value if isinstance(value, str) else value.decode("ascii", "replace")
                if given.startswith("Proof ") and self._proofs.check(given[6:], method):
                    return continuation(handler_call_details)
                break
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return self._refusals[(handler.request_streaming, handler.response_streaming)]
