"""What a link to one shard does, whatever carries the bytes: the interface and its one error type."""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from psgd.wire.codec import Codec
from psgd.errors import Code, TransportError
from psgd.partition import Slice
from psgd.proto import ps_pb2
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

    def __init__(self, code: Code, details: str, reason: str = "", rewind_to: int = 0,
                 holder: tuple[str, int] | None = None):
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
    worker_id: int           # protocol.OBSERVER for a reader that never pushes
    plan_hash: str
    token: str = ""
    tls: TLSFiles = NO_TLS
    request_timeout: float = 60.0
    transport: str = "auto"  # what the job asked for ([cluster] transport), for the shm link's fallback line
    busy_poll: float = 0.0   # seconds a data connection watches for an answer before it sleeps ([cluster] busy_poll_us)

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0].strip("[]")


#: Rows of embedding tables a pull asks for: table -> (this shard's ids, the array ``[len(ids), dim]`` they fill).
RowsOut = Mapping[str, "tuple[np.ndarray, np.ndarray]"]
#: Rows a push sends: table -> (this shard's ids, their gradients ``[len(ids), dim]``).
RowsIn = Mapping[str, "tuple[np.ndarray, np.ndarray]"]


class Link:
    """Calls to one shard.  Every method raises :class:`LinkError` on failure; none retries (the
    worker's client decides what to retry).  ``pull`` fills ``views`` (one per slice, slice order), and the
    rows of ``rows`` where given, and returns the version; ``push`` sends ``parts`` (one per slice, encoded by
    ``codec``) and the row gradients of ``rows``; every link carries rows with the pull or push they belong
    to."""

    kind = ""

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint

    def register(self, request: ps_pb2.RegisterRequest) -> ps_pb2.RegisterReply:
        raise NotImplementedError

    def pull(self, clock: int, views: list[memoryview], rows: RowsOut | None = None) -> int:
        raise NotImplementedError

    def push(self, clock: int, base_version: int, codec: Codec, parts: list[memoryview],
             rows: RowsIn | None = None) -> PushReply:
        raise NotImplementedError

    def push_pull(self, clock: int, base_version: int, codec: Codec, parts: list[memoryview],
                  views: list[memoryview], device: Mapping | None = None) -> tuple[PushReply, int | None]:
        """A push of ``clock`` whose answer brings the weights of ``clock + 1`` into ``views`` (into ``device``, a
        flat device array per variable, where the link can): one round trip.  Returns the push's reply and the
        weights' version, or None for a version where the push was applied but the weights did not come (the
        shard could not let the pull go, or the connection broke after the push's reply): the caller pulls then.
        A failure before the push's reply raises, as a push's does (a retried push is applied once)."""
        raise NotImplementedError

    def heartbeat(self, clock: int, timeout: float) -> None:
        raise NotImplementedError

    def done(self, clock: int) -> None:
        raise NotImplementedError

    def status(self) -> ps_pb2.StatusReply:
        raise NotImplementedError

    def list_rows(self, table: str, start: int) -> ps_pb2.ListRowsReply:
        """A page of the rows of ``table`` the shard holds, from ``start`` (0, then a reply's ``next``)."""
        raise NotImplementedError

    def rollback(self, version: int, cause: str, dry_run: bool = False) -> ps_pb2.RollbackReply:
        """Take the shard back to its cut at ``version`` (once per ``cause``: the incarnation of the shard of the job
        that restarted from a cut), or list its cuts (``dry_run``)."""
        raise NotImplementedError

    def interrupt(self) -> None:
        """End the calls in flight (from another thread): the worker is stopping."""

    def close(self) -> None:
        raise NotImplementedError
