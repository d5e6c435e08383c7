"""What a launch keeps of each of its processes that failed: a :class:`ChildFailure`, made by the supervisor
(:mod:`psgd.launcher.supervise`) as it sees the child end, and carried by the :class:`~psgd.launcher.LaunchError`
that ends the launch, in ``psgd launch --json`` (``"failures"``) and in the launch's last lines.  A record, not a
sentence, so that a script that runs launches can tell a worker that ran out of memory (SIGKILL) from one whose
data was missing (its exit code, its log's last lines) without reading the logs."""

from __future__ import annotations

import dataclasses
import signal as signals
import time
from pathlib import Path
from typing import Any

#: how many of a failed child's last log lines its record keeps (where its error usually is)
LAST_LINES = 15


@dataclasses.dataclass(frozen=True)
class ChildFailure:
    """One child of a launch that failed: ``role`` (shard, replica, worker, rank, mpiexec) and ``rank`` (its shard's,
    worker's or rank's number; None for mpiexec, which runs every rank), its ``pid``, how it ended (``exit_code``,
    or the name of the ``signal`` that killed it: one of the two is None), when the launcher saw it end (``time``,
    seconds since the epoch, and ``seconds`` since the launch began), its ``log`` file and that log's
    ``last_lines``."""

    role: str
    rank: int | None
    pid: int
    exit_code: int | None
    signal: str | None
    time: float
    seconds: float
    log: str
    last_lines: tuple[str, ...]

    @property
    def name(self) -> str:
        """The child as the launcher names it: ``worker 1``, ``shard 0``, ``mpiexec``."""
        return self.role if self.rank is None else f"{self.role} {self.rank}"

    def how(self) -> str:
        """How it ended, in a few words: ``exit code 3``, ``SIGKILL``."""
        return self.signal or f"exit code {self.exit_code}"

    def line(self) -> str:
        """One line of the launch's last ones: who, how it ended, when, and where its log is."""
        return (
            f"  {self.name}: {self.how()}, {self.seconds:.1f}s into the launch "
            f"({time.strftime('%H:%M:%S', time.localtime(self.time))}), pid {self.pid}; log {self.log}"
        )

    def record(self) -> dict[str, Any]:
        """The record as JSON takes it (``psgd launch --json``'s ``"failures"``)."""
        return {**dataclasses.asdict(self), "last_lines": list(self.last_lines)}


def failure(role: str, rank: int | None, pid: int, returncode: int, log: Path, began: float) -> ChildFailure:
    """The record of a child that ended with ``returncode`` (Popen's: negative for the signal that killed it),
    seen now, ``began`` (time.monotonic) being when its launch began."""
    killed = None
    if returncode < 0:
        try:
            killed = signals.Signals(-returncode).name
        except ValueError:  # a signal Python has no name for
            killed = f"signal {-returncode}"
    return ChildFailure(
        role,
        rank,
        pid,
        None if killed else returncode,
        killed,
        time.time(),
        time.monotonic() - began,
        str(log),
        last_lines(log),
    )


def last_lines(path: Path, lines: int = LAST_LINES) -> tuple[str, ...]:
    """The last ``lines`` lines of the log ``path`` (none where it is gone or empty)."""
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return ()
    return tuple(text[-lines:])
