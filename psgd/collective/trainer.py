"""The all-reduce trainer: every rank computes a gradient on its data shard, the
gradients are averaged by the collective, and every rank applies the same
update with the same optimizer code the shards use.

Same model, same sharding and same evaluation as a parameter-server worker, so
the two modes are compared on equal terms: with SGD, N ranks with batch B end
where one process ends with batch N*B, and where a sync parameter-server run
ends.  Rank 0 shows progress, evaluates, writes metrics and saves the weights.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import numpy as np

from psgd import data as datasets
from psgd import xp as backend
from psgd.collective.base import Bucketer, Collective, CollectiveError
from psgd.config import JobConfig
from psgd.metrics import MetricsLog, progress_bar
from psgd.partition import PartitionPlan
from psgd.train import build_job, build_optimizer, evaluate, params_to_device
from psgd.worker.delay import NO_DELAY, Delay

log = logging.getLogger(__name__)


@dataclasses.dataclass
class AllreduceResult:
    rank: int
    world_size: int
    steps: int
    seconds: float
    comm_seconds: float       # time spent in all-reduces (this rank)
    last_loss: float
    test_accuracy: float      # rank 0 only; NaN on the others
    params: dict[str, np.ndarray]


def run_allreduce(
    job: JobConfig,
    collective: Collective,
    *,
    dataset: datasets.Dataset | None = None,
    progress: bool = True,
    metrics_path: str | None = None,
    evaluate_every: int | None = None,
    bucket_bytes: int = 32 << 20,
    delay: Delay = NO_DELAY,
) -> AllreduceResult:
    """Train ``job`` as this rank of ``collective``; returns the final weights (host copies)."""
    built = build_job(job, dataset, check=True)
    ds, model, device, t = built.dataset, built.model, built.device, job.train
    rank, world = collective.rank, collective.world_size
    if world != job.cluster.workers:
        raise CollectiveError(f"rank {rank}: the job file says workers = {job.cluster.workers} but "
                              f"{world} rank(s) were started; start exactly that many (e.g. mpiexec -n "
                              f"{job.cluster.workers}) or change [cluster] workers")
    specs = model.specs()
    plan = PartitionPlan(specs, 1)
    collective.check_agreement(json.dumps({"plan": plan.hash, "world": world, "batch": t.batch_size,
                                           "epochs": t.epochs, "seed": t.seed, "data": ds.describe()}),
                               "the model, data, batch size, epochs and seed")
    params = params_to_device(model.init(t.seed), device)
    for name in sorted(params):  # one source of truth, whatever the ranks computed locally
        collective.broadcast_(params[name], root=0)
    opt = build_optimizer(job)
    bucketer = Bucketer({s.name: s.shape for s in specs}, specs[0].dtype, device.xp, bucket_bytes)
    batches = datasets.ShardedBatches(ds.x_train, ds.y_train, rank=rank, world=world,
                                      batch_size=t.batch_size, seed=t.seed)
    total = batches.steps_per_epoch * t.epochs
    if evaluate_every is None:
        evaluate_every = t.eval_every or batches.steps_per_epoch
    lead = rank == 0
    metrics = MetricsLog(metrics_path if lead else None, role=f"allreduce:{rank}")
    log.info("rank %d of %d (%s): %d steps of batch %d, %d bucket(s) of %.1f MB", rank, world,
             collective.backend, total, t.batch_size, len(bucketer.buffers), bucketer.nbytes / 1e6)
    start = time.perf_counter()
    comm = 0.0
    loss, acc = float("nan"), float("nan")
    slow = delay.applies_to(rank)
    delay_rng = np.random.default_rng([t.seed, rank, 7])
    with progress_bar(total, f"allreduce rank {rank}", enabled=progress and lead) as bar:
        for batch in batches.iterate(epochs=t.epochs):
            step_began = time.perf_counter()
            loss, grads = model.loss_and_grads(params, device.asarray(batch.x), device.asarray(batch.y))
            backend.synchronize(device)
            if slow:
                time.sleep(delay.seconds(time.perf_counter() - step_began, delay_rng))  # an injected straggler
            began = time.perf_counter()
            mean = bucketer.allreduce_mean(collective, grads)
            comm += time.perf_counter() - began
            for name, grad in mean.items():
                opt.update(name, params[name], grad)
            step = batch.global_step + 1
            point = {"step": step, "epoch": batch.epoch, "loss": float(loss), "wall": time.perf_counter() - start}
            if lead and evaluate_every and (step % evaluate_every == 0 or step == total):
                _, acc = evaluate(model, params, ds.x_test, ds.y_test, device, t.eval_batch_size)
                point["test_accuracy"] = acc
            metrics.write("step", **point)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", acc=f"{acc:.3f}", refresh=False)
    backend.synchronize(device)
    seconds = time.perf_counter() - start
    if lead:
        _, acc = evaluate(model, params, ds.x_test, ds.y_test, device, t.eval_batch_size)
    metrics.write("done", steps=total, seconds=seconds, comm_seconds=comm, test_accuracy=acc)
    metrics.close()
    host = {name: backend.to_host(v) for name, v in params.items()}
    return AllreduceResult(rank, world, total, seconds, comm, float(loss), acc, host)
