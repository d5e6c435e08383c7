"""How a worker is asked to stop: the stop signals every psgd process leaves cleanly on (the launcher forwards
them to its children), and the event they set in a worker."""

from __future__ import annotations

import signal
import threading

#: The stop signals: the launcher forwards them to its children; every psgd process leaves cleanly on them.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stop(threading.Event):
    """Set by a stop signal: the worker finishes the step in hand, pushes it and leaves.  ``pausing`` (SIGINT,
    Ctrl-C: the whole job is being paused) leaves without telling the shards it left, so that no round closes
    without it and the job goes on from here exactly (psgd launch --resume, whose launcher stops its workers so);
    SIGTERM and SIGHUP say it left."""

    pausing = False

    def signalled(self, signum: int) -> None:
        self.pausing = self.pausing or signum == signal.SIGINT
        self.set()
