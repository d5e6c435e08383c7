"""Parameter-server shards.

- core.py: the shard without any transport (workers, leases, the policy, the optimizer);
- store.py: its weights, the reads pulls are served from, updates in place;
- service.py: the gRPC servicer and ShardServer (health, leases, checkpoints), which also starts
- datapath.py: the TCP data path's server end, behind gatekeeper.py (accepting and checking hellos);
- checkpoint.py: writing and reading a shard's checkpoints.

``build_shard(job, k)`` makes the core of shard ``k`` from a job file.
"""

from psgd.server.core import PushResult, ShardCore
from psgd.server.errors import ShardError

__all__ = ["PushResult", "ShardCore", "ShardError", "build_shard"]


def build_shard(job, shard: int) -> ShardCore:
    """The core of shard ``shard`` for a job file: its slices initialized from the job's seed.

    The model comes from :func:`psgd.job.build_job_model`: a shard learns the input shape and class
    count from the dataset's headers and labels, and never loads the inputs.
    """
    from psgd import optim, policy
    from psgd.config import ConfigError
    from psgd.job import build_job_model, check_fits, identity
    from psgd.partition import PartitionPlan

    model = build_job_model(job)
    c = job.cluster
    if not 0 <= shard < c.shards:
        raise ConfigError(f"shard index {shard} is out of range: the job has {c.shards} shard(s), 0..{c.shards - 1}")
    plan = PartitionPlan(model.specs(), c.shards, c.slice_bytes)
    mine = plan.slices_for_shard(shard)
    held = {sl.var for sl in mine}
    check_fits([v for v in plan.specs if v.name in held], f"shard {shard} of model {job.model['name']!r}")
    init = model.init(job.train.seed, names=sorted({s.var for s in mine}))
    values = {s.id: init[s.var].reshape(-1)[s.start:s.stop] for s in mine}
    rule = policy.policy_from_cluster(c)
    # a local policy's push is a worker's progress, x_pulled - x: its workers run the job's optimizer, and the
    # shard moves the centre by the progress (SGD at rate 1, times the push's lr scale)
    optimizer = optim.SGD(1.0) if rule.local else optim.build_optimizer(job.optimizer["name"],
                                                                         **job.options("optimizer"))
    return ShardCore(
        plan, shard, values, optimizer, rule,
        num_workers=c.workers, lease_seconds=c.lease_seconds, join_timeout=c.join_timeout,
        identity=identity(job, plan.hash), async_lr=c.async_lr, staleness_lr=c.staleness_lr,
        dc_lambda=c.dc_lambda, dc_adaptive=c.dc_adaptive, implicit_momentum=c.implicit_momentum,
    )
