"""A shard's state taken and given whole: what a checkpoint of it holds and a new replica starts from
(:meth:`WholeState.take`), and such a state put back (a checkpoint adopted, a primary's state on its replica, a cut
gone back to); which checkpoint the shard started from and which it wrote last; and how a process that started
from one meets each worker again, the first time it registers (:meth:`WholeState.met`).

Its core holds one and calls it under the core's lock with no update half made
(:meth:`psgd.server.state.core.ShardCore.write_checkpoint`, ``adopt``, ``hand_over``, ``go_back``): the version, the
counters and the staleness histogram stay the core's, which every push changes, and are handed in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from psgd.data.blocks import Blocks
from psgd.optim import Optimizer
from psgd.partition import PartitionPlan
from psgd.policy import Policy
from psgd.server.state.admission import Roster
from psgd.server.state.checkpoint import Checkpoint, CheckpointError
from psgd.server.state.rounds import Round
from psgd.server.state.store import WeightStore
from psgd.server.state.tables import ShardTables

log = logging.getLogger(__name__)

T = TypeVar("T")


class WholeState:
    """The parts of shard ``shard`` that its state is made of, and ``restored_version`` (the checkpoint this
    process started from) and ``last_checkpoint`` ((version, time) of the newest one it wrote), which
    psgd.server.durable.recovery keeps; ``joined``: the workers registered with this process (a restart forgets
    them)."""

    def __init__(
        self,
        plan: PartitionPlan,
        shard: int,
        fingerprint: str,
        identity: Mapping[str, Any] | None,
        store: WeightStore,
        optimizer: Optimizer,
        policy: Policy,
        round: Round | None,
        tables: ShardTables,
        roster: Roster,
        blocks: Blocks | None = None,
    ):
        self.plan, self.shard, self.fingerprint, self.identity = plan, shard, fingerprint, identity
        self.store, self.optimizer, self.policy, self.round = store, optimizer, policy, round
        self.tables, self.roster = tables, roster
        self.blocks = blocks  # shard 0 of a job with a range: the batches handed out (its lobby's)
        self.restored_version: int | None = None
        self.last_checkpoint: tuple[int, float] | None = None
        self.joined: set[int] = set()

    def take(self, version: int, counters: Mapping[str, Any], histogram: list[int]) -> tuple[dict, dict]:
        """What a checkpoint of the shard at ``version`` holds: its arrays (views of the live ones) and manifest;
        also what a primary sends a new replica."""
        arrays = {"weights": self.store.flat}
        arrays.update({f"opt/{k}": v for k, v in self.optimizer.state_dict().items()})
        if self.round is not None:  # a round in flight: its sum, and the pushes an ordered one keeps apart, apart
            arrays["round_sum"] = self.round.so_far()
            arrays.update({f"round_push/{w}": a for w, a in self.round.apart.items()})
        arrays.update(self.tables.arrays())
        manifest = {
            "fingerprint": self.fingerprint,
            "identity": self.identity,
            "version": version,
            "shard": self.shard,
            "plan_hash": self.plan.hash,
            "plan": self.plan.description(),
            "policy": self.policy.state_dict(),
            "counters": dict(counters),
            "staleness_histogram": list(histogram),
            "round_bases": list(self.round.bases) if self.round else [],
            "optimizer": self.optimizer.describe(),
            "holders": self.roster.holders(),
        }
        if self.blocks is not None:  # each worker's batches from the clock it pushes next (a cut's, under sync)
            clocks = {w: self.policy.clock_of(w) for w in range(self.roster.num_workers)}
            since = {w: min(c, version) if self.policy.accumulates else c for w, c in clocks.items()}
            manifest["blocks"] = self.blocks.state_dict(since)
        return arrays, manifest

    def hand_over(
        self, attach: Callable[[int], bool], version: int, counters: Mapping[str, Any], histogram: list[int]
    ) -> tuple[int, dict, dict] | None:
        """The whole state a new follower starts from at ``version``, copied (the weights move on): (version,
        arrays, manifest), where ``attach(version)`` says yes; else None."""
        if not attach(version):
            return None
        arrays, manifest = self.take(version, counters, histogram)
        return version, {k: np.array(v) for k, v in arrays.items()}, manifest

    def met(self, worker: int, clock: int, version: int, cuts: bool) -> bool:
        """Whether the job goes back to the cut at ``version`` for ``worker``, met by this process for the first time
        at ``clock``: so where it is ahead of the policy and this process restarted from a cut (``cuts``: the job
        cuts).  Ahead of a process that did not, the policy jumps ahead to it: the updates since the shard's
        checkpoint are lost on this shard, but nobody repeats or waits."""
        if worker in self.joined:
            return False
        self.joined.add(worker)
        restored, ahead = self.restored_version, clock > self.policy.clock_of(worker)
        if ahead and cuts and restored is not None:
            log.warning(
                "shard %d: worker %d comes back at clock %d, ahead of this shard, restarted from the "
                "cut at version %d: the job goes back to it",
                self.shard,
                worker,
                clock,
                version,
            )
            return True
        if ahead:
            log.warning(
                "shard %d: worker %d comes back at clock %d, ahead of this shard (%s); continuing from there",
                self.shard,
                worker,
                clock,
                f"restored from the checkpoint of version {restored}"
                if restored is not None
                else "started without a checkpoint: its earlier updates are lost",
            )
            if self.policy.fast_forward(worker, clock):
                self.round.clear()
                self.tables.clear_round()
        return False

    def write(
        self,
        save: Callable[[int, dict, dict], T],
        version: int,
        counters: dict[str, Any],
        histogram: list[int],
        force: bool,
    ) -> T | None:
        """``save(version, arrays, manifest)`` of the state at ``version`` (what it returns), or nothing where that
        is the one last saved (unless ``force``).  A failure is counted in ``counters`` (``checkpoint_failures``)
        and raised (CheckpointError)."""
        if not force and self.last_checkpoint is not None and self.last_checkpoint[0] == version:
            return None
        try:
            path = save(version, *self.take(version, counters, histogram))
        except CheckpointError:
            counters["checkpoint_failures"] = counters.get("checkpoint_failures", 0) + 1
            raise
        self.last_checkpoint = (version, time.time())
        return path

    def adopt(self, ckpt: Checkpoint, counters: dict[str, Any], histogram: list[int], restored: bool) -> int:
        """Everything of ``ckpt``: its training state (:meth:`put_back`), and into ``counters`` and ``histogram``
        (the core's) its own; each rank kept for its holder.  ``restored``: the shard starts from it.  Returns its
        version."""
        m = ckpt.manifest
        version = self.put_back(ckpt)
        counters.update({k: type(counters[k])(v) for k, v in m.get("counters", {}).items() if k in counters})
        histogram[:] = [int(v) for v in m["staleness_histogram"]][: len(histogram)]
        self.roster.keep_for(m.get("holders", {}))
        if self.blocks is not None and "blocks" in m:  # a process restarted: the batches it had handed out
            self.blocks.load_state_dict(m["blocks"])
        if restored:
            self.restored_version = version
            self.last_checkpoint = (version, float(m.get("written_at", time.time())))
        return version

    def put_back(self, ckpt: Checkpoint) -> int:
        """The training state of ``ckpt``: weights, optimizer, policy, the round in the making, tables; returns its
        version.  Who holds which rank, the counters and the leases stay as they are, and the policy expects the
        workers the roster does (not those live when the checkpoint was written: a stopped job's had all left)."""
        m, a = ckpt.manifest, ckpt.arrays
        weights, flat = a.get("weights"), self.store.flat
        if weights is None or weights.shape != flat.shape or weights.dtype != flat.dtype:
            raise CheckpointError(f"{ckpt.path}: its weights do not fit shard {self.shard}")
        self.store.replace(weights)
        self.optimizer.load_state_dict({k[4:]: v for k, v in a.items() if k.startswith("opt/")})
        self.policy.load_state_dict(m["policy"], live_now=self.roster.expected())
        if self.round is not None:
            self.round.clear()
            if "round_sum" in a:
                self.round.load(
                    a["round_sum"],
                    m.get("round_bases", []),
                    {int(k.split("/")[1]): v for k, v in a.items() if k.startswith("round_push/")},
                )
        if self.tables:
            self.tables.load(a)
        return int(m["version"])

    def status(self) -> dict:
        return {
            "checkpoint": {"version": self.last_checkpoint[0], "written_at": self.last_checkpoint[1]}
            if self.last_checkpoint
            else None,
            "restored_version": self.restored_version,
        }
