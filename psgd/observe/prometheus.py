"""Prometheus metrics for shards and workers: ``--metrics-port [HOST:]PORT`` serves ``/metrics``.

The JSONL log (``--metrics FILE``) keeps working without any of this.

Shard: :class:`ShardMetrics` is a custom collector that reads ``core.status()``
on each scrape (pushes, pulls, outcomes, bytes, version, workers and their
clocks, the staleness histogram), so the shard's hot path pays nothing for
it; its :attr:`~ShardMetrics.interceptor` (:mod:`psgd.observe.rpc_latency`) times
every gRPC call by method and status code.  Pulls and pushes over the data
port are counted by the core (``psgd_shard_pulls_total``...) and timed by the
workers.

Worker: :class:`WorkerMetrics` is fed by ``run_worker(on_step=metrics.on_step)``:
steps, clock, loss, staleness, pull time (which includes the wait for the
round under sync, or for the slowest worker under ssp), push time, bytes and
push outcomes.

Each object owns its own registry (with the process collectors when built
from command-line arguments), so several can live in one process, as in the
tests.
"""

from __future__ import annotations

import argparse
import math
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from psgd.config import ConfigError
from psgd.observe.rpc_latency import LatencyInterceptor
from psgd.policy import OUTCOME_COUNTERS

#: RPC latency buckets (seconds): sub-millisecond control calls up to sync pulls that wait a minute.
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    math.inf,
)
#: Staleness buckets, as the shard keeps them: 0..14 exactly, the last bucket is 15 and more.
STALENESS_BUCKETS = tuple(float(i) for i in range(15)) + (math.inf,)
#: the shard's counter for each push outcome (psgd.policy.OUTCOME_COUNTERS), and refusals
PUSH_OUTCOMES = {**{counter: outcome for outcome, counter in OUTCOME_COUNTERS.items()}, "rejected": "rejected"}
WORKER_STATES = ("pending", "live", "done", "expired")


class MetricsError(ConfigError):
    """A --metrics-port value that cannot be served (a user error: one line, exit status 2)."""


