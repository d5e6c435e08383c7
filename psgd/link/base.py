"""What a link to one shard is made from, whatever carries the bytes: its endpoint, the interface of a data link,
its one error type."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from psgd.compute import backend
from psgd.errors import Code, TransportError
from psgd.partition import Slice
from psgd.proto import ps_pb2
from psgd.wire.codec import Codec
from psgd.wire.tls import NO_TLS, TLSFiles

#: Errors a caller may retry: the shard is away or slow (UNAVAILABLE, DEADLINE_EXCEEDED), or it cancelled
#: the call while stopping to restart (CANCELLED; a worker cancels its own calls only when it stops).
#: what a worker retries (with backoff, within its retry deadline); RESOURCE_EXHAUSTED: the shard's receive
#: buffers were all taken for a while, and the push was not applied
RETRYABLE = (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.CANCELLED, Code.RESOURCE_EXHAUSTED)


class LinkError(TransportError):
    """A call to a shard failed: ``code`` is the status code (psgd.errors.Code, whichever link carried it),
    ``details`` the shard's message, ``reason`` the ErrorInfo reason the caller acts on ("" for none),
    ``rewind_to`` the clock a ROLLED_BACK refusal says to continue from, ``holder`` (host, pid) the process that
    holds the rank, of a RANK_HELD."""

    def __init__(
        self, code: Code, details: str, reason: str = "", rewind_to: int = 0, holder: tuple[str, int] | None = None
    ):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details, self.reason, self.rewind_to, self.holder = code, details, reason, rewind_to, holder

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE


class ProtocolError(TransportError):
    """The shard sent what the partition plan does not allow (a slice it does not hold, a short one)."""


@dataclasses.dataclass(frozen=True)
class PushReply:
    """What the shard did with a push: applied, accumulated, duplicate or late, and where it stands."""

    outcome: str
    next_clock: int
    version: int
    staleness: int


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where shard ``shard`` is and who calls it: what every link is made from."""

    address: str
    shard: int
    slices: Sequence[Slice]  # the shard's slices, in slice-id order (the order bytes travel in)
    worker_id: int  # protocol.OBSERVER for a reader that never pushes
    plan_hash: str
    token: str = ""
    tls: TLSFiles = NO_TLS
    request_timeout: float = 60.0
    transport: str = "auto"  # what the job asked for ([cluster] transport), for the shm link's fallback line
    busy_poll: float = 0.0  # seconds a data connection watches for an answer before it sleeps ([cluster] busy_poll_us)

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0].strip("[]")


#: Rows of embedding tables a pull asks for: table -> (this shard's ids, the array ``[len(ids), dim]`` they fill).
RowsOut = Mapping[str, "tuple[np.ndarray, np.ndarray]"]
#: Rows a push sends: table -> (this shard's ids, their gradients ``[len(ids), dim]``).
RowsIn = Mapping[str, "tuple[np.ndarray, np.ndarray]"]


class DataLink:
    """How the tensors of one shard's pulls and pushes travel: over gRPC, the shard's data port or shared memory.
    Made from the control link (:class:`psgd.link.grpc.ControlLink`: the endpoint, the registration key its calls
    carry) and the device the worker computes on.  Every method raises :class:`LinkError` on failure; none retries
    (the worker's client decides what to retry).  ``pull`` fills ``views`` (one per slice, slice order), and the
    rows of ``rows`` where given, and returns the version; ``push`` sends ``parts`` (one per slice, encoded by
    ``codec``) and the row gradients of ``rows``; every data link carries rows with the pull or push they belong
    to.  Host buffers only, unless :attr:`takes_device`: then ``device`` (device arrays, one per view) takes the
    weights, and ``parts`` may be device arrays."""

    #: what carries the bytes now: "grpc", "tcp" or "shm"
    via = ""
    #: whether it goes to and from device arrays itself (else its link stages them through the host)
    takes_device = False
    #: whether pulls and pushes go through shared memory now, and between it and the GPU with no staging
    shared = direct = False
    #: the shard's data port it uses (0: none)
    data_port = 0

    def __init__(self, control: Any, device: backend.Device):  # a psgd.link.grpc.ControlLink
        self.control, self.endpoint, self.device = control, control.endpoint, device

    def registered(self, reply: ps_pb2.RegisterReply) -> bool:
        """Told the shard's answer to a registration: whether this data link can carry its tensors now."""
        return True

    def pull(self, clock: int, views: list[memoryview], rows: RowsOut | None = None) -> int:
        raise NotImplementedError

    def push(
        self, clock: int, base_version: int, codec: Codec, parts: list[memoryview], rows: RowsIn | None = None
    ) -> PushReply:
        raise NotImplementedError

    def push_pull(
        self, clock: int, base_version: int, codec: Codec, parts: list[memoryview], views: list[memoryview]
    ) -> tuple[PushReply, int | None]:
        """A push of ``clock`` whose answer brings the weights of ``clock + 1`` into ``views``: one round trip.
        Returns the push's reply and the weights' version, or None for a version where the push was applied but
        the weights did not come (the shard could not let the pull go, or the connection broke after the push's
        reply): the caller pulls then.  A failure before the push's reply raises, as a push's does (a retried push
        is applied once)."""
        raise NotImplementedError

    def interrupt(self) -> None:
        """End the pulls in flight, for good (from another thread): the worker is stopping."""

    def close(self) -> None:
        """Close what this data link opened (the control link closes its channel)."""


def to_device(targets: list, views: list[memoryview], device: backend.Device) -> None:
    """Copy each host view (a pull's bytes) into its device array of ``targets``."""
    backend.copy_to_device([(t, np.frombuffer(v, t.dtype)) for t, v in zip(targets, views)], device)


def on_host(parts: list) -> list:
    """Device arrays (a gradient pushed from the GPU, uncompressed) as bytes on the host."""
    return [memoryview(backend.to_host(p)).cast("B") for p in parts]
