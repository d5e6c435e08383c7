"""The shard's one request handler: what a worker's pull or push does once a transport has received it.

Two transports carry a worker's requests to a shard: gRPC (:mod:`psgd.server.net.service`) and the data port
(:mod:`psgd.server.net.datapath`, through shared memory or not).  Each only turns its bytes into a request here and the
answer into its reply; the checks and the update are made once, here and in the core
(:class:`psgd.server.state.core.ShardCore`), so that a push is the same push whichever link carried it: the same
admission, the same policy (a duplicate is acknowledged, never applied twice), the same refusals (a
:class:`ShardError`, whose code each transport turns into its own status).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from psgd.server.state.core import PushResult, ShardCore
from psgd.server.state.store import LiveRead, Snapshot
from psgd.server.state.tables import RowsIn
from psgd.wire.protocol import as_worker


@dataclasses.dataclass(frozen=True)
class PushRequest:
    """A push as received: ``worker``'s gradient (``grads``, by slice id) at ``clock`` on ``base_version``, and its
    rows (ids and gradients by table); ``key``: its registration's; ``wire_bytes``: what it took on the wire;
    ``largest``: the largest magnitude in ``grads`` where the receive measured it (not measured again)."""

    worker: int
    clock: int
    base_version: int
    grads: Mapping[int, np.ndarray]
    wire_bytes: int
    key: str = ""
    rows: RowsIn | None = None
    largest: float | None = None


@dataclasses.dataclass(frozen=True)
class PullRequest:
    """A pull of ``clock`` by ``worker`` (as on the wire: -1 is an observer), waiting at most ``timeout`` seconds,
    and the rows it asks for (``lookups``: ids by table).  ``live``: read where the weights are kept, no copy, for
    ``hold`` seconds at least (else revoked: ``on_revoke``); ``cancelled``: whether its caller has gone."""

    worker: int
    clock: int
    timeout: float
    key: str = ""
    lookups: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    live: bool = False
    hold: float = float("inf")
    on_revoke: Callable[[], None] = lambda: None
    cancelled: Callable[[], bool] = lambda: False


@dataclasses.dataclass(frozen=True)
class Pulled:
    """What a pull reads: the weights (release them once sent, or leave the block) and the rows it asked for."""

    read: Snapshot | LiveRead
    rows: dict[str, np.ndarray]

    def __enter__(self) -> Pulled:
        return self

    def __exit__(self, *exc) -> None:
        self.read.release()


class RequestHandler:
    """The requests of ``core``'s workers, whichever transport carried them."""

    def __init__(self, core: ShardCore):
        self.core = core

    def admit(self, worker: int, key: str) -> None:
        """Before a request is received: only a registered worker, as its registration's ``key``, takes a receive
        buffer or the time to receive.  A peek without the shard's lock, which an update holds while it runs (a
        receive overlaps other workers' updates); the push checks again, and renews the lease, under the lock."""
        self.core.roster.check(worker)
        self.core.roster.live(worker, key, renew=False)

    def push(self, request: PushRequest) -> PushResult:
        """Apply, accumulate or drop the push as the policy says (:meth:`ShardCore.push`)."""
        return self.core.push(
            request.worker,
            request.clock,
            request.base_version,
            request.grads,
            wire_bytes=request.wire_bytes,
            rows=request.rows,
            largest=request.largest,
            key=request.key,
        )

    def pull(self, request: PullRequest) -> Pulled:
        """The weights once the policy lets the pull go (:meth:`ShardCore.pull`), and then its rows: under sync no
        update comes before this worker's push."""
        worker = as_worker(request.worker)
        read = self.core.pull(
            worker,
            request.clock,
            request.timeout,
            cancelled=request.cancelled,
            copy=not request.live,
            hold=request.hold,
            on_revoke=request.on_revoke,
            key=request.key,
        )
        try:
            rows = self.core.read_rows(worker, request.lookups) if request.lookups else {}
        except BaseException:
            read.release()
            raise
        return Pulled(read, rows)
