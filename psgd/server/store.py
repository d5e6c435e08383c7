"""A shard's weights: one flat array in slice order, the reads pulls are served from, updates in place.

The weights of all of a shard's slices live in one contiguous array
(``flat``), in slice-id order, which is also the order slices travel in on
every link.  A pull reads them in one of two ways:

- a :class:`Snapshot`, a copy of one version shared by every pull of that
  version and refreshed only when the version changed (for readers that send
  slowly, piece by piece);
- a :class:`LiveRead` of ``flat`` itself, no copy: an update waits until the
  read is released, and new reads defer to a waiting update.

Every method runs under the shard's lock; ``changed`` is the condition on
that lock that the shard core waits on.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Mapping

import numpy as np

from psgd.optim import WHOLE, Optimizer, Share
from psgd.partition import Slice

#: A shard holding at least this many bytes checks and updates its slices on several threads
#: (numpy releases the GIL for large arrays); smaller ones stay on one, where threads cost latency.
PARALLEL_BYTES = 8 << 20


class Snapshot:
    """The weights of one version, as one contiguous buffer shared by every pull of that version.

    Unpacks as ``(version, data)`` with ``data`` mapping slice id to a
    memoryview.  Call :meth:`release` (or use it as a context manager) when
    the bytes have been sent, so the buffer can be reused.
    """

    def __init__(self, version: int, buffer: bytearray, views: dict[int, memoryview], owner: "WeightStore"):
        self.version, self.buffer, self.data = version, buffer, views
        self.refs, self._owner = 0, owner

    def release(self) -> None:
        self._owner._release_snapshot(self)

    def __iter__(self):
        return iter((self.version, self.data))

    def __getitem__(self, index: int):
        return (self.version, self.data)[index]

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class LiveRead:
    """The live weights of one version as bytes (``buffer``), valid until :meth:`release`."""

    def __init__(self, version: int, buffer: memoryview, owner: "WeightStore"):
        self.version, self.buffer, self._owner, self._done = version, buffer, owner, False

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._owner._release_live()

    def __enter__(self) -> "LiveRead":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class WeightStore:
    """The weights of ``slices`` (initialized from ``values``) and their reads; see the module docstring."""

    def __init__(self, slices: Mapping[int, Slice], values: Mapping[int, np.ndarray], dtype: str,
                 changed: threading.Condition, shard: int, apply_threads: int | None = None):
        if set(values) != set(slices):
            raise ValueError("initial values must cover exactly this shard's slices")
        self.slices, self.dtype, self.changed = slices, dtype, changed
        self.order = sorted(slices)
        self.offsets, total = {}, 0
        for i in self.order:
            self.offsets[i] = (total, total + slices[i].size)
            total += slices[i].size
        self.nbytes = total * np.dtype(dtype).itemsize
        self.flat = np.empty(total, dtype=dtype)
        self.weights = self.views(self.flat)
        for i in self.order:
            self.weights[i][...] = np.asarray(values[i], dtype=dtype).reshape(-1)
        threads = min(4, os.cpu_count() or 1) if apply_threads is None else apply_threads
        self._threads = (ThreadPoolExecutor(threads, thread_name_prefix=f"shard{shard}-apply")
                         if threads > 1 and len(self.order) > 1 and self.nbytes >= PARALLEL_BYTES else None)
        self._snapshot: Snapshot | None = None
        self._spare: bytearray | None = None
        self._readers = 0          # live reads sending from ``flat`` right now
        self.writers_waiting = 0   # updates waiting for those reads to finish

    def rehome(self, flat: np.ndarray) -> None:
        """Hold the weights in ``flat`` from now on (laid out like ``flat``, holding its values already): the
        shard moves them into shared memory this way."""
        self.flat, self.weights = flat, self.views(flat)

    def map(self, fn: Callable[[int], object], ids: Iterable[int]) -> list:
        """``[fn(i) for i in ids]``, spread over the store's threads when it has them."""
        if self._threads is None:
            return [fn(i) for i in ids]
        return list(self._threads.map(fn, ids))

    def views(self, flat: np.ndarray) -> dict[int, np.ndarray]:
        """Per-slice views of an array laid out like ``flat``."""
        return {i: flat[a:b] for i, (a, b) in self.offsets.items()}

    def gradient_views(self, buf: bytearray | memoryview) -> dict[int, np.ndarray]:
        """Per-slice arrays over a buffer holding a gradient for every slice, in slice order."""
        return self.views(np.frombuffer(buf, dtype=self.dtype, count=self.flat.size))

    def nonfinite(self, grads: Mapping[int, np.ndarray]) -> dict[int, int]:
        """How many NaN/Inf values each slice's gradient holds, for the slices that hold any."""
        counts = self.map(lambda i: _nonfinite(grads[i]), grads)
        return {i: n for i, n in zip(grads, counts) if n}

    # -- reads --------------------------------------------------------------------------------------
    def snapshot(self, version: int) -> Snapshot:
        """The snapshot of ``version`` (the current weights), made or refreshed only when needed."""
        snap = self._snapshot
        if snap is None or snap.version != version:
            if snap is not None and snap.refs == 0:
                buf = snap.buffer  # nobody is sending from it: refresh in place
            elif self._spare is not None:
                buf, self._spare = self._spare, None
            else:
                buf = bytearray(self.nbytes)
            np.copyto(np.frombuffer(buf, dtype=self.dtype, count=self.flat.size), self.flat)
            view = memoryview(buf)
            item = np.dtype(self.dtype).itemsize
            parts = {i: view[a * item:b * item] for i, (a, b) in self.offsets.items()}
            snap = self._snapshot = Snapshot(version, buf, parts, self)
        snap.refs += 1
        return snap

    def _release_snapshot(self, snap: Snapshot) -> None:
        with self.changed:
            snap.refs -= 1
            if snap.refs == 0 and snap is not self._snapshot and self._spare is None:
                self._spare = snap.buffer

    def live(self, version: int) -> LiveRead:
        """A read of the live weights; updates wait until it is released."""
        self._readers += 1
        return LiveRead(version, memoryview(self.flat).cast("B"), self)

    def _release_live(self) -> None:
        with self.changed:
            self._readers -= 1
            self.changed.notify_all()

    # -- updates -----------------------------------------------------------------------------------
    def apply(self, optimizer: Optimizer, grads: Mapping[int, np.ndarray], lr_scale: float,
              share: Share = WHOLE) -> None:
        """Update the weights with ``optimizer``, once no live read is sending from them."""
        if self._readers:
            self.writers_waiting += 1
            try:
                self.changed.wait_for(lambda: self._readers == 0)
            finally:
                self.writers_waiting -= 1
        self.map(lambda i: optimizer.update(self.slices[i].key, self.weights[i], grads[i], lr_scale, share),
                 grads)


def _nonfinite(g: np.ndarray) -> int:
    if np.isfinite(np.add.reduce(g)):
        return 0  # a finite sum has no NaN or Inf in it; a sum that overflows is counted exactly below
    return int(g.size - np.count_nonzero(np.isfinite(g)))
