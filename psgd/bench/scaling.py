"""How training speed scales with the model's width, the workers and the mode, run as a user runs it.

Every run is a real ``psgd train`` or ``psgd launch`` process started exactly
as a user would type it, in the caller's environment, untouched: no thread
variable is set for them, so whatever psgd does (or fails to do) about BLAS
threads on this machine is what gets measured.  The single exception is the
labelled peer column, the same 2-worker sync launch with
OPENBLAS_NUM_THREADS, OMP_NUM_THREADS and MKL_NUM_THREADS set to 1 in that
one process's environment; "as shipped / peer" should be at least 0.8 at
every width.  Beside it, the "no budget" column passes ``--threads`` with
this machine's core count to every process, which is what every psgd
process did before it had a thread budget: it shows what the budget prevents.

For the MLP on the bundled digits at hidden widths 64-4096 (one hidden layer)
and for the CNN, with SGD (lr 0.1) and batch 32 per worker:
  - one process (``psgd train``);
  - 1, 2 and 4 workers under ``--policy sync`` and ``--policy async`` (one
    parameter-server shard), and ``--mode allreduce`` (needs the mpi extra;
    recorded as skipped without it).

steps/s counts minibatch gradients computed per second, by all workers
together, taken from what the processes record, not from the wall time around
them (Python and gRPC start-up would dominate): ``psgd train --json`` (steps /
seconds of its training loop), the workers' ``worker-K.jsonl`` (steps
completed while every worker was stepping, over that window) and rank 0's
``allreduce.jsonl`` (its steps/s after the first step, times N).  Scaling
efficiency of N workers = aggregate steps/s / (N x one process's steps/s).

Written to ``--out``: ``table.md`` (steps/s, per-worker steps/s, efficiency,
the peer ratio and the BLAS threads the launcher reported), ``scaling.json``
(every run and figure, the machine, this process's thread pools) and
``scaling.png`` (steps/s against width, log-log, one line per configuration).

    psgd bench scaling          # everything, 264 runs: about 15 minutes on 2 cores (an estimate*)
    psgd bench scaling --quick  # widths 64 and 512, 1-2 workers, sync + peer + no budget + one process
    psgd bench scaling --widths 256,1024 --configs single,sync,peer --repeats 5

*Estimated from --quick (8 runs in 12 s, ~1.5 s a run, mostly start-up) and the
heaviest rows (width 4096 and the CNN, 4 workers: ~5 s a run) on a busy 2-core
machine; where BLAS threads fight (many cores, 20-35 steps/s) a run of 880
gradients takes up to a minute, and the whole far longer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Sequence

from threadpoolctl import threadpool_info

from psgd.threads import THREAD_VARIABLES, available_cores

DESCRIPTION = __doc__
WIDTHS = (64, 128, 256, 512, 1024, 2048, 4096)
WORKERS = (1, 2, 4)
CONFIGS = ("single", "sync", "async", "allreduce", "peer", "allcores", "cnn")
KINDS = ("single", "sync", "async", "allreduce")
DEFAULTS = {"widths": WIDTHS, "workers": WORKERS, "configs": CONFIGS, "epochs": 20, "repeats": 3}
QUICK = {"widths": (64, 512), "workers": (1, 2), "configs": ("single", "sync", "peer", "allcores"), "epochs": 1,
         "repeats": 1}
DEFAULT_TIMEOUT = 300.0
DEFAULT_OUT = "benchmarks/results/scaling"

#: The peer column's environment: one BLAS/OpenMP thread per process, set in that run's environment only.
PEER_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
PEER_LABEL = "2w sync, 1 BLAS thread (peer)"
#: The column that shows what the thread budget prevents: every process with a thread per core (--threads).
ALLCORES_LABEL = "2w sync, all cores each (no budget)"
RATIO_LABEL = "as shipped / peer"
PEER_TARGET = 0.8
#: Variables that set thread counts; those present in the caller's environment are recorded.
THREAD_VARS = THREAD_VARIABLES

#: Where each kind of run's figure comes from.
SOURCES = {
    "single": "psgd train --json: steps / seconds of its training loop (first step and per-epoch evaluation "
              "included)",
    "ps": "worker-K.jsonl (one line per step, 'wall' since the worker's start, 'time' on the shared clock): "
          "steps completed while every worker was stepping, over that window; the first step of each worker "
          "is left out (a fallback, when the workers barely overlapped: the sum over workers of "
          "(steps - 1) / (last wall - first wall))",
    "allreduce": "allreduce.jsonl (rank 0, one line per step): (steps - 1) / (last wall - first wall), times "
                 "N (every rank computes one gradient per step, in lockstep)",
}


class MeasureError(RuntimeError):
    """A run finished but left too little behind to measure."""


# -- what to run --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Run:
    """One configuration of one model: ``row`` is a hidden width ("64") or "cnn"."""

    row: str
    kind: str                # single | sync | async | allreduce
    workers: int = 1
    peer: bool = False       # PEER_ENV in its environment (the labelled peer column)
    all_cores: bool = False  # --threads <this machine's cores> on every process: no thread budget

    @property
    def column(self) -> str:
        return column_label(self.kind, self.workers, self.peer, self.all_cores)

    @property
    def label(self) -> str:
        return f"{row_label(self.row)} | {self.column}"

    def argv(self, epochs: int, run_dir: Path | None = None, timeout: float = DEFAULT_TIMEOUT) -> list[str]:
        """The ``psgd`` command line of this run, as a user would type it (without the leading ``psgd``)."""
        model = ["--model", "cnn"] if self.row == "cnn" else ["--set", f"model.hidden=[{self.row}]"]
        common = ["--optimizer", "sgd", "--lr", "0.1", "--epochs", str(epochs), *model, "--no-progress", "--json"]
        if self.kind == "single":
            return ["train", *common]
        mode = (["--mode", "allreduce"] if self.kind == "allreduce"
                else ["--mode", "ps", "--policy", self.kind, "--shards", "1"])
        threads = ["--threads", str(available_cores())] if self.all_cores else []
        return ["launch", *mode, "--workers", str(self.workers), *common, *threads, "--run-dir", str(run_dir),
                "--timeout", f"{timeout:g}"]


def column_label(kind: str, workers: int = 1, peer: bool = False, all_cores: bool = False) -> str:
    if peer:
        return PEER_LABEL
    if all_cores:
        return ALLCORES_LABEL
    if kind == "single":
        return "1 process"
    return f"{_kind_name(kind)} {workers}w"


def _kind_name(kind: str) -> str:
    return "all-reduce" if kind == "allreduce" else kind


def row_label(row: str) -> str:
    return "CNN" if row == "cnn" else f"MLP {row}"


@dataclasses.dataclass
class Settings:
    widths: list[int]
    workers: list[int]
    configs: list[str]
    epochs: int
    repeats: int
    timeout: float
    out: str
    quick: bool = False

    @property
    def rows(self) -> list[str]:
        return [str(w) for w in self.widths] + (["cnn"] if "cnn" in self.configs else [])

    def plan(self) -> list[Run]:
        """The runs of one repeat, row by row; the peer run comes right after its as-shipped twin."""
        runs = []
        peer, all_cores = "peer" in self.configs, "allcores" in self.configs
        for row in self.rows:
            if "single" in self.configs:
                runs.append(Run(row, "single"))
            for n in sorted(set(self.workers) | ({2} if peer or all_cores else set())):
                for kind in ("sync", "async", "allreduce"):
                    pair = (peer or all_cores) and kind == "sync" and n == 2  # their as-shipped twin always runs
                    if pair or (kind in self.configs and n in self.workers):
                        runs.append(Run(row, kind, n))
                    if pair and peer:
                        runs.append(Run(row, "sync", 2, peer=True))
                    if pair and all_cores:
                        runs.append(Run(row, "sync", 2, all_cores=True))
        return runs

    def columns(self) -> list[str]:
        """The table's columns, in a fixed order: one process, sync, async, all-reduce, peer."""
        runs = {(r.kind, r.workers, r.peer, r.all_cores) for r in self.plan()}
        order = sorted(runs, key=lambda k: (k[2] or k[3], k[3], KINDS.index(k[0]), k[1]))
        return [column_label(*k) for k in order]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _ints(flag: str, text: str, allow_empty: bool = False) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise _config_error(f"{flag}: expected whole numbers separated by commas, got {text!r}") from None
    if not values and not allow_empty:
        raise _config_error(f"{flag}: give at least one number")
    if any(v < 1 for v in values):
        raise _config_error(f"{flag}: every value must be at least 1, got {text!r}")
    return list(dict.fromkeys(values))


