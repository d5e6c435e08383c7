"""The all-reduce mode's share of a launch: its ranks started under mpiexec (MPI) or one by one (NCCL, which meet
at a file in the run folder), watched as one job (a rank cannot go on without the others), and the weights rank 0
saved evaluated here."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from psgd.config import JobConfig
from psgd.errors import ConfigError
from psgd.launcher.layout import Hosts, device_flags, find_mpiexec, mpi_environment, shown_flags
from psgd.launcher.result import LaunchResult, evaluate_weights
from psgd.launcher.supervise import Children, LaunchError, LaunchInterrupted, wait_all
from psgd.weights import read_npz, save_weights

log = logging.getLogger(__name__)

#: where the NCCL ranks of an all-reduce launch find rank 0's unique id, in the run folder
NCCL_RENDEZVOUS = "nccl-id.json"

#: MPI settings for ranks on emulated hosts: they talk over their hosts' links (TCP on eth0), not through the
#: shared memory of the one machine they all run on.
MPI_ON_HOSTS = ("-genv", "MPIR_CVAR_NOLOCAL", "1", "-genv", "UCX_TLS", "tcp,self", "-genv", "UCX_NET_DEVICES", "eth0")


def launch_allreduce(
    config: JobConfig,
    backend: str,
    run: Path,
    progress: bool,
    timeout: float,
    worker_args: list[str],
    log_flags: list[str],
    children: Children,
    save: str | None,
    hosts: Hosts | None,
    devices: dict[int, str],
) -> LaunchResult:
    n, py = config.cluster.workers, sys.executable
    if config.cluster.elastic:
        raise ConfigError(
            f"the all-reduce mode keeps a fixed count of ranks: --workers {config.cluster.get('workers')} is a range, "
            "which only a parameter-server job takes; give one number"
        )
    weights = run / "weights.npz"
    weights.unlink(missing_ok=True)
    common = [
        "-m",
        "psgd.cli.worker",
        "-c",
        str(run / "job.toml"),
        "--mode",
        "allreduce",
        "--backend",
        backend,
        "--save",
        str(weights),
        "--metrics",
        str(run / "allreduce.jsonl"),
        *worker_args,
    ]
    if backend == "mpi":  # every rank: mpiexec shows each one's stderr
        common += shown_flags(run / "allreduce.log", log_flags) if progress else (log_flags + ["--no-progress"])
    start = time.perf_counter()
    on_gpu = {r: device_flags(d) for r, d in devices.items()}
    if backend == "mpi":
        mpiexec = find_mpiexec()
        env, said = mpi_environment(mpiexec)
        if said:
            log.info("%s", said)
        if hosts is not None or any(on_gpu.values()):  # mpiexec's MPMD form: rank r on host w<r>, GPU of its own
            argv = [mpiexec, *(MPI_ON_HOSTS if hosts else ())]
            for r in range(n):
                argv += [":"] * (r > 0) + [
                    "-n",
                    "1",
                    *(hosts.prefix(f"w{r}") if hosts else []),
                    py,
                    *common,
                    *on_gpu[r],
                ]
        else:
            argv = [mpiexec, "-n", str(n), py, *common]
        children.start(
            f"mpiexec -n {n}" + " on emulated hosts" * (hosts is not None),
            argv,
            run / "allreduce.log",
            show=progress,
            env=env,
        )
    elif backend == "nccl":
        rendezvous = run / NCCL_RENDEZVOUS
        rendezvous.unlink(missing_ok=True)
        for r in range(n):
            extra = ["--rank", str(r), *on_gpu[r], "--rendezvous", f"file:{rendezvous}"]
            extra += (
                shown_flags(run / f"rank-{r}.log", log_flags) if progress and not r else (log_flags + ["--no-progress"])
            )
            children.start(f"rank {r}", [py, *common, *extra], run / f"rank-{r}.log", show=progress and r == 0)
    else:
        raise LaunchError(f"unknown all-reduce backend {backend!r}: use mpi or nccl")
    try:
        wait_all(children.procs, children.procs, children, time.monotonic() + timeout, timeout, run)
    except LaunchInterrupted:
        raise
    except LaunchError as exc:
        raise LaunchError(
            f"a rank of the all-reduce job failed, so the job was stopped (one rank cannot "
            f"go on without the others): {exc}",
            exc.failures,
        ) from None
    if not weights.exists():
        raise LaunchError(f"rank 0 finished without saving {weights}; see the logs in {run}")
    params = read_npz(weights)
    loss, scores, verdict = evaluate_weights(config, params, "allreduce")
    if save:
        save_weights(save, params)
    return LaunchResult(
        scores["test_accuracy"],
        loss,
        time.perf_counter() - start,
        [],
        str(run),
        [],
        save,
        verdict,
        test_r2=scores["test_r2"],
    )
