"""Chaos: the shards and workers of running jobs are faulted, and invariants are checked after each fault.

``run_chaos(minutes, seed, kinds)`` runs small jobs one after another (the
digits, softmax or MLP; 2 shards and 2-3 workers; sync or async; tensors over
the data path or over gRPC), each started the way users start them
(``psgd-server -c job.toml --shard K --bind ... --checkpoint-dir D``,
``psgd-worker -c job.toml --rank R --metrics F``, the user's environment),
and faults them while they train.  Everything random is drawn from one seeded
generator before a run starts, so ``--seed`` replays the same jobs and the
same faults (their timing follows the machine).

Workers are paced (``--delay fixed:0.02``) so that a job trains for about
10 s whatever its model.  Faults (``KINDS``), each injected when the slowest
worker reaches a drawn fraction of its steps:

- ``kill-shard``: SIGKILL a shard, restart it at the same address (it
  restores its newest checkpoint, the workers find it again);
- ``restart-shard``: SIGTERM a shard (it exits 0 with a last checkpoint),
  start it again: a graceful restart loses nothing;
- ``kill-worker``: SIGKILL a worker a few ms into a step (mid-pull or
  mid-push), restart it at once or after its lease ran out (it continues from
  the clock the shards hold);
- ``stop-shard``, ``stop-worker``: SIGSTOP for 0.5-3 s, then SIGCONT (longer
  than the 2 s lease: the shard drops the worker, which registers again);
- ``hostile``: idle TCP connections and connections sending random bytes,
  held against every shard's gRPC and data ports for a few seconds;
- ``netcut`` (as root, with ``ip netns``): the run's processes live in network
  namespaces made for it (veth pairs on a bridge, 10.99.1.x) and one host's
  link goes down for 1-3 s; skipped, with the reason, where namespaces
  cannot be made;
- ``sigterm``: the run ends by SIGTERM to every process at once (each must
  exit 0 within 10 s) instead of training to the end.

Invariants (the ``check_*`` functions, pure, on plain data): the job finishes
or stops within its bounds (every wait here is bounded: a stall is a
violation); no update is applied twice (a shard's version never exceeds the
updates its pushes could make: the sum of the workers' clocks under async,
the largest clock under sync; a shard that was never killed lost none); the
counters add up; a restarted shard restores at least its newest checkpoint;
the weights stay finite; every process exits with the documented code (0
when done or after SIGTERM, -9 when killed); nothing is leaked (temporary
files, more than ``--keep-checkpoints`` checkpoints, checkpoints that do not
match their manifest, stray port files, processes).  Each violation carries
the seed, the run, the faults so far and the ends of the logs.

``psgd bench``-style command line: ``benchmarks/chaos.py`` (see :func:`main`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import dataclasses
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from psgd.parsing import Parser

KINDS = ("kill-shard", "restart-shard", "kill-worker", "stop-shard", "stop-worker", "hostile", "netcut", "sigterm")
PY = sys.executable
IP = shutil.which("ip") or "/usr/sbin/ip"

SHARDS = 2
FAULTS_PER_RUN = 3            # draws per run (``sigterm`` among them ends the run)
STEPS_PER_WORKER = 420        # about how many steps each worker trains (epochs are rounded from it)
PACE = "fixed:0.02"           # psgd-worker --delay: steps of a known length, whatever the model (about 10 s a job)
KEEP = 2                      # --keep-checkpoints
CHECKPOINT_EVERY = 0.3        # --checkpoint-every
LEASE = 2.0                   # [cluster] lease_seconds: a dropped worker stalls a sync round this long
REQUEST_TIMEOUT = 15.0        # [cluster] request_timeout
JOIN_TIMEOUT = 30.0           # [cluster] join_timeout (processes start slowly on a loaded machine)
STOP_BOUND = 10.0             # every process must be gone this long after SIGTERM
START_BOUND = 45.0            # a shard must listen, a worker log its first step, within this
STALL_BOUND = 40.0            # no worker clock moving for this long while training: a hang
RUN_BOUND = 240.0             # no run may take longer
MIN_ACCURACY = 0.8            # a finished job on the digits must have learned something
SUBNET = "10.99.1"
NS_PORT = 50051


# -- invariants: pure checks on plain data; each returns its problems in words (empty: fine) ---------------
def check_exactly_once(policy: str, versions: Mapping[int, int], clocks: Mapping[int, int]) -> list[str]:
    """No update applied twice: every distinct (worker, clock) push makes at most one update.

    ``versions``: shard -> version; ``clocks``: worker -> how many steps it may
    have pushed.  Under sync a round is one update, so a version is at most the
    largest clock; otherwise at most the sum of the clocks.
    """
    if policy == "sync":
        bound, what = max(clocks.values(), default=0), "the largest worker clock (one update per sync round)"
    else:
        bound, what = sum(clocks.values()), "the sum of the workers' clocks (one update per push)"
    return [f"shard {k}: version {v} exceeds {bound}, {what}: an update was applied twice"
            for k, v in sorted(versions.items()) if v > bound]


def check_no_loss(policy: str, versions: Mapping[int, int], total: int, workers: int, restarted: Iterable[int],
                  worker_kills: int) -> list[str]:
    """A finished job's shards that were never killed lost no update (a graceful restart loses none).

    Sync: every round of the ``total`` closes once, so the version is ``total``.
    Async: every push is applied, except that a worker killed between its
    pushes to two shards skips that clock on one of them (one per kill).
    """
    restarted = set(restarted)
    out = []
    for k, v in sorted(versions.items()):
        if k in restarted:
            continue
        if policy == "sync" and v != total:
            out.append(f"shard {k}: version {v} after a finished sync job of {total} rounds (it was never killed): "
                       f"{'rounds were lost' if v < total else 'rounds were applied twice'}")
        elif policy != "sync" and v < workers * total - worker_kills:
            out.append(f"shard {k}: version {v} after a finished async job of {workers} x {total} pushes with "
                       f"{worker_kills} worker kill(s) (it was never killed): {workers * total - worker_kills - v} "
                       "update(s) lost")
    return out


def check_counters(policy: str, shard: int, version: int, counters: Mapping[str, Any]) -> list[str]:
    """A shard's counters add up: ``applied`` is its version, and every counted push has one outcome."""
    out = []
    if "applied" in counters and int(counters["applied"]) != version:
        out.append(f"shard {shard}: counters say {counters['applied']} update(s) applied, its version is {version}")
    if "pushes" in counters:
        parts = ["accumulated", "duplicates", "late", "rejected"] + ([] if policy == "sync" else ["applied"])
        outcomes = sum(int(counters.get(k, 0)) for k in parts)
        if int(counters["pushes"]) != outcomes:
            out.append(f"shard {shard}: {counters['pushes']} push(es) counted but {outcomes} outcome(s) "
                       f"({', '.join(f'{k} {counters.get(k, 0)}' for k in parts)})")
    return out


