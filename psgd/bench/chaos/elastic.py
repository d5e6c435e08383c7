"""The chaos suite's jobs with a range of workers (``[cluster] workers = "MIN:MAX"``): workers join (``psgd-worker
--rank auto``), leave (SIGTERM), are killed (SIGKILL, and another joins in their place or not) and are paused past
their lease (SIGSTOP, SIGCONT) while the job trains, and the invariants of such a job are checked at its end.

A run of its own kind, with its own seeded draws (:func:`draw`), so that the fixed jobs' runs and kinds
(``KINDS``, ``psgd bench chaos``'s seeds) stay as they were.  Each run starts two shards and MIN workers the way
users do, injects its faults at drawn fractions of the job's batches, waits for the job to end, and checks:

- ``finished``: every worker that was not killed exits 0, the job ends within ``RUN_BOUND``, the shards exit 0 on
  SIGTERM;
- ``batches``: shard 0 handed out every batch of the job (none left) and knew the job's number;
- ``versions``: under sync both shards applied the same rounds; under async and ssp every batch's push was applied
  once on every shard, but for one per kill on one shard (a worker killed between its pushes to two shards: the
  shard that had it keeps it, and the other, which never heard of it, has that batch trained again, or not where
  the job ended first); under local both shards applied the same periods but one per kill;
- ``steps``: where no worker was killed, the workers' steps add up to the job's batches exactly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from psgd.bench.chaos.processes import command, end_all, free_port_pair, job_token, last_error
from psgd.bench.chaos.settings import JOIN_TIMEOUT, LEASE, REQUEST_TIMEOUT, RUN_BOUND, SHARDS
from psgd.config import JobConfig, to_toml

#: the faults of a run with a range of workers
ELASTIC_KINDS = ("join", "leave", "kill-worker", "stop-worker")
POLICIES = ("sync", "async", "ssp", "local")
TRANSPORTS = ("tcp", "grpc", "shm")
EPOCHS = 40  # of the digits with batches of 32: 1,760 batches, about 10-20 s with two to four workers here
PACE = "fixed:0.005"  # psgd-worker --delay: the steps of a known length


@dataclasses.dataclass(frozen=True)
class ElasticFault:
    kind: str  # one of ELASTIC_KINDS
    at: float  # the fraction of the job's batches trained when it is injected
    target: int = 0  # which live worker (modulo those live)
    seconds: float = 0.0  # stop-worker: how long; kill-worker: 0 (none joins in its place) or the delay before one


@dataclasses.dataclass(frozen=True)
class ElasticSpec:
    index: int
    policy: str
    transport: str
    fewest: int
    faults: tuple[ElasticFault, ...]

    def describe(self) -> str:
        said = ", ".join(f"{f.kind} at {f.at:.2f}" + (f" ({f.seconds:.1f}s)" if f.seconds else "") for f in self.faults)
        return f"run {self.index}: {self.policy} over {self.transport}, workers {self.fewest}:{self.fewest + 2}; {said}"


def draw(rng: random.Random, index: int) -> ElasticSpec:
    """One run's plan, everything random drawn before it starts."""
    faults = sorted(
        (
            ElasticFault(
                kind,
                round(rng.uniform(0.1, 0.7), 3),
                rng.randrange(4),
                round(rng.uniform(LEASE + 0.5, LEASE + 2.0), 2)
                if kind == "stop-worker"
                else (round(rng.choice([0.0, 0.5, LEASE + 1.0]), 2) if kind == "kill-worker" else 0.0),
            )
            for kind in [rng.choice(ELASTIC_KINDS) for _ in range(4)]
        ),
        key=lambda f: f.at,
    )
    return ElasticSpec(
        index, POLICIES[index % len(POLICIES)], rng.choice(TRANSPORTS), rng.choice((1, 2)), tuple(faults)
    )


