"""The same-host link: pulls and pushes through shared memory, requests and replies over the data port.

When a worker and a shard run on one host, their bytes need not cross a socket.  The shard says at
registration who it may share memory with (:func:`psgd.wire.segment.host_id`: the boot id and the pid
and network namespaces); a worker with the same identity asks, in the hello of each of its two data
connections (pull and push) for shared memory: its pull connection is given the shard's weights
segment, its push connection a segment of its own (:mod:`psgd.wire.segment`).  From then on:

- a pull is its request header on the socket; the shard takes a live read of its weights, which live in
  a shared segment that the worker has mapped read-only (two slots, :mod:`psgd.server.state.store`), and
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
reconnections are the TCP data link's (:mod:`psgd.link.tcp`), whose connections this one opens.

A worker on a GPU registers its mappings of both segments with the device's driver (page-locked, as pinned
memory is: :func:`psgd.compute.backend.register_host`) for as long as their connection lasts, and while every shard
shares
memory with it, copies its pulls from the weights segment to the device and its (uncompressed) pushes from the
device into its push segment directly, instead of through pinned buffers on the host: one copy each way, by
DMA.  A pull's copy to the device is waited for before the sequence number is checked again, as a copy on the
host is.
"""

from __future__ import annotations

import logging

import numpy as np

from psgd.compute import backend
from psgd.errors import TransportError
from psgd.link.base import DataLink, PushReply, RowsIn, RowsOut, on_host, to_device
from psgd.link.grpc import ControlLink
from psgd.link.tcp import DataConnection, TcpData
from psgd.proto import ps_pb2
from psgd.wire import meaning, protocol, segment
from psgd.wire.codec import Codec
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

    def __init__(
        self,
        host: str,
        port: int,
        worker: int,
        plan_hash: str,
        token: str,
        timeout: float,
        tls,
        purpose: str,
        nbytes: int,
        device: backend.Device = backend.CPU,
        busy_poll: float = 0.0,
        key: str = "",
    ):
        super().__init__(host, port, worker, plan_hash, token, timeout, tls, shm=purpose, busy_poll=busy_poll, key=key)
        try:
            if "name" not in self.offer:
                raise NoSegment(str(self.offer.get("refused", "the shard offered no shared-memory segment")))
            if self.offer.get("bytes") != nbytes:
                raise NoSegment(
                    f"the shard offered a segment of {self.offer.get('bytes')} bytes, its slices take {nbytes}"
                )
            try:
                self.seg = segment.attach(self.offer, nbytes, writable=purpose == "push")
            except segment.SegmentError as exc:
                raise NoSegment(str(exc)) from None
        except NoSegment:
            super().close()
            raise
        self.device = device
        #: the segment's registration with the GPU's driver (None on a CPU, or where the driver refused it)
        self.registered = (
            backend.register_host(*self.seg.address(), device, read_only=purpose == "pull") if device.is_gpu else None
        )
        if self.registered is not None:
            log.debug("%s registered with %s's driver (%.1f MB)", self.seg.name, device, self.registered.nbytes / 1e6)

    def pull(self, clock: int, into: list[memoryview], rows: RowsOut | None = None, device: list | None = None) -> int:
        """Ask for the weights of ``clock`` (and the rows of ``rows``); once the shard has replied (holding its
        updates back) with the rows' values, copy the weights out of its weights segment and release them.
        ``device`` (device arrays, one per view of ``into``, of its size) takes the weights instead of ``into``,
        copied to the GPU straight from the segment, the copies finished before the sequence number is checked."""
        return self._take(self._ask(clock, rows, into), into, device)

    def _take(
        self,
        answer: tuple[int, int, int, list],
        into: list[memoryview],
        device: list | None = None,
        weights: segment.Segment | None = None,
    ) -> int:
        """Copy the weights of a pull's ``answer`` out of the weights segment (``weights``: that of this link's pull
        connection, for the pull half of a push-and-pull on its push connection), and release them."""
        version, slot, seq, values = answer
        seg = self.seg if weights is None else weights
        if sum(v.nbytes for v in into) > seg.size or not 0 <= slot < seg.slots:
            raise protocol.WireError(
                f"the shard holds the weights in slot {slot} of {seg.slots}, of {seg.size} bytes: the plan's do not fit"
            )
        for view in values:  # the rows come over the connection
            protocol.recv_exact(self.sock, view)
        source, at = seg.slot(slot), 0
        if device is None:
            pairs = []
            for view in into:
                pairs.append((view, source[at : at + view.nbytes]))
                at += view.nbytes
            copy_views(pairs)
        else:
            backend.copy_to_device(_over(device, source), self.device)  # waited for: read before the check below
        if seg.seq(slot) != seq:
            raise protocol.WireError(
                "the weights changed while they were copied out of shared memory (the pull "
                "was held past its deadline): pulling again"
            )
        self._send(protocol.OP_RELEASE, self.worker, 0, 0, 0, [], 0)
        return version

    def push(
        self,
        clock: int,
        base_version: int,
        dtype_code: int,
        payload: list,
        size: int,
        rows: RowsIn | None = None,
        op: int = protocol.OP_PUSH,
    ) -> PushReply:
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
                pairs.append((self.seg.data[at : at + n], part))
                at += n
            copy_views(pairs)
        self._send(
            protocol.OP_PUSH_ROWS if rows else op,
            self.worker,
            clock,
            base_version,
            dtype_code,
            self._rows_after(rows),
            size,
        )
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


