"""A benchmark model: one float32 variable of a chosen size and a free gradient, and shards holding it.

It isolates communication: ``loss_and_grads`` costs nothing, so a step's time
is the time to move the weights and the gradient.  Use it as
``--set model.name=psgd.bench.blob:Blob --set model.size=N``.
:class:`BlobCluster` starts psgd-server shards holding one (on emulated hosts
too; :class:`ShardProcesses` starts them for any job), and :func:`time_steps` times clients' pull+push against them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import numpy as np

from psgd.bench.chaos.processes import job_token
from psgd.config import Links
from psgd.model import BaseModel, VarSpec

MB = 1_000_000
PY = sys.executable


class Blob(BaseModel):
    # A stand-in for moving bytes: its gradient is a constant, not the derivative of its (zero) loss,
    # so the finite-difference check that every trainer runs first is told to skip it.
    check_gradients = False

    def __init__(self, input_shape, num_classes, dtype="float32", size=1 << 20):
        self.dtype, self.size, self.num_classes = dtype, int(size), num_classes
        self._grad = None

    def specs(self):
        return [VarSpec("blob", (self.size,), self.dtype, "zeros")]

    def loss_and_grads(self, params, x, y):
        w = params["blob"]
        if self._grad is None or self._grad.shape != w.shape:
            self._grad = np.full_like(w, 1e-3)
        return 0.0, {"blob": self._grad}

    def predict(self, params, x):
        return np.zeros((len(x), self.num_classes), dtype=self.dtype)


# -- shard processes -------------------------------------------------------------------------------------
class ShardProcesses:
    """psgd-server processes, one per shard of ``config``'s job (whose plan is ``plan``), each started as a user
    starts one; with ``hosts`` (psgd.bench.netns.Namespaces) shard k runs on host s<k> and listens on its address."""

    def __init__(self, config, plan, tmp: str = ".", hosts=None):
        from psgd.config import to_toml

        self.config, self.plan = config, plan
        shards = config.cluster.shards
        self.tmp = Path(tempfile.mkdtemp(dir=tmp))
        self.path = self.tmp / "job.toml"
        self.path.write_text(to_toml(config.to_dict()))
        self.token = job_token()  # the job's token, in the environment every process started from here inherits
        self.env = dict(os.environ)
        files = [self.tmp / f"{k}.addr" for k in range(shards)]
        on = [hosts.prefix(f"s{k}") if hosts else [] for k in range(shards)]
        bind = [f"{hosts.hosts[f's{k}']}:0" if hosts else "127.0.0.1:0" for k in range(shards)]
        self.procs = [
            subprocess.Popen(
                [
                    *on[k],
                    PY,
                    "-m",
                    "psgd.cli.server",
                    "-c",
                    str(self.path),
                    "--shard",
                    str(k),
                    "--bind",
                    bind[k],
                    "--port-file",
                    str(files[k]),
                    "-q",
                ],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for k in range(shards)
        ]
        deadline = time.monotonic() + 120
        while not all(f.exists() for f in files):
            for p in self.procs:
                if p.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise SystemExit(f"psgd-server did not start: {p.stderr.read()[-2000:]}")
            time.sleep(0.05)  # polling for the port files with a deadline
        self.addresses = [f.read_text().strip() for f in files]

    def client(self, worker: int, transport: str = "tcp", wire_dtype: str | None = None):
        from psgd.worker.client import PSClient

        c = PSClient(
            self.addresses,
            self.plan,
            worker,
            links=Links(transport=transport, wire_dtype=wire_dtype or ""),
            config=self.config,
            token=self.token,
        )
        c.wait_ready(60)
        c.register()
        return c

    def rss_mb(self, peak: bool = True) -> list[float]:
        """Each shard's resident memory in MB: its peak so far, or now."""
        return [rss_mb(p.pid, peak) for p in self.procs]

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(30)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BlobCluster(ShardProcesses):
    """``shards`` psgd-server processes holding a one-variable model of ``size`` bytes."""

    def __init__(
        self,
        size: int,
        shards: int = 1,
        workers: int = 1,
        optimizer: str = "sgd",
        policy: str = "async",
        tmp: str = ".",
        hosts=None,
        busy_poll_us: int = 0,
    ):
        from psgd.config import JobConfig
        from psgd.job import describe_job

        self.size, self.elems = size, size // 4
        config = JobConfig()
        config = config.apply_sets(
            [
                "model.name=psgd.bench.blob:Blob",
                f"model.size={self.elems}",
                "data.name=synthetic",
                "data.n_train=64",
                "data.n_test=16",
                f"optimizer.name={optimizer}",
                "optimizer.lr=0.001",
                f"cluster.policy={policy}",
                f"cluster.shards={shards}",
                f"cluster.workers={workers}",
                f"cluster.busy_poll_us={busy_poll_us}",
            ]
        )
        super().__init__(config, describe_job(config, model=Blob((1,), 2, size=self.elems)).plan, tmp, hosts)


def rss_mb(pid: int, peak: bool = True) -> float:
    """A process's resident memory in MB: its peak (VmHWM) or now (VmRSS)."""
    field = "VmHWM:" if peak else "VmRSS:"
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    return float("nan")


def median(xs) -> float:
    return float(np.median(xs))


def time_steps(
    cluster: BlobCluster, workers: int, steps: int, transport: str = "tcp", wire_dtype: str | None = None
) -> dict:
    """``workers`` clients in threads each doing ``steps`` pull+push over ``transport`` (tcp: the data port,
    shm: shared memory, grpc); per-step medians and throughput."""
    clients = [cluster.client(w, transport, wire_dtype) for w in range(workers)]
    if transport == "shm" and not all(link.shared for c in clients for link in c.links):
        for c in clients:
            c.close()
        raise SystemExit("the shm link fell back to TCP (see the log line above): no shared-memory figures here")
    start = time.perf_counter()
    with futures.ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda c: pull_push_loop(c, cluster.elems, steps), clients))
    wall = time.perf_counter() - start
    for c in clients:
        c.done()
        c.close()
    pulls = [x for r in results for x in r[0]]
    pushes = [x for r in results for x in r[1]]
    step = median([a + b for r in results for a, b in zip(*r)])
    moved = 2 * cluster.size * workers * (steps + 1)
    return {
        "pull_s": median(pulls),
        "push_s": median(pushes),
        "step_s": step,
        "pull_gbps": cluster.size / median(pulls) / 1e9,
        "push_gbps": cluster.size / median(pushes) / 1e9,
        "step_gbps": 2 * cluster.size / step / 1e9,
        "aggregate_gbps": moved / wall / 1e9,
    }


def pull_push_loop(client, elems: int, steps: int) -> tuple[list[float], list[float]]:
    """``steps`` pull+push steps of a registered client (after one warm-up step): seconds of each pull and push."""
    host = {"blob": np.empty(elems, dtype=np.float32)}
    grads = {"blob": np.full(elems, 1e-3, dtype=np.float32)}
    pulls, pushes = [], []
    for clock in range(steps + 1):
        a = time.perf_counter()
        client.pull(clock, host)
        b = time.perf_counter()
        client.push(clock, grads)
        if clock:
            pulls.append(b - a)
            pushes.append(time.perf_counter() - b)
    return pulls, pushes
