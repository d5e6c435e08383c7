"""A finished (or stopped) run, read back from its folder: ``psgd report RUN``.

A run folder (``psgd launch --run-dir``, or the one under ``runs/`` its last line names) holds each worker's metrics
lines (``worker-R.jsonl``; ``allreduce.jsonl`` for all-reduce), its job file and its logs.  :func:`summarise`
reads the lines into one :class:`Report`: per worker, the steps it took, its steps/s, the last test accuracy it
measured, the staleness of its updates, and where a step's time went (fetching weights, computing, the exchange);
:func:`draw` plots the training loss of every worker and the test accuracy against the steps done, as one PNG.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from psgd.data.base import SCORE_KEYS, SCORE_WORDS
from psgd.errors import InputError
from psgd.observe.progress import steps_done

#: the parts of a step the metrics lines time, in the order a step takes them
PARTS = ("weights", "compute", "exchange")


class ReportError(InputError):
    """The folder is not a run folder, or holds no metrics lines."""


@dataclasses.dataclass
class Worker:
    """One worker's (or rank's) run, from its metrics lines."""

    name: str
    steps: int = 0
    seconds: float = 0.0
    accuracy: float | None = None   # the last test score: accuracy, or R² where the targets are values
    score_words: str = "test accuracy"
    staleness: list[float] = dataclasses.field(default_factory=list)
    parts: dict[str, float] = dataclasses.field(default_factory=dict)  # median seconds of each part of a step
    losses: list[tuple[int, float]] = dataclasses.field(default_factory=list)   # (steps done, loss)
    evals: list[tuple[int, float]] = dataclasses.field(default_factory=list)    # (steps done, test score)
    finished: bool = False

    @property
    def rate(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass
class Report:
    folder: Path
    job: str
    workers: list[Worker]

    def lines(self) -> list[str]:
        """The summary as a user reads it: one line for the run, a few per worker."""
        out = [f"run {self.folder}: {self.job}"]
        for w in self.workers:
            said = [f"{w.steps} steps in {w.seconds:.1f}s ({w.rate:,.0f} steps/s)" if w.finished else
                    f"{w.steps} steps, stopped before its end"]
            if w.accuracy is not None:
                said.append(f"{w.score_words} {w.accuracy:.4f}")
            more = []
            if w.staleness:
                more.append(f"staleness median {statistics.median(w.staleness):g}, max {max(w.staleness):g}")
            if w.parts:
                total = sum(w.parts.values()) or 1.0
                more.append("a step: " + ", ".join(f"{p} {100 * s / total:.0f}%" for p, s in w.parts.items()))
            out.append(f"  {w.name}: " + "; ".join(said))
            out.extend(f"    {fact}" for fact in more)  # a line each, so that every line fits 80 columns
        return out


def summarise(folder: str | Path) -> Report:
    """The run in ``folder`` read back; :class:`ReportError` where it holds no metrics lines."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ReportError(f"{folder} is not a folder: give the run folder psgd launch printed (--run-dir)")
    files = sorted(folder.glob("worker-*.jsonl"), key=lambda p: int(p.stem.split("-")[1])) or \
        sorted(folder.glob("*.jsonl"))
    if not files:
        raise ReportError(f"{folder} holds no metrics lines (worker-R.jsonl): is it a psgd launch run folder?")
    return Report(folder, _job(folder / "job.toml"), [_worker(path) for path in files])


def _job(path: Path) -> str:
    """One line saying what the job was, from its job file."""
    from psgd.config import JobConfig

    if not path.exists():
        return "no job file"
    try:
        job = JobConfig.load(path)
    except InputError as exc:
        return f"its job file cannot be read ({exc})"
    c = job.cluster
    return f"{job.model['name']} on {job.data['name']}, {c.policy}, {c.workers} worker(s), {c.shards} shard(s)"


def _worker(path: Path) -> Worker:
    worker = Worker(path.stem)
    parts: dict[str, list[float]] = {p: [] for p in PARTS}
    for line in path.read_text().splitlines():
        try:
            rec: dict[str, Any] = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        event = rec.get("event")
        if event == "step":
            worker.steps += 1
            if rec.get("loss") is not None:
                worker.losses.append((steps_done(rec), rec["loss"]))
            if rec.get("staleness") is not None:
                worker.staleness.append(rec["staleness"])
            for part, seconds in (rec.get("seconds") or {}).items():
                parts.setdefault(part, []).append(seconds)
        elif event == "eval":
            score = _score(rec, worker)
            if score is not None:
                worker.evals.append((steps_done(rec), score))
                worker.accuracy = score
        elif event == "done":
            worker.finished, worker.seconds = True, rec.get("seconds") or 0.0
            worker.steps = rec.get("steps", worker.steps)
            score = _score(rec, worker)
            if score is not None:
                worker.accuracy = score
    worker.parts = {p: statistics.median(v) for p, v in parts.items() if v}
    return worker


def _score(record: dict, worker: Worker) -> float | None:
    """The test score a record holds (accuracy, or R² where the targets are values), naming it on ``worker``."""
    for metric, key in SCORE_KEYS.items():
        if record.get(key) is not None:
            worker.score_words = SCORE_WORDS[metric]
            return record[key]
    return None


def draw(report: Report, path: str | Path) -> Path:
    """The training loss of each worker and the test accuracy against the steps done, one PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss, accuracy) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for w in report.workers:
        if w.losses:
            loss.plot(*zip(*w.losses), lw=0.8, label=w.name)
        if w.evals:
            accuracy.plot(*zip(*w.evals), marker="o", ms=3, label=w.name)
    loss.set(xlabel="steps done", ylabel="training loss (each step's batch)", title="loss", yscale="log")
    words = report.workers[0].score_words if report.workers else "test accuracy"
    accuracy.set(xlabel="steps done", ylabel=words, title=words.removeprefix("test "))
    for ax in (loss, accuracy):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{report.folder.name}: {report.job}", fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
