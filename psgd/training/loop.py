"""The one training loop, shared by every mode, and the exchange that tells the modes apart.

Each step: the weights to compute with (:meth:`Exchange.weights`), the gradient of this process's
next batch (the only ``loss_and_grads`` of training), then the gradient handed on
(:meth:`Exchange.exchange`).  What an exchange does with it is the mode:

- :class:`psgd.training.local.LocalExchange`: applies the optimizer in this process (the reference trainer);
- :class:`psgd.worker.exchange.ParameterServerExchange`: pulls from and pushes to the shards;
- :class:`psgd.collective.exchange.AllReduceExchange`: averages with the other ranks, then applies
  the optimizer on every rank.

Everything else is written here once: the batches of this rank's data shard, when to evaluate
(before a step, on the weights it computes with, and once after the last step where this process
holds the final weights), the divergence guard, the metrics lines, the progress bar or log lines,
the injected straggler delay, the stop event and the result.

The straggler delay (``--delay``, :mod:`psgd.training.delay`) means the same in every mode: after a
step's exchange the process sleeps, and ``slowdown:K`` makes the whole step (weights in, gradient,
exchange out, with any waiting for the others) take K times as long as it did.

Metrics lines (``--metrics FILE``, one JSON object a line, with ``time``, ``role``, ``event``):
``step`` after every step (``clock``: the step's index from 0, ``epoch``, ``loss``, ``wall``,
``delay``, and what the exchange adds, e.g. ``version`` and ``staleness``); ``eval`` after every
evaluation (``step``: the steps done, ``epoch``, ``wall``, ``train_loss``, ``test_loss``,
``test_accuracy``); ``diverged`` once, when the divergence guard (:mod:`psgd.training.divergence`) sees the run
is not training (``by``, ``step``, ``epoch``, ``why``, ``advice``); ``done`` at the end (``steps``,
``clock``, ``seconds``, the exchange's summary, ``diverged``: the same record or null).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from psgd import data as datasets
from psgd import model as models
from psgd.compute import backend, graphs
from psgd.config import ConfigError
from psgd.data.ahead import Ahead
from psgd.data.base import scores_of
from psgd.errors import PsgdError
from psgd.job import Job
from psgd.model.module import step_seed
from psgd.model.table import Rows
from psgd.observe.progress import MetricsLog, progress_bar
from psgd.training.delay import NO_DELAY, Delay
from psgd.training.divergence import DivergenceGuard
from psgd.training.evaluation import BackgroundEvaluator, Evaluations, judged, resumed

log = logging.getLogger(__name__)


class Interrupted(PsgdError):
    """Raised by an exchange when the stop event ended a step half-way (the step is not counted)."""


class ResumeFromStep(PsgdError):
    """Raised by an exchange when the job went back to the cut at ``clock`` (a shard restarted from it): the loop
    continues from that step, with that step's data, and the steps since are computed again."""

    def __init__(self, clock: int):
        super().__init__(f"the job went back to step {clock}")
        self.clock = clock


def gradient_seconds(
    model: models.Model, params: Mapping[str, Any], x: Any, y: Any, repeats: int, device: backend.Device = backend.CPU
) -> float:
    """Median seconds of one gradient of (x, y) over ``repeats`` tries after a warm-up: what a step's
    compute costs before any exchange (the convergence lab's estimate); on a GPU until its kernels are done."""
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        began = time.perf_counter()
        model.loss_and_grads(params, x, y)
        backend.synchronize(device)
        times.append(time.perf_counter() - began)
    return float(np.median(times[1:]))


@dataclasses.dataclass
class Exchanged:
    """What an exchange says about one step: the next step to compute, and fields for its record."""

    next_step: int
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)  # for ``on_step`` only


