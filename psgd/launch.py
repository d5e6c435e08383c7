"""``psgd launch``: a whole job from one command per machine.

Parameter-server mode starts this node's share of K ``psgd-server`` processes
and N ``psgd-worker`` processes, shows worker 0's progress, waits (within a
time limit) for this node's workers to finish, then reads the final weights
from the shards and prints their test accuracy.  All-reduce mode starts N
ranks (under mpiexec for MPI; one per GPU for NCCL) and evaluates the weights
rank 0 saved.  Each process writes its log to the run folder.

The launcher owns its children, as torchrun does:

- each child runs in a session of its own and is told by the kernel to stop
  (SIGTERM) when the launcher dies, even by SIGKILL (``PR_SET_PDEATHSIG``);
- SIGINT, SIGTERM and SIGHUP to the launcher are forwarded to every child,
  which gets ``GRACE`` seconds to leave cleanly before it is killed;
- the BLAS/OpenMP threads of the machine's cores are divided among the
  processes it starts (see :mod:`psgd.threads`), said in one line;
- the current folder is on every child's import path and its own, as with
  ``python -m``, so ``--model mymodule:MyNet`` finds ``./mymodule.py``.

On many machines, ``nnodes``/``node_rank``/``hosts`` lay the job out so that
each node runs shards ``k`` with ``k % nnodes == node_rank`` (ports ``port``,
``port + 2``, ... on its host; each data port is the gRPC port + 1) and
workers ``r`` with ``r % nnodes == node_rank``; every node computes the same
addresses, so one command per machine needs no other coordination.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

from psgd import threads
from psgd.config import JobConfig, to_toml

log = logging.getLogger(__name__)

#: The stop signals: the launcher forwards them to its children; every psgd process leaves cleanly on them.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Seconds the children get to leave after a forwarded signal (or at the end of the job) before SIGKILL.
GRACE = 10.0
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


class LaunchError(RuntimeError):
    """A process of the job failed or ran past the time limit."""


class LaunchInterrupted(LaunchError):
    """The launcher was sent a stop signal; every child has been stopped."""

    def __init__(self, signum: int, children: int):
        self.signum = signum
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name}: forwarded it to {children} process(es); none is left running")


@dataclasses.dataclass
class LaunchResult:
    test_accuracy: float
    test_loss: float
    seconds: float
    servers: list[str]
    run_dir: str
    versions: list[int]
    saved: str | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which shards and workers of a job run on this node, and every shard's address."""

    nnodes: int = 1
    node_rank: int = 0
    hosts: tuple[str, ...] = ()   # one per node; empty: a single node on 127.0.0.1 with free ports
    port: int = 29500             # first gRPC port of a node's shards (multi-node only)

    def check(self, shards: int, workers: int) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}")
        if self.nnodes > 1 and len(self.hosts) != self.nnodes:
            raise LaunchError(f"--nnodes {self.nnodes} needs --hosts with one address per node "
                              f"(got {len(self.hosts)})")
        if self.nnodes > max(shards, workers):
            raise LaunchError(f"--nnodes {self.nnodes} is more nodes than shards ({shards}) or workers ({workers}) "
                              "to put on them")
        if not 0 < self.port < 65536 - 2 * shards:
            raise LaunchError(f"--port {self.port} leaves no room for {shards} shard(s) (two ports each)")

    def shards_here(self, shards: int) -> list[int]:
        return [k for k in range(shards) if k % self.nnodes == self.node_rank]

    def workers_here(self, workers: int) -> list[int]:
        return [r for r in range(workers) if r % self.nnodes == self.node_rank]

    def address(self, shard: int) -> str:
        host = self.hosts[shard % self.nnodes]
        return f"{host}:{self.port + 2 * (shard // self.nnodes)}"


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text[-lines:])


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGTERM when the launcher dies, however it dies."""
    def set_up() -> None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took hold
            os.kill(os.getpid(), signal.SIGTERM)
    return set_up


def child_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: the launcher's, unbuffered, with the current folder first on PYTHONPATH."""
    env = dict(os.environ if environ is None else environ)
    env["PYTHONUNBUFFERED"] = "1"
    paths = [os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != os.getcwd()]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


