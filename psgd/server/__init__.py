"""Parameter-server shards: the transport-free core and its gRPC adapter."""

from psgd.server.core import PushAssembler, PushResult, ShardCore, ShardError

__all__ = ["PushAssembler", "PushResult", "ShardCore", "ShardError", "build_shard"]


def build_shard(job, shard: int, dataset=None) -> ShardCore:
    """The core of shard ``shard`` for a job file: its slices initialized from the job's seed."""
    from psgd import optim, policy
    from psgd.config import ConfigError
    from psgd.job import identity
    from psgd.partition import PartitionPlan
    from psgd.job import build_job

    built = build_job(job, dataset)
    c = job.cluster
    if not 0 <= shard < c.shards:
        raise ConfigError(f"shard index {shard} is out of range: the job has {c.shards} shard(s), 0..{c.shards - 1}")
    plan = PartitionPlan(built.model.specs(), c.shards, c.slice_bytes)
    mine = plan.slices_for_shard(shard)
    init = built.model.init(job.train.seed, names=sorted({s.var for s in mine}))
    values = {s.id: init[s.var].reshape(-1)[s.start:s.stop] for s in mine}
    options = {"staleness": c.staleness} if c.policy == "ssp" else \
              {"backup_workers": c.backup_workers} if c.policy == "sync" else {}
    return ShardCore(
        plan, shard, values,
        optim.build_optimizer(job.optimizer["name"], **job.options("optimizer")),
        policy.make_policy(c.policy, c.workers, **options),
        num_workers=c.workers, lease_seconds=c.lease_seconds, join_timeout=c.join_timeout,
        staleness_lr=c.staleness_lr, identity=identity(job, plan.hash),
    )