def check_restore(shard: int, newest_before: int | None, restored: int | None, version: int | None) -> list[str]:
    """A restarted shard loses at most the updates since its last checkpoint: it restores the newest one
    there was when it was killed (``newest_before``; None: there was none)."""
    if newest_before is None:
        return []
    if restored is None:
        return [f"shard {shard} restarted from its initial weights although checkpoint ckpt-{newest_before} "
                "was there: every update it had applied is lost"]
    out = []
    if restored < newest_before:
        out.append(f"shard {shard} restored version {restored}, older than its newest checkpoint "
                   f"ckpt-{newest_before} at the kill: {newest_before - restored} update(s) lost")
    if version is not None and version < newest_before:
        out.append(f"shard {shard} is at version {version} after its restart, below its newest checkpoint "
                   f"ckpt-{newest_before} at the kill")
    return out


def check_finite(weights: Mapping[str, np.ndarray], where: str) -> list[str]:
    """The weights hold no NaN or Inf."""
    out = []
    for name, w in sorted(weights.items()):
        bad = int(np.size(w) - np.count_nonzero(np.isfinite(w)))
        if bad:
            out.append(f"{where}: {name} holds {bad} non-finite value(s) (NaN/Inf)")
    return out


def check_exit(name: str, code: int | None, expected: int, why: str) -> list[str]:
    """A process exits with the documented code (``None``: it had not exited within its bound)."""
    if code is None:
        return [f"{name} had not exited {why}"]
    if code != expected:
        return [f"{name} exited with status {code}, expected {expected} ({why})"]
    return []


def check_files(folder: Path, ckpt_root: Path, shards: int, keep: int, port_files: Sequence[Path],
                final_versions: Mapping[int, int] | None = None,
                at_least: Mapping[int, int] | None = None) -> list[str]:
    """After a clean stop nothing is leaked: no temporary file anywhere under ``folder``; per shard at most
    ``keep`` checkpoints, each npz with its manifest and matching its checksum; the newest one is the final
    version (``final_versions``) or at least ``at_least``; each port file names an address."""
    from psgd.server import checkpoint

    out = [f"temporary file left behind: {p.relative_to(folder)}" for p in sorted(folder.rglob("*"))
           if p.is_file() and (p.name.endswith(".tmp") or ".tmp." in p.name)]
    jobs = [p for p in sorted(ckpt_root.iterdir()) if p.is_dir()] if ckpt_root.is_dir() else []
    if len(jobs) > 1:
        out.append(f"{ckpt_root} holds {len(jobs)} job folders ({', '.join(p.name for p in jobs)}), expected one")
    for k in range(shards):
        for where in [j / f"shard-{k}" for j in jobs]:
            held = checkpoint.versions(where)
            if len(held) > keep:
                out.append(f"{where.relative_to(folder)}: {len(held)} checkpoints kept, at most {keep} allowed")
            for npz in sorted(where.glob("ckpt-*.npz")):
                if not npz.with_suffix(".json").exists():
                    out.append(f"{npz.relative_to(folder)} has no manifest (left by an interrupted checkpoint)")
            for v in held:
                try:
                    checkpoint.load(where, v, arrays=False)
                except checkpoint.CheckpointError as exc:
                    out.append(f"{where.relative_to(folder)}/ckpt-{v} is damaged: {exc}")
            newest = held[0] if held else None
            if final_versions is not None and k in final_versions and newest != final_versions[k]:
                out.append(f"shard {k} stopped at version {final_versions[k]} but its newest checkpoint is "
                           f"{'none' if newest is None else f'ckpt-{newest}'}: the last checkpoint was not written")
            if at_least is not None and k in at_least and (newest is None or newest < at_least[k]):
                out.append(f"shard {k} was at version {at_least[k]} before it stopped but its newest checkpoint is "
                           f"{'none' if newest is None else f'ckpt-{newest}'}: the last checkpoint was not written")
    for path in port_files:
        try:
            text = path.read_text().strip()
        except OSError:
            out.append(f"port file {path.name} is missing")
            continue
        host, _, port = text.rpartition(":")
        if not host or not port.isdigit():
            out.append(f"port file {path.name} holds {text!r}, not HOST:PORT")
    return out


# -- the plan: everything random, drawn before each run -----------------------------------------------------
@dataclasses.dataclass
class Fault:
    kind: str
    at: float              # the slowest worker's progress (fraction of its steps) at which it is injected
    target: int = 0        # shard or worker index (a worker that has finished passes it on to the next)
    seconds: float = 0.0   # stop, hostile, netcut: how long
    count: int = 0         # hostile: connections of each sort per port
    role: str = ""         # netcut: whose link ("shard" or "worker")
    offset: float = 0.0    # kill-worker: seconds after the worker logged a step (so that it lands mid-step)

    def describe(self) -> str:
        who = {"netcut": self.role}.get(self.kind, self.kind.rpartition("-")[2])
        text = self.kind + (f" {who} {self.target}" if who in ("shard", "worker") else "")
        if self.kind == "kill-worker":
            text += f" {self.offset * 1000:.1f} ms after a step"
        if self.kind == "hostile":
            text += f" {self.count}+{self.count} connection(s) per port"
        if self.seconds:
            text += f", restarted {self.seconds:.1f}s later" if self.kind == "kill-worker" else \
                f" for {self.seconds:.1f}s"
        return text


@dataclasses.dataclass
class RunSpec:
    index: int
    policy: str
    data_path: bool
    model: str
    workers: int
    exit_when_done: bool
    faults: list[Fault]
    end: str                 # "finish" (train to the end) or "sigterm" (every process at once)
    end_at: float            # sigterm: the progress at which it is sent
    namespaces: bool         # the run lives in network namespaces (it has a netcut)

    def describe(self) -> str:
        return (f"{self.policy}, {self.model}, {self.workers} workers, data path {'on' if self.data_path else 'off'}"
                + (", in namespaces" if self.namespaces else "") + (", --exit-when-done" if self.exit_when_done else "")
                + f"; faults: {', '.join(f.describe() for f in self.faults) or 'none'}; end: {self.end}")


class Planner:
    """Draws run after run from one seeded generator; fault kinds come from a shuffled bag (every kind once
    before any twice), and so do the (policy, data path) pairs, so a few runs cover them all."""

    def __init__(self, seed: int, kinds: Sequence[str], namespaces: str | None):
        self.rng = random.Random(seed)
        self.kinds = list(kinds)
        self.why_no_namespaces = namespaces  # None: namespaces can be made
        self._bag: list[str] = []
        self._pairs: list[tuple[str, bool]] = []
        self.skipped: dict[str, str] = {}

    def _draw(self) -> str:
        if not self._bag:
            self._bag = list(self.kinds)
            self.rng.shuffle(self._bag)
        return self._bag.pop()

    def next(self, index: int) -> RunSpec:
        rng = self.rng
        if not self._pairs:
            self._pairs = [(p, d) for p in ("sync", "async") for d in (True, False)]
            rng.shuffle(self._pairs)
        policy, data_path = self._pairs.pop()
        drawn = [self._draw() for _ in range(FAULTS_PER_RUN)]
        workers = rng.choice((2, 3))
        faults = []
        for kind in drawn:
            if kind == "sigterm":
                continue
            if kind == "netcut" and self.why_no_namespaces:
                self.skipped["netcut"] = self.why_no_namespaces
                continue
            fault = Fault(kind, 0.0)
            if kind.endswith("-shard"):
                fault.target = rng.randrange(SHARDS)
            elif kind.endswith("-worker"):
                fault.target = rng.randrange(workers)
                fault.offset = round(rng.uniform(0.0, 0.012), 4)
                if kind == "kill-worker" and rng.random() < 0.5:  # restarted after its lease ran out
                    fault.seconds = round(rng.uniform(LEASE + 0.5, LEASE + 2.0), 2)
            if kind.startswith("stop-"):
                fault.seconds = round(rng.uniform(0.5, 3.0), 2)
            elif kind == "hostile":
                fault.seconds, fault.count = round(rng.uniform(1.5, 3.0), 2), rng.randint(8, 24)
            elif kind == "netcut":
                fault.role = rng.choice(("shard", "worker"))
                fault.target = rng.randrange(SHARDS if fault.role == "shard" else workers)
                fault.seconds = round(rng.uniform(1.0, 3.0), 2)
            faults.append(fault)
        for fault, at in zip(faults, sorted(rng.uniform(0.1, 0.7) for _ in faults)):
            fault.at = round(at, 3)
        end = "sigterm" if "sigterm" in drawn else "finish"
        end_at = round(max([0.5] + [f.at + 0.1 for f in faults]) if end == "sigterm" else 1.0, 3)
        return RunSpec(index, policy, data_path, rng.choice(("softmax", "mlp")), workers,
                       exit_when_done=end == "finish" and rng.random() < 0.5, faults=faults, end=end,
                       end_at=min(end_at, 0.9), namespaces=any(f.kind == "netcut" for f in faults))


