"""A job whose shards end at different versions lost updates on the one behind (it restarted from an older
checkpoint): psgd launch says so, --json carries it, and the exit status is not 0 unless told to accept it."""

from __future__ import annotations

import json
import logging
import time

import numpy as np
from helpers import make_job

from psgd.cli import main as cli
from psgd.job import describe_job
from psgd.launcher import EXIT_LOST_UPDATES, LaunchResult, lost_updates
from psgd.launcher import result as launched
from psgd.server import build_shard
from psgd.server.net.service import ShardServer
from psgd.wire.tls import NO_TLS


def test_lost_updates_count_what_each_shard_is_behind():
    assert lost_updates([550, 526]) == {1: 24}
    assert lost_updates([7, 7, 7]) == {} and lost_updates([]) == {}
    assert lost_updates([3, 9, 5]) == {0: 6, 2: 4}


def test_the_final_read_finds_shards_at_different_versions(tmp_path, caplog):
    """Sync, 2 shards: shard 1 restarted from a checkpoint 24 rounds old ended at 526 against 550, and
    every process and psgd launch exited 0, the loss said in one shard's log only."""
    job = make_job("model.name=softmax", "cluster.shards=2", "cluster.workers=1", "cluster.policy=async")
    servers = [ShardServer(build_shard(describe_job(job), k), "127.0.0.1:0").start() for k in range(2)]
    try:
        core = servers[0].core
        core.register(0, core.plan.hash)
        grads = {i: np.full_like(w, 1e-3) for i, w in core.weights.items()}
        for clock in range(3):  # shard 0 applied 3 updates that shard 1 does not have
            core.push(0, clock, core.version, grads)
        caplog.set_level(logging.WARNING)
        result = launched.final_evaluation(
            job, [s.address for s in servers], tmp_path, time.perf_counter(), None, NO_TLS, ""
        )
    finally:
        for s in servers:
            s.stop(grace=0.5)
    assert result.versions == [3, 0] and result.lost == {1: 3}
    assert "the shards ended at different versions: shard 1 at 0, 3 behind (100.0%)" in caplog.text


def test_launch_exits_non_zero_on_lost_updates_unless_told_to_accept_them(monkeypatch, capsys):
    found = LaunchResult(0.9, 0.3, 1.0, ["127.0.0.1:1", "127.0.0.1:3"], "/tmp/run", [550, 526], lost={1: 24})
    monkeypatch.setattr("psgd.launcher.launch", lambda *a, **k: found)
    assert cli.main(["launch", "--epochs", "1", "--json"]) == EXIT_LOST_UPDATES
    assert json.loads(capsys.readouterr().out)["lost_updates"] == {"1": 24}
    assert cli.main(["launch", "--epochs", "1", "--accept-lost-updates"]) == 0
    assert "final test accuracy" in capsys.readouterr().out
