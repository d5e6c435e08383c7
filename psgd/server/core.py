"""A parameter-server shard without any transport: store + policy + optimizer.

The gRPC servicer is a thin adapter over :class:`ShardCore`; tests drive the
core directly.  Every failure is a :class:`ShardError` carrying the name of
the gRPC status code it maps to, and a message that says what to do.

Locking: one lock guards weights, policy and leases; pulls wait on a
condition variable until the policy lets them through, never longer than their
timeout.  Updates are applied under the lock, so a pull sees whole versions.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from psgd.job import differences as job_differences
from psgd.job import fingerprint as job_fingerprint
from psgd.optim import Optimizer
from psgd.server import checkpoint
from psgd.partition import PartitionPlan, Slice, plan_differences
from psgd.policy import Policy

log = logging.getLogger(__name__)

STALENESS_BUCKETS = 16  # histogram entries 0..14 exact, the last counts 15 and more
#: A shard holding at least this many bytes checks and updates its slices on several threads
#: (numpy releases the GIL for large arrays); smaller ones stay on one, where threads cost latency.
PARALLEL_BYTES = 8 << 20
MAX_CLOCK = 2**63 - 2  # the largest clock a push may carry: the next clock (clock + 1) must fit the wire's int64


class ShardError(Exception):
    """A request the shard refuses: ``code`` names a ``grpc.StatusCode``; ``reason`` names an
    ``ErrorInfo.Reason`` the client acts on ("" for none), with ``differences`` for JOB_MISMATCH."""

    def __init__(self, code: str, message: str, reason: str = "", differences: Iterable[str] = ()):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.differences = list(differences)


def _job_identity(text: str) -> dict:
    """The job identity a worker sent when it registered (a JSON object), or a refusal."""
    if not text:
        raise ShardError("INVALID_ARGUMENT", "the worker sent no job identity: start it with the same psgd "
                                             "version as the shards")
    try:
        job = json.loads(text)
    except (ValueError, RecursionError):
        job = None
    if not isinstance(job, dict):
        raise ShardError("INVALID_ARGUMENT", "the worker's job identity is not a JSON object")
    return job


@dataclasses.dataclass
class WorkerInfo:
    state: str = "pending"  # pending (expected, not yet registered), live, done, expired
    deadline: float = 0.0   # lease (or join) deadline, on the core's clock
    expired_at: float = 0.0  # when this shard dropped it (its clock), for "finished" to settle
    clock: int = 0
    hostname: str = ""
    pid: int = 0


@dataclasses.dataclass(frozen=True)
class PushResult:
    outcome: str  # applied, accumulated, duplicate, late
    next_clock: int
    version: int
    staleness: int


class PushAssembler:
    """Collects one push's chunks into complete, validated gradient arrays.

    Chunks of a slice must arrive in order and cover it exactly; the declared
    dtype must be the plan's.  Sizes come from the plan, never from the
    request, so a hostile push cannot make the shard allocate more than the
    slices it holds.
    """

    def __init__(self, slices: Mapping[int, Slice], dtype: str):
        self.slices = slices
        self.dtype = dtype
        self._buffers: dict[int, bytearray] = {}
        self._received: dict[int, int] = {}

    def check_dtype(self, dtype: str) -> None:
        if dtype != self.dtype:
            raise ShardError("INVALID_ARGUMENT", f"gradient dtype {dtype or '(none)'!r} does not match the "
                             f"model's {self.dtype!r}: worker and server must use the same dtype")

    def add(self, slice_id: int, offset: int, data: bytes) -> None:
        sl = self.slices.get(slice_id)
        if sl is None:
            raise ShardError("NOT_FOUND", f"slice {slice_id} is not held by this shard: "
                             "is the worker using the same partition plan?")
        got = self._received.get(slice_id, 0)
        if offset != got:
            raise ShardError("INVALID_ARGUMENT", f"slice {slice_id} ({sl.key}): chunk at byte {offset}, "
                             f"expected {got} (chunks must arrive in order, without gaps)")
        end = offset + len(data)
        if end > sl.nbytes:
            raise ShardError("INVALID_ARGUMENT", f"slice {slice_id} ({sl.key}) holds {sl.nbytes} bytes, "
                             f"the push sent {end} or more: wrong shape or dtype")
        buf = self._buffers.get(slice_id)
        if buf is None:
            buf = self._buffers[slice_id] = bytearray(sl.nbytes)
        buf[offset:end] = data
        self._received[slice_id] = end

    def finish(self) -> dict[int, np.ndarray]:
        missing = [f"{sl.key} ({self._received.get(i, 0)} of {sl.nbytes} bytes)"
                   for i, sl in self.slices.items() if self._received.get(i, 0) != sl.nbytes]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ShardError("INVALID_ARGUMENT", f"incomplete push: {', '.join(missing[:3])}{more}")
        return {i: np.frombuffer(buf, dtype=self.dtype) for i, buf in self._buffers.items()}


class Snapshot:
    """The weights of one version, as one contiguous buffer shared by every pull of that version.

    Unpacks as ``(version, data)`` with ``data`` mapping slice id to a
    memoryview.  Call :meth:`release` (or use it as a context manager) when
    the bytes have been sent, so the shard can reuse the buffer.
    """

    def __init__(self, version: int, buffer: bytearray, views: dict[int, memoryview], owner: "ShardCore"):
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


class LiveWeights:
    """A pull served straight from the shard's weights: ``buffer`` is valid until :meth:`release`."""

    def __init__(self, version: int, buffer: memoryview, owner: "ShardCore"):
        self.version, self.buffer, self._owner, self._done = version, buffer, owner, False

    def release(self) -> None:
        if not self._done:
            self._done = True
            with self._owner.lock:
                self._owner._readers -= 1
                self._owner.changed.notify_all()

    def __enter__(self) -> "LiveWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class BufferPool:
    """At most ``limit`` receive buffers of ``nbytes`` each, reused across pushes.

    Bounds the memory concurrent pushes can take: the ``limit + 1``-th push
    waits (within its timeout) for a buffer instead of allocating one.
    """

    def __init__(self, nbytes: int, limit: int = 2):
        self.nbytes = nbytes
        self._free: list[bytearray] = []
        self._made = 0
        self._limit = limit
        self._cond = threading.Condition()

    def acquire(self, timeout: float) -> bytearray:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free or self._made < self._limit, timeout):
                raise ShardError("RESOURCE_EXHAUSTED", f"no receive buffer free within {timeout:.1f}s: "
                                 "too many pushes at once")
            if self._free:
                return self._free.pop()
            self._made += 1
        return bytearray(self.nbytes)

    def release(self, buf: bytearray) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()


