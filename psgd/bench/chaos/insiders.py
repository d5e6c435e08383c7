"""The faults of members of the job: processes that hold its token (so they get past every door that asks for it)
and use it against the job.  ``insider-follower``: a token holder asks to follow a primary, saying that it is the
pair's replica, from an address that is not the replica's (and once as a replica of its own address).  Only the
job's configured replica may follow (it proves that it is the process at its address, psgd.server.durable.replica): the
insider must be refused, the real replica must keep following, and the job must go on as if nothing was tried.

``rollback-storm``: once the workers have finished, a token holder registers as one of them (its rank is free then)
and asks every shard, many times in a row, to go back to a cut for restarts it cannot prove (:func:`storm`, run from
the observer's host: :data:`ROLLBACK_STORM`).  A shard goes back only for a restart of the job's own shards that it
checked itself (psgd.server.durable.peers.restart_of): every request must be refused with FAILED_PRECONDITION and
counted (``rollbacks_refused``), no version may go back, and each shard says so in one ERROR line, not one per
request."""

from __future__ import annotations

import os
from typing import Any

from psgd.bench.chaos.hostile import FOLLOW_AS
from psgd.bench.chaos.settings import REQUEST_TIMEOUT, SHARDS

ROLLBACK_STORM = """
import json, sys
from psgd.bench.chaos.insiders import storm
print(json.dumps(storm(**json.loads(sys.argv[1]))))
"""


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
    primary, replica = (c.binds[k], c.replica_binds[k])[:: 1 if first == 0 else -1]  # (first: which leads)
    observer = "127.0.0.1" if c.net is None else c.net.hosts["obs"]
    claims = [replica, f"{observer}:1"]  # the replica's place, and a replica of its own (nothing listens at port 1)
    stats, _, _ = run._from_outside(
        FOLLOW_AS,
        {
            "host": primary.rpartition(":")[0].strip("[]"),
            "port": pair[first]["data_port"],
            "claims": claims,
            "plan_hash": c.plan.hash,
        },
        60,
        "insider-follower",
    )
    if stats is None:
        return "insider-follower client failed"
    run.violate(
        "insider",
        [
            f"shard {k}'s primary at {primary} let a token holder elsewhere follow it: {what}"
            for what in stats["accepted"]
        ],
    )
    problems = c.wait_followed(k)
    run.violate("insider", [f"after a token holder asked to follow in its replica's place: {p}" for p in problems])
    return f"{stats['refused']} of {stats['tried']} claims refused; " + (
        "the replica follows still" if not problems else "the replica does not follow"
    )


def rollback_storm(run: Any, r: int, rounds: int) -> str:
    """The ``rollback-storm`` fault of ``run`` (:class:`psgd.bench.chaos.run.Run`) as worker ``r``, ``rounds``
    requests per shard, and its checks."""
    c = run.cluster
    if run.spec.policy != "sync":
        return "skipped: the run keeps no cuts (async)"
    if not run.workers_finished():
        return "skipped: a worker was still training"
    views = [run._status_of(k, REQUEST_TIMEOUT) for k in range(SHARDS)]
    said = [_refusals_said(c, k, r) for k in range(SHARDS)]
    observer = "127.0.0.1" if c.net is None else c.net.hosts["obs"]
    stats, before, after = run._from_outside(
        ROLLBACK_STORM,
        {
            "config": str(c.path),
            "worker": r,
            "rounds": rounds,
            "bind": f"{observer}:0",
            "seed": run.seed * 1000 + run.spec.index,
            "timeout": REQUEST_TIMEOUT,
        },
        REQUEST_TIMEOUT * 4 + 60,
        "rollback-storm",
    )
    if stats is None:
        return "the rollback-storm client failed"
    problems = [f"a rollback for a restart nobody proved was accepted: {what}" for what in stats["accepted"]]
    if stats["done"]:
        problems.append(f"worker {r}'s Done after the storm failed: {stats['done']}")
    if before != after:
        problems.append(f"the shards' versions went from {before} to {after} during the storm")
    for k, view in enumerate(views):
        tried, refused = stats["tried"][k], stats["refused"][k]
        if stats["cuts"][k] is None:
            problems.append(f"shard {k} listed no cut to go back to")
        elif refused != tried:
            problems.append(
                f"shard {k} refused {refused} of {tried} rollback(s) with FAILED_PRECONDITION (codes {stats['codes']})"
            )
        counted = run._status_of(k, REQUEST_TIMEOUT)["counters"].get("rollbacks_refused", 0) - view["counters"].get(
            "rollbacks_refused", 0
        )
        if counted != tried:
            problems.append(f"shard {k} counted {counted} refused rollback(s) of {tried} (rollbacks_refused)")
        lines = _refusals_said(c, k, r)
        if not lines or lines - said[k] > 2:
            problems.append(
                f"shard {k} said {lines - said[k]} ERROR line(s) about {tried} refused rollback(s): "
                "one, then at most one a minute"
            )
    run.violate("rollback", problems)
    return (
        f"as worker {r}: {sum(stats['refused'])} of {sum(stats['tried'])} rollbacks to the cuts at "
        f"{stats['cuts']} refused, versions {before} -> {after}"
    )


