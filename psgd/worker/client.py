"""The worker's client to every shard: one link each, calls in parallel, bounded retries, leases.

Pulls write straight into preallocated host arrays (one per variable), or device arrays (:mod:`psgd.link.shm`);
pushes go out as views of the gradient arrays, or of a reused 16-bit buffer when the job compresses gradients
(:mod:`psgd.wire.codec`): no model-sized buffer is built per step.  How the bytes travel is the link's business
(:mod:`psgd.link`); what is retried is decided here, the same for every link: transient failures (UNAVAILABLE,
DEADLINE_EXCEEDED, CANCELLED by a restarting shard) with jittered exponential backoff inside one overall deadline;
anything else fails at once with the shard's address and the server's message.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import TypeVar

import numpy as np

from psgd.compute import backend
from psgd.config import Deadlines, JobConfig, Links, Recovery, workers_range
from psgd.errors import Code
from psgd.job import alive_here, process_incarnation
from psgd.job import identity as job_identity
from psgd.link import Endpoint, LinkError, ProtocolError, PushReply, accepts_connections, link_kind, open_link
from psgd.partition import PartitionPlan
from psgd.proto import ps_pb2
from psgd.wire.codec import CodecError, codec_for
from psgd.wire.protocol import OBSERVER
from psgd.wire.tls import NO_TLS, TLSFiles
from psgd.worker.errors import PSError, ShardWentBack, Stopped
from psgd.worker.failover import Failover
from psgd.worker.outgoing import Outgoing

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How often a worker waiting for its shards says which ones it is waiting for.
WAIT_REPORT_SECONDS = 5.0
#: How long one look at whether a shard accepts connections may take (a host that drops them, not refuses).
PROBE_SECONDS = 0.5
#: seconds past one lease that a registration refused for a live holder of the rank is retried (a late heartbeat)
HOLDER_MARGIN = 2.0


class PSClient:
    """Talks to all shards of one job on behalf of worker ``worker_id`` (``protocol.OBSERVER``: a reader)."""

    def __init__(
        self,
        addresses: Sequence[str],
        plan: PartitionPlan,
        worker_id: int = OBSERVER,
        *,
        links: Links = Links(),
        deadlines: Deadlines = Deadlines(),
        retry_deadline: float | None = None,
        token: str = "",
        tls: TLSFiles = NO_TLS,
        stop: threading.Event | None = None,
        config: JobConfig | None = None,
        device: backend.Device = backend.CPU,
        recovery: Recovery = Recovery(),
    ):
        """``links`` and ``deadlines``: the job's (``[cluster]``), taken whole, and ``recovery`` (its
        ``replica_servers``: where each shard's other process is); an observer's are the defaults
        (gRPC whatever ``links`` says: it has no data port).  ``retry_deadline``: how long a call is retried, the
        request timeout unless given.  ``config``: a worker's job file, which its registration sends."""
        if len(addresses) != plan.num_shards:
            raise PSError(f"{len(addresses)} server address(es) given for a plan with {plan.num_shards} shard(s)")
        try:
            self.codec = codec_for(links.wire_dtype)
            for spec in (*plan.specs, *plan.tables):
                self.codec.check(spec.dtype)
        except CodecError as exc:
            raise PSError(str(exc)) from None
        self.addresses, self.plan, self.worker_id = list(addresses), plan, worker_id
        self.deadlines = deadlines
        self.retry_deadline = deadlines.request_timeout if retry_deadline is None else retry_deadline
        self.shard_slices = [plan.slices_for_shard(k) for k in range(plan.num_shards)]
        kind = self.link_kind = link_kind(links.transport if worker_id != OBSERVER else "grpc")  # no data port
        self.links = [
            open_link(
                kind,
                Endpoint(
                    a,
                    k,
                    self.shard_slices[k],
                    worker_id,
                    plan.hash,
                    token,
                    tls,
                    deadlines.request_timeout,
                    links.transport,
                    links.busy_poll_seconds,
                ),
                device,
            )  # a GPU worker's: it registers its segments, and may take device arrays
            for k, a in enumerate(self.addresses)
        ]
        # each shard's pair of processes where the job keeps replicas (psgd.worker.failover)
        self.recovery = recovery
        self.failover = Failover(self, recovery.replica_servers)
        n = plan.num_shards  # this process's registrations with each shard: made so far, and on the way
        self.versions, self._joins, self._registering, self._joining = [0] * n, [0] * n, [0] * n, threading.Lock()
        self.lease_seconds = 10.0
        self._pool = futures.ThreadPoolExecutor(max_workers=2 * plan.num_shards, thread_name_prefix="ps-client")
        self._beat_stop, self._beat, self.clock, self._pulling = threading.Event(), None, 0, False
        # a shard that restarted from a cut behind this worker, until the job went back;
        # and calls still running when one of their siblings heard of a rollback (psgd.worker.rollback)
        self.pending_rollback: tuple[int, str] | None = None  # (its cut, its incarnation)
        self.stragglers: list[futures.Future] = []
        self.outgoing = Outgoing(self.codec, self.shard_slices)  # each shard's part of a gradient, as it travels
        self.stop = stop
        # What this worker's job is, sent when it registers (psgd.job.identity); observers need none.
        self.identity = job_identity(config, plan.hash, bool(plan.tables)) if config is not None else None
        #: how long a registration refused for another holder of the rank is retried: a lease (it died or renewed)
        self.holder_wait = deadlines.lease_seconds + HOLDER_MARGIN
        if stop is not None:
            threading.Thread(target=self._watch_stop, name="ps-stop", daemon=True).start()

    def observer(self) -> PSClient:
        """A reader of the same shards, with this client's token and TLS (an evaluation's: it never waits)."""
        ep = self.links[0].endpoint
        return PSClient(
            self.addresses,
            self.plan,
            OBSERVER,
            deadlines=self.deadlines,
            token=ep.token,
            tls=ep.tls,
            recovery=dataclasses.replace(
                self.recovery,
                replica_servers=[b if a == s else a for s, (a, b) in zip(self.addresses, self.failover.pairs)],
            ),
        )

    def _watch_stop(self) -> None:
        """Asked to stop, abandon a pull in progress: a sync pull may wait on a round that will not close now."""
        self.stop.wait()
        if self._pulling:
            for link in self.links:
                link.interrupt()

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    # -- plumbing ------------------------------------------------------------
    def retrying(
        self,
        shard: int,
        what: str,
        call: Callable[[], T],
        rejoin: bool = True,
        also: tuple[Code, ...] = (),
        also_for: float | None = None,
        within: float | None = None,
    ) -> T:
        """``call()``, retried on transient errors (and the codes in ``also``, for at most ``also_for`` seconds
        from the first of them) for ``within`` seconds (the retry deadline unless given); a shard that has forgotten
        this worker (it restarted, or the lease ran out) is re-registered with first.  Once the worker is asked to
        stop, no retry starts: a failed call ends there (the shards may be stopping too, a sync round will not
        close)."""
        began = time.monotonic()
        deadline, report = began + (self.retry_deadline if within is None else within), began + WAIT_REPORT_SECONDS
        first_also: float | None = None  # when the first error of a code in ``also`` came
        delay, attempt = 0.05, 0
        while True:
            attempt, used, joins = attempt + 1, self.links[shard], self._joins[shard]
            try:
                return call()
            except ProtocolError as err:
                raise PSError(str(err)) from None
            except LinkError as err:
                code, details = err.code, err.details
                if err.reason == "ROLLED_BACK":  # the job went back to a cut; this worker takes it back if it heard why
                    raise (
                        ShardWentBack(*self.pending_rollback) if self.pending_rollback else ShardWentBack(err.rewind_to)
                    ) from None
                self.failover.move(shard, used, err)  # the other process of the shard's pair, if it has one
                stopping = self._stopping()
                left = 0.0 if stopping else deadline - time.monotonic()
                if rejoin and self.worker_id != OBSERVER and err.reason == "NOT_REGISTERED" and left > 0:
                    log.warning(
                        "shard %d at %s no longer knows worker %d (restarted?): registering again",
                        shard,
                        self.addresses[shard],
                        self.worker_id,
                    )
                    self._register_one(shard)
                    continue
                # refused for the key of this process's earlier registration (a heartbeat registered again while
                # the call was on the way): the call changed nothing, and sent again it carries the new key
                rekeyed = code == Code.PERMISSION_DENIED and (self._joins[shard] != joins or self._registering[shard])
                retryable = err.retryable or code in also or rekeyed
                if code in also and not err.retryable and also_for is not None and not stopping:
                    first_also = time.monotonic() if first_also is None else first_also
                    left = min(left, first_also + also_for - time.monotonic())
                if not retryable or left <= 0:
                    tried = f" after {attempt} attempt(s) over {time.monotonic() - began:.0f}s" if retryable else ""
                    if retryable and stopping:
                        tried = f" after {attempt} attempt(s) (the worker is stopping, so it did not retry)"
                    raise PSError(
                        f"{what} on shard {shard} at {used.endpoint.address} failed{tried}: {code.name}: {details}",
                        code,
                    ) from None
                pause = min(left, delay * (0.5 + random.random()))
                log.debug("%s on shard %d: %s, retrying in %.2fs", what, shard, code.name, pause)
                if time.monotonic() >= report:  # a long wait says what it waits for
                    report = time.monotonic() + WAIT_REPORT_SECONDS
                    log.warning(
                        "%s on shard %d at %s: %s (%s); still retrying (%.0fs of %.0fs)",
                        what,
                        shard,
                        used.endpoint.address,
                        code.name,
                        details.splitlines()[0] if details else "",
                        time.monotonic() - began,
                        deadline - began,
                    )
                if self.stop is not None:
                    self.stop.wait(pause)  # backoff between attempts, cut short by a stop
                else:
                    time.sleep(pause)  # backoff between attempts, not synchronization
                delay = min(delay * 2, 2.0)

    def on_all(self, fn: Callable[[int], T]) -> list[T]:
        if self.plan.num_shards == 1:  # no thread hand-off for a single shard: it costs latency
            return [fn(0)]
        jobs = [self._pool.submit(fn, k) for k in range(self.plan.num_shards)]
        pending = set(jobs)
        while pending:  # short waits: a stop signal's handler runs in this (the main) thread in between
            done, pending = futures.wait(pending, timeout=0.1)
            back = next((j.exception() for j in done if isinstance(j.exception(), ShardWentBack)), None)
            if back is not None:  # the others may wait on a round that closes only once the job went back
                self.stragglers = list(pending)
                raise back
        return [j.result() for j in jobs]

    # -- calls --------------------------------------------------------------------
    def wait_ready(self, timeout: float) -> None:
        """Wait until every shard accepts connections (where the job keeps replicas, either process of its pair:
        registering then finds the one that leads), saying every few seconds which ones it waits for; fail naming
        the missing ones after ``timeout``, or raise :class:`Stopped` when asked to stop."""
        others = self.failover.others()
        up: list[str | None] = [None] * len(self.addresses)  # the process of each shard's pair that accepts
        log.info(
            "joining %d shard(s) at %s (waiting up to %.0fs)", len(self.addresses), ", ".join(self.addresses), timeout
        )
        start = time.monotonic()
        deadline, report = start + timeout, start + WAIT_REPORT_SECONDS
        stop = self.stop if self.stop is not None else threading.Event()
        while True:
            for k, pair in enumerate(zip(self.addresses, others)):
                if up[k] is None and not stop.is_set():  # (a stop is heard between two looks)
                    up[k] = next((a for a in pair if a is not None and accepts_connections(a, PROBE_SECONDS)), None)
            missing = [a for a, there in zip(self.addresses, up) if there is None]
            if not missing:
                for k, (a, there) in enumerate(zip(self.addresses, up)):
                    if there != a:
                        log.info(
                            "shard %d: %s does not accept connections, the other process of its pair, %s, "
                            "does: joining there",
                            k,
                            a,
                            there,
                        )
                return
            now = time.monotonic()
            if now >= deadline:
                raise PSError(
                    f"cannot reach shard(s) at {', '.join(missing)} within {timeout:.0f}s: is "
                    "psgd-server running there, and is the address and port right?",
                    Code.UNAVAILABLE,
                )
            if now >= report:
                log.warning("waiting for shard(s) at %s (%.0fs of %.0fs)", ", ".join(missing), now - start, timeout)
                report = now + WAIT_REPORT_SECONDS
            if stop.wait(min(0.1, deadline - now)):
                raise Stopped(f"asked to stop while waiting for shard(s) at {', '.join(missing)}")

    def _register_request(self) -> ps_pb2.RegisterRequest:
        if self.identity is None:
            raise PSError(
                "a worker registers with its job file (PSClient(..., config=...)); an observer cannot register"
            )
        return ps_pb2.RegisterRequest(
            worker_id=self.worker_id,
            plan_hash=self.plan.hash,
            plan_json=json.dumps(self.plan.description()),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            clock=self.clock,
            job_json=json.dumps(self.identity),
            incarnation=process_incarnation(),
        )

    def _register_one(self, k: int, within: float | None = None) -> ps_pb2.RegisterReply:
        request = self._register_request()

        def register() -> ps_pb2.RegisterReply:
            try:
                return self.links[k].register(request)
            except LinkError as err:  # a holder alive on this host is a second process of the rank, not our past
                held = err.reason == "RANK_HELD" and err.holder is not None and alive_here(*err.holder)
                raise (
                    PSError(
                        f"register on shard {k} at {self.addresses[k]} failed: {err.code.name}: {err.details} "
                        f"It is: pid {err.holder[1]} runs on this host.",
                        err.code,
                    )
                    if held
                    else err
                ) from None

        with self._joining:
            self._registering[k] += 1
        try:  # a rank held by another process frees itself within a lease (it crashed: this is its restart)
            reply = self.retrying(
                k,
                "register",
                register,
                rejoin=False,
                also=(Code.ALREADY_EXISTS,),
                also_for=self.holder_wait,
                within=within,
            )
            with self._joining:
                self._joins[k] += 1
        finally:
            with self._joining:
                self._registering[k] -= 1
        expected = (k, self.plan.num_shards, workers_range(self.identity["workers"])[1])
        if (reply.shard, reply.num_shards, reply.num_workers) != expected:
            raise PSError(
                f"the shard at {self.addresses[k]}, listed as shard {k} of {self.plan.num_shards}, "
                f"answered as shard {reply.shard} of {reply.num_shards} (with {reply.num_workers} "
                f"worker(s), this worker expects {expected[2]}): each address must be that of its shard, "
                "in shard order; is a psgd-server started with the wrong --shard?",
                Code.FAILED_PRECONDITION,
            )
        self.versions[k] = reply.version
        if reply.HasField("rollback_to") and reply.rollback_to < self.clock:
            self.pending_rollback = (reply.rollback_to, reply.incarnation)  # then ROLLED_BACK
        return reply

    def take_rank(self, within: float | None = None) -> int:
        """Ask shard 0 for the lowest rank nobody holds (a job with a range of workers: ``psgd-worker --rank auto``),
        which it registers for this process at once; returns the rank.  A client of that rank then registers it with
        every shard, as any worker does (this process holds it: the same incarnation)."""
        request = self._register_request()
        request.any_rank = True
        reply = self.retrying(0, "take a rank", lambda: self.links[0].register(request), rejoin=False, within=within)
        return reply.worker_id

    def register(self, within: float | None = None) -> int:
        """Join every shard, retrying each for ``within`` seconds (the retry deadline unless given); returns the clock
        to go on from, the smallest any shard reports (a worker stopped between its pushes to two shards left them a
        clock apart; from the smaller, the shard that has it counts the push again as a duplicate, applied once)."""
        replies = self.on_all(lambda k: self._register_one(k, within))
        self.lease_seconds = min(r.lease_seconds for r in replies)
        self.versions, self.clock = [r.version for r in replies], min(r.clock for r in replies)
        return self.clock

    def _into(self, out: Mapping[str, np.ndarray]) -> list[list[memoryview]]:
        """For each shard, byte views of its slices of ``out`` (an array per variable), in slice order."""
        flat = _flat(out)
        return [[memoryview(flat[s.var][s.start : s.stop]).cast("B") for s in slices] for slices in self.shard_slices]

    def _split_rows(self, rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None) -> list[dict[str, np.ndarray]]:
        """For each shard, the positions of the ids of ``rows`` (table -> (ids, ...)) whose rows it holds."""
        per_shard: list[dict[str, np.ndarray]] = [{} for _ in self.links]
        for table, (ids, _) in (rows or {}).items():
            owner = self.plan.shard_of_ids(table, ids)
            for k in range(len(self.links)):
                per_shard[k][table] = np.flatnonzero(owner == k)
        return per_shard

    def pull(
        self,
        clock: int,
        out: Mapping[str, np.ndarray],
        rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
        device: dict | None = None,
    ) -> list[int]:
        """Fill ``out`` (one host array per variable) with every shard's weights, and each ``rows`` entry (table ->
        (distinct ids, an array ``[len(ids), dim]``)) with those rows, from the shards that hold them; returns
        shard versions.  ``device`` (device arrays by variable; shm links only) takes the weights instead."""
        into = self._into(out)
        where = self._split_rows(rows)
        kw = {} if device is None else {"device": _flat(device)}

        def one(k: int) -> int:
            mine = {
                t: (rows[t][0][pos], np.empty((pos.size,) + rows[t][1].shape[1:], rows[t][1].dtype))
                for t, pos in where[k].items()
            }
            version = self.retrying(k, f"pull (clock {clock})", lambda: self.links[k].pull(clock, into[k], mine, **kw))
            for t, pos in where[k].items():
                rows[t][1][pos] = mine[t][1]
            return version

        self._pulling = True  # first: a stop from now on interrupts this pull (_watch_stop)
        try:
            if self._stopping():
                raise Stopped(f"asked to stop before the pull of clock {clock}")
            self.versions = self.on_all(one)
        finally:
            self._pulling = False
        return self.versions

    def push(
        self,
        clock: int,
        grads: Mapping[str, np.ndarray],
        base_versions: Sequence[int] | None = None,
        rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> list[PushReply]:
        """Send every shard its slices of ``grads`` (on the device: uncompressed, over direct links, see :meth:`pull`),
        encoded by the job's codec, and its rows of ``rows`` (table -> (distinct ids, their gradients)); a retried push
        is applied once by the shard.  ``base_versions`` are the shards' versions the gradient was computed from
        (default: those of the last pull; give them when a later pull may already be under way)."""
        return [reply for reply, _ in self._pushing(clock, grads, base_versions, rows)]

    def push_pull(
        self, clock: int, grads: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray], device: dict | None = None
    ) -> tuple[list[PushReply], list[int] | None]:
        """Push as :meth:`push` (no rows), each shard's answer bringing its weights for ``clock + 1`` into ``out``
        (``device``, as for :meth:`pull`): one round trip a step.  The replies, and the shards' versions, or None
        where some shard's weights did not come (the caller pulls then; the pushes stand).  A stop cuts the wait
        for the weights, never a push."""
        self._pulling = True  # first: a stop from now on cuts the wait for the weights (_watch_stop)
        try:
            if self._stopping():  # asked before (the watcher found nothing to cut): the push alone
                return self.push(clock, grads), None
            answers = self._pushing(
                clock, grads, None, None, self._into(out), None if device is None else _flat(device)
            )
        finally:
            self._pulling = False
        if any(v is None for _, v in answers):
            return [r for r, _ in answers], None
        self.versions = [v for _, v in answers]
        return [r for r, _ in answers], self.versions

    def _pushing(
        self,
        clock: int,
        grads: Mapping[str, np.ndarray],
        base_versions: Sequence[int] | None,
        rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None,
        into: list | None = None,
        device: dict | None = None,
    ) -> list[tuple[PushReply, int | None]]:
        bases, joins = list(self.versions if base_versions is None else base_versions), list(self._joins)
        flat = {name: backend.get_array_module(g).ascontiguousarray(g).reshape(-1) for name, g in grads.items()}
        for spec in self.plan.specs:
            g = flat.get(spec.name)
            if g is not None and g.dtype != np.dtype(spec.dtype):
                raise PSError(f"gradient {spec.name} is {g.dtype}, the model's variable is {spec.dtype}")

        where = self._split_rows(rows)

        def one(k: int) -> tuple[PushReply, int | None]:
            parts = self.outgoing.slices(k, flat)
            mine = {t: (rows[t][0][pos], self.outgoing.rows(rows[t][1][pos])) for t, pos in where[k].items()}

            def base() -> int:  # read at each try: a shard may restart between them
                return bases[k] if self._joins[k] == joins[k] else self.versions[k]

            if into is not None:
                return self.retrying(
                    k,
                    f"push and pull (clock {clock})",
                    lambda: self.links[k].push_pull(clock, base(), self.codec, parts, into[k], device),
                )
            return self.retrying(
                k, f"push (clock {clock})", lambda: (self.links[k].push(clock, base(), self.codec, parts, mine), None)
            )

        return self.on_all(one)

    def batch(self, clock: int, blocks: int) -> int:
        """The job's batch to train at ``clock`` (a job with a range: shard 0 hands them out, psgd.data.blocks), of
        the ``blocks`` this worker's data makes; the same when asked again for the same clock."""
        return self.retrying(0, f"batch (clock {clock})", lambda: self.links[0].batch(clock, blocks))

    def done(self) -> None:
        self._stop_heartbeats()  # first: a done worker holds no lease; a heartbeat refused then would register it again
        self.on_all(lambda k: self.retrying(k, "done", lambda: self.links[k].done(self.clock)))

    def status(self) -> list[ps_pb2.StatusReply]:
        return self.on_all(lambda k: self.retrying(k, "status", lambda: self.links[k].status()))

    # -- leases ---------------------------------------------------------------------
    def start_heartbeats(self) -> None:  # the lease on every shard, renewed three times per lease
        if self._beat is not None:
            return
        self._beat = threading.Thread(target=self._heartbeats, name="ps-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeats(self) -> None:
        while not self._beat_stop.wait(self.lease_seconds / 3):
            for k, link in enumerate(self.links):
                try:
                    link.heartbeat(self.clock, timeout=max(1.0, self.lease_seconds / 3))
                except LinkError as err:
                    log.warning("heartbeat to shard %d at %s failed: %s", k, self.addresses[k], err.code.name)
                    if err.reason == "NOT_REGISTERED" and not self._beat_stop.is_set():
                        self._rejoin(k)  # the lease is what heartbeats keep: a shard that dropped us hears back

    def _rejoin(self, k: int) -> None:
        log.warning(
            "shard %d at %s dropped worker %d (paused or cut off past the lease?): registering again",
            k,
            self.addresses[k],
            self.worker_id,
        )
        try:
            self._register_one(k)
        except PSError as exc:
            log.warning("registering again with shard %d failed: %s", k, exc)

    def _stop_heartbeats(self) -> None:
        self._beat_stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)

    def close(self) -> None:
        self._stop_heartbeats()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for link in self.links:
            link.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _flat(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: a.reshape(-1) for name, a in arrays.items()}


def fetch_weights(
    addresses: Sequence[str],
    plan: PartitionPlan,
    request_timeout: float = 60.0,
    token: str = "",
    tls: TLSFiles = NO_TLS,
) -> dict[str, np.ndarray]:
    """The current weights of a running job, read as an observer (never waits for a round)."""
    out = {s.name: np.empty(s.shape, dtype=s.dtype) for s in plan.specs}
    with PSClient(
        addresses, plan, OBSERVER, deadlines=Deadlines(request_timeout=request_timeout), token=token, tls=tls
    ) as client:
        client.pull(0, out)
    return out
