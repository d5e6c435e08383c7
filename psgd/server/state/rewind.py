"""What a shard's rollbacks to a cut leave behind (:func:`psgd.server.durable.recovery.rollback`): the causes it went
back for, each once, and the version each worker must continue from until it comes back with a clock no later.

Its core holds one, under the core's lock (:meth:`psgd.server.state.core.ShardCore.go_back`).
"""

from __future__ import annotations

import time

from psgd.server.errors import ShardError

#: A shard goes back for a new cause at most once in this many seconds (a worker asked to wait retries): a shard
#: restarts from a cut in seconds, and a storm of made-up causes cannot hold the job at one version.
ROLLBACK_SPACING = 1.0


class Rewind:
    """Shard ``shard``'s rollbacks: ``rewinding`` (the version each worker must continue from), ``causes`` (each
    cause gone back for: when), and ``cut_asked`` (for each worker that came back ahead of this shard restarted from
    a cut, that cut: its registration's answer)."""

    def __init__(self, shard: int, num_workers: int):
        self.shard, self.num_workers = shard, num_workers
        self.rewinding: dict[int, int] = {}
        self.causes: dict[str, float] = {}
        self.cut_asked: dict[int, int] = {}

    def check(self, worker: int, clock: int) -> None:
        """Refuse (ROLLED_BACK) a request of ``worker`` at ``clock`` past the cut it must continue from."""
        cut = self.rewinding.get(worker)
        if cut is not None and clock <= cut:
            del self.rewinding[worker]  # it has gone back
        elif cut is not None:
            raise ShardError(
                "FAILED_PRECONDITION",
                f"shard {self.shard} went back to the cut at version {cut} (a "
                f"shard of the job restarted from it): worker {worker} continues from clock {cut}, not "
                f"{clock}",
                reason="ROLLED_BACK",
                rewind_to=cut,
            )

    def ask(self, worker: int, version: int) -> None:
        """``worker`` came back ahead of this shard, restarted from the cut at ``version``: the job goes back to it."""
        self.cut_asked[worker] = self.rewinding[worker] = version

    def must_go_back(self, cause: str, now: int, version: int, worker: int) -> bool:
        """Whether the shard, at version ``now``, must load the cut at ``version`` to go back to it for ``cause``, as
        ``worker`` asks: not for a cause gone back for already, nor where it is there already (the shard that
        restarted, or one that never went past it: it has gone back then).  Refuses (UNAVAILABLE) a new cause within
        ROLLBACK_SPACING of the last, and (FAILED_PRECONDITION) a cut ahead of the shard."""
        if cause in self.causes:
            return False
        last = max(self.causes.values(), default=None)
        if last is not None and time.monotonic() - last < ROLLBACK_SPACING:
            raise ShardError(
                "UNAVAILABLE",
                f"shard {self.shard} went back for another cause "
                f"{time.monotonic() - last:.2f}s ago; it goes back at most once a "
                f"{ROLLBACK_SPACING:g}s",
            )
        if now < version:
            raise ShardError(
                "FAILED_PRECONDITION",
                f"shard {self.shard} is at version {now}, behind the cut at "
                f"{version} that worker {worker} asks it to go back to",
            )
        if now == version:
            self.went_back(cause, version)
            return False
        return True

    def went_back(self, cause: str, version: int) -> None:
        """The shard is at the cut of ``version`` for ``cause``: every worker continues from it."""
        self.causes[cause] = time.monotonic()
        self.rewinding = {w: version for w in range(self.num_workers)}

    def status(self) -> dict:
        """The version each worker must continue from, and the cause last gone back for ("" for none)."""
        return {
            "rewinding": dict(self.rewinding),
            "last_cause": max(self.causes, key=self.causes.__getitem__, default=""),
        }
