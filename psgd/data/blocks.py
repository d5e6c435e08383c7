"""The examples of a job with a range of workers, handed out a batch at a time while workers join and leave.

A job's **epoch** is one pass over its training set in the order of :func:`psgd.data.sharding.epoch_permutation`
(from the job's seed and the epoch), whoever trains on it.  Its **blocks** are that order's consecutive runs of
``batch_size`` examples: ``n // batch_size`` an epoch (the incomplete last run is left out, a different one each
epoch, as a fixed job's sharding leaves its remainder out), and block ``g`` of the job is block
``g % per_epoch`` of epoch ``g // per_epoch``.  A job of E epochs has ``E * per_epoch`` blocks.

Shard 0 hands them out (:class:`Blocks`, a pure state machine under the shard's lock): a worker asks for the block of
its clock at the start of each step and gets the lowest block nobody took, or the one it was given for that clock
before (a retried ask, a step taken again after the job went back to a cut).  A worker that leaves gives back the
blocks of the clocks it did not push, which go to the next to ask.  One whose lease runs out may only be paused, and
push its step in hand when it comes back: its blocks stay its own (and go to the next process of its rank, clock for
clock) until no other block is left.  So within the job no block is trained twice and none is lost, however many
workers train at a time (``tests/unit/test_handed_batches.py`` checks it over random joins, leaves, crashes and
pauses).  When no block is left the answer is :data:`NONE_LEFT`, and the worker's training ends.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from psgd.data.base import DataError
from psgd.data.sharding import epoch_permutation

#: the answer when every block of the job was handed out
NONE_LEFT = -1


def blocks_per_epoch(n: int, batch_size: int) -> int:
    """An epoch's blocks: ``n // batch_size``."""
    if batch_size < 1 or n < batch_size:
        raise DataError(f"a batch of {batch_size} does not fit a training set of {n} examples")
    return n // batch_size