# -- the HTTP endpoint ----------------------------------------------------------------------------
def parse_bind(value: str | int, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``PORT`` or ``HOST:PORT`` (``[::1]:PORT`` for IPv6) as ``(host, port)``."""
    text = str(value).strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = default_host, text
    host = host.strip("[]") or default_host
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise MetricsError(f"--metrics-port {value!r}: expected PORT or HOST:PORT with a port 0..65535")
    return host, int(port)


class MetricsEndpoint:
    """``http://HOST:PORT/metrics`` served from a daemon thread; :meth:`close` stops it."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry):
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise MetricsError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
        self.host, self.port = host, self._server.server_port
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve_metrics(bind: str | int, registry: CollectorRegistry, default_host: str = "127.0.0.1") -> MetricsEndpoint:
    """Serve ``registry`` at ``bind`` (``PORT`` or ``HOST:PORT``; port 0 picks a free one)."""
    host, port = parse_bind(bind, default_host)
    return MetricsEndpoint(host, port, registry)


def process_registry() -> CollectorRegistry:
    """A fresh registry with the usual process, platform and garbage-collector metrics."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port [HOST:]PORT`` for psgd-server and psgd-worker."""
    parser.add_argument(
        "--metrics-port",
        metavar="[HOST:]PORT",
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default host: the server's "
        "bind address; 127.0.0.1 for a worker; name 0.0.0.0 to be scraped from elsewhere)",
    )


# -- shards --------------------------------------------------------------------------------------
def staleness_buckets(histogram: Iterable[int]) -> tuple[list[tuple[str, float]], float]:
    """A shard's staleness counts (0..14, 15+) as cumulative Prometheus buckets and their sum.

    The sum counts the last bucket as 15, so it is a lower bound when staleness ran past 14.
    """
    counts = list(histogram)
    buckets, total, acc = [], 0.0, 0
    for i, n in enumerate(counts):
        acc += n
        total += i * n
        le = "+Inf" if i == len(counts) - 1 else f"{float(i)}"
        buckets.append((le, acc))
    if not counts or buckets[-1][0] != "+Inf":
        buckets.append(("+Inf", acc))
    return buckets, total


class ShardMetrics(Collector):
    """Metrics of one shard: a collector over ``core.status()`` plus an RPC-latency interceptor."""

    def __init__(self, core: Any, registry: CollectorRegistry | None = None):
        self.core = core
        self.registry = registry if registry is not None else CollectorRegistry()
        self.rpc_seconds = Histogram(
            "psgd_shard_rpc_seconds",
            "gRPC calls served by this shard, by method and "
            "status code (a sync Pull over gRPC includes its wait for the round)",
            ["method", "code"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.interceptor = LatencyInterceptor(self.rpc_seconds)
        self.endpoint: MetricsEndpoint | None = None
        self._bind: str | None = None
        self._default_host = "127.0.0.1"
        self.registry.register(self)

    @property
    def interceptors(self) -> list[LatencyInterceptor]:
        """Pass to ``ShardServer(..., interceptors=...)``."""
        return [self.interceptor]

    @classmethod
    def from_args(cls, core: Any, args: argparse.Namespace, default_host: str = "127.0.0.1") -> ShardMetrics:
        """Metrics for ``psgd-server``: call :meth:`start` once serving; a no-op without ``--metrics-port``."""
        bind = getattr(args, "metrics_port", None)
        if bind is None:
            return _NoMetrics()  # type: ignore[return-value]
        parse_bind(bind, default_host)  # a bad value fails before the shard starts serving
        metrics = cls(core, process_registry())
        metrics._bind, metrics._default_host = bind, default_host
        return metrics

    def start(self) -> ShardMetrics:
        if self._bind is not None and self.endpoint is None:
            self.endpoint = serve_metrics(self._bind, self.registry, self._default_host)
        return self

    def stop(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None

    def describe(self) -> Iterator:
        return iter(())  # the metrics are read on each scrape: nothing to check at registration

    def collect(self) -> Iterator:
        s = self.core.status()
        c = s["counters"]
        labels = {"shard": str(s["shard"])}
        names, values = list(labels), list(labels.values())

        info = GaugeMetricFamily(
            "psgd_shard_info",
            "this shard: which of how many, under which policy",
            labels=["shard", "num_shards", "policy", "plan_hash"],
        )
        info.add_metric([str(s["shard"]), str(s["num_shards"]), s["policy"], s["plan_hash"]], 1)
        yield info
        yield _gauge("psgd_shard_version", "updates applied to this shard's weights", names, values, s["version"])
        yield _gauge("psgd_shard_bytes_held", "bytes of weights this shard holds", names, values, s["bytes_held"])
        tables = s.get("tables", {})
        if tables:
            for metric, kind, words in (
                ("rows", GaugeMetricFamily, "rows of the table this shard holds"),
                ("bytes", GaugeMetricFamily, "bytes this shard's rows of the table take"),
                ("rows_created", CounterMetricFamily, "rows made on first use"),
                ("rows_evicted", CounterMetricFamily, "rows evicted (idle, or a full table)"),
                ("grads_dropped", CounterMetricFamily, "row gradients dropped: their id was not admitted yet"),
            ):
                family = kind(f"psgd_shard_table_{metric}", words, labels=[*names, "table"])
                for name, t in tables.items():
                    family.add_metric([*values, name], t.get(metric, 0))
                yield family
        yield _counter(
            "psgd_shard_pushes", "gradient pushes received (gRPC and data port)", names, values, c.get("pushes", 0)
        )
        yield _counter(
            "psgd_shard_pulls", "weight pulls answered (gRPC and data port)", names, values, c.get("pulls", 0)
        )
        outcomes = CounterMetricFamily(
            "psgd_shard_push_outcomes", "pushes by what the policy did with them", labels=[*names, "outcome"]
        )
        for key, outcome in PUSH_OUTCOMES.items():
            outcomes.add_metric([*values, outcome], c.get(key, 0))
        yield outcomes
        yield _counter(
            "psgd_shard_received_bytes",
            "gradient bytes received in accepted pushes",
            names,
            values,
            c.get("bytes_in", 0),
        )
        yield _counter("psgd_shard_sent_bytes", "weight bytes sent in pulls", names, values, c.get("bytes_out", 0))
        yield _counter(
            "psgd_shard_data_requests",
            "pulls and pushes served on the data port",
            names,
            values,
            c.get("data_requests", 0),
        )
        yield _counter(
            "psgd_shard_data_request_cpu_seconds",
            "CPU seconds the data port's threads spent on requests, from a request's header in to its answer sent",
            names,
            values,
            c.get("data_cpu_seconds", 0.0),
        )
        yield _counter(
            "psgd_shard_receive_seconds",
            "seconds pushes took to be received (off the socket, or copied out of shared memory) and checked",
            names,
            values,
            c.get("receive_seconds", 0.0),
        )
        yield _counter(
            "psgd_shard_apply_seconds",
            "seconds updates took to be applied to the weights (their wait for reads included)",
            names,
            values,
            c.get("apply_seconds", 0.0),
        )
        yield _counter(
            "psgd_shard_expired_workers",
            "workers dropped for missing their lease or join deadline",
            names,
            values,
            c.get("expired", 0),
        )
        yield _counter(
            "psgd_shard_impostor_calls",
            "calls as a registered worker without its registration's key (refused)",
            names,
            values,
            c.get("impostors", 0),
        )
        yield _counter(
            "psgd_shard_rollbacks_refused",
            "rollbacks asked for a restart the shard could not prove at the job's own shards (refused)",
            names,
            values,
            c.get("rollbacks_refused", 0),
        )
        yield _counter(
            "psgd_shard_unreplicated_pushes",
            "pushes acknowledged without a copy on the shard's replica (replicas = 1: it did not follow then)",
            names,
            values,
            c.get("unreplicated", 0),
        )
        yield _counter(
            "psgd_shard_copied_updates",
            "updates made in the weights' other place because the current one was still being read",
            names,
            values,
            c.get("copied_updates", 0),
        )
        yield _counter(
            "psgd_shard_revoked_reads",
            "pulls whose memory an update took after they were read past their deadline (their worker pulled again)",
            names,
            values,
            c.get("revoked_reads", 0),
        )
        yield _gauge(
            "psgd_shard_oldest_read_seconds",
            "how long the oldest pull still being read has been (0: none)",
            names,
            values,
            max((r["held_seconds"] for r in s["reads"]), default=0.0),
        )

        states = {state: 0 for state in WORKER_STATES}
        clocks = GaugeMetricFamily(
            "psgd_shard_worker_clock", "each worker's clock as this shard knows it", labels=[*names, "worker"]
        )
        leases = GaugeMetricFamily(
            "psgd_shard_worker_lease_left_seconds",
            "seconds before a live worker is dropped unless it is heard from",
            labels=[*names, "worker"],
        )
        for w in s["workers"]:
            states[w["state"]] = states.get(w["state"], 0) + 1
            clocks.add_metric([*values, str(w["worker_id"])], w["clock"])
            if w["state"] == "live":
                leases.add_metric([*values, str(w["worker_id"])], max(0.0, w["lease_left_seconds"]))
        yield _gauge(
            "psgd_shard_live_workers", "workers registered and within their lease", names, values, states.get("live", 0)
        )
        by_state = GaugeMetricFamily("psgd_shard_workers", "workers by state", labels=[*names, "state"])
        for state, n in states.items():
            by_state.add_metric([*values, state], n)
        yield by_state
        yield clocks
        yield leases

        buckets, total = staleness_buckets(s["staleness_histogram"])
        hist = HistogramMetricFamily(
            "psgd_shard_staleness",
            "updates applied between the weights a gradient was "
            "computed on and its application (15 or more in the last bucket)",
            labels=names,
        )
        hist.add_metric(values, buckets, total)
        yield hist

        written = s.get("checkpoint") or {}
        if written.get("written_at"):  # absent until the first checkpoint
            yield _gauge(
                "psgd_shard_checkpoint_age_seconds",
                "seconds since the last checkpoint was written",
                names,
                values,
                max(0.0, time.time() - written["written_at"]),
            )
        if written.get("version") is not None:
            yield _gauge(
                "psgd_shard_checkpoint_version",
                "the version the last checkpoint holds",
                names,
                values,
                written["version"],
            )
        if "checkpoint_failures" in c:
            yield _counter(
                "psgd_shard_checkpoint_failures",
                "checkpoints that could not be written",
                names,
                values,
                c["checkpoint_failures"],
            )
        yield _counter(
            "psgd_shard_background_errors",
            "errors in a shard's background loops (checkpoints, leases), each of which goes on",
            names,
            values,
            c.get("background_errors", 0),
        )


class _NoMetrics:
    """What :meth:`ShardMetrics.from_args` / :meth:`WorkerMetrics.from_args` return without --metrics-port."""

    interceptors: tuple = ()
    endpoint = None

    def start(self) -> _NoMetrics:
        return self

    def stop(self) -> None:
        pass

    def on_step(self, point: dict) -> None:
        pass

    def took_rank(self, rank: int) -> None:
        pass

    def __enter__(self) -> _NoMetrics:
        return self

    def __exit__(self, *exc) -> None:
        pass


def _gauge(name: str, text: str, names: list[str], values: list[str], value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, text, labels=names)
    g.add_metric(values, value)
    return g


def _counter(name: str, text: str, names: list[str], values: list[str], value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, text, labels=names)
    c.add_metric(values, value)
    return c


# -- workers -------------------------------------------------------------------------------------
class WorkerMetrics:
    """Metrics of one worker, fed by ``run_worker(..., on_step=metrics.on_step)``."""

    def __init__(self, rank: int, registry: CollectorRegistry | None = None):
        self.rank = rank
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.endpoint: MetricsEndpoint | None = None
        self._bind: str | None = None
        self._lock = threading.Lock()
        self._last_wall: float | None = None
        self._info = Gauge("psgd_worker_info", "this worker's rank", ["rank"], registry=r)
        self._info.labels(str(rank)).set(1)
        self.steps = Counter("psgd_worker_steps", "steps computed and pushed", registry=r)
        self.pulls = Counter("psgd_worker_pulls", "pulls, one per shard per step", registry=r)
        self.pushes = Counter(
            "psgd_worker_pushes", "pushes, one per shard per step, by the shard's answer", ["outcome"], registry=r
        )
        self.bytes = Counter(
            "psgd_worker_bytes",
            "bytes of weights pulled plus gradients pushed (before any wire compression)",
            registry=r,
        )
        self.clock = Gauge("psgd_worker_clock", "steps this worker has pushed (its clock)", registry=r)
        self.version = Gauge("psgd_worker_version", "the newest shard version this worker pulled", registry=r)
        self.loss = Gauge("psgd_worker_loss", "training loss of the last batch", registry=r)
        self.accuracy = Gauge("psgd_worker_test_accuracy", "test accuracy at the last evaluation", registry=r)
        self.r2 = Gauge("psgd_worker_test_r2", "test R² at the last evaluation (values: regression)", registry=r)
        self.delay = Counter("psgd_worker_injected_delay_seconds", "seconds of injected slowdown (--delay)", registry=r)
        self.staleness = Histogram(
            "psgd_worker_staleness",
            "staleness of this worker's pushes as the shards report it (the largest over shards, per step)",
            buckets=STALENESS_BUCKETS,
            registry=r,
        )
        self.pull_seconds = Histogram(
            "psgd_worker_pull_seconds",
            "time per pull from all shards, the wait for the round (sync) or the slowest worker (ssp) included",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.push_seconds = Histogram(
            "psgd_worker_push_seconds", "time per push to all shards", buckets=LATENCY_BUCKETS, registry=r
        )
        self.step_seconds = Histogram(
            "psgd_worker_step_seconds", "wall time per step, pull to pull", buckets=LATENCY_BUCKETS, registry=r
        )

    def took_rank(self, rank: int) -> None:
        """A worker started with --rank auto was given ``rank`` (it said -1 until then)."""
        self._info.remove(str(self.rank))
        self.rank = rank
        self._info.labels(str(rank)).set(1)

    @classmethod
    def from_args(cls, args: argparse.Namespace, rank: int) -> WorkerMetrics:
        """Metrics for ``psgd-worker``: a no-op without ``--metrics-port``; use as a context manager."""
        bind = getattr(args, "metrics_port", None)
        if bind is None:
            return _NoMetrics()  # type: ignore[return-value]
        parse_bind(bind)
        metrics = cls(rank, process_registry())
        metrics._bind = bind
        return metrics

    def start(self) -> WorkerMetrics:
        if self._bind is not None and self.endpoint is None:
            self.endpoint = serve_metrics(self._bind, self.registry)
        return self

    def stop(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None

    def __enter__(self) -> WorkerMetrics:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def on_step(self, point: dict) -> None:
        """One step's record from ``run_worker``."""
        outcomes = point.get("outcomes") or []
        with self._lock:
            self.steps.inc()
            self.pulls.inc(len(outcomes))
            for outcome in outcomes:
                self.pushes.labels(outcome).inc()
            self.bytes.inc(point.get("bytes", 0))
            self.clock.set(point["clock"] + 1)
            self.version.set(point.get("version", 0))
            loss = point.get("loss")
            if loss is not None and math.isfinite(loss):
                self.loss.set(loss)
            if point.get("test_accuracy") is not None:
                self.accuracy.set(point["test_accuracy"])
            if point.get("test_r2") is not None:
                self.r2.set(point["test_r2"])
            self.delay.inc(point.get("delay", 0.0) or 0.0)
            self.staleness.observe(max(0, point.get("staleness", 0)))
            if "pull_seconds" in point:
                self.pull_seconds.observe(point["pull_seconds"])
            if "push_seconds" in point:
                self.push_seconds.observe(point["push_seconds"])
            wall = point.get("wall")
            if wall is not None:
                if self._last_wall is not None and wall >= self._last_wall:
                    self.step_seconds.observe(wall - self._last_wall)
                self._last_wall = wall
