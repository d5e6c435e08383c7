"""The evaluations of a training process: the weights scored on the job's test split (:func:`evaluate`; those saved
in a file, :func:`evaluate_file`, their tables' rows read as :func:`saved_rows` says), and each
evaluation kept as every psgd worker keeps it (:class:`Evaluations`: the history, an ``eval`` metrics line, the
divergence guard's judgement, a log line), in the loop or beside it (:class:`BackgroundEvaluator`), in psgd's own
loop (:mod:`psgd.training.loop`) and in a loop of one's own (:mod:`psgd.worker.script`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from psgd import model as models
from psgd.compute import backend
from psgd.config import JobConfig
from psgd.data.base import SCORE_WORDS
from psgd.job import Job, build_job, params_to_device
from psgd.model.table import Rows, TableSpec, initial_rows, table_keys, unique_lookups
from psgd.observe.progress import MetricsLog, first_values
from psgd.training.divergence import Divergence, DivergenceGuard
from psgd.weights import load_weights

log = logging.getLogger(__name__)


def evaluate(
    model: models.Model,
    params: Mapping[str, Any],
    x: np.ndarray,
    y: np.ndarray,
    device: backend.Device,
    batch_size: int = 1024,
    ids: np.ndarray | None = None,
    rows: Callable[..., dict[str, Any]] | None = None,
    target: str = "classes",
) -> tuple[float, float]:
    """Mean loss and score of ``params`` on (x, y), in batches: the score is the accuracy for classes (of every
    position, for a class per position) and for labels (of every label, a score above 0 saying yes), R² for values
    (1 - the squared error over the targets' variance: 0 is guessing their mean).  A model with embedding tables
    looks the ids of each batch up through ``rows`` (:meth:`psgd.training.loop.Exchange.rows`, reading without
    making rows)."""
    total_loss, right, targets, squared, n = 0.0, 0, 0, 0.0, max(len(x), 1)
    for start in range(0, len(x), batch_size):
        xb = device.asarray(x[start : start + batch_size])
        yb_host = np.asarray(y[start : start + batch_size])
        if rows is not None:
            params = {**params, **rows(model.lookups(ids[start : start + batch_size]))}
        loss, _ = model.loss_and_grads(params, xb, device.asarray(yb_host))  # the loss, of any model
        scores = backend.to_host(model.predict(params, xb))
        total_loss += float(loss) * len(yb_host)
        targets += yb_host.size
        if target == "values":
            squared += float(((scores.reshape(yb_host.shape) - yb_host) ** 2).sum())
        elif target == "labels":
            right += int(((scores > 0) == (yb_host > 0.5)).sum())
        else:
            right += int((scores.argmax(axis=-1) == yb_host).sum())
    if target == "values":
        y = np.asarray(y)
        spread = float(((y - y.mean(axis=0)) ** 2).sum())
        return total_loss / n, 1.0 - squared / spread if spread > 0 else float(squared == 0)
    return total_loss / n, right / max(targets, 1)


def evaluate_file(config: JobConfig, path: str | os.PathLike) -> dict[str, Any]:
    """Test loss and score (``test_accuracy``, or ``test_r2`` for values) of the weights saved at ``path``, for the
    model and data of ``config``."""
    job = build_job(config)
    weights = load_weights(path, job.model.specs(), job.plan.tables)
    params = params_to_device({s.name: weights[s.name] for s in job.model.specs()}, job.device)
    ds = job.dataset
    loss, score = evaluate(
        job.model,
        params,
        ds.x_test,
        ds.y_test,
        job.device,
        config.train.eval_batch_size,
        ds.ids_test,
        saved_rows(job, weights),
        ds.target,
    )
    return {
        ds.score_key: score,
        "test_loss": loss,
        "examples": int(len(ds.y_test)),
        "dataset": config.data["name"],
        "model": config.model["name"],
        "variables": len(weights),
        "parameters": int(sum(w.size for w in weights.values())),
        "file": str(path),
    }


def saved_rows(job: Any, weights: Mapping[str, np.ndarray]) -> Any:
    """How an evaluation reads the tables of ``job`` from the rows saved in ``weights`` (None: no tables)."""
    saved = {
        t.name: SavedRows(t, job.config.train.seed, *(weights[k] for k in table_keys(t.name))) for t in job.plan.tables
    }
    if not saved:
        return None
    return lambda lookups: {name: saved[name].rows(wanted, job.device) for name, wanted in lookups.items()}


class SavedRows:
    """A table's saved rows (``ids`` increasing, ``rows`` one per id), looked up as an evaluation reads a table:
    an id that has no saved row reads as its first value."""

    def __init__(self, spec: TableSpec, seed: int, ids: np.ndarray, rows: np.ndarray):
        self.spec, self.seed, self.ids, self.values = spec, seed, ids, rows

    def rows(self, lookups: np.ndarray, device: Any) -> Rows:
        ids, index = unique_lookups(lookups)
        at = np.minimum(np.searchsorted(self.ids, ids), max(self.ids.size - 1, 0))
        have = (self.ids[at] == ids) if self.ids.size else np.zeros(ids.size, bool)
        out = np.empty((ids.size, self.spec.dim), self.spec.dtype)
        out[have] = self.values[at[have]]
        out[~have] = initial_rows(self.spec, self.seed, ids[~have])
        return Rows(ids, device.asarray(out), device.asarray(index))


def judged(verdict: Divergence | None, metrics: MetricsLog) -> None:
    """The divergence guard's verdict, where it has one: a WARNING line and a ``diverged`` metrics line."""
    if verdict is not None:
        log.warning("%s", verdict.line())
        metrics.write("diverged", **verdict.record())


def resumed(guard: DivergenceGuard, metrics_path: str | None, role: str) -> None:
    """A resumed process's divergence guard given the run's baselines: the first step's loss and the first test loss
    ``role`` wrote in its metrics lines at ``metrics_path``, in the run's earlier part."""
    if metrics_path is not None:
        first = first_values(metrics_path, role, {"step": "loss", "eval": "test_loss"})
        guard.resumed(first.get("step"), first.get("eval"))


class Evaluations:
    """A process's evaluations of the weights on the job's test split, each kept as every psgd worker keeps them:
    in :attr:`history`, as an ``eval`` metrics line, judged by the divergence ``guard``, and (``says``: no progress
    bar shows them) as a log line.  ``rows`` reads a model's embedding rows
    (:meth:`psgd.training.loop.Exchange.rows`)."""

    def __init__(
        self,
        job: Job,
        metrics: MetricsLog,
        guard: DivergenceGuard,
        name: str,
        per_epoch: int,
        total: int,
        rows: Callable[..., dict[str, Any]] | None = None,
        says: bool = False,
    ):
        self.job, self.metrics, self.guard, self.name, self.rows, self.says = job, metrics, guard, name, rows, says
        self.per_epoch, self.total = per_epoch, total
        self.history: list[dict[str, Any]] = []
        self.test_loss, self.score = float("nan"), float("nan")  # of the last evaluation

    def __call__(self, params: Mapping[str, Any], done: int, train_loss: float | None, wall: float) -> None:
        """Evaluate ``params``, the weights after ``done`` steps (``wall`` seconds into the run); ``train_loss``:
        the last step's, None where this process took none (a resumed job that had ended: no loss to say)."""
        ds, t = self.job.dataset, self.job.config.train
        self.test_loss, self.score = evaluate(
            self.job.model,
            params,
            ds.x_test,
            ds.y_test,
            self.job.device,
            t.eval_batch_size,
            ds.ids_test,
            self.rows,
            ds.target,
        )
        epoch = done // self.per_epoch
        point = {
            "step": done,
            "epoch": epoch,
            "wall": wall,
            "train_loss": float("nan") if train_loss is None else float(train_loss),
            "test_loss": self.test_loss,
            ds.score_key: self.score,
        }
        self.history.append(point)
        self.metrics.write("eval", **point)
        judged(self.guard.evaluation(done, epoch, self.test_loss, self.score), self.metrics)
        if self.says:
            trained = "" if train_loss is None else f", train loss {train_loss:.4f}"
            log.info(
                "%s: epoch %d/%d, step %d/%d: %s %.4f%s",
                self.name,
                epoch,
                t.epochs,
                done,
                self.total,
                SCORE_WORDS[ds.metric],
                self.score,
                trained,
            )

    def scores(self) -> dict[str, Any]:
        """The last evaluation's test loss and score, for a ``done`` line (none where nothing was evaluated)."""
        return {"test_loss": self.test_loss, self.job.dataset.score_key: self.score} if self.history else {}


class BackgroundEvaluator:
    """Evaluations of copies of the weights, one at a time on a thread of their own (``[train] eval_beside``):
    a step never waits for one, and an evaluation that falls due while the last is still running is skipped."""

    def __init__(self, evaluation: Callable[..., None]):
        self.evaluation, self.skipped = evaluation, 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="evaluate")
        self._pending: Future | None = None

    def submit(self, params: Mapping[str, Any], done: int, train_loss: float, wall: float) -> bool:
        """Evaluate a copy of ``params`` (the weights after ``done`` steps, taken at ``wall``); False: skipped."""
        if self._pending is not None and not self._pending.done():
            self.skipped += 1
            return False
        if self._pending is not None:
            self._pending.result()  # an evaluation's error is the run's
        copy = {name: value.copy() for name, value in params.items()}
        self._pending = self._pool.submit(self.evaluation, copy, done, train_loss, wall)
        return True

    def close(self) -> None:
        """Wait for the evaluation under way, if any."""
        try:
            if self._pending is not None:
                self._pending.result()
        finally:
            self._pool.shutdown(wait=True)
