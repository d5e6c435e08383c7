"""The single-process reference trainer.

``train_local(job)`` is plain minibatch training in one process (the one loop,
:mod:`psgd.loop`, with :class:`LocalExchange`): the yardstick that the
parameter-server and all-reduce modes are checked against (a sync run of N
workers with batch B must end where this ends with batch N*B).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from psgd import data as datasets
from psgd.config import JobConfig
from psgd.job import Job, build_job, params_to_device
from psgd.loop import Exchange, Exchanged, LoopResult, run_loop

log = logging.getLogger(__name__)


class LocalExchange(Exchange):
    """The reference trainer's exchange: the optimizer applied in this process, step by step."""

    role = name = "local"

    def __init__(self, job: Job):
        self.params = params_to_device(job.model.init(job.config.train.seed), job.device)
        self.optimizer = job.optimizer()

    def weights(self, step: int) -> Mapping[str, Any]:
        return self.params

    def exchange(self, step: int, grads: dict[str, Any]) -> Exchanged:
        for name, grad in grads.items():
            self.optimizer.update(name, self.params[name], grad)
        return Exchanged(step + 1)

    def final_weights(self) -> Mapping[str, Any]:
        return self.params


def train_local(
    config: JobConfig,
    *,
    dataset: datasets.Dataset | None = None,
    progress: bool = True,
    metrics_path: str | None = None,
) -> LoopResult:
    """Train in one process; the result holds the final weights and their test accuracy."""
    job = build_job(config, dataset, check=True)
    t = config.train
    spe = datasets.steps_per_epoch(job.dataset.n_train, 1, t.batch_size)
    log.info("training %s on %s, %d steps of batch %d on %s", config.model["name"], job.dataset.describe(),
             spe * t.epochs, t.batch_size, job.device)
    return run_loop(job, LocalExchange(job), progress=progress, metrics_path=metrics_path)
