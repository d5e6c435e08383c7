"""A psgd job in the simulator: what a step costs (:class:`Costs`), how the job is laid out (:class:`Layout`), and
its workers and shards as psgd runs them (:func:`simulate`): under sync a push whose answer brings the next
weights once the round closes (``workers - backup_workers`` pushes of the same clock); under async a push
answered at once and a pull after it; under ssp the same, a pull waiting while its clock is more than
``staleness`` ahead of the slowest worker's; and ring all-reduce, every rank's gradient then 2(n-1) steps of a
ring.

Each process runs on a host's cores (:class:`psgd.bench.simulate.engine.Cpu`), a shard's updates one at a time
under its lock, and bytes between hosts over their links (one host: the loopback at its measured rate).
"""

from __future__ import annotations

import dataclasses

from psgd.bench.simulate.engine import Cpu, Lock, Nic, Sim, send

POLICIES = ("sync", "async", "ssp", "allreduce")


@dataclasses.dataclass
class Costs:
    """What a step's parts cost on some machine (seconds, bytes/s), as :mod:`psgd.bench.simulate.calibrate`
    measures them."""

    compute: float  # one gradient of a batch on one core, the training loop around it included
    shard_request: float  # a shard's CPU for a push or a pull of its own, beside its bytes
    shard_per_byte: float  # ... and for each byte of it (receive, check, update or read, send)
    joint_request: float  # a shard's CPU for a push whose answer brings the next weights (sync), beside its bytes
    joint_per_byte: float  # ... and for each byte of the push
    worker_request: float  # a worker's CPU for a push or a pull of its own to one shard, beside its bytes
    worker_per_byte: float  # ... and for each byte of it
    wake: float  # a round trip's time beyond both ends' CPU (the socket, waking the peer)
    cores: float  # what a host's cores give busy processes together (measured, not counted)
    worker_joint: float = 0.0  # a worker's CPU for a joint push and pull to one shard (sync), beside its bytes
    worker_step: float = 0.0  # a worker's CPU a step beyond its gradient and its requests
    cores_four: float = 0.0  # what four or more busy processes get from a host's cores together (0: as cores)
    watch_saves: float = 0.0  # CPU a joint round trip saves where both ends watch (no sleep, no wake-up), half each
    watch_saves_request: float = 0.0  # ... and a push's or a pull's round trip of its own (async, ssp)
    wake_watching: float = 0.0  # a round trip's time beyond both ends' CPU where both watch (0: as wake)
    hop: float = 0.0  # all-reduce: one step of the ring beside its bytes
    ring_rate: float = 0.0  # all-reduce: bytes/s of a ring step between ranks of one host (0: no all-reduce)

    def watched(self, joint: bool) -> float:
        """The CPU one end of a round trip saves where both ends watch (a joint push and pull's, or a request's of
        its own)."""
        return (self.watch_saves if joint else self.watch_saves_request) / 2

    def cpu(self, sim: Sim) -> Cpu:
        """A host's cores as measured."""
        return Cpu(sim, self.cores, self.cores_four or None)


@dataclasses.dataclass
class Layout:
    """A job: ``workers`` and ``shards`` (all-reduce: ``workers`` ranks) of a model of ``model_bytes``, on one host
    (``rate`` None) or each process on a host of its own with a link of ``rate`` bytes/s and ``latency`` s (hosts
    emulated on one machine, sharing its cores: ``one_machine``)."""

    workers: int
    shards: int
    policy: str
    model_bytes: float
    staleness: int = 2
    backup_workers: int = 0
    rate: float | None = None
    latency: float = 25e-6
    one_machine: bool = False  # with a rate: every host's link of its own, all of them on one machine's cores
    burst: float = 0.0  # with a rate: bytes each way of a link passes at once (an emulated link's token bucket)
    watching: bool = False  # data connections watch for answers ([cluster] busy_poll_us): the wake's wait only
    slow: dict = dataclasses.field(default_factory=dict)  # worker -> how many times longer its gradient takes

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")


