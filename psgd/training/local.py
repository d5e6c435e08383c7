"""The single-process reference trainer.

``train_local(job)`` is plain minibatch training in one process (the one loop,
:mod:`psgd.training.loop`, with :class:`LocalExchange`): the yardstick that the
parameter-server and all-reduce modes are checked against (a sync run of N
workers with batch B must end where this ends with batch N*B).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from psgd import data as datasets
from psgd.compute import backend, threads
from psgd.config import ConfigError, JobConfig
from psgd.errors import InputError
from psgd.job import Job, build_job, params_to_device
from psgd.model.table import Rows
from psgd.optim.base import SEP
from psgd.optim.ingraph import InGraph
from psgd.tables.held import lookup_rows, saved_tables
from psgd.training.loop import Exchange, Exchanged, LoopResult, run_loop
from psgd.weights import ExportError, read_npz, save_weights, weight_differences

log = logging.getLogger(__name__)


class LocalExchange(Exchange):
    """The reference trainer's exchange: the optimizer applied in this process, step by step; a model's
    embedding tables held whole here, each row made when first looked up (:mod:`psgd.tables.held`)."""

    role = name = "local"
    trains_tables = True

    def __init__(self, job: Job, keep: str | None = None, resume: str | None = None):
        self.params = params_to_device(job.model.init(job.config.train.seed), job.device)
        self.optimizer = job.optimizer()
        self.device = job.device
        self.tables = job.row_tables()
        self._tables_lock = threading.Lock()  # an evaluation beside training reads them too
        #: where a stopped run leaves its state (None: nowhere), and the state it goes on from (None: the start)
        self.keep, self.resume, self.step = keep, resume, 0
        if (keep or resume) and self.tables:
            raise ConfigError(
                "psgd train keeps no state of a model's embedding tables yet: run it without "
                "--checkpoint and --resume, or with psgd launch (its shards keep them)"
            )
        self.specs = job.plan.specs
        t = job.config.train
        self.total = datasets.steps_per_epoch(job.dataset.n_train, 1, t.batch_size) * t.epochs
        self.job_name = hashlib.sha256(
            json.dumps(
                {
                    "plan": job.plan.hash,
                    "optimizer": dict(job.config.optimizer),
                    "dtype": job.config.train.dtype,
                    "batch_size": job.config.train.batch_size,
                    "seed": job.config.train.seed,
                    "model": dict(job.config.model),
                    "data": dict(job.config.data),
                },
                sort_keys=True,
                default=str,
            ).encode()
        ).hexdigest()[:16]

    def begin(self) -> int:
        self.step = self._restore(self.resume) if self.resume else 0  # (each run of the loop starts afresh)
        if self.resume:
            log.info("going on from step %d, as %s left it", self.step, self.resume)
        return self.step

    def _restore(self, path: str) -> int:
        """The weights, the optimizer's state and the step of the checkpoint at ``path``, checked to be this job's
        (names, shapes, dtypes, finite values, a step of this run) before any of them is installed."""
        try:
            arrays = read_npz(path)
        except ExportError as exc:
            raise ConfigError(f"--resume {path}: cannot be read as psgd train's checkpoint ({exc})") from None
        made_by = str(arrays.get("job", ""))
        if made_by != self.job_name:
            raise ConfigError(
                f"--resume {path}: it is the state of another job (made by {made_by or 'no job'}, "
                f"this job is {self.job_name}): the model, data, optimizer, dtype, batch size and "
                "seed must be the ones it was made with"
            )
        weights = {k[2:]: v for k, v in arrays.items() if k.startswith("w:")}
        state = {k[2:]: v for k, v in arrays.items() if k.startswith("o:")}
        problems = weight_differences(weights, self.specs)
        problems += [
            f"{name} holds NaN or infinite values"
            for name, v in {**weights, **state}.items()
            if v.dtype.kind == "f" and not np.isfinite(v).all()
        ]
        for key, value in state.items():  # a buffer the shape of its variable (the optimizer checks the rest)
            name, _, field = key.rpartition(SEP)
            if field != "t" and getattr(self.params.get(name), "shape", None) != value.shape:
                problems.append(f"the optimizer's state {key} is {value.shape}, not its variable's")
        step = arrays.get("step")
        if step is None:
            problems.append("no step")
        elif step.shape != () or step.dtype.kind not in "iu":
            problems.append(f"step must be an integer, got {step.dtype} {step.shape}")
        elif not 0 <= int(step) <= self.total:
            problems.append(f"step {int(step)} is not in 0..{self.total}, the steps of this run")
        if problems:
            raise ConfigError(f"--resume {path}: not a state this job can go on from: {'; '.join(problems)}")
        try:  # the optimizer checks its own state whole before it takes any of it
            self.optimizer.load_state_dict(state, self.device)
        except InputError as exc:
            raise ConfigError(
                f"--resume {path}: not a state this job can go on from: the optimizer's state ({exc})"
            ) from None
        for name, value in weights.items():
            self.params[name][...] = self.device.asarray(value)
        return int(step)

    def _save(self, path: str) -> None:
        """This run's state at ``path``, whole or not at all (as the weights are saved: written aside, synced, then
        renamed)."""
        arrays = {f"w:{name}": value for name, value in self.params.items()}
        arrays.update({f"o:{k}": v for k, v in self.optimizer.state_dict().items()})
        arrays.update(step=np.array(self.step, dtype=np.int64), job=np.array(self.job_name))
        save_weights(path, arrays)

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
        self.step = step + 1
        return Exchanged(step + 1)

    def end(self, interrupted: bool) -> dict[str, Any]:
        if interrupted and self.keep:
            self._save(self.keep)
            log.info(
                "stopped at step %d; its state is in %s (psgd train --resume %s goes on from there)",
                self.step,
                self.keep,
                self.keep,
            )
            return {"kept": self.keep}
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
    run_dir: str | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    keep: str | None = None,
    resume: str | None = None,
    stop: threading.Event | None = None,
) -> LoopResult:
    """Train in one process; the result holds the final weights and their test accuracy.  ``dataset``, ``model``
    (a model or its class) and ``augment`` (a function): a caller's own, instead of the job file's; ``on_step``
    hears of every step (see :func:`psgd.training.loop.run_loop`).  ``stop`` set: the step in hand is finished and
    the run ends, its state (weights, optimizer, step) written to ``keep`` where given, which ``resume`` (a path)
    goes on from; the result's ``summary["kept"]`` says where it is.  ``run_dir``: the metrics' CSV and
    TensorBoard files' folder (default: beside ``metrics_path``)."""
    job = build_job(config, dataset, check=True, model=model, augment=augment)  # first: a refusal is one line
    per_process, said = threads.budget(config.train.threads, 1)  # as psgd launch picks them, for one process
    log.info("%s", said)
    threads.apply(per_process)
    t = config.train
    spe = datasets.steps_per_epoch(job.dataset.n_train, 1, t.batch_size)
    log.info(
        "training %s on %s, %d steps of batch %d on %s",
        config.model["name"],
        job.dataset.describe(),
        spe * t.epochs,
        t.batch_size,
        job.device,
    )
    exchange = LocalExchange(job, keep=keep or resume, resume=resume)
    return run_loop(
        job, exchange, progress=progress, metrics_path=metrics_path, run_dir=run_dir, on_step=on_step, stop=stop
    )
