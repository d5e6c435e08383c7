"""Local SGD (``[cluster] policy = "local"``): workers train their own copy for ``local_steps`` steps with the
job's optimizer and push their progress; the shards move the centre by it over N.  Checked against what
the algorithm writes: one worker is the single-process trainer; two workers that push once, at the end,
leave the centre at the average of the two models each trained alone on its half of the data."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import make_job, run_threads, shards

from psgd import data as datasets
from psgd.job import build_job
from psgd.partition import PartitionPlan
from psgd.training.local import LocalExchange, train_local
from psgd.training.loop import run_loop
from psgd.worker.client import fetch_weights
from psgd.worker.exchange import run_worker

COMMON = (
    "model.hidden=[32]",
    "train.dtype=float64",
    "train.epochs=2",
    "train.batch_size=16",
    "optimizer.name=momentum",
    "optimizer.lr=0.05",
    "cluster.policy=local",
    "cluster.slice_bytes=2048",
)


def trained(job, pushes_after_pulls: int = 0) -> tuple[dict, list, set]:
    """Train ``job``'s workers against its shards; with ``pushes_after_pulls``, no shard applies a push before
    it has answered that many pulls (so that every worker starts from the initial weights)."""
    with shards(job) as (job, servers):
        if pushes_after_pulls:
            for server in servers:
                hold(server.core, pushes_after_pulls)
        results = run_threads(
            [lambda r=r: run_worker(job, r, job.cluster.servers, progress=False) for r in range(job.cluster.workers)],
            timeout=120,
        )
        plan = PartitionPlan(build_job(job).model.specs(), job.cluster.shards, job.cluster.links.slice_bytes)
        return fetch_weights(job.cluster.servers, plan), results, {s.core.version for s in servers}


def hold(core, pulls: int) -> None:
    """Make ``core`` wait (at most 60 s) for its ``pulls``-th pull before it applies a push."""
    answered, lock, pulled, push, pull = [0], threading.Lock(), threading.Event(), core.push, core.pull

    def counted_pull(*args, **kwargs):
        snap = pull(*args, **kwargs)
        with lock:
            answered[0] += 1
            if answered[0] >= pulls:
                pulled.set()
        return snap

    def held_push(*args, **kwargs):
        assert pulled.wait(60), f"the shard answered {answered[0]} of {pulls} pulls in 60 s"
        return push(*args, **kwargs)

    core.pull, core.push = counted_pull, held_push


def close(got: dict, want: dict) -> None:
    for name, ref in want.items():
        rel = np.linalg.norm(got[name] - ref) / np.linalg.norm(ref)
        assert rel <= 1e-12, f"{name}: relative error {rel:.2e}"


@pytest.mark.parametrize("local_steps", [1, 5])
def test_one_worker_is_the_single_process_trainer(local_steps):
    job = make_job(*COMMON, f"cluster.local_steps={local_steps}", "cluster.workers=1", "cluster.shards=2")
    weights, results, versions = trained(job)
    reference = train_local(job, progress=False)
    close(weights, reference.params)
    assert versions == {-(-reference.steps // local_steps)}  # one push per period, the last one short
    assert results[0].steps == reference.steps


def test_two_workers_pushing_once_leave_the_average_of_their_models():
    job = make_job(*COMMON, "cluster.local_steps=1000", "cluster.workers=2", "cluster.shards=1")
    steps = datasets.steps_per_epoch(build_job(job).dataset.n_train, 2, 16) * 2
    assert steps < job.cluster.consistency.local_steps  # one period longer than the run: one push each, at the end
    weights, results, versions = trained(job, pushes_after_pulls=2)
    assert versions == {2} and all(r.steps == steps for r in results)
    alone = []
    for rank in range(2):  # each worker's model, trained on its half of the data by the reference trainer
        built = build_job(job)
        alone.append(run_loop(built, LocalExchange(built), rank=rank, world=2, progress=False).params)
    close(weights, {name: (alone[0][name] + alone[1][name]) / 2 for name in alone[0]})
    assert any(not np.allclose(alone[0][k], alone[1][k]) for k in alone[0])  # two models: their average is neither
