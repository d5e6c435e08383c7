"""What a convergence lab produced, apart from how it ran: each run's result (:class:`RunResult`), the lab's
(:class:`LabResult`, read back from ``lab.json`` by :func:`load_result`), and the groups of repeated runs with
their medians, which the table, the figures and the answer in words all read."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from psgd.bench.lab import LabConfig
from psgd.bench.observe import LOSS_WINDOW


@dataclasses.dataclass
class RunResult:
    """One (scenario, contender) run: what ran, its evaluation points and their summary."""

    key: str  # "<scenario>/<contender spec>"
    scenario: str  # scenario slug
    delay: str  # the injected delay spec ('' for none), as passed to every worker
    policy: str  # the contender's spec (a policy, or allreduce)
    label: str  # the contender's label
    mode: str  # ps | allreduce
    job: dict  # the full job configuration of the run
    worker_args: list[str]
    points: list[dict]
    summary: dict
    error: str | None = None
    repeat: int = 0
    network: str = ""  # the emulated links it ran on ('' or LOOPBACK: this machine's loopback, no hosts)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class LabResult:
    config: LabConfig
    machine: str
    parameters: int  # model parameters
    model_bytes: int
    runs: list[RunResult]
    seconds: float
    files: dict[str, str]  # what was written: json, table, plots...
    load_average: dict  # the machine's 1/5/15-minute load averages before and after the lab
    gradient_seconds: float | None = None  # one minibatch gradient, computed alone in a fresh process
    links: dict = dataclasses.field(default_factory=dict)  # network -> its rate and measured throughput

    def to_dict(self) -> dict:
        return {
            "config": self.config.to_dict(),
            "machine": self.machine,
            "load_average": self.load_average,
            "parameters": self.parameters,
            "model_bytes": self.model_bytes,
            "seconds": round(self.seconds, 1),
            "gradient_seconds": self.gradient_seconds,
            "links": self.links,
            "axes": AXES,
            "runs": [r.to_dict() for r in self.runs],
        }


#: What every axis of the outputs means, recorded in lab.json.
AXES = {
    "wall": "seconds since the first worker (rank) entered its training loop (from the metrics JSONL)",
    "steps": "gradients computed by all workers together",
    "updates": "optimizer updates applied (ps: smallest shard version; allreduce: steps of rank 0)",
    "loss": f"mean training loss of the last {LOSS_WINDOW} minibatches before the point (all workers'; "
    "allreduce: rank 0's)",
    "test_loss": "loss on the test split (ps runs; allreduce only where rank 0 records it)",
    "staleness": "versions applied between a gradient's pull and its application, over all gradients so far",
    "bytes": "ps: bytes_in + bytes_out over all shards, the observer's pulls left out (measured); "
    "allreduce: steps x 2(N-1) x model bytes, the ring algorithm's volume (computed)",
}


def load_result(path: str | os.PathLike) -> LabResult:
    """A :class:`LabResult` read back from a ``lab.json`` (to redraw its table and plots)."""
    data = json.loads(Path(path).read_text())
    fields = {f.name for f in dataclasses.fields(RunResult)}
    runs = [RunResult(**{k: v for k, v in r.items() if k in fields}) for r in data["runs"]]
    known = {f.name for f in dataclasses.fields(LabConfig)}  # files from older versions may hold more
    return LabResult(
        LabConfig(**{k: v for k, v in data["config"].items() if k in known}),
        data["machine"],
        data["parameters"],
        data["model_bytes"],
        runs,
        data["seconds"],
        data.get("files", {}),
        data.get("load_average", {}),
        data.get("gradient_seconds"),
        data.get("links", {}),
    )


_MEDIAN_KEYS = (
    "final_accuracy",
    "train_seconds",
    "steps_per_s",
    "updates_per_s",
    "staleness_p50",
    "staleness_p99",
    "bytes",
    "step_seconds",
    "link_step_seconds",
)


def groups(result: LabResult) -> list[list[RunResult]]:
    """The runs of each (scenario, policy), in the order they were first run."""
    by_key: dict[str, list] = {}
    for run in result.runs:
        by_key.setdefault(run.key, []).append(run)
    return list(by_key.values())


def _lower_median(values: list) -> object:
    values = sorted(values)
    return values[(len(values) - 1) // 2]


def representative(runs: list[RunResult]) -> RunResult:
    """The run whose time to target is the (lower) median of its group: the one plotted."""
    ok = [r for r in runs if not r.error] or runs

    def rank(r: RunResult) -> tuple[float, float]:
        t = r.summary.get("time_to_target")
        return (float("inf") if t is None else t, -(r.summary.get("final_accuracy") or 0.0))

    ranked = sorted(ok, key=rank)
    return ranked[(len(ranked) - 1) // 2]


def median_summary(runs: list[RunResult]) -> dict:
    """Medians over the repeats, and in ``spread`` each figure's least and most over them (time to target: over the
    runs that reached it); a target counts as reached when the median run reached it."""
    ok = [r for r in runs if not r.error]
    rep = representative(runs)
    out = {"reached": sum(r.summary.get("time_to_target") is not None for r in ok), "runs": len(runs)}
    for key in ("time_to_target", "updates_to_target", "steps_to_target"):
        out[key] = rep.summary.get(key)
    out["spread"] = {}  # key -> (least, most) over the repeats that have it, where two or more do
    for key in ("time_to_target", *_MEDIAN_KEYS):
        values = [r.summary[key] for r in ok if r.summary.get(key) is not None]
        if key != "time_to_target":
            out[key] = _lower_median(values) if values else None
        if len(values) > 1:
            out["spread"][key] = (min(values), max(values))
    return out
