"""The collective interface the all-reduce trainer needs, and gradient bucketing.

Backends wrap an existing engine (NCCL through CuPy, MPI through mpi4py); psgd
never hand-writes a ring.  Every operation works in place on an ``xp`` array.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from psgd.errors import ClusterError

OPS = ("sum", "max", "min")


class CollectiveError(ClusterError):
    """A collective operation failed: a rank died, timed out, or the ranks disagree."""


class BackendUnavailable(CollectiveError):
    """The backend's engine is not installed here; the message says what to install."""


class Collective(abc.ABC):
    """One rank's handle on a group of ``world_size`` processes."""

    backend: str = "?"
    rank: int
    world_size: int
    #: Largest piece a long buffer is reduced in by :class:`Bucketer` (0: the whole buffer at once).
    chunk_bytes: int = 0

    @abc.abstractmethod
    def allreduce_(self, array: Any, op: str = "sum") -> Any:
        """Reduce ``array`` over all ranks, in place, and return it (``op``: sum, max, min)."""

    #: whether :meth:`queued` works: all-reduces left queued on the current CUDA stream, not waited for
    queues: bool = False

    @contextlib.contextmanager
    def queued(self) -> Iterator[None]:
        """Inside, :meth:`allreduce_` only queues its work on the calling thread's current stream and returns;
        :meth:`wait_queued` waits for it (only where :attr:`queues`)."""
        raise CollectiveError(f"the {self.backend} backend cannot leave an all-reduce queued")

    def wait_queued(self, what: str) -> None:
        """Wait for the work queued on the calling thread's current stream (``what``: for the error message)."""

    @abc.abstractmethod
    def broadcast_(self, array: Any, root: int = 0) -> Any:
        """Overwrite ``array`` on every rank with ``root``'s, in place, and return it."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every rank has called it."""

    def close(self) -> None:
        """Release the backend's resources (idempotent)."""

    def check_agreement(self, text: str, what: str) -> None:
        """Fail on every rank unless all ranks passed the same ``text`` (e.g. a plan hash)."""
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
        both = self._host_allreduce(np.array([digest, -digest], dtype=np.int64), op="max")
        if both[0] != digest or -both[1] != digest:
            raise CollectiveError(
                f"rank {self.rank}: the {self.world_size} ranks disagree on {what}; "
                "start every rank from the same job file"
            )

    def _host_allreduce(self, array: np.ndarray, op: str) -> np.ndarray:
        """All-reduce a small host array (backends that reduce device arrays only stage it)."""
        return self.allreduce_(array, op=op)

    def gather_rows(self, ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's ``ids`` and ``values`` (rows of a table's gradient: ``[len(ids), dim]``, host arrays), in
        rank order, on every rank.  Made of all-reduces: each rank's part written at its place in a buffer of
        zeros the size of all of them, which sums to the gathered rows (about twice the bytes of an all-gather;
        every backend has an all-reduce; the MPI backend all-gathers instead)."""
        counts = np.zeros(self.world_size, np.int64)
        counts[self.rank] = ids.size
        counts = self._host_allreduce(counts, op="sum")
        start = int(counts[: self.rank].sum())
        total = int(counts.sum())
        all_ids = np.zeros(total, np.int64)
        all_ids[start : start + ids.size] = ids
        all_values = np.zeros((total,) + values.shape[1:], values.dtype)
        all_values[start : start + ids.size] = values
        return self._host_allreduce(all_ids, op="sum"), self._host_allreduce(all_values, op="sum")

    def __enter__(self) -> Collective:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Bucketer:
    """Packs small gradients into a few large flat buffers, all-reduces those, unpacks.

    Few large all-reduces are much faster than many small ones.  Buckets are
    allocated once (on the gradients' device) and reused every step; the
    unpacked gradients are views into them.  A gradient of ``direct_bytes``
    or more is reduced in place in its own array, with no packing copy (the
    trainer owns the arrays a model returns, so it may overwrite them).
    Where the backend asks for it (``chunk_bytes``), long buffers are reduced
    in pieces, each scaled to the mean while it is still in cache.
    """

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]],
        dtype: Any,
        xp: Any,
        bucket_bytes: int = 32 << 20,
        direct_bytes: int = 4 << 20,
    ):
        self.xp, self.dtype = xp, np.dtype(dtype)
        self.direct = {
            name: tuple(shape)
            for name, shape in shapes.items()
            if int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize >= direct_bytes
        }
        self.layout: list[list[tuple[str, int, int, tuple[int, ...]]]] = [[]]
        used = 0
        limit = max(1, bucket_bytes // self.dtype.itemsize)
        for name, shape in shapes.items():
            if name in self.direct:
                continue
            size = int(np.prod(shape, dtype=np.int64))
            if used and used + size > limit:
                self.layout.append([])
                used = 0
            self.layout[-1].append((name, used, used + size, tuple(shape)))
            used += size
        self.layout = [bucket for bucket in self.layout if bucket]
        self.buffers = [xp.empty(bucket[-1][2], dtype=self.dtype) for bucket in self.layout]

    def _direct(self, g: Any) -> Any:
        """A large gradient as the array to reduce in place: itself, or a contiguous copy of it."""
        # CuPy arrays have no ``writeable`` flag: they always are
        if not (g.flags.c_contiguous and getattr(g.flags, "writeable", True) and g.dtype == self.dtype):
            g = self.xp.ascontiguousarray(g, dtype=self.dtype).copy()
        return g

    def allreduce_mean(self, collective: Collective, grads: Mapping[str, Any]) -> dict[str, Any]:
        """The mean of ``grads`` over all ranks (views into the reused buckets, or the arrays themselves)."""
        out = {}
        scale = 1.0 / collective.world_size
        for name in self.direct:
            g = self._direct(grads[name])
            _sum_then_scale(collective, g.reshape(-1), scale)
            out[name] = g
        for bucket, buf in zip(self.layout, self.buffers):
            for name, start, stop, _ in bucket:
                buf[start:stop] = grads[name].reshape(-1)
            _sum_then_scale(collective, buf, scale)
            for name, start, stop, shape in bucket:
                out[name] = buf[start:stop].reshape(shape)
        return out

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.buffers)

    def round(self, collective: Collective, submit: Callable[..., Future]) -> BucketRound:
        """One step's reduction with each bucket started (through ``submit``, e.g. a one-thread executor's)
        as soon as its gradients are in, while backward goes on."""
        return BucketRound(self, collective, submit)


class BucketRound:
    """One step of :class:`Bucketer` fed gradient by gradient (overlap): a large gradient is reduced as it
    arrives, a bucket once all of its gradients are in, each through ``submit``; :meth:`finish` adds what
    never came, waits, and returns what :meth:`Bucketer.allreduce_mean` would.

    The same buckets are reduced as without overlap, each as one sum, so the mean is the same to the bit.
    Every rank must hand the gradients over in the same order (the same model does), since the reductions
    are collective calls made in the order they are submitted.  At most one reduction per bucket and per
    large gradient is in flight: the buffers are the bucketer's own, made once.
    """

    def __init__(self, bucketer: Bucketer, collective: Collective, submit: Callable[..., Future]):
        self.b, self.collective, self.submit = bucketer, collective, submit
        self.scale = 1.0 / collective.world_size
        self.missing = [{name for name, *_ in bucket} for bucket in bucketer.layout]
        self.where = {
            name: (i, start, stop) for i, bucket in enumerate(bucketer.layout) for name, start, stop, _ in bucket
        }
        self.out: dict[str, Any] = {}
        self.pending: list[Future] = []

    def add(self, name: str, grad: Any) -> None:
        """Variable ``name``'s gradient is ready: copy it into its bucket (or take it), start what is complete."""
        if name in self.out or (name in self.where and name not in self.missing[self.where[name][0]]):
            return  # handed over twice: the first one counts
        if name in self.b.direct:
            g = self.b._direct(grad)
            self.out[name] = g
            self.pending.append(self.submit(_sum_then_scale, self.collective, g.reshape(-1), self.scale))
            return
        i, start, stop = self.where[name]
        self.b.buffers[i][start:stop] = grad.reshape(-1)
        self.missing[i].discard(name)
        if not self.missing[i]:
            self.pending.append(self.submit(_sum_then_scale, self.collective, self.b.buffers[i], self.scale))

    def finish(self, grads: Mapping[str, Any]) -> dict[str, Any]:
        """Add the gradients of ``grads`` not handed over yet, wait for every reduction (its error is raised
        here, in the step that owns it) and return the mean by variable."""
        for name in self.b.direct:
            if name not in self.out:
                self.add(name, grads[name])
        for i, bucket in enumerate(self.b.layout):
            for name, *_ in bucket:
                if name in self.missing[i]:
                    self.add(name, grads[name])
        errors = []
        for future in self.pending:
            try:
                future.result()
            except BaseException as exc:  # wait for the rest before raising: no reduction outlives its step
                errors.append(exc)
        if errors:
            raise errors[0]
        for bucket, buf in zip(self.b.layout, self.b.buffers):
            for name, start, stop, shape in bucket:
                self.out[name] = buf[start:stop].reshape(shape)
        return self.out


def _sum_then_scale(collective: Collective, flat: Any, scale: float) -> None:
    """All-reduce (sum) the 1-D ``flat`` in place, in the backend's chunks, and scale it by ``scale``."""
    step = max(1, collective.chunk_bytes // flat.dtype.itemsize) if collective.chunk_bytes else max(1, flat.size)
    for start in range(0, flat.size, step):
        part = flat[start : start + step]
        collective.allreduce_(part, op="sum")
        part *= scale
