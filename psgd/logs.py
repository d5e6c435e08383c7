"""Logging set-up: every line names the process (role and rank) that wrote it."""

from __future__ import annotations

import logging
import os
import sys


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
