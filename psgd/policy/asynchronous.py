"""async: every push is applied on arrival; pulls never wait."""

from __future__ import annotations

from typing import Any, ClassVar

from psgd.policy.base import APPLY, DUPLICATE, Policy, PolicyError, PolicyOption, PushDecision


class AsyncPolicy(Policy):
    """Applies every push whose clock is at least the worker's clock (gaps allowed).

    A push of a clock the worker pushed before (a retry) is a ``duplicate``, so a
    retried push is applied once.  A clock the worker's clock jumped over without a
    push (ssp's join, a restored shard's fast-forward) was never pushed here: it is
    applied, as the other shards, which did not jump as far, apply it too.
    """

    name: ClassVar[str] = "async"
    summary: ClassVar[str] = "every push is applied on arrival; pulls never wait"
    options: ClassVar[tuple[PolicyOption, ...]] = ()
    accumulates: ClassVar[bool] = False
    _COUNTERS: ClassVar[tuple[str, ...]] = ("pushes_applied", "duplicates", "late", "rejected")

    def __init__(self, num_workers: int):
        super().__init__(num_workers)
        self._clocks = [0] * self.num_workers  # the clock each worker pushes next
        self._pushed = [-1] * self.num_workers  # the last clock each worker pushed (-1: none)
        self.gap = 0  # how many clocks a worker may skip between pushes (local SGD: its local steps)

    def join(self, worker: int) -> int:
        worker = self._check_worker(worker)
        self._live.add(worker)
        return self._clocks[worker]

    def fast_forward(self, worker: int, clock: int) -> bool:
        """As :meth:`Policy.fast_forward`; the worker says it pushed every clock below ``clock`` (to the shard
        process before the restore): a push of one of them again is a duplicate."""
        moved = super().fast_forward(worker, clock)
        worker, clock = int(worker), int(clock)
        self._pushed[worker] = max(self._pushed[worker], clock - 1)
        return moved

    def leave(self, worker: int) -> tuple[int, ...]:
        self._live.discard(self._check_worker(worker))
        return ()

    def push(self, worker: int, clock: int) -> PushDecision:
        problem = self._push_problem(worker, clock)
        if problem is not None:
            return problem
        worker, clock = int(worker), int(clock)
        if clock > self._clocks[worker] + self.gap:
            return self._reject(
                f"clock {clock} is beyond what worker {worker} can have reached: it pushes clock "
                f"{self._clocks[worker]} next" + (f" (or up to {self.gap} later)" if self.gap else ""),
                self._clocks[worker],
            )
        if clock <= self._pushed[worker]:
            self._counters["duplicates"] += 1
            return PushDecision(
                DUPLICATE,
                next_clock=self._clocks[worker],
                reason=f"worker {worker} already pushed clock {clock}: it is at clock {self._clocks[worker]}",
            )
        self._clocks[worker] = max(self._clocks[worker], clock + 1)
        self._pushed[worker] = clock
        self._counters["pushes_applied"] += 1
        return PushDecision(APPLY, next_clock=clock + 1)

    def pull_ready(self, worker: int, clock: int) -> bool:
        self._check_worker(worker)
        self._check_clock(clock)
        return True

    def clock_of(self, worker: int) -> int:
        return self._clocks[self._check_worker(worker)]

    def _state(self) -> dict[str, Any]:
        return {"clocks": list(self._clocks), "pushed": list(self._pushed)}

    def _check_state(self, d: dict[str, Any]):
        clocks = self._int_list(d, "clocks", 0)
        # a state written before "pushed" was kept: every clock below a worker's was pushed, as it then meant
        pushed = self._int_list(d, "pushed", -1) if "pushed" in d else [c - 1 for c in clocks]
        if any(p >= c for p, c in zip(pushed, clocks)):
            raise PolicyError("policy state: 'pushed' has a clock at or beyond the worker's clock")

        def restore() -> None:
            self._clocks, self._pushed = clocks, pushed

        return restore
