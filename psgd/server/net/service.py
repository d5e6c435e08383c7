"""The gRPC face of a shard: a thin servicer over :class:`ShardCore`, health checking, lease reaper.

``ShardServer(core, bind)`` builds the server (port 0 picks a free port);
``start()`` serves, ``stop()`` reports NOT_SERVING, wakes waiting pulls and
stops within a grace period.  Tests and the ``psgd-server`` command share it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from psgd import wire
from psgd.proto import ps_pb2, ps_pb2_grpc
from psgd.server.durable import peers, recovery
from psgd.server.errors import ShardError
from psgd.server.net import tokens
from psgd.server.net.assembly import PushAssembler
from psgd.server.net.datapath import DataServer, transfer_seconds
from psgd.server.net.handler import PullRequest, PushRequest, RequestHandler
from psgd.server.net.listen import GRPC_IDLE_SECONDS, PortTaken, free_to_listen, grpc_connection_cap
from psgd.server.net.watchdog import Turns, Watchdog
from psgd.server.state import checkpoint
from psgd.server.state.core import ShardCore
from psgd.wire import proofs, segment, status
from psgd.wire.channel import CHANNEL_OPTIONS, SERVICE_NAME, chunks, server_credentials
from psgd.wire.rows import RowCollector, RowsError, blocks
from psgd.wire.tls import NO_TLS, TLSFiles

log = logging.getLogger(__name__)


#: Control calls (register, heartbeat, done, status, health) keep this many of the server's threads: pulls and
#: pushes past the rest are refused with RESOURCE_EXHAUSTED, which workers retry with backoff.
CONTROL_THREADS = 4
#: Calls at once on one connection (HTTP/2 streams): a worker's channel carries a pull, a push, a heartbeat.
STREAMS_PER_CONNECTION = 16


def _remaining(context: grpc.ServicerContext, cap: float) -> float:
    left = context.time_remaining()
    return cap if left is None else max(0.0, min(cap, left - 0.05))


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    """Maps RPCs onto the core; every ShardError becomes its status code."""

    def __init__(
        self,
        core: ShardCore,
        incarnation: str,
        request_timeout: float,
        data_port: int = 0,
        host_id: str = "",
        threads: int = 16,
        token: str = "",
    ):
        self.core, self.incarnation, self.data_port, self.host_id, self.token = (
            core,
            incarnation,
            data_port,
            host_id,
            token,
        )  # token: Status' proof
        self.request_timeout = request_timeout
        self.requests = RequestHandler(core)
        self._row_shapes = core.tables.shapes()
        self.data_calls = threading.BoundedSemaphore(max(1, threads - CONTROL_THREADS))  # pulls and pushes at once
        self.watchdog = Watchdog(f"shard{core.shard}-watchdog")
        #: Rollback's body (the request, and where it came from): its ShardServer's, which knows the checkpoint
        #: folder and the job's shards
        self.rollback: Callable[[ps_pb2.RollbackRequest, str], ps_pb2.RollbackReply] = self._keeps_no_cuts

    def _keeps_no_cuts(self, request: ps_pb2.RollbackRequest, peer: str) -> ps_pb2.RollbackReply:
        raise ShardError("FAILED_PRECONDITION", f"shard {self.core.shard} keeps no cuts to go back to")

    @property
    def transfer_seconds(self) -> float:
        """How long a pull's bytes may take to go, or a push to arrive (psgd.server.net.datapath's rule)."""
        return transfer_seconds(self.core.nbytes, self.request_timeout)

    def Register(self, request, context):
        worker = request.worker_id
        try:
            if request.any_rank:  # psgd-worker --rank auto: shard 0 gives it a rank
                args = (request.plan_hash, request.plan_json, request.hostname, request.pid, request.job_json)
                worker = self.core.lobby.take_rank(*args, request.incarnation)
            clock = self.core.register(
                worker,
                request.plan_hash,
                request.plan_json,
                request.hostname,
                request.pid,
                request.clock,
                request.job_json,
                request.incarnation,
            )
        except ShardError as err:
            status.refuse(context, err)
        core = self.core
        if not core.roster.held_by(worker, request.incarnation):  # another process took it since
            status.refuse(
                context, ShardError("ABORTED", "the registration was taken over as it was answered; register again")
            )
        held = core.roster.workers[worker]
        cut = core.rewind.cut_asked.pop(worker, None)  # this shard restarted from a cut behind the worker
        return ps_pb2.RegisterReply(
            worker_id=worker,
            clock=clock,
            lease_seconds=core.roster.lease_seconds,
            shard=core.shard,
            num_shards=core.plan.num_shards,
            num_workers=core.num_workers,
            policy=core.policy.name,
            incarnation=self.incarnation,
            version=core.version,
            data_port=self.data_port,
            host_id=self.host_id,
            registration=held.key,
            **({"rollback_to": cut} if cut is not None else {}),
        )

    def Rollback(self, request, context):
        try:
            return self.rollback(request, context.peer())
        except ShardError as err:
            status.refuse(context, err)

    def _data_call(self, context, what: str, seconds: float = float("inf")) -> int:
        """Take one of the threads data calls may use (else RESOURCE_EXHAUSTED: the control calls keep theirs);
        returns the call's key for the watchdog, which cancels it after ``seconds``.  :meth:`_end_call` gives
        both back."""
        if not self.data_calls.acquire(blocking=False):
            status.refuse(
                context,
                ShardError(
                    "RESOURCE_EXHAUSTED",
                    f"shard {self.core.shard} serves as many pulls and pushes at once as it has threads for; try again",
                ),
            )
        return self.watchdog.watch(seconds, context, what)

    def _end_call(self, key: int) -> None:
        self.watchdog.done(key)
        self.data_calls.release()

    def Pull(self, request, context):
        what = f"shard {self.core.shard}: gRPC pull by worker {request.worker_id}"
        key = self._data_call(context, what)
        try:
            yield from self._weights(request, request.clock, request.rows, context, key, what)
        finally:
            self._end_call(key)

    def _weights(self, asker, clock: int, blocks_asked, context, key: int, what: str):
        """The chunks of a pull of ``clock`` by ``asker`` (its worker_id and registration; and of the rows
        ``blocks_asked`` names), once the policy lets it go; the watchdog of call ``key`` bounds the time they take."""
        try:
            asked = RowCollector(self._row_shapes, False, f"pull by worker {asker.worker_id}")
            for block in blocks_asked:
                asked.add(block.table, block.ids, block.values)
            ids = asked.lookups()
            pulled = self.requests.pull(
                PullRequest(
                    asker.worker_id,
                    clock,
                    _remaining(context, self.request_timeout),
                    asker.registration,
                    ids,
                    cancelled=lambda: not context.is_active(),
                )
            )
        except RowsError as err:
            status.refuse(context, ShardError("INVALID_ARGUMENT", str(err)))
        except ShardError as err:
            status.refuse(context, err)
        snap, rows = pulled.read, pulled.rows
        row_bytes = sum(v.nbytes for v in rows.values())  # its bytes, the rows' too, must go by then
        self.watchdog.watch(transfer_seconds(self.core.nbytes + row_bytes, self.request_timeout), context, what, key)
        with pulled:
            for slice_id, payload in snap.data.items():
                for offset, piece in chunks(payload):
                    yield ps_pb2.TensorChunk(slice_id=slice_id, offset=offset, data=bytes(piece), version=snap.version)
            for table, values in rows.items():
                for part_ids, part_values in blocks(ids[table], values):
                    yield ps_pb2.TensorChunk(
                        version=snap.version, rows=ps_pb2.RowBlock(table=table, ids=part_ids, values=part_values)
                    )

    def Push(self, request_iterator, context):
        what = f"shard {self.core.shard}: gRPC push"
        key = self._data_call(context, what, self.transfer_seconds)  # the whole push must arrive by then
        try:
            return self._received(request_iterator, context, key, what)[0]
        finally:
            self._end_call(key)

    def PushPull(self, request_iterator, context):
        what = f"shard {self.core.shard}: gRPC push and pull"
        key = self._data_call(context, what, self.transfer_seconds)
        try:
            reply, header = self._received(request_iterator, context, key, what)
            yield ps_pb2.TensorChunk(pushed=reply)
            self.watchdog.watch(float("inf"), context, what, key)  # the pull bounds its own wait, as Pull's
            yield from self._weights(header, header.clock + 1, (), context, key, what)
        finally:
            self._end_call(key)

    def _received(self, request_iterator, context, key: int, what: str):
        """A push's stream received and applied: its reply and its header."""
        try:
            return self._push(request_iterator, context, key, what)
        except grpc.RpcError:  # cancelled by the watchdog, or by the client
            status.refuse(
                context, ShardError("DEADLINE_EXCEEDED", f"push did not arrive within {self.transfer_seconds:.1f}s")
            )

    def _push(self, request_iterator, context, key: int, what: str):
        began, row_bytes = time.monotonic(), 0
        try:
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise ShardError("INVALID_ARGUMENT", "a push must start with a header")
            header = first.header
            self.requests.admit(header.worker_id, header.registration)  # a push as another's is not received
            assembler = PushAssembler(self.core, header.dtype)
            rows = RowCollector(self._row_shapes, True, f"push from worker {header.worker_id}", assembler.codec)
            for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "rows":
                    rows.add(message.rows.table, message.rows.ids, message.rows.values)
                    # rows come beside the slices: the deadline, counted from the start, allows for their bytes
                    # too (at the same least rate, so a trickled push is cut off all the same)
                    row_bytes += len(message.rows.ids) + len(message.rows.values)
                    allowed = transfer_seconds(self.core.nbytes + row_bytes, self.request_timeout)
                    self.watchdog.watch(began + allowed - time.monotonic(), context, what, key)
                    continue
                if kind != "chunk":
                    raise ShardError("INVALID_ARGUMENT", "a push has exactly one header, at the start")
                chunk = message.chunk
                assembler.add(chunk.slice_id, chunk.offset, chunk.data)
            if not context.is_active():  # the stream was cut (a message over the size limit ends it quietly)
                raise ShardError("CANCELLED", "the push was cut off before its end; nothing was applied")
            pushed = rows.rows()
            got = sum(ids.size for ids, _ in pushed.values())
            if got != header.rows:  # it may end quietly before the call is seen to end: count what came
                raise ShardError(
                    "INVALID_ARGUMENT",
                    f"the push said it carries {header.rows} rows and {got} came; nothing was applied",
                )
            result = self.requests.push(
                PushRequest(
                    header.worker_id,
                    header.clock,
                    header.base_version,
                    assembler.finish(),
                    assembler.received,
                    header.registration,
                    pushed,
                )
            )
        except RowsError as err:
            status.refuse(context, ShardError("INVALID_ARGUMENT", str(err)))
        except ShardError as err:
            status.refuse(context, err)
        return ps_pb2.PushReply(
            outcome=result.outcome, next_clock=result.next_clock, version=result.version, staleness=result.staleness
        ), header

    def Heartbeat(self, request, context):
        try:
            self.core.heartbeat(request.worker_id, request.clock, request.registration)
        except ShardError as err:
            status.refuse(context, err)
        return ps_pb2.HeartbeatReply(lease_seconds=self.core.roster.lease_seconds, version=self.core.version)

    def Batch(self, request, context):
        try:
            block = self.core.lobby.batch(request.worker_id, request.clock, request.blocks, request.registration)
        except ShardError as err:
            status.refuse(context, err)
        return ps_pb2.BatchReply(block=block)

    def Done(self, request, context):
        try:
            live = self.core.done(request.worker_id, request.clock, request.registration)
        except ShardError as err:
            status.refuse(context, err)
        return ps_pb2.DoneReply(live_workers=live)

    def ListRows(self, request, context):
        key = self._data_call(context, f"shard {self.core.shard}: a listing of table {request.table!r}")
        try:
            ids, values, after, version = self.core.list_rows(request.table, request.start, request.max_rows)
        except ShardError as err:
            status.refuse(context, err)
        finally:
            self._end_call(key)
        return ps_pb2.ListRowsReply(
            rows=ps_pb2.RowBlock(table=request.table, ids=ids.astype("<i8").tobytes(), values=values.tobytes()),
            next=after,
            version=version,
        )

    def Status(self, request, context):
        s = self.core.status()
        counters = {
            **s["counters"],
            "tables": s.get("tables", {}),
            **{
                k: s[k] for k in ("checkpoint", "restored_version", "reads", "rewinding", "last_cause", "workers_range")
            },
        }
        reply = ps_pb2.StatusReply(
            shard=s["shard"],
            num_shards=s["num_shards"],
            policy=s["policy"],
            version=s["version"],
            workers=[ps_pb2.WorkerStatus(**w) for w in s["workers"]],
            plan_hash=s["plan_hash"],
            bytes_held=s["bytes_held"],
            counters_json=json.dumps(counters),
            staleness_histogram=s["staleness_histogram"],
            incarnation=self.incarnation,
            data_port=self.data_port,
            role=s["role"],
            replica_lag=s["replica_lag"],
        )
        pair = self.core.replication
        reply.follower = pair.follower if pair is not None else ""
        mine = request.ticket if pair is not None and request.ticket and request.ticket == pair.ticket else ""
        reply.proof = proofs.answer(self.token, request.challenge, *proofs.status_said(reply), *filter(None, [mine]))
        return reply


