"""Passes over memory, in pieces that stay in a core's cache, spread over threads: a shard's and a worker's.

A gradient through shared memory is copied into a buffer of the shard's own (so that what is checked is what is
applied) and checked (no NaN, no infinity, nothing too large to apply: its largest magnitude).  Made one after the
other over the whole array, the copy and the check read and write three times the gradient's bytes from memory;
made piece by piece (:meth:`Sweep.copy_checked`), a piece of PIECE_BYTES stays in the cache from one pass to the
next: the check reads what the copy has just written.  The shard's update pass runs its optimizer piece by piece
the same way (:mod:`psgd.server.state.update`).

A worker's copies into and out of a segment (:mod:`psgd.link.shm`) are one pass each, over all of its views at once.

The pieces of a large array are spread over a pool of threads (NumPy lets go of the GIL inside a copy, a reduction
or an arithmetic loop), each thread taking one run of them, the calling thread the first; a small array is swept on
the calling thread alone, where a thread's wake-up would cost more than the pass.  Elementwise work gives the same
bits in any piece order: the same operations on the same values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from psgd.compute.threads import available_cores

#: the bytes of one piece: what one pass leaves in the cache for the next (4 MiB: the fastest of 0.25-16 MiB for the
#: copy-and-check and SGD on a 16-core Xeon, level with 1 MiB on 2 EPYC cores; benchmarks/results/step/)
PIECE_BYTES = 4 << 20
#: below this many bytes an array is swept on the calling thread
PARALLEL_BYTES = 8 << 20
#: the most threads a sweep uses: memory bandwidth, not cores, bounds a pass (84 MB on a 16-core Xeon: 12 threads
#: copied and checked it in 2.8 ms and swept SGD over it in 3.7, 8 threads in 3.8 and 4.8, 16 in 3.2 and 4.4)
MAX_THREADS = 12


class Sweep:
    """Runs a piece function over arrays of up to ``nbytes`` bytes: on ``threads`` threads (default: this
    machine's cores, at most MAX_THREADS) where the array holds PARALLEL_BYTES or more, else inline."""

    def __init__(self, nbytes: int, name: str, threads: int | None = None):
        threads = min(MAX_THREADS, available_cores()) if threads is None else threads
        self.threads = threads if threads > 1 and nbytes >= PARALLEL_BYTES else 1
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=name) if self.threads > 1 else None

    def run(self, size: int, itemsize: int, fn: Callable[[int, int], object]) -> None:
        """``fn(a, b)`` for consecutive pieces ``[a, b)`` covering ``range(size)`` (elements of ``itemsize``
        bytes), every piece once; returns when all are done (the first error raised, after that)."""
        step = max(1, PIECE_BYTES // itemsize)
        if self._pool is None or size * itemsize < PARALLEL_BYTES:
            for a in range(0, size, step):
                fn(a, min(size, a + step))
            return
        per = -(-size // self.threads // step) * step  # each thread's run: whole pieces

        def run_of(lo: int) -> None:
            hi = min(size, lo + per)
            for a in range(lo, hi, step):
                fn(a, min(hi, a + step))

        self._spread([lambda lo=lo: run_of(lo) for lo in range(0, size, per)])

    def _spread(self, runs: list[Callable[[], object]]) -> None:
        """Each of ``runs``: the first on this thread, the others on the pool; returns once all are done."""
        others = [self._pool.submit(run) for run in runs[1:]]
        try:
            runs[0]()
        finally:
            for other in others:
                other.result()

    def copy(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Copy each ``(dst, src)`` of ``pairs`` (byte arrays, each pair of one length) as one pass over all of
        them, spread over the threads where they hold PARALLEL_BYTES or more."""
        total = sum(d.size for d, _ in pairs)
        if self._pool is None or total < PARALLEL_BYTES:
            for d, s in pairs:
                np.copyto(d, s)
            return
        per = -(-total // self.threads)
        runs: list[list] = [[] for _ in range(self.threads)]
        at = 0
        for d, s in pairs:  # cut into one run of about ``per`` bytes a thread, across the pairs
            lo = 0
            while lo < d.size:
                k = at // per
                take = min(d.size - lo, (k + 1) * per - at)
                runs[k].append((d[lo : lo + take], s[lo : lo + take]))
                lo, at = lo + take, at + take
        self._spread([lambda run=run: [np.copyto(d, s) for d, s in run] for run in runs if run])

    def map(self, fn: Callable, items) -> list:
        """``fn`` of each item (a slice id, say), on the pool where there is one."""
        if self._pool is None:
            return [fn(i) for i in items]
        return list(self._pool.map(fn, items))

    def largest(self, a: np.ndarray) -> float:
        """The largest magnitude in the float array ``a``: NaN where it holds one, infinity where an infinity."""
        found: list[float] = []
        self.run(a.size, a.itemsize, lambda lo, hi: found.append(extent(a[lo:hi])))
        return _combined(found)

    def copy_checked(self, dst: np.ndarray, src: np.ndarray) -> float:
        """Copy ``src`` into ``dst`` (float arrays of one size) and return the largest magnitude copied (NaN or
        infinity where one was): each piece measured where the copy left it, in the cache."""
        found: list[float] = []

        def piece(a: int, b: int) -> None:
            np.copyto(dst[a:b], src[a:b])
            found.append(extent(dst[a:b]))

        self.run(dst.size, dst.itemsize, piece)
        return _combined(found)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def extent(a: np.ndarray) -> float:
    """The largest magnitude in the float array ``a`` from its largest and smallest values: NaN where it holds one
    (a NaN makes both NaN), infinity where an infinity; 0 for an empty array."""
    if a.size == 0:
        return 0.0
    high, low = float(np.maximum.reduce(a)), float(np.minimum.reduce(a))
    if high != high or low != low:
        return float("nan")
    return max(abs(high), abs(low))


def all_finite(a: np.ndarray) -> bool:
    """Whether the float array ``a`` holds no NaN and no infinity (exact, and faster than a sum, whose overflow
    would need a count after it)."""
    return math.isfinite(extent(a))


def _combined(extents: list[float]) -> float:
    if any(e != e for e in extents):
        return float("nan")
    return max(extents, default=0.0)