class _Host:
    def __init__(self, sim: Sim, costs: Costs, layout: Layout, cpu: Cpu | None = None):
        self.cpu = cpu or costs.cpu(sim)
        self.nic = Nic(layout.rate, layout.latency, layout.burst) if layout.rate else None


class _Job:
    def __init__(self, costs: Costs, layout: Layout):
        self.sim, self.costs, self.layout = Sim(), costs, layout
        one = _Host(self.sim, costs, layout) if layout.rate is None else None
        machine = costs.cpu(self.sim) if layout.one_machine else None
        self.worker_hosts = [one or _Host(self.sim, costs, layout, machine) for _ in range(layout.workers)]
        self.shard_hosts = [one or _Host(self.sim, costs, layout, machine) for _ in range(layout.shards)]
        self.part = layout.model_bytes / layout.shards
        self.steps: list[tuple[float, int]] = []  # (time, worker) of every step done

    def move(self, src: _Host, dst: _Host, nbytes: float, then) -> None:
        """Bytes from one process to another over both hosts' links; a round trip's wait beyond the CPU is paid
        half each way.  On one host the bytes cost the CPU of both ends (in their measured costs), not time."""
        c = self.costs
        wake = c.wake_watching if self.layout.watching and c.wake_watching else c.wake
        if src.nic is None:
            self.sim.after(wake / 2, then)
        else:
            send(self.sim, src.nic, dst.nic, nbytes, lambda: self.sim.after(wake / 2, then))


class _Shard:
    def __init__(self, job: _Job, k: int):
        self.job, self.k, self.host, self.lock = job, k, job.shard_hosts[k], Lock()
        self.pushed = [0] * job.layout.workers  # each worker's clocks pushed here
        self.rounds: dict[int, list] = {}  # sync: clock -> the workers waiting for its close
        self.closed = -1  # sync: the last round closed
        self.held: list = []  # ssp: pulls waiting for the slowest

    def _cpu(self, seconds: float, then, joint: bool = False) -> None:
        if self.job.layout.watching:
            seconds = max(seconds - self.job.costs.watched(joint), 0.0)
        self.lock.acquire(lambda: self.host.cpu.work(seconds, lambda: (self.lock.release(), then()), self))

    def push(self, worker: _Worker, clock: int) -> None:
        c, part = self.job.costs, self.job.part
        joint = self.job.layout.policy == "sync"
        self._cpu(
            c.joint_request + c.joint_per_byte * part if joint else c.shard_request + c.shard_per_byte * part,
            lambda: self._pushed(worker, clock),
            joint,
        )

    def _pushed(self, worker: _Worker, clock: int) -> None:
        layout = self.job.layout
        self.pushed[worker.rank] = clock + 1
        if layout.policy != "sync":
            self.job.move(self.host, worker.host, 0, lambda: worker.answered(self.k))
            self._release_held()
            return
        if clock <= self.closed:  # a backup worker's late push: the round went on without it
            self._weights_to(worker)
            return
        waiting = self.rounds.setdefault(clock, [])
        waiting.append(worker)
        if len(waiting) >= layout.workers - layout.backup_workers:
            self.closed = clock
            for w in self.rounds.pop(clock):
                self._weights_to(w)

    def _weights_to(self, worker: _Worker) -> None:
        self.job.move(self.host, worker.host, self.job.part, lambda: worker.got(self.k))

    def pull(self, worker: _Worker, clock: int) -> None:
        if self.job.layout.policy == "ssp" and clock - min(self.pushed) > self.job.layout.staleness:
            self.held.append((worker, clock))
            return
        c = self.job.costs
        self._cpu(c.shard_request + c.shard_per_byte * self.job.part, lambda: self._weights_to(worker))

    def _release_held(self) -> None:
        held, self.held = self.held, []
        for worker, clock in held:
            self.pull(worker, clock)


