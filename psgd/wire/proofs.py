"""How a call shows that its maker holds the job's token without sending it: a keyed proof (HMAC-SHA256, with a key
derived from the token) of what the call is for, of the address it was made to, of when it was made and of a
session and count never used before.  Every caller makes them here: a gRPC channel opened with a token puts one in
each call's metadata (``authorization: Proof ...``, psgd.wire.channel.open_channel), and a data-port hello carries one
(psgd.link.tcp); the shard checks them (psgd.server.net.tokens).  A shard's Status answer to a fresh challenge
carries a proof too (:func:`answer`), which the other process of its pair checks (psgd.server.durable.peers).

What crosses the wire is good once, at one address, for one purpose, for :data:`PROOF_SECONDS`: a proof read off
the wire, or received by whoever holds a dead shard's port, cannot be replayed to the shard it was made for (its
count was used) nor to another (it names the address it was made to) nor made into a call of another kind.  Without
TLS the calls themselves still travel in the clear, and someone on the path could change them in flight; only TLS
(``[tls]``, a default ``psgd launch`` on one node) prevents that.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import itertools
import secrets
import time

#: how far a proof's time may be from the checking shard's clock (the machines' clocks may differ by less)
PROOF_SECONDS = 300.0
#: The gRPC metadata key that carries a call's proof, as ``Proof WHEN SESSION COUNT TO MAC``.
PROOF_METADATA_KEY = "authorization"


@functools.lru_cache(maxsize=8)
def _key(token: str) -> bytes:
    return hmac.new(token.encode("utf-8", "surrogatepass"), b"psgd peer proof", hashlib.sha256).digest()


def mac(token: str, *words: object) -> str:
    """The keyed hash of ``words`` with the key of ``token``."""
    said = "\x1f".join(str(w) for w in words).encode("utf-8", "surrogatepass")
    return hmac.new(_key(token), said, hashlib.sha256).hexdigest()


class Prover:
    """Makes the proofs of one caller's calls to the process at ``to`` (``host:port``, as the caller dialed it):
    each names ``to``, the time, this prover's random session and the next count in it."""

    def __init__(self, token: str, to: str):
        self.token, self.to = token, "".join(to.split())  # no spaces: a proof's fields are split on them
        self.session = secrets.token_hex(16)
        self._count = itertools.count(1)  # next() on it is atomic: callers on several threads never share a count

    def prove(self, purpose: str) -> str:
        """A fresh proof for ``purpose`` (a gRPC method, "hello", "follow"); "" without a token."""
        if not self.token:
            return ""
        when, count = int(time.time()), next(self._count)
        keyed = mac(self.token, "call", purpose, self.to, when, self.session, count)
        return f"{when} {self.session} {count} {self.to} {keyed}"


def parse(proof: str) -> tuple[int, str, int, str, str] | None:
    """(time, session, count, address, keyed hash) of a proof that has their form, else None."""
    words = proof.split(" ")
    if len(words) != 5 or not (words[0].isdigit() and words[2].isdigit() and len(words[1]) == 32):
        return None
    if len(words[0]) > 12 or len(words[2]) > 18 or len(words[3]) > 300:
        return None
    return int(words[0]), words[1], int(words[2]), words[3], words[4]


def answer(token: str, challenge: str, *said: object) -> str:
    """The proof that an answer saying ``said`` to the fresh ``challenge`` comes from a holder of ``token``."""
    return mac(token, "answer", challenge, *said) if token and challenge else ""


def answered(token: str, challenge: str, proof: str, *said: object) -> bool:
    """Whether ``proof`` is :func:`answer`'s for ``challenge`` and ``said`` (always, without a token)."""
    return not token or hmac.compare_digest(proof.encode("ascii", "replace"), answer(token, challenge, *said).encode())


def status_said(reply) -> tuple:
    """What a Status answer's proof covers (:func:`answer`): who answers, as what, how far it is, and its counters
    (the pair's failovers among them: a claim to lead)."""
    return reply.shard, reply.role, reply.version, reply.data_port, reply.incarnation, reply.counters_json