class ElasticRun:
    """One job with a range of workers, its faults and its checks; :meth:`execute` returns the run's record."""

    def __init__(self, spec: ElasticSpec, folder: Path, seed: int, say: Callable[[str], None]):
        self.spec, self.folder, self.seed, self.say = spec, folder, seed, say
        self.violations: list[dict] = []
        self.workers: list[tuple[subprocess.Popen, Path, Path]] = []  # process, its metrics, its log
        self.killed: list[subprocess.Popen] = []
        self.shards: list[subprocess.Popen] = []
        folder.mkdir(parents=True, exist_ok=True)

    def violate(self, invariant: str, problem: str) -> None:
        where = {"seed": self.seed, "run": self.spec.index, "run_spec": self.spec.describe()}
        self.violations.append({**where, "folder": str(self.folder), "invariant": invariant, "message": problem})

    # -- the job ------------------------------------------------------------------------------------------------
    def _job(self) -> tuple[Path, int, list[str]]:
        s = self.spec
        config = JobConfig().apply_sets(
            [
                "model.name=softmax",
                f"train.epochs={EPOCHS}",
                f"cluster.policy={s.policy}",
                f'cluster.workers="{s.fewest}:{s.fewest + 2}"',
                f"cluster.shards={SHARDS}",
                f"cluster.transport={s.transport}",
                f"cluster.lease_seconds={LEASE}",
                f"cluster.join_timeout={JOIN_TIMEOUT}",
                f"cluster.request_timeout={REQUEST_TIMEOUT}",
            ]
            + (["cluster.staleness=2"] if s.policy == "ssp" else [])
        )
        rng = random.Random(self.seed * 1000 + s.index)
        addresses = [f"127.0.0.1:{free_port_pair(rng)}" for _ in range(SHARDS)]
        config = config.override("cluster.servers", addresses)
        path = self.folder / "job.toml"
        path.write_text(to_toml(config.to_dict()))
        return path, EPOCHS * (1438 // 32), addresses

    def _start_worker(self, job: Path) -> None:
        n = len(self.workers)
        metrics, log = self.folder / f"worker-{n}.jsonl", self.folder / f"worker-{n}.log"
        argv = [*command("psgd-worker", "psgd.cli.worker"), "-c", str(job), "--rank", "auto", "--no-progress"]
        argv += ["--metrics", str(metrics), "--delay", PACE]
        with open(log, "w") as err:
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL)
        self.workers.append((proc, metrics, log))

    def _live(self) -> list[subprocess.Popen]:
        return [p for p, _, _ in self.workers if p.poll() is None and p not in self.killed]

    def _trained(self) -> int:
        total = 0
        for _, metrics, _ in self.workers:
            if metrics.exists():
                total += sum(
                    1 for line in metrics.read_text(errors="replace").splitlines() if '"event": "step"' in line
                )
        return total

    def _inject(self, fault: ElasticFault, job: Path) -> None:
        live = self._live()
        if fault.kind == "join":
            self._start_worker(job)
            return
        if not live or (fault.kind == "leave" and len(live) < 2):
            return
        victim = live[fault.target % len(live)]
        if fault.kind == "leave":
            victim.send_signal(signal.SIGTERM)
        elif fault.kind == "kill-worker":
            victim.send_signal(signal.SIGKILL)
            self.killed.append(victim)
            if fault.seconds:  # another joins in its place, at once or once its lease ran out
                time.sleep(fault.seconds)  # the delay is the fault's
                self._start_worker(job)
            elif len(live) == 1:  # the last one: the job needs a worker to end
                self._start_worker(job)
        else:  # stop-worker: paused past its lease, then let go on
            victim.send_signal(signal.SIGSTOP)
            time.sleep(fault.seconds)  # the length of the pause is the fault
            victim.send_signal(signal.SIGCONT)

    def execute(self) -> dict:
        s = self.spec
        began = time.monotonic()
        job, total, addresses = self._job()
        try:
            for k, address in enumerate(addresses):
                argv = [*command("psgd-server", "psgd.cli.server"), "-c", str(job), "--shard", str(k)]
                with open(self.folder / f"shard-{k}.log", "w") as err:
                    self.shards.append(
                        subprocess.Popen(argv + ["--bind", address], stdout=subprocess.DEVNULL, stderr=err)
                    )
            for _ in range(s.fewest):
                self._start_worker(job)
            pending = list(s.faults)
            while any(p.poll() is None for p, _, _ in self.workers):
                if time.monotonic() - began > RUN_BOUND:
                    self.violate("finished", f"the job did not end within {RUN_BOUND:.0f}s")
                    break
                if any(p.poll() is not None for p in self.shards):
                    self.violate("finished", "a shard exited while the job trained: " + last_error(self._shard_log()))
                    break
                if pending and self._trained() >= pending[0].at * total:
                    self._inject(pending.pop(0), job)
                    continue
                time.sleep(0.1)  # polling the processes and the workers' records, within RUN_BOUND
            self._check(total, addresses)
        finally:
            end_all([p for p, _, _ in self.workers] + self.shards)
        for k, proc in enumerate(self.shards):
            if proc.returncode not in (0, None):
                self.violate("finished", f"shard {k} exited with status {proc.returncode} on SIGTERM")
        return {
            "run": s.index,
            "spec": s.describe(),
            "seconds": round(time.monotonic() - began, 1),
            "violations": self.violations,
        }

    def _shard_log(self) -> Path:
        return self.folder / "shard-0.log"

    def _check(self, total: int, addresses: list[str]) -> None:
        from psgd.ops.reach import Connect, read_status

        for proc, _, log in self.workers:
            if proc not in self.killed and proc.poll() not in (0, None):
                self.violate("finished", f"a worker exited with status {proc.returncode}: {last_error(log)}")
        connect = Connect(timeout=5.0, token=os.environ.get("PSGD_TOKEN", ""))
        status = [read_status(a, connect) for a in addresses]
        versions = [st["version"] for st in status]
        batches = status[0]["counters"].get("batches", {})
        if batches.get("total") != total or batches.get("left") != 0:
            self.violate("batches", f"shard 0 says {batches} of a job of {total} batches, at its end")
        kills = len(self.killed)
        if self.spec.policy in ("async", "ssp"):  # a kill between two shards: a push on one, not the other
            if any(not total - kills <= v <= total + kills for v in versions):
                self.violate("versions", f"versions {versions} for {total} batches with {kills} kill(s)")
        elif abs(versions[0] - versions[1]) > (kills if self.spec.policy == "local" else 0):
            self.violate("versions", f"the shards applied {versions[0]} and {versions[1]} with {kills} kill(s)")
        if not kills:
            steps = 0
            for _, metrics, _ in self.workers:
                done = [json.loads(x) for x in metrics.read_text().splitlines() if '"event": "done"' in x]
                steps += done[-1]["steps"] if done else 0
            if steps != total:
                self.violate("steps", f"the workers took {steps} steps in all for a job of {total} batches")


def run_elastic(runs: int, seed: int, folder: Path, say: Callable[[str], None] = print) -> list[dict]:
    """``runs`` seeded runs of jobs with a range of workers; each run's record, its violations in it."""
    job_token()  # the job's token, in the environment every process started here inherits
    rng, records = random.Random(seed), []
    for index in range(runs):
        spec = draw(rng, index)
        say(spec.describe())
        record = ElasticRun(spec, folder / f"elastic-{index}", seed, say).execute()
        for v in record["violations"]:
            say(f"  VIOLATION {v['invariant']}: {v['message']}")
        records.append(record)
    return records