class _Worker:
    def __init__(self, job: _Job, rank: int, shards: list[_Shard]):
        self.job, self.rank, self.shards = job, rank, shards
        self.host = job.worker_hosts[rank]
        self.clock, self.waiting = 0, 0
        self.slow = job.layout.slow.get(rank, 1.0)

    def _client(self, nbytes: float, then) -> None:
        c = self.job.costs
        joint = self.job.layout.policy == "sync"
        fixed = c.worker_joint if joint else c.worker_request
        if self.job.layout.watching:
            fixed = max(fixed - c.watched(joint), 0.0)
        self.host.cpu.work(fixed + c.worker_per_byte * nbytes, then, self)

    def start(self) -> None:
        self.host.cpu.work(self.job.costs.compute * self.slow + self.job.costs.worker_step, self.computed, self)

    def computed(self) -> None:
        self.waiting = len(self.shards)
        for shard in self.shards:
            self._client(
                self.job.part,
                lambda s=shard: self.job.move(self.host, s.host, self.job.part, lambda: s.push(self, self.clock)),
            )

    def answered(self, k: int) -> None:  # async, ssp: the push is answered; the pull goes
        shard = self.shards[k]
        self._client(0, lambda: self.job.move(self.host, shard.host, 0, lambda: shard.pull(self, self.clock + 1)))

    def got(self, k: int) -> None:
        self.waiting -= 1
        if self.waiting == 0:
            self.job.steps.append((self.job.sim.now, self.rank))
            self.clock += 1
            self.start()


def _ring(job: _Job) -> None:
    """Ring all-reduce: every rank's gradient, then 2(n-1) steps each moving 1/n of it to the next rank; a rank
    waiting for the others spins (MPI's progress loop), busy for the cores' share.  The ranks' hosts are alike, so
    they move in lockstep: rank 0's chain of steps to rank 1 stands for every rank's."""
    layout, c = job.layout, job.costs
    n = layout.workers
    state = {"left": n}

    def step() -> None:
        state["left"] = n
        for rank, host in enumerate(job.worker_hosts):
            host.cpu.work(c.compute * layout.slow.get(rank, 1.0), computed, rank)

    def computed() -> None:
        state["left"] -= 1
        if not state["left"]:
            _hops(job, job.worker_hosts[0], job.worker_hosts[1], layout.model_bytes / n, 2 * (n - 1), reduced)

    def reduced() -> None:
        for rank in range(n):
            job.steps.append((job.sim.now, rank))
        step()

    for rank, host in enumerate(job.worker_hosts):  # MPI's ranks spin while they wait for each other
        host.cpu.spinning(rank)
    step()


def _hops(job: _Job, host: _Host, nxt: _Host, chunk: float, hops: int, then) -> None:
    """``hops`` ring steps of ``chunk`` bytes from ``host`` to ``nxt``, one after the other, then ``then``."""
    if hops == 0:
        then()
        return
    c = job.costs
    again = lambda: _hops(job, host, nxt, chunk, hops - 1, then)  # noqa: E731
    if host.nic is None:
        job.sim.after(c.hop + chunk / c.ring_rate, again)
    else:
        send(job.sim, host.nic, nxt.nic, chunk, lambda: job.sim.after(c.hop, again))


def simulate(costs: Costs, layout: Layout, steps: int = 400, warmup: int = 40) -> dict:
    """Steps/s of the job (all workers together) over ``steps`` steps after ``warmup``, and what it took."""
    job = _Job(costs, layout)
    if layout.policy == "allreduce":
        if layout.workers > 1:
            _ring(job)
        else:  # one rank: nothing to reduce

            def alone() -> None:
                job.steps.append((job.sim.now, 0))
                job.worker_hosts[0].cpu.work(costs.compute * layout.slow.get(0, 1.0), alone)

            job.worker_hosts[0].cpu.work(costs.compute, alone)
    else:
        shards = [_Shard(job, k) for k in range(layout.shards)]
        for rank in range(layout.workers):
            _Worker(job, rank, shards).start()
    horizon = 1.0
    while len(job.steps) <= steps + warmup:
        job.sim.run(horizon)
        if job.sim.idle:
            raise RuntimeError(f"the simulated job stopped after {len(job.steps)} steps: {layout}")
        horizon *= 2
    (t0, _), (t1, _) = job.steps[warmup], job.steps[warmup + steps]
    return {"steps_per_s": steps / (t1 - t0), "seconds": t1 - t0}
