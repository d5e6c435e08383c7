"""Links: how a worker talks to one shard, a control link and a data link composed (:mod:`psgd.link.compose`),
the data link chosen by configuration, and whether a shard is there to be talked to (:func:`accepts_connections`).

- :mod:`psgd.link.base`: what a link is made from (the shard's endpoint), the interface every data link has
  (pull into arrays, push, push and pull), its one error type and reply.
- :mod:`psgd.link.grpc`: the control link (register, heartbeat, done, status, rows, rollback), and the data link
  over gRPC, tensors in protobuf chunks.
- :mod:`psgd.link.tcp`: the data link over the shard's plain-TCP data port.
- :mod:`psgd.link.shm`: on the shard's host, the data link through shared memory (:mod:`psgd.wire.segment`),
  its requests over the data port; elsewhere over the data port as it is (the default, ``transport = "auto"``).
- :mod:`psgd.link.compose`: the link the worker's client holds for each shard: its control link, and the data
  link of its kind where the shard gives a data port, else the one over gRPC.

What both ends share (the data port's frames, the segments, the refusals' reasons) is :mod:`psgd.wire`,
and so is what each ``transport`` means.

How a gradient is written on the wire is a codec (:mod:`psgd.wire.codec`), the
same for every link.  The retries, the fan-out to every shard and the leases
are the worker's client's (:mod:`psgd.worker.client`), the same for every link.
"""

from __future__ import annotations

from psgd.compute import backend
from psgd.link.base import DataLink, Endpoint, LinkError, ProtocolError, PushReply
from psgd.link.compose import Link
from psgd.link.grpc import GrpcData
from psgd.link.shm import ShmData
from psgd.link.tcp import TcpData
from psgd.wire import TRANSPORTS, meaning
from psgd.wire.channel import accepts_connections

__all__ = [
    "DataLink",
    "Endpoint",
    "Link",
    "LinkError",
    "ProtocolError",
    "PushReply",
    "LINKS",
    "TRANSPORTS",
    "accepts_connections",
    "link_kind",
    "open_link",
]

#: Each kind of link by name: the data link its tensors go over where the shard gives a data port.
LINKS: dict[str, type[DataLink]] = {"grpc": GrpcData, "tcp": TcpData, "shm": ShmData}


def link_kind(transport: str) -> str:
    """The link a job's ``[cluster] transport`` asks for."""
    return str(meaning(transport)["link"])


def open_link(kind: str, endpoint: Endpoint, device: backend.Device = backend.CPU) -> Link:
    """A link of ``kind`` (a key of :data:`LINKS`) to the shard at ``endpoint``, for a worker computing on
    ``device`` (a GPU worker's shared-memory link registers its segments with it, and may take device arrays)."""
    try:
        data = LINKS[kind]
    except KeyError:
        raise ValueError(f"unknown link {kind!r}: use one of {', '.join(LINKS)}") from None
    return Link(kind, data, endpoint, device)
