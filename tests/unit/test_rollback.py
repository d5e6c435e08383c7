"""A shard going back to a cut (sync with checkpoint_rounds), driven directly: psgd.server.durable.recovery.rollback and
the core's refusals of workers that have not gone back yet.  Plans and helpers are test_shard_core's."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from test_shard_core import PLAN, error, grads_of, make_core, push, register_all, weights

from psgd.server.durable import recovery
from psgd.server.errors import ShardError
from psgd.server.state import checkpoint
from psgd.server.state.rewind import ROLLBACK_SPACING
from psgd.server.state.rounds import Round

K = 2  # rounds between cuts


def cut_core(tmp_path, workers: int = 2):
    """A sync core that writes a checkpoint (a cut) at version 0 and at every K-th round, into tmp_path."""
    core, clock = make_core("sync", workers, cut_rounds=K)
    folder = checkpoint.shard_dir(tmp_path, 0, core.fingerprint)
    core.on_cut = lambda: recovery.write(core, folder, keep=10, held=True)
    recovery.write(core, folder, keep=10)
    register_all(core)
    return core, folder


def rounds(core, first: int, last: int) -> None:
    """Every worker pushes clocks first..last-1, one round each."""
    for c in range(first, last):
        for w in range(core.num_workers):
            push(core, w, c)


def test_a_shard_goes_back_to_its_cut_once_per_cause_and_every_worker_is_told(tmp_path):
    core, folder = cut_core(tmp_path)
    rounds(core, 0, 2)
    at_cut = weights(core)
    rounds(core, 2, 5)
    assert core.version == 5 and recovery.cuts(core, folder) == [4, 2, 0]
    assert recovery.rollback(core, folder, 2, "shard1-restart", worker=0) == 3
    assert core.version == 2 and core.counters["rollbacks"] == 1 and core.counters["rounds_undone"] == 3
    assert core.counters["applied"] == core.version  # the updates the weights hold
    for name, value in at_cut.items():
        np.testing.assert_array_equal(weights(core)[name], value)
    assert core.policy.clock_of(0) == core.policy.clock_of(1) == 2
    # a second worker asking for the same cause changes nothing, even once the job has moved on
    push(core, 0, 2)
    assert recovery.rollback(core, folder, 2, "shard1-restart", worker=1) == 0
    assert core.round.bases and core.counters["rollbacks"] == 1
    # worker 1 has not gone back yet: its later clock is refused, naming where to continue
    refused = error(push, core, 1, 4)
    assert (refused.code, refused.reason, refused.rewind_to) == ("FAILED_PRECONDITION", "ROLLED_BACK", 2)
    assert "continues from clock 2" in refused.message
    push(core, 1, 2)  # the repeated round closes, as it closed the first time
    assert core.version == 3 and core.rewind.rewinding == {}


def test_the_same_rounds_after_going_back_give_the_same_bits(tmp_path):
    """Three workers whose pushes arrive in another order the second time: the round's sum is the same."""
    core, folder = cut_core(tmp_path, workers=3)
    rng = np.random.default_rng(5)
    g = {}
    for c in range(4):  # workers 0 and 2 cancel each other: how the sum rounds shows the order it was added in
        big, small = (
            (rng.standard_normal(12), rng.standard_normal(3)),
            (rng.standard_normal(12), rng.standard_normal(3)),
        )
        g[0, c], g[1, c], g[2, c] = tuple(1e16 * p for p in big), small, tuple(-1e16 * p for p in big)
    for c in range(4):
        for w in (0, 1, 2):
            push(core, w, c, g[w, c])
    first = weights(core)
    recovery.rollback(core, folder, 2, "restart", worker=2)
    for c in (2, 3):
        for w in (2, 0, 1):
            push(core, w, c, g[w, c])
    for name, value in first.items():
        np.testing.assert_array_equal(weights(core)[name], value)


