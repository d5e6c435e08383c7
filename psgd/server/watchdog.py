"""Deadlines for gRPC calls that have none of their own: :class:`Watchdog` cancels a shard's data calls that
run past theirs (psgd.server.service)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class Watchdog:
    """Cancels the data calls that run past their deadline (a push whose messages stop coming, a pull whose
    reader stops reading): a gRPC handler has no deadline of its own but the client's, which may be none.
    One thread for every call of a server."""

    def __init__(self, name: str):
        self._calls: dict[int, tuple[float, Any, str]] = {}  # key -> (deadline, the call's gRPC context, what)
        self._next = 0
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.ident is not None:
            self._thread.join(5)

    def watch(self, seconds: float, context: Any, what: str, key: int | None = None) -> int:
        """Cancel ``context`` unless :meth:`done` is called within ``seconds`` (``key``: re-arm that call)."""
        with self._cond:
            if key is None:
                key, self._next = self._next, self._next + 1
            self._calls[key] = (time.monotonic() + seconds, context, what)
            self._cond.notify()
        return key

    def done(self, key: int) -> None:
        with self._cond:
            self._calls.pop(key, None)

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                for key in [k for k, (deadline, _, _) in self._calls.items() if deadline <= now]:
                    _, context, what = self._calls.pop(key)
                    log.warning("%s: cancelled, past its deadline", what)
                    context.cancel()
                wake = min((deadline for deadline, _, _ in self._calls.values()), default=now + 1.0)
                self._cond.wait(min(max(wake - now, 0.001), 1.0))
