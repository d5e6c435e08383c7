"""The worker's training loop: pull, compute on its data shard, push; evaluate now and then."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable, Sequence

import numpy as np

from psgd import data as datasets
from psgd import xp as backend
from psgd.config import JobConfig
from psgd.metrics import MetricsLog, progress_bar
from psgd.partition import PartitionPlan
from psgd.tls import NO_TLS, TLSFiles
from psgd.train import build_job, evaluate
from psgd.worker.client import PSClient, PSError, Stopped
from psgd.worker.delay import NO_DELAY, Delay

log = logging.getLogger(__name__)


@dataclasses.dataclass
class WorkerResult:
    rank: int
    steps: int          # steps this worker computed
    final_clock: int
    seconds: float
    last_loss: float
    history: list[dict]
    outcomes: dict[str, int]


def run_worker(
    job: JobConfig,
    rank: int,
    addresses: Sequence[str],
    *,
    dataset: datasets.Dataset | None = None,
    progress: bool = True,
    metrics_path: str | None = None,
    evaluate_every: int | None = None,
    delay: Delay = NO_DELAY,
    on_step: Callable[[dict], None] | None = None,
    token: str = "",
    stop: threading.Event | None = None,
    tls: TLSFiles = NO_TLS,
) -> WorkerResult:
    """Train as worker ``rank`` of ``job.cluster.workers`` against the shards at ``addresses``.

    ``evaluate_every`` (steps; default: once per epoch on rank 0, never on the
    others) evaluates the pulled weights on the test split.  ``delay`` slows
    this worker down, to play a straggler in experiments.  ``on_step`` is
    called with each step's record (the JSONL fields plus ``pull_seconds``,
    ``push_seconds`` and ``bytes``), e.g. to feed a metrics endpoint.
    ``token`` is the job's shared secret.  When ``stop`` is set (SIGTERM), the
    worker finishes the step in hand, pushes it, and leaves.
    """
    built = build_job(job, dataset, check=True)
    ds, model, device = built.dataset, built.model, built.device
    c, t = job.cluster, job.train
    if not 0 <= rank < c.workers:
        raise ValueError(f"rank {rank} is out of range: the job has {c.workers} worker(s), 0..{c.workers - 1}")
    batches = datasets.ShardedBatches(ds.x_train, ds.y_train, rank=rank, world=c.workers,
                                      batch_size=t.batch_size, seed=t.seed)
    spe = batches.steps_per_epoch
    total = spe * t.epochs
    if evaluate_every is None:
        evaluate_every = (t.eval_every or spe) if rank == 0 else 0
    plan = PartitionPlan(model.specs(), c.shards, c.slice_bytes)
    host = {s.name: np.empty(s.shape, dtype=s.dtype) for s in plan.specs}
    metrics = MetricsLog(metrics_path, role=f"worker:{rank}")
    outcomes: dict[str, int] = {}
    history: list[dict] = []

    with PSClient(addresses, plan, rank, request_timeout=c.request_timeout, data_path=c.data_path,
                  wire_dtype=c.wire_dtype or None, token=token, tls=tls, stop=stop, job=job) as client:
        try:
            client.wait_ready(c.join_timeout)
        except Stopped as exc:
            log.info("worker %d: %s; leaving before it joined", rank, exc)
            metrics.write("done", steps=0, clock=0, seconds=0.0, outcomes={})
            metrics.close()
            return WorkerResult(rank, 0, 0, 0.0, float("nan"), [], {})
        clock = client.register()
        client.start_heartbeats()
        log.info("worker %d of %d: %d steps of batch %d (%d per epoch), starting at clock %d, %s",
                 rank, c.workers, total, t.batch_size, spe, clock, ds.describe())
        start = time.perf_counter()
        steps, loss, acc = 0, float("nan"), float("nan")
        cached_epoch, indices = -1, None
        slow = delay.applies_to(rank)
        delay_rng = np.random.default_rng([t.seed, rank, 7])
        with progress_bar(total, f"worker {rank}", enabled=progress) as bar:
            bar.update(clock)
            try:
                while clock < total:
                    if stop is not None and stop.is_set():
                        log.info("worker %d: stopping at clock %d as asked; the next start continues from here",
                                 rank, clock)
                        break
                    epoch, i = divmod(clock, spe)
                    if epoch != cached_epoch:
                        cached_epoch, indices = epoch, batches.indices(epoch)
                    idx = indices[i]
                    began = time.perf_counter()
                    versions = client.pull(clock, host)
                    pulled = time.perf_counter()
                    params = {k: device.asarray(v) for k, v in host.items()}
                    evaluating = bool(evaluate_every) and clock > 0 and clock % evaluate_every == 0
                    if evaluating:
                        _, acc = evaluate(model, params, ds.x_test, ds.y_test, device, t.eval_batch_size)
                    loss, grads = model.loss_and_grads(params, device.asarray(ds.x_train[idx]),
                                                       device.asarray(ds.y_train[idx]))
                    pushing = time.perf_counter()
                    replies = client.push(clock, {k: backend.to_host(g) for k, g in grads.items()})
                    pushed = time.perf_counter()
                    pause = delay.seconds(time.perf_counter() - began, delay_rng) if slow else 0.0
                    if pause:
                        time.sleep(pause)  # an injected slowdown (a straggler), part of the run's configuration
                    for r in replies:
                        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
                    staleness = max(r.staleness for r in replies)
                    # The smallest clock any shard expects next (never behind this one): skipping a clock
                    # on a shard that is behind would leave its sync round waiting for this worker forever.
                    new_clock = max(clock + 1, min(r.next_clock for r in replies))
                    steps += 1
                    point = {"clock": clock, "epoch": epoch, "loss": float(loss), "version": max(versions),
                             "staleness": staleness, "wall": time.perf_counter() - start, "delay": pause}
                    if evaluating:
                        point["test_accuracy"] = acc
                        history.append(point)
                        if not progress:  # no bar to show it: one line per evaluation, for logs
                            log.info("worker %d: epoch %d/%d, clock %d/%d: test accuracy %.4f, train loss %.4f",
                                     rank, epoch, t.epochs, clock, total, acc, loss)
                    metrics.write("step", **point)
                    if on_step:
                        on_step({**point, "pull_seconds": pulled - began, "push_seconds": pushed - pushing,
                                 "bytes": 2 * plan.total_bytes, "outcomes": [r.outcome for r in replies]})
                    bar.update(new_clock - clock)
                    bar.set_postfix(loss=f"{loss:.4f}", acc=f"{acc:.3f}", refresh=False)
                    clock = client.clock = new_clock
            except PSError as exc:
                if stop is None or not stop.is_set():
                    raise
                log.info("worker %d: stopping at clock %d as asked, in the middle of a step (%s); the next start "
                         "continues from here", rank, clock, exc)
        try:
            client.done()
        except PSError as exc:
            if stop is None or not stop.is_set():
                raise
            # Stopped together with its shards (docker compose down): they are not there to hear it.
            log.warning("worker %d: could not say it left (%s); stopping anyway", rank, exc)
        seconds = time.perf_counter() - start
    metrics.write("done", steps=steps, clock=clock, seconds=seconds, outcomes=outcomes)
    metrics.close()
    log.info("worker %d done: %d steps in %.1fs (%s)", rank, steps, seconds,
             ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    return WorkerResult(rank, steps, clock, seconds, float(loss), history, outcomes)
