"""A finished (or stopped) run, read back from its folder: ``psgd report RUN``.

A run folder (``psgd launch --run-dir``, or the one under ``runs/`` its last line names) holds each worker's metrics
lines (``worker-R.jsonl``; ``allreduce.jsonl`` for all-reduce), its job file and its logs.  :func:`summarise`
reads the lines into one :class:`Report`: per worker, the steps it took, its steps/s, the last test accuracy it
measured, the staleness of its updates, and where a step's time went (fetching weights, computing, the exchange).
A run stopped and resumed (``--resume``) appends each part's lines to the same files: each part ends with a
``done`` line, or, killed, where the next part's clock starts again; the steps and the seconds are those of every
part, summed.  :func:`draw` plots the training loss of every worker and the test accuracy against the steps done,
as one PNG.

The folder may have been written by someone else, so nothing in it is trusted: only regular files are read (a FIFO
would wait for ever, a device such as /dev/zero never ends), a line longer than :data:`LONGEST_LINE` is read through
in pieces and skipped, a line that is not a metrics record is skipped, both counted; the PNG is written to a new
file beside it and renamed into place, never through a symbolic link.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from psgd.config import JobConfig
from psgd.data.base import SCORE_KEYS, SCORE_WORDS
from psgd.errors import InputError
from psgd.observe.files import open_regular, replace_whole
from psgd.observe.progress import steps_done

#: the parts of a step the metrics lines time, in the order a step takes them
PARTS = ("weights", "compute", "exchange")
#: the longest metrics line read (a step's line is a few hundred bytes): a longer one is skipped, never read whole
LONGEST_LINE = 1 << 20
#: what a record's numbers and counts may be (a bool is an int to Python, never to a metrics line)
_NUMBERS, _COUNTS = ("loss", "staleness", "wall", *SCORE_KEYS.values()), ("clock", "step", "steps")
_WORKER_FILE = re.compile(r"worker-(\d+)\.jsonl")


class ReportError(InputError):
    """The folder is not a run folder, or holds no metrics lines."""


@dataclasses.dataclass
class Worker:
    """One worker's (or rank's) run, from its metrics lines."""

    name: str
    steps: int = 0  # over every part of the run (a resumed run's before its stop included)
    seconds: float = 0.0  # the training time of every part, summed
    runs: int = 0  # the parts: more than one where the run was stopped and resumed
    accuracy: float | None = None  # the last test score: accuracy, or R² where the targets are values
    score_words: str = "test accuracy"
    staleness: list[float] = dataclasses.field(default_factory=list)
    parts: dict[str, float] = dataclasses.field(default_factory=dict)  # median seconds of each part of a step
    losses: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (steps done, loss)
    evals: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (steps done, test score)
    finished: bool = False  # its last part ended with a done line
    malformed: int = 0  # lines skipped: not a metrics record
    too_long: int = 0  # lines skipped: longer than LONGEST_LINE

    @property
    def rate(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    def said(self) -> str:
        """Its steps and their rate, in words."""
        if not self.finished:
            return f"{self.steps} steps, stopped before its end"
        if not self.steps:
            return "no steps"
        over = f" over {self.runs} parts" if self.runs > 1 else ""
        return f"{self.steps} steps in {self.seconds:.1f}s{over} ({self.rate:,.0f} steps/s)"


@dataclasses.dataclass
class Report:
    folder: Path
    job: str
    workers: list[Worker]

    def lines(self) -> list[str]:
        """The summary as a user reads it: one line for the run, a few per worker."""
        out = [f"run {self.folder}: {self.job}"]
        for w in self.workers:
            said = [w.said()]
            if w.accuracy is not None:
                said.append(f"{w.score_words} {w.accuracy:.4f}")
            more = []
            if w.staleness:
                more.append(f"staleness median {statistics.median(w.staleness):g}, max {max(w.staleness):g}")
            if w.parts:
                total = sum(w.parts.values()) or 1.0
                more.append("a step: " + ", ".join(f"{p} {100 * s / total:.0f}%" for p, s in w.parts.items()))
            skipped = [
                f"{n} {what}"
                for n, what in ((w.malformed, "malformed line(s)"), (w.too_long, "line(s) longer than 1 MiB"))
                if n
            ]
            if skipped:
                more.append("skipped: " + ", ".join(skipped))
            out.append(f"  {w.name}: " + "; ".join(said))
            out.extend(f"    {fact}" for fact in more)  # a line each, so that every line fits 80 columns
        return out


def summarise(folder: str | Path) -> Report:
    """The run in ``folder`` read back; :class:`ReportError` where it holds no metrics lines."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ReportError(f"{folder} is not a folder: give the run folder psgd launch printed (--run-dir)")
    ranks = {path: _WORKER_FILE.fullmatch(path.name) for path in folder.glob("worker-*.jsonl")}
    files = sorted((p for p, m in ranks.items() if m), key=lambda p: int(ranks[p][1])) or sorted(folder.glob("*.jsonl"))
    if not files:
        raise ReportError(f"{folder} holds no metrics lines (worker-R.jsonl): is it a psgd launch run folder?")
    return Report(folder, _job(folder / "job.toml"), [_worker(path) for path in files])


