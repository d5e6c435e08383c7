"""``psgd launch``: a whole job on this machine, from one command.

Parameter-server mode starts K ``psgd-server`` processes and N
``psgd-worker`` processes on 127.0.0.1, shows worker 0's progress, waits
(within a time limit) for every worker to finish, then reads the final
weights from the shards and prints their test accuracy.  All-reduce mode
starts N ranks (under mpiexec for MPI; one per GPU for NCCL) and evaluates the
weights rank 0 saved.  Each process writes its log to the run folder.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from psgd.config import JobConfig, to_toml

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A process of the local cluster failed or ran past the time limit."""


@dataclasses.dataclass
class LaunchResult:
    test_accuracy: float
    test_loss: float
    seconds: float
    servers: list[str]
    run_dir: str
    versions: list[int]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text[-lines:])


class _Proc:
    def __init__(self, name: str, argv: list[str], log_path: Path, show: bool):
        self.name, self.log_path = name, log_path
        self.log_file = open(log_path, "w")
        stderr = None if show else self.log_file
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen(argv, stdout=self.log_file, stderr=stderr, stdin=subprocess.DEVNULL, env=env)

    def failed(self) -> str:
        return (f"{self.name} exited with status {self.popen.returncode}; the end of its log "
                f"({self.log_path}):\n{_tail(self.log_path)}")

    def stop(self, grace: float) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self.log_file.close()


