"""Evaluation points of one run, on a common footing for every policy.

Parameter-server runs are watched by a :class:`ShardObserver`: while the
workers train it pulls the shards' weights as an observer (a pull that never
waits for a round) every ``interval`` seconds, evaluates them on the test
split and reads each shard's status (version, counters, staleness histogram).
All-reduce runs are read from rank 0's metrics: every few steps it evaluates
a copy of its weights on a thread beside its steps (``[train] eval_beside``),
so that, as with the observer, no rank waits for an evaluation (one that falls
due while the last is running is skipped).  Both are then put on one clock:

- ``wall``: seconds since the first worker (or rank) entered its training
  loop, read from the metrics JSONL (``time - wall`` of each first step line);
- ``steps``: gradients computed so far by all workers together;
- ``updates``: optimizer updates applied to the model (a sync round or an
  all-reduce step is one update averaging N gradients; async applies every
  gradient as its own update);
- ``loss``: mean training loss of the last ``LOSS_WINDOW`` minibatches before
  the point (all workers' minibatches; rank 0's in all-reduce runs), so every
  policy's curve has the same noise level;
- ``staleness_p50``/``staleness_p99``: of every gradient applied so far.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from psgd.config import JobConfig
from psgd.wire.tls import NO_TLS, TLSFiles

log = logging.getLogger(__name__)

#: Minibatch losses averaged into each point's training loss.
LOSS_WINDOW = 16


@dataclasses.dataclass
class Sample:
    """One look at the shards."""

    time: float  # unix time the observer's pull returned
    versions: list[int]  # per shard
    observer_pulls: int  # pulls the observer made so far, this one included
    bytes_moved: int  # bytes_in + bytes_out over all shards
    histogram: list[int]  # staleness histogram summed over the shards
    counters: dict[str, int]  # numeric counters summed over the shards
    test_loss: float
    test_accuracy: float


class Evaluator:
    """The job's model and test split, built once in this process."""

    def __init__(self, config: JobConfig):
        from psgd.job import build_job

        job = build_job(config)
        self.config, self.model, self.dataset, self.device, self.plan = (
            config,
            job.model,
            job.dataset,
            job.device,
            job.plan,
        )
        self.model_bytes = int(sum(np.prod(s.shape) * np.dtype(s.dtype).itemsize for s in self.plan.specs))
        self.parameters = int(sum(np.prod(s.shape) for s in self.plan.specs))

    def __call__(self, weights: dict) -> tuple[float, float]:
        """(test loss, test accuracy) of ``weights``."""
        from psgd.job import params_to_device
        from psgd.training.evaluation import evaluate

        params = params_to_device(weights, self.device)
        return evaluate(
            self.model, params, self.dataset.x_test, self.dataset.y_test, self.device, self.config.train.eval_batch_size
        )

    def gradient_seconds(self, tries: int = 5) -> float:
        """Median time of one minibatch gradient, computed alone in a fresh process (with the BLAS
        thread settings the runs inherit): the compute a step needs, nothing else."""
        from psgd.config import to_toml

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "job.toml"
            path.write_text(to_toml(self.config.to_dict()))
            out = subprocess.run(
                [sys.executable, "-c", _GRADIENT_TIMER, str(path), str(tries)],
                capture_output=True,
                text=True,
                timeout=300,
                check=True,
            ).stdout
        return float(out.split()[-1])

    def initial(self) -> tuple[float, float]:
        """(test loss, test accuracy) of the initial weights every run starts from."""
        return self(self.model.init(self.config.train.seed))


_GRADIENT_TIMER = """
import sys
from psgd.config import JobConfig
from psgd.job import build_job
from psgd.training.loop import gradient_seconds
config = JobConfig.load(sys.argv[1])
job = build_job(config)
b = config.train.batch_size
print(gradient_seconds(job.model, job.model.init(config.train.seed), job.dataset.x_train[:b],
                       job.dataset.y_train[:b], int(sys.argv[2])))
"""


class ShardObserver:
    """``launch``'s monitor: samples the shards every ``interval`` seconds until the workers finish."""

    def __init__(self, evaluator: Evaluator, interval: float, on_sample: Callable[[Sample], None] | None = None):
        self.evaluator, self.interval, self.on_sample = evaluator, interval, on_sample
        self.samples: list[Sample] = []
        self.error: str | None = None
        self._pulls = 0

    def __call__(self, addresses: list[str], stop: threading.Event, token: str = "", tls: TLSFiles = NO_TLS) -> None:
        from psgd.wire.protocol import OBSERVER
        from psgd.worker.client import PSClient

        ev = self.evaluator
        host = {s.name: np.empty(s.shape, dtype=s.dtype) for s in ev.plan.specs}
        try:
            with PSClient(
                addresses, ev.plan, OBSERVER, deadlines=ev.config.cluster.deadlines, token=token, tls=tls
            ) as client:
                next_at = time.monotonic()
                while True:
                    finished = stop.is_set()  # one last sample after the workers are done: the final weights
                    self._sample(client, host)
                    if finished:
                        return
                    next_at += self.interval
                    stop.wait(max(0.0, next_at - time.monotonic()))
        except Exception as exc:  # recorded with the run; the run itself carries on
            self.error = f"observer failed: {exc}"
            log.warning("%s", self.error)

    def _sample(self, client, host: dict) -> None:
        versions = [int(v) for v in client.pull(0, host)]
        now = time.time()
        self._pulls += 1
        statuses = client.status()
        counters: dict[str, int] = {}
        histogram: list[int] = []
        for status in statuses:
            for key, value in json.loads(status.counters_json).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    counters[key] = counters.get(key, 0) + value
            hist = list(status.staleness_histogram)
            histogram = [a + b for a, b in zip(histogram, hist)] if histogram else hist
        loss, acc = self.evaluator(host)
        sample = Sample(
            now,
            versions,
            self._pulls,
            int(counters.get("bytes_in", 0) + counters.get("bytes_out", 0)),
            histogram,
            counters,
            float(loss),
            float(acc),
        )
        self.samples.append(sample)
        if self.on_sample:
            self.on_sample(sample)


