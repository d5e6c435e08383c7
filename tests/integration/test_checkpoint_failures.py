"""A shard whose checkpoints fail (a full disk): said once, counted, and said again when they succeed, instead of one
ERROR line per failed checkpoint (116 of them in one drill)."""

from __future__ import annotations

import errno
import logging

import numpy as np
from helpers import TOKEN, make_job, wait_for

from psgd.config import Deadlines
from psgd.job import describe_job
from psgd.observe.prometheus import ShardMetrics
from psgd.server import build_shard
from psgd.server.net.service import ShardServer
from psgd.server.state import checkpoint
from psgd.worker.client import PSClient


def test_failing_checkpoints_are_said_once_counted_and_their_end_said(tmp_path, monkeypatch, caplog):
    job = make_job("model.name=softmax", "cluster.policy=async", "cluster.workers=1", "cluster.shards=1")
    server = ShardServer(
        build_shard(describe_job(job), 0), "127.0.0.1:0", checkpoint_dir=str(tmp_path), checkpoint_seconds=3600
    ).start()
    real_save = checkpoint.save

    def full_disk(*args, **kwargs):
        raise checkpoint.CheckpointError(f"{tmp_path}: cannot write a checkpoint: No space left on device")

    try:
        caplog.set_level(logging.INFO, logger="psgd.server")
        monkeypatch.setattr(checkpoint, "save", full_disk)
        assert [server.save_checkpoint(force=True) for _ in range(50)] == [False] * 50
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "No space left on device" in errors[0], errors
        assert server.core.counters["checkpoint_failures"] == 50
        monkeypatch.setattr(checkpoint, "save", real_save)
        assert server.save_checkpoint(force=True)
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("checkpoints are written again" in m and "50 failed" in m for m in said), said
    finally:
        server.stop(grace=1.0)


def out_of_descriptors(*args, **kwargs):
    """What listing a folder meets when a flood of connections has taken every descriptor of the process."""
    raise OSError(errno.EMFILE, "Too many open files")


def test_a_checkpoint_loop_that_runs_out_of_descriptors_goes_on_and_writes_again(tmp_path, monkeypatch, caplog):
    """Periodic checkpoints (async) whose folder cannot be listed for a while: the loop goes on, and once the
    descriptors are back the next version is checkpointed.  Before, the loop's thread died of the OSError
    ("Exception in thread shard0-checkpoints") and no checkpoint was written again."""
    job = make_job(
        "model.name=softmax",
        "cluster.policy=async",
        "cluster.workers=1",
        "cluster.shards=1",
        "cluster.transport=tcp",
        "cluster.request_timeout=5",
    )
    server = ShardServer(
        build_shard(describe_job(job), 0),
        "127.0.0.1:0",
        transport="tcp",
        token=TOKEN,
        checkpoint_dir=str(tmp_path),
        checkpoint_seconds=0.05,
    ).start()
    job = job.override("cluster.servers", [server.address])
    plan = server.core.plan
    folder = checkpoint.shard_dir(tmp_path, 0, server.core.fingerprint)
    caplog.set_level(logging.INFO, logger="psgd.server")
    try:
        wait_for(lambda: checkpoint.versions(folder) == [0], 10, "the first checkpoint")
        with PSClient(
            job.cluster.servers, plan, 0, deadlines=Deadlines(request_timeout=5), token=TOKEN, config=job
        ) as client:
            client.register()
            grads = {s.name: np.full(s.shape, 1e-3, np.float32) for s in plan.specs}
            with monkeypatch.context() as patched:  # neither a checkpoint's files nor the folder's list
                patched.setattr(checkpoint, "_write_atomically", out_of_descriptors)
                patched.setattr(checkpoint, "_versions", out_of_descriptors)
                client.push(0, grads)
                wait_for(
                    lambda: server.core.counters.get("checkpoint_failures", 0) >= 2,
                    10,
                    "the checkpoint loop to fail twice",
                )
            client.push(1, grads)
            wait_for(lambda: 2 in checkpoint.versions(folder), 10, "a checkpoint of version 2")
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "Too many open files" in errors[0], errors
    finally:
        server.stop(grace=1.0)


def test_a_background_loop_that_meets_an_error_says_it_counts_it_and_goes_on(tmp_path, caplog):
    """Whatever a turn of a shard's background loops raises (here the lease reaper's), the loop goes on: the error
    is counted (Status, Prometheus) and said once, with its traceback, not once per turn."""
    job = make_job(
        "model.name=softmax",
        "cluster.policy=async",
        "cluster.workers=1",
        "cluster.shards=1",
        "cluster.lease_seconds=0.4",
    )
    server = ShardServer(build_shard(describe_job(job), 0), "127.0.0.1:0").start()
    real, turns = server.core.expire_leases, []

    def broken():
        turns.append(1)
        if len(turns) <= 5:
            raise RuntimeError("a fault of the lease reaper's own")
        return real()

    caplog.set_level(logging.INFO, logger="psgd.server")
    server.core.expire_leases = broken
    try:
        wait_for(lambda: len(turns) >= 8, 10, "the lease reaper to go on after its errors")
        assert server.core.counters["background_errors"] == 5
        scraped = {m.name: m for m in ShardMetrics(server.core).collect()}
        assert scraped["psgd_shard_background_errors"].samples[0].value == 5
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "the lease reaper failed" in errors[0].getMessage(), errors
        assert errors[0].exc_info is not None
    finally:
        server.stop(grace=1.0)
