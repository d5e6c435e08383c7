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


def setup_logging(role: str, verbose: int = 0, log_file: str | None = None) -> None:
    """Send psgd's log to stderr as ``time role[pid] LEVEL message``, and to ``log_file`` too where one is given.

    ``role`` is e.g. ``local``, ``server:1`` or ``worker:3``; ``verbose`` 0 is
    INFO, 1 or more is DEBUG, and -1 is WARNING only on stderr (the file still
    gets INFO: a worker whose terminal shows its bar keeps its whole log there).
    """
    level = logging.DEBUG if verbose > 0 else logging.WARNING if verbose < 0 else logging.INFO
    form = logging.Formatter(f"%(asctime)s {role}[{os.getpid()}] %(levelname)s %(message)s", datefmt="%H:%M:%S")
    handler = _StderrHandler()
    handler.setFormatter(form)
    handler.setLevel(level)
    handlers: list[logging.Handler] = [handler]
    if log_file:
        kept = logging.FileHandler(log_file, encoding="utf-8")  # appended to: another writer may share the file
        kept.setFormatter(form)
        kept.setLevel(min(level, logging.INFO))
        handlers.append(kept)
    root = logging.getLogger("psgd")
    for old in root.handlers:
        if isinstance(old, logging.FileHandler):
            old.close()
    root.handlers[:] = handlers
    root.setLevel(min(h.level for h in handlers))
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