def _refusals_said(cluster: Any, k: int, r: int) -> int:
    """How many ERROR lines shard ``k``'s process has said about rollbacks it refused worker ``r``."""
    return cluster.procs[f"shard{k}"].log.read_text(errors="replace").count(f"refused worker {r} (calling from")


def storm(config: str, worker: int, rounds: int, bind: str, seed: int, timeout: float) -> dict:
    """Worker ``worker`` of the job file ``config`` registers again (the environment's token; heartbeats keep its
    lease) and asks every shard ``rounds`` times in a row to go back to its newest cut before its version, each time
    for a restart it cannot prove: a made-up incarnation, that of a shard of the job that never restarted, or that
    of a shard of the job of its own, started at ``bind`` from nothing.  Then it says Done.
    Returns, per shard, the cut asked for and how many were asked and refused (with which codes), which were
    accepted, and why Done failed ("" where it did not)."""
    import random

    from psgd.config import Deadlines, JobConfig
    from psgd.job import describe_job
    from psgd.link import LinkError
    from psgd.server import build_shard
    from psgd.server.net.service import ShardServer
    from psgd.worker.client import PSClient
    from psgd.worker.errors import PSError, ShardWentBack

    job, token, rng = JobConfig.load(config), os.environ.get("PSGD_TOKEN", ""), random.Random(seed)
    described = describe_job(job)
    stats: dict[str, Any] = {"tried": [], "refused": [], "codes": {}, "accepted": [], "cuts": [], "done": ""}
    own = ShardServer(build_shard(described, 0), bind, transport="grpc", token=token).start()
    try:
        with PSClient(
            job.cluster.servers,
            described.plan,
            worker,
            deadlines=Deadlines(request_timeout=timeout),
            recovery=job.cluster.recovery,
            config=job,
            token=token,
        ) as client:
            client.register()
            client.start_heartbeats()
            shards = client.status()
            for k, link in enumerate(client.links):
                listed = link.rollback(0, "", dry_run=True)
                cut = next((v for v in listed.cuts if v < listed.version), max(listed.cuts, default=None))
                stats["cuts"].append(cut)
                stats["tried"].append(0)
                stats["refused"].append(0)
                if cut is None:
                    continue
                causes = [own.incarnation] + [s.incarnation for s in shards if not _restarted(s)]
                for _ in range(rounds):
                    cause = rng.choice(causes + [rng.randbytes(6).hex()])
                    stats["tried"][k] += 1
                    try:
                        undone = link.rollback(cut, cause).rounds_undone
                    except LinkError as err:
                        stats["codes"][err.code.name] = stats["codes"].get(err.code.name, 0) + 1
                        stats["refused"][k] += err.code.name == "FAILED_PRECONDITION"
                    else:
                        stats["accepted"].append(
                            f"shard {k} went back to the cut at {cut} for the restart of "
                            f"incarnation {cause} ({undone} round(s) undone)"
                        )
            try:  # (where a shard went back, it says so instead)
                client.done()
            except (PSError, ShardWentBack) as exc:
                stats["done"] = str(exc)
    finally:
        own.stop(grace=0.1)
    return stats


def _restarted(reply: Any) -> bool:
    """Whether the shard that sent the Status ``reply`` restarted from a checkpoint: the job may have gone back for
    it (a shard answers a cause it went back for already as done), so it is no cause that it cannot prove."""
    from psgd.ops.reach import status_dict

    return status_dict(reply)["counters"].get("restored_version") is not None
