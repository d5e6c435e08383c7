"""What one process of a shard's pair asks the other (:mod:`psgd.server.durable.replica`), and how it checks the answer;
whether a shard of the job that a rollback names as its cause restarted (:func:`restart_of`).

Whatever answers at the peer's address may be a stranger's process once the peer died, so the question proves that
the asker holds the job's token without sending it, and an answer counts only when it proves the same of its sender
(:mod:`psgd.server.net.tokens`): a claim to lead from a process without the token is not believed.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Sequence
from concurrent import futures

import grpc

from psgd.observe.logs import Quieted
from psgd.proto import ps_pb2, ps_pb2_grpc
from psgd.wire import proofs
from psgd.wire.channel import open_channel
from psgd.wire.tls import NO_TLS, TLSFiles

log = logging.getLogger("psgd.server.durable.replica")

#: how long a status call to the peer may take before the peer counts as gone
PEER_SECONDS = 0.5
#: seconds between two lines saying that an answer was not believed (a squatter answers every few tenths)
UNPROVEN_SAID_EVERY = 60.0
_unproven = Quieted(UNPROVEN_SAID_EVERY)


def _ask(address: str, token: str, tls: TLSFiles, ticket: str = "") -> tuple[ps_pb2.StatusReply | None, bool]:
    """The Status answer of the shard process at ``address`` (None: none in time) and whether it proves that its
    sender holds ``token`` (psgd.server.net.tokens: the call proves it too, the token itself is never sent), and, with
    a ``ticket``, that it follows this process with that ticket."""
    challenge = secrets.token_hex(16) if token else ""
    try:
        with open_channel(address, tls, token) as channel:  # each call proves the token, made for this address
            reply = ps_pb2_grpc.ParameterServerStub(channel).Status(
                ps_pb2.StatusRequest(challenge=challenge, ticket=ticket), timeout=PEER_SECONDS
            )
    except grpc.RpcError:
        return None, False
    return reply, proofs.answered(token, challenge, reply.proof, *proofs.status_said(reply), *filter(None, [ticket]))


def confirms(address: str, ticket: str, token: str = "", tls: TLSFiles = NO_TLS) -> bool:
    """Whether the process at ``address`` (a replica's, as the job gives it) proves that it follows this one with
    the connection that gave ``ticket``: another holder of the token, elsewhere, cannot (without a token, nothing
    is proven: whatever answers there confirms)."""
    reply, proven = _ask(address, token, tls, ticket)
    return reply is not None and proven and (not token or bool(ticket))


def peer_status(address: str, token: str = "", tls: TLSFiles = NO_TLS) -> ps_pb2.StatusReply | None:
    """The Status of the other process of the pair, at ``address``; None when it does not answer in time, or its
    answer does not prove that it holds ``token`` (said in a WARNING line)."""
    reply, proven = _ask(address, token, tls)
    if reply is None or proven:
        return reply
    if _unproven.due() is not None:  # said once a minute at most, as refused followers are
        log.warning(
            "the process at %s answered as shard %d's %s without proving that it holds the job's token: "
            "not believed (taken for gone)",
            address,
            reply.shard,
            reply.role or "peer",
        )
    return None


def restart_of(
    job: Sequence[str], cause: str, version: int, shard: int, token: str = "", tls: TLSFiles = NO_TLS
) -> str:
    """Why shard ``shard`` cannot believe that the job goes back to the cut at ``version`` because of ``cause`` ("":
    it can).  The cause is looked for only at ``job``, the addresses of the job's own shards and replicas (its
    [cluster] servers and replica_servers), never at one a request names: a registered worker may run a shard of
    this job of its own anywhere.  Each is asked as the pair asks its peer (the question and its answer each prove
    the job's token); the one of incarnation ``cause`` must be another shard, restarted from a cut at ``version``
    or later."""
    if not job:
        return "this shard knows no address of the job's shards ([cluster] servers) to check the cause at"
    with futures.ThreadPoolExecutor(max_workers=len(job), thread_name_prefix=f"shard{shard}-restart") as pool:
        answers = list(zip(job, pool.map(lambda address: _ask(address, token, tls), job)))
    found = [(address, reply) for address, (reply, proven) in answers if proven and reply.incarnation == cause]
    if not found:
        unproven = [address for address, (reply, proven) in answers if reply is not None and not proven]
        return f"no shard of the job at its addresses ({', '.join(job)}) is of incarnation {cause[:40]!r}" + (
            f"; {', '.join(unproven)} answered without proving that it holds the job's token" if unproven else ""
        )
    address, reply = found[0]
    if reply.shard == shard:
        return f"the process at {address} is shard {shard}'s own, not another shard's"
    restored = _counters(reply).get("restored_version")
    if not isinstance(restored, int) or restored < version:
        return (
            f"shard {reply.shard} at {address} did not restart from a cut at version {version} or later (it "
            f"restarted from {'none' if restored is None else f'the cut at {restored}'})"
        )
    return ""


def _counters(reply: ps_pb2.StatusReply) -> dict:
    """The counters a Status answer carries ({} where they are not a JSON object)."""
    try:
        counters = json.loads(reply.counters_json or "{}")
    except ValueError:
        return {}
    return counters if isinstance(counters, dict) else {}


def failovers(reply: ps_pb2.StatusReply) -> int:
    """How many times the pair of the process that sent ``reply`` changed leader, as it counts."""
    try:
        return int(_counters(reply).get("failovers", 0))
    except (ValueError, TypeError):
        return 0
