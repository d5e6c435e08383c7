"""Going back to a cut reaches every shard or none, and only for a restart the shard can check.

A worker that takes the job back and dies after reaching some of the shards leaves the job split ([30, 57] in the
finding); a worker told by a shard that it went back finishes the job's way back itself, for the same cause (each
shard goes back once per cause), instead of waiting for it.  A rollback names its cause, the incarnation of the
shard that restarted: the shard asked looks for it at the job's own addresses, never at one the request names,
with a question that proves the job's token and an answer that must prove it too, and goes back only where a
shard of this job restarted from a cut at or past the one asked for (a made-up cause from a registered worker took
a shard back before; a shard of its own, at an address it named, took the job back once a second)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from helpers import TOKEN, make_job, run_threads

from psgd.config import Deadlines
from psgd.job import describe_job
from psgd.link import LinkError
from psgd.observe.prometheus import ShardMetrics
from psgd.server import build_shard
from psgd.server.durable import recovery
from psgd.server.net.service import ShardServer
from psgd.server.state import checkpoint
from psgd.worker.client import PSClient
from psgd.worker.errors import ShardWentBack
from psgd.worker.rollback import roll_back

SHARDS = 3


class Job:
    """SHARDS in-process shards with cuts every 2 rounds, and two registered workers, after five rounds."""

    def __init__(self, tmp_path, keep: int = 10):
        self.tmp, self.keep, self.job = (
            tmp_path,
            keep,
            make_job(
                "model.name=softmax",
                "cluster.policy=sync",
                "cluster.workers=2",
                f"cluster.shards={SHARDS}",
                "cluster.checkpoint_rounds=2",
                "cluster.transport=tcp",
                "cluster.request_timeout=6",
            ),
        )
        self.servers = [self.shard(k) for k in range(SHARDS)]
        self.job = self.job.override("cluster.servers", [s.address for s in self.servers])
        self.plan = self.servers[0].core.plan
        self.clients = [
            PSClient(
                self.job.cluster.servers,
                self.plan,
                r,
                deadlines=Deadlines(request_timeout=6),
                token=TOKEN,
                config=self.job,
            )
            for r in range(2)
        ]
        for c in self.clients:
            c.register()
        grads = {s.name: np.full(s.shape, 1e-3, np.float32) for s in self.plan.specs}
        for clock in range(5):  # five rounds: cuts at 0, 2 and 4
            run_threads([lambda c=c: c.push(clock, grads) for c in self.clients], 30)
        assert self.versions() == [5] * SHARDS

    def shard(self, k: int, bind: str = "127.0.0.1:0") -> ShardServer:
        core = build_shard(describe_job(self.job), k)
        recovery.resume(core, str(self.tmp))
        return ShardServer(
            core,
            bind,
            transport="tcp",
            token=TOKEN,
            checkpoint_dir=str(self.tmp),
            keep_checkpoints=self.keep,
            job_shards=lambda: self.job.cluster.servers,
        ).start()

    def restart(self, k: int) -> ShardServer:
        """Shard ``k`` stopped without a last checkpoint (as if killed) and started again at its address."""
        old = self.servers[k]
        old.checkpoint_dir = None  # killed: no checkpoint on the way out
        old.stop(grace=0.1)
        self.servers[k] = self.shard(k, old.address)
        return self.servers[k]

    def shard_of_its_own(self, k: int) -> ShardServer:
        """What a registered worker may run where it likes: a shard of this job (it holds the token) restored from
        shard ``k``'s newest cut, so that its Status answers as shard ``k`` restarted from it, proof and all."""
        core = build_shard(describe_job(self.job), k)
        recovery.resume(core, str(self.tmp))
        return ShardServer(core, "127.0.0.1:0", transport="tcp", token=TOKEN).start()

    def versions(self) -> list[int]:
        return [s.core.version for s in self.servers]

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for s in self.servers:
            s.stop(grace=1.0)


@pytest.fixture
def job(tmp_path):
    made = Job(tmp_path)
    yield made
    made.close()


@pytest.mark.slow
def test_a_worker_told_that_the_job_went_back_takes_the_shards_left_behind_back_too(job):
    restarted = job.restart(2)
    assert job.versions() == [5, 5, 4]  # from its cut at 4
    # worker 1 takes the job back to the cut at 4 for that restart and dies after shard 0
    job.clients[1].links[0].rollback(4, restarted.incarnation)
    assert job.versions() == [4, 5, 4]
    # worker 0 hears that shard 0 went back (ROLLED_BACK names the cut): it finishes the way back itself
    assert roll_back(job.clients[0], ShardWentBack(4)) == 4
    assert job.versions() == [4, 4, 4]
    assert [s.core.counters["rollbacks"] for s in job.servers[:2]] == [1, 1]


