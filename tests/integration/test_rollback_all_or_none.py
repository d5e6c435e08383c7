"""Going back to a cut reaches every shard or none: a worker that takes the job back and dies after reaching some
of the shards leaves the job split ([30, 57] in the finding); a worker told by a shard that it went back finishes
the job's way back itself, for the same cause (each shard goes back once per cause), instead of waiting for it."""

from __future__ import annotations

import numpy as np

from helpers import TOKEN, make_job, run_threads
from psgd.job import describe_job
from psgd.server import build_shard
from psgd.server.service import ShardServer
from psgd.worker.client import PSClient
from psgd.worker.errors import Rewind
from psgd.worker.rollback import roll_back


def test_a_worker_told_that_the_job_went_back_takes_the_shards_left_behind_back_too(tmp_path):
    job = make_job("model.name=softmax", "cluster.policy=sync", "cluster.workers=2", "cluster.shards=2",
                   "cluster.checkpoint_rounds=2", "cluster.transport=tcp", "cluster.request_timeout=6")
    d = describe_job(job)
    servers = [ShardServer(build_shard(d, k), "127.0.0.1:0", transport="tcp", token=TOKEN,
                           checkpoint_dir=str(tmp_path), keep_checkpoints=10).start() for k in range(2)]
    job.override("cluster.servers", [s.address for s in servers])
    plan = servers[0].core.plan
    clients = [PSClient(job.cluster.servers, plan, r, request_timeout=6, token=TOKEN, config=job) for r in range(2)]
    try:
        for c in clients:
            c.register()
        grads = {s.name: np.full(s.shape, 1e-3, np.float32) for s in plan.specs}
        for clock in range(5):  # five rounds: cuts at 0, 2 and 4
            run_threads([lambda c=c: c.push(clock, grads) for c in clients], 30)
        assert [s.core.version for s in servers] == [5, 5]
        # worker 1 takes the job back to the cut at 4 for a restart (cause "restart-abc") and dies after shard 0
        clients[1].links[0].rollback(4, "restart-abc")
        assert [s.core.version for s in servers] == [4, 5]
        # worker 0 hears that shard 0 went back (ROLLED_BACK names the cut): it finishes the way back itself
        assert roll_back(clients[0], Rewind(4)) == 4
        assert [s.core.version for s in servers] == [4, 4]
        np.testing.assert_array_equal(*(s.core.counters["rollbacks"] for s in servers))
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.stop(grace=1.0)
