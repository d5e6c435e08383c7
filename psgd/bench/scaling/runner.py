"""Running the benchmark: each :class:`Run` started as a user would (``python -m psgd.cli.main ...``),
stopped within its timeout and measured; :func:`run_benchmark` goes round every run and writes the report."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from threadpoolctl import threadpool_info

from psgd.bench.scaling.grid import PEER_ENV, THREAD_VARS, Run, Settings, kind_name, row_label
from psgd.bench.scaling.measure import (
    SOURCES,
    MeasureError,
    allreduce_rates,
    ps_rates,
    read_steps,
    single_rates,
    thread_report,
)
from psgd.bench.scaling.report import tabulate, write_outputs


def allreduce_unavailable() -> str | None:
    """Why the all-reduce runs cannot happen here, or None."""
    import importlib.util

    from psgd.collective import BackendUnavailable
    from psgd.launcher import find_mpiexec

    if importlib.util.find_spec("mpi4py") is None:
        from psgd.errors import install_extra

        return f"mpi4py is not installed (in psgd's folder: {install_extra('mpi')})"
    try:
        find_mpiexec()
    except BackendUnavailable as exc:
        return str(exc)
    return None


def execute(run: Run, epochs: int, timeout: float, run_dir: Path, network=None) -> dict:
    """Start the run as a user would, wait for it (within ``timeout``), and measure it; one JSON-able record.
    With ``network`` (:class:`psgd.bench.hosted.Network`) a launch runs with its processes on its hosts."""
    argv = run.argv(epochs, run_dir, timeout)
    env = {**os.environ, **PEER_ENV} if run.peer else None  # None: this process's environment, as it is
    record = {
        "row": run.row,
        "column": run.column,
        "kind": run.kind,
        "workers": run.workers,
        "peer": run.peer,
        "all_cores": run.all_cores,
        "command": shlex.join(["psgd", *argv]),
        "env": dict(PEER_ENV) if run.peer else {},
    }
    limit = timeout + (60 if run.kind != "single" else 0)  # psgd launch stops itself at --timeout
    began = time.perf_counter()
    command = [sys.executable, "-m", "psgd.cli.main", *argv]
    if network is not None and run.kind != "single":
        from psgd.bench.hosted import launch_argv

        command = launch_argv(network, run_dir, argv)
        record["network"] = network.name
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        stop(proc)
        out, err = proc.communicate()
    except BaseException:
        stop(proc)
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
        record["source"] = "ps" if run.kind in ("sync", "async", "ssp") else run.kind
    except (MeasureError, OSError, ValueError, KeyError, IndexError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    return record


def _run_all(
    todo: list, settings: Settings, root: Path, records: list[dict], progress: bool, skipped: dict, network
) -> None:
    """Each (repeat, run) in turn, its record appended to ``records``, one line each as it comes."""
    from tqdm import tqdm

    with tqdm(
        total=len(todo), desc="scaling", unit="run", disable=not progress, file=sys.stderr, dynamic_ncols=True
    ) as bar:
        if progress:
            for kind, why in skipped.items():
                bar.write(f"{kind_name(kind)}: skipped: {why}", file=sys.stderr)
        for repeat, run in todo:
            bar.set_description(run.label + (f" #{repeat}" if settings.repeats > 1 else ""))
            variant = "-peer" if run.peer else "-allcores" if run.all_cores else ""
            folder = root / f"{run.row}-{run.kind}{run.workers}{variant}-{repeat}"
            shutil.rmtree(folder, ignore_errors=True)  # the metrics logs append
            record = execute(run, settings.epochs, settings.timeout, folder, network)
            record["repeat"] = repeat
            records.append(record)
            bar.update(1)
            if progress:
                bar.write(_one_line(record, repeat), file=sys.stderr)


def stop(proc: subprocess.Popen) -> None:
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
    return (
        f"{head}: {record['steps_per_s']:,.0f} steps/s{per} over {record['seconds']:.2f}s{threads} "
        f"[{record['process_seconds']:.1f}s in all]"
    )


def run_benchmark(settings: Settings, *, progress: bool = True, keep_runs: str | None = None) -> dict:
    """Run every configuration ``settings.repeats`` times; write table.md, scaling.json, scaling.png.

    Repeats go round the whole list, so background load falls on every
    configuration alike.  Returns everything written to scaling.json.
    """
    from psgd.bench.convergence import machine
    from psgd.bench.plots import require_matplotlib

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
        with contextlib.ExitStack() as stack:
            network = None
            if settings.network:  # every launch's shards, workers and ranks on hosts of their own
                from psgd.bench.hosted import Network

                network = stack.enter_context(Network(settings.network, 1, max(r.workers for r in plan)))
                if progress:
                    print(
                        f"{settings.network} links: measured {network.record()['measured_gbit_per_s']} Gbit/s",
                        file=sys.stderr,
                        flush=True,
                    )
            _run_all(todo, settings, root, records, progress, skipped, network)
    finally:
        if not keep_runs:
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "benchmark": "psgd bench scaling",
        "settings": settings.to_dict(),
        "network": network.record() if network is not None else None,
        "machine": machine(),
        "cores": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "threadpool_info": threadpool_info(),
        "thread_env": {k: os.environ[k] for k in THREAD_VARS if k in os.environ},
        "peer_env": PEER_ENV,
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
        "seconds": round(time.perf_counter() - began, 1),
        "sources": SOURCES,
        "skipped": skipped,
        "table": tabulate(records, settings, skipped),
        "runs": records,
    }
    result["files"] = write_outputs(result, out)
    return result
