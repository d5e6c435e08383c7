"""The token check of a shard's gRPC calls (the data port's is its hello's: psgd.server.gatekeeper), and the proofs
with which the two processes of a pair show each other that they hold the job's token without sending it.

A worker sends the token itself (``authorization: Bearer TOKEN``) to the addresses its job file names.  A pair's
processes also talk to whatever answers at the other's address, which may be a stranger's after the other died,
so they never send the token: a call carries ``authorization: Proof TIME.NONCE.MAC``, a keyed hash (HMAC-SHA256,
with a key derived from the token) of what it is for, when it was made and a random nonce, which a shard accepts
once within :data:`PROOF_SECONDS` of its own clock; and a Status answer carries a keyed hash of the caller's fresh
challenge and of what the answer says (:func:`answer`), so that a claim to lead made by a process without the token
is not believed.  Without a token (``--no-token``) there is nothing to prove, and nothing is checked.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time

import grpc

from psgd.wire.channel import TOKEN_METADATA_KEY

#: how far a proof's time may be from the checking shard's clock (the machines' clocks may differ by less)
PROOF_SECONDS = 300.0
#: the most proofs remembered at once (each accepted once): beyond it, proofs are refused until old ones expire
MOST_REMEMBERED = 100_000


def _key(token: str) -> bytes:
    return hmac.new(token.encode("utf-8", "surrogatepass"), b"psgd peer proof", hashlib.sha256).digest()


def _mac(token: str, *words: object) -> str:
    said = "\x1f".join(str(w) for w in words).encode("utf-8", "surrogatepass")
    return hmac.new(_key(token), said, hashlib.sha256).hexdigest()


def prove(token: str, purpose: str) -> str:
    """A proof that the caller holds ``token``, for ``purpose`` (a gRPC method, or "follow"), good once."""
    when, nonce = int(time.time()), secrets.token_hex(16)
    return f"{when}.{nonce}.{_mac(token, 'call', purpose, when, nonce)}"


def answer(token: str, challenge: str, *said: object) -> str:
    """The proof that an answer saying ``said`` to the fresh ``challenge`` comes from a holder of ``token``."""
    return _mac(token, "answer", challenge, *said) if token and challenge else ""


def answered(token: str, challenge: str, proof: str, *said: object) -> bool:
    """Whether ``proof`` is :func:`answer`'s for ``challenge`` and ``said`` (always, without a token)."""
    return not token or hmac.compare_digest(proof.encode("ascii", "replace"),
                                            answer(token, challenge, *said).encode())


class Proofs:
    """Checks proofs made with :func:`prove`, each accepted once while its time is within PROOF_SECONDS."""

    def __init__(self, token: str):
        self.token = token
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}  # nonce -> the proof's time, forgotten once it is too old to be accepted

    def check(self, proof: str, purpose: str) -> bool:
        when, _, rest = proof.partition(".")
        nonce, _, mac = rest.partition(".")
        now = time.time()
        if not (when.isdigit() and len(nonce) == 32 and abs(now - int(when)) <= PROOF_SECONDS):
            return False
        if not hmac.compare_digest(mac.encode("ascii", "replace"),
                                   _mac(self.token, "call", purpose, int(when), nonce).encode()):
            return False
        with self._lock:
            if len(self._seen) >= MOST_REMEMBERED:
                self._seen = {n: t for n, t in self._seen.items() if now - t <= PROOF_SECONDS}
            if nonce in self._seen or len(self._seen) >= MOST_REMEMBERED:
                return False  # replayed (or too many at once to remember)
            self._seen[nonce] = int(when)
        return True


def proof_metadata(token: str, method: str) -> tuple[tuple[str, str], ...]:
    """The metadata of a call to ``method`` (``/psgd.v1.ParameterServer/Status``) that proves the token."""
    return ((TOKEN_METADATA_KEY, f"Proof {prove(token, method)}"),) if token else ()


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call without the shared token (metadata ``authorization: Bearer TOKEN``) or a proof of it
    (``authorization: Proof ...``, :func:`prove`)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()
        self._proofs = Proofs(token)

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token: pass --token or set PSGD_TOKEN "
                                                           "to the job's token")

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
            if key == TOKEN_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(given, self._expected) or (
                        given.startswith(b"Proof ") and self._proofs.check(given[6:].decode("ascii", "replace"),
                                                                           method)):
                    return continuation(handler_call_details)
                break
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return self._refusals[(handler.request_streaming, handler.response_streaming)]


def status_said(reply) -> tuple:
    """What a Status answer's proof covers (:func:`answer`): who answers, as what, how far it is, and its counters
    (the pair's failovers among them: a claim to lead)."""
    return reply.shard, reply.role, reply.version, reply.data_port, reply.incarnation, reply.counters_json
