"""A shard's versions/s, its Status and its checkpoints under a flood of connections that never prove the token.

One shard (``psgd-server`` with a token, ``--checkpoint-dir``, ``--checkpoint-every 1``) and one worker
(``psgd-worker``) train softmax regression on the digits under async (a few hundred microseconds a step, so
whatever a flood costs the shard shows in every step), on this machine, as a user starts them.  Three windows
of ``--seconds`` each, measured from the shard's own Status:

1. undisturbed: versions/s, the checkpoints written, how long Status takes to answer;
2. ``idle``: as many TCP connections to the shard's gRPC port as the shard may open files (its own limit, read
   from /proc) and a tenth more, opened at once from processes of their own and held, sending nothing; those
   the shard closes stay closed;
3. ``reopened``: the same, but each connection the shard closes is opened again at once: a flood that never
   lets up.

In each flooded window the same figures, and then a worker that comes during the flood: the seconds from its
start to its first step.  The goal: versions/s at least half the undisturbed, Status answered, the new worker
in, checkpoints still written.

    psgd bench flood                      # about a minute
    psgd bench flood --seconds 20 --json flood.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from psgd.errors import ClusterError

START_BOUND = 120.0  # seconds for the shard to listen, a worker to step, a flood to open its connections
STATUS_TIMEOUT = 10.0  # seconds a Status call may take (then it counts as not answered)
KINDS = ("idle", "reopened")

FLOOD = r"""
import json, resource, selectors, socket, sys, threading, time
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
seconds, reopen = float(sys.argv[4]), sys.argv[5] == "1"
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()  # ends when stdin closes
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
stats = {"opened": 0, "failed": 0, "closed_by_shard": 0}
sel = selectors.DefaultSelector()
def open_one():
    s = socket.socket()
    s.settimeout(1.0)
    try:
        s.connect((host, port))
    except OSError:
        stats["failed"] += 1
        s.close()
        return False
    s.setblocking(False)
    sel.register(s, selectors.EVENT_READ)
    stats["opened"] += 1
    return True
misses = 0
while stats["opened"] < count and misses < 200:
    misses = 0 if open_one() else misses + 1