def _number(flag: str, text: str, kind=int, low: float = 1):
    try:
        value = kind(text)
    except ValueError:
        raise _config_error(f"{flag}: expected a {'whole ' if kind is int else ''}number, got {text!r}") from None
    if not value >= low:
        raise _config_error(f"{flag} must be at least {low:g}, got {text}")
    return value


def _config_error(message: str) -> Exception:
    from psgd.config import ConfigError

    return ConfigError(message)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The flags, checked (a bad one is a one-line :class:`ConfigError`); --quick fills what is not given."""
    base = QUICK if args.quick else DEFAULTS
    widths = _ints("--widths", args.widths, allow_empty=True) if args.widths is not None else list(base["widths"])
    workers = _ints("--workers", args.workers) if args.workers is not None else list(base["workers"])
    if args.configs is not None:
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
        unknown = [c for c in configs if c not in CONFIGS]
        if unknown:
            raise _config_error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    else:
        configs = list(base["configs"])
    if not set(configs) - {"cnn"}:
        raise _config_error(f"--configs: nothing to run; name at least one of {', '.join(CONFIGS[:-1])}")
    epochs = _number("--epochs", args.epochs) if args.epochs is not None else base["epochs"]
    repeats = _number("--repeats", args.repeats) if args.repeats is not None else base["repeats"]
    timeout = _number("--timeout", args.timeout, float, 1) if args.timeout is not None else DEFAULT_TIMEOUT
    settings = Settings(widths, workers, list(dict.fromkeys(configs)), epochs, repeats, timeout,
                        args.out or DEFAULT_OUT, args.quick)
    if not settings.rows:
        raise _config_error("nothing to run: give --widths, or add cnn to --configs")
    if not settings.plan():
        raise _config_error(f"--configs {args.configs} with --workers {args.workers}: nothing to run")
    return settings


# -- turning what the processes recorded into steps/s (pure functions, unit-tested) ---------------
def read_steps(path: str | os.PathLike) -> list[dict]:
    """The ``"event": "step"`` lines of a metrics JSONL file, in order."""
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r.get("event") == "step"]


def span_rate(walls: Sequence[float]) -> float:
    """Steps per second after the first step: (steps - 1) / (last wall - first wall)."""
    if len(walls) < 2 or walls[-1] <= walls[0]:
        raise MeasureError(f"{len(walls)} step(s) recorded over {(walls[-1] - walls[0]) if walls else 0:.4f}s: "
                           "too few to measure (raise --epochs)")
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
    out = {"workers": n, "steps": sum(len(r) for r in workers), "worker_steps_per_s": rates,
           "sum_of_rates": sum(rates), "window_s": max(end - start, 0.0), "window_steps": inside,
           "start_skew_s": max(c[0] for c in clocks) - min(c[0] for c in clocks)}
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
    return {"workers": workers, "steps": len(records) * workers, "per_worker_steps_per_s": per,
            "steps_per_s": per * workers, "method": "rank 0 x N",
            "seconds": records[-1]["wall"] - records[0]["wall"]}


def single_rates(summary: dict) -> dict:
    """``psgd train --json``: steps over the seconds of its training loop."""
    steps, seconds = summary.get("steps"), summary.get("seconds")
    if not steps or not seconds or seconds <= 0:
        raise MeasureError(f"psgd train reported steps={steps}, seconds={seconds}: too little to measure")
    return {"workers": 1, "steps": steps, "seconds": seconds, "steps_per_s": steps / seconds,
            "per_worker_steps_per_s": steps / seconds, "method": "train --json"}


def efficiency(aggregate: float | None, workers: int, single: float | None) -> float | None:
    """Scaling efficiency: aggregate steps/s / (N x one process's steps/s)."""
    if aggregate is None or not single:
        return None
    return aggregate / (workers * single)


_THREADS = re.compile(r"(\d+)\s+BLAS", re.IGNORECASE)
_LOG_PREFIX = re.compile(r"^\d\d:\d\d:\d\d \S+\[\d+\] [A-Z]+ ")  # psgd.logs: "21:35:19 launch[15901] INFO "
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


# -- running ------------------------------------------------------------------------------------
def allreduce_unavailable() -> str | None:
    """Why the all-reduce runs cannot happen here, or None."""
    import importlib.util

    from psgd.collective import BackendUnavailable
    from psgd.launch import find_mpiexec

    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'psgd[mpi]')"
    try:
        find_mpiexec()
    except BackendUnavailable as exc:
        return str(exc)
    return None