def test_a_round_in_flight_keeps_its_pushes_apart_through_a_checkpoint(tmp_path):
    """Found by the chaos suite (seed 20, run 1): a shard stopped (SIGTERM) in the middle of a round wrote the
    round's pushes summed, and the rest of the round was added after them, in another order than undisturbed."""
    rng = np.random.default_rng(7)
    big, small = (rng.standard_normal(12), rng.standard_normal(3)), (rng.standard_normal(12), rng.standard_normal(3))
    g = {0: tuple(1e16 * p for p in big), 1: small, 2: tuple(-1e16 * p for p in big)}
    undisturbed, _ = cut_core(tmp_path / "a", workers=3)
    for w in (0, 1, 2):
        push(undisturbed, w, 0, g[w])
    stopped, folder = cut_core(tmp_path / "b", workers=3)
    for w in (0, 2):  # worker 1's push is still to come when the shard stops
        push(stopped, w, 0, g[w])
    recovery.write(stopped, folder, keep=10, force=True)
    restarted, _ = make_core("sync", 3, cut_rounds=K)
    recovery.resume(restarted, tmp_path / "b")
    assert [restarted.register(w, PLAN.hash) for w in range(3)] == [1, 0, 1]  # workers 0 and 2 pushed clock 0
    push(restarted, 1, 0, g[1])
    assert restarted.version == undisturbed.version == 1
    for name, value in weights(undisturbed).items():
        np.testing.assert_array_equal(weights(restarted)[name], value)


def test_an_unordered_round_depends_on_the_order_an_ordered_one_does_not():
    core, _ = make_core("sync", 3)
    gs = [grads_of(np.full(12, v), np.full(3, v)) for v in (1e16, 1.0, -1e16)]
    sums = {}
    for ordered in (False, True):
        for order in ((0, 1, 2), (0, 2, 1)):
            r = Round(core.store, ordered=ordered)
            for w in order:
                r.add(gs[w], 0, worker=w)
            r.mean()
            sums[ordered, order] = r.flat.copy()
    assert not np.array_equal(sums[False, (0, 1, 2)], sums[False, (0, 2, 1)])
    np.testing.assert_array_equal(sums[True, (0, 1, 2)], sums[True, (0, 2, 1)])


def test_a_pull_waiting_on_a_round_hears_of_the_rollback(tmp_path):
    core, folder = cut_core(tmp_path)
    rounds(core, 0, 3)
    push(core, 0, 3)
    out: dict = {}

    def pull():
        try:
            core.pull(0, 4, timeout=10)
        except ShardError as err:
            out["error"] = err

    waiting = threading.Thread(target=pull)
    waiting.start()
    recovery.rollback(core, folder, 2, "restart", worker=1)
    waiting.join(10)
    assert not waiting.is_alive() and out["error"].reason == "ROLLED_BACK" and out["error"].rewind_to == 2


def test_a_worker_dropped_past_its_lease_catches_up_under_cuts(tmp_path):
    """Found by the chaos suite (seed 20, run 1): a worker paused past its lease comes back behind the rounds that
    closed without it; its pull of its own older clock is answered with the current weights (its push is then
    late and it jumps ahead), as without cuts: a shard must not wait for a rollback nobody started."""
    core, folder = cut_core(tmp_path, workers=3)
    rounds(core, 0, 3)
    core.roster.workers[0].deadline = -1.0  # worker 0's lease ran out
    core.expire_leases()
    for c in range(3, 8):
        for w in (1, 2):
            push(core, w, c)
    assert core.version == 8
    core.register(0, PLAN.hash)
    read = core.pull(0, 3, timeout=0.5)
    assert read.version == 8
    read.release()
    assert push(core, 0, 3).outcome == "late"


def test_going_back_is_refused_where_the_cut_is_not_held_and_the_cuts_are_listed(tmp_path):
    core, folder = cut_core(tmp_path)
    rounds(core, 0, 3)
    assert recovery.cuts(core, folder) == [2, 0]
    missing = error(recovery.rollback, core, folder, 1, "restart", 0)
    assert missing.code == "FAILED_PRECONDITION" and "cannot go back to the cut at version 1" in missing.message
    ahead = error(recovery.rollback, core, folder, 6, "restart", 0)
    assert "behind the cut at 6" in ahead.message
    assert core.version == 3 and core.counters["rollbacks"] == 0