class ShardServer:
    """A shard served over gRPC, with health checking and a lease reaper thread."""

    def __init__(
        self,
        core: ShardCore,
        bind: str = "127.0.0.1:0",
        *,
        request_timeout: float = 60.0,
        threads: int | None = None,
        transport: str = "auto",
        data_port: int = 0,
        interceptors: Sequence[grpc.ServerInterceptor] = (),
        token: str = "",
        checkpoint_dir: str | None = None,
        checkpoint_seconds: float = 30.0,
        keep_checkpoints: int = 3,
        tls: TLSFiles = NO_TLS,
        hello_timeout: float = 2.0,
        replicated: bool = False,
        busy_poll: float = 0.0,
        on_cut_failure: str = "stop",
        job_shards: Callable[[], Sequence[str]] = tuple,
    ):
        self.core = core
        #: the addresses of the job's shards and replicas now ([cluster] servers, replica_servers): where the cause
        #: of a rollback is checked
        self.job_shards = job_shards
        self._refusals = recovery.Refusals(core)
        self.checkpoint_dir = checkpoint_dir
        self._failures = recovery.Failures(core, stop=on_cut_failure == "stop")
        self.checkpoint_seconds, self.keep_checkpoints = checkpoint_seconds, keep_checkpoints
        host = bind.rpartition(":")[0]
        here = tokens.Here(host, job_shards)  # a proof is good only at the port it names: this one's, once bound
        if token:
            interceptors = [tokens.TokenInterceptor(token, here, lambda: self.port), *interceptors]
        self.incarnation = uuid.uuid4().hex[:12]
        means = wire.meaning(transport)  # a data port or none; shared memory for workers on this host or not
        try:
            self.data = (
                DataServer(
                    core,
                    host.strip("[]") or "127.0.0.1",
                    data_port,
                    token=token,
                    here=here,
                    request_timeout=request_timeout,
                    hello_timeout=hello_timeout,
                    tls=tls.server_context() if tls.enabled else None,
                    shm=bool(means["shared_memory"]),
                    busy_poll=busy_poll,
                )
                if means["data_port"] or replicated
                else None
            )
        except OSError as exc:
            raise PortTaken("data port", f"{host}:{data_port}", data_port, exc.strerror or str(exc)) from None
        shares = self.data is not None and self.data.shm
        threads = threads or max(16, 4 * core.num_workers + 8)
        # connections that have not proven the token are bounded: in number, and by the hello deadline to finish
        # their handshake (psgd.server.net.listen)
        self.connection_cap, short = grpc_connection_cap(self.data.descriptors if self.data else 0, core.num_workers)
        if short:
            log.warning("shard %d: %s", core.shard, short)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"shard{core.shard}"),
            options=[
                *CHANNEL_OPTIONS,
                ("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION),
                ("grpc.max_allowed_incoming_connections", self.connection_cap),
                ("grpc.server_handshake_timeout_ms", max(1, int(hello_timeout * 1000))),
                ("grpc.max_connection_idle_ms", int(GRPC_IDLE_SECONDS * 1000)),
            ],
            maximum_concurrent_rpcs=threads * 4,
            interceptors=list(interceptors),
        )
        self.servicer = ParameterServerServicer(
            core,
            self.incarnation,
            request_timeout,
            self.data.port if self.data else 0,
            segment.host_id() if shares else "",
            threads,
            token,
        )
        self.servicer.rollback = self._rollback
        ps_pb2_grpc.add_ParameterServerServicer_to_server(self.servicer, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.tls = tls
        try:
            free_to_listen(bind)
            self.port = (
                self.server.add_secure_port(bind, server_credentials(tls))
                if tls.enabled
                else self.server.add_insecure_port(bind)
            )
            if self.port == 0:  # older grpcio says so; newer raises
                raise RuntimeError("no port added")
        except (OSError, RuntimeError) as exc:
            if self.data is not None:
                self.data.stop()  # its port and shared memory: nothing started yet
            why = exc.why if isinstance(exc, PortTaken) else "in use, or the address is not on this machine"
            raise PortTaken("gRPC port", bind, int(bind.rpartition(":")[2]), why) from None
        self.address = f"{host}:{self.port}"
        self._stop = threading.Event()
        self._survive = Turns(core, "background_errors")
        self._reaper = threading.Thread(target=self._reap, name=f"shard{core.shard}-leases", daemon=True)
        self._checkpointer = threading.Thread(
            target=self._checkpoints, name=f"shard{core.shard}-checkpoints", daemon=True
        )

    def start(self) -> ShardServer:
        self.servicer.watchdog.start()
        self.server.start()
        if self.data:
            self.data.start()
        self._reaper.start()
        if self.checkpoint_dir and self.core.cut_rounds:  # at each cut, in the round's closing (under the lock)
            self.core.on_cut = lambda: self.save_checkpoint(held=True)
            # and the cut before the newest: another shard killed before it wrote the newest comes back from that
            self.keep_checkpoints = max(2, self.keep_checkpoints)
            if self.core.version == 0:
                self.save_checkpoint()  # the initial weights are a cut too, for a shard lost before the first
        elif self.checkpoint_dir:
            self._checkpointer.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "shard %d of %d serving on %s, data port %s (%s; policy %s, %d workers, %d slices, %.1f MB)",
            self.core.shard,
            self.core.plan.num_shards,
            self.address,
            self.data.port if self.data else "none",
            "mutual TLS" if self.tls.ca else "TLS" if self.tls.enabled else "plaintext",
            self.core.policy.name,
            self.core.num_workers,
            len(self.core.slices),
            sum(w.nbytes for w in self.core.weights.values()) / 1e6,
        )
        return self

    def _rollback(self, request: ps_pb2.RollbackRequest, peer: str) -> ps_pb2.RollbackReply:
        """Go back to the cut of ``request.to_version`` (psgd.server.durable.recovery.rollback), or list the cuts
        held."""
        core = self.core
        self.servicer.requests.admit(request.worker_id, request.registration)  # only a registered worker
        if not (self.checkpoint_dir and core.cut_rounds):
            raise ShardError(
                "FAILED_PRECONDITION",
                f"shard {core.shard} keeps no cuts to go back to (it needs a "
                "checkpoint folder and [cluster] checkpoint_rounds under sync)",
            )
        folder = checkpoint.shard_dir(self.checkpoint_dir, core.shard, core.fingerprint)
        if request.dry_run:
            return ps_pb2.RollbackReply(version=core.version, cuts=recovery.cuts(core, folder))
        undone = recovery.rollback(
            core,
            folder,
            request.to_version,
            request.cause,
            request.worker_id,
            unproven=lambda: (
                recovery.own_restart(core, request.to_version)
                if request.cause == self.incarnation
                else peers.restart_of(
                    list(self.job_shards()),
                    request.cause,
                    request.to_version,
                    core.shard,
                    self.servicer.token,
                    self.tls,
                )
            ),
            key=checkpoint.signing_key(self.servicer.token),
            refusals=self._refusals,
            peer=peer,
        )
        return ps_pb2.RollbackReply(version=core.version, rounds_undone=undone)

    def _reap(self) -> None:
        period = max(0.05, min(1.0, self.core.roster.lease_seconds / 4))
        while not self._stop.wait(period):
            self._survive("the lease reaper", self.core.expire_leases)

    def _checkpoints(self) -> None:
        def turn() -> None:
            last = self.core.whole.last_checkpoint
            if last is None or time.time() - last[1] >= self.checkpoint_seconds:
                self.save_checkpoint()

        while not self._stop.wait(min(1.0, self.checkpoint_seconds)):
            self._survive("the checkpoint loop", turn)

    def save_checkpoint(self, force: bool = False, held: bool = False) -> bool:
        """Write a checkpoint now (if there is a checkpoint folder; ``held``: the caller holds the core's lock);
        a failure is logged, not raised.  False when it failed."""
        if not self.checkpoint_dir or self.core.role in ("replica", "starting"):  # a replica's state is its primary's
            return True
        try:
            folder = checkpoint.shard_dir(self.checkpoint_dir, self.core.shard, self.core.fingerprint)
            path = recovery.write(
                self.core,
                folder,
                self.keep_checkpoints,
                force=force,
                held=held,
                key=checkpoint.signing_key(self.servicer.token),
            )
        except checkpoint.CheckpointError as exc:
            self._failures.failed(exc, cut=bool(self.core.cut_rounds))  # each one a cut, then
            return False
        self._failures.written(path)
        if path:
            log.debug("shard %d: checkpoint %s", self.core.shard, path)
        return True

    def wait_finished(self, timeout: float | None = None, settle: float = 0.0) -> bool:
        """Block until every worker is done or was dropped ``settle`` seconds ago (or ``timeout``);
        True when finished."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.core.finished(settle):
            if self._stop.is_set():
                return False
            left = 1.0 if end is None else min(1.0, end - time.monotonic())
            if left <= 0:
                return False
            self.core.wait_serving_changed(left)
        return True

    def stop(self, grace: float = 5.0) -> bool:
        """NOT_SERVING, let in-flight calls finish (within ``grace``), write a last checkpoint, stop.
        False when that checkpoint could not be written."""
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._stop.set()
        self.core.close()
        if self.data:
            self.data.stop()
        self.server.stop(grace).wait(grace + 1)
        self.servicer.watchdog.stop()
        if self._checkpointer.is_alive():
            self._checkpointer.join(grace + 30)
        return self.save_checkpoint()