class ShardCore:
    """Shard ``shard`` of a job: its slices' weights, the policy and the optimizer.

    The weights of all slices live in one contiguous array (``flat``), in
    slice-id order, which is also the order slices travel in on the wire.
    """

    def __init__(
        self,
        plan: PartitionPlan,
        shard: int,
        values: Mapping[int, np.ndarray],
        optimizer: Optimizer,
        policy: Policy,
        *,
        num_workers: int,
        lease_seconds: float = 10.0,
        join_timeout: float = 120.0,
        staleness_lr: bool = False,
        allow_nonfinite: bool = False,
        apply_threads: int | None = None,
        identity: Mapping[str, Any] | None = None,
        now: Callable[[], float] = time.monotonic,
    ):
        self.plan, self.shard = plan, shard
        # What every process of the job must agree on (psgd.job.identity); None: only the plan is compared.
        self.identity = dict(identity) if identity is not None else None
        self.fingerprint = job_fingerprint(identity) if identity is not None else plan.hash[:16]
        self.slices = {s.id: s for s in plan.slices_for_shard(shard)}
        dtypes = {s.dtype for s in plan.specs}
        if len(dtypes) != 1:
            raise ValueError(f"all variables must share one dtype, got {sorted(dtypes)}")
        self.dtype = dtypes.pop()
        if set(values) != set(self.slices):
            raise ValueError("initial values must cover exactly this shard's slices")
        self.order = sorted(self.slices)
        self.offsets, total = {}, 0
        for i in self.order:
            self.offsets[i] = (total, total + self.slices[i].size)
            total += self.slices[i].size
        self.nbytes = total * np.dtype(self.dtype).itemsize
        self.flat = np.empty(total, dtype=self.dtype)
        self.weights = self._views(self.flat)
        for i in self.order:
            self.weights[i][...] = np.asarray(values[i], dtype=self.dtype).reshape(-1)
        self.receive_buffers = BufferPool(self.nbytes, limit=2)
        threads = min(4, os.cpu_count() or 1) if apply_threads is None else apply_threads
        self._threads = (ThreadPoolExecutor(threads, thread_name_prefix=f"shard{shard}-apply")
                         if threads > 1 and len(self.order) > 1 and self.nbytes >= PARALLEL_BYTES else None)
        self.optimizer, self.policy = optimizer, policy
        self.num_workers = num_workers
        self.lease_seconds, self.join_timeout = lease_seconds, join_timeout
        self.staleness_lr, self.allow_nonfinite = staleness_lr, allow_nonfinite
        self._now = now
        self.version = 0
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        start = now()
        self.workers = {w: WorkerInfo(deadline=start + join_timeout) for w in range(num_workers)}
        self._round_flat = np.zeros_like(self.flat) if policy.name == "sync" else None
        self._round_sum = self._views(self._round_flat) if self._round_flat is not None else {}
        self._round_bases: list[int] = []
        self._snapshot: Snapshot | None = None
        self._spare: bytearray | None = None
        self.staleness_histogram = [0] * STALENESS_BUCKETS
        self.counters = {"pushes": 0, "pulls": 0, "applied": 0, "accumulated": 0, "duplicates": 0,
                         "late": 0, "rejected": 0, "expired": 0, "bytes_in": 0, "bytes_out": 0}
        self.closing = False
        self._readers = 0          # zero-copy pulls sending from ``flat`` right now
        self._writers_waiting = 0  # updates waiting for those sends to finish
        self.restored_version: int | None = None   # the checkpoint this process started from
        self.last_checkpoint: tuple[int, float] | None = None  # (version, time) of the newest one written
        self._joined: set[int] = set()  # workers registered with this process (a restart forgets them)

    # -- helpers ------------------------------------------------------------
    def _map(self, fn: Callable[[int], object], ids: Iterable[int]) -> list:
        """``[fn(i) for i in ids]``, spread over the shard's threads when it has them."""
        if self._threads is None:
            return [fn(i) for i in ids]
        return list(self._threads.map(fn, ids))

    def _views(self, flat: np.ndarray) -> dict[int, np.ndarray]:
        return {i: flat[a:b] for i, (a, b) in self.offsets.items()}

    def gradient_views(self, buf: bytearray | memoryview) -> dict[int, np.ndarray]:
        """Per-slice arrays over a receive buffer holding the shard's gradient in slice order."""
        return self._views(np.frombuffer(buf, dtype=self.dtype, count=self.flat.size))

    def _take_snapshot(self) -> Snapshot:
        """The current version's snapshot (under the lock), made or refreshed only when needed."""
        snap = self._snapshot
        if snap is None or snap.version != self.version:
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
            snap = self._snapshot = Snapshot(self.version, buf, parts, self)
        snap.refs += 1
        return snap

    def _release_snapshot(self, snap: Snapshot) -> None:
        with self.lock:
            snap.refs -= 1
            if snap.refs == 0 and snap is not self._snapshot and self._spare is None:
                self._spare = snap.buffer

    def assembler(self) -> PushAssembler:
        return PushAssembler(self.slices, self.dtype)

    def _check_worker(self, worker: int) -> None:
        if not 0 <= worker < self.num_workers:
            raise ShardError("INVALID_ARGUMENT", f"worker id {worker} is out of range: this job has "
                             f"{self.num_workers} worker(s), ids 0..{self.num_workers - 1}")

    def _require_live(self, worker: int, renew: bool = True) -> WorkerInfo:
        info = self.workers[worker]
        if info.state != "live":
            raise ShardError("FAILED_PRECONDITION", f"worker {worker} is not registered with shard {self.shard} "
                             f"(state: {info.state}); it must register again", reason="NOT_REGISTERED")
        if renew:
            info.deadline = self._now() + self.lease_seconds
        return info

    def _record_staleness(self, staleness: int) -> None:
        self.staleness_histogram[min(max(staleness, 0), STALENESS_BUCKETS - 1)] += 1

    def _apply(self, grads: Mapping[int, np.ndarray], lr_scale: float) -> None:
        """Update the weights (under the lock), once no zero-copy pull is sending from them."""
        if self._readers:
            self._writers_waiting += 1
            try:
                self.changed.wait_for(lambda: self._readers == 0)
            finally:
                self._writers_waiting -= 1
        self._map(lambda i: self.optimizer.update(self.slices[i].key, self.weights[i], grads[i], lr_scale=lr_scale),
                  grads)
        self.version += 1
        self.counters["applied"] += 1

    def _close_rounds(self, rounds: Iterable[int]) -> None:
        for _ in rounds:
            count = len(self._round_bases)
            if count == 0:
                continue
            self._round_flat *= 1.0 / count
            for base in self._round_bases:
                self._record_staleness(self.version - base)
            self._apply(self._round_sum, 1.0)
            self._round_flat.fill(0)
            self._round_bases.clear()
        self.changed.notify_all()

    # -- requests -----------------------------------------------------------------
    def register(self, worker: int, plan_hash: str, plan_json: str = "", hostname: str = "", pid: int = 0,
                 clock: int = 0, job_json: str | None = None) -> int:
        """(Re)join ``worker``; returns the clock it continues from.

        ``clock`` is where the worker is.  The first time a worker that was
        already training registers with this shard process (so the shard was
        restarted), the shard jumps ahead to it: the updates since the shard's
        checkpoint are lost on this shard, but nobody repeats or waits.
        """
        self._check_worker(worker)
        if plan_hash != self.plan.hash:
            try:
                why = plan_differences(json.loads(plan_json), self.plan.description())
            except Exception:  # a malformed description (any shape, any depth) only loses the explanation
                why = ""
            raise ShardError("FAILED_PRECONDITION", f"worker {worker}'s partition plan {plan_hash!r} differs from "
                             f"shard {self.shard}'s {self.plan.hash!r}" + (f": {why}" if why else "") +
                             "; start every process from the same job file", reason="JOB_MISMATCH")
        if job_json is not None and self.identity is not None:
            job = _job_identity(job_json)
            differ = job_differences(self.identity, job, me=f"shard {self.shard}", them=f"worker {worker}")
            if differ:
                raise ShardError("FAILED_PRECONDITION", f"worker {worker}'s job differs from shard {self.shard}'s: "
                                 f"{'; '.join(differ)}; start every process from the same job file",
                                 reason="JOB_MISMATCH", differences=differ)
        if clock < 0:
            raise ShardError("INVALID_ARGUMENT", f"clock {clock} is negative")
        with self.lock:
            info = self.workers[worker]
            if worker not in self._joined:
                self._joined.add(worker)
                if clock > self.policy.clock_of(worker):
                    log.warning("shard %d: worker %d comes back at clock %d, ahead of this shard (%s); "
                                "continuing from there", self.shard, worker, clock,
                                f"restored from the checkpoint of version {self.restored_version}"
                                if self.restored_version is not None else
                                "started without a checkpoint: its earlier updates are lost")
                    if self.policy.fast_forward(worker, clock):
                        self._round_flat.fill(0)
                        self._round_bases.clear()
            clock = self.policy.join(worker)
            info.state, info.clock, info.hostname, info.pid = "live", clock, hostname, pid
            info.deadline = self._now() + self.lease_seconds
            self.changed.notify_all()
        log.info("shard %d: worker %d registered (%s pid %d), continues at clock %d",
                 self.shard, worker, hostname or "?", pid, clock)
        return clock

    def pull(self, worker: int, clock: int, timeout: float,
             cancelled: Callable[[], bool] = lambda: False, _copy: bool = True) -> "Snapshot | LiveWeights":
        """Wait until the policy allows it, then return a snapshot of the weights (release it when sent).

        Waiting does not renew the worker's lease (its heartbeats do), so a
        worker that dies while its pull waits is still dropped on time; a
        pull whose caller has gone (``cancelled``) stops waiting.
        """
        if worker != -1:
            self._check_worker(worker)
            if clock < 0:
                raise ShardError("INVALID_ARGUMENT", f"clock {clock} is negative")
        deadline = time.monotonic() + max(timeout, 0.0)
        with self.lock:
            if worker != -1:
                self._require_live(worker)
                while not self.policy.pull_ready(worker, clock):
                    if self.closing:
                        raise ShardError("UNAVAILABLE", f"shard {self.shard} is shutting down")
                    if cancelled():
                        raise ShardError("CANCELLED", f"worker {worker} went away while its pull waited")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ShardError("DEADLINE_EXCEEDED", self._why_waiting(worker, clock, timeout))
                    self.changed.wait(min(left, 0.5))
                    self._require_live(worker, renew=False)
            while self._writers_waiting:  # an update is due first: never send half-applied weights
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ShardError("DEADLINE_EXCEEDED", f"pull waited {timeout:.1f}s for an update to finish")
                self.changed.wait(min(left, 0.5))
            self.counters["pulls"] += 1
            self.counters["bytes_out"] += self.nbytes
            if not _copy:
                self._readers += 1
                return LiveWeights(self.version, memoryview(self.flat).cast("B"), self)
            return self._take_snapshot()

    def pull_live(self, worker: int, clock: int, timeout: float,
                  cancelled: Callable[[], bool] = lambda: False) -> "LiveWeights":
        """Like :meth:`pull`, without a copy: the caller sends straight from the weights and must
        call ``release()`` when done; updates wait until then, and new pulls defer to a waiting update."""
        return self.pull(worker, clock, timeout, cancelled, _copy=False)

    def _why_waiting(self, worker: int, clock: int, timeout: float) -> str:
        slow = sorted((w, i.clock) for w, i in self.workers.items()
                      if i.state in ("live", "pending") and w != worker and i.clock < clock)
        waiting = ", ".join(f"worker {w} at clock {c}" for w, c in slow) or "none"
        return (f"pull for clock {clock} by worker {worker} waited {timeout:.1f}s under {self.policy.name}; "
                f"other workers still expected: {waiting}")

    def push(self, worker: int, clock: int, base_version: int, grads: Mapping[int, np.ndarray]) -> PushResult:
        """Apply, accumulate or drop one gradient for every slice of this shard, as the policy says."""
        self._check_worker(worker)
        if clock < 0 or base_version < 0:
            raise ShardError("INVALID_ARGUMENT", f"clock ({clock}) and base version ({base_version}) must be >= 0")
        if clock > MAX_CLOCK:
            raise ShardError("INVALID_ARGUMENT", f"clock {clock} is too large: a push's clock must be at most "
                             f"{MAX_CLOCK}")
        if set(grads) != set(self.slices):
            raise ShardError("INVALID_ARGUMENT", "a push must carry a gradient for every slice of the shard")
        if not self.allow_nonfinite:
            for i, bad in zip(grads, self._map(lambda i: _nonfinite(grads[i]), grads)):
                if bad:
                    raise ShardError("INVALID_ARGUMENT", f"gradient for {self.slices[i].key} from worker {worker} "
                                     f"has {bad} non-finite value(s) (NaN/Inf); lower the learning rate or check the data")
        with self.lock:
            info = self._require_live(worker)  # first: a restarted shard asks the worker to register again
            if base_version > self.version:
                raise ShardError("INVALID_ARGUMENT", f"base version {base_version} is ahead of shard "
                                 f"{self.shard}'s version {self.version}")
            self.counters["pushes"] += 1
            decision = self.policy.push(worker, clock)
            staleness = self.version - base_version
            action = decision.action
            if action == "reject":
                self.counters["rejected"] += 1
                raise ShardError("FAILED_PRECONDITION", f"push from worker {worker} at clock {clock} refused: "
                                 f"{decision.reason}", reason=decision.reason_code)
            self.counters["bytes_in"] += sum(g.nbytes for g in grads.values())
            info.clock = max(info.clock, decision.next_clock)
            if action == "apply":
                self._record_staleness(staleness)
                scale = 1.0 / max(1, staleness) if self.staleness_lr else 1.0
                self._apply(grads, scale)
                self.changed.notify_all()
                outcome = "applied"
            elif action == "accumulate":
                for i, g in grads.items():
                    self._round_sum[i] += g
                self._round_bases.append(base_version)
                self.counters["accumulated"] += 1
                self._close_rounds(decision.closed_rounds)
                outcome = "accumulated"
            elif action == "duplicate":
                self.counters["duplicates"] += 1
                outcome = "duplicate"
            else:
                self.counters["late"] += 1
                outcome = "late"
            return PushResult(outcome, decision.next_clock, self.version, staleness)

    def heartbeat(self, worker: int, clock: int) -> None:
        self._check_worker(worker)
        with self.lock:
            self._require_live(worker)

    def done(self, worker: int, clock: int) -> int:
        """``worker`` has finished; returns how many workers are still live."""
        self._check_worker(worker)
        with self.lock:
            info = self.workers[worker]
            if info.state == "live":
                info.state = "done"
                info.clock = max(info.clock, clock)
                self._close_rounds(self.policy.leave(worker))
                log.info("shard %d: worker %d is done at clock %d", self.shard, worker, clock)
            self.changed.notify_all()
            return sum(1 for i in self.workers.values() if i.state == "live")

    def expire_leases(self) -> list[int]:
        """Drop workers whose lease (or join deadline) has passed; returns their ids."""
        now = self._now()
        expired = []
        with self.lock:
            for w, info in self.workers.items():
                if info.state in ("pending", "live") and now > info.deadline:
                    was = info.state
                    info.state, info.expired_at = "expired", now
                    self.counters["expired"] += 1
                    expired.append(w)
                    self._close_rounds(self.policy.leave(w))
                    limit = self.join_timeout if was == "pending" else self.lease_seconds
                    log.warning("shard %d: worker %d %s within %.1fs: dropped from the round; it may register "
                                "again", self.shard, w, "did not register" if was == "pending" else
                                "missed its lease", limit)
            if expired:
                self.changed.notify_all()
        return expired

    # -- checkpoints -------------------------------------------------------------
    def checkpoint(self, folder, keep: int = 3, force: bool = False):
        """Write a checkpoint of this shard into ``folder`` (nothing when unchanged since the last one).

        Written under the lock, straight from the live arrays: consistent, and
        no second copy of the weights in memory; training pauses meanwhile.
        Raises CheckpointError when the disk refuses (the previous one stays).
        """
        with self.lock:
            if not force and self.last_checkpoint and self.last_checkpoint[0] == self.version:
                return None
            arrays = {"weights": self.flat}
            arrays.update({f"opt/{k}": v for k, v in self.optimizer.state_dict().items()})
            if self._round_flat is not None:
                arrays["round_sum"] = self._round_flat
            manifest = {"fingerprint": self.fingerprint, "identity": self.identity,
                        "shard": self.shard, "plan_hash": self.plan.hash, "plan": self.plan.description(),
                        "policy": self.policy.state_dict(), "counters": dict(self.counters),
                        "staleness_histogram": list(self.staleness_histogram),
                        "round_bases": list(self._round_bases), "optimizer": self.optimizer.describe()}
            try:
                path = checkpoint.save(folder, self.version, arrays, manifest, keep)
            except checkpoint.CheckpointError:
                self.counters["checkpoint_failures"] = self.counters.get("checkpoint_failures", 0) + 1
                raise
            self.last_checkpoint = (self.version, time.time())
            return path

    def restore(self, ckpt: "checkpoint.Checkpoint") -> None:
        """Take the state of a checkpoint loaded by :func:`checkpoint.load_latest` (before serving)."""
        m, a = ckpt.manifest, ckpt.arrays
        if m.get("fingerprint", self.fingerprint) != self.fingerprint or m.get("shard", self.shard) != self.shard:
            raise checkpoint.CheckpointError(f"{ckpt.path} is shard {m.get('shard')}'s of job {m.get('fingerprint')}, "
                                             f"this is shard {self.shard} of job {self.fingerprint}")
        weights = a.get("weights")
        if weights is None or weights.shape != self.flat.shape or weights.dtype != self.flat.dtype:
            raise checkpoint.CheckpointError(f"{ckpt.path}: its weights do not fit shard {self.shard}")
        with self.lock:
            np.copyto(self.flat, weights)
            self.optimizer.load_state_dict({k[4:]: v for k, v in a.items() if k.startswith("opt/")})
            self.policy.load_state_dict(m["policy"])
            if self._round_flat is not None and "round_sum" in a:
                np.copyto(self._round_flat, a["round_sum"])
                self._round_bases[:] = [int(b) for b in m.get("round_bases", [])]
            self.version = int(m["version"])
            self.counters.update({k: int(v) for k, v in m.get("counters", {}).items() if k in self.counters})
            self.staleness_histogram[:] = [int(v) for v in m["staleness_histogram"]][:STALENESS_BUCKETS]
            self.restored_version = self.version
            self.last_checkpoint = (self.version, float(m.get("written_at", time.time())))
        log.info("shard %d: restored version %d from %s", self.shard, self.version, ckpt.path)

    def finished(self, settle: float = 0.0) -> bool:
        """True once no worker is pending or live: each is done, or was dropped at least ``settle``
        seconds ago (a shard paused longer than the lease drops every worker at once when it resumes;
        they come back within a lease, so a dropped worker counts as gone only once that has passed)."""
        now = self._now()
        with self.lock:
            return all(i.state == "done" or (i.state == "expired" and now - i.expired_at >= settle)
                       for i in self.workers.values())

    def wait_changed(self, timeout: float) -> None:
        with self.lock:
            self.changed.wait(timeout)

    def close(self) -> None:
        """Wake every waiting pull so that it ends with UNAVAILABLE."""
        with self.lock:
            self.closing = True
            self.changed.notify_all()

    def status(self) -> dict:
        now = self._now()
        with self.lock:
            return {
                "shard": self.shard, "num_shards": self.plan.num_shards, "policy": self.policy.name,
                "version": self.version, "plan_hash": self.plan.hash,
                "bytes_held": int(sum(w.nbytes for w in self.weights.values())),
                "workers": [{"worker_id": w, "state": i.state, "clock": i.clock,
                             "lease_left_seconds": i.deadline - now, "hostname": i.hostname, "pid": i.pid}
                            for w, i in sorted(self.workers.items())],
                "counters": {**self.counters, "policy": self.policy.describe()},
                "staleness_histogram": list(self.staleness_histogram),
                "checkpoint": {"version": self.last_checkpoint[0], "written_at": self.last_checkpoint[1]}
                if self.last_checkpoint else None,
                "restored_version": self.restored_version,
            }

    def weights_by_var(self) -> Iterator[tuple[Slice, np.ndarray]]:
        for i, w in self.weights.items():
            yield self.slices[i], w


def _nonfinite(g: np.ndarray) -> int:
    """How many NaN/Inf values ``g`` holds."""
    if np.isfinite(np.add.reduce(g)):
        return 0  # a finite sum has no NaN or Inf in it; a sum that overflows is counted exactly below
    return int(g.size - np.count_nonzero(np.isfinite(g)))