def test_a_shard_restarted_from_a_cut_tells_a_worker_that_is_past_it(tmp_path):
    core, folder = cut_core(tmp_path)
    rounds(core, 0, 3)
    restarted, _ = make_core("sync", 2, cut_rounds=K)
    recovery.resume(restarted, tmp_path)
    assert restarted.version == 2
    hello = (PLAN.hash, json.dumps(PLAN.description()))
    assert restarted.register(0, *hello, clock=3) == 2
    assert restarted.rewind.cut_asked == {0: 2}
    assert error(push, restarted, 0, 3).reason == "ROLLED_BACK"
    assert restarted.register(1, *hello, clock=2) == 2 and 1 not in restarted.rewind.cut_asked  # not past it


def test_a_cut_needs_every_worker_in_every_round():
    from helpers import make_job

    from psgd.config import ConfigError

    with pytest.raises(ConfigError, match="backup_workers = 1 closes rounds without some"):
        make_job("cluster.policy=sync", "cluster.checkpoint_rounds=4", "cluster.backup_workers=1", "cluster.workers=2")


def test_a_rollback_names_its_cause_and_a_storm_of_causes_goes_back_once_a_second(tmp_path):
    """Found: an empty cause was accepted, and 141 rollbacks with made-up causes held a job at one version for
    30 s.  A shard goes back for a new cause at most once a ROLLBACK_SPACING; a worker told to wait retries."""
    core, folder = cut_core(tmp_path)
    rounds(core, 0, 5)
    for cause in ("", "x" * 65, "line\nbreak"):
        err = error(recovery.rollback, core, folder, 2, cause, worker=0)
        assert err.code == "INVALID_ARGUMENT" and "cause" in err.message
    assert core.version == 5
    assert recovery.rollback(core, folder, 4, "restart-1", worker=0) == 1
    rounds(core, 4, 5)
    for n in range(20):  # made-up causes, at once: refused, the job goes on from where it is
        err = error(recovery.rollback, core, folder, 2, f"made-up-{n}", worker=1)
        assert err.code == "UNAVAILABLE" and "at most once a" in err.message
    assert core.version == 5 and core.counters["rollbacks"] == 1
    assert recovery.rollback(core, folder, 4, "restart-1", worker=1) == 0  # the same cause again: nothing to do
    core.rewind.causes["restart-1"] -= ROLLBACK_SPACING  # a second later
    assert recovery.rollback(core, folder, 4, "restart-2", worker=1) == 1


def test_a_shard_reads_the_jobs_addresses_where_the_launch_writes_them_after_it_started(tmp_path, monkeypatch):
    """psgd launch starts each shard on a port of its choosing and writes the job's addresses into the job file once
    all are bound: a shard that found none there at its start reads them again when it checks a rollback's cause
    (only there: never at an address the rollback names)."""
    from helpers import make_job

    from psgd.cli.common import job_from_args
    from psgd.cli.server import _job_shards, build_parser
    from psgd.config import to_toml

    monkeypatch.delenv("PSGD_SERVERS", raising=False)
    monkeypatch.delenv("PSGD_REPLICA_SERVERS", raising=False)
    job, path = make_job("cluster.policy=async", "cluster.shards=2", "cluster.replicas=1"), tmp_path / "job.toml"
    path.write_text(to_toml(job.to_dict()))
    args = build_parser().parse_args(["-c", str(path), "--shard", "1"])
    addresses = _job_shards(args, job_from_args(args))
    assert addresses() == []
    job = job.override("cluster.servers", ["127.0.0.1:7001", "127.0.0.1:7002"])
    job = job.override("cluster.replica_servers", ["127.0.0.1:7101", "127.0.0.1:7102"])
    path.write_text(to_toml(job.to_dict()))
    assert addresses() == ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7101", "127.0.0.1:7102"]
