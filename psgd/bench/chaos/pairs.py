"""``restart-primary-at-end``: once every worker has finished, a pair's primary is SIGTERMed (it exits 0, telling its
replica that the job is over) and started again at the same address, with the same checkpoint folder.  Its replica
must follow it again within a bound (both say so in Status), and a push made afterwards must be copied: the primary
counts no push acknowledged without a copy (``unreplicated``), and the replica holds the primary's version."""

from __future__ import annotations

import signal
import time
from typing import Any

from psgd.bench.chaos.hostile import PUSH_ONCE
from psgd.bench.chaos.invariants import check_exit
from psgd.bench.chaos.settings import REQUEST_TIMEOUT, STOP_BOUND


def restart_primary_at_end(run: Any, k: int) -> str:
    """The fault on shard ``k``'s pair of ``run`` (:class:`psgd.bench.chaos.run.Run`), and its checks; the push it
    makes is counted in ``run.pushed_after`` (worker 0's), for the checks at the run's end."""
    c = run.cluster
    if not run.spec.replicas:
        return "skipped: the run keeps no replicas"
    if not run.workers_finished():
        return "skipped: a worker was still training"
    roles = [s["role"] if s else "" for s in c._pair_status(k, 2.0)]
    if sorted(roles) != ["primary", "replica"]:
        return f"skipped: shard {k}'s pair is not whole ({roles})"
    first = roles.index("primary")
    name = f"shard{k}" if first == 0 else f"replica{k}"
    c.signal(name, signal.SIGTERM)
    code = c.wait(name, STOP_BOUND)
    run.violate(
        "exit-code", check_exit(f"{name} (the primary, after the workers finished)", code, 0, "within 10 s of SIGTERM")
    )
    if code is None:
        c.signal(name, signal.SIGKILL)
        c.wait(name, STOP_BOUND)
    c.start_shard(k, replica=first == 1)
    c.wait_listening(k, replica=first == 1)
    problems = c.wait_followed(k)
    run.violate("replica", [f"after its primary restarted at the job's end: {p}" for p in problems])
    if problems:
        return "the replica does not follow the restarted primary"
    held = c._pair_status(k, 5.0)[first]["counters"].get("unreplicated", 0)
    stats, _, _ = run._from_outside(
        PUSH_ONCE,
        {"config": str(c.path), "worker": 0, "timeout": REQUEST_TIMEOUT},
        REQUEST_TIMEOUT * 2 + 60,
        "push-after-the-end",
    )
    if stats is None:
        return "the push after the end failed"
    if "applied" in stats["outcomes"]:  # one update more than the workers' clocks allow, on each shard
        run.pushed_after[0] = run.pushed_after.get(0, 0) + 1
    deadline = time.monotonic() + REQUEST_TIMEOUT
    while True:  # the replica holds the push (its answer came before the push was acknowledged: at once)
        pair = c._pair_status(k, 2.0)
        if None not in pair and pair[1 - first]["version"] == pair[first]["version"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)  # polling, with a deadline
    lead, follow = pair
    if first == 1:
        lead, follow = follow, lead
    unreplicated = (lead or {}).get("counters", {}).get("unreplicated", 0) - held
    if unreplicated:
        run.violate(
            "replica",
            [
                f"shard {k}'s restarted primary acknowledged {unreplicated} push(es) without a copy "
                f"although its replica follows"
            ],
        )
    if lead is None or follow is None or follow["version"] != lead["version"]:
        run.violate(
            "replica",
            [
                f"shard {k}'s replica does not hold the push made after its primary restarted "
                f"(versions {lead and lead['version']} and {follow and follow['version']})"
            ],
        )
    return (
        f"{name} restarted, its replica follows it again; a push at clock {stats['clock']} "
        f"({', '.join(stats['outcomes'])}) copied"
    )
