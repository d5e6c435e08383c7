"""The single-process reference trainer, and building what a job file describes.

``train_local(job)`` is plain minibatch training in one process (the one loop,
:mod:`psgd.loop`, with :class:`LocalExchange`): the yardstick that the
parameter-server and all-reduce modes are checked against (a sync run of N
workers with batch B must end where this ends with batch N*B).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Mapping

import numpy as np

from psgd import data as datasets
from psgd import model as models
from psgd import optim
from psgd import xp as backend
from psgd.config import JobConfig
from psgd.loop import Exchange, Exchanged, LoopResult, run_loop

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Job:
    """Everything built from a job file: dataset, model and device."""

    config: JobConfig
    dataset: datasets.Dataset
    model: models.Model
    device: backend.Device


def build_job(config: JobConfig, dataset: datasets.Dataset | None = None, check: bool = False) -> Job:
    """Load the dataset and build the model a job file describes (errors are one line each).

    With ``check`` (every trainer, not the shards), the model is first checked on a small random batch
    (:func:`psgd.model.check_model`): a model that would fail mid-training fails here, one line per fault.
    """
    device = backend.get_device(config.train.device)
    dtype = config.train.dtype
    if dataset is None:
        dataset = datasets.load_dataset(config.data["name"], dtype=dtype, **config.options("data"))
    model = models.build_model(
        config.model["name"], dataset.input_shape, dataset.num_classes, dtype=dtype, **config.options("model")
    )
    if check:
        began = time.perf_counter()
        models.check_model(model, dataset.input_shape, dataset.num_classes, dtype, config.train.seed,
                           name=config.model["name"], options=config.options("model"), device=device)
        log.debug("model %s passed its check in %.3f s", config.model["name"], time.perf_counter() - began)
    return Job(config=config, dataset=dataset, model=model, device=device)


def build_optimizer(config: JobConfig) -> optim.Optimizer:
    return optim.build_optimizer(config.optimizer["name"], **config.options("optimizer"))


def params_to_device(params: Mapping[str, np.ndarray], device: backend.Device) -> dict[str, Any]:
    return {name: device.asarray(value) for name, value in params.items()}


class LocalExchange(Exchange):
    """The reference trainer's exchange: the optimizer applied in this process, step by step."""

    role = name = "local"

    def __init__(self, built: Job):
        self.params = params_to_device(built.model.init(built.config.train.seed), built.device)
        self.optimizer = build_optimizer(built.config)

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
    built = build_job(config, dataset, check=True)
    t = config.train
    spe = datasets.steps_per_epoch(built.dataset.n_train, 1, t.batch_size)
    log.info("training %s on %s, %d steps of batch %d on %s", config.model["name"], built.dataset.describe(),
             spe * t.epochs, t.batch_size, built.device)
    return run_loop(built, LocalExchange(built), evaluate_every=t.eval_every or spe, progress=progress,
                    metrics_path=metrics_path)
