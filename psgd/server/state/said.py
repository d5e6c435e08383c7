"""What a shard says of itself: the answer to Status (``psgd status``, ``psgd doctor``, Prometheus), read from its
core's parts under the core's lock."""

from __future__ import annotations

from typing import Any


def shard_status(core: Any) -> dict[str, Any]:
    """The shard's weights, workers, counters and recovery, JSON-serialisable (``core``: a
    :class:`psgd.server.state.core.ShardCore`, whose lock the caller holds).
    ``workers_range`` is the job's fewest and most workers (the same for a fixed count) and ``members`` those
    training now."""
    return {
        "shard": core.shard,
        "num_shards": core.plan.num_shards,
        "policy": core.policy.name,
        "version": core.version,
        "plan_hash": core.plan.hash,
        "bytes_held": int(sum(w.nbytes for w in core.weights.values())),
        "workers": core.roster.rows(),
        "workers_range": [core.roster.fewest, core.num_workers],
        "members": core.roster.live_count(),
        "counters": {
            **core.counters,
            **core.store.counters,
            "impostors": core.roster.impostors,
            "policy": core.policy.describe(),
            **({"batches": core.lobby.blocks.describe()} if core.lobby.blocks is not None else {}),
        },
        "reads": core.store.reads(),
        "staleness_histogram": list(core.staleness_histogram),
        **core.whole.status(),
        **core.rewind.status(),
        "role": core.role,
        "replica_lag": core.replication.lag() if core.replication is not None else -1,
        **({"tables": core.tables.status()} if core.tables else {}),
    }
