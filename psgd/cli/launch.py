"""``psgd launch``: a whole parameter-server job on this machine, from one command.

Starts K ``psgd-server`` processes and N ``psgd-worker`` processes on
127.0.0.1, shows worker 0's progress, waits (within a time limit) for every
worker to finish, then reads the final weights from the shards and prints
their test accuracy.  Each process writes its log to the run folder.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

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


def launch(job: JobConfig, *, run_dir: str | None = None, progress: bool = True, timeout: float = 900.0,
           worker_args: Sequence[Sequence[str]] = (), verbose: int = 0) -> LaunchResult:
    """Run ``job`` as a local cluster; returns the final test accuracy read from the shards."""
    c = job.cluster
    run = Path(run_dir or tempfile.mkdtemp(prefix="psgd-run-"))
    run.mkdir(parents=True, exist_ok=True)
    job_path = run / "job.toml"
    py = sys.executable
    log_flags = ["-v"] if verbose > 0 else ["-q"] if verbose < 0 else []
    procs: list[_Proc] = []
    start = time.perf_counter()
    try:
        spec = job.to_dict()
        spec["cluster"]["servers"] = []
        job_path.write_text(to_toml(spec))
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
            extra = list(worker_args[r]) if r < len(worker_args) else []
            show = progress and r == 0
            argv = [py, "-m", "psgd.cli.worker", "-c", str(job_path), "--rank", str(r),
                    "--metrics", str(run / f"worker-{r}.jsonl"), *extra]
            argv += ["-q"] if show else (log_flags + ["--no-progress"])
            workers.append(_Proc(f"worker {r}", argv, run / f"worker-{r}.log", show=show))
        procs += workers
        deadline = time.monotonic() + timeout
        pending = list(workers)
        while pending:
            for p in list(pending):
                if p.popen.poll() is not None:
                    if p.popen.returncode != 0:
                        raise LaunchError(p.failed())
                    pending.remove(p)
            for s in servers:
                if s.popen.poll() is not None and s.popen.returncode != 0:
                    raise LaunchError(s.failed())
            if time.monotonic() > deadline:
                raise LaunchError(f"the job did not finish within {timeout:.0f}s (--timeout); still running: "
                                  f"{', '.join(p.name for p in pending)}; logs in {run}")
            if pending:
                try:
                    pending[0].popen.wait(0.2)
                except subprocess.TimeoutExpired:
                    pass
        return _final_evaluation(job, addresses, run, start)
    finally:
        for p in reversed(procs):
            p.stop(grace=10.0)


def _final_evaluation(job: JobConfig, addresses: list[str], run: Path, start: float) -> LaunchResult:
    from psgd.partition import PartitionPlan
    from psgd.train import build_job, evaluate, params_to_device
    from psgd.worker.client import PSClient, fetch_weights

    built = build_job(job)
    plan = PartitionPlan(built.model.specs(), job.cluster.shards, job.cluster.slice_bytes)
    weights = fetch_weights(addresses, plan, timeout=job.cluster.request_timeout)
    with PSClient(addresses, plan) as client:
        versions = [s.version for s in client.status()]
    params = params_to_device(weights, built.device)
    loss, acc = evaluate(built.model, params, built.dataset.x_test, built.dataset.y_test, built.device)
    return LaunchResult(acc, loss, time.perf_counter() - start, addresses, str(run), versions)