class Exchange(abc.ABC):
    """How one process's gradients become new weights.  Subclasses hold any connection they need."""

    #: who writes the metrics lines, e.g. ``local``, ``worker:0``, ``allreduce:1``
    role: str = "local"
    #: who logs, in words: ``local``, ``worker 0``, ``rank 1``
    name: str = "local"
    #: the mode, for the divergence guard's advice: ``local``, ``ps`` or ``allreduce``
    mode: str = "local"

    def begin(self) -> int:
        """Join the job; returns the first step to compute (a parameter-server worker resumes)."""
        return 0

    @abc.abstractmethod
    def weights(self, step: int, lookups: Mapping[str, np.ndarray] | None = None) -> Mapping[str, Any]:
        """The weights (on the device) to compute step ``step``'s gradient with; for a model with embedding
        tables also, as :class:`~psgd.model.table.Rows`, the rows of each table the step's ``lookups`` (ids by
        table) name, made where they do not exist yet.  A table's gradient comes back to :meth:`exchange` as
        ``Rows`` too."""

    @abc.abstractmethod
    def exchange(self, step: int, grads: dict[str, Any]) -> Exchanged:
        """Hand on step ``step``'s gradients (device arrays, by variable name)."""

    #: whether :meth:`gradient_ready` wants each gradient as soon as backward produces it ([cluster] overlap)
    overlaps: bool = False
    #: whether this mode trains a model with embedding tables (:meth:`rows`)
    trains_tables: bool = False

    def rows(self, lookups: Mapping[str, np.ndarray]) -> dict[str, Rows]:
        """An evaluation's read of the rows ``lookups`` names (ids by table), on the device, as
        :class:`~psgd.model.table.Rows`: rows that do not exist read as their first values and are not made."""
        raise NotImplementedError

    def updates_in_graph(self) -> Callable[[], graphs.GraphUpdate] | None:
        """Where this exchange applies its optimizer to the very arrays :meth:`weights` hands out, in place: a maker
        of the updates a step captured as a graph may hold (the exchange is then handed no gradients for the steps
        whose graph applied them).  None where the weights come from elsewhere."""
        return None

    def ahead(self, step: int, lookups: Mapping[str, np.ndarray]) -> None:
        """The ``lookups`` of step ``step``, the next, told before this step's :meth:`exchange` (only where
        :attr:`overlaps` and the model has tables): an exchange that pulls the next step's weights beside this
        step's push pulls their rows too."""

    def gradient_ready(self, name: str, grad: Any) -> None:
        """Variable ``name``'s gradient of the step in hand, as soon as backward has produced it (only where
        :attr:`overlaps` and the model hands its gradients over); :meth:`exchange` still gets them all."""

    def batches(self, fixed: datasets.ShardedBatches) -> Any:
        """Where this rank's batches come from: ``fixed`` (its share of every epoch, from its rank), unless the
        exchange's job hands them out as it runs (a parameter-server job with a range of workers)."""
        return fixed

    def settle(self, step: int) -> None:
        """The loop's last step is done: an exchange that may still go back (:class:`ResumeFromStep`) makes sure here
        that every step stands before the loop ends."""

    def end(self, interrupted: bool) -> dict[str, Any]:
        """Leave the job (``interrupted``: the stop event ended it early); returns summary fields."""
        return {}

    def final_weights(self) -> Mapping[str, Any] | None:
        """The weights after the last step, where this process holds them (None: it does not)."""
        return None


@dataclasses.dataclass
class LoopResult:
    rank: int
    steps: int  # steps this process computed
    final_clock: int  # the step it would compute next
    seconds: float
    last_loss: float
    test_loss: float  # of the final weights, where evaluated; NaN otherwise
    test_accuracy: float | None  # of the final weights, for classes and labels (None for values)
    history: list[dict[str, Any]]  # the evaluation records
    params: dict[str, np.ndarray] | None  # host copies of the final weights, where this process holds them
    summary: dict[str, Any]  # the exchange's: push outcomes, seconds in the collective, ...
    divergence: dict[str, Any] | None = None  # what the divergence guard saw first (psgd.training.divergence)
    test_r2: float | None = None  # of the final weights, for values (regression) targets


