"""sync (BSP): one averaged update per clock, with optional backup workers."""

from __future__ import annotations

from typing import Any, ClassVar

from psgd.policy.base import (
    ACCUMULATE,
    DUPLICATE,
    LATE,
    Policy,
    PolicyError,
    PolicyOption,
    PushDecision,
    _is_int,
    _show,
)


class SyncPolicy(Policy):
    """Bulk synchronous rounds: round ``c`` gathers the pushes with clock ``c``.

    Rounds close in order; ``applied_rounds`` counts those closed, and the
    open round is round ``applied_rounds``.  The open round closes once it has
    at least one push and at most ``backup_workers`` live workers have not
    pushed it.  Pushes from workers that pushed and then left still count
    (the core averages over the pushes it accumulated); a worker that leaves
    only stops being waited for.  Only the open round takes pushes, so a close
    never cascades, and a push for a closed round is ``late`` (dropped).
    """

    name: ClassVar[str] = "sync"
    summary: ClassVar[str] = "bulk-synchronous rounds: a round's pushes are averaged, then applied once"
    options: ClassVar[tuple[PolicyOption, ...]] = (
        PolicyOption(
            "backup_workers",
            int,
            0,
            "close each round without the last B workers' pushes",
            required=False,
            cluster_key="backup_workers",
            shorthand="backup:B",
            label="sync +{} backup",
        ),
    )
    accumulates: ClassVar[bool] = True
    _COUNTERS: ClassVar[tuple[str, ...]] = (
        "rounds_closed",
        "pushes_accumulated",
        "duplicates",
        "late",
        "rejected",
        "rounds_skipped",
    )

    def __init__(self, num_workers: int, backup_workers: int = 0):
        super().__init__(num_workers)
        if not _is_int(backup_workers) or not 0 <= backup_workers < self.num_workers:
            raise PolicyError(
                f"policy 'sync': backup_workers must be an integer in "
                f"0..{self.num_workers - 1} (fewer than num_workers), got {_show(backup_workers)}"
            )
        self.backup_workers = int(backup_workers)
        self._applied_rounds = 0
        self._last = [-1] * self.num_workers  # the last clock each worker contributed to a round

    @property
    def applied_rounds(self) -> int:
        """Rounds closed so far; the open round is this one."""
        return self._applied_rounds

    def open_round_pushers(self) -> frozenset[int]:
        """Workers (live or not) whose push is in the open round."""
        return frozenset(w for w, c in enumerate(self._last) if c == self._applied_rounds)

    # -- events ---------------------------------------------------------

    def join(self, worker: int) -> int:
        worker = self._check_worker(worker)
        self._live.add(worker)  # never closes a round: one more live worker to wait for, or one that pushed
        return self.clock_of(worker)

    def fast_forward(self, worker: int, clock: int) -> bool:
        """Jump the open round to ``clock`` (dropping the rounds in between, and the open round's
        contributions) when a worker comes back to a restored shard further ahead."""
        self._check_worker(worker)
        clock = self._check_clock(clock)
        if clock <= self._applied_rounds:
            return False
        self._counters["rounds_skipped"] += clock - self._applied_rounds
        self._applied_rounds = clock
        self._last = [min(c, clock - 1) for c in self._last]
        return True

    def leave(self, worker: int) -> tuple[int, ...]:
        worker = self._check_worker(worker)
        if worker not in self._live:
            return ()
        self._live.discard(worker)
        return self._close_if_complete()

    def push(self, worker: int, clock: int) -> PushDecision:
        problem = self._push_problem(worker, clock)
        if problem is not None:
            return problem
        worker, clock = int(worker), int(clock)
        rnd = self._applied_rounds
        if clock <= self._last[worker]:
            self._counters["duplicates"] += 1
            return PushDecision(
                DUPLICATE,
                round=clock,
                next_clock=self.clock_of(worker),
                reason=f"worker {worker} already pushed clock {clock}",
            )
        if clock < rnd:
            self._counters["late"] += 1
            return PushDecision(
                LATE,
                round=clock,
                next_clock=rnd,
                reason=f"round {clock} closed without worker {worker}: continue at clock {rnd}",
            )
        if clock > rnd:
            return self._reject(
                f"clock {clock} is from the future: round {rnd} is open, and a sync worker "
                f"pushes clock {clock} only after round {clock - 1} closed",
                self.clock_of(worker),
            )
        self._last[worker] = clock
        self._counters["pushes_accumulated"] += 1
        return PushDecision(ACCUMULATE, round=clock, closed_rounds=self._close_if_complete(), next_clock=clock + 1)

    def _close_if_complete(self) -> tuple[int, ...]:
        rnd = self._applied_rounds
        pushed = self.open_round_pushers()
        if not pushed or len(self._live - pushed) > self.backup_workers:
            return ()
        self._applied_rounds += 1
        self._counters["rounds_closed"] += 1
        return (rnd,)

    # -- queries --------------------------------------------------------

    def pull_ready(self, worker: int, clock: int) -> bool:
        self._check_worker(worker)
        return self._check_clock(clock) <= self._applied_rounds

    def clock_of(self, worker: int) -> int:
        """The clock ``worker`` pushes next: after its last push, and never a closed round."""
        return max(self._last[self._check_worker(worker)] + 1, self._applied_rounds)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "applied_rounds": self._applied_rounds,
            "open_round_pushers": sorted(self.open_round_pushers()),
        }

    # -- checkpoints ----------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {"applied_rounds": self._applied_rounds, "last_pushed": list(self._last)}

    def _check_state(self, d: dict[str, Any]):
        applied = d.get("applied_rounds")
        if not _is_int(applied) or applied < 0:
            raise PolicyError(f"policy state: 'applied_rounds' must be an integer >= 0, got {_show(applied)}")
        last = self._int_list(d, "last_pushed", -1)
        if max(last) > applied:
            raise PolicyError(f"policy state: 'last_pushed' has a clock beyond the open round {applied}")

        def restore() -> None:
            self._applied_rounds = int(applied)
            self._last = last

        return restore