def test_a_rollback_for_a_restart_the_shard_cannot_check_is_refused_and_changes_nothing(job):
    """A registered worker's rollback for a made-up cause, or for a shard that did not restart: refused with
    FAILED_PRECONDITION, every shard where it was."""
    for cause in ("restart-abc", job.servers[1].incarnation):
        with pytest.raises(LinkError) as info:
            job.clients[1].links[0].rollback(4, cause)
        assert info.value.code.name == "FAILED_PRECONDITION" and "restart" in info.value.details, info.value.details
    assert job.versions() == [5, 5, 5]
    restarted = job.restart(2)  # from its cut at 4: now a cause the shard can check
    assert job.clients[1].links[0].rollback(4, restarted.incarnation).rounds_undone == 1
    assert job.versions() == [4, 5, 4]


def test_a_registered_worker_cannot_take_the_job_back_for_a_shard_it_runs_itself(job, caplog):
    """A registered worker runs a shard of its own, restored from shard 2's cut, at an address of its choosing and
    names it as the cause, a new one each time: the job went back once a second for as long as it liked.  A shard
    checks a cause only at the job's own addresses ([cluster] servers and replica_servers), refuses the rest, and
    names the worker in one ERROR line."""
    caplog.set_level(logging.INFO, logger="psgd.server")
    claimed = []
    for _ in range(3):
        fake = job.shard_of_its_own(2)
        claimed.append(fake.incarnation)
        try:
            with pytest.raises(LinkError) as info:  # it names no address: the shards know the job's own
                job.clients[1].links[0].rollback(4, fake.incarnation)
        finally:
            fake.stop(grace=0.1)
        assert info.value.code.name == "FAILED_PRECONDITION", info.value.details
    assert job.versions() == [5, 5, 5]
    assert job.servers[0].core.counters["rollbacks_refused"] == 3
    scraped = {m.name: m for m in ShardMetrics(job.servers[0].core).collect()}
    assert scraped["psgd_shard_rollbacks_refused"].samples[0].value == 3
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(said) == 1, said  # then at most once a minute, with how many more
    assert all(part in said[0] for part in ("worker 1", "127.0.0.1", claimed[0], "version 4")), said[0]


def test_a_shard_that_never_restarted_does_not_go_back_for_its_own_incarnation(job):
    """The shard asked is the one the cause names: it goes back for it only where it restarted from a cut at or past
    the one asked for (a registered worker took a fresh shard back once for each of its incarnations)."""
    with pytest.raises(LinkError) as info:
        job.clients[1].links[0].rollback(4, job.servers[0].incarnation)
    assert info.value.code.name == "FAILED_PRECONDITION" and "restart" in info.value.details, info.value.details
    assert job.versions() == [5, 5, 5]


def test_the_cause_is_checked_with_the_token_proved_not_sent(job, monkeypatch):
    """The shard asks the restarted shard's address with a question that proves the job's token: what answers
    there without proving it in turn (a process that is not of this job) is not believed."""
    restarted = job.restart(2)
    monkeypatch.setattr(restarted.servicer, "token", "not-the-jobs")  # its answers no longer prove the job's token
    with pytest.raises(LinkError) as info:
        job.clients[1].links[0].rollback(4, restarted.incarnation)
    assert info.value.code.name == "FAILED_PRECONDITION" and "without proving" in info.value.details
    assert job.versions() == [5, 5, 4]


def test_the_newest_common_cut_outlives_a_shards_newest_however_few_checkpoints_it_keeps(tmp_path):
    """With --keep-checkpoints 1 shard 0 pruned its cut at 2 as it wrote the one at 4; shard 2, killed before it
    wrote its own cut at 4, came back from 2, and no shard but it held that cut: the job could not go back
    without losing rounds.  A shard with cuts keeps the one before its newest too."""
    job = Job(tmp_path, keep=1)
    try:
        folders = [checkpoint.shard_dir(tmp_path, k, s.core.fingerprint) for k, s in enumerate(job.servers)]
        assert [sorted(checkpoint.versions(f)) for f in folders] == [[2, 4]] * SHARDS
        for written in folders[2].glob("ckpt-4.*"):  # killed before it wrote its cut at 4
            written.unlink()
        restarted = job.restart(2)
        assert restarted.core.version == 2
        assert roll_back(job.clients[0], ShardWentBack(2, restarted.incarnation)) == 2
        assert job.versions() == [2, 2, 2]
    finally:
        job.close()
