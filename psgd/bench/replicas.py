"""What a replica per shard costs an async job, and how soon it takes over.

1. Steps/s with and without ``[cluster] replicas = 1``: ``psgd launch --mode ps --policy async --shards 2 --workers 2
   --set model.hidden=[H]`` as a user runs it, the two kinds interleaved round by round, on this machine's loopback
   and on emulated links (``--network 1gbit``: every shard, replica and worker a host of its own in a network
   namespace, its link shaped to the rate; a shard's replica on the next shard's host, as ``psgd launch`` places it
   on the next node); with ``--overlap``, ``[cluster] overlap = true`` (the next pull beside the push, which waits
   for the replica).  The figure is the workers' aggregate steps/s while all were stepping (their metrics, as
   ``psgd bench scaling`` reads them); the ratio is with / without, per round, then the median.
2. Failover: two shards, each a ``psgd-server`` primary and a ``psgd-server --replica``, and two ``psgd-worker``
   processes on loopback; once the job is under way shard 0's primary is SIGKILLed, and the seconds from the kill
   to the first push applied after it (the replica's version, polled every 5 ms, moving past what it held at the
   kill) are taken, with the final check that the replica applied every push the workers counted as done.
3. A replica that does not keep up: one ``psgd-server`` primary and one ``psgd-worker`` (async), and at the
   replica's address a follower of the job's own (the token, the replica's claimed address) that answers every
   frame half a second late (slow) or never (silent), connecting again whenever it is cut off; the primary's
   versions/s over ``--window`` seconds from the moment the bound had passed (the follower cut off and timed out:
   the primary's log says when it may follow again), against the same job with no follower at all, from its first
   push acknowledged alone (``--parts follow``; the cost, 1 - rate / the alone rate, is what such a follower takes
   from the job once found out, its come-backs after each time out included).

    psgd bench replicas                               # loopback only: about a minute on 2 cores
    psgd bench replicas --parts follow --window 40    # a slow and a silent follower: about 3 minutes
    psgd bench replicas --network loopback,1gbit --repeats 3 --json replicas.json     # as root: a few minutes
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from psgd.bench.chaos.processes import command, free_port_pair, job_token
from psgd.bench.limits import machine
from psgd.config.parsing import comma_list
from psgd.errors import ClusterError
from psgd.launcher.supervise import dying_with_parent

DESCRIPTION = __doc__
SHARDS, WORKERS = 2, 2
BOUND = 300.0  # seconds a run may take at most


class ReplicaBenchError(ClusterError):
    """A run could not be measured (a process failed, the job did not finish in time)."""


def _argv(hidden: int, epochs: int, replicas: int, run_dir: Path, overlap: bool = False) -> list[str]:
    return [
        "launch",
        "--mode",
        "ps",
        "--policy",
        "async",
        "--shards",
        str(SHARDS),
        "--workers",
        str(WORKERS),
        "--set",
        f"model.hidden=[{hidden}]",
        "--epochs",
        str(epochs),
        "--replicas",
        str(replicas),
        "--set",
        f"cluster.overlap={str(overlap).lower()}",
        "--no-progress",
        "--json",
        "--run-dir",
        str(run_dir),
        "--timeout",
        f"{BOUND:g}",
    ]


def steps_per_second(
    network: str, hidden: int, epochs: int, replicas: int, folder: Path, overlap: bool = False
) -> dict:
    """One launch; its aggregate steps/s while every worker stepped, and what its --json said."""
    from psgd.bench.hosted import Network, launch_argv
    from psgd.bench.scaling.measure import ps_rates, read_steps

    run_dir = folder / "run"
    argv = _argv(hidden, epochs, replicas, run_dir, overlap)
    if network == "loopback":
        done = subprocess.run(
            [sys.executable, "-m", "psgd.cli.main", *argv], capture_output=True, text=True, timeout=BOUND + 60
        )
    else:
        with Network(network, SHARDS, WORKERS) as net:
            done = subprocess.run(launch_argv(net, folder, argv), capture_output=True, text=True, timeout=BOUND + 60)
    if done.returncode != 0:
        raise ReplicaBenchError(
            f"psgd {' '.join(argv)} exited with status {done.returncode}: {done.stderr.strip()[-1500:]}"
        )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rates = ps_rates([read_steps(run_dir / f"worker-{r}.jsonl") for r in range(WORKERS)])
    return {
        "steps_per_second": rates["steps_per_s"],
        "accuracy": result["test_accuracy"],
        "versions": result["versions"],
        "failed_over": result.get("failed_over", {}),
    }


def throughput(
    networks: list[str], hidden: int, epochs: int, repeats: int, folder: Path, say=print, overlap: bool = False
) -> list[dict]:
    """For each network: ``repeats`` rounds of (without, with) a replica; the medians and the ratio."""
    rows = []
    for network in networks:
        runs: dict[int, list[dict]] = {0: [], 1: []}
        for i in range(repeats):
            for replicas in (0, 1):
                runs[replicas].append(
                    steps_per_second(network, hidden, epochs, replicas, folder / f"{network}-{replicas}-{i}", overlap)
                )
        ratios = [b["steps_per_second"] / a["steps_per_second"] for a, b in zip(runs[0], runs[1])]
        row = {
            "network": network,
            "hidden": hidden,
            "epochs": epochs,
            "overlap": overlap,
            "without": statistics.median(r["steps_per_second"] for r in runs[0]),
            "with": statistics.median(r["steps_per_second"] for r in runs[1]),
            "ratio": statistics.median(ratios),
            "ratios": ratios,
            "runs": runs,
        }
        rows.append(row)
        say(
            f"{network:>8}, MLP [{hidden}]{', overlap' if overlap else ''}: "
            f"{row['without']:7.1f} steps/s without a replica, {row['with']:7.1f} "
            f"with ({row['ratio']:.2f}x; rounds {', '.join(f'{r:.2f}' for r in ratios)})"
        )
    return rows


def _status(address: str) -> dict | None:
    from psgd.ops.reach import Connect, read_status

    try:
        return read_status(address, Connect(timeout=2, token=os.environ.get("PSGD_TOKEN", "")))
    except Exception:  # not answering (yet, or any more)
        return None


def failover(folder: Path, epochs: int, at: float) -> dict:
    """One job with a replica per shard; shard 0's primary SIGKILLed at ``at`` of the pushes; the figures."""
    from psgd.config import JobConfig, to_toml
    from psgd.data.sharding import steps_per_epoch
    from psgd.job import build_job

    folder.mkdir(parents=True, exist_ok=True)
    taken: set[int] = set()
    ports = [free_port_pair(random.Random(), taken) for _ in range(2 * SHARDS)]
    config = JobConfig()
    config = config.apply_sets(
        [
            "cluster.policy=async",
            f"cluster.shards={SHARDS}",
            f"cluster.workers={WORKERS}",
            f"train.epochs={epochs}",
            "train.threads=1",
            "cluster.replicas=1",
            "cluster.request_timeout=30",
            "cluster.servers=" + ",".join(f"127.0.0.1:{p}" for p in ports[:SHARDS]),
            "cluster.replica_servers=" + ",".join(f"127.0.0.1:{p}" for p in ports[SHARDS:]),
        ]
    )
    job_file = folder / "job.toml"
    job_file.write_text(to_toml(config.to_dict()))
    total = WORKERS * steps_per_epoch(len(build_job(config).dataset.x_train), WORKERS, config.train.batch_size) * epochs
    server, worker = command("psgd-server", "psgd.cli.server"), command("psgd-worker", "psgd.cli.worker")
    job_token()  # the job's token, in the environment every process started here inherits
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, argv: list[str]) -> None:
        with open(folder / f"{name}.log", "w") as err:
            procs[name] = subprocess.Popen(
                dying_with_parent(argv, signal.SIGKILL), stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL
            )

    primary, replica = config.cluster.servers[0], config.cluster.recovery.replica_servers[0]
    deadline = time.monotonic() + BOUND
    try:
        for k in range(SHARDS):
            start(f"shard{k}", [*server, "-c", str(job_file), "--shard", str(k)])
            start(f"replica{k}", [*server, "-c", str(job_file), "--shard", str(k), "--replica"])
        for k in range(SHARDS):
            while (s := _status(config.cluster.servers[k])) is None or s["replica_lag"] != 0:
                if time.monotonic() > deadline:
                    raise ReplicaBenchError(f"shard {k}'s replica did not follow within {BOUND:.0f}s")
                time.sleep(0.05)  # polling the primary's Status, with a deadline
        for r in range(WORKERS):
            start(f"worker{r}", [*worker, "-c", str(job_file), "--rank", str(r), "--no-progress"])
        while (s := _status(primary)) is None or s["version"] < at * total:
            if time.monotonic() > deadline or any(procs[f"worker{r}"].poll() is not None for r in range(WORKERS)):
                raise ReplicaBenchError(f"the job ended or stalled before {at:.0%} of its pushes")
            time.sleep(0.01)  # polling the primary's version, with a deadline
        held = _status(replica)["version"]
        killed = time.monotonic()
        procs["shard0"].send_signal(signal.SIGKILL)
        while (s := _status(replica)) is None or s["role"] != "primary" or s["version"] <= held:
            if time.monotonic() > deadline:
                raise ReplicaBenchError("no push was applied after the kill")
            time.sleep(0.005)  # polling the replica's version, with a deadline
        applied = time.monotonic() - killed
        for r in range(WORKERS):
            code = procs[f"worker{r}"].wait(max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise ReplicaBenchError(
                    f"worker {r} exited with status {code}: {(folder / f'worker{r}.log').read_text()[-1500:]}"
                )
        final = _status(replica)
    except subprocess.TimeoutExpired:
        raise ReplicaBenchError(f"the job did not end within {BOUND:.0f}s") from None
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
    return {
        "pushes": total,
        "killed_at_version": held,
        "kill_to_next_push_seconds": applied,
        "final_version": final["version"],
        "lost": total - final["version"],
        "failovers": final["counters"].get("failovers", 0),
    }


#: a follower of the job's own that answers late ("slow") or never ("silent"): argv job file, kind, host, data port,
#: the address it listens at (the replica's, where it answers for its ticket); it connects again whenever it is cut
#: off or refused
FOLLOWER = r"""
import os, secrets, socket, sys, time
from psgd.config import JobConfig
from psgd.job import describe_job
from psgd.server import build_shard
from psgd.server.durable import stream
from psgd.server.durable.replica import Replication
from psgd.server.net.service import ShardServer
from psgd.wire.tls import NO_TLS
from psgd.wire import protocol
job = JobConfig.load(sys.argv[1])
kind, host, port, me = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
core = build_shard(describe_job(job), 0)
token = os.environ["PSGD_TOKEN"]
pair = Replication(core, me, f"{host}:0", second=True, token=token)  # never started: its ticket is set here
ShardServer(core, me, replicated=True, token=token).start()
while True:
    try:
        pair.ticket = secrets.token_hex(16)
        sock = stream.connect(host, port, me, token, core.plan.hash, NO_TLS, 5.0, pair.ticket)
        if kind == "silent":
            sock.settimeout(None)
            while sock.recv(1 << 20):
                pass
        else:
            reader = stream.Reader(core)
            while True:
                time.sleep(0.5)
                reader.take(sock)
    except Exception:
        pass
    time.sleep(0.5)
"""


def lagging(folder: Path, kind: str, window: float, hidden: int) -> dict:
    """The primary's versions/s over ``window`` seconds once the bound had passed, with a follower of ``kind``
    ("slow", "silent") at its replica's address, or none ("none")."""
    from psgd.config import JobConfig, to_toml

    folder.mkdir(parents=True, exist_ok=True)
    taken: set[int] = set()
    primary_port, replica_port = (free_port_pair(random.Random(), taken) for _ in range(2))
    config = JobConfig()
    config = config.apply_sets(
        [
            "cluster.policy=async",
            "cluster.shards=1",
            "cluster.workers=1",
            "train.epochs=100000",
            "train.threads=1",
            f"model.hidden=[{hidden}]",
            "cluster.replicas=1",
            f"cluster.servers=127.0.0.1:{primary_port}",
            f"cluster.replica_servers=127.0.0.1:{replica_port}",
        ]
    )
    job_file = folder / "job.toml"
    job_file.write_text(to_toml(config.to_dict()))
    server, worker = command("psgd-server", "psgd.cli.server"), command("psgd-worker", "psgd.cli.worker")
    job_token()  # the job's token, in the environment every process started here inherits
    procs: list[subprocess.Popen] = []

    def start(name: str, argv: list[str]) -> None:
        with open(folder / f"{name}.log", "w") as err:
            procs.append(
                subprocess.Popen(
                    dying_with_parent(argv, signal.SIGKILL),
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                )
            )

    address = config.cluster.servers[0]
    deadline = time.monotonic() + BOUND
    try:
        start("primary", [*server, "-c", str(job_file), "--shard", "0"])
        while (s := _status(address)) is None or not s.get("data_port"):
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise ReplicaBenchError(f"the primary did not start: {(folder / 'primary.log').read_text()[-800:]}")
            time.sleep(0.05)  # polling the primary's Status, with a deadline
        if kind != "none":
            start(
                "follower",
                [
                    sys.executable,
                    "-c",
                    FOLLOWER,
                    str(job_file),
                    kind,
                    "127.0.0.1",
                    str(s["data_port"]),
                    config.cluster.recovery.replica_servers[0],
                ],
            )
        start("worker", [*worker, "-c", str(job_file), "--rank", "0", "--no-progress"])
        # from the moment the bound has passed: the primary first acknowledges a push without a copy (no follower),
        # or it has found the follower unable to keep up and timed it out (its log says when it may follow again)
        log = folder / "primary.log"
        while (
            (s := _status(address)) is None
            or not s["counters"].get("unreplicated")
            or (kind != "none" and "may follow again in" not in log.read_text())
        ):
            if time.monotonic() > deadline or procs[-1].poll() is not None:
                raise ReplicaBenchError(f"the primary never went on alone ({kind} follower)")
            time.sleep(0.05)  # polling the primary's counters and log, with a deadline
        began, first = time.monotonic(), s["version"]
        time.sleep(window)  # the window measured: the job runs meanwhile
        s = _status(address)
        if s is None:
            raise ReplicaBenchError("the primary stopped answering")
        rate = (s["version"] - first) / (time.monotonic() - began)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
    cut = (folder / "primary.log").read_text().count("did not keep up")
    return {
        "follower": kind,
        "versions_per_second": rate,
        "window_seconds": window,
        "cut_off": cut,
        "unreplicated": s["counters"].get("unreplicated", 0),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--network",
        default="loopback",
        type=lambda t: comma_list(t, what="networks"),
        help="where the steps/s are measured: loopback and/or emulated links such as 1gbit, 10gbit "
        "(namespaces: needs root and ip; default loopback)",
    )
    parser.add_argument("--hidden", type=int, default=256, help="the MLP's hidden width (default 256)")
    parser.add_argument("--epochs", type=int, default=6, help="epochs of each launch (default 6)")
    parser.add_argument(
        "--repeats", type=int, default=2, help="rounds of (without, with) per network, and of the failover (default 2)"
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="launch with [cluster] overlap = true: the next pull goes beside the push, which waits for the replica",
    )
    parser.add_argument(
        "--at", type=float, default=0.3, help="kill the primary once this part of the pushes is applied (default 0.3)"
    )
    parser.add_argument(
        "--parts",
        default="throughput,failover",
        type=lambda t: comma_list(t, what="parts"),
        help="which parts to run: throughput, failover, follow (default throughput,failover)",
    )
    parser.add_argument(
        "--window",
        type=float,
        default=40.0,
        help="follow: seconds measured once the primary "
        "went on alone (default 40: one come-back of the follower after its 30 s time out)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE")


def run_from_args(args: argparse.Namespace) -> int:
    if args.hidden < 1 or args.epochs < 1 or args.repeats < 1 or not 0 < args.at < 1 or args.window <= 0:
        print("psgd bench replicas: --hidden, --epochs and --repeats must be >= 1, --at between 0 and 1, --window > 0")
        return 2
    unknown = sorted(set(args.parts) - {"throughput", "failover", "follow"})
    if unknown:
        print(f"psgd bench replicas: unknown part(s) {', '.join(unknown)} (parts: throughput, failover, follow)")
        return 2
    print(
        f"machine: {machine()}; async, MLP [{args.hidden}] on the digits: {SHARDS} shards and {WORKERS} workers "
        "(throughput, failover), 1 shard and 1 worker (follow)",
        flush=True,
    )
    rows, kills, follows = [], [], []
    with tempfile.TemporaryDirectory(prefix="psgd-replicas-") as tmp:
        try:
            if "throughput" in args.parts:
                rows = throughput(
                    args.network,
                    args.hidden,
                    args.epochs,
                    args.repeats,
                    Path(tmp),
                    say=lambda line: print(line, flush=True),
                    overlap=args.overlap,
                )
            for i in range(args.repeats if "failover" in args.parts else 0):
                kills.append(failover(Path(tmp) / f"failover-{i}", args.epochs, args.at))
                k = kills[-1]
                print(
                    f"failover {i}: shard 0's primary SIGKILLed at version {k['killed_at_version']}: the next push "
                    f"applied {k['kill_to_next_push_seconds'] * 1000:.0f} ms later, by its replica; "
                    f"{k['final_version']} of {k['pushes']} pushes applied at the end ({k['lost']} lost)",
                    flush=True,
                )
            for kind in ("none", "slow", "silent") if "follow" in args.parts else ():
                follows.append(lagging(Path(tmp) / f"follow-{kind}", kind, args.window, args.hidden))
                f, alone = follows[-1], follows[0]["versions_per_second"]
                print(
                    f"follower {kind}: {f['versions_per_second']:.1f} versions/s over {args.window:g}s once the "
                    f"bound had passed (cut off {f['cut_off']} time(s) in all)"
                    + (
                        f"; {1 - f['versions_per_second'] / alone:.1%} below no follower at all"
                        if kind != "none"
                        else ""
                    ),
                    flush=True,
                )
        except ReplicaBenchError as exc:
            print(f"psgd bench replicas: {exc}")
            return 1
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": machine(), "rows": rows, "failovers": kills, "followers": follows}, indent=2)
        )
        print(f"written to {args.json}")
    return 0 if all(k["lost"] == 0 for k in kills) else 1
