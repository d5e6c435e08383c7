"""A worker's link to one shard: its control link and a data link, composed.

The control link (:class:`psgd.link.grpc.ControlLink`) makes the calls that go over gRPC whatever the job's
transport: register, heartbeat, done, status, the listing of rows, rollback.  A data link carries the tensors of
pulls and pushes: the one the link's kind names (:data:`psgd.link.LINKS`) where the shard gave a data port at its
last registration, else the data link over gRPC, through the control link's channel.  That choice is made here,
at each registration, and nowhere else; so is the staging of device arrays through the host for a data link that
carries host bytes only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psgd.compute import backend
from psgd.link.base import DataLink, Endpoint, PushReply, RowsIn, RowsOut, on_host, to_device
from psgd.link.grpc import ControlLink, GrpcData
from psgd.proto import ps_pb2
from psgd.wire.codec import Codec


class Link:
    """Calls to one shard: control calls over :attr:`control`, tensors over :attr:`data`.  Every method raises
    :class:`psgd.link.base.LinkError` on failure; none retries (the worker's client decides what to retry).
    ``device`` (a flat device array per variable, for a worker on a GPU) takes a pull's weights instead of its
    host ``views``, and a push's ``parts`` may be device arrays."""

    def __init__(self, kind: str, data: type[DataLink], endpoint: Endpoint, device: backend.Device = backend.CPU):
        self.kind, self.endpoint, self.device = kind, endpoint, device
        self.control = ControlLink(endpoint)
        self.grpc = GrpcData(self.control, device)
        #: the data link of this kind, which carries the tensors once the shard gives a data port
        self.chosen = self.grpc if data is GrpcData else data(self.control, device)
        #: the data link the tensors go over now: over gRPC until a registration says otherwise (an observer never
        #: registers)
        self.data: DataLink = self.grpc

    @property
    def registration(self) -> str:
        return self.control.registration

    @property
    def via(self) -> str:
        """What carries the bytes now: "shm", "tcp" or "grpc"."""
        return self.data.via

    @property
    def data_port(self) -> int:
        return self.data.data_port

    @property
    def shared(self) -> bool:
        return self.data.shared

    @property
    def direct(self) -> bool:
        """Whether pulls and pushes go between the GPU and shared memory now, with no staging on the host."""
        return self.data.direct

    def register(self, request: ps_pb2.RegisterRequest) -> ps_pb2.RegisterReply:
        reply = self.control.register(request)
        self.data = self.chosen if self.chosen.registered(reply) else self.grpc
        return reply

    def heartbeat(self, clock: int, timeout: float) -> None:
        self.control.heartbeat(clock, timeout)

    def done(self, clock: int) -> None:
        self.control.done(clock)

    def batch(self, clock: int, blocks: int) -> int:
        return self.control.batch(clock, blocks)

    def status(self) -> ps_pb2.StatusReply:
        return self.control.status()

    def list_rows(self, table: str, start: int) -> ps_pb2.ListRowsReply:
        return self.control.list_rows(table, start)

    def rollback(self, version: int, cause: str, dry_run: bool = False) -> ps_pb2.RollbackReply:
        return self.control.rollback(version, cause, dry_run)

    def _targets(self, device: Mapping[str, Any]) -> list:
        """The device arrays a pull fills, one per view, in slice order."""
        return [device[s.var][s.start : s.stop] for s in self.endpoint.slices]

    def pull(
        self, clock: int, views: list[memoryview], rows: RowsOut | None = None, device: Mapping[str, Any] | None = None
    ) -> int:
        data = self.data
        if device is None:
            return data.pull(clock, views, rows)
        if data.takes_device:
            return data.pull(clock, views, rows, self._targets(device))
        version = data.pull(clock, views, rows)
        to_device(self._targets(device), views, self.device)
        return version

    @staticmethod
    def _staged(data: DataLink, parts: list) -> list:
        """A push's ``parts`` as ``data`` takes them: device arrays through the host for a data link that carries
        host bytes only."""
        if parts and backend.is_device_array(parts[0]) and not data.takes_device:
            return on_host(parts)
        return parts

    def push(self, clock: int, base_version: int, codec: Codec, parts: list, rows: RowsIn | None = None) -> PushReply:
        data = self.data
        return data.push(clock, base_version, codec, self._staged(data, parts), rows)

    def push_pull(
        self,
        clock: int,
        base_version: int,
        codec: Codec,
        parts: list,
        views: list[memoryview],
        device: Mapping[str, Any] | None = None,
    ) -> tuple[PushReply, int | None]:
        """A push of ``clock`` whose answer brings the weights of ``clock + 1``: see
        :meth:`psgd.link.base.DataLink.push_pull`."""
        data = self.data
        targets = None if device is None else self._targets(device)
        if data.takes_device:
            return data.push_pull(clock, base_version, codec, parts, views, targets)
        reply, version = data.push_pull(clock, base_version, codec, self._staged(data, parts), views)
        if version is not None and targets is not None:
            to_device(targets, views, self.device)
        return reply, version

    def _made(self) -> tuple[DataLink, ...]:
        return (self.grpc,) if self.chosen is self.grpc else (self.grpc, self.chosen)

    def interrupt(self) -> None:
        """End the pulls in flight, for good (from another thread): the worker is stopping."""
        for data in self._made():
            data.interrupt()

    def close(self) -> None:
        for data in self._made():
            data.close()
        self.control.close()
