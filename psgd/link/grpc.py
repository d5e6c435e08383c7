"""A shard's gRPC port: the control link every worker's link holds, and the data link over gRPC.

The control link (:class:`ControlLink`) makes every call that is not a tensor's: register, heartbeat, done,
status, the listing of rows, rollback; each proves the token, and each after the registration carries its key.
The data link over gRPC (:class:`GrpcData`) carries the tensors through the control link's channel: a pull
streams :class:`TensorChunk` messages straight into the worker's arrays; a push streams a header and then each
slice's bytes (encoded by the push's codec) in chunks of :data:`psgd.wire.channel.CHUNK_BYTES`, from views of the
gradient, so no model-sized buffer is built per step.  It is the data link of ``[cluster] transport = "grpc"``,
and of every link to a shard that gives no data port.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc
import numpy as np

from psgd.compute.backend import Device
from psgd.errors import Code
from psgd.link.base import DataLink, Endpoint, LinkError, ProtocolError, PushReply, RowsIn, RowsOut
from psgd.proto import ps_pb2, ps_pb2_grpc
from psgd.wire import status
from psgd.wire.channel import chunks, open_channel
from psgd.wire.codec import Codec
from psgd.wire.rows import MAX_PULL_ROWS, blocks

T = TypeVar("T")


def _link_error(err: grpc.RpcError) -> LinkError:
    return LinkError(Code[err.code().name], err.details() or "", *status.error_info(err))


def _call(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except grpc.RpcError as err:
        raise _link_error(err) from None


class ControlLink:
    """The calls to one shard that go over gRPC whatever carries the tensors; its channel is the gRPC data link's."""

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint
        self.channel = open_channel(endpoint.address, endpoint.tls, endpoint.token)  # each call proves the token
        self.stub = ps_pb2_grpc.ParameterServerStub(self.channel)
        self.timeout = endpoint.request_timeout
        self.registration = ""  # the key of this worker's registration with the shard: every later call carries it

    def register(self, request: ps_pb2.RegisterRequest) -> ps_pb2.RegisterReply:
        reply = _call(lambda: self.stub.Register(request, timeout=self.timeout))
        self.registration = reply.registration
        return reply

    def heartbeat(self, clock: int, timeout: float) -> None:
        request = ps_pb2.HeartbeatRequest(
            worker_id=self.endpoint.worker_id, clock=clock, registration=self.registration
        )
        _call(lambda: self.stub.Heartbeat(request, timeout=timeout))

    def batch(self, clock: int, blocks: int) -> int:
        """The job's batch this worker trains at ``clock`` (shard 0 of a job with a range: psgd.data.blocks)."""
        request = ps_pb2.BatchRequest(
            worker_id=self.endpoint.worker_id, clock=clock, blocks=blocks, registration=self.registration
        )
        return _call(lambda: self.stub.Batch(request, timeout=self.timeout)).block

    def done(self, clock: int) -> None:
        request = ps_pb2.DoneRequest(worker_id=self.endpoint.worker_id, clock=clock, registration=self.registration)
        _call(lambda: self.stub.Done(request, timeout=self.timeout))

    def status(self) -> ps_pb2.StatusReply:
        return _call(lambda: self.stub.Status(ps_pb2.StatusRequest(), timeout=self.timeout))

    def list_rows(self, table: str, start: int) -> ps_pb2.ListRowsReply:
        """A page of the rows of ``table`` the shard holds, from ``start`` (0, then a reply's ``next``)."""
        request = ps_pb2.ListRowsRequest(table=table, start=start)
        return _call(lambda: self.stub.ListRows(request, timeout=self.timeout))

    def rollback(self, version: int, cause: str, dry_run: bool = False) -> ps_pb2.RollbackReply:
        """Take the shard back to its cut at ``version`` (once per ``cause``: the incarnation of the shard of the job
        that restarted from a cut), or list its cuts (``dry_run``)."""
        request = ps_pb2.RollbackRequest(
            worker_id=self.endpoint.worker_id,
            to_version=version,
            cause=cause,
            dry_run=dry_run,
            registration=self.registration,
        )
        return _call(lambda: self.stub.Rollback(request, timeout=self.timeout))

    def close(self) -> None:
        self.channel.close()


