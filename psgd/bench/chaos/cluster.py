"""The processes of one job: :class:`Cluster` starts, signals and reads its shards and workers (on
127.0.0.1, or on hosts in network namespaces); :class:`Abort` stops a run that cannot go on."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from psgd.bench.chaos.draws import RunSpec
from psgd.bench.chaos.invariants import check_follows
from psgd.bench.chaos.processes import Proc, command, free_port_pair, job_token, last_error
from psgd.bench.chaos.settings import (
    CHECKPOINT_EVERY,
    CUT_ROUNDS,
    JOIN_TIMEOUT,
    KEEP,
    LEASE,
    MIN_ACCURACY,
    NS_PORT,
    PACE,
    REQUEST_TIMEOUT,
    SHARDS,
    START_BOUND,
    STEPS_PER_WORKER,
)
from psgd.bench.netns import Namespaces
from psgd.errors import PsgdError
from psgd.launcher.supervise import dying_with_parent


class Abort(PsgdError):
    """The run cannot go on (a hang, a failed process); recorded as a violation of ``invariant``."""

    def __init__(self, message: str, invariant: str = "bounded"):
        super().__init__(message)
        self.invariant = invariant


#: what each model of the runs is trained on, beside its name (the digits by default)
MODEL_SETS = {
    "mlp": ("model.hidden=[32]",),
    "embed": (
        "model.dim=4",
        "model.hidden=[16]",
        "data.name=clicks",
        "data.n_train=8000",
        "data.n_test=2000",
        "data.fields=8",
        "data.dense=4",
        "data.max_cardinality=20000",
        "tables.lr=0.1",
    ),
}


class Cluster:
    """The processes of one job, on 127.0.0.1 at fixed ports or on hosts in network namespaces."""

    def __init__(self, spec: RunSpec, folder: Path, port_rng: random.Random, net: Namespaces | None):
        from psgd.config import JobConfig, to_toml
        from psgd.data.sharding import steps_per_epoch
        from psgd.job import build_job

        self.spec, self.folder, self.net = spec, folder, net
        config = JobConfig().apply_sets(
            [
                f"model.name={spec.model}",
                *(MODEL_SETS.get(spec.model, ())),
                "train.threads=1",
                f"cluster.policy={spec.policy}",
                f"cluster.shards={SHARDS}",
                f"cluster.workers={spec.workers}",
                f"cluster.lease_seconds={LEASE}",
                f"cluster.request_timeout={REQUEST_TIMEOUT}",
                f"cluster.join_timeout={JOIN_TIMEOUT}",
                f"cluster.transport={spec.transport}",
                f"cluster.replicas={int(spec.replicas)}",
                # sync goes back to a cut after a shard restarts, and float64 makes "the same weights" exact
                *((f"cluster.checkpoint_rounds={CUT_ROUNDS}", "train.dtype=float64") if spec.policy == "sync" else ()),
                # a full disk fails a cut: the job goes on (psgd.bench.chaos.disk), instead of stopping
                *(("cluster.on_cut_failure=continue",) if any(f.kind == "full-disk" for f in spec.faults) else ()),
            ]
        )
        self.job = build_job(config)
        spe = steps_per_epoch(len(self.job.dataset.x_train), spec.workers, config.train.batch_size)
        self.epochs = max(1, round(STEPS_PER_WORKER / spe))
        config = config.apply_sets([f"train.epochs={self.epochs}"])
        self.total = spe * self.epochs
        if net is None:
            taken: set[int] = set()
            self.binds = [f"127.0.0.1:{free_port_pair(port_rng, taken)}" for _ in range(SHARDS)]
            self.replica_binds = [f"127.0.0.1:{free_port_pair(port_rng, taken)}" for _ in range(SHARDS)]
        else:
            self.binds = [f"{net.hosts[f's{k}']}:{NS_PORT}" for k in range(SHARDS)]
            self.replica_binds = [f"{net.hosts[f'r{k}']}:{NS_PORT}" for k in range(SHARDS) if f"r{k}" in net.hosts]
        config = config.override("cluster.servers", list(self.binds))
        # each shard's data port named in the job file, next to its gRPC port: where the faults aim, and the same
        # after a restart
        config = config.override("cluster.data_ports", [int(b.rpartition(":")[2]) + 1 for b in self.binds])
        if spec.replicas:  # shard k's second process ("replica{k}"): on a host of its own in namespaces
            config = config.override("cluster.replica_servers", list(self.replica_binds))
        self.config = config
        self.plan = self.job.plan
        self.path = folder / "job.toml"
        self.path.write_text(to_toml(config.to_dict()))
        self.ckpt = folder / "ckpt"
        self.port_files = [folder / f"shard{k}.addr" for k in range(SHARDS)] + [
            folder / f"replica{k}.addr" for k in range(SHARDS) if spec.replicas
        ]
        self.procs: dict[str, Proc] = {}  # the current incarnation of each process
        self.history: list[Proc] = []  # every incarnation
        self.server, self.worker = command("psgd-server", "psgd.cli.server"), command("psgd-worker", "psgd.cli.worker")
        self.token = job_token()  # in the environment: every process of the job inherits it
        self.psgd = command("psgd", "psgd.cli.main")

    # -- starting and stopping ---------------------------------------------------------------------
    def _host(self, name: str) -> str:
        if name.startswith("duplicate"):  # a second process of a worker's rank runs where the worker does
            return "w" + name[-1]
        return name[0] + name[-1] if name.startswith(("shard", "worker", "replica")) else name

    def prefix(self, host: str) -> list[str]:
        """What runs a command on ``host`` (nothing on loopback)."""
        return self.net.prefix(host) if self.net else []

    def _start(self, name: str, argv: list[str], metrics: Path | None = None, current: bool = True) -> Proc:
        incarnation = sum(1 for p in self.history if p.name == name)
        log = self.folder / f"{name}.{incarnation}.log"
        with open(log, "w") as err:
            popen = subprocess.Popen(
                dying_with_parent(self.prefix(self._host(name)) + argv, signal.SIGKILL),
                stdout=subprocess.DEVNULL,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )
        proc = Proc(name, incarnation, popen, log, metrics)
        if current:
            self.procs[name] = proc
        self.history.append(proc)
        return proc

    def start_shard(self, k: int, replica: bool = False) -> Proc:
        """Shard ``k``'s process (``replica``: the second of its pair, ``replica{k}``)."""
        name, at = (f"replica{k}", SHARDS + k) if replica else (f"shard{k}", k)
        self.port_files[at].unlink(missing_ok=True)
        argv = [
            *self.server,
            "-c",
            str(self.path),
            "--shard",
            str(k),
            "--bind",
            (self.replica_binds if replica else self.binds)[k],
            *(["--replica"] if replica else []),
            "--port-file",
            str(self.port_files[at]),
            "--checkpoint-dir",
            str(self.ckpt),
            "--checkpoint-every",
            str(CHECKPOINT_EVERY),
            "--keep-checkpoints",
            str(KEEP),
            *(["--exit-when-done"] if self.spec.exit_when_done else []),
        ]
        return self._start(name, argv)

    @property
    def shard_names(self) -> list[str]:
        """Every shard process's name: ``shard{k}``, and ``replica{k}`` where the job keeps replicas."""
        return [f"shard{k}" for k in range(SHARDS)] + [f"replica{k}" for k in range(SHARDS) if self.spec.replicas]

    def left_by_itself(self) -> bool:
        """Whether a shard of an --exit-when-done run exited 0: every worker had said it was done."""
        return self.spec.exit_when_done and any(self.procs[n].popen.poll() == 0 for n in self.shard_names)

    def start(self) -> None:
        """Every shard (and replica), once each listens every worker: the job as it starts."""
        for k in range(SHARDS):
            self.start_shard(k)
        for k in range(SHARDS):
            self.wait_listening(k)
        if self.spec.replicas:
            for k in range(SHARDS):
                self.start_shard(k, replica=True)
            for k in range(SHARDS):
                self.wait_listening(k, replica=True)
                self.wait_whole(k)
        for r in range(self.spec.workers):
            self.start_worker(r)

    def wait_whole(self, k: int, bound: float = START_BOUND) -> dict:
        """Until shard ``k``'s pair has a primary whose replica follows (lag 0); that primary's Status."""
        deadline = time.monotonic() + bound
        while True:
            for s in self._pair_status(k, 2.0):
                if s is not None and s["role"] == "primary" and s["replica_lag"] == 0:
                    return s
            if time.monotonic() > deadline:
                raise Abort(f"shard {k}'s pair had no primary with a following replica within {bound:.0f}s")
            time.sleep(0.1)  # polling, with a deadline

    def wait_followed(self, k: int, bound: float = START_BOUND) -> list[str]:
        """Until shard ``k``'s primary says that the other process of its pair follows it, and that process says so
        too (``bound`` seconds at most): the problems left then (:func:`check_follows`)."""
        deadline = time.monotonic() + bound
        while True:
            pair = self._pair_status(k, 2.0)
            first = 1 if pair[1] is not None and pair[1]["role"] == "primary" else 0
            problems = check_follows(k, pair[first], pair[1 - first], (self.replica_binds, self.binds)[first][k])
            if not problems or time.monotonic() > deadline:
                return problems
            time.sleep(0.2)  # polling, with a deadline

    def wait_listening(self, k: int, bound: float = START_BOUND, replica: bool = False) -> None:
        name, at = (f"replica{k}", SHARDS + k) if replica else (f"shard{k}", k)
        proc = self.procs[name]
        deadline = time.monotonic() + bound
        while not self.port_files[at].exists():
            if proc.popen.poll() is not None:
                raise Abort(
                    f"{name} exited with status {proc.popen.returncode} while starting: {last_error(proc.log)}",
                    "finishes",
                )
            if time.monotonic() > deadline:
                raise Abort(f"{name} did not listen within {bound:.0f}s")
            time.sleep(0.05)  # polling for the port file, with a deadline

    def start_worker(self, r: int, duplicate: bool = False) -> Proc:
        """Worker ``r`` (its next incarnation); ``duplicate``: a second process of rank ``r`` beside the
        current one, which stays worker ``r``'s."""
        name = f"{'duplicate' if duplicate else 'worker'}{r}"
        incarnation = sum(1 for p in self.history if p.name == name)
        metrics = self.folder / f"{name}.{incarnation}.jsonl"
        argv = [
            *self.worker,
            "-c",
            str(self.path),
            "--rank",
            str(r),
            "--servers",
            ",".join(self.binds),
            "--no-progress",
            "--metrics",
            str(metrics),
            "--delay",
            PACE,
        ]
        return self._start(name, argv, metrics, current=not duplicate)

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
        """Every shard's Status (None where it did not answer within ``timeout``): its leader's, where the job keeps
        replicas (two primaries for a moment: the later one, which took over)."""
        raw = self._raw_status(timeout)
        out: list[dict | None] = []
        for k in range(SHARDS):
            found = [s for s in raw[k::SHARDS] if s is not None and s.get("role", "") in ("primary", "")]
            s = max(found, key=lambda s: (s["counters"].get("failovers", 0), s["version"]), default=None)
            out.append(None if s is None else shard_view(s["shard"], s["version"], s["incarnation"], s["counters"]))
        return out

    def _pair_status(self, k: int, timeout: float) -> list[dict | None]:
        """Status of shard ``k``'s processes: at its primary's address, and at its replica's where it has one."""
        return self._raw_status(timeout)[k::SHARDS]

    def _raw_status(self, timeout: float) -> list[dict | None]:
        """Status of every shard process, at ``binds`` then ``replica_binds`` (with ``psgd status --json`` from the
        observer's host in the namespaces)."""
        addresses = [*self.binds, *(self.replica_binds if self.spec.replicas else [])]
        if self.net is not None:
            try:
                done = subprocess.run(
                    self.prefix("obs")
                    + [*self.psgd, "status", "--json", "--sample", "0", "--timeout", str(timeout), *addresses],
                    capture_output=True,
                    text=True,
                    timeout=timeout * 2 + 30,
                )
                return [row if "version" in row else None for row in json.loads(done.stdout)["shards"]]
            except (subprocess.TimeoutExpired, ValueError, KeyError):
                return [None] * len(addresses)
        import grpc

        from psgd.ops.reach import Connect, read_status

        out: list[dict | None] = []
        for address in addresses:
            try:
                out.append(read_status(address, Connect(timeout=timeout, token=self.token)))
            except grpc.RpcError:
                out.append(None)
        return out

    def weights(self, timeout: float = 10.0) -> dict[str, np.ndarray]:
        """The current weights, pulled as an observer (``psgd export`` from the observer's host in namespaces)."""
        if self.net is None:
            from psgd.worker.client import fetch_weights

            return fetch_weights(self.binds, self.plan, request_timeout=timeout, token=self.token)
        from psgd.weights import read_npz

        out = self.folder / "observed.npz"
        done = subprocess.run(
            self.prefix("obs")
            + [
                *self.psgd,
                "export",
                "-c",
                str(self.path),
                "--timeout",
                str(timeout),
                "--mixed-versions",
                str(out),
            ],  # as they are
            capture_output=True,
            text=True,
            timeout=timeout * 3 + 30,
        )
        if done.returncode != 0:
            raise RuntimeError(f"psgd export exited with status {done.returncode}: {done.stderr.strip()[-500:]}")
        try:
            return read_npz(out)
        finally:
            out.unlink(missing_ok=True)

    def checkpoints(self, k: int) -> list[int]:
        """The versions of the checkpoints (with their manifests) shard ``k`` holds, whatever the job folder, oldest
        first."""
        from psgd.server.state import checkpoint

        return sorted({v for folder in self.ckpt.glob(f"*/shard-{k}") for v in checkpoint.versions(folder)})

    def newest_checkpoint(self, k: int) -> int | None:
        """The newest checkpoint shard ``k`` has written (None: none)."""
        return max(self.checkpoints(k), default=None)

    @property
    def sparse(self) -> bool:
        """Whether the job's model has embedding tables: its rows are read from the shards' checkpoints."""
        return bool(self.plan.tables)

    def accuracy(self, weights: Mapping[str, np.ndarray]) -> float:
        """Test accuracy of ``weights`` (with a table's rows as checkpoints hold them, for a sparse job)."""
        from psgd.job import params_to_device
        from psgd.training.evaluation import evaluate, saved_rows

        b = self.job
        params = params_to_device({s.name: weights[s.name] for s in b.model.specs()}, b.device)
        return float(
            evaluate(
                b.model,
                params,
                b.dataset.x_test,
                b.dataset.y_test,
                b.device,
                ids=b.dataset.ids_test,
                rows=saved_rows(b, weights) if self.sparse else None,
            )[1]
        )

    def least_accuracy(self) -> float:
        """What a finished job must reach: MIN_ACCURACY on the digits; on clicks, half the way from chance to
        what its teacher allows."""
        if not self.sparse:
            return MIN_ACCURACY
        from psgd.data.clicks import Generator, clicks_options, reachable_accuracy

        o = clicks_options(**{k: v for k, v in self.config.data.items() if k != "name"})
        gen = Generator(o["data_seed"], o["fields"], o["dense"], o["alpha"], o["max_cardinality"])
        return 0.5 + 0.5 * (reachable_accuracy(gen.make("test", 0, o["n_test"], o["n_test"])) - 0.5)


def shard_view(shard: int, version: int, incarnation: str, counters: Mapping[str, Any]) -> dict:
    counters = dict(counters)
    written = counters.pop("checkpoint", None) or {}
    return {
        "shard": shard,
        "version": version,
        "incarnation": incarnation,
        "restored_version": counters.pop("restored_version", None),
        "checkpoint_version": written.get("version"),
        "counters": {k: v for k, v in counters.items() if isinstance(v, int)},
    }