def execute(run: Run, epochs: int, timeout: float, run_dir: Path) -> dict:
    """Start the run as a user would, wait for it (within ``timeout``), and measure it; one JSON-able record."""
    argv = run.argv(epochs, run_dir, timeout)
    env = {**os.environ, **PEER_ENV} if run.peer else None  # None: this process's environment, as it is
    record = {"row": run.row, "column": run.column, "kind": run.kind, "workers": run.workers, "peer": run.peer,
              "all_cores": run.all_cores,
              "command": shlex.join(["psgd", *argv]), "env": dict(PEER_ENV) if run.peer else {}}
    limit = timeout + (60 if run.kind != "single" else 0)  # psgd launch stops itself at --timeout
    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "psgd.cli.main", *argv], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop(proc)
        out, err = proc.communicate()
    except BaseException:
        _stop(proc)
        raise
    record["process_seconds"] = round(time.perf_counter() - began, 3)
    record["returncode"] = proc.returncode
    record["threads_line"], record["blas_threads"] = thread_report(err + "\n" + out)
    if timed_out or proc.returncode:
        record["error"] = f"timed out after {limit:.0f}s" if timed_out else _error_line(err, proc.returncode)
        record["stderr_tail"] = err[-2000:]
        return record
    try:
        if run.kind == "single":
            record.update(single_rates(json.loads(out.strip().splitlines()[-1])))
        elif run.kind == "allreduce":
            record.update(allreduce_rates(read_steps(run_dir / "allreduce.jsonl"), run.workers))
        else:
            record.update(ps_rates([read_steps(run_dir / f"worker-{k}.jsonl") for k in range(run.workers)]))
        record["source"] = "ps" if run.kind in ("sync", "async") else run.kind
    except (MeasureError, OSError, ValueError, KeyError, IndexError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    return record


def _stop(proc: subprocess.Popen) -> None:
    """Stop the run's process group (the launcher and what it started), TERM then KILL."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _error_line(stderr: str, code: int) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    said = next((line for line in lines if line.startswith("psgd: error:")), lines[-1] if lines else "")
    return f"exit status {code}: {said[:300]}"


def _one_line(record: dict, repeat: int) -> str:
    head = f"{row_label(record['row'])} | {record['column']} #{repeat}"
    if record.get("error"):
        return f"{head}: FAILED: {record['error']}"
    threads = f"; {record['blas_threads']} BLAS thread(s) each" if record.get("blas_threads") else ""
    per = f" ({record['per_worker_steps_per_s']:,.0f}/worker)" if record["workers"] > 1 else ""
    return (f"{head}: {record['steps_per_s']:,.0f} steps/s{per} over {record['seconds']:.2f}s{threads} "
            f"[{record['process_seconds']:.1f}s in all]")


def run_benchmark(settings: Settings, *, progress: bool = True, keep_runs: str | None = None) -> dict:
    """Run every configuration ``settings.repeats`` times; write table.md, scaling.json, scaling.png.

    Repeats go round the whole list, so background load falls on every
    configuration alike.  Returns everything written to scaling.json.
    """
    from tqdm import tqdm

    from psgd.bench.convergence import machine
    from psgd.bench.report import require_matplotlib

    require_matplotlib("psgd bench scaling")
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    skipped = {}
    if "allreduce" in settings.configs and (why := allreduce_unavailable()):
        skipped["allreduce"] = why
    plan = [r for r in settings.plan() if r.kind not in skipped]
    todo = [(k, r) for k in range(settings.repeats) for r in plan]
    root = Path(keep_runs) if keep_runs else Path(tempfile.mkdtemp(prefix="psgd-scaling-"))
    began, load_before = time.perf_counter(), os.getloadavg()
    records: list[dict] = []
    try:
        with tqdm(total=len(todo), desc="scaling", unit="run", disable=not progress, file=sys.stderr,
                  dynamic_ncols=True) as bar:
            if progress:
                for kind, why in skipped.items():
                    bar.write(f"{_kind_name(kind)}: skipped: {why}", file=sys.stderr)
            for repeat, run in todo:
                bar.set_description(run.label + (f" #{repeat}" if settings.repeats > 1 else ""))
                variant = "-peer" if run.peer else "-allcores" if run.all_cores else ""
                folder = root / f"{run.row}-{run.kind}{run.workers}{variant}-{repeat}"
                shutil.rmtree(folder, ignore_errors=True)  # the metrics logs append
                record = execute(run, settings.epochs, settings.timeout, folder)
                record["repeat"] = repeat
                records.append(record)
                bar.update(1)
                if progress:
                    bar.write(_one_line(record, repeat), file=sys.stderr)
    finally:
        if not keep_runs:
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "benchmark": "psgd bench scaling",
        "settings": settings.to_dict(),
        "machine": machine(),
        "cores": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "threadpool_info": threadpool_info(),
        "thread_env": {k: os.environ[k] for k in THREAD_VARS if k in os.environ},
        "peer_env": PEER_ENV,
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in os.getloadavg()]},
        "seconds": round(time.perf_counter() - began, 1),
        "sources": SOURCES,
        "skipped": skipped,
        "table": tabulate(records, settings, skipped),
        "runs": records,
    }
    result["files"] = write_outputs(result, out)
    return result


# -- the figures ------------------------------------------------------------------------------
def tabulate(records: list[dict], settings: Settings, skipped: dict[str, str]) -> dict:
    """Medians over the repeats, per (row, column): aggregate and per-worker steps/s, efficiency, the peer
    ratio, the BLAS threads reported; a cell with no good run holds "failed" or "skipped"."""
    columns = settings.columns()
    table: dict[str, dict] = {"columns": columns, "rows": settings.rows, "steps_per_s": {},
                              "per_worker_steps_per_s": {}, "efficiency": {}, "peer_ratio": {},
                              "blas_threads": {}, "failures": {}}
    for row in settings.rows:
        mine = [r for r in records if r["row"] == row]
        agg, per, eff, threads, failures = {}, {}, {}, {}, {}
        for col in columns:
            runs = [r for r in mine if r["column"] == col]
            good = [r for r in runs if not r.get("error")]
            kind = next((r.kind for r in settings.plan() if r.column == col), "")
            if kind in skipped:
                agg[col] = per[col] = "skipped"
            elif not good:
                agg[col] = per[col] = "failed" if runs else None
                if runs:
                    failures[col] = runs[0]["error"]
            else:
                agg[col] = median(r["steps_per_s"] for r in good)
                per[col] = median(r["per_worker_steps_per_s"] for r in good)
            counts = sorted({r["blas_threads"] for r in runs if r.get("blas_threads")})
            threads[col] = counts
        single = agg.get("1 process")
        single = single if isinstance(single, float) else None
        for col in columns:
            if col in ("1 process",) or not isinstance(agg[col], float):
                continue
            n = int(re.search(r"(\d+)w", col).group(1))
            eff[col] = efficiency(agg[col], n, single)
        shipped, peer = agg.get("sync 2w"), agg.get(PEER_LABEL)
        ratio = shipped / peer if isinstance(shipped, float) and isinstance(peer, float) and peer > 0 else None
        table["steps_per_s"][row] = agg
        table["per_worker_steps_per_s"][row] = per
        table["efficiency"][row] = eff
        table["peer_ratio"][row] = ratio
        table["blas_threads"][row] = threads
        if failures:
            table["failures"][row] = failures
    return table


def _rate(value) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" + (f" (< {PEER_TARGET:g})" if value < PEER_TARGET else "")


def markdown(result: dict) -> str:
    """table.md: the four tables and the notes that say where each figure came from."""
    t, s = result["table"], result["settings"]
    columns, rows = t["columns"], t["rows"]
    peer = PEER_LABEL in columns
    scaled = [c for c in columns if c != "1 process"]

    def grid(title: str, cols: list[str], cell, extra: tuple[str, callable] | None = None) -> list[str]:
        head = ["model", *cols] + ([extra[0]] if extra else [])
        lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for row in rows:
            cells = [cell(row, c) for c in cols] + ([extra[1](row)] if extra else [])
            lines.append("| " + " | ".join([row_label(row), *cells]) + " |")
        return lines + [""]

    reps = f"median of {s['repeats']} runs" if s["repeats"] > 1 else "one run each"
    lines = grid(f"Aggregate steps/s (minibatch gradients per second, all workers together; {reps})", columns,
                 lambda row, c: _rate(t["steps_per_s"][row].get(c)),
                 (RATIO_LABEL, lambda row: _ratio(t["peer_ratio"][row])) if peer else None)
    lines += grid("Steps/s per worker (aggregate / N)", scaled,
                  lambda row, c: _rate(t["per_worker_steps_per_s"][row].get(c)))
    if "1 process" in columns:
        lines += grid("Scaling efficiency: aggregate steps/s / (N x one process's steps/s)", scaled,
                      lambda row, c: _eff(t, row, c))
    reported = any(v for row in rows for v in t["blas_threads"][row].values())
    if reported:
        lines += grid("BLAS/OpenMP threads per process, as the launcher's log said", columns,
                      lambda row, c: "-".join(str(x) for x in t["blas_threads"][row].get(c) or []) or "")
    return "\n".join(lines) + "\n" + notes(result, reported)


def _eff(t: dict, row: str, col: str) -> str:
    value = t["efficiency"][row].get(col)
    if value is None:
        cell = t["steps_per_s"][row].get(col)
        return cell if isinstance(cell, str) else "n/a" if cell is not None else ""
    return f"{value:.2f}"


def notes(result: dict, reported: bool) -> str:
    s, t = result["settings"], result["table"]
    kinds = {"1 process": "single", PEER_LABEL: "ps", ALLCORES_LABEL: "ps"}
    used = []
    for col in t["columns"]:
        kind = kinds.get(col) or ("allreduce" if col.startswith("all-reduce") else "ps")
        if kind not in used:
            used.append(kind)
    where = {"single": "1 process", "ps": "sync / async / peer / no budget", "allreduce": "all-reduce"}
    lines = [f"Sources: {'; '.join(f'*{where[k]}*: {SOURCES[k]}' for k in used)}.", ""]
    lines.append(f"Each run: `psgd train` or `psgd launch` (one shard for sync/async), SGD lr 0.1, batch 32 per "
                 f"worker, {s['epochs']} epoch(s) of the bundled digits (~{45 * s['epochs']} minibatch "
                 f"gradients in all, whatever N), started as a user would in this environment, unchanged. "
                 f"The peer column alone runs with {', '.join(f'{k}={v}' for k, v in PEER_ENV.items())} in its "
                 f"environment; {RATIO_LABEL} = sync 2w / peer, the goal >= {PEER_TARGET:g} at every width. "
                 f"The no-budget column passes --threads <cores> to every process: each uses a thread per core, "
                 f"as every psgd process did before the thread budget.")
    if result["thread_env"]:
        lines.append(f"Caution: this environment already sets "
                     f"{', '.join(f'{k}={v}' for k, v in result['thread_env'].items())}, so the as-shipped "
                     f"runs inherited it and are not what psgd does on its own.")
    if not reported:
        lines.append("No launcher printed a BLAS/OpenMP thread budget line.")
    for kind, why in result["skipped"].items():
        lines.append(f"{_kind_name(kind)}: skipped: {why}.")
    for row, failures in t["failures"].items():
        for col, error in failures.items():
            lines.append(f"{row_label(row)} | {col}: failed: {error}")
    load = result["load_average"]
    lines.append(f"Machine: {result['machine']}; load average (1/5/15 min) {load['before']} before, "
                 f"{load['after']} after; {len(result['runs'])} runs in {result['seconds']:.0f}s.")
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, out: Path) -> dict[str, str]:
    files = {"table": str(out / "table.md"), "json": str(out / "scaling.json"), "plot": str(out / "scaling.png")}
    Path(files["table"]).write_text(markdown(result))
    plot(result, Path(files["plot"]))
    Path(files["json"]).write_text(_json_text({**result, "files": {k: Path(v).name for k, v in files.items()}}))
    return files


def _json_text(data: dict) -> str:
    """Indented JSON, except that each run takes one line."""
    data = dict(data)
    runs = data.pop("runs")
    head = json.dumps(data, indent=1)[:-2]
    body = ",\n  ".join(json.dumps(r) for r in runs)
    return f'{head},\n "runs": [\n  {body}\n ]\n}}\n'


def plot(result: dict, path: Path) -> None:
    """steps/s against hidden width (log-log), one line per configuration; efficiency beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    t = result["table"]
    widths = [row for row in t["rows"] if row != "cnn"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.2))
    colors = plt.get_cmap("tab10")
    special = {PEER_LABEL: {"color": "black", "linestyle": "--"},  # the two references stand apart
               ALLCORES_LABEL: {"color": "black", "linestyle": ":", "marker": "x"}}
    plain = [c for c in t["columns"] if c not in special]
    for col in t["columns"]:
        style = {"marker": "o", "markersize": 4, "label": col, "linestyle": "-",
                 "color": colors(plain.index(col) % 10) if col in plain else None, **special.get(col, {})}
        xy = [(int(w), t["steps_per_s"][w].get(col)) for w in widths]
        xy = [(x, y) for x, y in xy if isinstance(y, float) and y > 0]
        if xy:
            left.plot(*zip(*xy), **style)
        xy = [(int(w), t["efficiency"][w].get(col)) for w in widths]
        xy = [(x, y) for x, y in xy if y is not None]
        if xy:
            right.plot(*zip(*xy), **style)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        if widths:
            ax.set_xticks([int(w) for w in widths], labels=widths)
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("MLP hidden width (log scale)")
        ax.grid(True, which="both", alpha=0.3)
    left.set_yscale("log")
    left.set_ylabel("aggregate steps/s (log scale)")
    right.set_ylabel("scaling efficiency: aggregate / (N x one process)")
    right.axhline(1.0, color="grey", linewidth=1)
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, max(1, len(labels))), fontsize=9, frameon=False)
    cnn = " (the CNN is in the table)" if "cnn" in t["rows"] else ""
    fig.suptitle(f"psgd bench scaling: MLP on digits, {result['settings']['epochs']} epoch(s) per run{cnn}; "
                 f"{result['machine']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


# -- command line ---------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (``psgd bench scaling``; ``benchmarks/scaling.py`` runs the same command)."""
    parser.add_argument("--widths", metavar="LIST",
                        help="MLP hidden widths, comma-separated (default " + ",".join(map(str, WIDTHS)) +
                             "; quick 64,512)")
    parser.add_argument("--workers", metavar="LIST",
                        help="worker (rank) counts for sync, async and all-reduce (default 1,2,4; quick 1,2)")
    parser.add_argument("--configs", metavar="LIST",
                        help="comma-separated, from " + ", ".join(CONFIGS) + ": single (psgd train), sync and "
                             "async (psgd launch --mode ps, 1 shard), allreduce (psgd launch --mode allreduce), "
                             "peer (2w sync with 1 BLAS thread, beside its as-shipped twin), allcores (2w sync "
                             "with a thread per core in every process, i.e. no thread budget), cnn (add the CNN "
                             "row) (default: all; quick single,sync,peer,allcores)")
    parser.add_argument("--epochs", metavar="N",
                        help="passes over the training data per run, ~45 gradients each whatever the workers "
                             f"(default {DEFAULTS['epochs']}; quick {QUICK['epochs']})")
    parser.add_argument("--repeats", metavar="N",
                        help="run everything N times, going round the whole list; the table shows medians "
                             f"(default {DEFAULTS['repeats']}; quick {QUICK['repeats']})")
    parser.add_argument("--timeout", metavar="SECONDS",
                        help=f"fail a run that takes longer (default {DEFAULT_TIMEOUT:g})")
    parser.add_argument("--out", metavar="DIR",
                        help=f"where table.md, scaling.json and scaling.png go (default {DEFAULT_OUT})")
    parser.add_argument("--quick", action="store_true",
                        help="widths 64 and 512, 1 and 2 workers, sync + peer + one process, 1 epoch, 1 repeat "
                             "(~15 s); flags given beside it win")
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE as JSON")
    parser.add_argument("--keep-runs", metavar="DIR", help="keep every run's logs and metrics under DIR")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run_from_args(args: argparse.Namespace) -> int:
    """Run what the flags ask for and print the table; 1 when a run failed."""
    settings = settings_from_args(args)
    result = run_benchmark(settings, progress=not args.no_progress, keep_runs=args.keep_runs)
    if args.json:
        Path(args.json).write_text(_json_text(result))
    print(Path(result["files"]["table"]).read_text())
    print(f"{len(result['runs'])} runs in {result['seconds']:.0f}s; wrote "
          f"{', '.join(sorted(result['files'].values()))}")
    return 1 if any(r.get("error") for r in result["runs"]) else 0