class GrpcData(DataLink):
    """Tensors in protobuf chunks, over the control link's channel."""

    via = "grpc"

    def __init__(self, control: ControlLink, device: Device):
        super().__init__(control, device)
        self._streams: list = []  # pull streams in flight, cancelled by interrupt()
        self._interrupted = False
        self._lock = threading.Lock()

    def pull(self, clock: int, views: list[memoryview], rows: RowsOut | None = None) -> int:
        ep = self.endpoint
        rows = {t: r for t, r in (rows or {}).items() if len(r[0])}
        asking = sum(len(r[0]) for r in rows.values())
        if asking > MAX_PULL_ROWS:
            raise ProtocolError(
                f"a pull may ask shard {ep.shard} for at most {MAX_PULL_ROWS:,} rows, this one asks "
                f"for {asking:,}: use a smaller batch, or more shards"
            )
        asked = [ps_pb2.RowBlock(table=t, ids=part) for t, (ids, _) in rows.items() for part, _ in blocks(ids)]
        control = self.control
        stream = control.stub.Pull(
            ps_pb2.PullRequest(worker_id=ep.worker_id, clock=clock, rows=asked, registration=control.registration),
            timeout=control.timeout,
        )
        with self._watched(stream):
            return self._fill(self._chunks(stream), views, rows)

    @contextlib.contextmanager
    def _watched(self, stream):
        """While a stream of weights comes: :meth:`interrupt` cancels it."""
        with self._lock:
            self._streams.append(stream)
            if self._interrupted:  # the stop came while this pull was being started
                stream.cancel()
        try:
            yield stream
        finally:
            with self._lock:
                self._streams.remove(stream)

    def _fill(self, stream: Iterator[ps_pb2.TensorChunk], views: list[memoryview], rows: RowsOut) -> int:
        """Put the chunks of ``stream`` into ``views`` (slice order) and ``rows``; the version they are of."""
        ep = self.endpoint
        targets = {sl.id: (sl, np.frombuffer(view, dtype=sl.dtype)) for sl, view in zip(ep.slices, views)}
        got = dict.fromkeys(targets, 0)
        version = 0
        filled = dict.fromkeys(rows, 0)  # rows of each table received so far, in the order asked
        for chunk in stream:
            if chunk.HasField("rows"):
                self._fill_rows(chunk.rows, rows, filled)
                continue
            target = targets.get(chunk.slice_id)
            if target is None:
                raise ProtocolError(
                    f"shard {ep.shard} at {ep.address} sent slice {chunk.slice_id}, which the plan does not place there"
                )
            sl, out = target
            values = np.frombuffer(chunk.data, dtype=sl.dtype)
            begin, rem = divmod(chunk.offset, out.itemsize)
            if rem or begin + len(values) > len(out):
                raise ProtocolError(f"shard {ep.shard} sent a malformed chunk for slice {sl.key}")
            out[begin : begin + len(values)] = values
            got[sl.id] += len(chunk.data)
            version = chunk.version
        short = [targets[i][0].key for i, n in got.items() if n != targets[i][0].nbytes]
        short += [f"table {t}" for t, n in filled.items() if n != len(rows[t][0])]
        if short:
            raise ProtocolError(f"shard {ep.shard} at {ep.address} sent incomplete slices: {', '.join(short[:3])}")
        return version

    def _fill_rows(self, block: ps_pb2.RowBlock, rows: RowsOut, filled: dict[str, int]) -> None:
        """Put a block of a pull's rows where they were asked for, once they are the ones asked for."""
        ep = self.endpoint
        if block.table not in rows:
            raise ProtocolError(f"shard {ep.shard} at {ep.address} sent rows of table {block.table!r}, not asked for")
        ids, out = rows[block.table]
        at = filled[block.table]
        got = np.frombuffer(block.ids, dtype="<i8")
        values = np.frombuffer(block.values, dtype=out.dtype)
        if (
            at + got.size > len(ids)
            or not np.array_equal(got, ids[at : at + got.size])
            or values.size != got.size * out.shape[1]
        ):
            raise ProtocolError(
                f"shard {ep.shard} at {ep.address} sent rows of table {block.table!r} other than those asked for"
            )
        out[at : at + got.size] = values.reshape(got.size, out.shape[1])
        filled[block.table] = at + got.size

    @staticmethod
    def _chunks(stream) -> Iterator[ps_pb2.TensorChunk]:
        try:
            yield from stream
        except grpc.RpcError as err:
            raise _link_error(err) from None

    def _messages(
        self, clock: int, base_version: int, codec: Codec, parts: list[memoryview], rows: RowsIn | None
    ) -> Iterator[ps_pb2.PushMessage]:
        """A push's stream: its header, each slice's chunks, the rows' blocks."""
        ep = self.endpoint
        dtype = codec.name if codec.compresses else (ep.slices[0].dtype if ep.slices else "float32")
        yield ps_pb2.PushMessage(
            header=ps_pb2.PushHeader(
                worker_id=ep.worker_id,
                clock=clock,
                base_version=base_version,
                dtype=dtype,
                rows=sum(len(ids) for ids, _ in (rows or {}).values()),
                registration=self.control.registration,
            )
        )
        for sl, part in zip(ep.slices, parts):
            for offset, piece in chunks(part):
                yield ps_pb2.PushMessage(chunk=ps_pb2.TensorChunk(slice_id=sl.id, offset=offset, data=bytes(piece)))
        for table, (ids, values) in (rows or {}).items():
            for part_ids, part_values in blocks(ids, values):
                yield ps_pb2.PushMessage(rows=ps_pb2.RowBlock(table=table, ids=part_ids, values=part_values))

    def push(
        self, clock: int, base_version: int, codec: Codec, parts: list[memoryview], rows: RowsIn | None = None
    ) -> PushReply:
        control = self.control
        reply = _call(
            lambda: control.stub.Push(self._messages(clock, base_version, codec, parts, rows), timeout=control.timeout)
        )
        return PushReply(reply.outcome, reply.next_clock, reply.version, reply.staleness)

    def push_pull(
        self, clock: int, base_version: int, codec: Codec, parts: list[memoryview], views: list[memoryview]
    ) -> tuple[PushReply, int | None]:
        control = self.control
        stream = control.stub.PushPull(self._messages(clock, base_version, codec, parts, None), timeout=control.timeout)
        received = self._chunks(stream)
        first = next(received, None)  # an error before it: the push's
        if first is None or not first.HasField("pushed"):
            raise ProtocolError(
                f"shard {self.endpoint.shard} at {self.endpoint.address} did not answer a push "
                "and pull with the push's reply"
            )
        p = first.pushed
        reply = PushReply(p.outcome, p.next_clock, p.version, p.staleness)
        with self._watched(stream):  # the pull half, not the push, is cut by interrupt()
            try:
                return reply, self._fill(received, views, {})
            except LinkError:  # the push was applied; the weights are pulled on their own
                return reply, None

    def interrupt(self) -> None:
        with self._lock:
            self._interrupted = True  # for good: the worker is stopping, no pull of this link is waited for
            streams = list(self._streams)
        for stream in streams:
            stream.cancel()