class ShmData(DataLink):
    """Pulls and pushes through shared memory where the shard shares it, their requests on the data port's
    connections (:class:`psgd.link.tcp.TcpData`, whose connections this link opens); else on those connections as
    they are.  Takes device arrays: between the GPU and the segments directly where it has them."""

    takes_device = True

    def __init__(self, control: ControlLink, device: backend.Device):
        super().__init__(control, device)
        self.tcp = TcpData(control, device, opener=self._open)
        #: whether pulls and pushes go through shared memory (decided at registration)
        self.shared = False
        self._said = ""  # the reason last logged for not sharing, so that it is said once

    @property
    def via(self) -> str:
        return "shm" if self.shared else "tcp"

    @property
    def data_port(self) -> int:
        return self.tcp.data_port

    @property
    def direct(self) -> bool:
        """Whether pulls and pushes go between the GPU and shared memory now, with no staging on the host."""
        return self.shared and self.device.is_gpu

    def registered(self, reply: ps_pb2.RegisterReply) -> bool:
        self.tcp.registered(reply)
        shard, nbytes = self.endpoint.shard, sum(s.nbytes for s in self.endpoint.slices)
        if not reply.data_port:
            self._over_tcp("it has no data port", over="gRPC")
        elif not reply.host_id:
            self._over_tcp(
                "it offers no shared memory ([cluster] transport = \"tcp\" on its side, or no memory to spare for it)"
            )
        elif reply.host_id != segment.host_id():
            self._over_tcp(
                "it is on another host, or in another network or pid namespace (a container; its host id differs)"
            )
        elif nbytes < SHARED_FROM_BYTES and not meaning(self.endpoint.transport)["insist"]:
            self._over_tcp(
                f"its slices take {nbytes:,} bytes, fewer than the "
                f"{SHARED_FROM_BYTES:,} from which shared memory pays ([cluster] transport = \"shm\" "
                "uses it anyway)"
            )
        else:
            self.shared = True
            log.debug("shard %d: pulls and pushes through shared memory", shard)
        return bool(reply.data_port)

    def pull(self, clock: int, views: list[memoryview], rows: RowsOut | None = None, device: list | None = None) -> int:
        """As every data link's; ``device`` (a device array per view) takes the weights instead of ``views``:
        straight from the weights segment where this link has it, else through ``views``."""
        if device is None:
            return self.tcp.pull(clock, views, rows)

        def into_device(conn: DataConnection) -> int:
            if isinstance(conn, ShmConnection):
                return conn.pull(clock, views, rows, device)
            version = conn.pull(clock, views, rows)  # the data port, with no segment
            to_device(device, views, self.device)
            return version

        return self.tcp.over("pull", into_device)

    def push(self, clock: int, base_version: int, codec: Codec, parts: list, rows: RowsIn | None = None) -> PushReply:
        """As every data link's; ``parts`` may be device arrays (an uncompressed gradient on the GPU): copied
        straight into the push segment where this link has one, else to the host first."""
        if not parts or not backend.is_device_array(parts[0]):
            return self.tcp.push(clock, base_version, codec, parts, rows)
        size = sum(p.nbytes for p in parts)

        def from_device(conn: DataConnection) -> PushReply:
            mine = parts if isinstance(conn, ShmConnection) else on_host(parts)
            return conn.push(clock, base_version, codec.code, mine, size, rows)

        return self.tcp.over("push", from_device)

    def push_pull(
        self,
        clock: int,
        base_version: int,
        codec: Codec,
        parts: list,
        views: list[memoryview],
        device: list | None = None,
    ) -> tuple[PushReply, int | None]:
        """As every data link's; ``parts`` may be device arrays and ``device`` take the weights, as for :meth:`push`
        and :meth:`pull`.  Through shared memory where both of this link's connections have it: the gradient goes
        through the push segment, the weights come out of the weights segment (mapped by the pull connection)."""
        on_device = bool(parts) and backend.is_device_array(parts[0])
        size = sum(p.nbytes if on_device else memoryview(p).nbytes for p in parts)
        weights = self.tcp.over("pull", lambda conn: conn)  # opened first: its segment holds the weights

        def call(conn: DataConnection, got: dict) -> tuple[PushReply, int | None]:
            if isinstance(conn, ShmConnection):
                if isinstance(weights, ShmConnection):
                    return conn.push_pull(
                        clock, base_version, codec.code, parts, size, views, got, device=device, weights=weights.seg
                    )
                got["push"] = conn.push(clock, base_version, codec.code, parts, size)  # no weights segment here
                return got["push"], None
            reply, version = conn.push_pull(
                clock, base_version, codec.code, on_host(parts) if on_device else parts, size, views, got
            )
            if version is not None and device is not None:  # over a socket, into the host views first
                to_device(device, views, self.device)
            return reply, version

        return self.tcp.pushed_then(call)

    def _over_tcp(self, why: str, over: str = "its data port") -> None:
        self.shared = False
        if why != self._said:
            self._said = why
            level = logging.WARNING if meaning(self.endpoint.transport)["insist"] else logging.INFO
            log.log(
                level,
                "shard %d at %s: not through shared memory, over %s, since %s",
                self.endpoint.shard,
                self.endpoint.address,
                over,
                why,
            )

    def _open(self, purpose: str) -> ShmConnection | None:
        """The ``purpose`` connection through a segment, where the shard shares memory; None for a plain one."""
        if not self.shared:
            return None
        ep = self.endpoint
        try:
            return ShmConnection(
                ep.host,
                self.tcp.data_port,
                ep.worker_id,
                ep.plan_hash,
                ep.token,
                ep.request_timeout,
                ep.tls,
                purpose,
                sum(s.nbytes for s in ep.slices),
                self.device,
                ep.busy_poll,
                self.control.registration,
            )
        except NoSegment as exc:
            self._over_tcp(str(exc))
            return None

    def interrupt(self) -> None:
        self.tcp.interrupt()

    def close(self) -> None:
        self.tcp.close()
