"""The single-process reference trainer.

``train_local(job)`` is plain minibatch training in one process (the one loop,
:mod:`psgd.training.loop`, with :class:`LocalExchange`): the yardstick that the
parameter-server and all-reduce modes are checked against (a sync run of N
workers with batch B must end where this ends with batch N*B).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping

import numpy as np

from psgd import data as datasets
from psgd.compute import backend
from psgd.config import JobConfig
from psgd.job import Job, build_job, params_to_device
from psgd.training.loop import Exchange, Exchanged, LoopResult, run_loop
from psgd.model.table import Rows
from psgd.optim.ingraph import InGraph
from psgd.tables.held import lookup_rows, saved_tables

log = logging.getLogger(__name__)


class LocalExchange(Exchange):
    """The reference trainer's exchange: the optimizer applied in this process, step by step; a model's
    embedding tables held whole here, each row made when first looked up (:mod:`psgd.tables.held`)."""

    role = name = "local"
    trains_tables = True

    def __init__(self, job: Job):
        self.params = params_to_device(job.model.init(job.config.train.seed), job.device)
        self.optimizer = job.optimizer()
        self.device = job.device
        self.tables = job.row_tables()
        self._tables_lock = threading.Lock()  # an evaluation beside training reads them too

    def weights(self, step: int, lookups: Mapping[str, np.ndarray] | None = None) -> Mapping[str, Any]:
        return {**self.params, **self._rows(lookups, make=True)} if lookups else self.params

    def rows(self, lookups: Mapping[str, np.ndarray]) -> dict[str, Rows]:
        return self._rows(lookups, make=False)

    def _rows(self, lookups: Mapping[str, np.ndarray], make: bool) -> dict[str, Rows]:
        with self._tables_lock:
            return lookup_rows(self.tables, lookups, self.device, make)

    def updates_in_graph(self) -> Callable[[], InGraph] | None:
        if self.tables:
            return None
        return lambda: InGraph(self.optimizer, self.params, self.device)

    def exchange(self, step: int, grads: dict[str, Any]) -> Exchanged:
        for name, grad in grads.items():
            if name in self.tables:
                with self._tables_lock:
                    self.tables[name].apply(grad.ids, backend.to_host(grad.values))
            else:
                self.optimizer.update(name, self.params[name], grad)
        return Exchanged(step + 1)

    def end(self, interrupted: bool) -> dict[str, Any]:
        return {"tables": {name: table.status() for name, table in self.tables.items()}} if self.tables else {}

    def final_weights(self) -> Mapping[str, Any]:
        """The weights, and each table's rows that exist (``table:NAME:ids``, ``table:NAME:rows``)."""
        return {**self.params, **saved_tables(self.tables)}


def train_local(
    config: JobConfig,
    *,
    dataset: datasets.Dataset | None = None,
    model: Any = None,
    augment: Any = None,
    progress: bool = True,
    metrics_path: str | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> LoopResult:
    """Train in one process; the result holds the final weights and their test accuracy.  ``dataset``, ``model``
    (a model or its class) and ``augment`` (a function): a caller's own, instead of the job file's; ``on_step``
    hears of every step (see :func:`psgd.training.loop.run_loop`)."""
    job = build_job(config, dataset, check=True, model=model, augment=augment)
    t = config.train
    spe = datasets.steps_per_epoch(job.dataset.n_train, 1, t.batch_size)
    log.info("training %s on %s, %d steps of batch %d on %s", config.model["name"], job.dataset.describe(),
             spe * t.epochs, t.batch_size, job.device)
    return run_loop(job, LocalExchange(job), progress=progress, metrics_path=metrics_path, on_step=on_step)
