"""A parameter-server worker: the one loop (:mod:`psgd.training.loop`) with the shards as its exchange.

Each step pushes the gradient to every shard, which apply it under the job's policy; under sync the answer brings
the next step's weights once the round closes (one round trip a step; the first step, a rejoin and embedding
tables pull on their own), under async and ssp the worker pulls once its push is answered: fresher weights.
Under a local policy (``local``) the worker pulls every ``local_steps`` steps, trains its own copy with the job's
optimizer in between, and pushes its progress (the weights it pulled less its own) at the end of each period.
The worker joins at the clock the shards hold (a restarted worker continues where the job is), and when the shards
say a clock is already past, it skips ahead to the smallest clock any shard expects next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import resource
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future
from typing import Any, NoReturn

import numpy as np

from psgd import data as datasets
from psgd.compute import backend
from psgd.config import ConfigError, JobConfig
from psgd.data.blocks import HandedBatches, blocks_per_epoch
from psgd.job import Job, build_job, params_to_device
from psgd.model.table import Rows
from psgd.policy import POLICIES
from psgd.training.delay import NO_DELAY, Delay
from psgd.training.loop import Exchange, Exchanged, Interrupted, LoopResult, ResumeFromStep, run_loop
from psgd.wire.tls import NO_TLS, TLSFiles
from psgd.worker.client import PSClient, PSError, Stopped
from psgd.worker.errors import ShardWentBack
from psgd.worker.lookups import as_rows, asked_rows, held_rows, read_rows
from psgd.worker.rollback import roll_back

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Prefetch:
    """The pull of the next step, started beside a push ([cluster] overlap)."""

    step: int  # the step it pulls the weights for
    lookups: Mapping[str, np.ndarray] | None  # the ids it asked each table's rows for
    rows: dict  # those rows, as asked_rows gives them
    pending: Future  # the pull itself: (versions, its span)
    pulled: dict[str, Any] | None  # the device arrays it fills, where it goes straight there


class ParameterServerExchange(Exchange):
    """Pull from and push to every shard through ``client`` (a :class:`PSClient`, entered); a model's embedding
    tables travel in the same pulls and pushes: the rows of the step's ids, and their gradients."""

    mode = "ps"
    trains_tables = True

    def __init__(self, job: Job, client: PSClient, rank: int, stop: threading.Event | None = None):
        self.job, self.client, self.plan, self.rank, self.stop = job, client, job.plan, rank, stop
        self.role, self.name = f"worker:{rank}", f"worker {rank}"
        # Pulled weights land in, and gradients leave from, host buffers made once: pinned on a GPU,
        # so the copies to and from the device run by DMA at the bus's rate (psgd bench gpu).
        device = job.device
        self.host = {s.name: backend.host_empty(s.shape, s.dtype, device) for s in self.plan.specs}
        self.grad_host = (
            {s.name: backend.host_empty(s.shape, s.dtype, device) for s in self.plan.specs} if device.is_gpu else None
        )
        self.outcomes: dict[str, int] = {}
        self.joined = False
        #: whether this worker evaluates the weights its last step left (the one that evaluates, rank 0 by default)
        self.reads_final = False
        self._final: dict[str, Any] | None = None
        self.versions: list[int] = []
        self.pull_seconds = 0.0
        # [cluster] overlap: the next step's pull goes out while this step's push is in flight, into a second
        # set of host buffers; at most one push and one pull are under way (two threads, two buffer sets)
        self.overlaps = job.config.cluster.overlap
        self._spare = (
            {s.name: backend.host_empty(s.shape, s.dtype, device) for s in self.plan.specs} if self.overlaps else None
        )
        self._prefetch: _Prefetch | None = None  # the pull of the next step, started beside a push
        self._ahead: tuple[int, dict] | None = None  # the next step's rows to pull ahead (tables)
        self._answered: tuple[int, list[int], dict | None] | None = None  # a push's answer: step, versions, arrays
        self.pulls_ahead = 0  # steps whose weights were pulled beside a push
        # and on a GPU each gradient leaves the device as soon as backward has produced it, on a CUDA stream
        # of its own into its pinned buffer, while backward goes on
        self._side = backend.SideStream(device) if self.overlaps and device.is_gpu else None
        self._copied: set[str] = set()
        # A GPU worker whose shards all share memory with it (psgd.link.shm) pulls into device arrays made for each
        # pull, and pushes from the device, straight from and into the shards' segments: no host buffers then.
        self.pulled: dict[str, Any] | None = None  # the weights the last pull put on the device (None: in self.host)
        self.total = 0
        self.stepped = 0  # the clock after the last step this process took
        self.spans: dict[str, tuple[float, float]] = {}  # overlap: when this step's pull and push ran
        # a local policy: this worker's own copy of the weights and its optimizer, between pulls
        c = job.config.cluster
        self.local_steps = c.consistency.local_steps if POLICIES[c.policy].local else 0
        self.accumulates = POLICIES[c.policy].accumulates  # sync: a push's answer brings the next weights (_combines)
        self.optimizer = job.optimizer() if self.local_steps else None
        self.own: dict[str, Any] | None = None
        if self.plan.tables and self.local_steps:
            raise ConfigError(
                f"model {job.config.model['name']!r} has embedding tables, which a parameter-server "
                "worker trains without the local policy so far"
            )
        self._reader: PSClient | None = None  # an observer, for an evaluation's rows
        self.moved = {"rows": 0, "bytes": 0, "steps": 0}  # a model with tables: rows and bytes moved, in all

    def _stopping(self, exc: PSError, then: str = "") -> None:
        """A failed call while the worker is being stopped ends the step (``then``: what it does next), else fails."""
        if isinstance(exc, Stopped) or (self.stop is not None and self.stop.is_set()):
            raise Interrupted(f"{exc}{then}") from None

    def begin(self) -> int:
        c, t, ds = self.job.config.cluster, self.job.config.train, self.job.dataset
        try:  # asked to stop while it waits for its shards or registers: it leaves, no error
            join, began = c.deadlines.join_timeout, time.monotonic()  # to reach the shards, then to register (a
            self.client.wait_ready(join)  # pair's replica may accept connections before its primary is up to lead)
            clock = self.client.register(max(c.deadlines.request_timeout, join - (time.monotonic() - began)))
        except PSError as exc:
            self._stopping(exc, "; leaving before it joined")
            raise
        self.joined = True
        self.client.start_heartbeats()
        if c.elastic:  # its batches are handed out as it goes: it trains until none is left
            self.total = sys.maxsize
            log.info(
                "worker %d of %s: batches of %d handed out by shard 0 until the job's %d epoch(s) are done (%d "
                "batches an epoch), starting at clock %d, %s",
                self.rank,
                c.get("workers"),
                t.batch_size,
                t.epochs,
                blocks_per_epoch(ds.n_train, t.batch_size),
                clock,
                ds.describe(),
            )
            return clock
        spe = datasets.steps_per_epoch(ds.n_train, c.workers, t.batch_size)
        self.total = spe * t.epochs
        log.info(
            "worker %d of %d: %d steps of batch %d (%d per epoch), starting at clock %d, %s",
            self.rank,
            c.workers,
            spe * t.epochs,
            t.batch_size,
            spe,
            clock,
            ds.describe(),
        )
        return clock

    def weights(self, step: int, lookups: Mapping[str, np.ndarray] | None = None) -> Mapping[str, Any]:
        if self.own is not None and step % self.local_steps:
            return self.own  # a local step: on this worker's own copy
        began = time.perf_counter()
        try:
            rows = self._prefetched(step, lookups)
            if rows is None and self._answered is not None and self._answered[0] == step:
                _, self.versions, self.pulled = self._answered  # brought by the last push's answer
                rows = {}
            elif rows is None:
                rows, self.pulled = asked_rows(self.plan, lookups), self._device_arrays()
                self.versions = self.client.pull(
                    step, self.host, {t: (ids, out) for t, (ids, _, out) in rows.items()}, device=self.pulled
                )
                self.spans["pull"] = (began, time.perf_counter())
        except PSError as exc:
            self._stopping(exc)
            raise
        except ShardWentBack as back:
            self._went_back(back)
        self.pull_seconds = time.perf_counter() - began  # with overlap: the part of the pull not hidden
        device, pulled = self.job.device, self._centre()
        if self.local_steps:  # the centre stays where it was pulled to until the period's push
            self.own = {k: device.asarray(v).copy() for k, v in pulled.items()}
            return self.own
        return {**{k: device.asarray(v) for k, v in pulled.items()}, **as_rows(rows, device)}

    def batches(self, fixed: datasets.ShardedBatches) -> datasets.ShardedBatches | HandedBatches:
        """A job with a range of workers: each step's batch asked of shard 0 (psgd.data.blocks), else ``fixed``."""
        c, t, ds = self.job.config.cluster, self.job.config.train, self.job.dataset
        if not c.elastic:
            return fixed
        return HandedBatches(ds.n_train, t.batch_size, t.seed, t.epochs, c.fewest, self._batch)

    def _batch(self, clock: int, total: int) -> int:
        try:
            return self.client.batch(clock, total)
        except PSError as exc:
            self._stopping(exc)
            raise

    def settle(self, step: int) -> None:
        """A local policy's last period, cut short where the job's batches ran out (a job with a range), pushed; and
        with cuts (sync, checkpoint_rounds) the last round's weights pulled from every shard before this worker
        leaves, so that a shard that restarted from a cut after its last push still brings the job back."""
        try:
            self._push_period_so_far(step)
        except PSError as exc:
            self._stopping(exc)
            raise
        except ShardWentBack as back:
            self._went_back(back)
        if self.job.config.cluster.cut_rounds:
            try:
                self.client.pull(step, self.host)
            except PSError as exc:
                self._stopping(exc)
                raise
            except ShardWentBack as back:
                self._went_back(back)

    def _push_period_so_far(self, step: int) -> None:
        """A job with a range under a local policy: the progress of the period ``step`` (the clock after its last
        step) cut short, pushed, as the job's batches ran out or the worker leaves; its batches are then in, and
        leaving gives none of them back (a worker that could not push gives them back, and another trains them)."""
        if self.job.config.cluster.elastic and self.local_steps and step % self.local_steps and self.own is not None:
            device, centre = self.job.device, self._centre()
            progress = {k: device.asarray(centre[k]) - v for k, v in self.own.items()}
            self.client.push(step - 1, self._outgoing(progress))
            self.client.clock = step

    def _went_back(self, back: ShardWentBack) -> NoReturn:
        """The job goes back to a cut (psgd.worker.rollback): taken back by this worker where it heard why; a pull
        made ahead is dropped, and the loop continues from the cut's clock."""
        clock, self._answered = roll_back(self.client, back), None
        if self._prefetch is not None:
            with contextlib.suppress(PSError, ShardWentBack, futures.TimeoutError):
                self._prefetch.pending.result(timeout=self.client.deadlines.request_timeout)
            self._prefetch = None
        self._ahead = None
        raise ResumeFromStep(clock) from None

    def _centre(self) -> dict[str, Any]:
        """The weights of the last pull: on the device where it went there (see _device_arrays), else on the host."""
        return self.host if self.pulled is None else self.pulled

    def _device_arrays(self) -> dict[str, Any] | None:
        """Device arrays for a pull to fill straight from shared memory, where every shard's link can now (made
        for each pull: what the last one filled may still be in use); None where not."""
        if not self._direct():
            return None
        xp = self.job.device.xp
        return {s.name: xp.empty(s.shape, dtype=s.dtype) for s in self.plan.specs}

    def _direct(self) -> bool:
        """Whether every shard's link goes between this worker's GPU and shared memory now (psgd.link.shm)."""
        return self.job.device.is_gpu and all(getattr(link, "direct", False) for link in self.client.links)

    def _pushes_from_device(self) -> bool:
        """Whether a gradient goes from the device straight into shared memory now: it does uncompressed (a
        codec encodes on the host)."""
        return not self.client.codec.compresses and self._direct()

    def rows(self, lookups: Mapping[str, np.ndarray]) -> dict[str, Rows]:
        if self._reader is None:
            self._reader = self.client.observer()
        return read_rows(self._reader, lookups, self.job.device)

    def _prefetched(self, step: int, lookups: Mapping[str, np.ndarray] | None) -> dict | None:
        """Take the pull of ``step`` started during the last push, if that is the step now computed and it asked
        for the rows of ``lookups`` (its error, if it failed, is this step's): the rows it filled (as
        :func:`_asked` gives them).  None where there was none; a pull for another step or other lookups is
        waited for and dropped."""
        if self._prefetch is None:
            return None
        ahead, self._prefetch = self._prefetch, None
        mine, theirs = lookups or {}, ahead.lookups or {}
        if (
            ahead.step != step
            or mine.keys() != theirs.keys()
            or not all(np.array_equal(mine[t], theirs[t]) for t in mine)
        ):
            with contextlib.suppress(PSError):  # not this step's: only let it finish off the connection
                ahead.pending.result()
            return None
        self.versions, self.spans["pull"] = ahead.pending.result()
        self.host, self._spare = self._spare, self.host
        self.pulled = ahead.pulled
        self.pulls_ahead += 1
        return ahead.rows

    def exchange(self, step: int, grads: dict[str, Any]) -> Exchanged:
        self.stepped = step + 1
        if self.local_steps:
            for name, grad in grads.items():
                self.optimizer.update(name, self.own[name], grad)
            if (step + 1) % self.local_steps and step + 1 < self.total:
                return Exchanged(step + 1, {"version": max(self.versions)})
            device = self.job.device
            centre = self._centre()
            grads = {k: device.asarray(centre[k]) - v for k, v in self.own.items()}  # the period's progress
        began = time.perf_counter()
        rows = {name: (g.ids, backend.to_host(g.values)) for name, g in grads.items() if isinstance(g, Rows)}
        grads = {name: g for name, g in grads.items() if name not in rows}
        fields = {"version": max(self.versions)}  # the weights this step's gradient was computed from
        self._answered = None
        try:
            if self.overlaps:
                replies = self._push_beside_next_pull(step, self._outgoing(grads), rows)
            elif self._combines(step, rows):
                pulled = self._device_arrays()
                replies, versions = self.client.push_pull(step, self._outgoing(grads), self.host, pulled)
                if versions is not None:
                    self._answered = (step + 1, versions, pulled)
            else:
                replies = self.client.push(step, self._outgoing(grads), rows=rows)
        except PSError as exc:
            self._stopping(exc)
            raise
        except ShardWentBack as back:
            self._went_back(back)
        pushed = time.perf_counter()
        for r in replies:
            self.outcomes[r.outcome] = self.outcomes.get(r.outcome, 0) + 1
        # The smallest clock any shard expects next (never behind this one): skipping a clock on a
        # shard that is behind would leave its sync round waiting for this worker forever.
        new_clock = self.client.clock = max(step + 1, min(r.next_clock for r in replies))
        self._answered = self._answered if new_clock == step + 1 else None  # else: it pulls the clock shards expect
        spans, self.spans = self.spans, {}
        # what moved: the dense weights down and their gradient up, and each row of the step down and up
        moved = 2 * (self.plan.total_bytes + sum(ids.nbytes + values.nbytes for ids, values in rows.values()))
        fields["staleness"] = max(r.staleness for r in replies)
        if rows:
            fields["rows"] = sum(ids.size for ids, _ in rows.values())
            self.moved["rows"] += fields["rows"]
            self.moved["bytes"] += moved
            self.moved["steps"] += 1
        return Exchanged(
            new_clock,
            fields,
            {
                "pull_seconds": self.pull_seconds,
                "push_seconds": pushed - began,
                "bytes": moved,
                "outcomes": [r.outcome for r in replies],
                "spans": spans,
            },
        )

    def _combines(self, step: int, rows: Mapping) -> bool:
        """Whether this step's push brings the next step's weights: under sync (async's pull, sent once the push is
        answered, reads fresher weights), but for the last step, a stopping worker and rows (their own pull's)."""
        return (
            self.accumulates
            and step + 1 < self.total
            and not rows
            and not self.plan.tables
            and not (self.stop is not None and self.stop.is_set())
        )

    def gradient_ready(self, name: str, grad: Any) -> None:
        if self._side is not None and not self._pushes_from_device():
            self._side.to_host_after(self._side.mark(), grad, self.grad_host[name])
            self._copied.add(name)

    def ahead(self, step: int, lookups: Mapping[str, np.ndarray]) -> None:
        self._ahead = (step, lookups)

    def _push_beside_next_pull(self, step: int, grads: dict[str, np.ndarray], rows: Mapping[str, tuple]) -> list:
        """Push ``step``'s gradient (and row gradients) and, at the same time, pull the weights for the next
        step, with the rows of its lookups where :meth:`ahead` told them (on the link's other connection; under
        sync that pull waits at the shards for the round this push closes)."""
        push = _in_background(
            f"worker-{self.rank}-push", _spanned, self.client.push, step, grads, list(self.versions), rows
        )
        ahead, self._ahead = self._ahead, None
        if step + 1 < self.total and not (self.stop is not None and self.stop.is_set()):
            lookups = ahead[1] if ahead is not None and ahead[0] == step + 1 else None
            asked, pulled = asked_rows(self.plan, lookups), self._device_arrays()
            self._prefetch = _Prefetch(
                step + 1,
                lookups,
                asked,
                _in_background(
                    f"worker-{self.rank}-pull",
                    _spanned,
                    self.client.pull,
                    step + 1,
                    self._spare,
                    {t: (ids, out) for t, (ids, _, out) in asked.items()},
                    pulled,
                ),
                pulled,
            )
        replies, self.spans["push"] = push.result()  # a failed push fails this step, as without overlap
        return replies

    def _outgoing(self, grads: dict[str, Any]) -> dict[str, Any]:
        """The gradients as they are pushed: as they are, on the device, where they go straight into shared memory
        (copies made during backward are then let go), else on the host (:meth:`_on_host`)."""
        if not self._pushes_from_device():
            return self._on_host(grads)
        if self._copied:
            self._copied = set()
            self._side.synchronize()
        return grads

    def _on_host(self, grads: dict[str, Any]) -> dict[str, np.ndarray]:
        """The gradients as host arrays: copied into the pinned buffers from a GPU, as they are on a CPU."""
        if self.grad_host is None:
            return {k: np.asarray(g) for k, g in grads.items()}
        copied, self._copied = self._copied, set()
        if copied:  # those copied during backward (overlap)
            self._side.synchronize()
        return {
            k: self.grad_host[k] if k in copied else backend.to_host(g, out=self.grad_host[k]) for k, g in grads.items()
        }

    def _read_final(self) -> dict[str, Any] | None:
        """The weights the shards hold once this worker's last push is in (under sync, its last round's), for the
        loop to evaluate as the final ones; None, said in a line, where they cannot be read."""
        try:
            last = self.client.clock if self.job.config.cluster.elastic else self.total  # (elastic: ran out of batches)
            self.versions = self.client.pull(last, self.host, {}, None)
        except (PSError, ShardWentBack) as exc:
            log.warning(
                "worker %d: could not read the weights its last step left, to evaluate them (%s)", self.rank, exc
            )
            return None
        return params_to_device(self.host, self.job.device)

    def final_weights(self) -> Mapping[str, Any] | None:
        return self._final

    def end(self, interrupted: bool) -> dict[str, Any]:
        if self._prefetch is not None:  # a pull for a step that will not be computed now
            with contextlib.suppress(PSError):
                self._prefetch.pending.result()
            self._prefetch = None
        if self._reader is not None:
            self._reader.close()
        if self.joined and interrupted and getattr(self.stop, "pausing", False):
            log.info(
                "worker %d: paused, the shards not told it left (their rounds wait for it): psgd launch "
                "--resume, or this worker started again, goes on from here",
                self.rank,
            )
        elif self.joined:
            if interrupted:  # leaving: a local period's progress so far goes in first (else its batches go back)
                with contextlib.suppress(PSError, ShardWentBack):
                    self._push_period_so_far(self.stepped)
            if self.reads_final and not interrupted:  # before it leaves: the job's last shards may leave with it
                self._final = self._read_final()
            try:
                self.client.done()
            except PSError as exc:
                if not interrupted and (self.stop is None or not self.stop.is_set()):
                    raise
                # Stopped together with its shards (docker compose down): they are not there to hear it.
                log.warning("worker %d: could not say it left (%s); stopping anyway", self.rank, exc)
        summary: dict[str, Any] = {
            "outcomes": dict(self.outcomes),
            "job_steps": None if self.job.config.cluster.elastic else self.total,  # elastic: until no batch is left
            "stopped": interrupted,
            **({"pulls_ahead": self.pulls_ahead} if self.overlaps else {}),
            **({"final_versions": list(self.versions)} if self._final is not None else {}),
        }
        if self.moved["steps"]:
            steps = self.moved["steps"]
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes
            summary.update(
                rows_per_step=self.moved["rows"] / steps,
                bytes_per_step=self.moved["bytes"] / steps,
                peak_rss_bytes=peak,
            )
            log.info(
                "worker %d: %.0f rows of embedding tables and %.3f MB moved a step on average (the dense "
                "weights, down and up: %.3f MB; the rows the shards hold: %s); this worker's peak RSS %.0f MB",
                self.rank,
                summary["rows_per_step"],
                summary["bytes_per_step"] / 1e6,
                2 * self.plan.total_bytes / 1e6,
                held_rows(self.client),
                peak / 1e6,
            )
        return summary


