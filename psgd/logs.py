"""Logging set-up: every line names the process (role and rank) that wrote it; a line that repeats is said at most
once a while (:class:`Quieted`)."""

from __future__ import annotations

import logging
import os
import sys
import time


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each record (it may be replaced)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def setup_logging(role: str, verbose: int = 0) -> None:
    """Send psgd's log to stderr as ``time role[pid] LEVEL message``.

    ``role`` is e.g. ``local``, ``server:1`` or ``worker:3``; ``verbose`` 0 is
    INFO, 1 or more is DEBUG, and -1 is WARNING only.
    """
    level = logging.DEBUG if verbose > 0 else logging.WARNING if verbose < 0 else logging.INFO
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s {role}[{os.getpid()}] %(levelname)s %(message)s", datefmt="%H:%M:%S"))
    root = logging.getLogger("psgd")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


class Quieted:
    """A line that may repeat without end (a refused follower, a failing checkpoint): said the first time, then at
    most once every ``seconds`` while it goes on, with how many were not said since."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.unsaid, self._quiet_until = 0, 0.0

    def due(self) -> int | None:
        """None while quiet (this one counted, not said); else how many were not said before it, to say so."""
        now = time.monotonic()
        if now < self._quiet_until:
            self.unsaid += 1
            return None
        unsaid, self.unsaid, self._quiet_until = self.unsaid, 0, now + self.seconds
        return unsaid

    def reset(self) -> None:
        """It stopped: the next one is said at once."""
        self.unsaid, self._quiet_until = 0, 0.0
