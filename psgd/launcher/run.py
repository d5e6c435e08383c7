"""``launch()``: this node's share of a job, in parameter-server or all-reduce mode, to its final accuracy.

Parameter-server mode starts the shards, waits for their addresses, starts the
workers and (on node 0) reads the final weights from the shards; all-reduce
mode starts the ranks and reads the weights rank 0 saved (psgd.launcher.allreduce).
Either way the weights are evaluated on the test set here.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from psgd.compute import threads
from psgd.config import JobConfig, to_toml
from psgd.job import RANK_CLAIM, check_optimizer
from psgd.launcher.allreduce import NCCL_RENDEZVOUS, launch_allreduce
from psgd.launcher.certs import job_tls
from psgd.launcher.folder import (
    CHECKPOINTS,
    FINAL,
    TOKEN_FILE,
    claim,
    made_token,
    new_run_folder,
    resume_command,
    status_command,
)
from psgd.launcher.layout import Hosts, Layout, busy_poll, device_flags, place_on_gpus, shown_flags
from psgd.launcher.result import (
    LaunchResult,
    exchange_bound,
    final_evaluation,
    first_divergence,
    handed_steps,
    lockstep_steps,
    read_records,
)
from psgd.launcher.scale import Scaler
from psgd.launcher.supervise import (
    STOP_SIGNALS,
    Child,
    Children,
    LaunchError,
    LaunchInterrupted,
    wait_all,
    wait_for_files,
)
from psgd.observe.files import open_own
from psgd.ops.reach import Connect, check_health, try_status
from psgd.wire.channel import MAKE_TOKEN, read_token
from psgd.wire.tls import TLSFiles, child_flags

log = logging.getLogger(__name__)


def launch(
    config: JobConfig,
    *,
    mode: str = "ps",
    backend: str = "mpi",
    run_dir: str | None = None,
    progress: bool = True,
    timeout: float = 900.0,
    worker_args: Sequence[str] = (),
    verbose: int = 0,
    monitor: Callable[[list[str], threading.Event, str, TLSFiles], None] | None = None,
    save: str | None = None,
    layout: Layout = Layout(),
    hosts: Hosts | None = None,
    tls: TLSFiles | None = None,
    resume: bool = False,
    script: Sequence[str] = (),
    resume_flags: Sequence[str] = (),
    continue_with: str = "",
) -> LaunchResult:
    """Run ``job`` (this node's share of it); returns the final test accuracy of the trained weights.

    ``worker_args`` are passed to every worker (or rank), e.g. ``["--delay",
    "slowdown:4@0"]``.  In ps mode, ``monitor(addresses, stop, token, tls)`` runs in a
    thread from the workers' start until they have all finished (``stop`` is
    set then); it may read the shards with ``token`` and the TLS files ``tls`` (the job's own by default), e.g. to
    evaluate the weights over time.
    The shards want ``$PSGD_TOKEN``; without one, a single node makes a random token for the job
    (:func:`made_token`, kept in ``RUN/.token``, readable by its user alone) and hands it to its children in
    their environment (never in the job file or a log), and a node of several refuses to start (every node must
    know the same token).
    The final weights are kept (node 0's) in a ``.npz`` file keyed by variable name: ``save``, else
    ``RUN/final.npz``.
    In ps mode the shards write checkpoints into ``RUN/checkpoints`` (and a last one when stopped); ``resume``
    continues the job of ``run_dir`` from them, where a launch into a folder that holds them is refused.
    ``hosts`` puts every shard and worker (or MPI rank) on an emulated host of
    this machine (one node).  ``tls`` (certificate, key and CA together) is mutual TLS between every shard,
    worker and this launcher's own reads; by default (None) those of the job's ``[tls]`` table, else, for a
    parameter-server job on one node, a CA made for the job and kept in ``RUN/tls`` (:func:`job_tls`); ``NO_TLS``:
    plaintext.
    Raises :class:`LaunchInterrupted` when a stop signal arrived (every child
    stopped first).  ``divergence`` in the result is the first divergence this node's workers (ranks)
    reported, else the launcher's own verdict on the final weights (:mod:`psgd.training.divergence`).
    ``script`` (``psgd run``: a Python file and its arguments) is each worker's program instead of psgd-worker:
    its loop is its own, through :func:`psgd.join` (ps mode only).
    ``resume_flags``: the flags of the command that started the launch which its run folder does not keep, said
    again in the command a stopped launch says continues it (:func:`~psgd.launcher.folder.resume_command`);
    ``continue_with``: what it says instead (psgd.launch's own call).
    """
    if mode not in ("ps", "allreduce"):
        raise LaunchError(f"unknown mode {mode!r}: use ps or allreduce")
    if script and (mode != "ps" or worker_args):
        raise LaunchError(
            "psgd run starts a script per parameter-server worker: not in all-reduce mode, and not with worker flags"
        )
    check_optimizer(config)
    made_tls = False
    if tls is None:  # the default: the job file's certificates, else (ps mode, one node) a CA made for the job
        tls = TLSFiles(config.tls.cert or None, config.tls.key or None, config.tls.ca or None)
        made_tls = not tls.enabled and mode == "ps" and layout.nnodes == 1
    tls_flags = child_flags(tls)
    if tls.enabled and mode != "ps":
        raise LaunchError(
            "TLS protects the parameter servers' traffic: all-reduce mode has no servers (MPI and "
            "NCCL bring their own transport)"
        )
    if config.cluster.elastic and layout.nnodes > 1:
        raise LaunchError(
            f"--workers {config.cluster.get('workers')} (a range) is launched on one node; on many, start the "
            "shards and run psgd-worker --rank auto on each machine that joins (docs/howto/elastic.md)"
        )
    if mode == "allreduce" and layout.nnodes > 1:
        raise LaunchError("--nnodes > 1 is for ps mode; start all-reduce ranks on many machines with mpiexec")
    layout.check(config.cluster.shards, config.cluster.workers)
    if hosts is not None:
        if layout.nnodes > 1 or (mode == "allreduce" and backend != "mpi"):
            raise LaunchError(
                "emulated hosts are for one node, and for all-reduce over MPI (NCCL ranks need GPUs of their own)"
            )
        hosts.check(config.cluster.shards if mode == "ps" else 0, config.cluster.workers)
    ranks = layout.workers_here(config.cluster.workers)
    devices, placement = place_on_gpus(config.train.device, ranks, "rank" if mode == "allreduce" else "worker")
    if mode == "allreduce" and backend == "nccl":
        gpus = {d for d in devices.values() if d != "cpu"}
        if len(gpus) < len(ranks):
            raise LaunchError(
                f"all-reduce over NCCL needs a GPU of its own for each of its {len(ranks)} ranks, "
                f"and --device {config.train.device} gives {len(gpus)}: use --device cuda on a machine "
                "with enough GPUs, or the mpi backend"
            )
    if placement:
        log.info("%s", placement)
    # the job file names one device (its workers' own comes with --device)
    config = config.override("train.device", devices[ranks[0]] if ranks else "cpu")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the launcher's own evaluation imports user models too
    if resume and mode != "ps":
        raise LaunchError(
            "--resume continues a parameter-server job from its shards' checkpoints; all-reduce ranks keep none"
        )
    token = read_token()  # a weak one is refused before anything is written
    run = Path(run_dir) if run_dir else new_run_folder(mode)
    claim(run, resume, mode, script)
    checkpoints = run / CHECKPOINTS
    save = save or str(run / FINAL)  # a trained model is kept, as psgd.launch keeps it
    kept_token = not token and mode == "ps"
    if kept_token:
        if layout.nnodes == 1:
            token = made_token(run)
            log.info(
                "the job's token is in %s (readable by you alone; psgd %s --resume reads it, the shards sign "
                "their checkpoints with it)",
                run / TOKEN_FILE,
                "run" if script else "launch",
            )
        else:  # every node must know the same one: none is made here
            raise LaunchError(
                f"a {layout.nnodes}-node job needs its token on every node: set the same PSGD_TOKEN "
                f"on each before psgd launch (make one: {MAKE_TOKEN})"
            )
    if made_tls:
        tls = job_tls(run, [*layout.hosts, *(hosts.addresses.values() if hosts else ())])
        tls_flags = child_flags(tls)
        log.info("TLS on (mutual; a CA made for this job, kept in %s)", Path(tls.ca).parent)
    elif mode == "ps" and layout.nnodes > 1 and not tls.enabled:
        log.warning(
            "no TLS: the token and the gradients and weights travel in the clear between nodes; give every "
            "node the same --tls-cert, --tls-key and --tls-ca (docs/howto/reliability-security.md)"
        )
    spec = config.to_dict()
    spec["cluster"]["servers"] = []
    here = (
        (len(layout.shards_here(config.cluster.shards)) if mode == "ps" else 0)
        + len(layout.workers_here(config.cluster.workers))
        + (len(layout.replicas_here(config.cluster.shards)) if mode == "ps" and config.cluster.recovery.replicas else 0)
    )
    per_process, said = threads.budget(config.train.threads, here)
    log.info("%s", said)
    spec["train"]["threads"] = per_process
    if mode == "ps" and config.cluster.links.busy_poll_us < 0:
        spec["cluster"]["busy_poll_us"], said = busy_poll(here)
        log.info("%s", said)
    threads.apply(per_process)
    _write_job(run / "job.toml", spec)
    log_flags = ["-v"] if verbose > 0 else ["-q"] if verbose < 0 else []
    children = Children(resumed=resume)  # a resumed run keeps its logs
    began = time.time()  # metrics lines from before this launch (a reused run folder) are not this run's
    with children.forwarding_signals():
        stopping = signal.SIGTERM
        try:
            if mode == "allreduce":
                result = launch_allreduce(
                    config,
                    backend,
                    run,
                    progress,
                    timeout,
                    list(worker_args),
                    log_flags,
                    children,
                    save,
                    hosts,
                    devices,
                )
                metrics, shown = [run / "allreduce.jsonl"], "rank 0" if progress else None
            else:
                watch = status_command(run, tls, token_kept=kept_token)
                result = _launch_ps(
                    config,
                    spec,
                    run,
                    progress,
                    timeout,
                    list(worker_args),
                    log_flags,
                    monitor,
                    children,
                    save,
                    layout,
                    hosts,
                    devices,
                    tls,
                    tls_flags,
                    token,
                    tuple(script),
                    watch,
                )
                metrics = [run / f"worker-{r}.jsonl" for r in ranks]
                shown = f"worker {ranks[0]}" if progress and ranks else None
            records = read_records(metrics, began)
            if mode == "allreduce":
                result.worker_steps = lockstep_steps(records, config.cluster.workers)
            elif config.cluster.elastic:
                result.worker_steps = handed_steps(records, config.cluster.workers)
            result.divergence = first_divergence(records, result.divergence, shown)
            bound = exchange_bound(records) if mode == "ps" and layout.node_rank == 0 else None
            if bound:
                log.info("%s", bound)
            return result
        except LaunchInterrupted as exc:
            stopping = exc.signum
            if mode == "ps" and layout.node_rank == 0:  # the shards write their last checkpoints as they stop
                exc.args = (
                    f"{exc}; the shards' checkpoints are in {checkpoints}: continue with "
                    f"{continue_with or resume_command(run, script, resume_flags)}",
                )
            raise
        finally:
            children.stop_all(stopping if stopping in STOP_SIGNALS else signal.SIGTERM, pause_workers=mode == "ps")
            # the files through which the processes found each other mean nothing once the launch has ended
            # (a stopped shard removes its own port file; a killed one cannot)
            handoff = (
                [run / NCCL_RENDEZVOUS]
                if mode == "allreduce"
                else [_port_file(run, k) for k in layout.shards_here(config.cluster.shards)]
                + [_port_file(run, k, "replica") for k in layout.replicas_here(config.cluster.shards)]
            )
            for path in handoff:
                path.unlink(missing_ok=True)


def _write_job(path: Path, spec: dict) -> None:
    """The job file every process of the launch reads, written as psgd's own (psgd.observe.files)."""
    with open_own(path, "w", encoding="utf-8") as f:
        f.write(to_toml(spec))


def _port_file(run: Path, shard: int, role: str = "shard") -> Path:
    """Where shard ``shard`` of this node (its replica: ``role`` "replica") writes the address it bound."""
    return run / f"{role}-{shard}.addr"


def _launch_ps(
    config: JobConfig,
    spec: dict,
    run: Path,
    progress: bool,
    timeout: float,
    worker_args: list[str],
    log_flags: list[str],
    monitor: Callable[[list[str], threading.Event, str, TLSFiles], None] | None,
    children: Children,
    save: str | None,
    layout: Layout,
    hosts: Hosts | None,
    devices: dict[int, str],
    tls: TLSFiles,
    tls_flags: list[str],
    token: str,
    script: tuple[str, ...] = (),
    watch: str = "",
) -> LaunchResult:
    c = config.cluster
    job_path = run / "job.toml"
    py = sys.executable
    start = time.perf_counter()
    mine = layout.shards_here(c.shards)
    servers, bound = _start_shards(
        c.shards,
        job_path,
        run,
        layout,
        hosts,
        children,
        tls_flags + log_flags + ["--checkpoint-dir", str(run / CHECKPOINTS)],
        token,
        timeout,
    )
    addresses = [bound[k] if layout.nnodes == 1 else layout.address(k) for k in range(c.shards)]
    spec["cluster"]["servers"] = addresses
    if (
        c.recovery.replicas
    ):  # each shard's replica, on the next node (psgd.server.durable.replica), once its primary is up
        replicas, replica_bound = _start_shards(
            c.shards, job_path, run, layout, hosts, children, tls_flags + log_flags, token, timeout, primaries=addresses
        )
        servers += replicas
        config = config.override(
            "cluster.replica_servers",
            [replica_bound[k] if layout.nnodes == 1 else layout.replica_address(k, c.shards) for k in range(c.shards)],
        )
        spec["cluster"]["replica_servers"] = list(config.cluster.recovery.replica_servers)
    _write_job(job_path, spec)
    ranks = layout.workers_here(c.fewest)
    log.info(
        "%d shard(s) serving here (%s); starting worker(s) %s, logs in %s",
        len(mine),
        ", ".join(bound.values()) or "none",
        ", ".join(map(str, ranks)) or "none",
        run,
    )
    if watch:  # once the job file names the shards
        log.info("to watch the shards: %s", watch)

    def start_worker(r: int) -> Child:
        """Start the worker of rank ``r`` (the first rank's shows its progress)."""
        show = progress and r == ranks[0]
        on = hosts.prefix(f"w{r}") if hosts else []
        if script:  # psgd run: the user's program, told its job, rank and device in its environment
            from psgd.worker import script as own

            env = {
                own.JOB_FILE: str(job_path),
                own.RANK: str(r),
                own.METRICS: str(run / f"worker-{r}.jsonl"),
                RANK_CLAIM: rank_claim(token, r),
                **({own.DEVICE: devices[r]} if devices[r] != "cpu" else {}),
                **{name: str(Path(path).resolve()) for name, path in zip(own.TLS, (tls.cert, tls.key, tls.ca)) if path},
            }
            return children.start(
                f"worker {r}",
                [*on, py, *script],
                run / f"worker-{r}.log",
                show=r == ranks[0],
                env={"PSGD_TOKEN": token, **env},
                show_stdout=True,
            )
        argv = [
            *on,
            py,
            "-m",
            "psgd.cli.worker",
            "-c",
            str(job_path),
            "--rank",
            str(r),
            "--metrics",
            str(run / f"worker-{r}.jsonl"),
            *tls_flags,
            *worker_args,
        ]
        argv += device_flags(devices[r])
        argv += shown_flags(run / f"worker-{r}.log", log_flags) if show else (log_flags + ["--no-progress"])
        return children.start(
            f"worker {r}",
            argv,
            run / f"worker-{r}.log",
            show=show,
            env={"PSGD_TOKEN": token, RANK_CLAIM: rank_claim(token, r)},
        )

    workers = [start_worker(r) for r in ranks]
    # a job with a range starts its fewest; psgd scale asks for more or fewer while it runs
    scaler = Scaler(run, c.workers, start_worker, dict(zip(ranks, workers))) if c.elastic else None
    stop = threading.Event()
    watcher = threading.Thread(target=monitor, args=(addresses, stop, token, tls), daemon=True) if monitor else None
    if watcher:
        watcher.start()
    try:
        more = scaler.poll if scaler is not None else None
        wait_all(workers, children.procs, children, time.monotonic() + timeout, timeout, run, more)
        if layout.nnodes > 1 and servers:  # shards here may still serve other nodes' workers
            _wait_for_job(list(bound.values()), children, servers, time.monotonic() + timeout, timeout, tls, token)
    finally:
        stop.set()
        if watcher:
            watcher.join(60)
    if layout.node_rank > 0:  # node 0 evaluates (and saves) once every worker is done; then this node ends
        _wait_until_gone(addresses[0], children, time.monotonic() + timeout, timeout, tls)
        return LaunchResult(float("nan"), float("nan"), time.perf_counter() - start, addresses, str(run), [], None)
    return final_evaluation(config, addresses, run, start, save, tls, token)


def rank_claim(token: str, rank: int) -> str:
    """The claim on rank ``rank`` this job's launches give its worker (:data:`psgd.job.RANK_CLAIM`): the same for
    every launch of the job (``--resume`` included: the job's token is its run folder's), so a resumed launch's
    worker takes at once the rank its shards kept for the stopped one; a process the launch did not start has
    none, and waits for the rank as before.  Keyed by the token: only the job's own processes can make it."""
    return hmac.new(token.encode(), f"psgd-rank-claim\0{rank}".encode(), hashlib.sha256).hexdigest()[:32]


def _start_shards(
    shards: int,
    job_path: Path,
    run: Path,
    layout: Layout,
    hosts: Hosts | None,
    children: Children,
    flags: list[str],
    token: str,
    timeout: float,
    primaries: list[str] | None = None,
) -> tuple[list[Child], dict[int, str]]:
    """Start this node's shards (with ``primaries``, the shards' addresses: their replicas, each on the node after
    its shard's, following it), and wait for the address each bound; returns the processes and those addresses."""
    replica = primaries is not None
    mine = layout.replicas_here(shards) if replica else layout.shards_here(shards)
    files = {k: _port_file(run, k, "replica" if replica else "shard") for k in mine}
    started = []
    for k in mine:
        bind = (
            "127.0.0.1:0" if layout.nnodes == 1 else layout.replica_address(k, shards) if replica else layout.address(k)
        )
        data = ["--data-port", str(int(bind.rpartition(":")[2]) + 1)] if layout.nnodes > 1 and not hosts else []
        host = f"s{(k + 1) % shards}" if replica else f"s{k}"  # a replica: on another emulated host, if any
        if hosts:
            bind = f"{hosts.addresses[host]}:0"
        files[k].unlink(missing_ok=True)
        name = f"replica {k}" if replica else f"shard {k}"
        started.append(
            children.start(
                name,
                [
                    *(hosts.prefix(host) if hosts else []),
                    sys.executable,
                    "-m",
                    "psgd.cli.server",
                    "-c",
                    str(job_path),
                    "--shard",
                    str(k),
                    *(["--replica", "--peer", primaries[k]] if replica else []),
                    "--bind",
                    bind,
                    *data,
                    "--port-file",
                    str(files[k]),
                    *flags,
                ],
                run / f"{name.replace(' ', '-')}.log",
                env={"PSGD_TOKEN": token},
            )
        )
    bound = dict(zip(mine, wait_for_files(list(files.values()), started, children, timeout=min(timeout, 120.0))))
    return started, bound


def _wait_for_job(
    local: list[str],
    children: Children,
    servers: list[Child],
    deadline: float,
    timeout: float,
    tls: TLSFiles,
    token: str,
) -> None:
    """Wait until this node's shards say every worker of the job has finished or been dropped (every
    shard follows every worker, so this node's own shards are enough; other nodes' may be gone)."""
    connect = Connect.using(tls, token, 2.0)
    while True:
        ended = [p for p in servers if p.popen.poll() is not None]
        if ended:
            raise children.failed(ended)
        answers = [try_status(address, connect) for address in local]
        if all(
            status is not None and all(w["state"] in ("done", "expired", "left", "free") for w in status["workers"])
            for status, _, _ in answers
        ):
            return
        log.debug("waiting for the job's workers: %s", "; ".join(why or "training" for _, why, _ in answers))
        if time.monotonic() > deadline:
            raise LaunchError(f"the job's workers did not finish within {timeout:.0f}s (--timeout)")
        children.wait(0.5)


def _wait_until_gone(address: str, children: Children, deadline: float, timeout: float, tls: TLSFiles) -> None:
    """Wait until the shard at ``address`` (node 0's shard 0) stops serving: node 0 has read the weights."""
    connect = Connect.using(tls, "", 0.5)
    while time.monotonic() < deadline:
        if check_health(address, connect)[0] == "UNREACHABLE":
            return
        children.wait(0.5)
    raise LaunchError(f"node 0's shard at {address} was still serving after {timeout:.0f}s (--timeout)")
