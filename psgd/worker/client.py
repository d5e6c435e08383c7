"""The worker's client to every shard: one channel each, calls in parallel, bounded retries.

Pulls write straight into preallocated host arrays (one per variable); pushes
stream each slice's bytes in chunks from views of the gradient arrays, so no
model-sized buffer is built per step on the client.  Transient failures
(UNAVAILABLE, DEADLINE_EXCEEDED) are retried with jittered exponential
backoff inside one overall deadline; anything else fails at once with the
shard's address and the server's message.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
from concurrent import futures
from typing import Callable, Iterator, Mapping, Sequence, TypeVar

import grpc
import numpy as np

from psgd import status, wire
from psgd.channel import open_channel, token_metadata
from psgd.config import JobConfig
from psgd.job import identity as job_identity
from psgd.partition import PartitionPlan
from psgd.proto import ps_pb2, ps_pb2_grpc
from psgd.tls import NO_TLS, TLSFiles
from psgd.wire import WireError, chunks
from psgd.worker.datapath import DataConnection, DataStatus

log = logging.getLogger(__name__)

T = TypeVar("T")
# CANCELLED: a shard stopping (SIGTERM, to restart) cancels the calls still in flight when its grace ends.
# A worker cancels its own calls only when it stops, and then it does not retry them (see _retrying).
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class PSError(RuntimeError):
    """A call to a shard failed for good; the message names the address and what was tried."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


class Stopped(PSError):
    """The worker was asked to stop (SIGTERM) while it waited for its shards."""


#: Once a worker is asked to stop, calls still in hand (the last push, ``done``) are retried at
#: most this long: shards stopped together with the worker are not coming back.
STOP_GRACE = 2.0
#: How often a worker waiting for its shards says which ones it is waiting for.
WAIT_REPORT_SECONDS = 5.0


