"""The plan of each run, everything random drawn before it starts: :class:`Fault`, :class:`RunSpec` and the
seeded :class:`Planner` that draws them."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence

from psgd.bench.chaos.settings import FAULTS_PER_RUN, LEASE, SHARDS

#: the kinds aimed at a worker whose names do not end in "-worker"
AT_A_WORKER = ("stop-mid-pull", "trickled-push", "duplicate-rank", "outsider", "rollback-storm")
#: the kinds aimed at a shard whose names do not end in "-shard"
AT_A_SHARD = ("corrupt-checkpoint", "squatter", "full-disk", "insider-follower", "restart-primary-at-end")
#: the kinds that need each shard kept twice: drawn only for runs with replicas (an async run on the digits)
WITH_REPLICAS = ("squatter", "insider-follower", "restart-primary-at-end")
#: the kinds that need cuts to go back to: drawn only for sync runs ([cluster] checkpoint_rounds)
WITH_CUTS = ("rollback-storm",)
#: the kinds injected once every worker has finished: drawn only for runs that train to their end (not with
#: ``sigterm``), whose shards do not leave by themselves (no --exit-when-done)
AT_THE_END = ("restart-primary-at-end", "rollback-storm")


@dataclasses.dataclass
class Fault:
    kind: str
    at: float  # the slowest worker's progress (fraction of its steps) at which it is injected
    target: int = 0  # shard or worker index (a worker that has finished passes it on to the next)
    seconds: float = 0.0  # stop, hostile, netcut, squatter, full-disk, flood: how long
    count: int = 0  # hostile: connections of each sort per port; trickled-push: unregistered ones per shard;
    #                        flood: idle connections per gRPC port; rollback-storm: rollbacks asked of each shard
    role: str = ""  # netcut: whose link ("shard" or "worker")
    offset: float = 0.0  # kill-worker: seconds after the worker logged a step (so that it lands mid-step)
    damage: str = ""  # corrupt-checkpoint: what is done to the newest checkpoint ("flipped", "truncated",
    #                        "manifest"; psgd.bench.chaos.faults.damage_checkpoint)

    def describe(self) -> str:
        who = (
            self.role
            if self.kind == "netcut"
            else "worker"
            if self.kind in AT_A_WORKER
            else "shard"
            if self.kind in AT_A_SHARD
            else self.kind.rpartition("-")[2]
        )
        text = self.kind + (f" {who} {self.target}" if who in ("shard", "worker") else "")
        if self.kind == "kill-worker":
            text += f" {self.offset * 1000:.1f} ms after a step"
        if self.damage:
            text += f", its newest checkpoint {self.damage}"
        if self.kind == "hostile":
            text += f" {self.count}+{self.count} connection(s) per port"
        if self.kind == "trickled-push":
            text += f", {self.count}+1 connection(s) per shard"
        if self.kind == "flood":
            text += f" {self.count} idle connection(s) per gRPC port"
        if self.kind == "rollback-storm":
            text += f", {self.count} rollback(s) asked of each shard"
        if self.seconds:
            text += (
                f", restarted {self.seconds:.1f}s later" if self.kind == "kill-worker" else f" for {self.seconds:.1f}s"
            )
        return text


#: the transports the runs take turns with ("shm": shared memory, everything runs on this machine; the digits
#: model is too small for "auto" to take it)
TRANSPORTS = ("shm", "tcp", "grpc")


@dataclasses.dataclass
class RunSpec:
    index: int
    policy: str
    transport: str  # [cluster] transport: shm (shared memory here), tcp or grpc
    model: str  # softmax or mlp (on the digits), embed (on clicks: a table's rows on the shards)
    workers: int
    exit_when_done: bool
    faults: list[Fault]
    end: str  # "finish" (train to the end) or "sigterm" (every process at once)
    end_at: float  # sigterm: the progress at which it is sent
    namespaces: bool  # the run lives in network namespaces (it has a netcut)
    replicas: bool = False  # each shard kept twice ([cluster] replicas = 1): every async run on the digits

    def describe(self) -> str:
        return (
            f"{self.policy}, {self.model}, {self.workers} workers, transport {self.transport}"
            + (", in namespaces" if self.namespaces else "")
            + (", --exit-when-done" if self.exit_when_done else "")
            + (", a replica per shard" if self.replicas else "")
            + f"; faults: {', '.join(f.describe() for f in self.faults) or 'none'}; end: {self.end}"
        )


class Planner:
    """Draws run after run from one seeded generator; fault kinds come from a shuffled bag (every kind once
    before any twice), and the (policy, transport) pairs come six at a time, the first three runs of each six
    covering both policies and every transport, so a few runs cover them all.  The model is softmax or mlp on
    the digits, drawn, except in every third run (2, 5, ...): embed on clicks, a job with an embedding table.  A
    kind that does not fit a run (WITH_REPLICAS, WITH_CUTS, AT_THE_END) stays in the bag for a later run."""

    def __init__(self, seed: int, kinds: Sequence[str], namespaces: str | None):
        self.rng = random.Random(seed)
        self.kinds = list(kinds)
        self.why_no_namespaces = namespaces  # None: namespaces can be made
        self._bag: list[str] = []
        self._pairs: list[tuple[str, str]] = []
        self.skipped: dict[str, str] = {}

    def _draw(self, fits: Callable[[str], bool]) -> str:
        """The next kind from the bag that ``fits`` the run ("" where no kind can: --kinds chose only others)."""
        if not any(fits(kind) for kind in self.kinds):
            return ""
        while True:
            for i in range(len(self._bag) - 1, -1, -1):  # popped from the end: the kinds left over come first
                if fits(self._bag[i]):
                    return self._bag.pop(i)
            fresh = list(self.kinds)
            self.rng.shuffle(fresh)
            self._bag = fresh + self._bag

    def next(self, index: int) -> RunSpec:
        rng = self.rng
        if not self._pairs:
            transports = list(TRANSPORTS)
            rng.shuffle(transports)
            policies = ["sync", "async", rng.choice(("sync", "async"))]
            rng.shuffle(policies)
            first = list(zip(policies, transports))
            second = [("async" if p == "sync" else "sync", t) for p, t in first]
            self._pairs = (first + second)[::-1]  # popped from the end: first comes first
        policy, transport = self._pairs.pop()
        workers = rng.choice((2, 3))
        model = rng.choice(("softmax", "mlp"))
        if index % 3 == 2:  # every third run the sparse job, with the same draws as the others
            model = "embed"
        replicas = policy != "sync" and model != "embed"
        drawn: list[str] = []

        def fits(kind: str) -> bool:
            if kind in WITH_REPLICAS and not replicas or kind in WITH_CUTS and policy != "sync":
                return False
            return not (
                kind == "sigterm" and any(k in AT_THE_END for k in drawn) or kind in AT_THE_END and "sigterm" in drawn
            )

        for _ in range(FAULTS_PER_RUN):
            drawn.append(self._draw(fits))
        faults = []
        for kind in filter(None, drawn):
            if kind == "sigterm":
                continue
            if kind == "netcut" and self.why_no_namespaces:
                self.skipped["netcut"] = self.why_no_namespaces
                continue
            fault = Fault(kind, 0.0)
            if kind.endswith("-shard") or kind in AT_A_SHARD:
                fault.target = rng.randrange(SHARDS)
                if kind == "corrupt-checkpoint":
                    fault.damage = rng.choice(("flipped", "truncated", "manifest"))
            elif kind.endswith("-worker") or kind in AT_A_WORKER:
                fault.target = rng.randrange(workers)
                fault.offset = round(rng.uniform(0.0, 0.012), 4)
                if kind == "kill-worker" and rng.random() < 0.5:  # restarted after its lease ran out
                    fault.seconds = round(rng.uniform(LEASE + 0.5, LEASE + 2.0), 2)
            if kind.startswith("stop-"):
                fault.seconds = round(rng.uniform(0.5, 3.0), 2)
            elif kind in ("squatter", "full-disk"):
                fault.seconds = round(rng.uniform(1.5, 3.0), 2)
            elif kind == "hostile":
                fault.seconds, fault.count = round(rng.uniform(1.5, 3.0), 2), rng.randint(8, 24)
            elif kind == "flood":  # more than a gRPC port takes (psgd.server.net.listen.GRPC_CONNECTIONS, 1,024)
                fault.seconds, fault.count = round(rng.uniform(2.0, 4.0), 2), rng.randint(1200, 2000)
            elif kind == "trickled-push":
                fault.count = rng.randint(2, 4)
            elif kind == "rollback-storm":
                fault.count = rng.randint(20, 50)
            elif kind == "netcut":
                fault.role = rng.choice(("shard", "worker"))
                fault.target = rng.randrange(SHARDS if fault.role == "shard" else workers)
                fault.seconds = round(rng.uniform(1.0, 3.0), 2)
            faults.append(fault)
        last = [f for f in faults if f.kind in AT_THE_END]  # once every worker has finished: after the others
        faults = [f for f in faults if f.kind not in AT_THE_END]
        for fault, at in zip(faults, sorted(rng.uniform(0.1, 0.7) for _ in faults)):
            fault.at = round(at, 3)
        for fault in last:
            fault.at = 1.0
        faults += last
        end = "sigterm" if "sigterm" in drawn else "finish"
        end_at = round(max([0.5] + [f.at + 0.1 for f in faults]) if end == "sigterm" else 1.0, 3)
        return RunSpec(
            index,
            policy,
            transport,
            model,
            workers,
            exit_when_done=end == "finish" and rng.random() < 0.5 and not last,
            faults=faults,
            end=end,
            end_at=min(end_at, 0.9),
            namespaces=any(f.kind == "netcut" for f in faults),
            replicas=replicas,
        )