# -- network namespaces ------------------------------------------------------------------------------------
def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([IP, *args], capture_output=True, text=True, timeout=20, check=check)


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if not os.path.exists(IP):
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (or CAP_SYS_ADMIN)"
    name = f"psgdchaos{os.getpid()}probe"
    try:
        made = _ip("netns", "add", name, check=False)
        if made.returncode != 0:
            return f"ip netns add failed: {made.stderr.strip() or made.returncode}"
        ran = subprocess.run([IP, "netns", "exec", name, "true"], capture_output=True, text=True, timeout=20)
        if ran.returncode != 0:
            return f"ip netns exec failed: {ran.stderr.strip() or ran.returncode}"
        for args in (("link", "add", "br0", "type", "bridge"),
                     ("link", "add", "va", "type", "veth", "peer", "name", "vb")):
            made = _ip("-n", name, *args, check=False)
            if made.returncode != 0:  # e.g. a kernel without bridge or veth support
                return f"ip {' '.join(args)} failed: {made.stderr.strip() or made.returncode}"
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"ip netns: {exc}"
    finally:
        _ip("netns", "del", name, check=False)


class Namespaces:
    """Hosts in network namespaces made for one run: a hub namespace holds a bridge, and each host has one end
    of a veth pair (``eth0``, 10.99.1.x) whose other end (``vI`` in the hub) is on the bridge.  Nothing on
    the machine's own interfaces is touched; :meth:`close` removes every namespace made."""

    def __init__(self, hosts: Mapping[str, str]):
        self.hosts = dict(hosts)  # name -> address
        self.tag = f"psgdchaos{os.getpid()}x{os.urandom(2).hex()}"
        self.made: list[str] = []
        self.ports: dict[str, str] = {}  # host -> its veth end on the bridge

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def _add(self, host: str) -> str:
        name = self.ns(host)
        _ip("netns", "add", name)
        self.made.append(name)
        return name

    def build(self) -> "Namespaces":
        hub = self._add("hub")
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, (host, address) in enumerate(self.hosts.items()):
            ns = self._add(host)
            self.ports[host] = f"v{i}"
            _ip("-n", hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", hub, "link", "set", f"v{i}", "master", "br0")
            _ip("-n", hub, "link", "set", f"v{i}", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def prefix(self, host: str) -> list[str]:
        return [IP, "netns", "exec", self.ns(host)]

    def link(self, host: str, up: bool) -> None:
        _ip("-n", self.ns("hub"), "link", "set", self.ports[host], "up" if up else "down")

    def close(self) -> list[str]:
        """Remove every namespace made; returns those that could not be removed."""
        left = []
        for name in reversed(self.made):
            if _ip("netns", "del", name, check=False).returncode != 0:
                left.append(name)
        self.made = left
        return left


# -- processes -------------------------------------------------------------------------------------------
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child is killed when the harness dies, however it dies (no process is left)."""
    def set_up() -> None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
    return set_up


def command(script: str, module: str) -> list[str]:
    """How a user starts ``script``: the console script beside this Python (a venv's), else on PATH, else
    ``python -m module``."""
    beside = Path(PY).parent / script
    if beside.exists() and os.access(beside, os.X_OK):
        return [str(beside)]
    found = shutil.which(script)
    return [found] if found else [PY, "-m", module]


def free_port_pair(rng: random.Random, taken: set[int]) -> int:
    """A port p with p and p + 1 free on 127.0.0.1, below the ephemeral range (so that no outgoing
    connection takes it while its shard is down for a restart)."""
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        if port in taken or port + 1 in taken:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        taken.update((port, port + 1))
        return port
    raise RuntimeError("no free pair of ports between 20000 and 32000 on 127.0.0.1")


def tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").rstrip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _last_error(path: Path) -> str:
    """The last line of a log that reports an error, else its last three lines."""
    lines = tail(path, 40).splitlines()
    found = next((line for line in reversed(lines) if "error" in line.lower()), None)
    return found or " | ".join(lines[-3:]) or "(empty log)"


def processes_mentioning(text: str) -> list[int]:
    """Live (not zombie) processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and text in cmdline:
            found.append(int(entry.name))
    return found


@dataclasses.dataclass
class Proc:
    name: str                # shard0, worker1, ...
    incarnation: int
    popen: subprocess.Popen
    log: Path
    metrics: Path | None = None  # a worker's --metrics file


HOSTILE = """
import json, sys
from psgd.bench.chaos import hostile
print(json.dumps(hostile(**json.loads(sys.argv[1]))))
"""


def hostile(targets: Sequence[Sequence[Any]], count: int, seconds: float, seed: int = 0) -> dict:
    """Hold ``count`` idle TCP connections and ``count`` connections sending random bytes against each
    (host, port) for ``seconds``; reconnects those the peer closes (bounded).  Returns what happened."""
    rng = random.Random(seed)
    stats = {"opened": 0, "refused": 0, "closed_by_peer": 0, "bytes_sent": 0}
    budget = [20 * count * len(targets)]  # connection attempts in all, reconnections included

    def connect(host: str, port: int) -> socket.socket | None:
        if budget[0] <= 0:
            return None
        budget[0] -= 1
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(1.0)
        try:
            s.connect((host, int(port)))
        except OSError:
            stats["refused"] += 1
            s.close()
            return None
        s.setblocking(False)
        stats["opened"] += 1
        return s

    idle = [connect(h, p) for h, p in targets for _ in range(count)]
    noisy = [[connect(h, p), (h, p)] for h, p in targets for _ in range(count)]
    end = time.monotonic() + seconds
    for _ in range(int(seconds / 0.05) + 1):
        if time.monotonic() >= end:
            break
        for pair in noisy:
            s, (host, port) = pair
            if s is None:
                pair[0] = connect(host, port)
                continue
            try:
                stats["bytes_sent"] += s.send(rng.randbytes(rng.randint(1, 512)))
            except BlockingIOError:
                pass
            except OSError:
                stats["closed_by_peer"] += 1
                s.close()
                pair[0] = None
        time.sleep(0.05)  # the pace of the noise, not synchronization
    for s in idle + [pair[0] for pair in noisy]:
        if s is None:
            continue
        with contextlib.suppress(OSError):
            if s.recv(1) == b"":
                stats["closed_by_peer"] += 1
        s.close()
    return stats


class Abort(Exception):
    """The run cannot go on (a hang, a failed process); recorded as a violation of ``invariant``."""

    def __init__(self, message: str, invariant: str = "bounded"):
        super().__init__(message)
        self.invariant = invariant


class Cluster:
    """The processes of one job, on 127.0.0.1 at fixed ports or on hosts in network namespaces."""

    def __init__(self, spec: RunSpec, folder: Path, port_rng: random.Random, net: Namespaces | None):
        from psgd.config import JobConfig, to_toml
        from psgd.data.sharding import steps_per_epoch
        from psgd.partition import PartitionPlan
        from psgd.job import build_job

        self.spec, self.folder, self.net = spec, folder, net
        job = JobConfig()
        job.apply_sets([f"model.name={spec.model}", *(["model.hidden=[32]"] if spec.model == "mlp" else []),
                        "train.threads=1", f"cluster.policy={spec.policy}", f"cluster.shards={SHARDS}",
                        f"cluster.workers={spec.workers}", f"cluster.lease_seconds={LEASE}",
                        f"cluster.request_timeout={REQUEST_TIMEOUT}", f"cluster.join_timeout={JOIN_TIMEOUT}",
                        f"cluster.data_path={'true' if spec.data_path else 'false'}"])
        self.built = build_job(job)
        spe = steps_per_epoch(len(self.built.dataset.x_train), spec.workers, job.train.batch_size)
        self.epochs = max(1, round(STEPS_PER_WORKER / spe))
        job.apply_sets([f"train.epochs={self.epochs}"])
        self.total = spe * self.epochs
        if net is None:
            taken: set[int] = set()
            self.binds = [f"127.0.0.1:{free_port_pair(port_rng, taken)}" for _ in range(SHARDS)]
        else:
            self.binds = [f"{net.hosts[f's{k}']}:{NS_PORT}" for k in range(SHARDS)]
        job.override("cluster.servers", list(self.binds))
        self.job = job
        self.plan = PartitionPlan(self.built.model.specs(), SHARDS, job.cluster.slice_bytes)
        self.path = folder / "job.toml"
        self.path.write_text(to_toml(job.to_dict()))
        self.ckpt = folder / "ckpt"
        self.port_files = [folder / f"shard{k}.addr" for k in range(SHARDS)]
        self.procs: dict[str, Proc] = {}    # the current incarnation of each process
        self.history: list[Proc] = []       # every incarnation
        self.server, self.worker = command("psgd-server", "psgd.cli.server"), command("psgd-worker", "psgd.cli.worker")
        self.psgd = command("psgd", "psgd.cli.main")

    # -- starting and stopping ---------------------------------------------------------------------
    def _host(self, name: str) -> str:
        return name[0] + name[-1] if name.startswith(("shard", "worker")) else name

    def prefix(self, host: str) -> list[str]:
        """What runs a command on ``host`` (nothing on loopback)."""
        return self.net.prefix(host) if self.net else []

    def _start(self, name: str, argv: list[str], metrics: Path | None = None) -> Proc:
        incarnation = sum(1 for p in self.history if p.name == name)
        log = self.folder / f"{name}.{incarnation}.log"
        with open(log, "w") as err:
            popen = subprocess.Popen(self.prefix(self._host(name)) + argv, stdout=subprocess.DEVNULL, stderr=err,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent(os.getpid()))
        proc = Proc(name, incarnation, popen, log, metrics)
        self.procs[name] = proc
        self.history.append(proc)
        return proc

    def start_shard(self, k: int) -> Proc:
        self.port_files[k].unlink(missing_ok=True)
        argv = [*self.server, "-c", str(self.path), "--shard", str(k), "--bind", self.binds[k],
                "--port-file", str(self.port_files[k]), "--checkpoint-dir", str(self.ckpt),
                "--checkpoint-every", str(CHECKPOINT_EVERY), "--keep-checkpoints", str(KEEP),
                *(["--exit-when-done"] if self.spec.exit_when_done else [])]
        return self._start(f"shard{k}", argv)

    def wait_listening(self, k: int, bound: float = START_BOUND) -> None:
        proc = self.procs[f"shard{k}"]
        deadline = time.monotonic() + bound
        while not self.port_files[k].exists():
            if proc.popen.poll() is not None:
                raise Abort(f"shard {k} exited with status {proc.popen.returncode} while starting: "
                            f"{_last_error(proc.log)}", "finishes")
            if time.monotonic() > deadline:
                raise Abort(f"shard {k} did not listen within {bound:.0f}s")
            time.sleep(0.05)  # polling for the port file, with a deadline

    def start_worker(self, r: int) -> Proc:
        name = f"worker{r}"
        incarnation = sum(1 for p in self.history if p.name == name)
        metrics = self.folder / f"{name}.{incarnation}.jsonl"
        argv = [*self.worker, "-c", str(self.path), "--rank", str(r), "--servers", ",".join(self.binds),
                "--no-progress", "--metrics", str(metrics), "--delay", PACE]
        return self._start(name, argv, metrics)

    def alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.popen.poll() is None

    def signal(self, name: str, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.procs[name].popen.send_signal(signum)

    def wait(self, name: str, bound: float) -> int | None:
        try:
            return self.procs[name].popen.wait(bound)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        for proc in self.history:
            if proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.send_signal(signal.SIGCONT)
                    proc.popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(10)

    # -- reading -------------------------------------------------------------------------------------
    def records(self, r: int) -> list[dict]:
        """Worker ``r``'s metrics lines, every incarnation in order."""
        out = []
        for proc in self.history:
            if proc.name == f"worker{r}" and proc.metrics is not None and proc.metrics.exists():
                for line in proc.metrics.read_text().splitlines():
                    if line.endswith("}"):
                        out.append({**json.loads(line), "incarnation": proc.incarnation})
        return out

    def clocks(self) -> dict[int, int]:
        """Each worker's last logged step clock (-1: none yet); a worker that is done counts its final clock."""
        out = {}
        for r in range(self.spec.workers):
            last = -1
            for rec in self.records(r):
                if rec["event"] == "step":
                    last = max(last, rec["clock"])
                elif rec["event"] == "done":
                    last = max(last, rec["clock"] - 1)
            out[r] = last
        return out

    def status(self, timeout: float = 5.0) -> list[dict | None]:
        """Every shard's Status (None where it did not answer within ``timeout``)."""
        if self.net is not None:
            return self._status_command(timeout)
        import grpc

        from psgd.channel import open_channel
        from psgd.proto import ps_pb2, ps_pb2_grpc

        out: list[dict | None] = []
        for address in self.binds:
            with open_channel(address) as channel:
                try:
                    reply = ps_pb2_grpc.ParameterServerStub(channel).Status(ps_pb2.StatusRequest(), timeout=timeout)
                except grpc.RpcError:
                    out.append(None)
                    continue
            counters = json.loads(reply.counters_json or "{}")
            out.append(_shard_view(reply.shard, reply.version, reply.incarnation, counters))
        return out

    def _status_command(self, timeout: float) -> list[dict | None]:
        """``psgd status --json`` from the observer's host in the namespaces."""
        try:
            done = subprocess.run(self.prefix("obs") + [*self.psgd, "status", "--json", "--sample", "0", "--timeout",
                                                         str(timeout), *self.binds],
                                  capture_output=True, text=True, timeout=timeout * 2 + 30)
            rows = json.loads(done.stdout)["shards"]
        except (subprocess.TimeoutExpired, ValueError, KeyError):
            return [None] * SHARDS
        return [_shard_view(row["shard"], row["version"], row["incarnation"], row["counters"])
                if "version" in row else None for row in rows]

    def weights(self, timeout: float = 10.0) -> dict[str, np.ndarray]:
        """The current weights, pulled as an observer (``psgd export`` from the observer's host in namespaces)."""
        if self.net is None:
            from psgd.worker.client import fetch_weights

            return fetch_weights(self.binds, self.plan, timeout=timeout)
        from psgd.export import read_npz

        out = self.folder / "observed.npz"
        done = subprocess.run(self.prefix("obs") + [*self.psgd, "export", "-c", str(self.path), "--timeout",
                                                     str(timeout), str(out)],
                              capture_output=True, text=True, timeout=timeout * 3 + 30)
        if done.returncode != 0:
            raise RuntimeError(f"psgd export exited with status {done.returncode}: {done.stderr.strip()[-500:]}")
        try:
            return read_npz(out)
        finally:
            out.unlink(missing_ok=True)

    def newest_checkpoint(self, k: int) -> int | None:
        """The newest checkpoint (with its manifest) shard ``k`` has written, whatever the job folder."""
        from psgd.server import checkpoint

        found = [v for folder in self.ckpt.glob(f"*/shard-{k}") for v in checkpoint.versions(folder)]
        return max(found, default=None)

    def accuracy(self, weights: Mapping[str, np.ndarray]) -> float:
        from psgd.loop import evaluate
        from psgd.job import params_to_device

        b = self.built
        return float(evaluate(b.model, params_to_device(weights, b.device), b.dataset.x_test, b.dataset.y_test,
                              b.device)[1])


def _shard_view(shard: int, version: int, incarnation: str, counters: Mapping[str, Any]) -> dict:
    counters = dict(counters)
    written = counters.pop("checkpoint", None) or {}
    return {"shard": shard, "version": version, "incarnation": incarnation,
            "restored_version": counters.pop("restored_version", None), "checkpoint_version": written.get("version"),
            "counters": {k: v for k, v in counters.items() if isinstance(v, int)}}


# -- one run ---------------------------------------------------------------------------------------------
class Run:
    """One job, its faults and its checks; :meth:`execute` returns the run's record."""

    def __init__(self, spec: RunSpec, folder: Path, seed: int, say: Callable[[str], None]):
        self.spec, self.folder, self.seed, self.say = spec, folder, seed, say
        self.violations: list[dict] = []
        self.done_faults: list[str] = []
        self.restarted: set[int] = set()
        self.worker_kills = 0
        self.seen: dict[int, tuple[str, int]] = {}  # shard -> (incarnation, version) last seen
        self.started = time.monotonic()
        self.cluster: Cluster | None = None
        self.net: Namespaces | None = None
        self.accuracy: float | None = None
        self.finished = False
        self.counts: dict[str, int] = {}

    # -- recording -------------------------------------------------------------------------------
    def violate(self, invariant: str, problems: Iterable[str]) -> None:
        for problem in problems:
            logs = {}
            if self.cluster is not None:
                for name, proc in sorted(self.cluster.procs.items()):
                    logs[f"{name}.{proc.incarnation}"] = tail(proc.log)
            record = {"seed": self.seed, "run": self.spec.index, "invariant": invariant, "message": problem,
                      "run_spec": self.spec.describe(), "faults_so_far": list(self.done_faults),
                      "at_seconds": round(time.monotonic() - self.started, 1), "folder": str(self.folder),
                      "logs": logs}
            self.violations.append(record)
            self.say(f"  VIOLATION [{invariant}] seed {self.seed} run {self.spec.index}: {problem} "
                     f"(faults so far: {'; '.join(self.done_faults) or 'none'})")

    def left(self) -> float:
        return self.started + RUN_BOUND - time.monotonic()

    # -- the run -------------------------------------------------------------------------------------
    def execute(self) -> dict:
        spec = self.spec
        try:
            if spec.namespaces:
                hosts = {f"s{k}": f"{SUBNET}.{10 + k}" for k in range(SHARDS)}
                hosts.update({f"w{r}": f"{SUBNET}.{20 + r}" for r in range(spec.workers)})
                hosts["obs"] = f"{SUBNET}.30"
                self.net = Namespaces(hosts)
                self.net.build()
            self.cluster = Cluster(spec, self.folder, random.Random(), self.net)
            self._start()
            for fault in spec.faults:
                self._wait_progress(fault.at, f"progress {fault.at:.0%} before {fault.describe()}")
                self._inject(fault)
                self.counts[fault.kind] = self.counts.get(fault.kind, 0) + 1
                self._check_running(after=fault.describe())
            if spec.end == "sigterm":
                self._wait_progress(spec.end_at, f"progress {spec.end_at:.0%} before the SIGTERM")
                self.counts["sigterm"] = 1
                self._sigterm_all()
            else:
                self._finish()
        except Abort as exc:
            self.violate(exc.invariant, [str(exc)])
        except Exception as exc:  # the harness itself failed: say so with the run's context
            self.violate("harness", [f"{type(exc).__name__}: {exc}"])
        finally:
            self._close()
        return {"run": spec.index, "spec": spec.describe(), "policy": spec.policy, "model": spec.model,
                "workers": spec.workers, "data_path": spec.data_path, "namespaces": spec.namespaces,
                "end": spec.end, "faults": self.done_faults, "seconds": round(time.monotonic() - self.started, 1),
                "finished": self.finished, "accuracy": self.accuracy, "violations": len(self.violations),
                "steps_per_worker": self.cluster.total if self.cluster else None}

    def _start(self) -> None:
        c = self.cluster
        for k in range(SHARDS):
            c.start_shard(k)
        for k in range(SHARDS):
            c.wait_listening(k)
        for r in range(self.spec.workers):
            c.start_worker(r)

    def _wait_progress(self, fraction: float, what: str) -> None:
        """Until the slowest worker has done ``fraction`` of its steps (or every worker has exited);
        a clock that does not move for STALL_BOUND, or the run's bound, is a hang."""
        c = self.cluster
        target = math.ceil(fraction * c.total)
        last, moved = None, time.monotonic()
        while True:
            clocks = c.clocks()
            for r in range(self.spec.workers):
                proc = c.procs[f"worker{r}"]
                if proc.popen.poll() not in (None, 0):
                    raise Abort(f"worker {r} exited with status {proc.popen.returncode} at clock {clocks[r]} of "
                                f"{c.total}: {_last_error(proc.log)}", "finishes")
            if min(clocks.values()) + 1 >= target:
                return
            if not any(c.alive(f"worker{r}") for r in range(self.spec.workers)):
                return
            for k in range(SHARDS):
                proc = c.procs[f"shard{k}"]
                if proc.popen.poll() is not None:
                    raise Abort(f"shard {k} exited with status {proc.popen.returncode} while workers were training "
                                f"(clocks {clocks}): {_last_error(proc.log)}", "finishes")
            if clocks != last:
                last, moved = clocks, time.monotonic()
            if time.monotonic() - moved > STALL_BOUND:
                raise Abort(f"no worker clock moved for {STALL_BOUND:.0f}s waiting for {what} (clocks {clocks}, "
                            f"versions {[s and s['version'] for s in c.status()]}): a hang")
            if self.left() <= 0:
                raise Abort(f"the run took longer than {RUN_BOUND:.0f}s waiting for {what} (clocks {clocks})")
            time.sleep(0.1)  # polling the workers' metrics, with a deadline

    # -- faults ------------------------------------------------------------------------------------
    def _inject(self, fault: Fault) -> None:
        c = self.cluster
        began = time.monotonic()
        note = ""
        if fault.kind == "kill-shard":
            note = self._kill_shard(fault.target)
        elif fault.kind == "restart-shard":
            note = self._restart_shard(fault.target)
        elif fault.kind == "kill-worker":
            r = self._live_worker(fault.target)
            note = self._kill_worker(r, fault.offset, fault.seconds) if r is not None else \
                "skipped: every worker had finished"
        elif fault.kind in ("stop-shard", "stop-worker"):
            if fault.kind == "stop-shard":
                name = f"shard{fault.target}"
            else:
                r = self._live_worker(fault.target)
                name = f"worker{r}" if r is not None else ""
            if name and c.alive(name):
                c.signal(name, signal.SIGSTOP)
                time.sleep(fault.seconds)  # the length of the pause is the fault
                c.signal(name, signal.SIGCONT)
            else:
                note = "skipped: every worker had finished"
        elif fault.kind == "hostile":
            note = self._hostile(fault)
        elif fault.kind == "netcut":
            host = ("s" if fault.role == "shard" else "w") + str(fault.target)
            self.net.link(host, up=False)
            try:
                time.sleep(fault.seconds)  # the length of the cut is the fault
            finally:
                self.net.link(host, up=True)
        text = f"{fault.describe()} at {time.monotonic() - self.started:.1f}s"
        self.done_faults.append(text + (f" ({note})" if note else ""))
        self.say(f"  run {self.spec.index}: {text}, {time.monotonic() - began:.1f}s{'; ' + note if note else ''}")

    def _live_worker(self, hint: int) -> int | None:
        n = self.spec.workers
        for i in range(n):
            r = (hint + i) % n
            if self.cluster.alive(f"worker{r}"):
                return r
        return None

    def _kill_shard(self, k: int) -> str:
        c = self.cluster
        name = f"shard{k}"
        c.signal(name, signal.SIGKILL)
        self.violate("exit-code", check_exit(f"shard {k} (SIGKILLed)", c.wait(name, STOP_BOUND), -signal.SIGKILL,
                                             "after SIGKILL"))
        newest = c.newest_checkpoint(k)  # what was on disk when it died
        c.start_shard(k)
        self.restarted.add(k)
        c.wait_listening(k)
        view = self._status_of(k, START_BOUND)
        self.violate("checkpoint", check_restore(k, newest, view["restored_version"], view["version"]))
        return f"newest checkpoint ckpt-{newest}, restored {view['restored_version']}, version {view['version']}"

    def _restart_shard(self, k: int) -> str:
        """SIGTERM: it exits 0 within 10 s with a last checkpoint of its last version; started again, it
        restores that checkpoint, so a graceful restart loses nothing."""
        c = self.cluster
        name = f"shard{k}"
        c.signal(name, signal.SIGTERM)
        code = c.wait(name, STOP_BOUND)
        self.violate("exit-code", check_exit(f"shard {k}", code, 0, "within 10 s of SIGTERM"))
        if code is None:
            c.signal(name, signal.SIGKILL)
            c.wait(name, STOP_BOUND)
            self.restarted.add(k)
        stopped = self._stopped_at().get(k)
        newest = c.newest_checkpoint(k)
        if stopped is not None and newest != stopped:
            self.violate("checkpoint", [f"shard {k} stopped at version {stopped} on SIGTERM but its newest "
                                        f"checkpoint is ckpt-{newest}"])
        c.start_shard(k)
        c.wait_listening(k)
        view = self._status_of(k, START_BOUND)
        self.violate("checkpoint", check_restore(k, stopped if stopped is not None else newest,
                                                 view["restored_version"], view["version"]))
        return f"stopped at version {stopped}, restored {view['restored_version']}"

    def _kill_worker(self, r: int, offset: float, down: float) -> str:
        c = self.cluster
        name = f"worker{r}"
        self._aim(c.procs[name], offset)
        c.signal(name, signal.SIGKILL)
        self.violate("exit-code", check_exit(f"worker {r} (SIGKILLed)", c.wait(name, STOP_BOUND), -signal.SIGKILL,
                                             "after SIGKILL"))
        self.worker_kills += 1
        before = c.clocks()[r]
        time.sleep(down)  # how long it stays dead is part of the fault
        proc = c.start_worker(r)
        deadline = time.monotonic() + START_BOUND
        while not (proc.metrics.exists() and proc.metrics.read_text().strip()):
            if proc.popen.poll() is not None:
                raise Abort(f"worker {r}, restarted after SIGKILL at clock {before}, exited with status "
                            f"{proc.popen.returncode} before its first step: {_last_error(proc.log)}", "finishes")
            if time.monotonic() > deadline:
                raise Abort(f"worker {r}, restarted after SIGKILL at clock {before}, logged no step within "
                            f"{START_BOUND:.0f}s")
            time.sleep(0.05)  # polling for its first metrics line, with a deadline
        first = json.loads(proc.metrics.read_text().splitlines()[0])
        resumed = first["clock"]
        problems = []
        if before >= 0 and resumed < before + 1:
            problems.append(f"worker {r} logged clock {before} before it was killed but continued at clock "
                            f"{resumed}: it repeats steps the shards hold")
        if self.spec.policy != "sync" and before >= 0 and resumed > before + 2:
            problems.append(f"worker {r} logged clock {before} before it was killed but continued at clock "
                            f"{resumed}: async steps were skipped")
        self.violate("continue", problems)
        return f"last clock {before}, continued at {resumed}"

    @staticmethod
    def _aim(proc: Proc, offset: float) -> None:
        """Wait (at most 2 s) for the worker's next metrics line, then ``offset`` seconds: its next step is under
        way then (pull, gradient, push; the pace's pause comes after the push)."""
        def size() -> int:
            try:
                return proc.metrics.stat().st_size
            except OSError:
                return -1

        first, deadline = size(), time.monotonic() + 2.0
        while size() == first and time.monotonic() < deadline and proc.popen.poll() is None:
            time.sleep(0.0005)  # watching for the line, briefly, with a deadline
        time.sleep(offset)  # the aim is the fault's own timing

    def _hostile(self, fault: Fault) -> str:
        c = self.cluster
        targets = []
        for address in c.binds:
            host, _, port = address.rpartition(":")
            targets += [(host, int(port)), (host, int(port) + 1)]
        before = self._versions()
        args = json.dumps({"targets": targets, "count": fault.count, "seconds": fault.seconds,
                           "seed": self.seed * 1000 + self.spec.index})
        done = subprocess.run(c.prefix("obs") + [PY, "-c", HOSTILE, args], capture_output=True, text=True,
                              timeout=fault.seconds + 60)
        after = self._versions()
        try:
            stats = json.loads(done.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            self.violate("harness", [f"the hostile client failed: {done.stderr.strip()[-500:]}"])
            return "hostile client failed"
        training = any(c.alive(f"worker{r}") for r in range(self.spec.workers))
        if training and None not in before + after and sum(after) <= sum(before):
            self.violate("starvation", [f"no shard applied an update during {fault.seconds:.1f}s of hostile "
                                        f"connections (versions {before} -> {after}; {stats})"])
        return (f"{stats['opened']} opened, {stats['closed_by_peer']} closed by the shards, versions "
                f"{before} -> {after}")

    # -- checks ----------------------------------------------------------------------------------
    def _status_of(self, k: int, bound: float) -> dict:
        deadline = time.monotonic() + bound
        proc = self.cluster.procs[f"shard{k}"]
        while True:
            view = self.cluster.status()[k]
            if view is not None:
                return view
            if proc.popen.poll() is not None:
                raise Abort(f"shard {k} exited with status {proc.popen.returncode} while it was expected to serve: "
                            f"{_last_error(proc.log)}", "finishes")
            if time.monotonic() > deadline:
                raise Abort(f"shard {k} did not answer Status within {bound:.0f}s")
            time.sleep(0.2)  # polling, with a deadline

    def _versions(self) -> list[int | None]:
        return [s and s["version"] for s in self.cluster.status()]

    def _check_shards(self, views: Sequence[dict], clocks: Mapping[int, int]) -> None:
        """Exactly-once and the counters on answers just read; ``clocks``: each worker's possible pushes."""
        policy = self.spec.policy
        self.violate("exactly-once", check_exactly_once(policy, {v["shard"]: v["version"] for v in views}, clocks))
        for v in views:
            self.violate("counters", check_counters(policy, v["shard"], v["version"], v["counters"]))
            seen = self.seen.get(v["shard"])
            if seen and seen[0] == v["incarnation"] and v["version"] < seen[1]:
                self.violate("monotonic", [f"shard {v['shard']}'s version went back from {seen[1]} to "
                                           f"{v['version']} without a restart"])
            self.seen[v["shard"]] = (v["incarnation"], v["version"])

    def _check_running(self, after: str) -> None:
        """After a fault: every shard answers, the counters hold, the weights are finite."""
        c = self.cluster
        for name, proc in c.procs.items():
            code = proc.popen.poll()
            if code not in (None, 0):
                raise Abort(f"{name} exited with status {code} after {after}: {_last_error(proc.log)}", "finishes")
        if not any(c.alive(f"worker{r}") for r in range(self.spec.workers)):
            return  # training is over: the final checks follow
        views = [self._status_of(k, REQUEST_TIMEOUT + 5) for k in range(SHARDS)]
        clocks = {r: last + 2 for r, last in c.clocks().items()}  # read after Status: + the push in flight
        self._check_shards(views, clocks)
        try:
            self.violate("finite", check_finite(c.weights(), f"weights after {after}"))
        except Exception as exc:  # a pull that fails after a fault is a finding too ...
            ended = self.spec.exit_when_done and not any(c.alive(f"worker{r}") for r in range(self.spec.workers))
            if not ended:  # ... unless training ended meanwhile and the shards left by themselves
                self.violate("observe", [f"the weights could not be pulled after {after}: {exc}"])

    def _finish(self) -> None:
        """Train to the end: every worker exits 0; the shards stop (by themselves with --exit-when-done, else
        on SIGTERM) and exit 0; then the last checks."""
        c, spec = self.cluster, self.spec
        self._wait_progress(1.0, "the end of training")
        for r in range(spec.workers):
            self.violate("exit-code", check_exit(f"worker {r}", c.wait(f"worker{r}", max(5.0, min(60.0, self.left()))),
                                                 0, "at the end of training"))
        done = {r: [x for x in c.records(r) if x["event"] == "done"] for r in range(spec.workers)}
        self.finished = all(d and d[-1]["clock"] == c.total for d in done.values())
        if not self.finished:
            self.violate("finishes", [f"worker {r} ended at clock {d[-1]['clock'] if d else '?'} of {c.total}"
                                      for r, d in done.items() if not d or d[-1]["clock"] != c.total])
        if spec.exit_when_done:
            for k in range(SHARDS):  # a restarted shard waits for the join deadline of workers that are done
                self.violate("exit-code", check_exit(f"shard {k} (--exit-when-done)",
                                                     c.wait(f"shard{k}", JOIN_TIMEOUT + STOP_BOUND), 0,
                                                     "within the join timeout + 10 s of the last worker's end"))
            views, weights = self._from_checkpoints()
        else:
            views = [self._status_of(k, REQUEST_TIMEOUT) for k in range(SHARDS)]
            weights = c.weights()
            for k in range(SHARDS):
                c.signal(f"shard{k}", signal.SIGTERM)
                self.violate("exit-code", check_exit(f"shard {k}", c.wait(f"shard{k}", STOP_BOUND), 0,
                                                     "within 10 s of SIGTERM"))
        versions = {v["shard"]: v["version"] for v in views}
        self._check_shards(views, {r: c.total for r in range(spec.workers)})
        if self.finished:
            self.violate("lost-update", check_no_loss(spec.policy, versions, c.total, spec.workers, self.restarted,
                                                      self.worker_kills))
        if weights is not None:
            self.violate("finite", check_finite(weights, "the final weights"))
            self.accuracy = round(c.accuracy(weights), 4)
            if self.finished and self.accuracy < MIN_ACCURACY:
                self.violate("trained", [f"final test accuracy {self.accuracy:.3f} < {MIN_ACCURACY}"])
        self.violate("files", check_files(self.folder, c.ckpt, SHARDS, KEEP, c.port_files,
                                          final_versions=self._stopped_at() or versions))

    def _sigterm_all(self) -> None:
        """SIGTERM to every process at once: each exits 0 within 10 s; the last checkpoints hold."""
        c = self.cluster
        before = {k: s["version"] for k, s in enumerate(c.status()) if s is not None}
        for name in list(c.procs):
            if c.alive(name):
                c.signal(name, signal.SIGTERM)
        deadline = time.monotonic() + STOP_BOUND
        for name in c.procs:
            self.violate("exit-code", check_exit(name, c.wait(name, max(0.1, deadline - time.monotonic())), 0,
                                                 "within 10 s of SIGTERM to every process"))
        stopped = self._stopped_at()
        self.violate("files", check_files(self.folder, c.ckpt, SHARDS, KEEP, c.port_files, final_versions=stopped,
                                          at_least=before))
        views, weights = self._from_checkpoints()
        clocks = {r: last + 2 for r, last in c.clocks().items()}  # + a push stopped mid-step, without its line
        self._check_shards(views, clocks)
        if weights is not None:
            self.violate("finite", check_finite(weights, "the last checkpoints"))
            self.accuracy = round(c.accuracy(weights), 4)

    def _stopped_at(self) -> dict[int, int]:
        """The version each shard's last incarnation said it stopped at (its log's last line)."""
        out = {}
        for k in range(SHARDS):
            found = re.findall(r"stopped at version (\d+)", tail(self.cluster.procs[f"shard{k}"].log, 5))
            if found:
                out[k] = int(found[-1])
        return out

    def _from_checkpoints(self) -> tuple[list[dict], dict[str, np.ndarray] | None]:
        """The shards' views (version, counters) and the joined weights, from their newest checkpoints."""
        from psgd.export import join_checkpoints
        from psgd.server import checkpoint

        c = self.cluster
        views = []
        for k in range(SHARDS):
            newest = c.newest_checkpoint(k)
            folder = next((f for f in c.ckpt.glob(f"*/shard-{k}") if newest in checkpoint.versions(f)), None)
            if folder is None:
                self.violate("files", [f"shard {k} left no checkpoint"])
                continue
            m = checkpoint.load(folder, newest, arrays=False).manifest
            views.append(_shard_view(k, int(m["version"]), "final", m.get("counters", {})))
        try:
            return views, join_checkpoints(c.job, c.ckpt, mixed=True).weights
        except Exception as exc:  # said as a finding: the last checkpoints should always join
            self.violate("files", [f"the last checkpoints cannot be joined: {exc}"])
            return views, None

    def _close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
            left = processes_mentioning(str(self.folder))  # every child was reaped: anything here escaped
            if left:
                self.violate("processes", [f"process(es) {left} mentioning the run's folder are still there after "
                                           "it ended"])
        if self.net is not None:
            left = self.net.close()
            if left:
                self.violate("harness", [f"network namespaces {left} could not be removed"])


# -- the whole thing -------------------------------------------------------------------------------------
def parse_kinds(text: str | Sequence[str] | None) -> list[str]:
    """``"kill-shard,hostile"`` (or a list, or None/"all" for every kind) -> kinds, checked."""
    if text is None or text == "all":
        return list(KINDS)
    items = [k.strip() for k in (text.split(",") if isinstance(text, str) else text) if k.strip()]
    unknown = [k for k in items if k not in KINDS]
    if unknown or not items:
        raise ValueError(f"unknown fault kind(s) {', '.join(unknown) or '(none given)'}: choose from "
                         f"{', '.join(KINDS)}")
    return list(dict.fromkeys(items))


def run_chaos(minutes: float, seed: int, kinds: str | Sequence[str] | None = None, out: str | os.PathLike | None = None,
              progress: bool = True, runs: int | None = None) -> dict:
    """Run faulted jobs for about ``minutes`` (the run in hand is finished; at least one run), or ``runs``
    runs; returns the figures: runs, faults by kind, violations (each with seed, faults and log tails),
    per-run durations and final accuracies.  ``out``: where the runs' folders go (default: a temporary
    folder, of which only the runs with violations are kept)."""
    from tqdm import tqdm

    kinds = parse_kinds(kinds)
    why_not = namespaces_unavailable() if "netcut" in kinds else None
    planner = Planner(seed, kinds, why_not)
    keep_all = out is not None
    root = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="psgd-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    budget = max(0.0, minutes * 60)
    began = time.monotonic()
    by_runs = runs is not None
    bar = tqdm(total=runs if by_runs else round(budget), unit="run" if by_runs else "s", desc="chaos",
               file=sys.stderr, disable=not (progress and sys.stderr.isatty()), leave=False, dynamic_ncols=True,
               bar_format="{desc}: {n_fmt}/{total_fmt}" + (" runs" if by_runs else "s") + " |{bar}|")

    def say(line: str) -> None:
        if progress:
            bar.write(line, file=sys.stderr)

    print(f"chaos: seed {seed} (replay with --seed {seed}); kinds {', '.join(kinds)}; runs in {root}",
          file=sys.stderr, flush=True)
    if why_not:
        print(f"chaos: netcut skipped: {why_not}", file=sys.stderr, flush=True)
    records, violations = [], []
    faults: dict[str, int] = dict.fromkeys(kinds, 0)
    try:
        index = 0
        while (runs is None and (index == 0 or time.monotonic() - began < budget)) or \
                (runs is not None and index < runs):
            spec = planner.next(index)
            folder = root / f"run-{index:03d}"
            if folder.exists():  # an earlier run into the same --out: its metrics logs would be appended to
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
            say(f"run {index}: {spec.describe()}")
            run = Run(spec, folder, seed, say)
            record = run.execute()
            records.append(record)
            violations += run.violations
            for kind, n in run.counts.items():
                faults[kind] = faults.get(kind, 0) + n
            say(f"run {index}: {'finished' if record['finished'] else 'ended'} in {record['seconds']:.1f}s, "
                f"accuracy {record['accuracy']}, {len(run.violations)} violation(s)")
            if not run.violations and not keep_all:
                shutil.rmtree(folder, ignore_errors=True)
            bar.n = index + 1 if by_runs else min(round(budget), round(time.monotonic() - began))
            bar.refresh()
            index += 1
    finally:
        bar.close()
        if not keep_all and not violations:
            shutil.rmtree(root, ignore_errors=True)
    for v in violations:
        print(f"chaos: VIOLATION [{v['invariant']}] seed {v['seed']} run {v['run']}: {v['message']}",
              file=sys.stderr)
    return {"seed": seed, "kinds": kinds, "minutes": minutes, "seconds": round(time.monotonic() - began, 1),
            "runs": len(records), "faults": faults, "faults_total": sum(faults.values()),
            "skipped": dict(planner.skipped), "violations": violations, "violation_count": len(violations),
            "durations": [r["seconds"] for r in records],
            "accuracies": [r["accuracy"] for r in records if r["finished"]], "run_records": records,
            "folder": str(root) if keep_all or violations else None}


def summary(result: Mapping[str, Any]) -> str:
    """The figures in a few lines."""
    faults = ", ".join(f"{k} {n}" for k, n in result["faults"].items())
    lines = [f"seed {result['seed']}: {result['runs']} run(s) in {result['seconds']:.0f}s, "
             f"{result['faults_total']} fault(s) ({faults}), {result['violation_count']} violation(s)",
             f"run durations (s): {', '.join(f'{d:.1f}' for d in result['durations'])}",
             f"final accuracies: {', '.join(f'{a:.3f}' for a in result['accuracies']) or '-'}"]
    lines += [f"skipped {k}: {why}" for k, why in result["skipped"].items()]
    lines += [f"VIOLATION [{v['invariant']}] run {v['run']}: {v['message']}" for v in result["violations"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to keep starting runs (default 10)")
    parser.add_argument("--seed", type=int, default=None, help="the seed to draw jobs and faults from (default: "
                                                               "a random one, printed)")
    parser.add_argument("--kinds", default="all", help=f"fault kinds, comma-separated (default all: {','.join(KINDS)})")
    parser.add_argument("--runs", type=int, default=None, help="stop after this many runs instead of --minutes")
    parser.add_argument("--out", metavar="DIR", help="keep every run's folder (job file, logs, checkpoints) here")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or per-fault lines")
    args = parser.parse_args(argv)
    try:
        kinds = parse_kinds(args.kinds)
    except ValueError as exc:
        parser.error(str(exc))
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "big")

    def stop(signum, frame):  # so that every process and namespace is cleaned up on the way out
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    result = run_chaos(args.minutes, seed, kinds, out=args.out, progress=not args.no_progress, runs=args.runs)
    print(summary(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if not result["violations"] else 1


if __name__ == "__main__":
    sys.exit(main())
