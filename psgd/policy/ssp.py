"""ssp(s): pushes are applied on arrival; a pull waits while it is more than s clocks ahead of the slowest."""

from __future__ import annotations

from typing import ClassVar

from psgd.policy.asynchronous import AsyncPolicy
from psgd.policy.base import PolicyError, PolicyOption, _is_int, _show


class SSPPolicy(AsyncPolicy):
    """Stale synchronous parallel with staleness bound ``s`` (an integer >= 0).

    Pushes are handled exactly as by :class:`AsyncPolicy`.  A pull for clock
    ``c`` is answered once every *other* live worker has clock >= ``c - s``
    (workers that left do not count), so ``s = 0`` is lock-step and a huge
    ``s`` is async.

    A worker that had left (done, expired, or never registered in time) and
    joins again continues from ``max(its own clock, slowest other live
    worker's clock - s)``: one that was gone for long starts at the back of the
    allowed window instead of stalling everybody while it replays old clocks
    (the clocks it skips are never pushed; pushes allow gaps).  A live worker
    that registers again (a quick restart) continues from its own clock.
    """

    name: ClassVar[str] = "ssp"
    summary: ClassVar[str] = (
        "bounded staleness: pushes are applied on arrival; a pull waits while its worker "
        "is more clocks than the staleness bound ahead of the slowest"
    )
    options: ClassVar[tuple[PolicyOption, ...]] = (
        PolicyOption(
            "staleness",
            int,
            None,
            "clocks a worker may run ahead of the slowest",
            required=True,
            cluster_key="staleness",
            shorthand="ssp:S",
            label="ssp s={}",
        ),
    )
    accumulates: ClassVar[bool] = False

    def __init__(self, num_workers: int, staleness: int):
        super().__init__(num_workers)
        if not _is_int(staleness) or staleness < 0:
            raise PolicyError(f"policy 'ssp': staleness must be an integer >= 0, got {_show(staleness)}")
        self.staleness = int(staleness)

    def _slowest_other(self, worker: int) -> int | None:
        return min((self._clocks[o] for o in self._live if o != worker), default=None)

    def join(self, worker: int) -> int:
        worker = self._check_worker(worker)
        slowest = self._slowest_other(worker)
        if worker not in self._live and slowest is not None:
            self._clocks[worker] = max(self._clocks[worker], slowest - self.staleness)
        self._live.add(worker)
        return self._clocks[worker]

    def pull_ready(self, worker: int, clock: int) -> bool:
        worker = self._check_worker(worker)
        clock = self._check_clock(clock)
        slowest = self._slowest_other(worker)
        return slowest is None or slowest >= clock - self.staleness