def _job(path: Path) -> str:
    """One line saying what the job was, from its job file."""
    if not os.path.lexists(path):
        return "no job file"
    _regular(path).close()
    try:
        job = JobConfig.load(path)
    except InputError as exc:
        return f"its job file cannot be read ({exc})"
    c = job.cluster
    return f"{job.model['name']} on {job.data['name']}, {c.policy}, {c.workers} worker(s), {c.shards} shard(s)"


def _worker(path: Path) -> Worker:
    worker = Worker(path.stem)
    parts: dict[str, list[float]] = {p: [] for p in PARTS}
    run = _Part()
    with _regular(path) as f:
        for rec in _records(f, worker):
            _add(worker, rec, parts, run)
    if run.steps:  # the last part has no done line: it was killed before its end
        _ended(worker, run, None)
    worker.parts = {p: statistics.median(v) for p, v in parts.items() if v}
    return worker


@dataclasses.dataclass
class _Part:
    """The part of a run being read: a run stopped and resumed appends each part's lines to the same file."""

    steps: int = 0  # its step lines so far
    wall: float = 0.0  # the seconds into the part of its last step


def _ended(worker: Worker, part: _Part, done: dict[str, Any] | None) -> None:
    """``part`` ended, with its ``done`` line (None: killed before it wrote one); its steps and seconds added to
    ``worker``'s: the done line's, else its step lines and the time of its last one."""
    worker.steps += done.get("steps", part.steps) if done else part.steps
    worker.seconds += (done.get("seconds") or 0.0) if done else part.wall
    worker.runs += 1
    worker.finished = done is not None
    part.steps, part.wall = 0, 0.0


def _regular(path: Path) -> BinaryIO:
    """``path`` opened for reading; :class:`ReportError` unless it is a regular file (psgd.observe.files)."""
    try:
        return open_regular(path)
    except InputError as exc:
        raise ReportError(str(exc)) from None


def _records(f: BinaryIO, worker: Worker) -> Iterator[dict[str, Any]]:
    """The metrics records of ``f``, each line read up to LONGEST_LINE; what is skipped is counted on ``worker``."""
    while line := f.readline(LONGEST_LINE + 1):
        if len(line) > LONGEST_LINE and not line.endswith(b"\n"):
            while (rest := f.readline(LONGEST_LINE)) and not rest.endswith(b"\n"):
                pass  # read through, a piece at a time
            worker.too_long += 1
            continue
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut short by a crash, or no JSON (nor UTF-8) at all
            rec = None
        if line.strip() and not _is_record(rec):
            worker.malformed += 1
        elif line.strip():
            yield rec


def _is_record(rec: Any) -> bool:
    """Whether ``rec`` is a metrics record whose numbers are numbers: what :func:`_add` reads without a doubt."""

    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if not isinstance(rec, dict) or not isinstance(rec.get("event"), str):
        return False
    if not all(rec.get(k) is None or number(rec[k]) for k in _NUMBERS) or not all(
        rec.get(k) is None or number(rec[k]) and isinstance(rec[k], int) for k in _COUNTS
    ):
        return False
    seconds = rec.get("seconds")
    if rec["event"] == "step":
        return seconds is None or isinstance(seconds, dict) and all(number(v) for v in seconds.values())
    return seconds is None or number(seconds)


def _add(worker: Worker, rec: dict[str, Any], parts: dict[str, list[float]], part: _Part) -> None:
    """One record's facts, added to ``worker``'s (``part``: the part of the run being read)."""
    event = rec.get("event")
    if event == "step":
        wall = rec.get("wall")
        if wall is not None and wall < part.wall:  # the clock started again: a part that was killed, then resumed
            _ended(worker, part, None)
        part.steps += 1
        part.wall = part.wall if wall is None else wall
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
        _ended(worker, part, rec)
        score = _score(rec, worker)
        if score is not None:
            worker.accuracy = score


def _score(record: dict, worker: Worker) -> float | None:
    """The test score a record holds (accuracy, or R² where the targets are values), naming it on ``worker``."""
    for metric, key in SCORE_KEYS.items():
        if record.get(key) is not None:
            worker.score_words = SCORE_WORDS[metric]
            return record[key]
    return None


def draw(report: Report, path: str | Path) -> Path:
    """The training loss of each worker and the test accuracy against the steps done, one PNG at ``path``."""
    path = Path(path)
    if path.is_symlink():
        raise ReportError(
            f"{path} is a symbolic link: a report is not written through one (remove it, or give --png FILE)"
        )
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
    try:
        _replace(path, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)
    return path


def _replace(path: Path, write) -> None:
    """``path`` replaced whole by what ``write`` writes (psgd.observe.files.replace_whole: a link planted there,
    before the check or after it, is replaced, its target never written)."""
    try:
        replace_whole(path, write)
    except OSError as exc:
        raise ReportError(f"cannot write {path}: {exc.strerror or exc}") from None
