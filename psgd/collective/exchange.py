"""The all-reduce mode: the one loop (:mod:`psgd.training.loop`) with a collective as its exchange.

Every rank computes a gradient on its data shard, the gradients are averaged by the collective (in
buckets), and every rank applies the same update with the same optimizer code the shards use.
Same model, same sharding and same evaluation as a parameter-server worker, so the two modes are
compared on equal terms: with SGD, N ranks with batch B end where one process ends with batch N*B,
and where a sync parameter-server run ends.  Rank 0 shows progress, evaluates, writes metrics and
holds the weights it saves.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from psgd import data as datasets
from psgd.collective import make_collective
from psgd.collective.base import Bucketer, Collective, CollectiveError
from psgd.compute import backend
from psgd.config import ConfigError, JobConfig
from psgd.job import Job, build_job, params_to_device
from psgd.model.table import Rows
from psgd.tables.held import lookup_rows, saved_tables
from psgd.training.delay import NO_DELAY, Delay
from psgd.training.loop import Exchange, Exchanged, LoopResult, run_loop

log = logging.getLogger(__name__)


class AllReduceExchange(Exchange):
    """Average the gradients with the other ranks of ``collective``, then apply them here.  A model's embedding
    tables are held whole on every rank: the row gradients of a step are gathered from every rank
    (:meth:`Collective.gather_rows`), summed per row and averaged over the ranks, and applied alike everywhere."""

    mode = "allreduce"
    trains_tables = True

    def __init__(self, job: Job, collective: Collective, bucket_bytes: int = 32 << 20):
        config, ds, model, device, t = job.config, job.dataset, job.model, job.device, job.config.train
        self.collective, self.device = collective, device
        rank, world = collective.rank, collective.world_size
        self.role, self.name = f"allreduce:{rank}", f"rank {rank}"
        if config.cluster.elastic:
            raise CollectiveError(
                f"the all-reduce mode keeps a fixed count of ranks: [cluster] workers = "
                f"\"{config.cluster.get('workers')}\" is a range, which only a parameter-server job takes; give one "
                "number"
            )
        if world != config.cluster.workers:
            raise CollectiveError(
                f"rank {rank}: the job file says workers = {config.cluster.workers} but "
                f"{world} rank(s) were started; start exactly that many (e.g. mpiexec -n "
                f"{config.cluster.workers}) or change [cluster] workers"
            )
        specs = model.specs()
        plan = job.one_shard_plan()
        # overlap too: it changes the order of the collective calls, which every rank must make alike
        collective.check_agreement(
            json.dumps(
                {
                    "plan": plan.hash,
                    "world": world,
                    "batch": t.batch_size,
                    "epochs": t.epochs,
                    "seed": t.seed,
                    "data": ds.describe(),
                    "overlap": config.cluster.overlap,
                }
            ),
            "the model, data, batch size, epochs, seed and overlap",
        )
        self.params = params_to_device(model.init(t.seed), device)
        for name in sorted(self.params):  # one source of truth, whatever the ranks computed locally
            collective.broadcast_(self.params[name], root=0)
        self.optimizer = job.optimizer()
        self.tables = job.row_tables(f"rank {rank}")
        tables = config.tables
        if self.tables and (
            tables.admit_after > 1 or tables.idle_updates or tables.when_full == "evict" or config.cluster.overlap
        ):
            raise ConfigError(
                f"rank {rank}: all-reduce keeps a table alike on every rank only without admission, "
                "eviction and overlap ([tables] admit_after, idle_updates, when_full = \"evict\"; "
                "[cluster] overlap): each rank would decide them from its own batches"
            )
        self.bucketer = Bucketer({s.name: s.shape for s in specs}, specs[0].dtype, device.xp, bucket_bytes)
        self.comm_seconds = 0.0
        # [cluster] overlap: each bucket is reduced while backward goes on, on a GPU on a CUDA stream of its
        # own that starts it once the kernels that filled it are done.  NCCL queues the reduction there from
        # this thread (the DDP shape); a backend that blocks (MPI) runs it on one communication thread.
        self.overlaps = config.cluster.overlap
        self._side = backend.SideStream(device) if self.overlaps else None
        self._queues = self.overlaps and device.is_gpu and collective.queues
        self._comm = (
            ThreadPoolExecutor(1, thread_name_prefix=f"psgd-allreduce-{rank}")
            if self.overlaps and not self._queues
            else None
        )
        self._round = None
        spe = datasets.steps_per_epoch(ds.n_train, world, t.batch_size)
        log.info(
            "rank %d of %d (%s): %d steps of batch %d, %d bucket(s) of %.1f MB",
            rank,
            world,
            collective.backend,
            spe * t.epochs,
            t.batch_size,
            len(self.bucketer.buffers),
            self.bucketer.nbytes / 1e6,
        )

    def weights(self, step: int, lookups: Mapping[str, np.ndarray] | None = None) -> Mapping[str, Any]:
        return {**self.params, **self._rows(lookups, make=True)} if lookups else self.params

    def rows(self, lookups: Mapping[str, np.ndarray]) -> dict[str, Rows]:
        return self._rows(lookups, make=False)

    def _rows(self, lookups: Mapping[str, np.ndarray], make: bool) -> dict[str, Rows]:
        return lookup_rows(self.tables, lookups, self.device, make)

    def _submit(self, fn: Any, *args: Any) -> Future:
        """Start a bucket's reduction ``fn(*args)``, after the kernels queued so far (those that wrote the
        bucket), on the side stream, while backward's next kernels go on: queued from here where the backend
        can (its completion is waited for in :meth:`exchange`), else on the communication thread."""
        mark = self._side.mark()
        if not self._queues:
            return self._comm.submit(self._side.run_after, mark, fn, *args)
        done: Future = Future()
        with self._side.current(after=mark), self.collective.queued():
            done.set_result(fn(*args))
        return done

    def gradient_ready(self, name: str, grad: Any) -> None:
        if self._round is None:
            self._round = self.bucketer.round(self.collective, self._submit)
        self._round.add(name, grad)

    def exchange(self, step: int, grads: dict[str, Any]) -> Exchanged:
        backend.synchronize(self.device)  # the gradient is computed: time the collective alone
        began = time.perf_counter()
        rows = {name: grads.pop(name) for name in list(grads) if name in self.tables}
        for name, grad in rows.items():  # every rank's rows, summed per row, over the ranks: as one batch's
            ids, values = self.collective.gather_rows(grad.ids, backend.to_host(grad.values))
            distinct, where = np.unique(ids, return_inverse=True)
            total = np.zeros((distinct.size, values.shape[1]), values.dtype)
            np.add.at(total, where, values)
            self.tables[name].apply(distinct, total / self.collective.world_size)
        if self.overlaps:  # what is left of the reductions started during backward
            round_, self._round = self._round or self.bucketer.round(self.collective, self._submit), None
            mean = round_.finish(grads)
            if self._queues:
                with self._side.current():
                    self.collective.wait_queued(f"the all-reduces of step {step}")
        else:
            mean = self.bucketer.allreduce_mean(self.collective, grads)
        seconds = time.perf_counter() - began
        self.comm_seconds += seconds
        for name, grad in mean.items():
            self.optimizer.update(name, self.params[name], grad)
        return Exchanged(step + 1, timings={"allreduce_seconds": seconds})

    def end(self, interrupted: bool) -> dict[str, Any]:
        if self._comm is not None:
            self._comm.shutdown(wait=True)
        return {"comm_seconds": self.comm_seconds}

    def final_weights(self) -> Mapping[str, Any]:
        """The weights, and each table's rows that exist (``table:NAME:ids``, ``table:NAME:rows``)."""
        return {**self.params, **saved_tables(self.tables)}