class PSClient:
    """Talks to all shards of one job on behalf of worker ``worker_id`` (-1: an observer)."""

    def __init__(self, addresses: Sequence[str], plan: PartitionPlan, worker_id: int = -1, *,
                 request_timeout: float = 60.0, retry_deadline: float | None = None, data_path: bool = True,
                 wire_dtype: str | None = None, token: str = "", tls: TLSFiles = NO_TLS,
                 stop: threading.Event | None = None, job: JobConfig | None = None):
        if len(addresses) != plan.num_shards:
            raise PSError(f"{len(addresses)} server address(es) given for a plan with {plan.num_shards} shard(s)")
        if wire_dtype not in (None, "float16", "bfloat16"):
            raise PSError(f"wire dtype {wire_dtype!r}: use float16 or bfloat16 (or none)")
        if wire_dtype and any(s.dtype != "float32" for s in plan.specs):
            raise PSError("gradient compression (float16/bfloat16 on the wire) needs float32 variables")
        self.addresses = list(addresses)
        self.plan, self.worker_id = plan, worker_id
        self.request_timeout = request_timeout
        self.retry_deadline = request_timeout if retry_deadline is None else retry_deadline
        self.tls = tls
        self.channels = [open_channel(a, tls) for a in self.addresses]
        self.stubs = [ps_pb2_grpc.ParameterServerStub(ch) for ch in self.channels]
        self.shard_slices = [plan.slices_for_shard(k) for k in range(plan.num_shards)]
        self.versions = [0] * plan.num_shards
        self.lease_seconds = 10.0
        self._pool = futures.ThreadPoolExecutor(max_workers=plan.num_shards, thread_name_prefix="ps-client")
        self._beat_stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.clock = 0
        self.token = token
        self._metadata = token_metadata(token)
        self.data_path = data_path
        self.data_ports = [0] * plan.num_shards
        self._data: list[DataConnection | None] = [None] * plan.num_shards
        self.wire_dtype = wire_dtype
        self._packed: list[np.ndarray | None] = [None] * plan.num_shards
        self.stop = stop
        # What this worker's job is, sent when it registers (psgd.job.identity); observers need none.
        self.identity = job_identity(job, plan.hash) if job is not None else None
        self._stopped_at: float | None = None
        self._pulling = False
        self._pull_calls: list = []  # gRPC pull streams in flight, cancelled when the worker stops
        if stop is not None:
            threading.Thread(target=self._watch_stop, name="ps-stop", daemon=True).start()

    def _watch_stop(self) -> None:
        """When the worker is asked to stop, note the time and abandon a pull in progress: a sync pull
        may wait on a round that will not close now (the other workers are stopping too)."""
        self.stop.wait()
        self._stopped_at = time.monotonic()
        if not self._pulling:
            return
        for call in list(self._pull_calls):
            call.cancel()
        for conn in list(self._data):
            if conn is not None:
                conn.interrupt()

    def _stop_deadline(self) -> float | None:
        """When retries must end because the worker is stopping (None: it is not)."""
        if self.stop is None or not self.stop.is_set():
            return None
        if self._stopped_at is None:
            self._stopped_at = time.monotonic()
        return self._stopped_at + STOP_GRACE

    # -- plumbing ------------------------------------------------------------
    def _retrying(self, shard: int, what: str, call: Callable[[], T], rejoin: bool = True) -> T:
        """``call()``, retried on transient errors within the retry deadline; a shard that has
        forgotten this worker (it restarted, or the lease ran out) is re-registered with first."""
        began = time.monotonic()
        deadline, report = began + self.retry_deadline, began + WAIT_REPORT_SECONDS
        delay, attempt = 0.05, 0
        while True:
            attempt += 1
            try:
                return call()
            except (grpc.RpcError, DataStatus, WireError) as err:
                if isinstance(err, WireError):  # the data connection broke: reconnect on the next attempt
                    self._drop_data(shard)
                    code, details, reason = grpc.StatusCode.UNAVAILABLE, f"data connection: {err}", ""
                elif isinstance(err, DataStatus):
                    code, details, reason = err.code, err.message, err.reason
                else:
                    code, details, reason = err.code(), err.details(), status.reason_of(err)
                left = deadline - time.monotonic()
                stopping = self._stop_deadline()
                if stopping is not None:
                    left = min(left, stopping - time.monotonic())
                if rejoin and self.worker_id >= 0 and reason == "NOT_REGISTERED" and left > 0:
                    log.warning("shard %d at %s no longer knows worker %d (restarted?): registering again",
                                shard, self.addresses[shard], self.worker_id)
                    self._register_one(shard)
                    continue
                if code == grpc.StatusCode.CANCELLED and stopping is not None:
                    left = 0  # cancelled by this worker itself, to stop
                if code not in RETRYABLE or left <= 0:
                    tried = f" after {attempt} attempt(s) over {self.retry_deadline:.0f}s" if code in RETRYABLE else ""
                    if code in RETRYABLE and stopping is not None:
                        tried = f" after {attempt} attempt(s) (the worker is stopping, so it did not wait longer)"
                    raise PSError(f"{what} on shard {shard} at {self.addresses[shard]} failed{tried}: "
                                  f"{code.name}: {details}", code) from None
                pause = min(left, delay * (0.5 + random.random()))
                log.debug("%s on shard %d: %s, retrying in %.2fs", what, shard, code.name, pause)
                if time.monotonic() >= report:  # a long wait says what it waits for
                    report = time.monotonic() + WAIT_REPORT_SECONDS
                    log.warning("%s on shard %d at %s: %s (%s); still retrying (%.0fs of %.0fs)", what, shard,
                                self.addresses[shard], code.name, details.splitlines()[0] if details else "",
                                time.monotonic() - began, self.retry_deadline)
                time.sleep(pause)  # backoff between attempts, not synchronization
                delay = min(delay * 2, 2.0)

    def _on_all(self, fn: Callable[[int], T]) -> list[T]:
        if self.plan.num_shards == 1:  # no thread hand-off for a single shard: it costs latency
            return [fn(0)]
        jobs = [self._pool.submit(fn, k) for k in range(self.plan.num_shards)]
        return [j.result() for j in jobs]

    def _connection(self, shard: int) -> DataConnection | None:
        """The data-path connection to ``shard`` (opened on first use), or None to use gRPC."""
        if not (self.data_path and self.data_ports[shard]):
            return None
        conn = self._data[shard]
        if conn is None:
            host = self.addresses[shard].rpartition(":")[0].strip("[]")
            conn = self._data[shard] = DataConnection(host, self.data_ports[shard], self.worker_id,
                                                      self.plan.hash, self.token, self.request_timeout, self.tls)
        return conn

    def _drop_data(self, shard: int) -> None:
        conn, self._data[shard] = self._data[shard], None
        if conn is not None:
            conn.close()

    # -- calls --------------------------------------------------------------------
    def wait_ready(self, timeout: float) -> None:
        """Wait until every shard accepts connections, saying every few seconds which ones it waits
        for; fail naming the missing ones after ``timeout``, or raise :class:`Stopped` when asked to stop."""
        ready = [grpc.channel_ready_future(ch) for ch in self.channels]
        log.info("joining %d shard(s) at %s (waiting up to %.0fs)", len(self.addresses), ", ".join(self.addresses),
                 timeout)
        start = time.monotonic()
        deadline, report = start + timeout, start + WAIT_REPORT_SECONDS
        stop = self.stop if self.stop is not None else threading.Event()
        try:
            while True:
                missing = [self.addresses[k] for k, f in enumerate(ready) if not f.done()]
                if not missing:
                    return
                now = time.monotonic()
                if now >= deadline:
                    raise PSError(f"cannot reach shard(s) at {', '.join(missing)} within {timeout:.0f}s: is "
                                  "psgd-server running there, and is the address and port right?",
                                  grpc.StatusCode.UNAVAILABLE)
                if now >= report:
                    log.warning("waiting for shard(s) at %s (%.0fs of %.0fs)", ", ".join(missing), now - start,
                                timeout)
                    report = now + WAIT_REPORT_SECONDS
                if stop.wait(min(0.1, deadline - now)):
                    raise Stopped(f"asked to stop while waiting for shard(s) at {', '.join(missing)}")
        finally:
            for f in ready:
                f.cancel()

    def _register_request(self) -> ps_pb2.RegisterRequest:
        if self.identity is None:
            raise PSError("a worker registers with its job (PSClient(..., job=...)); an observer cannot register")
        return ps_pb2.RegisterRequest(worker_id=self.worker_id, plan_hash=self.plan.hash,
                                      plan_json=json.dumps(self.plan.description()),
                                      hostname=socket.gethostname(), pid=os.getpid(), clock=self.clock,
                                      job_json=json.dumps(self.identity))

    def _register_one(self, k: int) -> ps_pb2.RegisterReply:
        request = self._register_request()
        reply = self._retrying(k, "register", lambda: self.stubs[k].Register(request, timeout=self.request_timeout,
                                                                             metadata=self._metadata),
                               rejoin=False)
        expected = (k, self.plan.num_shards, self.identity["workers"])
        if (reply.shard, reply.num_shards, reply.num_workers) != expected:
            raise PSError(f"the shard at {self.addresses[k]}, listed as shard {k} of {self.plan.num_shards}, "
                          f"answered as shard {reply.shard} of {reply.num_shards} (with {reply.num_workers} "
                          f"worker(s), this worker expects {expected[2]}): each address must be that of its shard, "
                          "in shard order; is a psgd-server started with the wrong --shard?",
                          grpc.StatusCode.FAILED_PRECONDITION)
        if reply.data_port != self.data_ports[k]:
            self._drop_data(k)
        self.data_ports[k] = reply.data_port
        self.versions[k] = reply.version
        return reply

    def register(self) -> int:
        """Join every shard; returns the clock to continue from: the smallest any shard reports.

        A worker stopped between its pushes to two shards left them a clock apart; continuing from the
        larger would leave the other (under sync) waiting for a push that never comes.  From the smaller,
        the shard that has it already counts the push again as a duplicate (applied once)."""
        replies = self._on_all(self._register_one)
        self.lease_seconds = min(r.lease_seconds for r in replies)
        self.versions = [r.version for r in replies]
        self.clock = min(r.clock for r in replies)
        return self.clock

    def pull(self, clock: int, out: Mapping[str, np.ndarray]) -> list[int]:
        """Fill ``out`` (one host array per variable) with every shard's weights; returns shard versions."""
        flat = {name: a.reshape(-1) for name, a in out.items()}
        request = ps_pb2.PullRequest(worker_id=self.worker_id, clock=clock)

        def one(k: int) -> int:
            def call() -> int:
                conn = self._connection(k)
                if conn is not None:
                    return conn.pull(clock, [memoryview(flat[s.var][s.start:s.stop]).cast("B")
                                             for s in self.shard_slices[k]])
                slices = {s.id: s for s in self.shard_slices[k]}
                got = dict.fromkeys(slices, 0)
                version = 0
                stream = self.stubs[k].Pull(request, timeout=self.request_timeout, metadata=self._metadata)
                self._pull_calls.append(stream)
                try:
                    for chunk in stream:
                        sl = slices.get(chunk.slice_id)
                        if sl is None:
                            raise PSError(f"shard {k} at {self.addresses[k]} sent slice {chunk.slice_id}, which "
                                          "the plan does not place there")
                        item = np.dtype(sl.dtype).itemsize
                        values = np.frombuffer(chunk.data, dtype=sl.dtype)
                        begin = sl.start + chunk.offset // item
                        if chunk.offset % item or begin + len(values) > sl.stop:
                            raise PSError(f"shard {k} sent a malformed chunk for slice {sl.key}")
                        flat[sl.var][begin:begin + len(values)] = values
                        got[sl.id] += len(chunk.data)
                        version = chunk.version
                finally:
                    self._pull_calls.remove(stream)
                short = [slices[i].key for i, n in got.items() if n != slices[i].nbytes]
                if short:
                    raise PSError(f"shard {k} at {self.addresses[k]} sent incomplete slices: {', '.join(short[:3])}")
                return version

            return self._retrying(k, f"pull (clock {clock})", call)

        if self.stop is not None and self.stop.is_set():
            raise Stopped(f"asked to stop before the pull of clock {clock}")
        self._pulling = True
        try:
            self.versions = self._on_all(one)
        finally:
            self._pulling = False
        return self.versions

    def push(self, clock: int, grads: Mapping[str, np.ndarray]) -> list[ps_pb2.PushReply]:
        """Send every shard its slices of ``grads``; a retried push is applied once by the shard."""
        flat = {name: np.ascontiguousarray(g).reshape(-1) for name, g in grads.items()}

        def one(k: int) -> ps_pb2.PushReply:
            slices = self.shard_slices[k]
            dtype = slices[0].dtype if slices else "float32"
            if self.data_path and self.data_ports[k]:
                return self._push_data(k, clock, flat)
            def messages() -> Iterator[ps_pb2.PushMessage]:  # made anew for each attempt
                yield ps_pb2.PushMessage(header=ps_pb2.PushHeader(
                    worker_id=self.worker_id, clock=clock, base_version=self.versions[k], dtype=dtype))
                for sl in slices:
                    view = flat[sl.var][sl.start:sl.stop]
                    if view.dtype != np.dtype(sl.dtype):
                        raise PSError(f"gradient {sl.var} is {view.dtype}, the model's variable is {sl.dtype}")
                    for offset, piece in chunks(view):
                        yield ps_pb2.PushMessage(chunk=ps_pb2.TensorChunk(slice_id=sl.id, offset=offset,
                                                                          data=bytes(piece)))

            return self._retrying(k, f"push (clock {clock})",
                                  lambda: self.stubs[k].Push(messages(), timeout=self.request_timeout,
                                                             metadata=self._metadata))

        return self._on_all(one)

    def _push_data(self, k: int, clock: int, flat: Mapping[str, np.ndarray]) -> ps_pb2.PushReply:
        slices = self.shard_slices[k]
        for sl in slices:
            if flat[sl.var].dtype != np.dtype(sl.dtype):
                raise PSError(f"gradient {sl.var} is {flat[sl.var].dtype}, the model's variable is {sl.dtype}")
        if self.wire_dtype:
            payload, code = [self._pack(k, flat)], wire.WIRE_CODES[self.wire_dtype]
        else:
            payload, code = [memoryview(flat[s.var][s.start:s.stop]).cast("B") for s in slices], 0
        size = sum(memoryview(p).nbytes for p in payload)

        def call() -> ps_pb2.PushReply:
            outcome, version, next_clock, staleness = self._connection(k).push(
                clock, self.versions[k], code, payload, size)
            return ps_pb2.PushReply(outcome=outcome, next_clock=next_clock, version=version, staleness=staleness)

        return self._retrying(k, f"push (clock {clock})", call)

    def _pack(self, k: int, flat: Mapping[str, np.ndarray]) -> np.ndarray:
        """Compress shard ``k``'s slices of the gradient into a reused 16-bit buffer."""
        slices = self.shard_slices[k]
        total = sum(s.size for s in slices)
        packed = self._packed[k]
        if packed is None:
            packed = self._packed[k] = np.empty(total, dtype=np.uint16)
        at = 0
        for s in slices:
            src, dst = flat[s.var][s.start:s.stop], packed[at:at + s.size]
            if self.wire_dtype == "float16":
                np.copyto(dst.view(np.float16), src, casting="same_kind")
            else:
                wire.to_bfloat16(src, dst)
            at += s.size
        return packed

    def done(self) -> None:
        request = ps_pb2.DoneRequest(worker_id=self.worker_id, clock=self.clock)
        self._on_all(lambda k: self._retrying(k, "done", lambda: self.stubs[k].Done(request, timeout=self.request_timeout,
                                                                                metadata=self._metadata)))

    def status(self) -> list[ps_pb2.StatusReply]:
        return self._on_all(lambda k: self._retrying(
            k, "status", lambda: self.stubs[k].Status(ps_pb2.StatusRequest(), timeout=self.request_timeout,
                                         metadata=self._metadata)))

    # -- leases ---------------------------------------------------------------------
    def start_heartbeats(self) -> None:
        """Renew the lease on every shard from a background thread, three times per lease."""
        if self._beat is not None:
            return
        self._beat = threading.Thread(target=self._heartbeats, name="ps-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeats(self) -> None:
        while not self._beat_stop.wait(self.lease_seconds / 3):
            for k, stub in enumerate(self.stubs):
                try:
                    stub.Heartbeat(ps_pb2.HeartbeatRequest(worker_id=self.worker_id, clock=self.clock),
                                   metadata=self._metadata,
                                   timeout=max(1.0, self.lease_seconds / 3))
                except grpc.RpcError as err:
                    log.warning("heartbeat to shard %d at %s failed: %s", k, self.addresses[k], err.code().name)
                    if status.reason_of(err) == "NOT_REGISTERED" and not self._beat_stop.is_set():
                        self._rejoin(k)  # the lease is what heartbeats keep: a shard that dropped us hears back

    def _rejoin(self, k: int) -> None:
        """Register again with shard ``k`` from the heartbeat thread (it forgot this worker)."""
        log.warning("shard %d at %s dropped worker %d (paused or cut off past the lease?): registering again",
                    k, self.addresses[k], self.worker_id)
        try:
            self._register_one(k)
        except PSError as exc:
            log.warning("registering again with shard %d failed: %s", k, exc)

    def close(self) -> None:
        self._beat_stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for k in range(self.plan.num_shards):
            self._drop_data(k)
        for ch in self.channels:
            ch.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fetch_weights(addresses: Sequence[str], plan: PartitionPlan, timeout: float = 60.0,
                  token: str = "", tls: TLSFiles = NO_TLS) -> dict[str, np.ndarray]:
    """The current weights of a running job, read as an observer (never waits for a round)."""
    out = {s.name: np.empty(s.shape, dtype=s.dtype) for s in plan.specs}
    with PSClient(addresses, plan, -1, request_timeout=timeout, token=token, tls=tls) as client:
        client.pull(0, out)
    return out
