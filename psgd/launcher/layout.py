"""Planning a launch: which shards and workers run on this node, their threads, the MPI launcher.

:class:`Layout` lays a job out over ``nnodes`` machines (every node computes
the same addresses, so one command per machine needs no other coordination);
:class:`Hosts` puts each process on an emulated host of this machine;
:func:`place_on_gpus` puts each worker (or rank) of this node on a GPU of its
own, as torchrun does with local ranks;
:func:`find_mpiexec` finds the ``mpiexec`` that all-reduce mode over MPI starts
its ranks with, and :func:`mpi_environment` what it needs from a launcher run
as root.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from psgd.collective import BackendUnavailable
from psgd.compute import backend, threads
from psgd.errors import install_extra
from psgd.launcher.supervise import LaunchError
from psgd.observe.progress import bar_wanted
from psgd.wire import protocol


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which shards and workers of a job run on this node, and every shard's address."""

    nnodes: int = 1
    node_rank: int = 0
    hosts: tuple[str, ...] = ()  # one per node; empty: a single node on 127.0.0.1 with free ports
    port: int = 29500  # first gRPC port of a node's shards (multi-node only)

    def check(self, shards: int, workers: int) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}")
        if self.nnodes > 1 and len(self.hosts) != self.nnodes:
            raise LaunchError(f"--nnodes {self.nnodes} needs --hosts with one address per node (got {len(self.hosts)})")
        if self.nnodes > max(shards, workers):
            raise LaunchError(
                f"--nnodes {self.nnodes} is more nodes than shards ({shards}) or workers ({workers}) to put on them"
            )
        if not 0 < self.port < 65536 - 4 * shards:
            raise LaunchError(
                f"--port {self.port} leaves no room for {shards} shard(s) (two ports each, and two for each replica)"
            )

    def shards_here(self, shards: int) -> list[int]:
        return [k for k in range(shards) if k % self.nnodes == self.node_rank]

    def replicas_here(self, shards: int) -> list[int]:
        """The shards whose replica runs on this node: the next node's after its primary's (the same one alone)."""
        return [k for k in range(shards) if (k + 1) % self.nnodes == self.node_rank]

    def replica_address(self, shard: int, shards: int) -> str:
        """Where shard ``shard``'s replica listens (multi-node): the ports after that node's primaries'."""
        host = self.hosts[(shard + 1) % self.nnodes]
        return f"{host}:{self.port + 2 * (-(-shards // self.nnodes)) + 2 * (shard // self.nnodes)}"

    def workers_here(self, workers: int) -> list[int]:
        return [r for r in range(workers) if r % self.nnodes == self.node_rank]

    def address(self, shard: int) -> str:
        host = self.hosts[shard % self.nnodes]
        return f"{host}:{self.port + 2 * (shard // self.nnodes)}"


