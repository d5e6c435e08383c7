"""A worker's part in going back to a cut (sync with ``[cluster] checkpoint_rounds``).

A shard that restarts comes back from its newest cut: the checkpoint every shard wrote as the same round closed
(:mod:`psgd.server.durable.recovery`).  The first worker to register with it hears that it is behind (``rollback_to``,
with the restarted shard's incarnation as the cause) and takes the job back: it asks every shard which cuts it
holds, picks the newest that all of them hold (no later than the restarted one's), and asks every shard to go
back to it (each does so once per cause, however many workers ask).  Every worker then continues from that
clock, its data from that step on, so the rounds the restart lost are computed again, from the same weights and
the same batches: the job ends where it would have ended undisturbed.  A worker that hears of it from a shard
that went back (ROLLED_BACK) continues from the clock it names once no shard is past it any more (the worker
taking the job back reaches them one by one; under sync none goes on without this one); where some shards are
still past it after :data:`FINISH_AFTER_SECONDS` (the worker taking the job back died on the way), it takes them
back itself, for the cause the shards that went back name: every shard goes back, or the job stops saying why.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent import futures
from typing import Any

from psgd.worker.errors import PSError, ShardWentBack

log = logging.getLogger(__name__)


#: how long a worker told that the job went back waits for the shards still past the cut before it takes them back
#: itself (the worker taking the job back reaches them within milliseconds, unless it died on the way)
FINISH_AFTER_SECONDS = 2.0


def _wait_for_every_shard(client: Any, clock: int) -> None:
    """Until no shard is past the cut at ``clock`` (the worker that takes the job back asks them one by one, and
    this one takes those left behind back after FINISH_AFTER_SECONDS); under sync none goes on from it without this
    worker.  Bounded by the request timeout."""
    began = time.monotonic()
    waits = client.deadlines.request_timeout
    deadline, finished = began + waits, False
    while True:
        replies = client.status()
        versions = [s.version for s in replies]
        if all(v <= clock for v in versions):
            return
        if not finished and time.monotonic() - began > FINISH_AFTER_SECONDS:
            finished = _finish(client, clock, replies)
        if time.monotonic() > deadline:
            raise PSError(
                f"worker {client.worker_id}: the shards are at versions {versions} "
                f"{waits:.0f}s after one went back to the cut at {clock}: the worker taking "
                "the job back to it did not reach them all (it may have died); restart the job from its "
                "checkpoints"
            )
        time.sleep(0.05)  # polling the shards' versions, with a deadline


def _finish(client: Any, clock: int, replies: list) -> bool:
    """Take the shards still past the cut at ``clock`` back to it, for the cause the shards at the cut name (each
    shard goes back once per cause, so a worker that was only slow changes nothing); False where they name no one
    cause."""
    causes = {json.loads(r.counters_json or "{}").get("last_cause", "") for r in replies if r.version == clock}
    causes.discard("")
    if len(causes) != 1:
        return False
    cause = causes.pop()
    behind = [k for k, r in enumerate(replies) if r.version > clock]
    log.warning(
        "worker %d: shard(s) %s are still past the cut at version %d %.0fs after the job went back to it "
        "(cause %s; the worker taking the job back may have died): taking them back",
        client.worker_id,
        behind,
        clock,
        FINISH_AFTER_SECONDS,
        cause,
    )
    for k in behind:
        client.retrying(k, f"going back to version {clock}", lambda k=k: client.links[k].rollback(clock, cause))
    return True


def roll_back(client: Any, rewind: ShardWentBack) -> int:
    """Go back as ``rewind`` says (every shard to the common cut, where it has a cause) with
    :class:`psgd.worker.client.PSClient` ``client``; returns the clock this worker continues from."""
    clock = rewind.clock
    if rewind.cause:
        held = client.on_all(
            lambda k: client.retrying(
                k, "listing the cuts", lambda: client.links[k].rollback(rewind.clock, rewind.cause, dry_run=True)
            )
        )
        common = set(held[0].cuts).intersection(*(set(r.cuts) for r in held[1:]))
        eligible = [v for v in common if v <= rewind.clock]
        if not eligible:
            listed = "; ".join(f"shard {k}: {list(r.cuts) or 'none'}" for k, r in enumerate(held))
            raise PSError(
                f"worker {client.worker_id}: a shard restarted from the cut at version {rewind.clock}, and "
                f"no cut at or before it is held by every shard ({listed}): the job cannot go back "
                "without losing rounds; restart it from its checkpoints (psgd launch resumes them)"
            )
        clock = max(eligible)
        undone = client.on_all(
            lambda k: client.retrying(
                k, f"going back to version {clock}", lambda: client.links[k].rollback(clock, rewind.cause).rounds_undone
            )
        )
        log.info(
            "worker %d: a shard restarted from the cut at version %d (incarnation %s): the job went back to "
            "version %d (rounds undone per shard: %s); repeating from clock %d",
            client.worker_id,
            rewind.clock,
            rewind.cause,
            clock,
            ", ".join(map(str, undone)),
            clock,
        )
    else:
        log.info(
            "worker %d: a shard went back to the cut at version %d: repeating from clock %d once every shard has",
            client.worker_id,
            clock,
            clock,
        )
        _wait_for_every_shard(client, clock)
    client.pending_rollback = None
    client.clock = clock
    stragglers, client.stragglers = client.stragglers, []
    # calls refused or answered once every shard is back
    futures.wait(stragglers, timeout=client.deadlines.request_timeout)
    return clock
