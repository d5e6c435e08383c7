"""What a killed shard costs a sync job with cuts, against the checkpoint interval.

Two shards (``psgd-server``) and two workers (``psgd-worker``) train the MLP on the digits in float64 under sync
with ``[cluster] checkpoint_rounds = K``, on this machine, as a user starts them.  For each interval K:

1. undisturbed: the job's wall time (the workers' start to their exit) and its rounds per second;
2. killed: the same job with shard 1 SIGKILLed once ``--at`` of the rounds are done, half-way between two cuts
   or later but two rounds short of the next (a kill loses about half an interval; the workers are paused a
   moment while shard 1's version is read, so that it lands there rather than on a cut), and started again at
   once (it comes back from its newest cut and the job goes back to it); the wall time, the rounds
   worker 0 computed again (and the rounds the shards undid), the seconds from the kill to the first round
   worker 0 finished after going back, and whether the final weights equal the undisturbed run's, to the bit.

The cost of a kill is the difference in wall time; the cuts' own cost shows in the undisturbed rounds per second
against a run without cuts (``K = 0``: checkpoints by seconds, none within so short a run), which comes first.

    psgd bench rollback                              # intervals 0, 5, 20, 50, 100: under a minute on 2 cores
    psgd bench rollback --epochs 40 --repeats 3 --json rollback.json     # about 5 minutes
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from psgd.bench.chaos.processes import command, free_port_pair, job_token
from psgd.bench.limits import machine
from psgd.config import Deadlines
from psgd.config.parsing import comma_list
from psgd.errors import ClusterError
from psgd.launcher.supervise import dying_with_parent

DESCRIPTION = __doc__
SHARDS, WORKERS = 2, 2
BOUND = 300.0  # seconds a run may take at most


class RollbackBenchError(ClusterError):
    """A run could not be measured (a process failed, the job did not finish in time)."""


def _config(ckpt: Path, interval: int, epochs: int):
    """The job file (beside ``ckpt``), the shards' addresses and the built job."""
    from psgd.config import JobConfig, to_toml
    from psgd.job import build_job

    config = JobConfig()
    config = config.apply_sets(
        [
            "cluster.policy=sync",
            f"cluster.shards={SHARDS}",
            f"cluster.workers={WORKERS}",
            f"train.epochs={epochs}",
            "train.dtype=float64",
            "train.threads=1",
            f"cluster.checkpoint_rounds={interval}",
            "cluster.request_timeout=30",
        ]
    )
    taken: set[int] = set()
    servers = [f"127.0.0.1:{free_port_pair(random.Random(), taken)}" for _ in range(SHARDS)]
    config = config.override("cluster.servers", servers)
    path = ckpt.parent / "job.toml"
    path.write_text(to_toml(config.to_dict()))
    return path, servers, build_job(config)


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def one_run(folder: Path, interval: int, epochs: int, kill_at: float | None) -> dict:
    """Train once (killing shard 1 at ``kill_at`` of the rounds where given); the run's figures."""
    from psgd.data.sharding import steps_per_epoch
    from psgd.worker.client import PSClient, fetch_weights

    folder.mkdir(parents=True, exist_ok=True)
    ckpt = folder / "ckpt"
    job_file, servers, job = _config(ckpt, interval, epochs)
    token = job_token()  # every process started here inherits it
    total = steps_per_epoch(len(job.dataset.x_train), WORKERS, job.config.train.batch_size) * epochs
    server, worker = command("psgd-server", "psgd.cli.server"), command("psgd-worker", "psgd.cli.worker")
    procs: list[subprocess.Popen] = []

    def start(argv: list[str], log: str) -> subprocess.Popen:
        with open(folder / log, "w") as err:
            p = subprocess.Popen(
                dying_with_parent(argv, signal.SIGKILL), stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL
            )
        procs.append(p)
        return p

    def shard(k: int, log: str) -> subprocess.Popen:
        return start(
            [*server, "-c", str(job_file), "--shard", str(k), "--checkpoint-dir", str(ckpt), "--keep-checkpoints", "3"],
            log,
        )

    try:
        shards = [shard(k, f"shard{k}.log") for k in range(SHARDS)]
        began = time.time()
        workers = [
            start(
                [
                    *worker,
                    "-c",
                    str(job_file),
                    "--rank",
                    str(r),
                    "--no-progress",
                    "--metrics",
                    str(folder / f"w{r}.jsonl"),
                ],
                f"w{r}.log",
            )
            for r in range(WORKERS)
        ]
        killed = None
        deadline = time.monotonic() + BOUND
        if kill_at is not None:
            _kill_between_cuts(folder, shards[1], workers, servers, job.plan, interval, kill_at * total, deadline)
            killed = time.time()
            shards[1].wait(10)
            shards[1] = shard(1, "shard1-restarted.log")
        for r, w in enumerate(workers):
            code = w.wait(max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RollbackBenchError(
                    f"worker {r} exited with status {code}: {(folder / f'w{r}.log').read_text()[-1500:]}"
                )
        ended = time.time()
        with PSClient(servers, job.plan, deadlines=Deadlines(request_timeout=10), token=token) as client:
            statuses = client.status()
        counters = [json.loads(s.counters_json) for s in statuses]
        versions = [s.version for s in statuses]
        weights = fetch_weights(servers, job.plan, token=token)
    except subprocess.TimeoutExpired:
        raise RollbackBenchError(f"the job did not end within {BOUND:.0f}s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    steps = _records(folder / "w0.jsonl")
    row = {
        "interval": interval,
        "killed": kill_at is not None,
        "rounds": total,
        "versions": versions,
        "seconds": ended - began,
        "rounds_per_second": total / (ended - began),
        "rounds_undone": sum(c.get("rounds_undone", 0) for c in counters),
        "rollbacks": max(c.get("rollbacks", 0) for c in counters),
    }
    if killed is not None:
        back = next((i for i, x in enumerate(steps) if x.get("event") == "rewound"), None)
        after = next((x for x in steps[back + 1 :] if x.get("event") == "step"), None) if back is not None else None
        row["kill_to_next_round_seconds"] = after["time"] - killed if after else None
        row["rounds_repeated"] = steps[back]["at"] - steps[back]["clock"] if back is not None else 0
        row["restored_version"] = counters[1].get("restored_version")
    return row | {"_weights": weights}


def measure(intervals: list[int], epochs: int, kill_at: float, folder: Path, say=print, repeats: int = 1) -> list[dict]:
    """For each interval: ``repeats`` undisturbed runs and killed runs, side by side; medians, and each run's."""
    rows = []
    for interval in intervals:
        calm = [one_run(folder / f"k{interval}-undisturbed-{i}", interval, epochs, None) for i in range(repeats)]
        seconds = [r["seconds"] for r in calm]
        row = {
            "interval": interval,
            "rounds": calm[0]["rounds"],
            "versions": calm[0]["versions"],
            "seconds": float(np.median(seconds)),
            "rounds_per_second": calm[0]["rounds"] / float(np.median(seconds)),
            "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in calm],
        }
        if interval:
            hits = [one_run(folder / f"k{interval}-killed-{i}", interval, epochs, kill_at) for i in range(repeats)]
            if any(h["kill_to_next_round_seconds"] is None for h in hits):
                raise RollbackBenchError(
                    f"K={interval}: shard 1 was killed between two cuts, yet worker 0 never went "
                    f"back to one ({'; '.join(_outcome(h) for h in hits)})"
                )
            same = all(np.array_equal(h["_weights"][n], v) for h in hits for n, v in calm[0]["_weights"].items())
            median = lambda key: float(np.median([h[key] for h in hits]))  # noqa: E731
            row.update(
                killed_seconds=median("seconds"),
                cost_seconds=median("seconds") - row["seconds"],
                rounds_undone=median("rounds_undone"),
                rounds_repeated=median("rounds_repeated"),
                restored_versions=[h["restored_version"] for h in hits],
                kill_to_next_round_seconds=median("kill_to_next_round_seconds"),
                killed_versions=[h["versions"] for h in hits],
                same_weights=same,
                killed_runs=[{k: v for k, v in h.items() if not k.startswith("_")} for h in hits],
            )
        rows.append(row)
        say(_line(row))
    return rows


def _kill_between_cuts(
    folder: Path,
    victim: subprocess.Popen,
    workers: list[subprocess.Popen],
    servers: list[str],
    plan,
    interval: int,
    after: float,
    deadline: float,
) -> None:
    """SIGKILL ``victim`` (shard 1) half-way between two cuts or later, once worker 0 has done ``after`` rounds.

    A round of the small model takes a few milliseconds and a cut (every shard's checkpoint, fsynced) longer, so a
    kill timed from worker 0's step records lands on a cut about as often as not, and a shard killed there loses
    nothing.  So the shard's version is polled, and where it is half-way to the next cut or later but two rounds
    short of it, the workers are paused (SIGSTOP) while it is read again: the kill is made there (the round in
    flight may still close, not reach the cut); otherwise the workers go on and it looks again."""
    from psgd.worker.client import PSClient

    def check() -> None:
        if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
            raise RollbackBenchError(
                f"the job ended or stalled before shard 1 was between two cuts after {after:.0f} rounds"
            )

    def between(version: int) -> bool:
        return max(1, interval // 2) <= version % interval <= interval - 2

    while len([x for x in _records(folder / "w0.jsonl") if x.get("event") == "step"]) < after:
        check()
        time.sleep(0.01)  # polling worker 0's step records, with a deadline
    with PSClient(servers, plan, deadlines=Deadlines(request_timeout=10), token=job_token()) as client:
        while True:
            check()
            if between(client.links[1].status().version):
                for w in workers:
                    w.send_signal(signal.SIGSTOP)
                try:
                    if between(client.links[1].status().version):
                        victim.send_signal(signal.SIGKILL)
                        return
                finally:
                    for w in workers:
                        w.send_signal(signal.SIGCONT)
            time.sleep(0.001)  # polling shard 1's version, with a deadline


def _outcome(run: dict) -> str:
    return (
        f"restored v{run['restored_version']}, {run['rounds_undone']} round(s) undone, final versions {run['versions']}"
    )


def _line(r: dict) -> str:
    text = f"K={r['interval']:>4}: undisturbed {r['seconds']:6.2f}s ({r['rounds_per_second']:6.1f} rounds/s)"
    if "killed_seconds" in r:
        nxt = r["kill_to_next_round_seconds"]
        text += (
            f"; killed {r['killed_seconds']:6.2f}s ({r['cost_seconds']:+.2f}s), back to "
            f"{'/'.join(f'v{v}' for v in r['restored_versions'])}, {r['rounds_repeated']:.0f} round(s) again, "
            f"{nxt:.2f}s kill to next round, weights {'the same' if r['same_weights'] else 'DIFFERENT'}"
        )
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--intervals",
        default="0,5,20,50,100",
        metavar="K,...",
        type=lambda t: comma_list(t, kind=int, what="checkpoint intervals in rounds (0: none)"),
        help="[cluster] checkpoint_rounds values to measure, each 0 or at least 3 (a kill goes "
        "between two cuts); 0 runs without cuts, undisturbed only (default 0,5,20,50,100)",
    )
    parser.add_argument("--epochs", type=int, default=10, help="epochs of the digits job (default 10: 220 rounds)")
    parser.add_argument(
        "--at", type=float, default=0.4, help="kill shard 1 once this part of the rounds is done (default 0.4)"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of each kind per interval; medians are shown (default 1)"
    )
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE")


def run_from_args(args: argparse.Namespace) -> int:
    if any(k < 0 or k in (1, 2) for k in args.intervals) or not 0 < args.at < 1 or args.epochs < 1 or args.repeats < 1:
        print(
            "psgd bench rollback: intervals must be 0 or at least 3 (a kill goes between two cuts), --at between 0 "
            "and 1, --epochs and --repeats >= 1"
        )
        return 2
    print(
        f"machine: {machine()}; sync, {SHARDS} shards, {WORKERS} workers, MLP on the digits in float64, "
        f"{args.epochs} epochs; shard 1 SIGKILLed at {args.at:.0%} of the rounds",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="psgd-rollback-") as tmp:
        try:
            rows = measure(
                args.intervals,
                args.epochs,
                args.at,
                Path(tmp),
                say=lambda line: print(line, flush=True),
                repeats=args.repeats,
            )
        except RollbackBenchError as exc:
            print(f"psgd bench rollback: {exc}")
            return 1
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"machine": machine(), "epochs": args.epochs, "at": args.at, "repeats": args.repeats, "rows": rows},
                indent=2,
            )
        )
        print(f"written to {args.json}")
    return 0 if all(r.get("same_weights", True) for r in rows) else 1
