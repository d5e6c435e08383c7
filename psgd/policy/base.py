"""What every consistency policy shares: the decision type, the error, the option type and the base class.

A policy is a pure state machine.  The server core feeds it events (a worker
joins, leaves, pushes, asks to pull) and acts on what it answers; the policy
holds no tensors, locks, threads or timers and does no I/O, so every
interleaving can be replayed in a unit test.  Being pure, it is not
thread-safe: the core calls it under its own lock.

Clocks: a worker's clock is the number of steps it has pushed.  A worker at
clock ``c`` pulls weights for ``c``, computes step ``c``, pushes it with clock
``c`` and is then at ``c + 1``.  Workers are ``0 .. num_workers - 1``, and all
of them start live (expected); the core calls :meth:`Policy.leave` for those
that never register, finish (``done``) or let their lease run out.

Each policy describes itself in class attributes: its ``name``, a one-line
``summary``, the ``options`` it takes (:class:`PolicyOption`: type, default,
help and the ``[cluster]`` key of a job file it is read from), whether it
``accumulates`` a round's pushes into a sum before one update, and whether its
workers train ``local``ly between pushes (a push is then a worker's progress).
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from psgd.errors import InputError

APPLY = "apply"  # apply this gradient now
ACCUMULATE = "accumulate"  # add it to the open sync round
DUPLICATE = "duplicate"  # already applied: drop it, acknowledge OK
LATE = "late"  # its sync round closed without it: drop it, count it
REJECT = "reject"  # a protocol violation: tell the worker why
ACTIONS = (APPLY, ACCUMULATE, DUPLICATE, LATE, REJECT)
#: What the shard tells the worker happened to a push it took, for each action but REJECT (an error), and
#: the shard's counter of each (psgd status, Prometheus).  The order is the data path's outcome codes.
OUTCOMES = {APPLY: "applied", ACCUMULATE: "accumulated", DUPLICATE: "duplicate", LATE: "late"}
OUTCOME_COUNTERS = {"applied": "applied", "accumulated": "accumulated", "duplicate": "duplicates", "late": "late"}

STATE_FORMAT = 1


class PolicyError(InputError):
    """A policy was misconfigured or misused; the message is one line that says why."""


@dataclass(frozen=True)
class PushDecision:
    """What the core must do with one push."""

    action: str  # one of ACTIONS
    round: int | None = None  # sync: the round (= clock) this push belongs to
    closed_rounds: tuple[int, ...] = ()  # sync rounds complete after this event, to apply now, in order
    next_clock: int = 0  # the clock the worker should use for its next push
    reason: str = ""  # for reject, late and duplicate
    reason_code: str = ""  # for reject: NOT_REGISTERED when the worker must register again


@dataclass(frozen=True)
class PolicyOption:
    """One option a policy takes: a keyword of its constructor, and a ``[cluster]`` key of a job file."""

    name: str  # the keyword (and the policy's attribute that holds the value)
    type: type  # int, float, ...
    default: Any  # None when required
    help: str  # one line, for --help
    required: bool
    cluster_key: str  # the [cluster] key it is read from (a field of psgd.config.Consistency)
    shorthand: str = ""  # how a benchmark contender names a value of it, as WORD:LETTER ("ssp:S"), if it may
    label: str = ""  # that contender in words, the value at {} ("ssp s={}")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _show(value: Any) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


class Policy(ABC):
    """The interface the server core drives; see the module docstring."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line, in words
    options: ClassVar[tuple[PolicyOption, ...]] = ()
    accumulates: ClassVar[bool] = False  # the core sums a round's pushes before one update
    local: ClassVar[bool] = False  # workers take local steps and push their progress, not gradients
    _COUNTERS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, num_workers: int):
        if not _is_int(num_workers) or num_workers < 1:
            raise PolicyError(f"num_workers must be an integer >= 1, got {_show(num_workers)}")
        self.num_workers = int(num_workers)
        self._live: set[int] = set(range(self.num_workers))
        self._counters: dict[str, int] = dict.fromkeys(self._COUNTERS, 0)

    # -- events ---------------------------------------------------------

    @abstractmethod
    def join(self, worker: int) -> int:
        """(Re)register ``worker``: it is live again; returns the clock it continues from."""

    def fast_forward(self, worker: int, clock: int) -> bool:
        """After the shard was restored from a checkpoint, ``worker`` says it is at ``clock``:
        adopt it if it is ahead, so the worker carries on instead of repeating or being refused.

        Returns True when the open sync round was discarded (its partial sum must be cleared).
        """
        worker, clock = self._check_worker(worker), self._check_clock(clock)
        clocks = getattr(self, "_clocks", None)
        if clocks is not None and clock > clocks[worker]:
            clocks[worker] = clock
        return False

    @abstractmethod
    def leave(self, worker: int) -> tuple[int, ...]:
        """``worker`` is done or its lease expired; returns the sync rounds that close because of it."""

    @abstractmethod
    def push(self, worker: int, clock: int) -> PushDecision:
        """``worker`` pushes the gradient of step ``clock``."""

    # -- queries --------------------------------------------------------

    @abstractmethod
    def pull_ready(self, worker: int, clock: int) -> bool:
        """May a pull from ``worker`` for ``clock`` be answered now?"""

    @abstractmethod
    def clock_of(self, worker: int) -> int:
        """The clock ``worker`` should push next, as this policy knows it."""

    def live_workers(self) -> frozenset[int]:
        return frozenset(self._live)

    def min_live_clock(self) -> int | None:
        """The slowest live worker's clock, or None when no worker is live."""
        return min((self.clock_of(w) for w in self._live), default=None)

    def option_values(self) -> dict[str, Any]:
        """The options this policy was built with (as :func:`psgd.policy.make_policy` takes them)."""
        return {o.name: getattr(self, o.name) for o in self.options}

    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def describe(self) -> dict[str, Any]:
        """Name, options, counters and clocks, JSON-serialisable (for status displays)."""
        return {
            "name": self.name,
            "num_workers": self.num_workers,
            "options": self.option_values(),
            "counters": self.counters(),
            "live_workers": sorted(self._live),
            "clocks": [self.clock_of(w) for w in range(self.num_workers)],
            "min_live_clock": self.min_live_clock(),
        }

    # -- checkpoints ----------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to make the same future decisions, JSON-serialisable."""
        return {
            "format": STATE_FORMAT,
            "policy": self.name,
            "num_workers": self.num_workers,
            "options": self.option_values(),
            "live": sorted(self._live),
            "counters": self.counters(),
            **self._state(),
        }

    def load_state_dict(self, d: dict[str, Any], live_now: Iterable[int] | None = None) -> None:
        """Restore :meth:`state_dict`'s output (all or nothing: a bad dict changes nothing).

        The policy name and the number of workers must match; the options are
        this policy's own (a restart may change them: clocks do not depend on them).
        ``live_now``: the workers expected now, where the caller knows better than the state (a shard's roster: the
        workers of a stopped job left before its last checkpoint, and come back to the restored shard); default
        the state's own.
        """
        if not isinstance(d, dict):
            raise PolicyError(f"policy state must be a dict, got {type(d).__name__}")
        if d.get("format") != STATE_FORMAT:
            raise PolicyError(f"policy state has format {_show(d.get('format'))}, this psgd reads {STATE_FORMAT}")
        if d.get("policy") != self.name:
            raise PolicyError(f"policy state is for policy {_show(d.get('policy'))}, this server runs {self.name!r}")
        if d.get("num_workers") != self.num_workers:
            raise PolicyError(
                f"policy state is for {_show(d.get('num_workers'))} workers, this server has {self.num_workers}"
            )
        live = self._worker_list(d, "live")
        expected = None if live_now is None else {self._check_worker(w) for w in live_now}
        counters = d.get("counters")
        if (
            not isinstance(counters, dict)
            or set(counters) != set(self._COUNTERS)
            or not all(_is_int(v) and v >= 0 for v in counters.values())
        ):
            raise PolicyError(f"policy state: 'counters' must map {', '.join(self._COUNTERS)} to integers >= 0")
        restore = self._check_state(d)  # validates everything before anything changes
        self._live = set(live) if expected is None else expected
        self._counters = {k: int(counters[k]) for k in self._COUNTERS}
        restore()

    @abstractmethod
    def _state(self) -> dict[str, Any]:
        """The policy's own part of :meth:`state_dict`."""

    @abstractmethod
    def _check_state(self, d: dict[str, Any]):
        """Validate the policy's own part of ``d``; return a function that installs it."""

    # -- helpers for subclasses -----------------------------------------

    def _int_list(self, d: dict[str, Any], key: str, minimum: int) -> list[int]:
        values = d.get(key)
        if (
            not isinstance(values, list)
            or len(values) != self.num_workers
            or not all(_is_int(v) and v >= minimum for v in values)
        ):
            raise PolicyError(f"policy state: {key!r} must be a list of {self.num_workers} integers >= {minimum}")
        return [int(v) for v in values]

    def _worker_list(self, d: dict[str, Any], key: str) -> list[int]:
        values = d.get(key)
        if (
            not isinstance(values, list)
            or len(set(values)) != len(values)
            or not all(_is_int(v) and 0 <= v < self.num_workers for v in values)
        ):
            raise PolicyError(
                f"policy state: {key!r} must be a list of distinct worker ids in 0..{self.num_workers - 1}"
            )
        return [int(v) for v in values]

    def _check_worker(self, worker: Any) -> int:
        if not _is_int(worker) or not 0 <= worker < self.num_workers:
            raise PolicyError(
                f"worker id {_show(worker)} is out of range: this job has workers 0..{self.num_workers - 1}"
            )
        return int(worker)

    def _check_clock(self, clock: Any) -> int:
        if not _is_int(clock) or clock < 0:
            raise PolicyError(f"clock must be an integer >= 0, got {_show(clock)}")
        return int(clock)

    def _push_problem(self, worker: Any, clock: Any) -> PushDecision | None:
        """A reject decision for a push that breaks the protocol whatever the policy, else None."""
        try:
            worker = self._check_worker(worker)
            clock = self._check_clock(clock)
        except PolicyError as exc:
            return self._reject(str(exc))
        if worker not in self._live:
            return self._reject(
                f"worker {worker} has left (done or lease expired): it must register again before it pushes",
                self.clock_of(worker),
                "NOT_REGISTERED",
            )
        return None

    def _reject(self, reason: str, next_clock: int = 0, code: str = "") -> PushDecision:
        self._counters["rejected"] += 1
        return PushDecision(REJECT, next_clock=next_clock, reason=reason, reason_code=code)