print("ready", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end and not done.is_set():
    for key, _ in sel.select(timeout=0.05):
        try:
            data = key.fileobj.recv(65536)
        except OSError:
            data = b""
        if data:
            continue
        sel.unregister(key.fileobj)
        key.fileobj.close()
        stats["closed_by_shard"] += 1
        if reopen:
            open_one()
print(json.dumps(stats), flush=True)
"""


class FloodError(ClusterError):
    """The measurement could not be taken (a process failed or did not start)."""


def _job(folder: Path, bind: str) -> Path:
    from psgd.config import JobConfig, to_toml

    config = JobConfig()
    config = config.apply_sets(
        [
            "model.name=softmax",
            "data.name=digits",
            "train.epochs=100000",
            "train.batch_size=16",
            "train.eval_every=0",
            "train.threads=1",
            "cluster.policy=async",
            "cluster.shards=1",
            "cluster.workers=3",
            "cluster.lease_seconds=60",
            "cluster.transport=tcp",
        ]
    )
    config = config.override("cluster.servers", [bind])
    path = folder / "job.toml"
    path.write_text(to_toml(config.to_dict()))
    return path


def _limit(pid: int) -> int:
    """The soft limit on open files of process ``pid``."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise FloodError(f"no limit on open files in /proc/{pid}/limits")


def _descriptors(pid: int) -> int:
    with contextlib.suppress(OSError):
        return len(list(Path(f"/proc/{pid}/fd").iterdir()))
    return -1


class _Shard:
    """Status of the shard at ``address``: each answer timed, each call that was not answered counted."""

    def __init__(self, address: str, token: str):
        from psgd.ops.reach import Connect

        self.address, self.connect = address, Connect(timeout=STATUS_TIMEOUT, token=token)
        self.unanswered: list[str] = []

    def status(self) -> tuple[dict, float, float] | None:
        """(Status, when it was asked, how long it took), or None where it was not answered."""
        import grpc

        from psgd.ops.reach import read_status

        asked = time.monotonic()
        try:
            reply = read_status(self.address, self.connect)
        except grpc.RpcError as exc:
            self.unanswered.append(f"{exc.code().name} ({exc.details()})")
            return None
        return reply, asked, time.monotonic() - asked


def _window(shard: _Shard, seconds: float, folder: Path, pid: int, metrics: Path) -> dict:
    """versions/s (the steps of the one worker, from its step records: under async one step is one version),
    Status's slowest answer and how many were not answered, the checkpoints written and the most descriptors the
    shard (``pid``) held, over ``seconds``."""
    began, wall, held, unanswered = time.monotonic(), time.time(), _descriptors(pid), len(shard.unanswered)
    answers = [a for a in [shard.status()] if a is not None]
    seen = set(_checkpoints(folder))
    written: set[int] = set()
    end = began + seconds
    for turn in range(int(seconds / 0.25) + 1):
        if time.monotonic() >= end:
            break
        time.sleep(0.25)  # the pace of looking at the checkpoint folder and the shard's descriptors
        written |= set(_checkpoints(folder)) - seen
        held = max(held, _descriptors(pid))
        if turn % 4 == 3 and (answer := shard.status()) is not None:
            answers.append(answer)
    if (answer := shard.status()) is not None:
        answers.append(answer)
    now = time.time()
    last = answers[-1][0]["counters"] if answers else {}
    return {
        "versions_per_s": _steps(metrics, wall, now) / (now - wall),
        "checkpoints_written": len(written),
        "status_slowest_s": max((a[2] for a in answers), default=None),
        "status_unanswered": len(shard.unanswered) - unanswered,
        "status_answered": len(answers),
        "seconds": time.monotonic() - began,
        "descriptors_held_at_most": held,
        "background_errors": last.get("background_errors"),
        "checkpoint_failures": last.get("checkpoint_failures"),
    }


def _steps(metrics: Path, start: float, end: float) -> int:
    """The steps a worker's records (``--metrics``) say it took between the wall-clock times ``start`` and ``end``."""
    count = 0
    for line in metrics.read_text().splitlines():
        if line.endswith("}"):
            record = json.loads(line)
            count += record.get("event") == "step" and start < float(record["time"]) <= end
    return count


def start_flood(
    host: str, port: str, count: int, seconds: float, reopen: bool, prefix: Sequence[str] = ()
) -> subprocess.Popen:
    """A process of :data:`FLOOD`'s holding ``count`` idle connections to ``host``:``port`` for ``seconds`` at most
    (``reopen``: each one closed is opened again), run after ``prefix`` (a network namespace's ``ip netns exec``)."""
    return subprocess.Popen(
        [*prefix, sys.executable, "-c", FLOOD, host, port, str(count), str(seconds), "1" if reopen else "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def ready(flood: subprocess.Popen, bound: float = START_BOUND) -> None:
    """Wait (``bound`` seconds at most) for a flood process to say it opened its connections; FloodError, with what
    it said on stderr, where it did not (it is killed then)."""
    if select.select([flood.stdout], [], [], bound)[0] and flood.stdout.readline().strip() == "ready":
        return
    flood.kill()
    flood.wait(5)
    raise FloodError(
        f"a flood process did not open its connections within {bound:.0f}s: {flood.stderr.read().strip()[-500:]}"
    )


def end_floods(floods: Sequence[subprocess.Popen]) -> tuple[dict[str, int], int]:
    """End each flood process (its stdin closed) and sum what they say they did: opened, failed, closed by the
    shard; second, how many said nothing (they are killed)."""
    stats, unread = {"opened": 0, "failed": 0, "closed_by_shard": 0}, 0
    for f in floods:
        with contextlib.suppress(OSError):
            f.stdin.close()
    for f in floods:
        try:
            f.wait(30)
            said = json.loads(f.stdout.read().strip().splitlines()[-1])
            stats = {k: stats[k] + said[k] for k in stats}
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            unread += 1
        if f.poll() is None:
            f.kill()
            f.wait(5)
    return stats, unread


def _checkpoints(folder: Path) -> list[int]:
    return [int(p.stem.split("-")[1]) for p in folder.glob("**/ckpt-*.json")]


def measure(seconds: float, folder: Path, say, connections: int = 0) -> dict:
    """The figures of every window (see the module's doc); ``connections``: how many a flood opens (0: the
    shard's own limit on open files and a tenth more)."""
    from psgd.bench.chaos.processes import command, end_all, free_port_pair, job_token, last_error
    from psgd.launcher.supervise import dying_with_parent

    token = job_token()
    bind = f"127.0.0.1:{free_port_pair(random.Random())}"
    path = _job(folder, bind)
    ckpt = folder / "ckpt"
    procs: list[tuple[subprocess.Popen, Path]] = []

    def start(argv: list[str], name: str) -> subprocess.Popen:
        log = folder / f"{name}.log"
        with open(log, "w") as err:
            proc = subprocess.Popen(
                dying_with_parent(argv, signal.SIGKILL), stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL
            )
        procs.append((proc, log))
        return proc

    def worker(rank: int) -> tuple[subprocess.Popen, Path]:
        metrics = folder / f"worker{rank}.jsonl"
        return start(
            [
                *command("psgd-worker", "psgd.cli.worker"),
                "-c",
                str(path),
                "--rank",
                str(rank),
                "--servers",
                bind,
                "--no-progress",
                "--metrics",
                str(metrics),
            ],
            f"worker{rank}",
        ), metrics

    def stepped(metrics: Path, proc: subprocess.Popen, what: str) -> float:
        started = time.monotonic()
        while '"event": "step"' not in (metrics.read_text() if metrics.exists() else ""):
            if proc.poll() is not None:
                raise FloodError(
                    f"{what} exited with status {proc.returncode}: {last_error(folder / (metrics.stem + '.log'))}"
                )
            if time.monotonic() - started > START_BOUND:
                raise FloodError(f"{what} took no step within {START_BOUND:.0f}s")
            time.sleep(0.05)  # polling for its first step, with a deadline
        return time.monotonic() - started

    port_file = folder / "shard.addr"
    try:
        shard_proc = start(
            [
                *command("psgd-server", "psgd.cli.server"),
                "-c",
                str(path),
                "--shard",
                "0",
                "--bind",
                bind,
                "--port-file",
                str(port_file),
                "--checkpoint-dir",
                str(ckpt),
                "--checkpoint-every",
                "1",
            ],
            "shard",
        )
        deadline = time.monotonic() + START_BOUND
        while not port_file.exists():
            if shard_proc.poll() is not None or time.monotonic() > deadline:
                raise FloodError(f"the shard did not listen: {last_error(folder / 'shard.log')}")
            time.sleep(0.05)  # polling for the port file, with a deadline
        proc, metrics = worker(0)  # the one that trains throughout
        stepped(metrics, proc, "worker 0")
        shard = _Shard(bind, token)
        limit = _limit(shard_proc.pid)
        result = {"shard_open_files_limit": limit, "seconds": seconds}
        say(f"the shard may open {limit} files; undisturbed window of {seconds:.0f}s")
        result["undisturbed"] = base = _window(shard, seconds, ckpt, shard_proc.pid, metrics)
        say(
            f"  undisturbed: {base['versions_per_s']:.0f} versions/s, {base['checkpoints_written']} checkpoints, "
            f"Status in {base['status_slowest_s'] * 1000:.0f} ms at most, "
            f"{base['descriptors_held_at_most']} descriptors"
        )
        host, _, port = bind.rpartition(":")
        for rank, kind in enumerate(KINDS, start=1):
            count = connections or limit + limit // 10
            per = max(1000, _limit(os.getpid()) - 200)  # connections a flood process may hold (its own limit)
            floods = [
                start_flood(host, port, min(per, count - i), seconds + START_BOUND, kind == "reopened")
                for i in range(0, count, per)
            ]
            figures: dict = {}
            try:
                figures = _window(shard, seconds, ckpt, shard_proc.pid, metrics)  # from the flood's first connection
                for f in floods:
                    ready(f)
                joiner, joined = worker(rank)
                figures["new_worker_first_step_s"] = stepped(joined, joiner, f"worker {rank}")
                joiner.terminate()
                joiner.wait(30)
            except FloodError as exc:  # this kind's figures are missing; said, and the next kind goes on
                figures["error"] = str(exc)
            finally:
                stats = end_floods(floods)[0]
            figures["connections"], figures["flood"] = count, stats
            result[kind] = figures
            if "error" in figures:
                say(f"  {kind} flood of {count} connections: {figures['error']}; the flood {stats}")
                continue
            figures["ratio"] = figures["versions_per_s"] / base["versions_per_s"]
            say(
                f"  {kind} flood of {count} connections: {figures['versions_per_s']:.0f} versions/s "
                f"({figures['ratio']:.2f}x), {figures['checkpoints_written']} checkpoints, Status in "
                f"{(figures['status_slowest_s'] or 0) * 1000:.0f} ms at most ({figures['status_unanswered']} of "
                f"{figures['status_unanswered'] + figures['status_answered']} not answered within "
                f"{STATUS_TIMEOUT:.0f}s), the shard held "
                f"{figures['descriptors_held_at_most']} descriptors at most, a new worker stepped after "
                f"{figures['new_worker_first_step_s']:.1f}s; the flood {stats}"
            )
        return result
    finally:
        end_all([proc for proc, _ in procs])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=10.0, metavar="S", help="each measurement window (default 10)")
    parser.add_argument(
        "--connections",
        type=int,
        default=0,
        metavar="N",
        help="connections each flood opens (default: the shard's limit on open files and a tenth more)",
    )
    parser.add_argument("--json", metavar="FILE", help="write the figures here")


def run_from_args(args: argparse.Namespace) -> int:
    from psgd.config import ConfigError

    if args.seconds <= 0:
        raise ConfigError(f"--seconds must be positive, got {args.seconds:g}")
    if args.connections < 0:
        raise ConfigError(f"--connections must be at least 0, got {args.connections}")
    with tempfile.TemporaryDirectory(prefix="psgd-flood-") as folder:
        try:
            result = measure(args.seconds, Path(folder), print, args.connections)
        except FloodError as exc:
            print(f"flood: {exc}")
            result = {"error": str(exc)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if "error" in result or any("error" in result.get(k, {}) for k in KINDS) else 0
