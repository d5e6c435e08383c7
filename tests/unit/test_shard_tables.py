"""A shard's rows of an embedding table under every policy: a sync round's row gradients averaged over its pushes,
async ones applied on arrival at the push's rate, a retried push applied once, hostile rows refused with every
row unchanged, and a round in flight kept by a checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from psgd.config import JobConfig
from psgd.job import describe_job
from psgd.model.table import initial_rows
from psgd.server import build_shard
from psgd.server.durable import recovery
from psgd.server.errors import ShardError
from psgd.server.state import checkpoint

DIM = 4


def shard(policy="sync", workers=2, cluster=(), **tables):
    config = JobConfig()
    config = config.apply_sets(
        [
            "model.name=embed",
            f"model.dim={DIM}",
            "model.hidden=[4]",
            "data.name=clicks",
            f"cluster.policy={policy}",
            "cluster.shards=2",
            f"cluster.workers={workers}",
            "tables.optimizer=sgd",
            "tables.lr=1.0",
            "train.dtype=float64",
            *(f"tables.{k}={v}" for k, v in tables.items()),
            *(f"cluster.{c}" for c in cluster),
        ]
    )
    job = describe_job(config)
    core = build_shard(job, 0)
    for w in range(workers):
        core.register(w, job.plan.hash)
    return job, core


def mine(job, n=6, start=0):
    """``n`` ids of shard 0's rows."""
    ids = np.arange(start, start + 20 * n, dtype=np.int64)
    return ids[job.plan.shard_of_ids("emb", ids) == 0][:n]


def dense(core, value=0.0):
    return {i: np.full(s.size, value) for i, s in core.slices.items()}


def first(job, ids):
    return initial_rows(job.plan.table_by_name["emb"], job.config.train.seed, ids)


def test_a_sync_round_averages_its_row_gradients_over_its_pushes():
    job, core = shard("sync")
    ids = mine(job, 6)
    a, b = ids[:4], ids[2:]  # rows 2 and 3 touched by both workers
    start = core.read_rows(0, {"emb": ids})["emb"]
    np.testing.assert_array_equal(start, first(job, ids))
    core.push(0, 0, 0, dense(core), rows={"emb": (a, np.ones((4, DIM)))})
    assert np.array_equal(core.read_rows(None, {"emb": ids})["emb"], start)  # nothing until the round closes
    core.push(1, 0, 0, dense(core), rows={"emb": (b, np.full((4, DIM), 3.0))})
    want = start.copy()
    want[:2] -= 1.0 / 2  # worker 0's alone, over 2 pushes
    want[2:4] -= (1.0 + 3.0) / 2  # both
    want[4:] -= 3.0 / 2  # worker 1's alone
    np.testing.assert_allclose(core.read_rows(None, {"emb": ids})["emb"], want)
    assert core.version == 1 and core.status()["tables"]["emb"]["rows"] == 6


def test_a_sync_rounds_row_gradients_are_added_in_the_workers_order_not_the_order_they_came():
    """Three workers' gradients of one row that cancel: how the sum rounds would show the order of the additions."""
    rows = {}
    for order in ((0, 1, 2), (2, 0, 1)):
        job, core = shard("sync", workers=3)
        ids = mine(job, 1)
        core.read_rows(0, {"emb": ids})
        grads = {0: np.full((1, DIM), 1e16), 1: np.full((1, DIM), 1.0), 2: np.full((1, DIM), -1e16)}
        for w in order:
            core.push(w, 0, 0, dense(core), rows={"emb": (ids, grads[w])})
        rows[order] = core.read_rows(None, {"emb": ids})["emb"]
    np.testing.assert_array_equal(rows[0, 1, 2], rows[2, 0, 1])


def test_async_rows_are_applied_on_arrival_at_the_pushs_rate_and_a_retried_push_once():
    job, core = shard("async", workers=4)
    ids = mine(job, 3)
    start = core.read_rows(0, {"emb": ids})["emb"]
    for _ in range(2):  # the same (worker, clock) twice: a retry
        core.push(0, 0, 0, dense(core), rows={"emb": (ids, np.ones((3, DIM)))})
    np.testing.assert_allclose(core.read_rows(0, {"emb": ids})["emb"], start - 1.0 / 4)  # lr / workers, once


@pytest.mark.parametrize(
    "rows, words",
    [
        (lambda ids: {"emb": (np.concatenate([ids[:2], ids[:1]]), np.ones((3, DIM)))}, "an id is repeated"),
        (lambda ids: {"emb": (np.arange(40, dtype=np.int64), np.ones((40, DIM)))}, "not shard 0's"),
        (lambda ids: {"emb": (ids, np.ones((len(ids), DIM + 1)))}, "need gradients of shape"),
        (lambda ids: {"emb": (ids.astype(np.float64), np.ones((len(ids), DIM)))}, "must be one int64 array"),
        (lambda ids: {"emb": (ids, np.full((len(ids), DIM), np.nan))}, "non-finite"),
        (lambda ids: {"users": (ids, np.ones((len(ids), DIM)))}, "no table 'users'"),
    ],
)
def test_hostile_rows_are_refused_and_change_nothing(rows, words):
    job, core = shard("async")
    ids = mine(job, 3)
    before = core.read_rows(0, {"emb": ids})["emb"]
    with pytest.raises(ShardError, match=words) as info:
        core.push(0, 0, 0, dense(core, 0.5), rows=rows(ids))
    assert info.value.code == "INVALID_ARGUMENT"
    assert core.version == 0 and core.counters["pushes"] == 0
    np.testing.assert_array_equal(core.read_rows(0, {"emb": ids})["emb"], before)