def run_loop(
    job: Job,
    exchange: Exchange,
    *,
    rank: int = 0,
    world: int = 1,
    evaluate_every: int | None = None,
    final_evaluation: bool = True,
    progress: bool = True,
    desc: str = "train",
    metrics_path: str | None = None,
    run_dir: str | None = None,
    delay: Delay = NO_DELAY,
    stop: threading.Event | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> LoopResult:
    """Train ``job`` as ``rank`` of ``world`` through ``exchange``.

    ``evaluate_every`` (steps; 0: never; default: the job's ``eval_every``, else once per epoch)
    evaluates the weights before each step whose index is a multiple of it; ``final_evaluation`` evaluates the final
    weights when the exchange holds them.
    ``on_step`` gets each step's record plus the exchange's timings (e.g. to feed a metrics endpoint).
    ``run_dir``: where the metrics' CSV and TensorBoard files go (default: beside ``metrics_path``).
    When ``stop`` is set, the step in hand is finished (or interrupted) and the loop ends early.
    """
    ds, model, device, t = job.dataset, job.model, job.device, job.config.train
    if job.plan.tables and not exchange.trains_tables:
        raise ConfigError(
            f"model {job.config.model['name']!r} has embedding tables, which the {exchange.mode} mode "
            "does not train yet; psgd train and the parameter servers do"
        )
    if job.plan.tables and ds.ids_train is None:
        raise ConfigError(
            f"model {job.config.model['name']!r} looks ids up in embedding tables, but dataset "
            f"{ds.name!r} has none (clicks has)"
        )
    looks_up = exchange.rows if job.plan.tables else None
    # this rank's batches (a job with a range of workers: each step's handed out by the shards, Exchange.batches)
    batches = exchange.batches(
        datasets.ShardedBatches(
            ds.x_train, ds.y_train, rank=rank, world=world, batch_size=t.batch_size, seed=t.seed, epochs=t.epochs
        )
    )
    spe, total = batches.steps_per_epoch, batches.steps
    # rows read from disk (npy:DIR): the next batch's gathered on a thread while a step computes
    rows = Ahead(
        ds.x_train,
        ds.y_train,
        on=t.prefetch and type(ds.x_train) is not np.ndarray,
        augment=job.augment,
        seed=(t.seed, rank),
        target=ds.target,
        classes=ds.num_classes,
    )
    if evaluate_every is None:
        evaluate_every = t.eval_every or spe
    metrics = MetricsLog(metrics_path, role=exchange.role, folder=run_dir)
    guard = DivergenceGuard.of_job(exchange.name, ds, job.config, exchange.mode)
    # (no bar to show an evaluation: a log line each, for logs)
    evaluations = Evaluations(job, metrics, guard, exchange.name, spe, total, looks_up, says=not progress)
    history, score_key, short = evaluations.history, ds.score_key, {"accuracy": "acc", "r2": "r2"}[ds.metric]
    slow = delay.applies_to(rank)
    delay_rng = np.random.default_rng([t.seed, rank, 7])
    loss = float("nan")
    steps, step, interrupted = 0, 0, False
    handing = {}  # the model's loss_and_grads keyword that hands each gradient on as backward produces it
    if exchange.overlaps:
        if models.hands_over_gradients(model):
            handing = {"on_grad": exchange.gradient_ready}
        else:
            log.info(
                "%s: the model's loss_and_grads takes no on_grad, so its gradients move once backward is "
                "done (no overlap)",
                exchange.name,
            )
    gradient = model.loss_and_grads
    # a model whose steps draw random masks is given a seed a step, from the job's seed, this rank and the step
    draws = getattr(model, "random_step", False)
    if (
        not handing
        and not job.plan.tables
        and graphs.can_graph(model, device, t.graphs, lambda why: log.info("%s: %s", exchange.name, why))
    ):
        # the step's kernels as one launch, the optimizer's among them where the exchange updates in place
        gradient = graphs.GraphedStep(model, device, exchange.name, exchange.updates_in_graph())
    start = time.perf_counter()  # again once joined: wall times count from the first step

    beside = BackgroundEvaluator(evaluations) if t.eval_beside else None

    def _went_back(back: ResumeFromStep, step: int) -> int:
        metrics.write("rewound", clock=back.clock, at=step)
        bar.update(back.clock - step)
        return back.clock

    with progress_bar(total, desc, enabled=progress) as bar:
        try:
            step = first = exchange.begin()
            if first > 0:  # a resumed run: judged against its own start, in its earlier part's records
                resumed(guard, metrics_path, exchange.role)
            start = time.perf_counter()
            bar.initial = bar.n = step  # resumed there: the steps before are not this run's, nor is their rate
            bar.refresh()
            while True:
                batch = batches.at(step)
                if batch is None:  # the last step: the exchange makes sure it stands before the loop ends
                    try:
                        if step > first:  # (a worker with nothing to do pushed nothing that could need it)
                            exchange.settle(step)
                        break
                    except ResumeFromStep as back:
                        step = _went_back(back, step)
                        continue
                if stop is not None and stop.is_set():
                    log.info(
                        "%s: stopping at step %d as asked; the next start continues from here", exchange.name, step
                    )
                    interrupted = True
                    break
                try:
                    epoch, idx = batch
                    x, y = rows.take(step, idx)  # (gathered ahead, or now: in none of the step's parts below)
                    # the next batch, where it is known before it is taken and something gathers it ahead
                    later = batches.ahead(step + 1) if rows.on or (exchange.overlaps and looks_up) else None
                    if rows.on and later is not None:
                        rows.ahead(step + 1, later)
                    began = time.perf_counter()
                    params = exchange.weights(step, model.lookups(ds.ids_train[idx]) if looks_up else None)
                    fetched = time.perf_counter()
                    evaluated = bool(evaluate_every) and step > 0 and step % evaluate_every == 0
                    if evaluated and beside is not None:
                        evaluated = beside.submit(params, step, float(loss), fetched - start)
                    elif evaluated:
                        evaluations(params, step, float(loss), fetched - start)
                    if draws:  # a step of random masks (dropout): its own seed, the same again for the same step
                        handing["seed"] = step_seed(t.seed, rank, step)
                    loss, grads = gradient(params, device.asarray(x), device.asarray(y), **handing)
                    computed = time.perf_counter()
                    loss = float(loss)  # on a GPU: waits for the step's kernels
                    synced = time.perf_counter()
                    judged(guard.step(step, epoch, loss), metrics)
                    if exchange.overlaps and looks_up and later is not None:  # the next batch's rows, pulled ahead
                        exchange.ahead(step + 1, model.lookups(ds.ids_train[later]))
                    out = exchange.exchange(step, grads)
                    exchanged = time.perf_counter()
                    pause = delay.seconds(time.perf_counter() - began, delay_rng) if slow else 0.0
                    if pause:
                        time.sleep(pause)  # an injected slowdown (a straggler), part of the run's configuration
                    steps += 1
                    point = {
                        "clock": step,
                        "epoch": epoch,
                        "loss": loss,
                        **out.fields,
                        "wall": time.perf_counter() - start,
                        "delay": pause,
                        "seconds": {
                            "weights": round(fetched - began, 6),
                            "compute": round(synced - fetched, 6),
                            "exchange": round(exchanged - synced, 6),
                        },
                    }
                    if exchange.overlaps:  # what ran when, on the clock of "wall": psgd bench overlap draws it
                        point["spans"] = {
                            name: [round(a - start, 5), round(b - start, 5)]
                            for name, (a, b) in {"compute": (fetched, computed), **out.timings.get("spans", {})}.items()
                        }
                    metrics.write("step", **point)
                    if on_step:
                        on_step(
                            {
                                **point,
                                **({score_key: evaluations.score} if evaluated else {}),
                                "weights_seconds": fetched - began,
                                "compute_seconds": computed - fetched,
                                **out.timings,
                            }
                        )
                    bar.update(out.next_step - step)
                    bar.set_postfix(
                        loss=f"{loss:.4f}", **({short: f"{evaluations.score:.3f}"} if history else {}), refresh=False
                    )
                    step = out.next_step
                except ResumeFromStep as back:  # a shard restarted from a cut: the steps since are taken again
                    step = _went_back(back, step)
        except Interrupted as exc:
            interrupted = True
            log.info(
                "%s: stopping at step %d as asked (%s); the next start continues from here", exchange.name, step, exc
            )
        finally:
            rows.close()
            if beside is not None:
                beside.close()
        summary = exchange.end(interrupted)
        if beside is not None:
            summary["evaluations_skipped"] = beside.skipped
    final = exchange.final_weights()
    backend.synchronize(device)
    seconds = time.perf_counter() - start
    if final is not None and final_evaluation and not interrupted:
        evaluations(final, step, loss if steps else None, time.perf_counter() - start)
    diverged = guard.verdict.record() if guard.verdict else None
    metrics.write(
        "done", steps=steps, clock=step, seconds=seconds, **summary, **evaluations.scores(), diverged=diverged
    )
    metrics.close()
    host = {name: backend.to_host(v) for name, v in final.items()} if final is not None else None
    scores = scores_of(ds.metric, evaluations.score)
    return LoopResult(
        rank,
        steps,
        step,
        seconds,
        float(loss),
        evaluations.test_loss,
        scores["test_accuracy"],
        history,
        host,
        summary,
        diverged,
        scores["test_r2"],
    )
