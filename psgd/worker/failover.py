"""A worker's way to the live process of a shard kept twice (``[cluster] replicas = 1``, psgd.server.durable.replica).

Each shard is a pair of addresses: its primary's and its replica's.  A call refused by a replica (NOT_PRIMARY)
or that cannot reach its shard at all (UNAVAILABLE) moves the client's link for that shard to the other address
of the pair before it is retried: the process there leads once the primary is gone, or points back when it does
not.  The retry itself is the client's (psgd.worker.client: backoff, one overall deadline), so a worker goes back
and forth at that pace until one of the two answers; once there, the shard asks it to register (NOT_REGISTERED),
and a push it had sent the dead primary and retries there is counted as the duplicate it is.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any

from psgd.errors import Code
from psgd.link import Link, LinkError, open_link

log = logging.getLogger(__name__)


class Failover:
    """Which address of each shard's pair ``client`` calls, and the move to the other one."""

    def __init__(self, client: Any, replicas: Sequence[str]):  # a psgd.worker.client.PSClient
        if replicas and len(replicas) != len(client.addresses):
            raise ValueError(f"{len(replicas)} replica address(es) for {len(client.addresses)} shard(s)")
        self.client = client
        self.pairs = list(zip(client.addresses, replicas)) if replicas else []
        self.moves = 0
        self._lock = threading.Lock()

    def others(self) -> list[str | None]:
        """The address of the other process of each shard's pair (None for a shard kept once)."""
        return [self._other(k) if self.pairs else None for k in range(len(self.client.links))]

    def _other(self, k: int) -> str:
        first, second = self.pairs[k]
        return second if self.client.addresses[k] == first else first

    def move(self, k: int, used: Link, err: LinkError) -> None:
        """After ``err`` from shard ``k`` over link ``used``: where the pair's other process may serve it, call that
        one from now on (unless another call has moved already)."""
        if not self.pairs or not (err.reason == "NOT_PRIMARY" or err.code == Code.UNAVAILABLE):
            return
        c = self.client
        with self._lock:
            if c.links[k] is not used:
                return
            other = self._other(k)
            link = open_link(c.link_kind, dataclasses.replace(used.endpoint, address=other), used.device)
            c.links[k], c.addresses[k] = link, other
            self.moves += 1
        used.close()
        log.info(
            "shard %d: %s (%s): calling the other process of its pair, %s",
            k,
            used.endpoint.address,
            "its replica, not its primary" if err.reason == "NOT_PRIMARY" else f"{err.code.name}",
            other,
        )
