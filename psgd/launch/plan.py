"""Planning a launch: which shards and workers run on this node, their threads, the MPI launcher.

:class:`Layout` lays a job out over ``nnodes`` machines (every node computes
the same addresses, so one command per machine needs no other coordination);
:class:`Hosts` puts each process on an emulated host of this machine;
:func:`thread_budget` divides the machine's cores among the processes it starts
(see :mod:`psgd.threads`); :func:`find_mpiexec` finds the ``mpiexec`` that
all-reduce mode over MPI starts its ranks with.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

from psgd import threads
from psgd.config import JobConfig
from psgd.launch.supervise import LaunchError


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


@dataclasses.dataclass(frozen=True)
class Hosts:
    """Emulated hosts on this one machine (network namespaces, :mod:`psgd.bench.netns`): shard ``k`` runs
    on host ``s<k>`` and listens on its address, worker (or all-reduce rank) ``r`` runs on host ``w<r>``.  ``prefixes`` give the
    argv that runs a command on a host; the launcher itself must run where it reaches every address."""

    prefixes: dict[str, tuple[str, ...]]
    addresses: dict[str, str]

    def check(self, shards: int, workers: int) -> None:
        wanted = [f"s{k}" for k in range(shards)] + [f"w{r}" for r in range(workers)]
        missing = [h for h in wanted if h not in self.prefixes or h not in self.addresses]
        if missing:
            raise LaunchError(f"no emulated host for {', '.join(missing)}: every shard and worker needs one")

    def prefix(self, host: str) -> list[str]:
        return list(self.prefixes[host])

    @classmethod
    def from_spec(cls, spec: dict) -> "Hosts":
        """From ``{"prefixes": {host: argv}, "addresses": {host: address}}`` (psgd.bench.hosted writes it)."""
        try:
            return cls({h: tuple(p) for h, p in spec["prefixes"].items()}, dict(spec["addresses"]))
        except KeyError as exc:
            raise LaunchError(f"an emulated-hosts spec needs 'prefixes' and 'addresses' by host; {exc} is "
                              "missing") from None
        except (TypeError, AttributeError):
            raise LaunchError("an emulated-hosts spec needs 'prefixes' and 'addresses' by host, each a table "
                              "keyed by host name") from None

    @classmethod
    def load(cls, path: str) -> "Hosts":
        """:meth:`from_spec` of the JSON file ``path`` (``psgd launch --emulated-hosts``)."""
        try:
            return cls.from_spec(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            raise LaunchError(f"--emulated-hosts {path}: {exc}") from None


def find_mpiexec() -> str:
    """The mpiexec beside this Python (where ``pip install 'psgd[mpi]'`` puts MPICH's), else on PATH."""
    from psgd.collective import BackendUnavailable

    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise BackendUnavailable("the mpi backend needs an MPI launcher (mpiexec): install one with "
                                 "`pip install 'psgd[mpi]'` (mpi4py with MPICH)")
    return found


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
