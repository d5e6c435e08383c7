"""Injected slowdowns, to play stragglers on one machine.

A spec is ``KIND:ARGS[@RANKS]``:

- ``fixed:S``          sleep S seconds every step
- ``exp:MEAN``         sleep an exponentially distributed time of mean MEAN seconds
- ``uniform:LO:HI``    sleep a uniform time between LO and HI seconds
- ``slowdown:K``       make every step take K times as long as it took without the delay

``@RANKS`` limits it to some ranks (``@0`` or ``@0,2``); without it every
rank is slowed.  The spec is part of a run's recorded configuration.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from psgd.errors import InputError

KINDS = ("fixed", "exp", "uniform", "slowdown")


class DelayError(InputError):
    """A malformed delay spec."""


@dataclasses.dataclass(frozen=True)
class Delay:
    kind: str = "none"
    args: tuple[float, ...] = ()
    ranks: tuple[int, ...] | None = None
    spec: str = ""

    def describe(self) -> str:
        """The delay in words, for titles: ``worker 0 four times slower``."""
        if self.kind == "none":
            return "no straggler"
        who = (
            "every worker"
            if self.ranks is None
            else f"worker {self.ranks[0]}"
            if len(self.ranks) == 1
            else "workers " + ", ".join(map(str, self.ranks))
        )
        if self.kind == "slowdown":
            k = self.args[0]
            times = {2: "twice", 3: "three times", 4: "four times", 5: "five times", 10: "ten times"}.get(k, f"{k:g}x")
            return f"{who} {times} slower"
        if self.kind == "fixed":
            return f"{who} {self.args[0] * 1e3:g} ms slower per step"
        if self.kind == "exp":
            return f"{who} slowed by random pauses (mean {self.args[0] * 1e3:g} ms a step)"
        return f"{who} slowed by {self.args[0] * 1e3:g}-{self.args[1] * 1e3:g} ms a step"

    def applies_to(self, rank: int) -> bool:
        return self.kind != "none" and (self.ranks is None or rank in self.ranks)

    def seconds(self, step_seconds: float, rng: np.random.Generator) -> float:
        """How long to sleep after a step that took ``step_seconds`` on its own."""
        if self.kind == "fixed":
            return self.args[0]
        if self.kind == "exp":
            return float(rng.exponential(self.args[0]))
        if self.kind == "uniform":
            return float(rng.uniform(self.args[0], self.args[1]))
        if self.kind == "slowdown":
            return (self.args[0] - 1.0) * max(step_seconds, 0.0)
        return 0.0


NO_DELAY = Delay()


def parse_delay(spec: str | None) -> Delay:
    if not spec:
        return NO_DELAY
    body, _, ranks_text = spec.partition("@")
    kind, _, rest = body.partition(":")
    arity = {"fixed": 1, "exp": 1, "uniform": 2, "slowdown": 1}
    if kind not in arity:
        raise DelayError(
            f"delay {spec!r}: unknown kind {kind!r}; use fixed:S, exp:MEAN, uniform:LO:HI or "
            "slowdown:K, optionally followed by @RANKS"
        )
    try:
        args = tuple(float(a) for a in rest.split(":")) if rest else ()
        ranks = tuple(int(r) for r in ranks_text.split(",")) if ranks_text else None
    except ValueError:
        raise DelayError(f"delay {spec!r}: arguments must be numbers and ranks integers") from None
    if len(args) != arity[kind]:
        raise DelayError(f"delay {spec!r}: {kind} takes {arity[kind]} number(s)")
    if any(a < 0 for a in args) or (kind == "slowdown" and args[0] < 1) or (kind == "uniform" and args[0] > args[1]):
        raise DelayError(f"delay {spec!r}: times must be >= 0, LO <= HI, and a slowdown at least 1")
    return Delay(kind, args, ranks, spec)