def run_allreduce(
    config: JobConfig,
    collective: Collective,
    *,
    dataset: datasets.Dataset | None = None,
    progress: bool = True,
    metrics_path: str | None = None,
    evaluate_every: int | None = None,
    bucket_bytes: int = 32 << 20,
    delay: Delay = NO_DELAY,
) -> LoopResult:
    """Train ``config``'s job as this rank of ``collective``; the result holds the final weights (host copies)."""
    job = build_job(config, dataset, check=True)
    exchange = AllReduceExchange(job, collective, bucket_bytes)
    rank, world = collective.rank, collective.world_size
    lead = rank == 0
    return run_loop(
        job,
        exchange,
        rank=rank,
        world=world,
        evaluate_every=evaluate_every if lead else 0,
        final_evaluation=lead,
        progress=progress and lead,
        desc=f"allreduce rank {rank}",
        metrics_path=metrics_path if lead else None,
        delay=delay,
    )


def train_allreduce(
    config: JobConfig,
    backend_name: str,
    *,
    rank: int | None = None,
    rendezvous: str | None = None,
    on_rank: Callable[[int], None] | None = None,
    **options: Any,
) -> tuple[LoopResult, int, int]:
    """One rank of an all-reduce job, from its collective's opening to its close: the collective of
    ``backend_name`` (``mpi``: its rank from MPI; ``nccl``: ``rank``, met at ``rendezvous``) on the job's device,
    ``on_rank`` told the rank once it is known, then :func:`run_allreduce` with ``options``.  Returns the result,
    the rank and the world size."""
    device = backend.get_device(config.train.device)
    with make_collective(
        backend_name,
        rank=rank,
        world_size=config.cluster.workers,
        device=device,
        rendezvous=rendezvous,
        timeout=config.cluster.deadlines.request_timeout,
    ) as group:
        if on_rank is not None:
            on_rank(group.rank)
        return run_allreduce(config, group, **options), group.rank, group.world_size
