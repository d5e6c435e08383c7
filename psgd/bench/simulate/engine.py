"""The simulator's clock and the things time is spent on: :class:`Sim` (events in time order), :class:`Cpu` (a
host's cores, shared by whatever runs on them), :class:`Lock` (one at a time: a shard's lock) and :class:`Nic`
(a host's link, full duplex).

The loop is a heap of (time, order, callback): psgd's job is a handful of kinds of actors whose work has a known
cost, so callbacks are all it needs (a coroutine framework such as SimPy would add processes and their scheduling
to what is a short chain of "then" calls per message, and its resources are first-come servers, where a host's
cores are shared).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable

Then = Callable[[], None]


class Sim:
    """Events in time order; ``now`` is the time of the one being run (seconds)."""

    def __init__(self):
        self.now = 0.0
        self._events: list = []
        self._order = itertools.count()

    def after(self, delay: float, then: Then) -> None:
        heapq.heappush(self._events, (self.now + max(delay, 0.0), next(self._order), then))

    @property
    def idle(self) -> bool:
        """Whether no event is left."""
        return not self._events

    def run(self, until: float) -> None:
        """Run every event up to ``until`` (simulated seconds), or until none is left."""
        while self._events and self._events[0][0] <= until:
            self.now, _, then = heapq.heappop(self._events)
            then()


class Cpu:
    """A host's cores, shared equally by the processes busy on it (processor sharing): with n of them busy and
    ``cores`` cores, each gets min(1, cores / n) of a core, split among its pieces of work (a Python process runs
    one thread at a time, whatever its threads wait for).  A process is busy while it works and
    while it watches for an answer (``spinning``: a wait that spins rather than sleeps).  ``cores`` may be fractional:
    what two busy processes get from two virtual cores that share a physical one is measured, not assumed."""

    def __init__(self, sim: Sim, cores: float, four: float | None = None):
        """``cores``: what two busy processes get together (all of them: a host of ``cores`` real cores);
        ``four``: what four or more get together where measured (context switches cost them some)."""
        self.sim, self.cores, self.four = sim, cores, four
        self._running: dict[int, list] = {}  # id -> [work left (core-seconds), then, owner]
        self._watching: set = set()  # processes spinning while they wait
        self._ids = itertools.count()
        self._last = 0.0
        self._epoch = 0  # the completion event in flight; an older one is stale
        self.busy = 0.0  # core-seconds of work done so far
        self._shares: dict[int, float] | None = None  # _rates() until the work on the cores changes

    def _rates(self) -> dict[int, float]:
        """Each piece of work's share of a core now."""
        if self._shares is None:
            self._shares = self._share()
        return self._shares

    def _share(self) -> dict[int, float]:
        owners: dict = {}
        for key, item in self._running.items():
            owners.setdefault(item[2] if item[2] is not None else ("work", key), []).append(key)
        n = len(set(owners) | self._watching)
        each = min(1.0, self.capacity(n) / n) if owners else 0.0
        return {key: each / len(keys) for keys in owners.values() for key in keys}

    def capacity(self, busy: int) -> float:
        """Cores' worth of work ``busy`` processes get done together."""
        if self.four is None or busy <= 2:
            return min(busy, self.cores)
        return self.four if busy >= 4 else (self.cores + self.four) / 2

    def _advance(self) -> None:
        elapsed = self.sim.now - self._last
        for key, rate in self._rates().items():
            self._running[key][0] -= elapsed * rate
            self.busy += elapsed * rate
        self._last = self.sim.now

    def spinning(self, owner) -> None:
        """``owner`` spins while it waits from now on: busy for the others' share of the cores."""
        self._advance()
        self._watching.add(owner)
        self._plan()

    def _plan(self) -> None:
        """The next completion, after the work on the cores changed (each change comes here)."""
        self._shares = None
        self._epoch += 1
        if self._running:
            epoch, rates = self._epoch, self._rates()
            soonest = min(self._running[key][0] / rate for key, rate in rates.items())
            self.sim.after(soonest, lambda: self._finish(epoch))

    def _finish(self, epoch: int) -> None:
        if epoch != self._epoch:
            return
        self._advance()
        done = [key for key, item in self._running.items() if item[0] <= 1e-12]
        thens = [self._running.pop(key)[1] for key in done]
        self._plan()
        for then in thens:
            then()

    def work(self, seconds: float, then: Then, owner=None) -> None:
        """``seconds`` of one core's work for ``owner`` (a process; None: a process of its own), then ``then`` (at
        once where there is none)."""
        if seconds <= 0:
            then()
            return
        self._advance()
        self._running[next(self._ids)] = [seconds, then, owner]
        self._plan()


class Lock:
    """One holder at a time, the others in arrival order."""

    def __init__(self):
        self._held = False
        self._waiting: deque[Then] = deque()

    def acquire(self, then: Then) -> None:
        if self._held:
            self._waiting.append(then)
        else:
            self._held = True
            then()

    def release(self) -> None:
        if self._waiting:
            self._waiting.popleft()()
        else:
            self._held = False


class Nic:
    """A host's link at ``rate`` bytes/s each way; a message leaves when its sender's way out and its receiver's way
    in are both free, holds both for its bytes / rate, and arrives ``latency`` seconds after its last byte left.
    With a ``burst`` (bytes), each way is a token bucket as Linux's tbf shapes an emulated link: bytes the bucket
    holds tokens for pass at once, the rest at the rate; a real link has none (0)."""

    def __init__(self, rate: float, latency: float, burst: float = 0.0):
        self.rate, self.latency, self.burst = rate, latency, burst
        self.out_free = self.in_free = 0.0  # when each way's last message has passed
        self.out_tokens = self.in_tokens = burst  # each way's bucket, as it was when its last message passed


def send(sim: Sim, src: Nic, dst: Nic, nbytes: float, then: Then) -> None:
    """Move ``nbytes`` from the host of ``src`` to the host of ``dst`` over their links (full duplex, first come
    first served on each way), then ``then``."""
    start = max(sim.now, src.out_free, dst.in_free)
    rate = min(src.rate, dst.rate)
    out = min(src.burst, src.out_tokens + src.rate * (start - src.out_free))
    into = min(dst.burst, dst.in_tokens + dst.rate * (start - dst.in_free))
    passing = max(nbytes - min(out, into), 0.0) / rate  # the bytes the buckets have no tokens for, at the rate
    end = start + passing
    src.out_tokens, dst.in_tokens = out + rate * passing - nbytes, into + rate * passing - nbytes
    src.out_free = dst.in_free = end
    sim.after(end - sim.now + max(src.latency, dst.latency), then)
