"""Shard 0's part in a job with a range of workers (``[cluster] workers = "MIN:MAX"``): the rank a joining worker takes
(``psgd-worker --rank auto``) and the batch each worker trains at each of its clocks (:mod:`psgd.data.blocks`), both
decided under the shard's lock, so that two workers never get the same."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from psgd.data.blocks import Blocks
from psgd.partition import PartitionPlan
from psgd.server.errors import ShardError
from psgd.server.state import admission
from psgd.server.state.admission import Roster

log = logging.getLogger(__name__)


class Lobby:
    """Where workers of a job with a range come in (a rank) and what each trains (a batch at a clock).  Only shard
    0 of such a job hands either out (``hands_out``); ``check_serving`` refuses a call the shard may not answer now
    (it is closing, halted, or a replica)."""

    def __init__(
        self,
        shard: int,
        plan: PartitionPlan,
        identity: Mapping[str, Any] | None,
        roster: Roster,
        lock: threading.Lock,
        check_serving: Callable[[], None],
    ):
        self.shard, self.plan, self.identity, self.roster, self.lock = shard, plan, identity, roster, lock
        self.check_serving = check_serving
        self.hands_out = shard == 0 and roster.ranged
        self.blocks = Blocks() if self.hands_out else None

    def _refuse_unless_handing_out(self, what: str) -> None:
        if not self.hands_out:
            raise ShardError(
                "INVALID_ARGUMENT",
                f"shard {self.shard} hands out no {what}: shard 0 of a job with a range of workers "
                '([cluster] workers = "MIN:MAX") does',
            )

    def take_rank(
        self, plan_hash: str, plan_json: str, hostname: str, pid: int, job_json: str | None, incarnation: str
    ) -> int:
        """Give a joining process the lowest rank nobody holds (Roster.pick), held for it at once; it then registers
        that rank here and with the other shards as any worker does."""
        self._refuse_unless_handing_out("ranks")
        admission.check_job(self.shard, self.plan, self.identity, -1, plan_hash, plan_json, job_json)
        with self.lock:
            self.check_serving()
            worker = self.roster.pick()
            self.roster.admit(worker, hostname, pid, incarnation)
        log.info("shard %d: rank %d taken by %s pid %d, which joins the job", self.shard, worker, hostname or "?", pid)
        return worker

    def batch(self, worker: int, clock: int, total: int, key: str | None) -> int:
        """The job block ``worker`` (its registration's ``key``) trains at ``clock``, of the ``total`` its data
        makes (checked against the job's); :data:`psgd.data.blocks.NONE_LEFT` once the job's are all handed out."""
        self._refuse_unless_handing_out("batches")
        self.roster.check(worker)
        if clock < 0 or total < 1:
            raise ShardError("INVALID_ARGUMENT", f"clock {clock} and a job of {total} batches: neither may be that")
        with self.lock:
            self.check_serving()
            self.roster.live(worker, key)
            why = self.blocks.check_total(total)
            if why:
                raise ShardError(
                    "FAILED_PRECONDITION",
                    f"worker {worker}: {why}; start every worker from the same job file and data",
                    reason="JOB_MISMATCH",
                )
            return self.blocks.take(worker, clock)

    def gone(self, worker: int, from_clock: int) -> None:
        """(Under the lock.)  ``worker`` left at ``from_clock``, pushing nothing from then on: the batches it was
        given for those clocks go to the next workers to ask."""
        if self.blocks is not None:
            back = self.blocks.give_back(worker, from_clock)
            if back:
                log.info("shard %d: %d batch(es) of worker %d go to the next to ask", self.shard, len(back), worker)

    def lapsed(self, worker: int, from_clock: int) -> None:
        """(Under the lock.)  ``worker``'s lease ran out at ``from_clock``: paused or dead, it keeps its batches until
        its rank registers again or no other batch is left (psgd.data.blocks.Blocks.lapsed)."""
        if self.blocks is not None:
            self.blocks.lapsed(worker, from_clock)

    def registered(self, worker: int) -> None:
        """(Under the lock.)  ``worker``'s rank registered again: its batches are its own again."""
        if self.blocks is not None:
            self.blocks.came_back(worker)
