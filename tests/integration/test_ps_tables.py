"""A model with an embedding table on the parameter servers: a sync run is exactly one process with N times the
batch, table included; the rows move in the same pulls and pushes; what the shards refuse changes nothing."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from psgd.job import build_job
from psgd.loop import run_loop
from psgd.train import LocalExchange
from psgd.worker.client import fetch_weights
from psgd.worker.exchange import run_worker

from helpers import make_job, run_threads, shards

SMALL = ("model.name=embed", "model.dim=3", "model.hidden=[8]", "data.name=clicks", "data.n_train=1536",
         "data.n_test=256", "data.fields=5", "data.dense=3", "data.max_cardinality=2000")


def shard_rows(servers, table="emb"):
    """Every row the shards hold, by id."""
    out = {}
    for s in servers:
        t = s.core.tables.tables[table]
        state = t.state_dict()
        out.update(zip(state["ids"].tolist(), state["rows"]))
    return out


@pytest.mark.parametrize("rule, transport", [("sgd", "grpc"), ("rowwise_adagrad", "tcp")])
def test_a_sync_run_with_a_table_equals_one_process_with_n_times_the_batch(rule, transport):
    workers, batch = 2, 16
    job = make_job(*SMALL, "train.dtype=float64", "train.epochs=1", f"train.batch_size={batch}",
                   "optimizer.name=sgd", "optimizer.lr=0.1", f"tables.optimizer={rule}", "tables.lr=0.3",
                   "cluster.policy=sync", f"cluster.workers={workers}", "cluster.shards=2",
                   f"cluster.transport={transport}")
    with shards(job) as servers:
        results = run_threads([lambda r=r: run_worker(job, r, job.cluster.servers, progress=False)
                               for r in range(workers)], timeout=120)
        plan = build_job(job).plan
        dense = fetch_weights(job.cluster.servers, plan)
        rows = shard_rows(servers)
        held = [len(s.core.tables.tables["emb"]) for s in servers]

    reference_job = copy.deepcopy(job)
    reference_job.train.batch_size = workers * batch
    reference = build_job(reference_job, check=True)
    local = LocalExchange(reference)
    expected = run_loop(reference, local, progress=False)

    assert all(r.steps == expected.steps for r in results) and min(held) > 0  # rows on both shards
    for name, ref in expected.params.items():
        np.testing.assert_allclose(dense[name], ref, rtol=1e-9, atol=1e-12, err_msg=name)
    want = local.tables["emb"].state_dict()
    assert sorted(rows) == sorted(want["ids"].tolist())  # the same rows made, each on its shard
    got = np.stack([rows[i] for i in want["ids"].tolist()])
    np.testing.assert_allclose(got, want["rows"], rtol=1e-9, atol=1e-12)
    start = reference.row_tables()["emb"]
    assert not np.allclose(got, start.peek(want["ids"]))  # training moved the rows


def test_async_workers_train_a_table_and_rows_stay_on_their_shards():
    job = make_job(*SMALL, "train.epochs=3", "train.batch_size=32", "train.eval_every=20", "tables.lr=0.1",
                   "cluster.policy=async", "cluster.workers=2", "cluster.shards=2")
    with shards(job) as servers:
        results = run_threads([lambda r=r: run_worker(job, r, job.cluster.servers, progress=False)
                               for r in range(2)], timeout=120)
        plan = build_job(job).plan
        for k, s in enumerate(servers):
            ids = s.core.tables.tables["emb"].state_dict()["ids"]
            assert ids.size and (plan.shard_of_ids("emb", ids) == k).all()
        status = servers[0].core.status()
        made = sum(len(s.core.tables.tables["emb"]) for s in servers)
    trained = np.unique(build_job(job).dataset.ids_train).size
    assert made == trained  # rank 0's evaluations read the test set's rows without making them
    history = results[0].history
    assert len(history) >= 3 and history[-1]["test_accuracy"] > 0.6  # chance is 0.5
    assert status["tables"]["emb"]["rows_updated"] > 0 and status["tables"]["emb"]["rows"] > 0
