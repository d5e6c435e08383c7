"""[cluster] checkpoint_rounds: under sync every shard checkpoints at the same rounds, so the job's checkpoints
form cuts (every shard at one version) that can be joined, or returned to, whole."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_job, run_threads

from psgd.config import ConfigError
from psgd.export.shards import join_checkpoints
from psgd.job import build_job, describe_job
from psgd.server import build_shard
from psgd.server.net.service import ShardServer
from psgd.server.state import checkpoint
from psgd.worker.exchange import run_worker


def test_sync_shards_checkpoint_at_the_same_rounds_and_each_cut_joins(tmp_path):
    job = make_job(
        "model.name=softmax",
        "cluster.policy=sync",
        "cluster.workers=2",
        "cluster.shards=2",
        "train.epochs=1",
        "train.batch_size=32",
        "cluster.checkpoint_rounds=4",
    )
    servers = [
        ShardServer(
            build_shard(describe_job(job), k),
            "127.0.0.1:0",
            checkpoint_dir=str(tmp_path),
            checkpoint_seconds=0.01,
            keep_checkpoints=1000,
        ).start()
        for k in range(2)
    ]
    try:
        job = job.override("cluster.servers", [s.address for s in servers])
        results = run_threads(
            [lambda r=r: run_worker(job, r, job.cluster.servers, progress=False) for r in range(2)], timeout=120
        )
        rounds = results[0].steps
        written = [
            sorted(checkpoint.versions(checkpoint.shard_dir(tmp_path, k, servers[k].core.fingerprint)))
            for k in range(2)
        ]
    finally:
        for s in servers:
            s.stop(grace=1.0)  # a last checkpoint, at the version the job ended at
    # the initial weights and every 4th round on both shards, and nothing between (the seconds' cadence is not used)
    assert written[0] == written[1] == list(range(0, rounds + 1, 4)) and len(written[0]) >= 4
    cuts = [join_checkpoints(job, tmp_path, version=v) for v in written[0][1:]]
    assert all(c.versions == [v, v] for c, v in zip(cuts, written[0][1:]))
    assert not np.array_equal(cuts[0].weights["dense0/W"], cuts[-1].weights["dense0/W"])


def test_a_cut_needs_a_sync_policy_and_names_the_job_only_where_it_is_set():
    with pytest.raises(
        ConfigError, match="checkpoint_rounds = 4 cuts checkpoints at common rounds, which only a sync policy has"
    ):
        make_job("cluster.policy=async", "cluster.checkpoint_rounds=4")  # the job file itself
    plain, cut, unset = (
        build_job(make_job("cluster.policy=sync", *extra))
        for extra in (("cluster.checkpoint_rounds=0",), ("cluster.checkpoint_rounds=4",), ())
    )
    assert (
        cut.identity["policy_options"]["checkpoint_rounds"] == 4
        and "checkpoint_rounds" not in plain.identity["policy_options"]
    )
    # unset: cuts every 100 rounds under sync, none where rounds close without some workers or under async
    assert unset.identity["policy_options"]["checkpoint_rounds"] == 100
    for other in (("cluster.policy=async",), ("cluster.policy=sync", "cluster.backup_workers=1")):
        assert make_job(*other).cluster.cut_rounds == 0
    assert make_job("cluster.policy=async", "cluster.policy=sync").cluster.cut_rounds == 100  # asked, not stored
    with pytest.raises(ConfigError, match="checkpoint_rounds"):
        make_job("cluster.checkpoint_rounds=-2")
