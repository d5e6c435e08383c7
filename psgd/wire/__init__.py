"""What both ends of a shard's connections share, and nothing else: the worker's links (:mod:`psgd.link`)
and the shard (:mod:`psgd.server`) import this package, never each other.

- :mod:`psgd.wire.protocol`: the data port's frames (hello, request, reply, error), exact receives and
  gathered sends.
- :mod:`psgd.wire.segment`: the shared-memory segments (sealed memory files, their header and slots) and
  who may share memory with whom (:func:`psgd.wire.segment.host_id`).
- :mod:`psgd.wire.status`: the reasons a refusal carries for the client to act on, as gRPC status details
  and as the data port's reason numbers.

The gRPC contract itself is ``protos/psgd/v1/ps.proto`` (generated into :mod:`psgd.proto`).  What each
``[cluster] transport`` means is written here, once, for both ends (:data:`TRANSPORTS`).
"""

from __future__ import annotations

#: what [cluster] transport may say, and what it means: the link a worker opens (its kind in psgd.link),
#: whether that link warns when it cannot use shared memory (asked for by name), and what the shard serves
#: besides its gRPC port (a data port; shared memory to workers on its host)
TRANSPORTS = {
    "auto": {"link": "shm", "insist": False, "data_port": True, "shared_memory": True},  # shared memory here, else TCP
    "shm": {"link": "shm", "insist": True, "data_port": True, "shared_memory": True},
    "tcp": {"link": "tcp", "insist": False, "data_port": True, "shared_memory": False},
    "grpc": {"link": "grpc", "insist": False, "data_port": False, "shared_memory": False},
}


def meaning(transport: str) -> dict[str, object]:
    """What ``transport`` means (see :data:`TRANSPORTS`); ValueError for one that does not exist."""
    try:
        return TRANSPORTS[transport]
    except KeyError:
        raise ValueError(f"unknown transport {transport!r}: use one of {', '.join(TRANSPORTS)}") from None
