"""Soak: async training with random worker kills and restarts, for a while.

4 workers and 2 shards train the MLP on the digits for ``--minutes``; every
few seconds a random worker is SIGKILLed and started again (it registers
anew and continues from its clock).  Meanwhile the shards' weights are read
and evaluated.  It fails if a shard stops moving (a hang), a process dies on
its own (a crash), or the test loss does not fall.

    python benchmarks/soak.py --minutes 3 --json benchmarks/results/soak.json
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from psgd.config import Deadlines
from psgd.config.parsing import Parser

PY = sys.executable


def soak(
    seconds: float, workers: int = 4, shards: int = 2, seed: int = 0, folder: str | None = None, say=print
) -> dict:
    from psgd.bench.chaos.processes import job_token
    from psgd.config import JobConfig, to_toml
    from psgd.job import build_job, params_to_device
    from psgd.partition import PartitionPlan
    from psgd.training.evaluation import evaluate
    from psgd.worker.client import PSClient, fetch_weights

    token = job_token()  # the job's token, in the environment every process started here inherits
    run = Path(folder or tempfile.mkdtemp(prefix="psgd-soak-"))
    job = JobConfig()
    job = job.apply_sets(
        [
            "cluster.policy=async",
            f"cluster.workers={workers}",
            f"cluster.shards={shards}",
            "cluster.lease_seconds=2",
            "train.epochs=100000",
            "optimizer.lr=0.01",
        ]
    )
    path = run / "job.toml"
    path.write_text(to_toml(job.to_dict()))
    rng = random.Random(seed)
    procs: dict[str, subprocess.Popen] = {}
    counts = {"kills": 0, "restarts": 0, "crashes": 0, "checks": 0, "checks_without_progress": 0}
    still = 0  # consecutive checks in which no shard moved
    built = build_job(job)

    def start(name: str, argv: list[str]) -> None:
        procs[name] = subprocess.Popen(
            [PY, "-m", *argv], stdout=subprocess.DEVNULL, stderr=open(run / f"{name}.log", "a")
        )

    try:
        files = [run / f"shard{k}.addr" for k in range(shards)]
        for k in range(shards):
            start(
                f"shard{k}",
                [
                    "psgd.cli.server",
                    "-c",
                    str(path),
                    "--shard",
                    str(k),
                    "--bind",
                    "127.0.0.1:0",
                    "--port-file",
                    str(files[k]),
                ],
            )
        deadline = time.monotonic() + 60
        while not all(f.exists() for f in files):
            if time.monotonic() > deadline:
                raise RuntimeError("shards did not start")
            time.sleep(0.05)  # polling for the port files with a deadline
        job = job.override("cluster.servers", [f.read_text().strip() for f in files])
        path.write_text(to_toml(job.to_dict()))
        for r in range(workers):
            start(f"worker{r}", ["psgd.cli.worker", "-c", str(path), "--rank", str(r), "--no-progress"])
        plan = PartitionPlan(built.model.specs(), shards, job.cluster.links.slice_bytes)
        losses, versions = [], []
        end = time.monotonic() + seconds
        next_kill = time.monotonic() + rng.uniform(2, 5)
        while time.monotonic() < end:
            time.sleep(0.5)  # the soak's own pace, not synchronization
            for name, p in procs.items():
                if p.poll() is not None:
                    counts["crashes"] += 1
                    raise RuntimeError(
                        f"{name} exited by itself with status {p.returncode}; see {run / (name + '.log')}"
                    )
            with PSClient(job.cluster.servers, plan, deadlines=Deadlines(request_timeout=10), token=token) as client:
                now = [s.version for s in client.status()]
            counts["checks"] += 1
            if versions and now == versions[-1]:
                counts["checks_without_progress"] += 1
                still += 1
                if still > 20:
                    raise RuntimeError(f"no shard moved for 10 s (versions {now}): a hang")
            else:
                still = 0
            versions.append(now)
            weights = fetch_weights(job.cluster.servers, plan, request_timeout=10, token=token)
            loss, acc = evaluate(
                built.model,
                params_to_device(weights, built.device),
                built.dataset.x_test,
                built.dataset.y_test,
                built.device,
            )
            losses.append((round(time.monotonic() - (end - seconds), 1), loss, acc))
            if time.monotonic() >= next_kill and time.monotonic() < end - 8:  # the last restart settles
                victim = f"worker{rng.randrange(workers)}"
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait(10)
                counts["kills"] += 1
                start(victim, ["psgd.cli.worker", "-c", str(path), "--rank", victim[6:], "--no-progress"])
                counts["restarts"] += 1
                next_kill = time.monotonic() + rng.uniform(2, 5)
                say(
                    f"t={losses[-1][0]:6.1f}s killed and restarted {victim}; versions {now}; "
                    f"test loss {loss:.4f} accuracy {acc:.3f}"
                )
        clean = {}
        for kind in ("worker", "shard"):  # graceful ends: workers leave after their step, then shards stop
            group = {name: p for name, p in procs.items() if name.startswith(kind)}
            for p in group.values():
                p.send_signal(signal.SIGTERM)
            clean.update({name: p.wait(30) for name, p in group.items()})
        first, last = losses[0], losses[-1]
        result = {
            "seconds": seconds,
            "workers": workers,
            "shards": shards,
            **counts,
            "updates": sum(versions[-1]),
            "first": first,
            "last": last,
            "exit_codes": clean,
            "loss_fell": last[1] < first[1],
        }
        return result
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    result = soak(args.minutes * 60, seed=args.seed)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    ok = result["loss_fell"] and not result["crashes"] and all(c == 0 for c in result["exit_codes"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