def test_an_observer_reads_rows_without_making_them_and_a_full_table_says_so():
    job, core = shard("async", max_rows=4)
    ids = mine(job, 6)
    np.testing.assert_array_equal(core.read_rows(None, {"emb": ids})["emb"], first(job, ids))
    assert core.status()["tables"]["emb"]["rows"] == 0
    with pytest.raises(ShardError, match="tables.max_rows") as info:
        core.read_rows(0, {"emb": ids})
    assert info.value.code == "RESOURCE_EXHAUSTED"


def test_a_checkpoint_keeps_the_rows_and_a_round_in_flight(tmp_path):
    job, core = shard("sync")
    ids = mine(job, 4)
    core.read_rows(0, {"emb": ids})
    core.push(0, 0, 0, dense(core), rows={"emb": (ids, np.ones((4, DIM)))})  # the round waits for worker 1
    recovery.write(core, tmp_path, force=True)
    again = build_shard(job, 0)
    recovery.restore(again, checkpoint.load_latest(tmp_path, job.plan.hash, again.fingerprint))
    for c in (core, again):
        c.register(1, job.plan.hash)
        c.push(1, 0, 0, dense(c), rows={"emb": (ids[:2], np.ones((2, DIM)))})
    np.testing.assert_array_equal(core.read_rows(None, {"emb": ids})["emb"], again.read_rows(None, {"emb": ids})["emb"])
    assert again.version == core.version == 1


def test_a_worker_whose_tables_are_trained_otherwise_is_refused_naming_them():
    import json

    from psgd.job import identity

    job, core = shard("sync")
    theirs = job.config.apply_sets(["tables.lr=0.5"])
    worker = identity(theirs, job.plan.hash, tables=True)
    with pytest.raises(ShardError, match="tables: shard .*lr=1.0.*worker .*lr=0.5") as info:
        core.register(0, job.plan.hash, job_json=json.dumps(worker), incarnation="other")
    assert info.value.reason == "JOB_MISMATCH"
    assert "tables" not in identity(JobConfig(), "abc")  # a job without tables keeps its fingerprint


def _dc_shard(lam, adaptive):
    return shard("async", workers=2, cluster=(f"dc_lambda={lam}", f"dc_adaptive={str(adaptive).lower()}"))


@pytest.mark.parametrize("lam, adaptive", [(0.5, False), (0.04, True)])
def test_a_stale_row_gradient_is_compensated_against_the_rows_its_worker_pulled(lam, adaptive):
    """DC-ASGD row by row, against the update written out by hand: both workers pull rows r; worker 1's push
    moves them; worker 0's gradient, computed on the rows as they were, is applied as g + λ·g⊙g⊙(r_now − r_then)
    (λ adaptive: λ0 / √MeanSquare of each row's own gradients), at lr / 2."""
    job, core = _dc_shard(lam, adaptive)
    ids = mine(job, 5)
    g1, g0 = np.full((5, DIM), 0.3), np.linspace(-1, 1, 5 * DIM).reshape(5, DIM)
    r0 = core.read_rows(0, {"emb": ids})["emb"].copy()
    core.pull(0, 0, timeout=0).release()
    core.read_rows(1, {"emb": ids})
    core.pull(1, 0, timeout=0).release()
    ms = np.zeros_like(g1)

    def step(rows, g, then):
        nonlocal ms
        ms = 0.95 * ms + 0.05 * g * g
        factor = lam / (np.sqrt(ms) + 1e-7) if adaptive else lam
        return rows - 0.5 * (g + factor * g * g * (rows - then))

    core.push(1, 0, 0, dense(core), rows={"emb": (ids, g1)})
    r1 = step(r0, g1, r0)
    core.push(0, 0, 0, dense(core), rows={"emb": (ids, g0)})  # on version 0: one update late
    want = step(r1, g0, r0)
    np.testing.assert_allclose(core.read_rows(None, {"emb": ids})["emb"], want, rtol=1e-12, atol=1e-12)
    plain = r1 - 0.5 * g0
    assert np.abs(want - plain).max() > 1e-3 and core.remedies.uncompensated_rows == 0


def test_a_row_push_without_the_pull_it_names_is_applied_uncompensated_and_counted():
    job, core = _dc_shard(0.5, False)
    ids = mine(job, 3)
    start = core.read_rows(1, {"emb": ids})["emb"].copy()
    core.push(1, 0, 0, dense(core), rows={"emb": (ids, np.ones((3, DIM)))})
    core.push(0, 0, 0, dense(core), rows={"emb": (ids, np.ones((3, DIM)))})  # worker 0 never pulled these rows
    np.testing.assert_allclose(core.read_rows(None, {"emb": ids})["emb"], start - 1.0)
    assert core.remedies.uncompensated_rows == 1


def test_a_rows_mean_square_is_checkpointed_with_it(tmp_path):
    job, core = _dc_shard(0.04, True)
    ids = mine(job, 3)
    core.read_rows(0, {"emb": ids})
    core.push(0, 0, 0, dense(core), rows={"emb": (ids, np.full((3, DIM), 2.0))})
    arrays = core.tables.tables["emb"].state_dict()
    np.testing.assert_allclose(arrays["state/dc_mean_square"], 0.05 * 4.0)
    _, again = _dc_shard(0.04, True)
    again.tables.tables["emb"].load_state_dict(arrays)
    np.testing.assert_allclose(again.tables.tables["emb"].column("dc_mean_square", ids)[1], 0.05 * 4.0)
