"""The faults of members of the job: processes that hold its token (so they get past every door that asks for it)
and use it against the job.  ``insider-follower``: a token holder asks to follow a primary, saying that it is the
pair's replica, from an address that is not the replica's (and once as a replica of its own address).  Only the
job's configured replica may follow (it proves that it is the process at its address, psgd.server.replica): the
insider must be refused, the real replica must keep following, and the job must go on as if nothing was tried."""

from __future__ import annotations

from typing import Any

from psgd.bench.chaos.hostile import FOLLOW_AS


def insider_follower(run: Any, k: int) -> str:
    """The ``insider-follower`` fault on shard ``k``'s pair of ``run`` (:class:`psgd.bench.chaos.run.Run`), and its
    checks."""
    c = run.cluster
    if not run.spec.replicas:
        return "skipped: the run keeps no replicas"
    pair = c._pair_status(k, 2.0)
    roles = [s["role"] if s else "" for s in pair]
    if sorted(roles) != ["primary", "replica"]:
        return f"skipped: shard {k}'s pair is not whole ({roles})"
    first = roles.index("primary")
    primary, replica = (c.binds[k], c.replica_binds[k])[::1 if first == 0 else -1]  # (first: which leads)
    observer = "127.0.0.1" if c.net is None else c.net.hosts["obs"]
    claims = [replica, f"{observer}:1"]  # the replica's place, and a replica of its own (nothing listens at port 1)
    stats, _, _ = run._from_outside(FOLLOW_AS, {"host": primary.rpartition(":")[0].strip("[]"),
                                               "port": pair[first]["data_port"], "claims": claims,
                                               "plan_hash": c.plan.hash}, 60, "insider-follower")
    if stats is None:
        return "insider-follower client failed"
    run.violate("insider", [f"shard {k}'s primary at {primary} let a token holder elsewhere follow it: {what}"
                            for what in stats["accepted"]])
    problems = c.wait_followed(k)
    run.violate("insider", [f"after a token holder asked to follow in its replica's place: {p}" for p in problems])
    return (f"{stats['refused']} of {stats['tried']} claims refused; "
            + ("the replica follows still" if not problems else "the replica does not follow"))