def _spanned(fn: Callable[..., Any], *args: Any) -> tuple[Any, tuple[float, float]]:
    """``fn(*args)`` and when it ran (perf_counter at its start and end)."""
    began = time.perf_counter()
    return fn(*args), (began, time.perf_counter())


def _in_background(name: str, fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` on a thread of its own; its result or error in the future.  The thread is a daemon:
    a call left behind by a failed step (retrying a shard that is gone) never holds the process open."""
    future: Future = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def take_rank(
    job: Job, addresses: Sequence[str], token: str, tls: TLSFiles, stop: threading.Event | None = None
) -> int:
    """The rank shard 0 gives this process to join ``job``, a job with a range of workers (``--rank auto``): it
    waits for the shards as a worker does, then asks within the join timeout."""
    c = job.config.cluster
    if not c.elastic:
        raise ConfigError(
            f"--rank auto joins a job with a range of workers ([cluster] workers = \"MIN:MAX\"); this job has a fixed "
            f"{c.workers}: give each worker its rank, 0..{c.workers - 1}"
        )
    with PSClient(
        addresses, job.plan, 0, deadlines=c.deadlines, token=token, tls=tls, stop=stop, config=job.config
    ) as client:  # gRPC only: it registers once, with shard 0
        join, began = c.deadlines.join_timeout, time.monotonic()
        try:
            client.wait_ready(join)
            rank = client.take_rank(max(c.deadlines.request_timeout, join - (time.monotonic() - began)))
        except PSError as exc:
            if isinstance(exc, Stopped) or (stop is not None and stop.is_set()):
                raise Interrupted(f"{exc}; leaving before it joined") from None
            raise
    log.info("joined the job as worker %d of at most %d (shard 0 gave the rank)", rank, c.workers)
    return rank


def run_worker(
    config: JobConfig,
    rank: int | None,
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
    on_rank: Callable[[int], None] | None = None,
) -> LoopResult:
    """Train as worker ``rank`` of ``config.cluster.workers`` against the shards at ``addresses``; ``rank`` None
    joins a job with a range of workers at the lowest rank nobody holds (:func:`take_rank`), told to ``on_rank``.

    ``evaluate_every`` (steps; default: once per epoch on rank 0, never on the others) evaluates the pulled weights
    on the test split, and at the end the weights its last step left (read from the shards before it leaves; not
    for a model with embedding tables, whose rows it would read after).  ``delay`` slows this worker down, to play
    a straggler.  ``on_step`` gets each step's record (the JSONL fields plus ``pull_seconds``, ``push_seconds`` and
    ``bytes``), e.g. to feed a metrics endpoint.  ``token`` is the job's shared secret.  When ``stop`` is set (a stop
    signal), the worker finishes the step in hand, pushes it, and leaves (paused, where ``stop.pausing``).
    """
    job = build_job(config, dataset, check=True)
    c = config.cluster
    if rank is None:
        rank = take_rank(job, addresses, token, tls, stop)
        if on_rank is not None:
            on_rank(rank)
    if not 0 <= rank < c.workers:
        raise ValueError(f"rank {rank} is out of range: the job has {c.workers} worker(s), 0..{c.workers - 1}")
    if evaluate_every is None and rank != 0:
        evaluate_every = 0  # by default only rank 0 evaluates (each epoch, see run_loop)
    with PSClient(
        addresses,
        job.plan,
        rank,
        links=c.links,
        deadlines=c.deadlines,
        recovery=c.recovery,
        token=token,
        tls=tls,
        stop=stop,
        config=config,
        device=job.device,
    ) as client:
        exchange = ParameterServerExchange(job, client, rank, stop)
        exchange.reads_final = evaluate_every != 0 and not job.plan.tables  # tables: rows read after it left
        result = run_loop(
            job,
            exchange,
            rank=rank,
            world=c.workers,
            evaluate_every=evaluate_every,
            progress=progress,
            desc=f"worker {rank}",
            metrics_path=metrics_path,
            delay=delay,
            stop=stop,
            on_step=on_step,
        )
    return result
