"""A worker whose training loop is the user's own script: ``psgd run SCRIPT`` starts the shards and one copy of
the script per worker, as torchrun does, and in the script :func:`join` joins the job.

    with psgd.join() as w:
        while w.clock < w.steps and not w.stopping:
            params = w.pull()
            x, y = w.batch()
            loss, grads = w.model.loss_and_grads(params, x, y)
            w.push(grads, loss=loss)

The loop is the script's: its own batches, losses, schedules and several pulls or pushes a step are all its to
choose.  What psgd keeps is the rest of a worker: the policy's clock (a push is its step's; a sync pull waits for
its round), retries, leases, a shard that went back to a cut (the clock goes back with it), the records of
``psgd report`` and TensorBoard (worker 0 evaluates the weights a pull gives at the start of each epoch, and those
its last step left, as psgd launch's workers do), the divergence guard, a clean stop (SIGTERM, SIGINT and SIGHUP
set :attr:`Worker.stopping`), and the step's seed: the network's random masks (dropout) are drawn from the job's
seed, the worker and the step, as psgd's own loop draws them, without a ``seed=`` of the script's.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from psgd import data as datasets
from psgd.config import JobConfig
from psgd.data.ahead import Ahead
from psgd.errors import ConfigError, InputError, PsgdError
from psgd.job import Job, build_job
from psgd.model.module import step_seed
from psgd.observe.progress import MetricsLog
from psgd.training.divergence import DivergenceGuard
from psgd.training.evaluation import Evaluations, judged, resumed
from psgd.training.loop import ResumeFromStep
from psgd.wire.channel import read_token
from psgd.wire.tls import TLSFiles
from psgd.worker.client import PSClient
from psgd.worker.exchange import ParameterServerExchange
from psgd.worker.stop import STOP_SIGNALS, Stop

#: what psgd run tells each copy of the script: the job file, the worker's rank, where its metrics lines go and
#: the device it computes on (the job's token travels as PSGD_TOKEN)
JOB_FILE, RANK, METRICS, DEVICE = "PSGD_JOB_FILE", "PSGD_RANK", "PSGD_METRICS", "PSGD_DEVICE"
#: and, where the job runs over TLS, the certificate, key and CA it shows and trusts (psgd run --tls-*)
TLS = ("PSGD_TLS_CERT", "PSGD_TLS_KEY", "PSGD_TLS_CA")


class Worker:
    """This process's place in a job: the job (:attr:`job`, with its model, data and device), this worker's
    :attr:`rank` of :attr:`workers`, and the calls of a step (:meth:`pull`, :meth:`batch`, :meth:`push`).  Made
    by :func:`join`; leaves the job when closed (``with``)."""

    def __init__(self, job: Job, client: PSClient, rank: int, stop: Stop, metrics_path: str | None = None):
        self.job, self.rank, self.stop = job, rank, stop
        c, t = job.config.cluster, job.config.train
        if c.elastic:
            raise ConfigError(
                f'psgd.join() takes a fixed count of workers; [cluster] workers = "{c.get("workers")}" is a range, '
                "which psgd launch's and psgd-worker's own loop take: give one number"
            )
        self.workers, self.batch_size = c.workers, t.batch_size
        self.model, self.device = job.model, job.device
        self._client = client
        self._exchange = ParameterServerExchange(job, client, rank, stop)
        self._batches = datasets.ShardedBatches(
            job.dataset.x_train, job.dataset.y_train, rank=rank, world=c.workers, batch_size=t.batch_size, seed=t.seed
        )
        #: the steps the job's epochs make for this worker (its share of the data, the job's batch size)
        self.steps = self._batches.steps_per_epoch * t.epochs
        self._metrics = MetricsLog(metrics_path, role=f"worker:{rank}")
        ds = job.dataset
        self._guard = DivergenceGuard.of_job(f"worker {rank}", ds, job.config, "ps")
        # evaluated as psgd launch's workers are: on worker 0, before each epoch's first step (or every
        # [train] eval_every steps), and the weights its last step left (read before it leaves)
        self._every = 0 if rank else t.eval_every or self._batches.steps_per_epoch
        self._evaluations = Evaluations(
            job,
            self._metrics,
            self._guard,
            f"worker {rank}",
            self._batches.steps_per_epoch,
            self.steps,
            self._exchange.rows if job.plan.tables else None,
            says=True,
        )
        self._exchange.reads_final = bool(self._every) and not job.plan.tables  # (rows: read after it left)
        self._evaluated, self._loss = -1, None  # the step last evaluated at; the last loss pushed (None: none yet)
        self._epoch: tuple[int, np.ndarray] = (-1, np.empty(0))
        self._rows = Ahead(
            job.dataset.x_train,
            job.dataset.y_train,
            on=False,
            augment=job.augment,
            seed=(t.seed, rank),
            target=job.dataset.target,
            classes=job.dataset.num_classes,
        )
        self.clock = self._exchange.begin()
        if self.clock > 0:  # a resumed run: judged against its own start, in its earlier part's records
            resumed(self._guard, metrics_path, self._metrics.role)
        self._began, self._closed = time.perf_counter(), False
        self._calls = (-1, 0)  # (a step, the training calls made in it): what the model's next masks are seeded by
        if hasattr(self.model, "step_seeds"):  # a network: its loss_and_grads draws the step in hand's masks
            self.model.step_seeds = self._step_seed

    def _step_seed(self) -> int:
        """The seed of a training call's random masks (dropout): the step in hand's, as psgd's own loop seeds it
        (the job's seed, this worker and the step); a further call in the same step gets a seed of its own."""
        step, calls = self._calls
        self._calls = (self.clock, calls + 1 if step == self.clock else 0)
        return step_seed(self.job.config.train.seed, self.rank, self.clock, self._calls[1])

    @property
    def stopping(self) -> bool:
        """Whether the worker was asked to stop (a stop signal): end the loop, then leave (close)."""
        return self.stop.is_set()

    def share(self, epoch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """This worker's examples of ``epoch`` (default: the step in hand's), as arrays on the host: the job's
        training data dealt among its workers anew each epoch, as psgd's own loop deals it."""
        x, y = self.job.dataset.x_train, self.job.dataset.y_train
        epoch = self.clock // self._batches.steps_per_epoch if epoch is None else epoch
        mine = datasets.shard_indices(len(x), self.rank, self.workers, epoch, self.job.config.train.seed)
        return x[mine], y[mine]

    def batch(self, step: int | None = None) -> tuple[Any, Any]:
        """Step ``step``'s batch (default: the step in hand, :attr:`clock`) of this worker's share, in the order
        psgd's own loop takes them, on the job's device."""
        step = self.clock if step is None else step
        epoch, i = divmod(step, self._batches.steps_per_epoch)
        if self._epoch[0] != epoch:
            self._epoch = (epoch, self._batches.indices(epoch))
        x, y = self._rows.take(step, self._epoch[1][i])  # augmented as the job says, as psgd's own loop does
        return self.device.asarray(x), self.device.asarray(y)

    def pull(self) -> Mapping[str, Any]:
        """The weights to compute the step in hand with (on the job's device), as the policy gives them: under
        sync, once its round has closed."""
        while True:
            try:
                params = self._exchange.weights(self.clock)
                break
            except ResumeFromStep as back:  # a shard restarted from a cut: the job goes on from there
                self._went_back(back)
        if self._every and self.clock > 0 and self.clock % self._every == 0 and self._evaluated != self.clock:
            self._evaluated = self.clock  # (once a step, however many pulls the script makes in it)
            self._evaluations(params, self.clock, self._loss, time.perf_counter() - self._began)
        return params

    def push(self, grads: Mapping[str, Any], loss: float | None = None) -> None:
        """Hand on the step in hand's gradients (by variable name, every variable of the model): the shards apply
        them under the job's policy and optimizer.  ``loss``, where given, goes into the metrics lines."""
        try:
            out = self._exchange.exchange(self.clock, dict(grads))
        except ResumeFromStep as back:
            self._went_back(back)
            return
        record = {"clock": self.clock, **out.fields, "wall": time.perf_counter() - self._began}
        if loss is not None:
            record["loss"] = self._loss = float(loss)
            judged(self._guard.step(self.clock, self.clock // self._batches.steps_per_epoch, self._loss), self._metrics)
        self._metrics.write("step", **record)
        self.clock = out.next_step

    def _went_back(self, back: ResumeFromStep) -> None:
        self._metrics.write("rewound", clock=back.clock, at=self.clock)
        self.clock, self._calls = back.clock, (-1, 0)  # a step taken again draws the same masks again

    def close(self) -> None:
        """Leave the job: every step stands (a sync worker waits for its last round), the shards are told (not
        when pausing: Ctrl-C), the metrics lines end."""
        if self._closed:
            return
        self._closed = True
        interrupted = self.stopping or self.clock < self.steps
        try:
            if not interrupted:
                try:
                    self._exchange.settle(self.clock)
                except ResumeFromStep as back:  # the steps since the cut are the script's to take again
                    self._went_back(back)
                    interrupted = True
            summary = self._exchange.end(interrupted)
            seconds, final = time.perf_counter() - self._began, self._exchange.final_weights()
            if final is not None:
                self._evaluations(final, self.clock, self._loss, seconds)
            diverged = self._guard.verdict.record() if self._guard.verdict else None
            self._metrics.write(
                "done", clock=self.clock, seconds=seconds, **summary, **self._evaluations.scores(), diverged=diverged
            )
        finally:
            if getattr(self.model, "step_seeds", None) == self._step_seed:
                self.model.step_seeds = None
            self._metrics.close()
            self._client.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def join(environ: Mapping[str, str] | None = None) -> Worker:
    """Join the job ``psgd run`` started this script for: the job file, rank, device, token and TLS files from the
    environment it set.  Stop signals set :attr:`Worker.stopping` from here on (the main thread only).

    The script is a psgd process like a command: an error psgd raises on purpose ends it with one line and the
    commands' exit status (2: what the user gave is wrong, as outside ``psgd run``; 1: the cluster's), not a
    traceback in its log."""
    try:
        return _join(os.environ if environ is None else environ)
    except PsgdError as exc:
        print(f"psgd.join(): error: {exc}", file=sys.stderr)
        raise SystemExit(2 if isinstance(exc, InputError) else 1) from None


def _join(environ: Mapping[str, str]) -> Worker:
    missing = [name for name in (JOB_FILE, RANK) if not environ.get(name)]
    if missing:
        raise InputError(
            f"{', '.join(missing)} not set: start this script with psgd run "
            "(psgd run --help), which starts the shards and one copy of it per worker"
        )
    stop = Stop()
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, lambda signum, frame: stop.signalled(signum))
    config = JobConfig.load(environ[JOB_FILE])
    if environ.get(DEVICE):
        config = config.override("train.device", environ[DEVICE])
    try:
        rank, workers = int(environ[RANK]), config.cluster.workers
    except ValueError:
        raise InputError(f"{RANK}={environ[RANK]!r} is not an integer (the worker's rank)") from None
    if not 0 <= rank < workers:
        raise InputError(f"{RANK}={rank}: the job has {workers} worker(s), 0..{workers - 1}")
    job = build_job(config, check=True)
    c = config.cluster
    client = PSClient(
        c.servers,
        job.plan,
        rank,
        links=c.links,
        deadlines=c.deadlines,
        recovery=c.recovery,
        token=read_token(environ=environ),
        tls=TLSFiles(*(environ.get(name) for name in TLS)),
        stop=stop,
        config=config,
        device=job.device,
    )
    try:
        return Worker(job, client, rank, stop, environ.get(METRICS) or None)
    except BaseException:
        client.close()
        raise
