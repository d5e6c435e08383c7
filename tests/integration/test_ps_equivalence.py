"""A sync parameter-server run is exactly data-parallel SGD.

N workers with batch B over K shards (tensors cut into slices) must end with
the weights one process reaches with batch N*B: same initial weights, same
examples per step, one averaged update per clock.
"""

import numpy as np
import pytest
from helpers import make_job, run_threads, shards

from psgd.job import build_job
from psgd.partition import PartitionPlan
from psgd.server.state.core import ShardCore
from psgd.training.local import train_local
from psgd.worker.client import fetch_weights
from psgd.worker.exchange import run_worker


@pytest.mark.parametrize("workers, num_shards, model", [(2, 2, "mlp"), (3, 3, "softmax"), (4, 1, "mlp")])
def test_sync_run_equals_single_process_with_n_times_the_batch(workers, num_shards, model, device):
    """Workers on ``device`` (NumPy, or CuPy on a GPU) against one process on the CPU."""
    batch = 16
    job = make_job(
        f"model.name={model}",
        "model.hidden=[32]" if model == "mlp" else "train.seed=3",
        f"train.device={device}",
        "train.dtype=float64",
        "train.epochs=2",
        f"train.batch_size={batch}",
        "optimizer.name=sgd",
        "optimizer.lr=0.1",
        "cluster.policy=sync",
        f"cluster.workers={workers}",
        f"cluster.shards={num_shards}",
        "cluster.slice_bytes=2048",
    )
    with shards(job) as (job, servers):
        assert sum(len(s.core.slices) for s in servers) > len(build_job(job).model.specs())  # tensors were cut
        results = run_threads(
            [lambda r=r: run_worker(job, r, job.cluster.servers, progress=False) for r in range(workers)], timeout=120
        )
        plan = PartitionPlan(build_job(job).model.specs(), num_shards, job.cluster.links.slice_bytes)
        distributed = fetch_weights(job.cluster.servers, plan)
        versions = {s.core.version for s in servers}

    # the [cluster] section plays no part in a single process
    reference_job = job.override("train.batch_size", workers * batch).override("train.device", "cpu")
    reference = train_local(reference_job, progress=False)

    assert versions == {reference.steps}  # one update per clock on every shard
    assert all(r.steps == reference.steps for r in results)
    for name, ref in reference.params.items():
        got = distributed[name]
        assert got.dtype == np.float64
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert rel <= 1e-5, f"{name}: relative error {rel:.2e}"
    init = build_job(job).model.init(job.train.seed)
    assert any(not np.allclose(init[k], reference.params[k]) for k in init)  # training moved the weights


def sync_weights(overlap: bool, link: str, device="cpu") -> tuple[dict, list]:
    job = make_job(
        "model.hidden=[48]",
        "train.dtype=float64",
        f"train.device={device}",
        "train.epochs=2",
        "train.batch_size=16",
        "optimizer.name=sgd",
        "optimizer.lr=0.1",
        "cluster.policy=sync",
        "cluster.workers=2",
        "cluster.shards=2",
        "cluster.slice_bytes=4096",
        f"cluster.overlap={str(overlap).lower()}",
        f"cluster.transport={link}",
    )
    with shards(job) as (job, _):
        results = run_threads(
            [lambda r=r: run_worker(job, r, job.cluster.servers, progress=False) for r in range(2)], timeout=120
        )
        plan = PartitionPlan(build_job(job).model.specs(), 2, job.cluster.links.slice_bytes)
        return fetch_weights(job.cluster.servers, plan), [r.steps for r in results]


@pytest.mark.slow
@pytest.mark.parametrize("link", ["shm", "tcp", "grpc"])
def test_overlap_on_and_off_give_identical_weights_under_sync(link, device):
    """[cluster] overlap = true (the next step's pull under way while this step's push is in flight; on a GPU
    each gradient copied off the device on a stream of its own during backward) ends a sync run with the
    weights of overlap = false, to the bit, in float64."""
    off, steps_off = sync_weights(False, link, device)
    on, steps_on = sync_weights(True, link, device)
    assert steps_on == steps_off
    for name in off:
        np.testing.assert_array_equal(on[name], off[name])


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_async_and_ssp_runs_apply_every_push(overlap):
    for policy in ("async", "ssp"):
        job = make_job(
            "model.name=softmax",
            "train.epochs=1",
            f"cluster.policy={policy}",
            "cluster.workers=2",
            "cluster.shards=2",
            f"cluster.overlap={str(overlap).lower()}",
        )
        with shards(job) as (job, servers):
            results = run_threads(
                [lambda r=r: run_worker(job, r, job.cluster.servers, progress=False) for r in range(2)], timeout=120
            )
            cores: list[ShardCore] = [s.core for s in servers]
            steps = sum(r.steps for r in results)
            assert [c.version for c in cores] == [steps, steps]
            assert all(sum(c.staleness_histogram) == steps for c in cores)
            assert all(c.finished() for c in cores)
