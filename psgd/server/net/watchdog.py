"""Deadlines for gRPC calls that have none of their own: :class:`Watchdog` cancels a shard's data calls that
run past theirs (psgd.server.net.service); and :class:`Turns`, by which a shard's background loops never die."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from psgd.observe.logs import Quieted

log = logging.getLogger(__name__)


class Turns:
    """The turns of the background loops of the shard whose core is ``core`` (its checkpoints, its lease reaper),
    none of which dies of an error: an error is counted (the core's ``counter``: Status, Prometheus), said at once
    with its traceback and then at most once a minute with how many more, and the loop goes on to its next turn."""

    def __init__(self, core: Any, counter: str, said_every: float = 60.0):
        self.core, self.shard, self.counter = core, core.shard, counter
        self._said, self._traced = Quieted(said_every), False

    def __call__(self, what: str, turn: Callable[[], object]) -> None:
        try:
            turn()
        except Exception as exc:  # noqa: BLE001  (whatever it was, the loop goes on: it is said and counted)
            self.core.count(self.counter)
            unsaid = self._said.due()
            if unsaid is not None:
                log.error(
                    "shard %d: %s failed (%s: %s)%s; it goes on, and says so again at most once a minute",
                    self.shard,
                    what,
                    type(exc).__name__,
                    exc,
                    f" ({unsaid} more errors since the last line)" if unsaid else "",
                    exc_info=not self._traced,
                )  # the first with its traceback
                self._traced = True


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
