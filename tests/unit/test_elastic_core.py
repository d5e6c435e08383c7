"""A job with a range of workers ("MIN:MAX") in the shard core, without any network: it starts with MIN, a worker
takes the lowest free rank (psgd-worker --rank auto) and joins a running round, and one that leaves while MIN stay
frees its rank instead of finishing it; "divided" divides by the workers training now."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_shard_core import JOIN, LEASE, PLAN, FakeClock, error, make_core, push

from psgd.config import ConfigError, Deadlines, JobConfig, workers_range
from psgd.job import identity
from psgd.server.state.admission import Roster

PLAN_JSON = json.dumps(PLAN.description())


def elastic(policy: str = "sync", fewest: int = 2, most: int = 4, **kw):
    return make_core(policy, most, fewest=fewest, **kw)


def join(core, who: str = "joiner") -> int:
    """A process that takes a rank, then registers it as any worker does; returns the rank."""
    rank = core.lobby.take_rank(PLAN.hash, PLAN_JSON, "host", 7, None, who)
    core.register(rank, PLAN.hash, PLAN_JSON, incarnation=who)
    return rank


# -- the job file ---------------------------------------------------------------------------------------------------
def test_workers_takes_a_range_and_writes_it_back():
    job = JobConfig().override("cluster.workers", "2:8")
    job.validate()
    c = job.cluster
    assert (c.workers, c.min_workers, c.fewest, c.elastic) == (8, 2, 2, True)
    assert job.to_dict()["cluster"]["workers"] == "2:8" and "min_workers" not in job.to_dict()["cluster"]
    assert JobConfig.from_dict(job.to_dict()).cluster == c
    fixed = job.override("cluster.workers", 3).cluster
    assert (fixed.workers, fixed.fewest, fixed.elastic) == (3, 3, False)
    assert job.override("cluster.workers", "4:4").cluster.elastic is False  # a range of one count is that count


def test_a_range_is_part_of_the_job_every_process_compares():
    fixed, ranged = JobConfig().override("cluster.workers", 8), JobConfig().override("cluster.workers", "2:8")
    assert identity(fixed, "p")["workers"] == 8 and identity(ranged, "p")["workers"] == "2:8"


@pytest.mark.parametrize("bad", ["8:2", "0:4", "a:b", "2:", ":3", "1.5", True])
def test_a_bad_range_is_refused_in_words(bad):
    with pytest.raises(ConfigError, match=r'workers must be a number of workers or a range "MIN:MAX"'):
        workers_range(bad)


def test_a_range_is_refused_with_replicas_which_do_not_keep_the_batches_handed_out():
    job = JobConfig().apply_sets(['cluster.workers="2:4"', "cluster.policy=async", "cluster.replicas=1"], False)
    with pytest.raises(ConfigError, match="does not keep the batches shard 0 hands out"):
        job.validate()


def test_backup_workers_must_stay_below_the_fewest():
    job = JobConfig().override("cluster.workers", "2:8").override("cluster.backup_workers", 2)
    with pytest.raises(ConfigError, match=r"backup_workers \(2\) must be less than workers \(2, the fewest"):
        job.validate()


# -- the roster -----------------------------------------------------------------------------------------------------
def test_ranks_above_the_fewest_are_free_and_taken_lowest_first():
    roster = Roster(0, 4, Deadlines(lease_seconds=LEASE, join_timeout=JOIN), FakeClock(), fewest=2)
    assert [roster.workers[w].state for w in range(4)] == ["pending", "pending", "free", "free"]
    assert roster.expected() == [0, 1]
    assert roster.pick() == 0  # a rank expected and not yet registered first: Compose's replicas all say auto
    for w in range(4):
        roster.admit(w, "h", 1, f"p{w}")
    with pytest.raises(Exception, match="every rank of this job") as info:
        roster.pick()
    assert info.value.code == "RESOURCE_EXHAUSTED"


def test_a_rank_whose_lease_ran_out_is_taken_only_when_no_other_is_free():
    clock = FakeClock()
    roster = Roster(0, 4, Deadlines(lease_seconds=LEASE, join_timeout=JOIN), clock, fewest=2)
    for w in (0, 1, 2):
        roster.admit(w, "h", 1, f"p{w}")
    clock.advance(LEASE + 1)
    roster.live(0, None)
    roster.live(2, None)
    assert roster.overdue() == [1]  # paused past its lease: it may come back for rank 1
    assert roster.pick() == 3
    roster.admit(3, "h", 1, "p3")
    assert roster.pick() == 1


def test_a_worker_leaving_above_the_fewest_frees_its_rank_below_it_is_done():
    roster = Roster(0, 4, Deadlines(lease_seconds=LEASE, join_timeout=JOIN), FakeClock(), fewest=2)
    keys = {w: roster.admit(w, "h", 1, f"p{w}").key for w in range(3)}
    assert roster.leave(2, 5, keys[2]) and roster.workers[2].state == "left"
    assert roster.leave(2, 5, keys[2]) is False  # said again (its answer lost): nothing more
    assert roster.pick() == 2  # free again for the next to join
    assert roster.leave(1, 5, keys[1]) and roster.workers[1].state == "done"  # 2 live: the fewest
    assert roster.finished(0.0) is False
    assert roster.leave(0, 5, keys[0]) and roster.finished(0.0)  # left, done and never-taken ranks: finished


def test_a_fixed_job_keeps_its_roster_as_it_was():
    roster = Roster(0, 3, Deadlines(lease_seconds=LEASE, join_timeout=JOIN), FakeClock())
    keys = {w: roster.admit(w, "h", 1, f"p{w}").key for w in range(3)}
    assert roster.leave(2, 1, keys[2]) and roster.workers[2].state == "done"


# -- the core -------------------------------------------------------------------------------------------------------
def test_a_sync_job_starts_with_its_fewest_and_a_joiner_enters_the_open_round():
    core, _ = elastic("sync")
    for w in (0, 1):
        core.register(w, PLAN.hash, PLAN_JSON, incarnation=f"p{w}")
    push(core, 0, 0)
    push(core, 1, 0)
    assert core.version == 1  # ranks 2 and 3 were not waited for
    rank = join(core)
    assert rank == 2 and core.policy.clock_of(2) == 1
    push(core, 0, 1)
    push(core, 1, 1)
    assert core.version == 1  # the round now waits for the joiner too
    push(core, 2, 1)
    assert core.version == 2
    assert core.status()["members"] == 3 and core.status()["workers_range"] == [2, 4]


def test_a_sync_worker_that_leaves_does_not_hold_the_round_and_its_rank_is_free_again():
    core, _ = elastic("sync")
    for w in (0, 1, 2):
        core.register(w, PLAN.hash, PLAN_JSON, incarnation=f"p{w}")
    push(core, 0, 0)
    push(core, 1, 0)
    key = core.roster.workers[2].key
    assert core.done(2, 0, key) == 2  # leaves before pushing round 0: the round closes without it
    assert core.version == 1 and core.roster.workers[2].state == "left"
    assert join(core, "another") == 2


def test_a_rank_is_given_only_for_the_same_job():
    core, _ = elastic("sync")
    err = error(core.lobby.take_rank, "another plan", PLAN_JSON, "h", 1, None, "x")
    assert err.code == "FAILED_PRECONDITION" and core.roster.workers[0].state == "pending"


@pytest.mark.parametrize("policy", ["async", "ssp"])
def test_divided_divides_by_the_workers_training_now(policy):
    core, _ = elastic(policy, async_lr="divided", options={"staleness": 2} if policy == "ssp" else None)
    assert core.remedies.scale == pytest.approx(1 / 2)
    for w in (0, 1):
        core.register(w, PLAN.hash, PLAN_JSON, incarnation=f"p{w}")
    join(core)
    assert core.remedies.scale == pytest.approx(1 / 3)
    core.done(2, 0, core.roster.workers[2].key)
    assert core.remedies.scale == pytest.approx(1 / 2)


def test_a_fixed_job_divides_by_its_count_whoever_trains():
    core, _ = make_core("async", 4, async_lr="divided")
    core.register(0, PLAN.hash, PLAN_JSON, incarnation="p0")
    core.done(0, 0, core.roster.workers[0].key)
    assert core.remedies.scale == pytest.approx(1 / 4)


def test_shard_0_hands_each_clock_its_batch_and_takes_back_those_of_a_worker_that_leaves():
    core, clock = elastic("async")
    keys = {}
    for w in (0, 1, 2):
        core.register(w, PLAN.hash, PLAN_JSON, incarnation=f"p{w}")
        keys[w] = core.roster.workers[w].key
    got = {(w, c): core.lobby.batch(w, c, 10, keys[w]) for c in (0, 1) for w in (0, 1, 2)}
    assert sorted(got.values()) == list(range(6))
    assert core.lobby.batch(1, 1, 10, keys[1]) == got[(1, 1)]  # asked again: the same
    err = error(core.lobby.batch, 0, 2, 11, keys[0])
    assert (err.code, err.reason) == ("FAILED_PRECONDITION", "JOB_MISMATCH") and "said 10" in str(err)
    assert error(core.lobby.batch, 0, 2, 10, "another key").code == "PERMISSION_DENIED"
    core.done(2, 1, keys[2])  # left before pushing clock 1: its batch of clock 1 goes to the next to ask
    assert core.lobby.batch(0, 2, 10, keys[0]) == got[(2, 1)]
    assert core.status()["counters"]["batches"] == {"total": 10, "left": 4, "given_back": 1, "lapsed": {}}
    clock.advance(LEASE + 1)  # worker 1 never pushed (its clock is 0): its lease runs out
    core.heartbeat(0, 3, keys[0])
    core.expire_leases()
    batches = core.status()["counters"]["batches"]
    assert batches["given_back"] == 1 and batches["lapsed"] == {"1": 0}  # paused or dead: kept for its rank
    core.register(1, PLAN.hash, PLAN_JSON, incarnation="next")  # the next process of rank 1
    key = core.roster.workers[1].key
    assert [core.lobby.batch(1, c, 10, key) for c in (0, 1)] == [got[(1, 0)], got[(1, 1)]]


def test_only_shard_0_of_a_job_with_a_range_hands_out_batches_or_ranks():
    fixed, _ = make_core("sync", 2)
    assert error(fixed.lobby.batch, 0, 0, 10, None).code == "INVALID_ARGUMENT"
    assert "hands out no ranks" in str(error(fixed.lobby.take_rank, PLAN.hash, PLAN_JSON, "h", 1, None, "x"))


def test_a_worker_that_took_its_rank_says_it_in_its_metrics():
    from prometheus_client import generate_latest

    from psgd.observe.prometheus import WorkerMetrics

    metrics = WorkerMetrics(-1)  # psgd-worker --rank auto, before shard 0 answered
    metrics.took_rank(2)
    text = generate_latest(metrics.registry).decode()
    assert 'psgd_worker_info{rank="2"} 1.0' in text and 'rank="-1"' not in text


def test_a_restarted_shard_0_hands_out_from_where_its_checkpoint_left():
    """Shard 0's batches travel in its checkpoint: a process restored from it gives a worker the batch of a clock it
    had not pushed (the same again) and the next batches never handed out, none twice."""
    import numpy as np

    from psgd.server.state.checkpoint import Checkpoint

    core, _ = elastic("async")
    for w in (0, 1):
        core.register(w, PLAN.hash, PLAN_JSON, incarnation=f"p{w}")
    keys = {w: core.roster.workers[w].key for w in (0, 1)}
    taken = [core.lobby.batch(w, 0, 10, keys[w]) for w in (0, 1)]
    push(core, 0, 0)  # worker 0 pushed its clock 0; worker 1 has not
    saved = {}
    core.write_checkpoint(lambda version, arrays, manifest: saved.update(arrays=arrays, manifest=manifest))
    restored, _ = elastic("async")
    arrays = {k: np.array(v) for k, v in saved["arrays"].items()}
    restored.adopt(Checkpoint(json.loads(json.dumps(saved["manifest"])), arrays, Path("ckpt")), restored=True)
    for w in (0, 1):
        restored.register(w, PLAN.hash, PLAN_JSON, incarnation=f"p{w}")
    again = {w: restored.roster.workers[w].key for w in (0, 1)}
    assert restored.lobby.batch(1, 0, 10, again[1]) == taken[1]  # not pushed: the same batch
    later = [restored.lobby.batch(0, 1, 10, again[0]), restored.lobby.batch(1, 1, 10, again[1])]
    assert sorted(later) == [2, 3] and not set(later) & set(taken)
