"""Turning what the processes recorded into steps/s (pure functions, unit-tested): the step records of
``psgd train --json``, the workers' and all-reduce rank 0's metrics, efficiency, the launcher's thread line."""

from __future__ import annotations

import json
import os
import re
import statistics
from collections.abc import Iterable, Sequence

from psgd.errors import ClusterError

#: Where each kind of run's figure comes from.
SOURCES = {
    "single": "psgd train --json: steps / seconds of its training loop (first step and per-epoch evaluation included)",
    "ps": "worker-K.jsonl (one line per step, 'wall' since the worker's start, 'time' on the shared clock): "
    "steps completed while every worker was stepping, over that window; the first step of each worker "
    "is left out (a fallback, when the workers barely overlapped: the sum over workers of "
    "(steps - 1) / (last wall - first wall))",
    "allreduce": "allreduce.jsonl (rank 0, one line per step): (steps - 1) / (last wall - first wall), times "
    "N (every rank computes one gradient per step, in lockstep)",
}


class MeasureError(ClusterError):
    """A run finished but left too little behind to measure."""


def read_steps(path: str | os.PathLike) -> list[dict]:
    """The ``"event": "step"`` lines of a metrics JSONL file, in order."""
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r.get("event") == "step"]


def span_rate(walls: Sequence[float]) -> float:
    """Steps per second after the first step: (steps - 1) / (last wall - first wall)."""
    if len(walls) < 2 or walls[-1] <= walls[0]:
        raise MeasureError(
            f"{len(walls)} step(s) recorded over {(walls[-1] - walls[0]) if walls else 0:.4f}s: "
            "too few to measure (raise --epochs)"
        )
    return (len(walls) - 1) / (walls[-1] - walls[0])


def shared_clock(records: Sequence[dict]) -> list[float]:
    """Each step's completion on the shared clock: the worker's ``wall`` (perf_counter since its start) plus
    its start on the wall clock, the median of ``time - wall`` (``time`` is rounded to the millisecond)."""
    start = statistics.median(r["time"] - r["wall"] for r in records)
    return [start + r["wall"] for r in records]


def ps_rates(workers: Sequence[Sequence[dict]], min_overlap: float = 0.5) -> dict:
    """Aggregate and per-worker steps/s of a parameter-server run from each worker's step records.

    The window runs from the moment the last worker completed its first step
    to the moment the first worker completed its last one: every worker was
    stepping throughout.  Aggregate = steps completed inside it (by all
    workers) / its length.  When the window covers less than ``min_overlap``
    of the median worker's own stepping time (workers that barely overlapped),
    the aggregate is the sum over workers of (steps - 1) / (last wall - first wall).
    """
    if not workers:
        raise MeasureError("no worker recorded anything")
    for k, records in enumerate(workers):
        if len(records) < 2:
            raise MeasureError(f"worker {k} recorded {len(records)} step(s): too few to measure (raise --epochs)")
    n = len(workers)
    rates = [span_rate([r["wall"] for r in records]) for records in workers]
    clocks = [shared_clock(records) for records in workers]
    start, end = max(c[0] for c in clocks), min(c[-1] for c in clocks)
    inside = sum(1 for c in clocks for t in c if start < t <= end)
    spans = [r[-1]["wall"] - r[0]["wall"] for r in workers]
    out = {
        "workers": n,
        "steps": sum(len(r) for r in workers),
        "worker_steps_per_s": rates,
        "sum_of_rates": sum(rates),
        "window_s": max(end - start, 0.0),
        "window_steps": inside,
        "start_skew_s": max(c[0] for c in clocks) - min(c[0] for c in clocks),
    }
    if end > start and inside >= 2 and end - start >= min_overlap * statistics.median(spans):
        out.update(steps_per_s=inside / (end - start), method="window")
    else:
        out.update(steps_per_s=sum(rates), method="sum of per-worker rates")
    out["per_worker_steps_per_s"] = out["steps_per_s"] / n
    out["seconds"] = out["window_s"] if out["method"] == "window" else max(spans)
    return out


def allreduce_rates(records: Sequence[dict], workers: int) -> dict:
    """All-reduce: rank 0's steps/s after its first step; every rank computes one gradient per step."""
    per = span_rate([r["wall"] for r in records])
    return {
        "workers": workers,
        "steps": len(records) * workers,
        "per_worker_steps_per_s": per,
        "steps_per_s": per * workers,
        "method": "rank 0 x N",
        "seconds": records[-1]["wall"] - records[0]["wall"],
    }


def single_rates(summary: dict) -> dict:
    """``psgd train --json``: steps over the seconds of its training loop."""
    steps, seconds = summary.get("steps"), summary.get("seconds")
    if not steps or not seconds or seconds <= 0:
        raise MeasureError(f"psgd train reported steps={steps}, seconds={seconds}: too little to measure")
    return {
        "workers": 1,
        "steps": steps,
        "seconds": seconds,
        "steps_per_s": steps / seconds,
        "per_worker_steps_per_s": steps / seconds,
        "method": "train --json",
    }


def efficiency(aggregate: float | None, workers: int, single: float | None) -> float | None:
    """Scaling efficiency: aggregate steps/s / (N x one process's steps/s)."""
    if aggregate is None or not single:
        return None
    return aggregate / (workers * single)


_THREADS = re.compile(r"(\d+)\s+BLAS", re.IGNORECASE)
_LOG_PREFIX = re.compile(r"^\d\d:\d\d:\d\d \S+\[\d+\] [A-Z]+ ")  # psgd.observe.logs: "21:35:19 launch[15901] INFO "
_THREAD_VARIABLE = re.compile(r"_(?:NUM|MAXIMUM)_THREADS=(\d+)")


def thread_report(text: str) -> tuple[str, int | None]:
    """The launcher's thread-budget line (e.g. "3 process(es) on 16 core(s): 5 BLAS/OpenMP thread(s) each",
    or "...: BLAS/OpenMP threads as OMP_NUM_THREADS=1 says") and the per-process thread count it gives;
    ("", None) when the processes printed no such line."""
    for line in text.splitlines():
        if "BLAS" in line and "thread" in line.lower():
            line = _LOG_PREFIX.sub("", line.strip())
            found = _THREADS.search(line) or _THREAD_VARIABLE.search(line)
            return line, int(found.group(1)) if found else None
    return "", None


def median(values: Iterable[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None
