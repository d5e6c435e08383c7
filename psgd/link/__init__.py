"""Links: how a worker talks to one shard, one class per transport, chosen by configuration, and whether a shard
is there to be talked to (:func:`accepts_connections`).

- :mod:`psgd.link.base`: the interface every link has (register, pull into
  arrays, push, heartbeat, done, status), its one error type and reply.
- :mod:`psgd.link.grpc`: everything over gRPC, tensors in protobuf chunks.
- :mod:`psgd.link.tcp`: pulls and pushes over the shard's plain-TCP data
  port, control calls over gRPC.
- :mod:`psgd.link.shm`: on the shard's host, pulls and pushes through shared
  memory (:mod:`psgd.wire.segment`), their requests over the data port;
  elsewhere the TCP link's (the default, ``transport = "auto"``).

What both ends share (the data port's frames, the segments, the refusals' reasons) is :mod:`psgd.wire`,
and so is what each ``transport`` means.

How a gradient is written on the wire is a codec (:mod:`psgd.wire.codec`), the
same for every link.  The retries, the fan-out to every shard and the leases
are the worker's client's (:mod:`psgd.worker.client`), the same for every link.
"""

from __future__ import annotations

from psgd.link.base import Endpoint, Link, LinkError, ProtocolError, PushReply
from psgd.link.grpc import GrpcLink
from psgd.link.shm import ShmLink
from psgd.link.tcp import TcpLink
from psgd.wire import TRANSPORTS, meaning
from psgd.wire.channel import accepts_connections

__all__ = ["Endpoint", "Link", "LinkError", "ProtocolError", "PushReply", "LINKS", "TRANSPORTS",
           "accepts_connections", "link_kind", "open_link"]

LINKS: dict[str, type[Link]] = {"grpc": GrpcLink, "tcp": TcpLink, "shm": ShmLink}


def link_kind(transport: str) -> str:
    """The link a job's ``[cluster] transport`` asks for."""
    return str(meaning(transport)["link"])


def open_link(kind: str, endpoint: Endpoint) -> Link:
    """A link of ``kind`` (a key of :data:`LINKS`) to the shard at ``endpoint``."""
    try:
        cls = LINKS[kind]
    except KeyError:
        raise ValueError(f"unknown link {kind!r}: use one of {', '.join(LINKS)}") from None
    return cls(endpoint)
