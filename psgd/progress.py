"""Progress bars and the JSONL metrics log shared by every trainer."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
from typing import Any, Iterator

from tqdm import tqdm


@contextlib.contextmanager
def progress_bar(total: int, desc: str, *, enabled: bool = True, position: int | None = None) -> Iterator[tqdm]:
    """A tqdm bar on stderr (a silent one when ``enabled`` is false)."""
    bar = tqdm(total=total, desc=desc, unit="step", disable=not enabled, file=sys.stderr,
               dynamic_ncols=True, mininterval=0.5, position=position, leave=True)
    try:
        yield bar
    finally:
        bar.close()


class MetricsLog:
    """Append one JSON object per line: ``{"time", "role", "event", ...}``.

    With ``path=None`` it writes nothing, so callers need no branches.  Values
    that JSON cannot hold (NaN, inf) are written as null.  Lines from several
    threads (an evaluation beside training) are written whole.
    """

    def __init__(self, path: str | os.PathLike | None, role: str):
        self.role = role
        self._file = None
        self._lock = threading.Lock()
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8", buffering=1)

    def write(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"time": round(time.time(), 3), "role": self.role, "event": event}
        record.update({k: _jsonable(v) for k, v in fields.items()})
        line = json.dumps(record) + "\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return _jsonable(value.item())
    return value
