"""The same-host link: pulls and pushes through shared memory, requests and replies over the data port.

When a worker and a shard run on one host, their bytes need not cross a socket.  The shard says at
registration who it may share memory with (:func:`psgd.wire.segment.host_id`: the boot id and the pid
and network namespaces); a worker with the same identity asks, in the hello of each of its two data
connections (pull and push) for shared memory: its pull connection is given the shard's weights
segment, its push connection a segment of its own (:mod:`psgd.wire.segment`).  From then on:

- a pull is its request header on the socket; the shard takes a live read of its weights, which live in
  a shared segment that the worker has mapped read-only (two slots, :mod:`psgd.server.store`), and
  replies with the version, the slot that holds it and the slot's sequence number; the worker copies
  them out into its arrays, checks that the sequence number has not changed, and sends a release.  No
  update touches the slot between the reply and the release unless the worker held it past its
  deadline; then the changed number says the copy is torn, and the worker pulls again over a new
  connection (the shard has closed this one).
- rows of embedding tables go over the socket, a pull's after its reply, a push's after its header;
- a push is the gradient, encoded by the job's codec, written into the push segment, then its header
  on the socket; the shard checks it there (size, NaN; a compressed one is first decoded into a receive
  buffer) and applies it exactly as a push over TCP: the same policies, the same exactly-once rule for a
  retried clock.

A shard on another host, in another container or namespace, or one that offers no shared memory
(``[cluster] transport = "tcp"`` on its side), is reached over the data port instead, with one log
line saying why (a warning where the job asked for ``transport = "shm"``).  Errors, retries and
reconnections are the TCP link's (:mod:`psgd.link.tcp`).

A worker on a GPU registers its mappings of both segments with the device's driver (page-locked, as pinned
memory is: :func:`psgd.compute.backend.register_host`) for as long as their connection lasts, and while every shard shares
memory with it, copies its pulls from the weights segment to the device and its (uncompressed) pushes from the
device into its push segment directly, instead of through pinned buffers on the host: one copy each way, by
DMA.  A pull's copy to the device is waited for before the sequence number is checked again, as a copy on the
host is.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import numpy as np

from psgd.compute import backend
from psgd.wire.codec import Codec
from psgd.errors import TransportError
from psgd.link.base import Endpoint, PushReply, RowsIn, RowsOut
from psgd.link.tcp import DataConnection, TcpLink
from psgd.proto import ps_pb2
from psgd.wire import meaning, protocol, segment
from psgd.wire.sweep import PARALLEL_BYTES, Sweep

log = logging.getLogger(__name__)

#: Under ``transport = "auto"``, a shard whose slices take fewer bytes is reached over its data port: a step of
#: a small model over the socket costs less than one through shared memory, which adds the release a step and the
#: shard's wake-up for it (78 KB: 490 against 640 us a step; 300 KB: 900 against 770; benchmarks/RESULTS.md).
SHARED_FROM_BYTES = 128 << 10


class NoSegment(TransportError):
    """The shard gave no segment, or it cannot be mapped here: use the data port as it is."""


class ShmConnection(DataConnection):
    """A data connection whose bytes go through a shared-memory segment (``purpose``: pull or push), registered
    with the driver of ``device`` while the connection lasts where that is a GPU."""

    def __init__(self, host: str, port: int, worker: int, plan_hash: str, token: str, timeout: float, tls,
                 purpose: str, nbytes: int, device: backend.Device = backend.CPU, busy_poll: float = 0.0,
                 key: str = ""):
        super().__init__(host, port, worker, plan_hash, token, timeout, tls, shm=purpose, busy_poll=busy_poll,
                         key=key)
        try:
            if "name" not in self.offer:
                raise NoSegment(str(self.offer.get("refused", "the shard offered no shared-memory segment")))
            if self.offer.get("bytes") != nbytes:
                raise NoSegment(f"the shard offered a segment of {self.offer.get('bytes')} bytes, its slices "
                                f"take {nbytes}")
            try:
                self.seg = segment.attach(self.offer, nbytes, writable=purpose == "push")
            except segment.SegmentError as exc:
                raise NoSegment(str(exc)) from None
        except NoSegment:
            super().close()
            raise
        self.device = device
        #: the segment's registration with the GPU's driver (None on a CPU, or where the driver refused it)
        self.registered = backend.register_host(*self.seg.address(), device, read_only=purpose == "pull") \
            if device.is_gpu else None
        if self.registered is not None:
            log.debug("%s registered with %s's driver (%.1f MB)", self.seg.name, device, self.registered.nbytes / 1e6)

    def pull(self, clock: int, into: list[memoryview], rows: RowsOut | None = None, device: list | None = None) -> int:
        """Ask for the weights of ``clock`` (and the rows of ``rows``); once the shard has replied (holding its
        updates back) with the rows' values, copy the weights out of its weights segment and release them.
        ``device`` (device arrays, one per view of ``into``, of its size) takes the weights instead of ``into``,
        copied to the GPU straight from the segment, the copies finished before the sequence number is checked."""
        return self._take(self._ask(clock, rows, into), into, device)

    def _take(self, answer: tuple[int, int, int, list], into: list[memoryview], device: list | None = None,
              weights: segment.Segment | None = None) -> int:
        """Copy the weights of a pull's ``answer`` out of the weights segment (``weights``: that of this link's pull
        connection, for the pull half of a push-and-pull on its push connection), and release them."""
        version, slot, seq, values = answer
        seg = self.seg if weights is None else weights
        if sum(v.nbytes for v in into) > seg.size or not 0 <= slot < seg.slots:
            raise protocol.WireError(f"the shard holds the weights in slot {slot} of {seg.slots}, of "
                                     f"{seg.size} bytes: the plan's do not fit")
        for view in values:  # the rows come over the connection
            protocol.recv_exact(self.sock, view)
        source, at = seg.slot(slot), 0
        if device is None:
            pairs = []
            for view in into:
                pairs.append((view, source[at:at + view.nbytes]))
                at += view.nbytes
            copy_views(pairs)
        else:
            backend.copy_to_device(_over(device, source), self.device)  # waited for: read before the check below
        if seg.seq(slot) != seq:
            raise protocol.WireError("the weights changed while they were copied out of shared memory (the pull "
                                     "was held past its deadline): pulling again")
        self._send(protocol.OP_RELEASE, self.worker, 0, 0, 0, [], 0)
        return version

    def push(self, clock: int, base_version: int, dtype_code: int, payload: list, size: int,
             rows: RowsIn | None = None, op: int = protocol.OP_PUSH) -> PushReply:
        """Write the gradient into the segment (from the GPU where ``payload`` holds device arrays), then send its
        header, and the rows of ``rows`` after it; the reply says what the shard did."""
        if size > self.seg.size:
            raise protocol.WireError(f"a push of {size} bytes does not fit the segment's {self.seg.size}")
        if payload and backend.is_device_array(payload[0]):
            backend.copy_to_host(_over(payload, self.seg.data), self.device)  # waited for: written before the header
        else:
            pairs, at = [], 0
            for part in payload:
                n = memoryview(part).nbytes
                pairs.append((self.seg.data[at:at + n], part))
                at += n
            copy_views(pairs)
        self._send(protocol.OP_PUSH_ROWS if rows else op, self.worker, clock, base_version, dtype_code,
                   self._rows_after(rows), size)
        outcome, version, next_clock, staleness, _ = self._reply()
        return PushReply(protocol.OUTCOMES[outcome], next_clock, version, staleness)

    def close(self) -> None:
        super().close()
        if self.registered is not None:
            self.registered.close()  # before the mapping goes
        self.seg.close()


#: a worker's copies into and out of its segments: a step's views in one pass, over this machine's cores
_copies = Sweep(PARALLEL_BYTES, "psgd-copy")


def copy_views(pairs: list) -> None:
    """Copy the bytes of each ``(dst, src)`` of ``pairs`` (buffers, each pair of one length), all as one pass."""
    _copies.copy([(np.frombuffer(d, dtype=np.uint8), np.frombuffer(s, dtype=np.uint8)) for d, s in pairs])


def _over(arrays: list, memory: memoryview) -> list[tuple]:
    """Each device array of ``arrays`` with the host array over its bytes in ``memory``, one after the other."""
    pairs, at = [], 0
    for a in arrays:
        pairs.append((a, np.frombuffer(memory, dtype=a.dtype, count=a.size, offset=at)))
        at += a.nbytes
    return pairs


def _to_device(targets: list, views: list[memoryview], device: backend.Device) -> None:
    """Copy each host view (a pull's bytes) into its device array of ``targets``."""
    backend.copy_to_device([(t, np.frombuffer(v, t.dtype)) for t, v in zip(targets, views)], device)


def _on_host(parts: list) -> list:
    """Device arrays (a gradient pushed from the GPU, uncompressed) as bytes on the host, for the data port."""
    return [memoryview(backend.to_host(p)).cast("B") for p in parts]


class ShmLink(TcpLink):
    """Bulk transfers through shared memory where the shard shares it, else the data port (TCP)."""

    kind = "shm"

    def __init__(self, endpoint: Endpoint):
        super().__init__(endpoint)
        #: whether pulls and pushes go through shared memory (decided at registration)
        self.shared = False
        self._said = ""  # the reason last logged for not sharing, so that it is said once
        #: the device the worker computes on (its client sets it): on a GPU the segments are registered with it
        self.device = backend.CPU

    def register(self, request: ps_pb2.RegisterRequest) -> ps_pb2.RegisterReply:
        reply = super().register(request)
        shard, nbytes = self.endpoint.shard, sum(s.nbytes for s in self.endpoint.slices)
        if not reply.data_port:
            self._over_tcp("it has no data port")
        elif not reply.host_id:
            self._over_tcp("it offers no shared memory ([cluster] transport = \"tcp\" on its side, or no memory "
                           "to spare for it)")
        elif reply.host_id != segment.host_id():
            self._over_tcp("it is on another host, or in another network or pid namespace (a container; its host "
                           "id differs)")
        elif nbytes < SHARED_FROM_BYTES and not meaning(self.endpoint.transport)["insist"]:
            self._over_tcp(f"its slices take {nbytes:,} bytes, fewer than the "
                           f"{SHARED_FROM_BYTES:,} from which shared memory pays ([cluster] transport = \"shm\" "
                           "uses it anyway)")
        else:
            self.shared = True
            log.debug("shard %d: pulls and pushes through shared memory", shard)
        return reply

    @property
    def direct(self) -> bool:
        """Whether pulls and pushes go between the GPU and shared memory now, with no staging on the host."""
        return self.shared and self.device.is_gpu

    def pull(self, clock: int, views: list[memoryview], rows: RowsOut | None = None,
             device: Mapping[str, Any] | None = None) -> int:
        """As every link's; ``device`` (a flat device array per variable) takes the weights instead of ``views``:
        straight from the weights segment where this link has it, else through ``views``."""
        if device is None:
            return super().pull(clock, views, rows)
        targets = [device[s.var][s.start:s.stop] for s in self.endpoint.slices]  # one per view, in slice order

        def through_host(version: int) -> int:
            _to_device(targets, views, self.device)
            return version

        def into_device(conn: DataConnection) -> int:
            if isinstance(conn, ShmConnection):
                return conn.pull(clock, views, rows, targets)
            return through_host(conn.pull(clock, views, rows))  # the data port, with no segment

        if self.data_port:
            return self._over_data("pull", into_device)
        return through_host(super().pull(clock, views, rows))  # over gRPC

    def push(self, clock: int, base_version: int, codec: Codec, parts: list, rows: RowsIn | None = None) -> PushReply:
        """As every link's; ``parts`` may be device arrays (an uncompressed gradient on the GPU): copied straight
        into the push segment where this link has one, else to the host first."""
        if not parts or not backend.is_device_array(parts[0]):
            return super().push(clock, base_version, codec, parts, rows)
        size = sum(p.nbytes for p in parts)

        def from_device(conn: DataConnection) -> PushReply:
            mine = parts if isinstance(conn, ShmConnection) else _on_host(parts)
            return conn.push(clock, base_version, codec.code, mine, size, rows)

        if self.data_port:
            return self._over_data("push", from_device)
        return super().push(clock, base_version, codec, _on_host(parts), rows)  # over gRPC

    def push_pull(self, clock: int, base_version: int, codec: Codec, parts: list, views: list[memoryview],
                  device: Mapping[str, Any] | None = None) -> tuple[PushReply, int | None]:
        """As every link's; ``parts`` may be device arrays and ``device`` take the weights, as for :meth:`push` and
        :meth:`pull`.  Through shared memory where both of this link's connections have it: the gradient goes
        through the push segment, the weights come out of the weights segment (mapped by the pull connection)."""
        on_device = bool(parts) and backend.is_device_array(parts[0])
        targets = None if device is None else [device[s.var][s.start:s.stop] for s in self.endpoint.slices]

        def through_host(reply: PushReply, version: int | None) -> tuple[PushReply, int | None]:
            if version is not None and targets is not None:  # over a socket, into the host views first
                _to_device(targets, views, self.device)
            return reply, version

        if not self.data_port:  # over gRPC
            return through_host(*super().push_pull(clock, base_version, codec, _on_host(parts) if on_device else parts,
                                                   views))
        size = sum(p.nbytes if on_device else memoryview(p).nbytes for p in parts)
        weights = self._over_data("pull", lambda conn: conn)  # opened first: its segment holds the weights

        def call(conn: DataConnection, got: dict) -> tuple[PushReply, int | None]:
            if isinstance(conn, ShmConnection):
                if isinstance(weights, ShmConnection):
                    return conn.push_pull(clock, base_version, codec.code, parts, size, views, got, device=targets,
                                          weights=weights.seg)
                got["push"] = conn.push(clock, base_version, codec.code, parts, size)  # no weights segment here
                return got["push"], None
            return through_host(*conn.push_pull(clock, base_version, codec.code, _on_host(parts) if on_device
                                                else parts, size, views, got))

        return self._pushed_then(call)

    def _over_tcp(self, why: str) -> None:
        self.shared = False
        if why != self._said:
            self._said = why
            level = logging.WARNING if meaning(self.endpoint.transport)["insist"] else logging.INFO
            log.log(level, "shard %d at %s: not through shared memory, over its data port, since %s",
                    self.endpoint.shard, self.endpoint.address, why)

    def _connection(self, purpose: str) -> DataConnection:
        if self.shared and self._conns[purpose] is None:
            ep = self.endpoint
            try:
                self._conns[purpose] = ShmConnection(ep.host, self.data_port, ep.worker_id, ep.plan_hash, ep.token,
                                                     ep.request_timeout, ep.tls, purpose,
                                                     sum(s.nbytes for s in ep.slices), self.device, ep.busy_poll,
                                                     self.registration)
            except NoSegment as exc:
                self._over_tcp(str(exc))
        return super()._connection(purpose)

    @property
    def via(self) -> str:
        """What carries the bytes now: "shm", "tcp" or "grpc"."""
        return "shm" if self.shared else ("tcp" if self.data_port else "grpc")