@dataclasses.dataclass(frozen=True)
class Hosts:
    """Emulated hosts on this one machine (network namespaces, :mod:`psgd.bench.netns`): shard ``k`` runs
    on host ``s<k>`` and listens on its address, worker (or all-reduce rank) ``r`` runs on host ``w<r>``.
    ``prefixes`` give the argv that runs a command on a host; the launcher itself must run where it reaches every
    address."""

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
    def from_spec(cls, spec: dict) -> Hosts:
        """From ``{"prefixes": {host: argv}, "addresses": {host: address}}`` (psgd.bench.hosted writes it)."""
        try:
            return cls({h: tuple(p) for h, p in spec["prefixes"].items()}, dict(spec["addresses"]))
        except KeyError as exc:
            raise LaunchError(
                f"an emulated-hosts spec needs 'prefixes' and 'addresses' by host; {exc} is missing"
            ) from None
        except (TypeError, AttributeError):
            raise LaunchError(
                "an emulated-hosts spec needs 'prefixes' and 'addresses' by host, each a table keyed by host name"
            ) from None

    @classmethod
    def load(cls, path: str) -> Hosts:
        """:meth:`from_spec` of the JSON file ``path`` (``psgd launch --emulated-hosts``)."""
        try:
            return cls.from_spec(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            raise LaunchError(f"--emulated-hosts {path}: {exc}") from None


def find_mpiexec() -> str:
    """The mpiexec beside this Python (where ``python3 -m pip install -c requirements.lock -e ".[mpi]"`` puts
    MPICH's), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise BackendUnavailable(
            "the mpi backend needs an MPI launcher (mpiexec): install one in psgd's folder "
            f"with `{install_extra('mpi')}` (mpi4py with MPICH)"
        )
    return found


#: what Open MPI's mpiexec asks of a user who runs it as root (it refuses otherwise; MPICH's does not ask)
OPEN_MPI_AS_ROOT = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")


def mpi_environment(mpiexec: str) -> tuple[dict[str, str], str]:
    """What the ranks' ``mpiexec`` needs in its environment from this launcher, and the one line that says so
    (empty when nothing): run as root with Open MPI's mpiexec, the two variables of :data:`OPEN_MPI_AS_ROOT`,
    unless the user set them."""
    if os.geteuid() != 0 or all(os.environ.get(v) for v in OPEN_MPI_AS_ROOT):
        return {}, ""
    try:
        said = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}, ""  # starting the ranks says what is wrong with it
    text = (said.stdout + said.stderr).lower()
    if not any(name in text for name in ("open mpi", "openrte", "open-mpi.org")):  # 5.x, 4.x; both link their site
        return {}, ""
    return {v: "1" for v in OPEN_MPI_AS_ROOT}, (
        f"running as root with Open MPI's mpiexec ({mpiexec}), which refuses root unless told: set "
        f"{'=1 and '.join(OPEN_MPI_AS_ROOT)}=1 for its ranks"
    )


def place_on_gpus(device: str, ranks: Sequence[int], what: str = "worker") -> tuple[dict[int, str], str]:
    """Where each of this node's workers (or all-reduce ranks) computes, and the one line that says so.

    As torchrun places local ranks: with ``device`` ``cuda`` the i-th of ``ranks`` runs on GPU i mod G, G the
    GPUs visible (CUDA_VISIBLE_DEVICES included); ``cuda:0,2`` names the GPUs to go round; ``cuda:N`` puts
    every one on GPU N; ``cpu`` keeps them all on the CPU (and says nothing).  Shards never take a GPU."""
    if not ranks:
        return {}, ""
    try:
        gpus = backend.gpu_indices(device)
    except backend.DeviceError as exc:
        raise LaunchError(f"--device {device}: {exc}") from None
    if not gpus:
        return {r: "cpu" for r in ranks}, ""
    placed = {r: f"cuda:{gpus[i % len(gpus)]}" for i, r in enumerate(ranks)}
    shared = f"; {len(ranks)} {what}s share {len(gpus)} GPU(s)" if len(ranks) > len(gpus) else ""
    return placed, (
        f"{what}s on GPUs: "
        + ", ".join(f"{r} on {d}" for r, d in placed.items())
        + f" ({backend.cuda_device_count()} visible{shared}; shards on the CPU)"
    )


def busy_poll(processes: int) -> tuple[int, str]:
    """``[cluster] busy_poll_us`` for ``processes`` psgd processes on this machine, and the one line that says so:
    a waiting end watches for its answer (protocol.BUSY_POLL_US) only where each process has a core of its own, as a
    watch takes the core a process waits on; one more process than cores and the watching cost steps (2 workers and
    a shard on 2 cores ran at half speed, benchmarks/RESULTS.md)."""
    cores = threads.available_cores()
    if processes <= cores:
        return protocol.BUSY_POLL_US, (
            f"{processes} process(es) on {cores} core(s): a data connection watches "
            f"{protocol.BUSY_POLL_US} µs for its answer before it sleeps "
            "([cluster] busy_poll_us to change)"
        )
    return 0, f"{processes} process(es) on {cores} core(s): data connections sleep at once ([cluster] busy_poll_us)"


def device_flags(device: str) -> list[str]:
    """What tells a worker (or rank) the device :func:`place_on_gpus` chose for it (the CPU: nothing)."""
    return [] if device == "cpu" else ["--device", device]


def shown_flags(log: Path, log_flags: list[str]) -> list[str]:
    """The flags of the process whose output the terminal shows: its bar and its warnings where stderr is a
    terminal, else its log lines (a bar's redraws would litter a file or a pipe); its whole log goes to ``log``
    either way (the file its stdout goes to)."""
    return ["--log-file", str(log), *(["-q"] if bar_wanted(None) else [*log_flags, "--no-progress"])]