class Blocks:
    """Which block each worker trains at each of its clocks; see the module docstring.

    ``total`` is the job's blocks, fixed by the first worker that asks (every worker computes it from the same job
    file; one that says another number is refused by the caller, :meth:`check_total`)."""

    def __init__(self) -> None:
        self.total: int | None = None
        self._next = 0  # the lowest block never handed out
        self._back: list[int] = []  # blocks given back, a heap: the lowest goes first
        self._given: dict[int, dict[int, int]] = {}  # worker -> its clock -> the block it trains then
        self.given_back = 0  # blocks given back so far (to be handed out again)
        self._lapsed: dict[int, int] = {}  # worker -> the clock from which its lease ran out (it may come back)

    def check_total(self, total: int) -> str:
        """ "" when ``total`` is the job's blocks (the first to ask sets it), else why not, in words."""
        if self.total is None:
            self.total = int(total)
        if total != self.total:
            return f"its data makes {total} batches for the whole job, the job's first worker said {self.total}"
        return ""

    def take(self, worker: int, clock: int) -> int:
        """The block ``worker`` trains at ``clock``: the one it was given for that clock, else the lowest given
        back, else the next never handed out; :data:`NONE_LEFT` once every block was."""
        mine = self._given.setdefault(worker, {})
        if clock in mine:
            return mine[clock]
        if not self._back and (self.total is None or self._next >= self.total):
            for gone, since in self._lapsed.items():  # nothing else left: the lapsed workers' blocks go now
                self.give_back(gone, since)
            self._lapsed.clear()
        if self._back:
            block = heapq.heappop(self._back)
        elif self.total is not None and self._next < self.total:
            block, self._next = self._next, self._next + 1
        else:
            return NONE_LEFT
        mine[clock] = block
        return block

    def give_back(self, worker: int, from_clock: int) -> list[int]:
        """``worker`` pushed no clock from ``from_clock`` on (it left, or its lease ran out): the blocks it was
        given for those clocks go back, to be handed out again; returns them."""
        mine = self._given.get(worker, {})
        back = [mine.pop(c) for c in sorted(c for c in mine if c >= from_clock)]
        for block in back:
            heapq.heappush(self._back, block)
        self.given_back += len(back)
        return back

    def lapsed(self, worker: int, from_clock: int) -> None:
        """``worker``'s lease ran out at ``from_clock``: it may be paused, not dead, and push the step in hand when it
        comes back, so its blocks from then on stay its own (the process that takes its rank next gets them, clock
        for clock) until no other block is left; then they go to the next to ask."""
        self._lapsed[worker] = min(from_clock, self._lapsed.get(worker, from_clock))

    def came_back(self, worker: int) -> None:
        """``worker``'s rank is registered again (the same process, or the next to take it): its blocks are its
        own again."""
        self._lapsed.pop(worker, None)

    def describe(self) -> dict[str, Any]:
        """The job's blocks, those not handed out yet, those given back so far, and the workers whose lease ran out
        with the clock it ran out at (for status displays)."""
        lapsed = {str(w): c for w, c in self._lapsed.items()}
        return {"total": self.total, "left": self.left(), "given_back": self.given_back, "lapsed": lapsed}

    def left(self) -> int:
        """Blocks not yet handed out (given back ones included)."""
        return (0 if self.total is None else self.total - self._next) + len(self._back)

    def state_dict(self, since: Mapping[int, int]) -> dict[str, Any]:
        """What a checkpoint keeps: the counts, the blocks given back, and each worker's blocks from its clock in
        ``since`` on (those before it are pushed: never asked for again, as a job goes back only to a cut)."""
        given = {
            str(w): {str(c): b for c, b in mine.items() if c >= since.get(w, 0)} for w, mine in self._given.items()
        }
        return {
            "total": self.total,
            "next": self._next,
            "back": sorted(self._back),
            "given": given,
            "given_back": self.given_back,
            "lapsed": {str(w): c for w, c in self._lapsed.items()},
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output: all or nothing (a malformed state changes nothing)."""
        try:
            total = None if d["total"] is None else int(d["total"])
            following, back = int(d["next"]), sorted(int(b) for b in d["back"])
            given = {int(w): {int(c): int(b) for c, b in mine.items()} for w, mine in d["given"].items()}
            given_back = int(d.get("given_back", 0))
            lapsed = {int(w): int(c) for w, c in d.get("lapsed", {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DataError(f"the handed-out batches in the checkpoint are malformed: {exc!r}") from None
        self.total, self._next, self._back, self._given = total, following, back, given
        self.given_back, self._lapsed = given_back, lapsed


class HandedBatches:
    """A worker's batches in a job with a range of workers: each step's is asked for (``ask(clock, total)``: shard 0's
    answer, :meth:`Blocks.take`), as :class:`psgd.data.sharding.ShardedBatches` gives a fixed job's.
    ``steps_per_epoch`` is this worker's share of an epoch when the ``fewest`` train (a schedule's unit, such as the
    default evaluation's once an epoch); the job ends for it when no batch is left (:meth:`at` gives None)."""

    def __init__(
        self, n: int, batch_size: int, seed: int, epochs: int, fewest: int, ask: Callable[[int, int], int]
    ) -> None:
        self.n, self.batch_size, self.seed, self.ask = n, batch_size, seed, ask
        self.per_epoch = blocks_per_epoch(n, batch_size)
        self.total_blocks = self.per_epoch * epochs
        self.steps_per_epoch = max(1, self.per_epoch // fewest)
        self.steps = -(-self.total_blocks // fewest)  # what it may expect to take: a progress bar's total
        self._cached: tuple[int, np.ndarray] | None = None

    def at(self, step: int) -> tuple[int, np.ndarray] | None:
        """The job epoch and the indices of the batch this worker trains at ``step``, or None when none is left."""
        block = self.ask(step, self.total_blocks)
        if block == NONE_LEFT:
            return None
        if not 0 <= block < self.total_blocks:
            raise DataError(f"shard 0 handed out batch {block} of a job of {self.total_blocks}")
        epoch, b = divmod(block, self.per_epoch)
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, epoch_permutation(self.n, epoch, self.seed))
        return epoch, self._cached[1][b * self.batch_size : (b + 1) * self.batch_size]

    def ahead(self, step: int) -> np.ndarray | None:
        """Unknown until asked for: None (nothing is gathered ahead)."""
        return None
