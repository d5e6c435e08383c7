"""A shard that cannot write a cut (sync with checkpoint_rounds; a full disk, a folder gone) does what
``[cluster] on_cut_failure`` says: "stop" (the default) refuses every call from then on, saying why, so that the
job never goes on without the cuts that make a restart lose nothing; "continue" goes on, said once."""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil

import numpy as np
import pytest
from helpers import TOKEN, make_job

from psgd.config import Deadlines
from psgd.job import describe_job
from psgd.server import build_shard
from psgd.server.net.service import ShardServer
from psgd.server.state import checkpoint
from psgd.worker.client import PSClient
from psgd.worker.errors import PSError


@contextlib.contextmanager
def pushing(tmp_path, setting: str = "stop"):
    """A sync shard with cuts every 2 rounds (on_cut_failure = ``setting``) and its one worker's client, after the
    rounds of clocks 0 and 1 (their cut written); yields (server, client, a gradient)."""
    job = make_job(
        "model.name=softmax",
        "cluster.policy=sync",
        "cluster.workers=1",
        "cluster.shards=1",
        "cluster.checkpoint_rounds=2",
        "cluster.transport=tcp",
        "cluster.request_timeout=5",
        f"cluster.on_cut_failure={setting}",
    )
    server = ShardServer(
        build_shard(describe_job(job), 0),
        "127.0.0.1:0",
        transport="tcp",
        token=TOKEN,
        checkpoint_dir=str(tmp_path),
        on_cut_failure=job.cluster.recovery.on_cut_failure,
    ).start()
    job = job.override("cluster.servers", [server.address])
    plan = server.core.plan
    try:
        with PSClient(
            job.cluster.servers, plan, 0, deadlines=Deadlines(request_timeout=5), token=TOKEN, config=job
        ) as client:
            client.register()
            grads = {s.name: np.full(s.shape, 1e-3, np.float32) for s in plan.specs}
            for clock in range(2):
                client.push(clock, grads)
            yield server, client, grads
    finally:
        server.stop(grace=1.0)


@pytest.mark.parametrize("setting", ["stop", "continue"])
def test_a_cut_that_cannot_be_written_stops_the_job_or_is_said_once(tmp_path, setting, caplog):
    caplog.set_level(logging.INFO, logger="psgd.server")
    with pushing(tmp_path, setting) as (server, client, grads):
        folder = checkpoint.shard_dir(tmp_path, 0, server.core.fingerprint)
        assert checkpoint.versions(folder) == [2, 0]
        shutil.rmtree(folder)
        folder.write_text("the disk took this place")  # the next cut cannot be written
        for clock in range(2, 4):
            client.push(clock, grads)  # the round of clock 3 closes at version 4: its cut fails
        if setting == "stop":
            with pytest.raises(PSError, match="could not write its cut at version 4") as refused:
                client.push(4, grads)
            assert 'on_cut_failure = "continue"' in str(refused.value)
            assert server.core.version == 4
        else:
            for clock in range(4, 8):  # a second failed cut (at 6) is not said again
                client.push(clock, grads)
            said = [r.getMessage() for r in caplog.records if "goes on" in r.getMessage()]
            assert len(said) == 1 and "on_cut_failure" in said[0], said
            assert server.core.version == 8


def test_a_cut_that_fails_for_want_of_descriptors_stops_the_job(tmp_path, monkeypatch):
    """A cut whose write fails while the process has no descriptor left (a flood of connections took them): the
    failure is the cut's, and on_cut_failure = "stop" stops the job.  Before, saying which checkpoint was left to
    fall back on listed the folder, failed again, and that OSError escaped the round's closing: the job went on."""

    def no_descriptor(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    with pushing(tmp_path) as (server, client, grads):
        with monkeypatch.context() as patched:
            patched.setattr(checkpoint, "_write_atomically", no_descriptor)
            patched.setattr(checkpoint, "_versions", no_descriptor)
            for clock in range(2, 4):
                client.push(clock, grads)  # the round of clock 3 closes at version 4: its cut fails
            with pytest.raises(PSError, match="could not write its cut at version 4"):
                client.push(4, grads)
            assert server.core.version == 4
