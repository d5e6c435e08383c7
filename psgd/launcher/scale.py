"""Growing and shrinking a running launch of a job with a range of workers (``[cluster] workers = "MIN:MAX"``).

``psgd scale RUN --workers N`` leaves a request in the run folder (:func:`ask`); the launch takes it within a
moment (:class:`Scaler`, polled while it waits for its workers) and starts workers at the lowest ranks it is not
running, or stops its highest ranks with SIGTERM: a worker stopped so tells the shards it leaves, and they shrink
the job at once (psgd.server.state.admission.Roster.leave) instead of waiting out its lease.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from psgd.config import JobConfig
from psgd.errors import InputError
from psgd.launcher.supervise import Child, LaunchError

log = logging.getLogger(__name__)

#: the request a launch takes: {"workers": N}
SCALE_FILE = "scale.json"
#: how long psgd scale waits for the launch to take its request
TAKEN_WITHIN = 15.0


def ask(run: Path, workers: int, within: float = TAKEN_WITHIN) -> str:
    """Ask the launch running in ``run`` for ``workers`` workers; returns what was asked, in words, once the launch
    took the request.  InputError for a folder without a job with a range, or a count outside it; LaunchError where
    no launch took it within ``within`` seconds (none runs there)."""
    path = run / "job.toml"
    if not path.is_file():
        raise InputError(f"{run} holds no job ({path.name} is missing): give the run folder of a psgd launch")
    c = JobConfig.load(path).cluster
    if not c.elastic:
        raise InputError(
            f"the job in {run} has a fixed {c.workers} worker(s): start it with --workers MIN:MAX to scale it"
        )
    if not c.fewest <= workers <= c.workers:
        raise InputError(f"--workers {workers} is outside the job's range {c.fewest}:{c.workers}")
    request, part = run / SCALE_FILE, run / (SCALE_FILE + ".part")
    part.write_text(json.dumps({"workers": workers}))
    os.replace(part, request)  # whole or not at all: the launch never reads half a request
    deadline = time.monotonic() + within
    while request.exists():
        if time.monotonic() > deadline:
            request.unlink(missing_ok=True)
            raise LaunchError(
                f"no launch took the request in {request} within {within:.0f}s: is psgd launch running with "
                f"--run-dir {run}?"
            )
        time.sleep(0.1)  # polling a file another process removes: nothing to wait on but the file itself
    return f"asked the launch in {run} for {workers} worker(s) (its range: {c.fewest}:{c.workers})"


class Scaler:
    """The launch's side: takes :data:`SCALE_FILE` when it appears and brings its workers to the count asked.

    ``start(rank)`` starts the worker of a rank; ``running`` maps the ranks started to their processes (those that
    ended are started again at their rank when more are asked for)."""

    def __init__(self, run: Path, most: int, start: Callable[[int], Child], running: dict[int, Child]):
        self.request, self.most, self.start, self.running = run / SCALE_FILE, most, start, running
        self.request.unlink(missing_ok=True)  # an earlier launch's, never taken

    def poll(self) -> list[Child]:
        """Act on a request, if one came; returns the workers it started."""
        try:
            asked = int(json.loads(self.request.read_text())["workers"])
        except FileNotFoundError:
            return []
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignored a request to scale (%s): %s", self.request, exc)
            asked = None
        self.request.unlink(missing_ok=True)
        if asked is None:
            return []
        live = sorted(r for r, child in self.running.items() if child.popen.poll() is None)
        started = []
        if asked > len(live):
            free = [r for r in range(self.most) if r not in live][: asked - len(live)]
            for r in free:
                self.running[r] = self.start(r)
                started.append(self.running[r])
            log.info("scaling up to %d worker(s): started worker(s) %s", asked, ", ".join(map(str, free)))
        elif asked < len(live):
            leaving = live[asked - len(live) :]
            for r in leaving:
                self.running[r].popen.send_signal(signal.SIGTERM)  # it finishes its step and tells the shards
            log.info("scaling down to %d worker(s): stopping worker(s) %s", asked, ", ".join(map(str, leaving)))
        else:
            log.info("asked for %d worker(s): %d already train", asked, len(live))
        return started
