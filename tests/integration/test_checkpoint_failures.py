"""A shard whose checkpoints fail (a full disk): said once, counted, and said again when they succeed, instead of one
ERROR line per failed checkpoint (116 of them in one drill)."""

from __future__ import annotations

import logging

from psgd.job import describe_job
from psgd.server import build_shard, checkpoint
from psgd.server.service import ShardServer

from helpers import make_job


def test_failing_checkpoints_are_said_once_counted_and_their_end_said(tmp_path, monkeypatch, caplog):
    job = make_job("model.name=softmax", "cluster.policy=async", "cluster.workers=1", "cluster.shards=1")
    server = ShardServer(build_shard(describe_job(job), 0), "127.0.0.1:0", checkpoint_dir=str(tmp_path),
                         checkpoint_seconds=3600).start()
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
