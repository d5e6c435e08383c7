"""Who may join a shard and who has: the partition plan and the job a registering worker brings, against
the shard's (:func:`check_job`), and each worker's registration, its lease and the process holding it
(:class:`Roster`)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from psgd.config import Deadlines
from psgd.job import differences as job_differences
from psgd.partition import PartitionPlan, plan_differences
from psgd.server.errors import ShardError

log = logging.getLogger(__name__)


def check_job(
    shard: int,
    plan: PartitionPlan,
    identity: Mapping[str, Any] | None,
    worker: int,
    plan_hash: str,
    plan_json: str,
    job_json: str | None,
) -> None:
    """Refuse ``worker`` where it may not join shard ``shard``: FAILED_PRECONDITION (reason JOB_MISMATCH) for
    another plan or job, with the job's differences, INVALID_ARGUMENT for a malformed request.  Without an
    ``identity`` (a shard built by hand) only the plan is compared."""
    if plan_hash != plan.hash:
        try:
            why = plan_differences(json.loads(plan_json), plan.description())
        except Exception:  # a malformed description (any shape, any depth) only loses the explanation
            why = ""
        raise ShardError(
            "FAILED_PRECONDITION",
            f"worker {worker}'s partition plan {plan_hash!r} differs from shard "
            f"{shard}'s {plan.hash!r}" + (f": {why}" if why else "") + "; start every process from the "
            "same job file",
            reason="JOB_MISMATCH",
        )
    if job_json is None or identity is None:
        return
    if not job_json:
        raise ShardError(
            "INVALID_ARGUMENT", "the worker sent no job identity: start it with the same psgd version as the shards"
        )
    try:
        job = json.loads(job_json)
    except (ValueError, RecursionError):
        job = None
    if not isinstance(job, dict):
        raise ShardError("INVALID_ARGUMENT", "the worker's job identity is not a JSON object")
    differ = job_differences(identity, job, me=f"shard {shard}", them=f"worker {worker}")
    if differ:
        raise ShardError(
            "FAILED_PRECONDITION",
            f"worker {worker}'s job differs from shard {shard}'s: "
            f"{'; '.join(differ)}; start every process from the same job file",
            reason="JOB_MISMATCH",
            differences=differ,
        )


def holder_id(incarnation: str) -> str:
    """What a shard keeps of a registering process's incarnation (its own random id, which only that process
    sends): a digest, so that what the shard writes or says of a holder (a checkpoint's manifest) cannot be sent
    back to pass for that process and get its key."""
    return hashlib.sha256(b"psgd-holder\0" + incarnation.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def claim_id(incarnation: str) -> str:
    """What a shard keeps of the claim on its rank that a launch gave a registering process, which outlives the
    process (``CLAIM/PROCESS``: :func:`psgd.job.process_incarnation`): a digest, as :func:`holder_id`; "" where the
    process has none (one started by hand)."""
    claim, mark, _ = incarnation.partition("/")
    return (
        hashlib.sha256(b"psgd-claim\0" + claim.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        if mark and claim
        else ""
    )


@dataclasses.dataclass
class WorkerInfo:
    state: str = "pending"  # pending (expected, not yet registered), live, done, expired; in a job with a range of
    #                         workers also free (a rank above the fewest that nobody has held) and left (its worker
    #                         left the job for good while at least the fewest stayed: the rank is free again)
    deadline: float = 0.0  # lease (or join) deadline, on the roster's clock
    expired_at: float = 0.0  # when this shard dropped it (its clock), for "finished" to settle
    clock: int = 0
    hostname: str = ""
    pid: int = 0
    incarnation: str = ""  # a digest of the registering process's own random id (:func:`holder_id`)
    claim: str = ""  # a digest of the claim on the rank its launch gave that process (:func:`claim_id`), if any
    key: str = ""  # the registration's key, made by the shard for that process: every call as this worker carries it
    kept_until: float = 0.0  # a restarted shard keeps a pending rank for its last holder until then


class Roster:
    """The workers of one shard: who is expected, live, done or dropped, and until when.

    A rank is held by one process at a time: while its lease runs, a registration from another process
    (another incarnation) is refused with ALREADY_EXISTS, naming the holder; once the lease has run out
    (the holder died or hangs) the rank is free again.  A rank kept after a restart from a checkpoint for the
    process that held it (:meth:`keep_for`) goes at once to a process of the same claim: the same launch's worker
    of that rank, started again by ``--resume``.  A registration gets a key, random, which the process keeps
    while it re-registers; a call as the worker that does not carry it (another process, or one that never
    registered) is refused with PERMISSION_DENIED and counted (``impostors``).  The caller holds the shard's lock
    (``live`` without renewing only reads, and may peek without it).

    A job with a range of workers (``fewest`` < ``num_workers``) expects only its fewest at the start; the ranks above
    are ``free``, taken by a worker that joins (:meth:`pick`, ``psgd-worker --rank auto``), and a worker that leaves
    while at least the fewest stay (:meth:`leave`) frees its rank (``left``) instead of finishing it.
    """

    def __init__(
        self, shard: int, num_workers: int, deadlines: Deadlines, now: Callable[[], float], fewest: int | None = None
    ):
        self.shard, self.num_workers = shard, num_workers
        self.fewest = num_workers if fewest is None else fewest
        self.lease_seconds, self.join_timeout, self._now = deadlines.lease_seconds, deadlines.join_timeout, now
        start = now()
        self.workers = {
            w: WorkerInfo(state="pending" if w < self.fewest else "free", deadline=start + self.join_timeout)
            for w in range(num_workers)
        }
        self.impostors = 0  # calls refused for a key that is not the registration's

    @property
    def ranged(self) -> bool:
        """Whether the job has a range of workers (fewer expected at the start than it takes at most)."""
        return self.fewest < self.num_workers

    def pick(self) -> int:
        """The lowest rank nobody holds or is kept for (:meth:`keep_for`): one expected and not yet registered, one
        never held, one whose worker left; else one whose lease ran out (its holder, paused, may come back for it).
        RESOURCE_EXHAUSTED when every rank is held."""
        now = self._now()
        for states in (("pending", "free", "left"), ("expired",)):  # a rank whose holder may come back, last
            for w, info in sorted(self.workers.items()):
                kept = info.state == "pending" and now <= info.kept_until
                if info.state in states and not kept:
                    return w
        raise ShardError(
            "RESOURCE_EXHAUSTED",
            f"every rank of this job ({self.num_workers}, the most workers it takes) is held: shard {self.shard} has "
            "no rank for another worker; raise the range's MAX to run more",
        )

    def check(self, worker: int) -> None:
        """Refuse a worker id outside the job (links check it before they read a push)."""
        if not 0 <= worker < self.num_workers:
            raise ShardError(
                "INVALID_ARGUMENT",
                f"worker id {worker} is out of range: this job has "
                f"{self.num_workers} worker(s), ids 0..{self.num_workers - 1}",
            )

    def live(self, worker: int, key: str | None, renew: bool = True) -> WorkerInfo:
        """``worker``'s registration, its lease renewed; refused unless it is live and ``key`` is its key (None: the
        caller is in this process and vouches for it; a call that came over the network always has a str)."""
        info = self.workers[worker]
        if info.state != "live":
            raise ShardError(
                "FAILED_PRECONDITION",
                f"worker {worker} is not registered with shard {self.shard} "
                f"(state: {info.state}); it must register again",
                reason="NOT_REGISTERED",
            )
        if not self._carries(info, key):
            raise ShardError(
                "PERMISSION_DENIED",
                f"worker {worker} is registered with shard {self.shard} by "
                f"{info.hostname or '?'} pid {info.pid}: a call as worker {worker} must carry the key "
                "that process's registration got; this one does not",
            )
        if renew:
            info.deadline = self._now() + self.lease_seconds
        return info

    def _carries(self, info: WorkerInfo, key: str | None) -> bool:
        """Whether a call with ``key`` is the registration's of ``info`` (None: a caller in this process, which
        vouches for it); one that is not is counted (``impostors``)."""
        if key is None or hmac.compare_digest(key.encode("utf-8", "surrogatepass"), info.key.encode()):
            return True
        self.impostors += 1
        return False

    def held_by(self, worker: int, incarnation: str) -> bool:
        """Whether ``worker``'s rank is held by the process ``incarnation`` (what it sent when it registered)."""
        return self.workers[worker].incarnation == holder_id(incarnation)

    def admit(self, worker: int, hostname: str, pid: int, incarnation: str) -> WorkerInfo:
        """Make ``worker`` live, held by the process ``incarnation``: refused while another process holds it."""
        info, now, claim, incarnation = self.workers[worker], self._now(), claim_id(incarnation), holder_id(incarnation)
        held = info.state == "live" and now <= info.deadline
        kept = info.state == "pending" and now <= info.kept_until and not (claim and claim == info.claim)
        if (held or kept) and incarnation != info.incarnation:
            how = (
                f"is already registered with shard {self.shard} by {info.hostname or '?'} pid {info.pid}, whose "
                f"lease runs {info.deadline - now:.1f}s more"
                if held
                else f"was held by {info.hostname or '?'} pid {info.pid} when shard {self.shard}'s checkpoint was "
                f"written, and is kept for it {info.kept_until - now:.1f}s more since the shard restarted"
            )
            raise ShardError(
                "ALREADY_EXISTS",
                f"worker {worker} {how}: is a second psgd-worker started with rank "
                f"{worker}? (A worker restarted after a crash rejoins once the old process's "
                f"{self.lease_seconds:.0f}s lease has run out.)",
                reason="RANK_HELD",
                holder=(info.hostname, info.pid),
            )
        if incarnation != info.incarnation or not info.key:  # the same process keeps its key (its calls in flight)
            info.key = secrets.token_hex(16)
        info.state, info.hostname, info.pid, info.incarnation, info.claim = "live", hostname, pid, incarnation, claim
        info.deadline = now + self.lease_seconds
        return info

    def holders(self) -> dict[str, dict[str, Any]]:
        """Who holds each live rank (for a checkpoint: see :meth:`keep_for`)."""
        return {
            str(w): {"hostname": i.hostname, "pid": i.pid, "incarnation": i.incarnation, "claim": i.claim}
            for w, i in self.workers.items()
            if i.state == "live" and i.incarnation
        }

    def keep_for(self, holders: Mapping[str, Any]) -> None:
        """After a restart from a checkpoint: keep each rank that was live then for the process that held it (or
        one of its claim), for one lease, so that a second process of that rank cannot take it before the holder
        comes back."""
        until = self._now() + self.lease_seconds
        for w, h in holders.items() if isinstance(holders, Mapping) else ():
            try:
                info = self.workers.get(int(w))
                if info is not None and info.state == "pending" and isinstance(h, Mapping):
                    info.hostname, info.pid = str(h.get("hostname", "")), int(h.get("pid", 0))
                    info.incarnation, info.kept_until = str(h.get("incarnation", "")), until
                    info.claim = str(h.get("claim", ""))
            except (TypeError, ValueError):  # a manifest written otherwise: the rank is simply not kept
                continue

    def leave(self, worker: int, clock: int, key: str | None) -> bool:
        """``worker`` (``key``: its registration's, see :meth:`live`) is done at ``clock``; True when it was live
        until now, False when it was done already; refused (:meth:`live`) where it is neither."""
        info = self.workers[worker]
        if info.state in ("done", "left"):  # said again (its answer was lost): by the same registration only
            if not self._carries(info, key):
                raise ShardError(
                    "PERMISSION_DENIED",
                    f"worker {worker} is {info.state} on shard {self.shard}: a Done as "
                    f"worker {worker} must carry the key of the registration that was done",
                )
            return False
        self.live(worker, key, renew=False)  # not live here: refused, the caller registers again
        # a job with a range shrinks while its fewest stay; below them, the worker is done as in a fixed job
        info.state = "left" if self.live_count() > self.fewest else "done"
        info.clock = max(info.clock, clock)
        return True

    def overdue(self) -> list[int]:
        """Drop the workers whose lease (or join deadline) has passed; returns their ids."""
        now, dropped = self._now(), []
        for w, info in self.workers.items():
            if info.state in ("pending", "live") and now > info.deadline:
                was = info.state
                info.state, info.expired_at = "expired", now
                dropped.append(w)
                log.warning(
                    "shard %d: worker %d %s within %.1fs: dropped from the round; it may register again",
                    self.shard,
                    w,
                    "did not register" if was == "pending" else "missed its lease",
                    self.join_timeout if was == "pending" else self.lease_seconds,
                )
        return dropped

    def behind(self, worker: int, clock: int) -> str:
        """Which other workers a pull of ``worker`` for ``clock`` waits for, in words."""
        slow = sorted(
            (w, i.clock)
            for w, i in self.workers.items()
            if i.state in ("live", "pending") and w != worker and i.clock < clock
        )
        return "other workers still expected: " + (", ".join(f"worker {w} at clock {c}" for w, c in slow) or "none")

    def expected(self) -> list[int]:
        """The workers this process waits for: live, or yet to register (a new process expects them all)."""
        return [w for w, info in self.workers.items() if info.state in ("pending", "live")]

    def live_count(self) -> int:
        return sum(1 for i in self.workers.values() if i.state == "live")

    def finished(self, settle: float) -> bool:
        """No worker is pending or live: each is done (or left, or its rank was never taken), or was dropped at
        least ``settle`` seconds ago."""
        now = self._now()
        return all(
            i.state in ("done", "left", "free") or (i.state == "expired" and now - i.expired_at >= settle)
            for i in self.workers.values()
        )

    def rows(self) -> list[dict]:
        now = self._now()
        return [
            {
                "worker_id": w,
                "state": i.state,
                "clock": i.clock,
                "lease_left_seconds": i.deadline - now,
                "hostname": i.hostname,
                "pid": i.pid,
            }
            for w, i in sorted(self.workers.items())
        ]