class _Proc:
    def __init__(self, name: str, argv: list[str], log_path: Path, show: bool):
        self.name, self.log_path = name, log_path
        self.log_file = open(log_path, "w")
        stderr = None if show else self.log_file
        self.popen = subprocess.Popen(argv, stdout=self.log_file, stderr=stderr, stdin=subprocess.DEVNULL,
                                      env=child_environment(), start_new_session=True,
                                      preexec_fn=_die_with_parent(os.getpid()))

    def failed(self) -> str:
        return (f"{self.name} exited with status {self.popen.returncode}; the end of its log "
                f"({self.log_path}):\n{_tail(self.log_path)}")

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the child's whole process group (mpiexec's ranks included)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signum)


class Children:
    """The processes of one launch: started, watched, and stopped together, never left behind."""

    def __init__(self) -> None:
        self.procs: list[_Proc] = []
        self.received: int | None = None

    def start(self, name: str, argv: list[str], log_path: Path, show: bool = False) -> _Proc:
        self.check_signal()
        proc = _Proc(name, argv, log_path, show)
        self.procs.append(proc)
        return proc

    def check_signal(self) -> None:
        if self.received is not None:
            raise LaunchInterrupted(self.received, len(self.procs))

    def wait(self, seconds: float) -> None:
        """Pause up to ``seconds``, returning early when a stop signal arrives."""
        self.check_signal()
        _SIGNALLED.wait(seconds)
        self.check_signal()

    def stop_all(self, signum: int = signal.SIGTERM, grace: float = GRACE) -> None:
        """Stop every child within ``grace`` seconds, then kill what is left.

        Workers (and ranks) get ``signum`` first and up to two thirds of the grace to push their
        last step and say they are done; then the shards get it and write their last checkpoint.
        """
        deadline = time.monotonic() + grace
        workers = [p for p in self.procs if not p.name.startswith("shard")]
        shards = [p for p in self.procs if p.name.startswith("shard")]
        self._signal_and_wait(workers, signum, time.monotonic() + grace * 2 / 3)
        self._signal_and_wait(shards, signum, deadline)
        for p in self.procs:
            if p.popen.poll() is None:
                log.warning("%s did not stop within %.0fs of %s: killing it", p.name, grace,
                            signal.Signals(signum).name)
            p.signal_group(signal.SIGKILL)  # whatever is left in its group (e.g. an MPI rank)
            if p.popen.poll() is None:
                p.popen.wait(5)
            p.log_file.close()

    @staticmethod
    def _signal_and_wait(procs: Sequence[_Proc], signum: int, deadline: float) -> None:
        live = [p for p in procs if p.popen.poll() is None]
        for p in live:
            p.signal_group(signum)
        for p in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(max(0.0, deadline - time.monotonic()))

    @contextlib.contextmanager
    def forwarding_signals(self) -> Iterator[None]:
        """While inside, SIGINT/SIGTERM/SIGHUP are recorded (and end the launch) instead of killing us."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum, frame) -> None:
            if self.received is None:
                self.received = signum
            _SIGNALLED.set()

        _SIGNALLED.clear()
        previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


_SIGNALLED = threading.Event()


def _wait_for_files(paths: Sequence[Path], procs: Sequence[_Proc], children: Children, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            if p.popen.poll() is not None:
                raise LaunchError(p.failed())
        if all(path.exists() for path in paths):
            return [path.read_text().strip() for path in paths]
        if time.monotonic() > deadline:
            missing = [path.name for path in paths if not path.exists()]
            raise LaunchError(f"shards did not start within {timeout:.0f}s (no {', '.join(missing)}); "
                              f"see the logs in {paths[0].parent}")
        children.wait(0.05)  # polling for port files with a deadline


def find_mpiexec() -> str:
    """The mpiexec beside this Python (where ``pip install 'psgd[mpi]'`` puts MPICH's), else on PATH."""
    from psgd.collective import BackendUnavailable

    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise BackendUnavailable("the mpi backend needs an MPI launcher (mpiexec): install one with "
                                 "`pip install 'psgd[mpi]'` (mpi4py with MPICH)")
    return found


def _wait_all(pending: list[_Proc], watched: Sequence[_Proc], children: Children, deadline: float,
              timeout: float, run: Path) -> None:
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
            children.wait(0.1)


def thread_budget(job: JobConfig, processes: int) -> tuple[int, str]:
    """Threads for each of ``processes`` psgd processes on this machine (0: left to the environment),
    and the one line that says so."""
    cores = threads.available_cores()
    if job.train.threads:
        return job.train.threads, f"{processes} process(es) on {cores} core(s): {job.train.threads} BLAS/OpenMP " \
                                  "thread(s) each (--threads)"
    explicit = threads.user_setting()
    if explicit:
        return 0, f"{processes} process(es) on {cores} core(s): BLAS/OpenMP threads as {explicit} says"
    share = threads.share_of_cores(processes, cores)
    return share, (f"{processes} process(es) on {cores} core(s): {share} BLAS/OpenMP thread(s) each "
                   "(--threads N or OMP_NUM_THREADS to change)")


def launch(job: JobConfig, *, mode: str = "ps", backend: str = "mpi", run_dir: str | None = None,
           progress: bool = True, timeout: float = 900.0, worker_args: Sequence[str] = (),
           verbose: int = 0, monitor: Callable[[list[str], threading.Event], None] | None = None,
           save: str | None = None, layout: Layout = Layout()) -> LaunchResult:
    """Run ``job`` (this node's share of it); returns the final test accuracy of the trained weights.

    ``worker_args`` are passed to every worker (or rank), e.g. ``["--delay",
    "slowdown:4@0"]``.  In ps mode, ``monitor(addresses, stop)`` runs in a
    thread from the workers' start until they have all finished (``stop`` is
    set then); it may read the shards, e.g. to evaluate the weights over time.
    ``save`` writes the final weights to a ``.npz`` file keyed by variable name.
    Raises :class:`LaunchInterrupted` when a stop signal arrived (every child
    stopped first).
    """
    if mode not in ("ps", "allreduce"):
        raise LaunchError(f"unknown mode {mode!r}: use ps or allreduce")
    if mode == "allreduce" and layout.nnodes > 1:
        raise LaunchError("--nnodes > 1 is for ps mode; start all-reduce ranks on many machines with mpiexec")
    layout.check(job.cluster.shards, job.cluster.workers)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the launcher's own evaluation imports user models too
    run = Path(run_dir or tempfile.mkdtemp(prefix="psgd-run-"))
    run.mkdir(parents=True, exist_ok=True)
    spec = job.to_dict()
    spec["cluster"]["servers"] = []
    here = (len(layout.shards_here(job.cluster.shards)) if mode == "ps" else 0) + \
        len(layout.workers_here(job.cluster.workers))
    per_process, said = thread_budget(job, here)
    log.info("%s", said)
    spec["train"]["threads"] = per_process
    threads.apply(per_process)
    (run / "job.toml").write_text(to_toml(spec))
    log_flags = ["-v"] if verbose > 0 else ["-q"] if verbose < 0 else []
    children = Children()
    with children.forwarding_signals():
        stopping = signal.SIGTERM
        try:
            if mode == "allreduce":
                return _launch_allreduce(job, backend, run, progress, timeout, list(worker_args), log_flags,
                                         children, save)
            return _launch_ps(job, spec, run, progress, timeout, list(worker_args), log_flags, monitor, children,
                              save, layout)
        except LaunchInterrupted as exc:
            stopping = exc.signum
            raise
        finally:
            children.stop_all(stopping if stopping in STOP_SIGNALS else signal.SIGTERM)


def _launch_allreduce(job: JobConfig, backend: str, run: Path, progress: bool, timeout: float,
                      worker_args: list[str], log_flags: list[str], children: Children,
                      save: str | None) -> LaunchResult:
    from psgd.export import read_npz, save_weights

    n, py = job.cluster.workers, sys.executable
    weights = run / "weights.npz"
    weights.unlink(missing_ok=True)
    common = ["-m", "psgd.cli.worker", "-c", str(run / "job.toml"), "--mode", "allreduce", "--backend", backend,
              "--save", str(weights), "--metrics", str(run / "allreduce.jsonl"), *worker_args]
    common += ["-q"] if progress else (log_flags + ["--no-progress"])
    start = time.perf_counter()
    if backend == "mpi":
        children.start(f"mpiexec -n {n}", [find_mpiexec(), "-n", str(n), py, *common], run / "allreduce.log",
                       show=progress)
    elif backend == "nccl":
        rendezvous = run / "nccl-id.json"
        rendezvous.unlink(missing_ok=True)
        for r in range(n):
            extra = ["--rank", str(r), "--device", f"cuda:{r}", "--rendezvous", f"file:{rendezvous}"]
            if r:
                extra += ["--no-progress"]
            children.start(f"rank {r}", [py, *common, *extra], run / f"rank-{r}.log", show=progress and r == 0)
    else:
        raise LaunchError(f"unknown all-reduce backend {backend!r}: use mpi or nccl")
    try:
        _wait_all(children.procs, children.procs, children, time.monotonic() + timeout, timeout, run)
    except LaunchInterrupted:
        raise
    except LaunchError as exc:
        raise LaunchError(f"a rank of the all-reduce job failed, so the job was stopped (one rank cannot "
                          f"go on without the others): {exc}") from None
    if not weights.exists():
        raise LaunchError(f"rank 0 finished without saving {weights}; see the logs in {run}")
    params = read_npz(weights)
    loss, acc = _evaluate(job, params)
    if save:
        save_weights(save, params)
    return LaunchResult(acc, loss, time.perf_counter() - start, [], str(run), [], save)


def _evaluate(job: JobConfig, weights: dict) -> tuple[float, float]:
    from psgd.loop import evaluate
    from psgd.job import build_job, params_to_device

    built = build_job(job)
    params = params_to_device(weights, built.device)
    return evaluate(built.model, params, built.dataset.x_test, built.dataset.y_test, built.device)


def _launch_ps(job: JobConfig, spec: dict, run: Path, progress: bool, timeout: float, worker_args: list[str],
               log_flags: list[str], monitor: Callable[[list[str], threading.Event], None] | None,
               children: Children, save: str | None, layout: Layout) -> LaunchResult:
    c = job.cluster
    job_path = run / "job.toml"
    py = sys.executable
    start = time.perf_counter()
    mine = layout.shards_here(c.shards)
    port_files = {k: run / f"shard-{k}.addr" for k in mine}
    for path in port_files.values():
        path.unlink(missing_ok=True)
    servers = []
    for k in mine:
        bind = ["--bind", "127.0.0.1:0" if layout.nnodes == 1 else layout.address(k)]
        servers.append(children.start(f"shard {k}", [py, "-m", "psgd.cli.server", "-c", str(job_path), "--shard",
                                                     str(k), *bind, "--port-file", str(port_files[k]),
                                                     *log_flags], run / f"shard-{k}.log"))
    bound = dict(zip(mine, _wait_for_files(list(port_files.values()), servers, children,
                                           timeout=min(timeout, 120.0))))
    addresses = [bound[k] if layout.nnodes == 1 else layout.address(k) for k in range(c.shards)]
    spec["cluster"]["servers"] = addresses
    job_path.write_text(to_toml(spec))
    ranks = layout.workers_here(c.workers)
    log.info("%d shard(s) serving here (%s); starting worker(s) %s, logs in %s", len(mine),
             ", ".join(bound.values()) or "none", ", ".join(map(str, ranks)) or "none", run)
    workers = []
    for r in ranks:
        show = progress and r == ranks[0]
        argv = [py, "-m", "psgd.cli.worker", "-c", str(job_path), "--rank", str(r),
                "--metrics", str(run / f"worker-{r}.jsonl"), *worker_args]
        argv += ["-q"] if show else (log_flags + ["--no-progress"])
        workers.append(children.start(f"worker {r}", argv, run / f"worker-{r}.log", show=show))
    stop = threading.Event()
    watcher = threading.Thread(target=monitor, args=(addresses, stop), daemon=True) if monitor else None
    if watcher:
        watcher.start()
    try:
        _wait_all(workers, children.procs, children, time.monotonic() + timeout, timeout, run)
        if layout.nnodes > 1 and servers:  # shards here may still serve other nodes' workers
            _wait_for_job(list(bound.values()), children, servers, time.monotonic() + timeout, timeout)
    finally:
        stop.set()
        if watcher:
            watcher.join(60)
    if layout.node_rank > 0:  # node 0 evaluates (and saves) once every worker is done; then this node ends
        _wait_until_gone(addresses[0], children, time.monotonic() + timeout, timeout)
        return LaunchResult(float("nan"), float("nan"), time.perf_counter() - start, addresses, str(run), [], None)
    return _final_evaluation(job, addresses, run, start, save)


def _wait_for_job(local: list[str], children: Children, servers: list[_Proc], deadline: float,
                  timeout: float) -> None:
    """Wait until this node's shards say every worker of the job has finished or been dropped (every
    shard follows every worker, so this node's own shards are enough; other nodes' may be gone)."""
    import grpc

    from psgd.channel import open_channel, token_metadata
    from psgd.proto import ps_pb2, ps_pb2_grpc

    metadata = token_metadata(os.environ.get("PSGD_TOKEN", ""))
    channels = [open_channel(a) for a in local]
    try:
        stubs = [ps_pb2_grpc.ParameterServerStub(ch) for ch in channels]
        while True:
            for p in servers:
                if p.popen.poll() is not None:
                    raise LaunchError(p.failed())
            try:
                if all(w.state in ("done", "expired")
                       for stub in stubs for w in stub.Status(ps_pb2.StatusRequest(), timeout=2.0,
                                                              metadata=metadata).workers):
                    return
            except grpc.RpcError as exc:
                log.debug("waiting for the job's workers: %s", exc.code().name)
            if time.monotonic() > deadline:
                raise LaunchError(f"the job's workers did not finish within {timeout:.0f}s (--timeout)")
            children.wait(0.5)
    finally:
        for ch in channels:
            ch.close()


def _wait_until_gone(address: str, children: Children, deadline: float, timeout: float) -> None:
    """Wait until the shard at ``address`` (node 0's shard 0) stops serving: node 0 has read the weights."""
    import grpc

    from psgd.channel import open_channel

    with open_channel(address) as channel:
        while time.monotonic() < deadline:
            try:
                grpc.channel_ready_future(channel).result(timeout=0.5)
            except grpc.FutureTimeoutError:
                return
            children.wait(0.5)
    raise LaunchError(f"node 0's shard at {address} was still serving after {timeout:.0f}s (--timeout)")


def _final_evaluation(job: JobConfig, addresses: list[str], run: Path, start: float,
                      save: str | None) -> LaunchResult:
    from psgd.export import pull_from_servers, save_weights

    # One observer: it checks each shard is the one listed, then reads the weights and their versions.
    pulled = pull_from_servers(job, addresses, token=os.environ.get("PSGD_TOKEN", ""))  # children have it too
    weights, versions = pulled.weights, pulled.versions
    loss, acc = _evaluate(job, weights)
    if save:
        save_weights(save, weights)
    return LaunchResult(acc, loss, time.perf_counter() - start, addresses, str(run), versions, save)
