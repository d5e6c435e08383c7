"""The single-process reference trainer, and the pieces every trainer shares.

``train_local(job)`` is plain minibatch training in one process: the yardstick
that the parameter-server and all-reduce modes are checked against (a sync run
of N workers with batch B must end where this ends with batch N*B).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Mapping

import numpy as np

from psgd import data as datasets
from psgd import model as models
from psgd import optim
from psgd import xp as backend
from psgd.config import JobConfig
from psgd.metrics import MetricsLog, progress_bar

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


def evaluate(
    model: models.Model, params: Mapping[str, Any], x: np.ndarray, y: np.ndarray,
    device: backend.Device, batch_size: int = 1024,
) -> tuple[float, float]:
    """Mean loss and accuracy of ``params`` on (x, y), in batches."""
    total_loss, correct = 0.0, 0
    for start in range(0, len(x), batch_size):
        xb = device.asarray(x[start:start + batch_size])
        yb_host = y[start:start + batch_size]
        loss, _ = model.loss_and_grads(params, xb, device.asarray(yb_host))
        scores = backend.to_host(model.predict(params, xb))
        total_loss += float(loss) * len(yb_host)
        correct += int((scores.argmax(axis=1) == yb_host).sum())
    n = max(len(x), 1)
    return total_loss / n, correct / n


@dataclasses.dataclass
class TrainResult:
    params: dict[str, np.ndarray]  # host copies of the final weights
    test_loss: float
    test_accuracy: float
    steps: int
    seconds: float
    history: list[dict[str, Any]]


def train_local(
    config: JobConfig,
    *,
    dataset: datasets.Dataset | None = None,
    progress: bool = True,
    metrics_path: str | None = None,
    on_eval: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Train in one process and return the final weights and test accuracy."""
    job = build_job(config, dataset, check=True)
    ds, model, device, tc = job.dataset, job.model, job.device, config.train
    opt = build_optimizer(config)
    params = params_to_device(model.init(tc.seed), device)
    steps_per_epoch = datasets.steps_per_epoch(ds.n_train, 1, tc.batch_size)
    total_steps = steps_per_epoch * tc.epochs
    eval_every = tc.eval_every or steps_per_epoch
    log.info("training %s on %s, %d steps of batch %d on %s", config.model["name"], ds.describe(),
             total_steps, tc.batch_size, device)

    history: list[dict[str, Any]] = []
    metrics = MetricsLog(metrics_path, role="local")
    start = time.perf_counter()
    step, last_loss, acc = 0, float("nan"), float("nan")
    with progress_bar(total_steps, "train", enabled=progress) as bar:
        for epoch in range(tc.epochs):
            for xb, yb in datasets.epoch_batches(ds.x_train, ds.y_train, 0, 1, tc.batch_size, epoch, tc.seed):
                last_loss, grads = model.loss_and_grads(params, device.asarray(xb), device.asarray(yb))
                for name, grad in grads.items():
                    opt.update(name, params[name], grad)
                step += 1
                if step % eval_every == 0 or step == total_steps:
                    test_loss, acc = evaluate(model, params, ds.x_test, ds.y_test, device, tc.eval_batch_size)
                    point = {"step": step, "epoch": epoch, "wall": time.perf_counter() - start,
                             "train_loss": float(last_loss), "test_loss": test_loss, "test_accuracy": acc}
                    history.append(point)
                    metrics.write("eval", **point)
                    if on_eval:
                        on_eval(point)
                bar.update(1)
                bar.set_postfix(loss=f"{last_loss:.4f}", acc=f"{acc:.3f}", refresh=False)
    backend.synchronize(device)
    seconds = time.perf_counter() - start
    test_loss, acc = evaluate(model, params, ds.x_test, ds.y_test, device, tc.eval_batch_size)
    metrics.write("final", step=step, wall=seconds, test_loss=test_loss, test_accuracy=acc)
    metrics.close()
    host = {name: backend.to_host(value) for name, value in params.items()}
    return TrainResult(host, test_loss, acc, step, seconds, history)
