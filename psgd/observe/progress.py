"""Progress bars and the metrics log shared by every trainer: JSON lines, and TensorBoard's event files beside them."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from tqdm import tqdm

from psgd.errors import InputError
from psgd.observe.files import open_own, open_regular


def bar_wanted(asked: bool | None) -> bool:
    """Whether to draw a progress bar: as ``asked``, or (None) where stderr is a terminal (a file, a pipe or a
    notebook's stream gets log lines instead)."""
    return sys.stderr.isatty() if asked is None else bool(asked)


@contextlib.contextmanager
def progress_bar(total: int, desc: str, *, enabled: bool = True, position: int | None = None) -> Iterator[tqdm]:
    """A tqdm bar on stderr (a silent one when ``enabled`` is false)."""
    bar = tqdm(
        total=total,
        desc=desc,
        unit="step",
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5,
        position=position,
        leave=True,
    )
    try:
        yield bar
    finally:
        bar.close()


#: the columns of the CSV file beside the JSON lines: a row per step and per evaluation (``step``: the steps done)
CSV_COLUMNS = (
    "time",
    "event",
    "step",
    "epoch",
    "loss",
    "staleness",
    "weights_seconds",
    "compute_seconds",
    "exchange_seconds",
    "train_loss",
    "test_loss",
    "test_accuracy",
    "test_r2",
)


class MetricsLog:
    """Append one JSON object per line: ``{"time", "role", "event", ...}``; the steps and evaluations as CSV rows in
    a file of the same name ending in ``.csv`` (:data:`CSV_COLUMNS`); and the same run's curves as TensorBoard event
    files in ``tensorboard/ROLE`` (:class:`Board`: ``tensorboard --logdir RUN`` shows them).  The CSV and
    TensorBoard files go into ``folder``, the run's own (default: the JSON lines' folder).

    With ``path=None`` it writes nothing, so callers need no branches.  Values
    that JSON cannot hold (NaN, inf) are written as null.  Lines from several
    threads (an evaluation beside training) are written whole.
    """

    def __init__(self, path: str | os.PathLike | None, role: str, folder: str | os.PathLike | None = None):
        self.role = role
        self._file = None
        self._board: Board | None = None
        self._lock = threading.Lock()
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            folder = os.path.dirname(os.path.abspath(path)) if folder is None else os.fspath(folder)
            os.makedirs(folder, exist_ok=True)
            self._file = open_own(path, "a", encoding="utf-8", buffering=1)
            table = os.path.join(folder, os.path.splitext(os.path.basename(path))[0] + ".csv")
            try:
                self._csv_file = open_own(table, "a", encoding="utf-8", newline="", buffering=1)
            except BaseException:
                self._file.close()
                raise
            self._csv = csv.writer(self._csv_file)
            if os.fstat(self._csv_file.fileno()).st_size == 0:
                self._csv.writerow(CSV_COLUMNS)
            self._board = Board(os.path.join(folder, "tensorboard", role.replace(":", "-")))

    def write(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"time": round(time.time(), 3), "role": self.role, "event": event}
        record.update({k: _jsonable(v) for k, v in fields.items()})
        line = json.dumps(record) + "\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)
                self._board.add(event, record)
                if event in ("step", "eval"):
                    self._csv.writerow(_row(event, record))

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
                self._csv_file.close()
                self._board.close()


def first_values(path: str | os.PathLike, role: str, wanted: Mapping[str, str]) -> dict[str, float]:
    """The first number ``role`` wrote under each ``event: key`` of ``wanted`` in the metrics lines at ``path``:
    a resumed run's, from its earlier part (its lines are appended to the same file); read until each is found.
    A line that is no such record is skipped; a file that is not there, or not a regular file, holds none."""
    found: dict[str, float] = {}
    try:
        f = open_regular(path)
    except InputError:
        return found
    with f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by a kill
                continue
            if not isinstance(record, dict) or record.get("role") != role:
                continue
            event = record.get("event")
            value = record.get(wanted.get(event, "")) if event not in found else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                found[event] = float(value)
                if len(found) == len(wanted):
                    break
    return found


def steps_done(record: dict) -> int:
    """The steps done at a ``step`` line (its clock counts from 0) or an ``eval`` line (it says them): the x axis of
    every curve drawn from the metrics lines."""
    return record.get("clock", 0) + 1 if record.get("event") == "step" else record.get("step", 0)


def _row(event: str, record: dict) -> list:
    """A step's or an evaluation's row of the CSV file (:data:`CSV_COLUMNS`); a value it does not have is empty."""
    seconds = record.get("seconds") or {}
    values = {**record, "step": steps_done(record), **{f"{k}_seconds": v for k, v in seconds.items()}}
    return ["" if values.get(c) is None else values[c] for c in CSV_COLUMNS]


class Board:
    """A run's curves as TensorBoard event files in ``folder`` (tensorboardX's writer: TensorBoard's format, with
    neither PyTorch nor TensorFlow): every evaluation (``eval/``: test accuracy and loss, training loss), and a step's
    loss, staleness and where its time went (``train/``, ``seconds/``) at most every :data:`STEP_SECONDS`, so that
    writing them costs a fast trainer nothing it would notice.  The x axis is the steps done."""

    #: the shortest time between two steps written (a writer's scalar costs about 60 µs)
    STEP_SECONDS = 0.1

    def __init__(self, folder: str):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(folder, flush_secs=5)
        self._last = -math.inf

    def add(self, event: str, record: dict) -> None:
        if event == "step":
            now = time.monotonic()
            if now - self._last < self.STEP_SECONDS:
                return
            self._last = now
            scalars = {
                "train/loss": record.get("loss"),
                "train/staleness": record.get("staleness"),
                **{f"seconds/{k}": v for k, v in (record.get("seconds") or {}).items()},
            }
        elif event == "eval":
            scalars = {f"eval/{k}": record.get(k) for k in ("test_accuracy", "test_r2", "test_loss", "train_loss")}
        else:
            return
        for tag, value in scalars.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(tag, value, steps_done(record), walltime=record["time"])

    def close(self) -> None:
        self.writer.close()


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return _jsonable(value.item())
    return value