def _wait_for_files(paths: Sequence[Path], procs: Sequence[_Proc], timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            if p.popen.poll() is not None:
                raise LaunchError(p.failed())
        if all(path.exists() for path in paths):
            return [path.read_text().strip() for path in paths]
        if time.monotonic() > deadline:
            raise LaunchError(f"servers did not start within {timeout:.0f}s; see the logs in {paths[0].parent}")
        time.sleep(0.05)  # polling for port files with a deadline


def find_mpiexec() -> str:
    """The mpiexec beside this Python (where ``pip install 'psgd[mpi]'`` puts MPICH's), else on PATH."""
    from psgd.collective import BackendUnavailable

    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise BackendUnavailable("the mpi backend needs an MPI launcher (mpiexec): install one with "
                                 "`pip install 'psgd[mpi]'` (mpi4py with MPICH)")
    return found


def _wait_all(pending: list[_Proc], watched: Sequence[_Proc], deadline: float, timeout: float, run: Path) -> None:
    """Wait until every process in ``pending`` exits 0; fail at once when any of ``watched`` fails."""
    pending = list(pending)
    while pending:
        for p in watched:
            if p.popen.poll() is not None and p.popen.returncode != 0:
                raise LaunchError(p.failed())
        pending = [p for p in pending if p.popen.poll() is None]
        if time.monotonic() > deadline:
            raise LaunchError(f"the job did not finish within {timeout:.0f}s (--timeout); still running: "
                              f"{', '.join(p.name for p in pending)}; logs in {run}")
        if pending:
            try:
                pending[0].popen.wait(0.2)
            except subprocess.TimeoutExpired:
                pass


def launch(job: JobConfig, *, mode: str = "ps", backend: str = "mpi", run_dir: str | None = None,
           progress: bool = True, timeout: float = 900.0, worker_args: Sequence[str] = (),
           verbose: int = 0, monitor: Callable[[list[str], threading.Event], None] | None = None) -> LaunchResult:
    """Run ``job`` as a local cluster; returns the final test accuracy of the trained weights.

    ``worker_args`` are passed to every worker (or rank), e.g. ``["--delay",
    "slowdown:4@0"]``.  In ps mode, ``monitor(addresses, stop)`` runs in a
    thread from the workers' start until they have all finished (``stop`` is
    set then); it may read the shards, e.g. to evaluate the weights over time.
    """
    run = Path(run_dir or tempfile.mkdtemp(prefix="psgd-run-"))
    run.mkdir(parents=True, exist_ok=True)
    spec = job.to_dict()
    spec["cluster"]["servers"] = []
    (run / "job.toml").write_text(to_toml(spec))
    log_flags = ["-v"] if verbose > 0 else ["-q"] if verbose < 0 else []
    if mode == "allreduce":
        return _launch_allreduce(job, backend, run, progress, timeout, list(worker_args), log_flags)
    if mode != "ps":
        raise LaunchError(f"unknown mode {mode!r}: use ps or allreduce")
    return _launch_ps(job, spec, run, progress, timeout, list(worker_args), log_flags, monitor)


def _launch_allreduce(job: JobConfig, backend: str, run: Path, progress: bool, timeout: float,
                      worker_args: list[str], log_flags: list[str]) -> LaunchResult:
    n, py = job.cluster.workers, sys.executable
    weights = run / "weights.npz"
    weights.unlink(missing_ok=True)
    common = ["-m", "psgd.cli.worker", "-c", str(run / "job.toml"), "--mode", "allreduce", "--backend", backend,
              "--save", str(weights), "--metrics", str(run / "allreduce.jsonl"), *worker_args]
    common += ["-q"] if progress else (log_flags + ["--no-progress"])
    procs: list[_Proc] = []
    start = time.perf_counter()
    try:
        if backend == "mpi":
            procs.append(_Proc(f"mpiexec -n {n}", [find_mpiexec(), "-n", str(n), py, *common],
                               run / "allreduce.log", show=progress))
        elif backend == "nccl":
            rendezvous = run / "nccl-id.json"
            rendezvous.unlink(missing_ok=True)
            for r in range(n):
                extra = ["--rank", str(r), "--device", f"cuda:{r}", "--rendezvous", f"file:{rendezvous}"]
                if r:
                    extra += ["--no-progress"]
                procs.append(_Proc(f"rank {r}", [py, *common, *extra], run / f"rank-{r}.log",
                                   show=progress and r == 0))
        else:
            raise LaunchError(f"unknown all-reduce backend {backend!r}: use mpi or nccl")
        try:
            _wait_all(procs, procs, time.monotonic() + timeout, timeout, run)
        except LaunchError as exc:
            raise LaunchError(f"a rank of the all-reduce job failed, so the job was stopped (one rank cannot "
                              f"go on without the others): {exc}") from None
    finally:
        for p in reversed(procs):
            p.stop(grace=10.0)
    if not weights.exists():
        raise LaunchError(f"rank 0 finished without saving {weights}; see the logs in {run}")
    import numpy as np

    with np.load(weights, allow_pickle=False) as saved:
        params = {k: saved[k] for k in saved.files}
    loss, acc = _evaluate(job, params)
    return LaunchResult(acc, loss, time.perf_counter() - start, [], str(run), [])


def _evaluate(job: JobConfig, weights: dict) -> tuple[float, float]:
    from psgd.train import build_job, evaluate, params_to_device

    built = build_job(job)
    params = params_to_device(weights, built.device)
    return evaluate(built.model, params, built.dataset.x_test, built.dataset.y_test, built.device)


def _launch_ps(job: JobConfig, spec: dict, run: Path, progress: bool, timeout: float, worker_args: list[str],
               log_flags: list[str], monitor: Callable[[list[str], threading.Event], None] | None) -> LaunchResult:
    c = job.cluster
    job_path = run / "job.toml"
    py = sys.executable
    procs: list[_Proc] = []
    start = time.perf_counter()
    try:
        port_files = [run / f"shard-{k}.addr" for k in range(c.shards)]
        for path in port_files:
            path.unlink(missing_ok=True)
        servers = [_Proc(f"shard {k}", [py, "-m", "psgd.cli.server", "-c", str(job_path), "--shard", str(k),
                                        "--bind", "127.0.0.1:0", "--port-file", str(port_files[k]),
                                        *log_flags],
                         run / f"shard-{k}.log", show=False) for k in range(c.shards)]
        procs += servers
        addresses = _wait_for_files(port_files, servers, timeout=min(timeout, 120.0))
        spec["cluster"]["servers"] = addresses
        job_path.write_text(to_toml(spec))
        log.info("%d shard(s) serving at %s; starting %d worker(s), logs in %s",
                 c.shards, ", ".join(addresses), c.workers, run)
        workers = []
        for r in range(c.workers):
            show = progress and r == 0
            argv = [py, "-m", "psgd.cli.worker", "-c", str(job_path), "--rank", str(r),
                    "--metrics", str(run / f"worker-{r}.jsonl"), *worker_args]
            argv += ["-q"] if show else (log_flags + ["--no-progress"])
            workers.append(_Proc(f"worker {r}", argv, run / f"worker-{r}.log", show=show))
        procs += workers
        stop = threading.Event()
        watcher = threading.Thread(target=monitor, args=(addresses, stop), daemon=True) if monitor else None
        if watcher:
            watcher.start()
        try:
            _wait_all(workers, procs, time.monotonic() + timeout, timeout, run)
        finally:
            stop.set()
            if watcher:
                watcher.join(60)
        return _final_evaluation(job, addresses, run, start)
    finally:
        for p in reversed(procs):
            p.stop(grace=10.0)


def _final_evaluation(job: JobConfig, addresses: list[str], run: Path, start: float) -> LaunchResult:
    from psgd.partition import PartitionPlan
    from psgd.train import build_job
    from psgd.worker.client import PSClient, fetch_weights

    plan = PartitionPlan(build_job(job).model.specs(), job.cluster.shards, job.cluster.slice_bytes)
    token = os.environ.get("PSGD_TOKEN", "")  # the children inherit it too
    weights = fetch_weights(addresses, plan, timeout=job.cluster.request_timeout, token=token)
    with PSClient(addresses, plan, token=token) as client:
        versions = [s.version for s in client.status()]
    loss, acc = _evaluate(job, weights)
    return LaunchResult(acc, loss, time.perf_counter() - start, addresses, str(run), versions)
