"""A shard's weights: one flat array in slice order, the reads pulls are served from, updates in place.

The weights of all of a shard's slices live in one contiguous array
(``flat``), in slice-id order, which is also the order slices travel in on
every link.  A pull reads them in one of two ways:

- a :class:`Snapshot`, a copy of one version shared by every pull of that
  version and refreshed only when the version changed (for readers that send
  slowly, piece by piece);
- a :class:`LiveRead` of ``flat`` itself, no copy, for the data port's readers (a socket, or a worker
  copying out of shared memory).

A live read never holds the weights back.  The store keeps the weights in two places ("slots" of
one array each, the second made when first needed): ``flat`` is the current one.  An update finds
the current slot either unread, and updates it in place, or read; then it waits for those reads at
most ``patience`` (the time a read of the weights takes at 1 GB/s, plus 50 ms), and if they are
still going it copies the weights into the other slot, updates them there and makes that one current.
The reads in flight keep their version, whole, for as long as they take: a stopped or slow reader
delays no update, and a fast one is waited for rather than copied around.  Only when both slots are
being read past patience does an update wait longer, for the first of them to be released or to pass
its hold (the deadline its transport set, see :mod:`psgd.server.net.datapath`); the reads past their hold
are then revoked (``on_revoke`` closes their connection) and their slot is taken.  Each slot has a
sequence number (``seq``), odd while it is written: a reader that copies out of shared memory checks it
after its copy, so a revoked read finds out that its copy is torn and pulls again.  New reads defer to
a waiting update, so a stream of reads cannot starve one.

Every method runs under the shard's lock; ``changed`` is the condition on
that lock that the shard core waits on.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from psgd.optim import WHOLE, Optimizer, Share
from psgd.partition import Slice
from psgd.server.errors import ShardError
from psgd.server.state.update import UpdatePass
from psgd.wire.sweep import Sweep, extent

log = logging.getLogger(__name__)

#: the places the weights are kept in: the current one, and the one the reads of the version before may be using
SLOTS = 2
#: how long an update waits for the reads of the current slot before it copies the weights elsewhere: PATIENCE
#: seconds and one second per PATIENCE_RATE bytes of weights (a read at 1 GB/s)
PATIENCE = 0.05
PATIENCE_RATE = 1e9


class Snapshot:
    """The weights of one version, as one contiguous buffer shared by every pull of that version.

    Unpacks as ``(version, data)`` with ``data`` mapping slice id to a
    memoryview.  Call :meth:`release` (or use it as a context manager) when
    the bytes have been sent, so the buffer can be reused.
    """

    def __init__(self, version: int, buffer: bytearray, views: dict[int, memoryview], owner: WeightStore):
        self.version, self.buffer, self.data = version, buffer, views
        self.refs, self._owner = 0, owner

    def release(self) -> None:
        self._owner._release_snapshot(self)

    def __iter__(self):
        return iter((self.version, self.data))

    def __getitem__(self, index: int):
        return (self.version, self.data)[index]

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class LiveRead:
    """The weights of one version, read where they are kept (``buffer``: slot ``slot``, whose sequence number
    was ``seq``), valid until :meth:`release`, or until ``hold_until`` (monotonic) has passed and an update
    needs the slot: then the read is revoked (``on_revoke`` is called, ``revoked`` set)."""

    def __init__(
        self,
        version: int,
        worker: int | None,
        slot: int,
        seq: int,
        buffer: memoryview,
        owner: WeightStore,
        hold_until: float,
        on_revoke: Callable[[], None],
    ):
        self.version, self.worker, self.slot, self.seq, self.buffer = version, worker, slot, seq, buffer
        self.hold_until, self.on_revoke, self.began = hold_until, on_revoke, time.monotonic()
        self._owner, self._done, self.revoked = owner, False, False

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._owner._release_live(self)

    def __enter__(self) -> LiveRead:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class WeightStore:
    """The weights of ``slices`` (initialized from ``values``) and their reads; see the module docstring."""

    def __init__(
        self,
        slices: Mapping[int, Slice],
        values: Mapping[int, np.ndarray],
        dtype: str,
        changed: threading.Condition,
        shard: int,
        apply_threads: int | None = None,
    ):
        if set(values) != set(slices):
            raise ValueError("initial values must cover exactly this shard's slices")
        self.slices, self.dtype, self.changed, self.shard = slices, dtype, changed, shard
        self.order = sorted(slices)
        self.offsets, total = {}, 0
        for i in self.order:
            self.offsets[i] = (total, total + slices[i].size)
            total += slices[i].size
        self.nbytes = total * np.dtype(dtype).itemsize
        self.patience = PATIENCE + self.nbytes / PATIENCE_RATE
        self._slots: list[np.ndarray | None] = [np.empty(total, dtype=dtype)] + [None] * (SLOTS - 1)
        self.seq = np.zeros(SLOTS, dtype=np.uint64)
        self.current = 0
        self._use(0)
        for i in self.order:
            self.weights[i][...] = np.asarray(values[i], dtype=dtype).reshape(-1)
        #: the passes over the weights (copy, check, update), in cache-sized pieces over threads
        self.sweep = Sweep(self.nbytes, f"shard{shard}-sweep", apply_threads)
        self.update_pass = UpdatePass(slices, self.offsets, self.sweep)
        #: the largest gradient value applied: a 16th of the square root of the dtype's largest (1.15e18 in float32)
        self.max_gradient = float(np.sqrt(np.finfo(dtype).max)) / 16
        self._snapshot: Snapshot | None = None
        self._spare: bytearray | None = None
        self._reads: list[list[LiveRead]] = [[] for _ in range(SLOTS)]  # live reads of each slot
        self.writers_waiting = 0  # updates waiting for reads to finish (new reads defer to them)
        self.settling = 0  # readers of the whole state waiting for those updates (new updates defer to them)
        #: updates made in the other slot since the current one was being read; reads revoked past their hold; the
        #: seconds updates took (their wait for reads included)
        self.counters = {"copied_updates": 0, "revoked_reads": 0, "apply_seconds": 0.0}

    def _use(self, slot: int) -> None:
        self.current, self.flat = slot, self._slots[slot]
        self.weights = self.views(self.flat)

    def rehome(self, slots: list[np.ndarray], seq: np.ndarray) -> None:
        """Keep the weights in ``slots`` (arrays laid out like ``flat``, as many as SLOTS) from now on, with
        their sequence numbers in ``seq``: the shard moves them into shared memory this way, before any read."""
        if any(self._reads) or len(slots) != SLOTS:
            raise RuntimeError("weights can move only while nothing reads them, into SLOTS places")
        np.copyto(slots[0], self.flat)
        seq[:] = 0
        self._slots, self.seq = list(slots), seq
        self._use(0)

    def views(self, flat: np.ndarray) -> SliceViews:
        """Per-slice views of an array laid out like ``flat``."""
        return SliceViews(flat, {i: flat[a:b] for i, (a, b) in self.offsets.items()})

    def gradient_views(self, buf: bytearray | memoryview) -> dict[int, np.ndarray]:
        """Per-slice arrays over a buffer holding a gradient for every slice, in slice order."""
        return self.views(np.frombuffer(buf, dtype=self.dtype, count=self.flat.size))

    def check(
        self, grads: Mapping[int, np.ndarray], who: str, largest: float | None = None, allow_nonfinite: bool = False
    ) -> None:
        """Refuse (INVALID_ARGUMENT) ``who``'s gradient ``grads`` unless it holds every slice of the store and may be
        applied (:meth:`unfit`; anything may where ``allow_nonfinite``): before the policy counts the push, so that
        it is refused whole, the weights as they were."""
        if set(grads) != set(self.slices):
            raise ShardError("INVALID_ARGUMENT", "a push must carry a gradient for every slice of the shard")
        unfit = None if allow_nonfinite else self.unfit(grads, largest)
        if unfit is not None:
            raise ShardError(
                "INVALID_ARGUMENT",
                f"gradient for {self.slices[unfit[0]].key} from {who} {unfit[1]}; "
                "lower the learning rate or check the data",
            )

    def unfit(self, grads: Mapping[int, np.ndarray], largest: float | None = None) -> tuple[int, str] | None:
        """Why the gradient ``grads`` may not be applied, as (a slice id, what it holds), or None: a NaN or an
        infinity, or a value beyond :attr:`max_gradient`, which no update rule keeps finite for long (Adam squares
        it; SGD's weights would grow without bound).  ``largest``: its largest magnitude, where the receive measured
        it; else measured here, in one pass."""
        whole = getattr(grads, "flat", None)
        if largest is None and whole is not None:
            largest = self.sweep.largest(whole)
        if largest is not None and largest <= self.max_gradient:
            return None
        extents = dict(zip(grads, self.sweep.map(lambda i: extent(grads[i]), grads)))  # slice by slice: which
        for i, e in extents.items():
            if not math.isfinite(e):
                return i, f"has {_nonfinite(grads[i])} non-finite value(s) (NaN/Inf)"
        for i, e in extents.items():
            if e > self.max_gradient:
                return i, (
                    f"has values up to {e:.3g}, beyond the {self.max_gradient:.3g} a {self.dtype} gradient may "
                    "hold: no update rule keeps the weights finite under it"
                )
        return None

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
            parts = {i: view[a * item : b * item] for i, (a, b) in self.offsets.items()}
            snap = self._snapshot = Snapshot(version, buf, parts, self)
        snap.refs += 1
        return snap

    def _release_snapshot(self, snap: Snapshot) -> None:
        with self.changed:
            snap.refs -= 1
            if snap.refs == 0 and snap is not self._snapshot and self._spare is None:
                self._spare = snap.buffer

    def live(
        self,
        version: int,
        worker: int | None = None,
        hold: float = float("inf"),
        on_revoke: Callable[[], None] = lambda: None,
    ) -> LiveRead:
        """A read of the current weights, no copy; see the module docstring for how long it may last."""
        read = LiveRead(
            version,
            worker,
            self.current,
            int(self.seq[self.current]),
            memoryview(self.flat).cast("B"),
            self,
            time.monotonic() + hold,
            on_revoke,
        )
        self._reads[self.current].append(read)
        return read

    def _release_live(self, read: LiveRead) -> None:
        with self.changed:
            if read in self._reads[read.slot]:
                self._reads[read.slot].remove(read)
                if self.writers_waiting:  # only an update waits for a read to end
                    self.changed.notify_all()

    def reads(self) -> list[dict]:
        """The live reads now, oldest first: whose, of which version, held how long."""
        now = time.monotonic()
        return [
            {"worker": r.worker, "version": r.version, "held_seconds": round(now - r.began, 3)}
            for r in sorted((r for slot in self._reads for r in slot), key=lambda r: r.began)
        ]

    # -- updates -----------------------------------------------------------------------------------
    def apply(
        self, optimizer: Optimizer, grads: Mapping[int, np.ndarray], lr_scale: float, share: Share = WHOLE
    ) -> None:
        """Update the weights with ``optimizer`` (:mod:`psgd.server.state.update`): in place where nothing reads them,
        else in the other slot."""
        began = time.perf_counter()
        with self._writing(keep=True):
            self.update_pass.apply(optimizer, self.flat, self.weights, grads, lr_scale, share)
        self.counters["apply_seconds"] += time.perf_counter() - began

    def replace(self, values: np.ndarray) -> None:
        """Make ``values`` (all slices, in slice order: a checkpoint's weights) the weights, written where an
        update would be, so that no read in flight sees them change."""
        with self._writing(keep=False):
            np.copyto(self.flat, values)

    @contextlib.contextmanager
    def _writing(self, keep: bool) -> Iterator[None]:
        """The weights made writable for the block: the slot an update goes to becomes the current one (with the
        weights copied into it first where ``keep``), its sequence number odd while it is written."""
        slot = self._slot_for_update()
        self.seq[slot] += 1  # odd: being written
        try:
            if slot != self.current:
                if self._slots[slot] is None:
                    self._slots[slot] = np.empty_like(self.flat)
                if keep:
                    target, source = self._slots[slot], self.flat
                    self.sweep.run(source.size, source.itemsize, lambda a, b: np.copyto(target[a:b], source[a:b]))
                    self.counters["copied_updates"] += 1
                self._use(slot)
            yield
        finally:
            self.seq[slot] += 1  # even: whole

    def _slot_for_update(self) -> int:
        """The slot the next update is made in: the current one once it is unread; after ``patience``, the
        other one once it is unread; past their hold, a slot's reads are revoked.  Waits (letting go of the
        shard's lock) only while both are read."""
        if not self._reads[self.current]:
            return self.current
        patience_over = time.monotonic() + self.patience
        self.writers_waiting += 1
        try:
            while True:
                now, cur = time.monotonic(), self.current
                other = (cur + 1) % SLOTS
                if not self._reads[cur]:
                    return cur
                if now >= patience_over:
                    if not self._reads[other]:
                        return other
                    for slot in (other, cur):
                        if all(r.hold_until <= now for r in self._reads[slot]):
                            self._revoke(slot, now)
                            return slot
                    wake = min(max(r.hold_until for r in self._reads[s]) for s in (other, cur))
                else:
                    wake = patience_over
                self.changed.wait(min(max(wake - now, 0.001), 1.0))
        finally:
            self.writers_waiting -= 1

    # -- the whole state, read -------------------------------------------------------------------
    def settle(self) -> None:
        """Wait until no update is half made: decided by the shard's policy (which counts the push) but not yet
        written, because it waits here for reads (letting go of the lock).  What is read of the shard after this,
        before the lock is let go (its state for a checkpoint or a new replica, its policy for the replica), holds
        every update whole or not at all.  New updates wait meanwhile (:meth:`after_settling`), so a stream of them
        cannot hold this back: the ones in flight end within their own bound (patience, then the reads' hold)."""
        self.settling += 1
        try:
            report = time.monotonic() + 10.0
            while self.writers_waiting:
                self.changed.wait(1.0)
                if time.monotonic() > report:  # a long wait says what it waits for
                    report = time.monotonic() + 10.0
                    log.warning(
                        "shard %d: reading its state waits for %d update(s) held by reads of the weights: %s",
                        self.shard,
                        self.writers_waiting,
                        self.reads(),
                    )
        finally:
            self.settling -= 1
            self.changed.notify_all()

    def before_reading(self, deadline: float) -> bool:
        """What a pull does before it reads: let an update that is due go first (never send half-applied weights),
        until ``deadline`` (time.monotonic()); False where that passed first."""
        while self.writers_waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.changed.wait(min(left, 0.5))
        return True

    def after_settling(self) -> None:
        """What a new update does before its policy decides: let a reader of the whole state go first."""
        while self.settling:
            self.changed.wait(1.0)

    def _revoke(self, slot: int, now: float) -> None:
        for read in self._reads[slot]:
            read.revoked = True
            self.counters["revoked_reads"] += 1
            log.warning(
                "shard %d: a pull of version %d by worker %s was still being read after %.1fs, past its "
                "deadline: its connection is closed (it pulls again) and an update takes its memory",
                self.shard,
                read.version,
                "?" if read.worker is None else read.worker,
                now - read.began,
            )
            try:
                read.on_revoke()
            except OSError:
                pass
        self._reads[slot] = []


class SliceViews(dict):
    """Views of each slice (by slice id) of one array laid out like the weights, which ``flat`` is: what is done to
    every slice may be done to it once."""

    def __init__(self, flat: np.ndarray, views: dict[int, np.ndarray]):
        super().__init__(views)
        self.flat = flat


def _nonfinite(g: np.ndarray) -> int:
    return int(g.size - np.count_nonzero(np.isfinite(g)))
