"""What a data connection's hello must say, checked (:func:`check`), and why one is refused (:class:`Refusal`);
:mod:`psgd.server.net.gatekeeper` reads the hellos without blocking, and counts and logs the refusals.

A hello is a JSON object after the request header: a proof that its sender holds the job's token (``"proof"``,
made for this port and good once: psgd.wire.proofs; the token itself is never sent), the partition plan's hash, a
worker's registration key (``"key"``: what its registration over gRPC got), and the wish for a shared-memory
segment (``"shm"``: ``"pull"`` or ``"push"``, workers only) or to follow the shard as its replica (``"follow":
true``, the header naming no worker: psgd.server.durable.stream); the header names the worker.  A hello as a registered
worker without that registration's key is refused; every request on the connection is checked against the key
again (a connection of a worker that was not registered yet is served, and its requests are refused until it is).
"""

from __future__ import annotations

import json

from psgd.errors import PsgdError
from psgd.server.errors import ShardError
from psgd.server.net.tokens import Proofs
from psgd.server.state.admission import Roster
from psgd.wire import protocol


class Refusal(PsgdError):
    """A hello is refused: ``code`` and the message go to the peer, ``reason`` (a few words) to the log."""

    def __init__(self, code: str, message: str, reason: str):
        super().__init__(message)
        self.code, self.reason = code, reason


def check(
    body: bytes | bytearray, worker: int, *, proofs: Proofs, plan_hash: str, shard: int, roster: Roster
) -> tuple[int, str, str]:
    """The worker id, what the connection is for ("", "pull" or "push": a shared-memory segment; "follow": a
    replica) and the registration key it gave, of a hello whose header named ``worker`` and whose JSON body is
    ``body``, once checked against the shard's token (``proofs.token``; a follower proves it holds it, with
    ``proofs``), its plan's ``plan_hash`` and its ``roster``; a :class:`Refusal` otherwise."""
    try:
        said = json.loads(body)
        theirs, key, shm = str(said.get("plan_hash", "")), str(said.get("key", "")), str(said.get("shm", ""))
        follow, proof = said.get("follow") is True, str(said.get("proof", ""))
    except (ValueError, AttributeError, RecursionError):  # RecursionError: deeply nested JSON
        raise Refusal("INVALID_ARGUMENT", "the hello is not a JSON object", "not a psgd hello") from None
    if proofs.token and not proofs.check(proof, "follow" if follow else "hello"):
        raise Refusal(
            "UNAUTHENTICATED",
            "missing, wrong or replayed proof of the token: a hello proves that its "
            "sender holds the job's token with a fresh proof made for this port (psgd.wire.proofs)",
            "no proof of the token",
        )
    if theirs != plan_hash:
        raise Refusal(
            "FAILED_PRECONDITION",
            f"partition plan {theirs[:64]!r} is not shard {shard}'s (registering over gRPC says how they differ)",
            "another partition plan",
        )
    if worker != protocol.OBSERVER:
        try:
            roster.check(worker)
        except ShardError as err:
            raise Refusal(err.code, err.message, "worker id out of range") from None
    if follow and not shm and worker == protocol.OBSERVER:
        return worker, "follow", ""
    if shm not in ("", "pull", "push") or (shm and worker == protocol.OBSERVER) or follow:
        raise Refusal(
            "INVALID_ARGUMENT",
            f"a hello may ask for a \"pull\" or \"push\" segment (workers "
            f"only), not {shm!r}, or to follow (a replica, no worker)",
            "not a psgd hello",
        )
    try:  # a peek, without the shard's lock: each request checks again under it
        if worker != protocol.OBSERVER and roster.workers[worker].state == "live":
            roster.live(worker, key, renew=False)
    except ShardError as err:
        raise Refusal(err.code, err.message, "not the worker's registration") from None
    return worker, shm, key
