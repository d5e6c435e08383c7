"""Parameter-server shards, in three rooms (state/ imports neither of the others: tests/unit/test_layering.py):

- net/: the network side: the gRPC servicer and ShardServer (health, leases, checkpoints), the TCP data path
  behind its gatekeeper (accepting and checking hellos), the token check, and handler.py, the one request handler
  a worker's pull or push reaches, whichever transport carried it;
- durable/: what keeps a shard through a crash: recovery.py (what of a shard its checkpoints hold, coming back,
  going back to a cut) and a shard kept twice (replica.py, following.py, stream.py, peers.py);
- state/: the shard without any transport: core.py (workers, leases, the policy, the optimizer), store.py (its
  weights, the reads pulls are served from, updates in place), whole.py (its state taken and given whole) and
  checkpoint.py (the files that state is written as);
- errors.py: what a shard answers when it refuses a request, whichever room refuses it.

``build_shard(job, k)`` makes the core of shard ``k`` of a job (:func:`psgd.job.describe_job`).
"""

from __future__ import annotations

from psgd.config import ConfigError
from psgd.job import Job, check_fits
from psgd.server.errors import ShardError
from psgd.server.state.core import PushResult, ShardCore
from psgd.server.state.tables import ShardTables

__all__ = ["PushResult", "ShardCore", "ShardError", "build_shard"]


def build_shard(job: Job, shard: int, checkpoints: bool = False) -> ShardCore:
    """The core of shard ``shard`` of ``job`` (:func:`psgd.job.describe_job`: a shard learns the input shape and
    class count from the dataset's headers and labels, and never loads the inputs), its slices initialized from
    the job's seed.  ``checkpoints``: the shard keeps checkpoints, so a sync job that does not set checkpoint_rounds
    cuts them too (psgd.config.ClusterConfig.shard_cut_rounds)."""
    config, plan, c = job.config, job.plan, job.config.cluster
    if not 0 <= shard < c.shards:
        raise ConfigError(f"shard index {shard} is out of range: the job has {c.shards} shard(s), 0..{c.shards - 1}")
    mine = plan.slices_for_shard(shard)
    held = {sl.var for sl in mine}
    check_fits([v for v in plan.specs if v.name in held], f"shard {shard} of model {config.model['name']!r}")
    init = job.model.init(config.train.seed, names=sorted({s.var for s in mine}))
    values = {s.id: init[s.var].reshape(-1)[s.start : s.stop] for s in mine}
    rule = job.policy()
    if c.recovery.replicas and plan.tables:
        raise ConfigError(
            f"[cluster] replicas = 1 copies a shard's dense variables to its replica, not the rows of "
            f"embedding tables ({', '.join(t.name for t in plan.tables)}) yet: leave it 0 for this model"
        )
    return ShardCore(
        plan,
        shard,
        values,
        job.shard_optimizer(rule),
        rule,
        num_workers=c.workers,
        fewest=c.fewest,
        deadlines=c.deadlines,
        identity=job.identity,
        remedies=c.remedies,
        tables=ShardTables(plan, shard, job.row_tables(f"shard {shard}")),
        cut_rounds=c.shard_cut_rounds(checkpoints),
    )