# -- the metrics JSONL ------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    """Every JSON line of ``path`` (a missing file reads as none)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_lines(paths: Iterable[Path]) -> list[dict]:
    """The ``step`` events of every file, oldest first."""
    steps = [rec for path in paths for rec in read_jsonl(path) if rec.get("event") == "step"]
    return sorted(steps, key=lambda rec: rec["time"])


def origin(steps: Sequence[dict]) -> float:
    """When the first worker entered its training loop: min over step lines of ``time - wall``."""
    if not steps:
        raise ValueError("no step was recorded")
    return min(rec["time"] - rec["wall"] for rec in steps)


def percentile(histogram: Sequence[int], q: float) -> int | None:
    """The q-quantile (0..1) of a histogram whose entry i counts value i; None when empty."""
    total = sum(histogram)
    if not total:
        return None
    cumulative = np.cumsum(histogram)
    return int(np.searchsorted(cumulative, q * total - 1e-9))


def _window_loss(steps: Sequence[dict], upto: int) -> float | None:
    """Mean loss of the last LOSS_WINDOW step lines before index ``upto``."""
    losses = [s["loss"] for s in steps[max(0, upto - LOSS_WINDOW) : upto] if s.get("loss") is not None]
    return float(np.mean(losses)) if losses else None


def _point(
    wall: float,
    steps: int,
    updates: int,
    loss: float | None,
    test_loss: float | None,
    acc: float,
    p50: int | None,
    p99: int | None,
    nbytes: int,
) -> dict:
    def clean(v: float | None) -> float | None:
        return None if v is None or not math.isfinite(v) else round(float(v), 5)

    return {
        "wall": round(max(wall, 0.0), 4),
        "steps": steps,
        "updates": updates,
        "loss": clean(loss),
        "test_loss": clean(test_loss),
        "test_accuracy": clean(acc),
        "staleness_p50": p50,
        "staleness_p99": p99,
        "bytes": nbytes,
    }


def initial_point(evaluator: Evaluator) -> dict:
    loss, acc = evaluator.initial()
    return _point(0.0, 0, 0, None, loss, acc, None, None, 0)


def ps_points(
    samples: Sequence[Sample], steps: Sequence[dict], start: float, model_bytes: int, first: dict
) -> list[dict]:
    """Evaluation points of a parameter-server run: ``first`` (the initial weights), then every sample
    taken after ``start``.  Bytes leave out the observer's own pulls (one model each)."""
    points, done = [first], 0
    for s in samples:
        if s.time < start:
            continue
        while done < len(steps) and steps[done]["time"] <= s.time:
            done += 1
        points.append(
            _point(
                s.time - start,
                done,
                min(s.versions),
                _window_loss(steps, done),
                s.test_loss,
                s.test_accuracy,
                percentile(s.histogram, 0.5),
                percentile(s.histogram, 0.99),
                s.bytes_moved - s.observer_pulls * model_bytes,
            )
        )
    return points


def allreduce_points(
    steps: Sequence[dict], evals: Sequence[dict], workers: int, model_bytes: int, first: dict
) -> list[dict]:
    """Evaluation points of an all-reduce run from rank 0's ``eval`` lines (``step``: steps done), the
    loss from its ``step`` lines before each.

    Bytes are computed, not measured: a ring all-reduce moves 2(N-1)/N of the
    model per rank per step, 2(N-1) models in all."""
    start = origin(steps)
    clocks = [int(rec["clock"]) for rec in steps]
    points = [first]
    for rec in evals:
        step = int(rec["step"])
        before = sum(1 for c in clocks if c < step)
        points.append(
            _point(
                rec["time"] - start,
                step * workers,
                step,
                _window_loss(steps, before),
                rec.get("test_loss"),
                rec["test_accuracy"],
                0,
                0,
                step * 2 * (workers - 1) * model_bytes,
            )
        )
    return points


def start_skew(steps: Sequence[dict], key: str = "role") -> float:
    """Seconds between the first and the last worker entering their training loops."""
    starts: dict[str, float] = {}
    for rec in steps:
        starts[rec[key]] = min(starts.get(rec[key], float("inf")), rec["time"] - rec["wall"])
    return max(starts.values()) - min(starts.values()) if starts else 0.0
