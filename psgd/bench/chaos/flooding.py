"""The ``flood`` fault: idle TCP connections against every shard process's gRPC port, more than one port takes
(:data:`psgd.server.net.listen.GRPC_CONNECTIONS`), opened at once and held for a few seconds; those a shard closes are
not opened again.  The connections are ``psgd bench flood``'s (:func:`psgd.bench.flood.start_flood`): a process of their
own per port, on the observer's host, which raises its own limit on open files to its hard limit.

Meanwhile every shard process must answer Status within the request timeout (its port bounds what connections that
never prove the token may take, and closes them within seconds), training must go on, and no background loop of a
shard may fail: no "Exception in thread" in its log, no ``background_errors`` counted."""

from __future__ import annotations

import time
from typing import Any

from psgd.bench.chaos.draws import Fault
from psgd.bench.chaos.invariants import check_background
from psgd.bench.chaos.settings import REQUEST_TIMEOUT, START_BOUND
from psgd.bench.flood import FloodError, end_floods, ready, start_flood


def inject(run: Any, fault: Fault) -> str:
    """The fault on every shard process of ``run`` (:class:`psgd.bench.chaos.run.Run`), and its checks."""
    c = run.cluster
    addresses = [*c.binds, *(c.replica_binds if run.spec.replicas else [])]
    logs = {name: (c.procs[name].log, c.procs[name].log.stat().st_size) for name in c.shard_names}
    errors = _background_errors(c)
    before = run._versions()
    floods = [
        start_flood(
            address.rpartition(":")[0].strip("[]"),
            address.rpartition(":")[2],
            fault.count,
            fault.seconds + START_BOUND,
            False,
            c.prefix("obs"),
        )
        for address in addresses
    ]
    unanswered: list[str] = []
    try:
        for f in floods:  # each says "ready" once its connections are open
            ready(f)
        held = time.monotonic()
        unanswered = _status_during(c, addresses)
        time.sleep(max(0.0, fault.seconds - (time.monotonic() - held)))  # how long the flood is held is the fault
    except FloodError as exc:
        run.violate("harness", [f"a flood client did not open its connections: {exc}"])
        return "flood client failed"
    finally:
        stats, unread = end_floods(floods)  # unread: flood clients whose figures could not be read
    after = run._versions()
    if unread:
        run.violate("harness", [f"{unread} flood client(s) did not say what they opened"])
    run.violate("flood", unanswered)
    training = any(c.alive(f"worker{r}") for r in range(run.spec.workers))
    if training and run._stood_still(before, after):
        run.violate(
            "starvation",
            [
                f"no shard applied an update during a flood of {fault.count} idle connections per "
                f"gRPC port (versions {before} -> {after}; {stats})"
            ],
        )
    now = _background_errors(c)
    for name, (log, start) in logs.items():
        said = log.read_bytes()[start:].decode(errors="replace") if log.exists() else ""
        run.violate("flood", check_background(name, said, now.get(name, 0) - errors.get(name, 0)))
    return (
        f"{stats['opened']} opened ({stats['failed']} failed), {stats['closed_by_shard']} closed by the shards, "
        f"versions {before} -> {after}"
    )


def _status_during(c: Any, addresses: list[str]) -> list[str]:
    """Ask every shard process for its Status while the flood holds its connections, until each has answered
    (each within the request timeout); what did not answer, in words."""
    deadline = time.monotonic() + REQUEST_TIMEOUT
    left = set(range(len(addresses)))
    while left and time.monotonic() < deadline:
        raw = c._raw_status(max(1.0, deadline - time.monotonic()))
        left -= {i for i in left if raw[i] is not None}
        if left:
            time.sleep(0.2)  # polling, with a deadline
    return [
        f"the shard process at {addresses[i]} did not answer Status within {REQUEST_TIMEOUT:.0f}s of a flood of "
        f"idle connections"
        for i in sorted(left)
    ]


def _background_errors(c: Any) -> dict[str, int]:
    """Each shard process's count of errors in its background loops, from its Status (those that answer)."""
    raw = c._raw_status(5.0)
    return {name: int((s or {}).get("counters", {}).get("background_errors", 0)) for name, s in zip(c.shard_names, raw)}
