"""The shard core's state taken and given whole, each under the core's lock, by the core's own methods: a checkpoint
written from it, a checkpoint (or a primary's state) adopted, a cut gone back to, the state handed to a new
replica, the primary's updates and policy applied by its replica, the roles of a pair.

:class:`CoreState` is a part of :class:`psgd.server.core.ShardCore` (its base), kept apart from the requests
(register, pull, push, ...): what recovery (:mod:`psgd.server.recovery`), the pair (:mod:`psgd.server.replica`) and
the replica's stream (:mod:`psgd.server.stream`) need of the core, so that no module but these two takes the core's
lock or touches its private members (tests/unit/test_layering.py holds them to it).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Mapping, TypeVar

import numpy as np

from psgd.policy import APPLY
from psgd.server.checkpoint import Checkpoint, CheckpointError
from psgd.server.errors import ShardError

T = TypeVar("T")

#: A shard goes back for a new cause at most once in this many seconds (a worker asked to wait retries): a shard
#: restarts from a cut in seconds, and a storm of made-up causes cannot hold the job at one version.
ROLLBACK_SPACING = 1.0
STALENESS_BUCKETS = 16  # histogram entries 0..14 exact, the last counts 15 and more


class CoreState:
    """The whole-state operations of :class:`~psgd.server.core.ShardCore` (which provides the fields)."""

    # -- a checkpoint's worth ------------------------------------------------------------------------------------
    def _state(self) -> tuple[dict, dict]:
        """(Under the lock, no update half made.)  What a checkpoint of this core holds: its arrays (views of the
        live ones) and manifest; also what a primary sends a new replica."""
        arrays = {"weights": self.flat}
        arrays.update({f"opt/{k}": v for k, v in self.optimizer.state_dict().items()})
        if self.round is not None:  # a round in flight: its sum, and the pushes an ordered one keeps apart, apart
            arrays["round_sum"] = self.round.so_far()
            arrays.update({f"round_push/{w}": a for w, a in self.round.apart.items()})
        arrays.update(self.tables.arrays())
        manifest = {"fingerprint": self.fingerprint, "identity": self.identity, "version": self.version,
                    "shard": self.shard, "plan_hash": self.plan.hash, "plan": self.plan.description(),
                    "policy": self.policy.state_dict(), "counters": dict(self.counters),
                    "staleness_histogram": list(self.staleness_histogram),
                    "round_bases": list(self.round.bases) if self.round else [],
                    "optimizer": self.optimizer.describe(),
                    "holders": self.roster.holders()}
        return arrays, manifest

    def write_checkpoint(self, save: Callable[[int, dict, dict], T], held: bool = False,
                         force: bool = False) -> T | None:
        """``save(version, arrays, manifest)`` of this core's whole state (what it returns: the file's path), or
        nothing where the state is the one last saved (unless ``force``).  Under the lock, straight from the live
        arrays with no update half made: consistent, and no second copy of the weights; training pauses meanwhile.
        ``held``: the caller holds the lock already (a sync round's cut, as it closes).  A failure is counted
        (``checkpoint_failures``) and raised (CheckpointError)."""
        with contextlib.nullcontext() if held else self.lock:
            if not held:
                self.store.settle()  # the policy's clocks and the weights say the same
            if not force and self.last_checkpoint and self.last_checkpoint[0] == self.version:
                return None
            arrays, manifest = self._state()
            try:
                path = save(self.version, arrays, manifest)
            except CheckpointError:
                self.counters["checkpoint_failures"] = self.counters.get("checkpoint_failures", 0) + 1
                raise
            self.last_checkpoint = (self.version, time.time())
            return path

    def adopt(self, ckpt: Checkpoint, restored: bool = False) -> None:
        """Everything of ``ckpt`` (checked: psgd.server.recovery.check), or of a primary's state on its replica:
        the training state, the counters, the staleness histogram, and each rank kept for its holder.
        ``restored``: the shard starts from it (it says so in Status, and it is its last checkpoint)."""
        m = ckpt.manifest
        with self.lock:
            self._put_back(ckpt)
            self.counters.update({k: type(self.counters[k])(v) for k, v in m.get("counters", {}).items()
                                  if k in self.counters})
            self.staleness_histogram[:] = [int(v) for v in m["staleness_histogram"]][:STALENESS_BUCKETS]
            self.roster.keep_for(m.get("holders", {}))
            if restored:
                self.restored_version = self.version
                self.last_checkpoint = (self.version, float(m.get("written_at", time.time())))

    def _put_back(self, ckpt: Checkpoint) -> None:
        """(Under the lock.)  The training state of ``ckpt``: weights, optimizer, policy, the round in the making,
        tables, version.  Who holds which rank, the counters and the leases stay as they are, and the policy expects the
        workers the roster does (not those live when the checkpoint was written: a stopped job's had all left)."""
        m, a = ckpt.manifest, ckpt.arrays
        weights = a.get("weights")
        if weights is None or weights.shape != self.flat.shape or weights.dtype != self.flat.dtype:
            raise CheckpointError(f"{ckpt.path}: its weights do not fit shard {self.shard}")
        self.store.replace(weights)
        self.optimizer.load_state_dict({k[4:]: v for k, v in a.items() if k.startswith("opt/")})
        self.policy.load_state_dict(m["policy"], live_now=self.roster.expected())
        if self.round is not None:
            self.round.clear()
            if "round_sum" in a:
                self.round.load(a["round_sum"], m.get("round_bases", []),
                                {int(k.split("/")[1]): v for k, v in a.items() if k.startswith("round_push/")})
        if self.tables:
            self.tables.load(a)
        self.version = int(m["version"])

    # -- going back to a cut ---------------------------------------------------------------------------------------
    def went_back_for(self, cause: str) -> bool:
        """Whether this shard went back for ``cause`` already (it goes back once per cause)."""
        with self.lock:
            return cause in self.rollback_causes

    def go_back(self, version: int, cause: str, worker: int, load: Callable[[], Checkpoint]) -> int:
        """Go back to the cut at ``version`` for ``cause`` (once per cause), as ``worker`` asks; ``load()`` reads and
        checks this shard's checkpoint of it, outside the lock (the shard serves meanwhile; under sync nobody can go
        on).  Every worker then continues from ``version``: a request with a later clock is refused with
        ROLLED_BACK, naming it, until the worker comes with one no later.  Returns the rounds undone."""
        with self.lock:
            if cause in self.rollback_causes:
                return 0
            last = max(self.rollback_causes.values(), default=None)
            if last is not None and time.monotonic() - last < ROLLBACK_SPACING:
                raise ShardError("UNAVAILABLE", f"shard {self.shard} went back for another cause "
                                 f"{time.monotonic() - last:.2f}s ago; it goes back at most once a "
                                 f"{ROLLBACK_SPACING:g}s")
            if self.version < version:
                raise ShardError("FAILED_PRECONDITION", f"shard {self.shard} is at version {self.version}, behind "
                                 f"the cut at {version} that worker {worker} asks it to go back to")
            if self.version == version:  # there already (the shard that restarted, or one that never went past it)
                self._went_back(cause, version)
                return 0
        ckpt = load()
        with self.lock:
            if cause in self.rollback_causes:
                return 0
            undone = self.version - version
            self._put_back(ckpt)
            self._went_back(cause, version)
            self.counters["rollbacks"] += 1
            self.counters["rounds_undone"] += undone
            self.counters["applied"] -= undone  # the updates the weights hold: the version
        return undone

    def _went_back(self, cause: str, version: int) -> None:
        self.rollback_causes[cause] = time.monotonic()
        self.rewinding = {w: version for w in range(self.num_workers)}
        self.changed.notify_all()

    # -- a pair of processes ---------------------------------------------------------------------------------------
    def join_pair(self, pair: Any) -> None:
        """This process is one of a pair (psgd.server.replica.Replication): it serves no worker until it takes a
        role."""
        with self.lock:
            self.replication, self.role = pair, "starting"
            # times the pair's leader changed (copied with the state): the later of two leaders has the larger
            self.counters.setdefault("failovers", 0)
            self.counters.setdefault("unreplicated", 0)  # pushes its primary acknowledged without a copy

    def take_role(self, role: str, only_from: str | None = None, failover: bool = False) -> None:
        """Serve as ``role`` (where it was ``only_from``, when given), waking whatever waits on who serves;
        ``failover``: a replica taking over (counted)."""
        with self.lock:
            if only_from is not None and self.role != only_from:
                return
            self.role = role
            if failover:
                self.counters["failovers"] += 1
            self.wake()

    def count(self, counter: str) -> None:
        with self.lock:  # one a checkpoint written before it was counted lacks starts at 0
            self.counters[counter] = self.counters.get(counter, 0) + 1

    def notify(self) -> None:
        """Wake whatever waits on the policy or on who serves (:meth:`wake`, taking the lock)."""
        with self.lock:
            self.wake()

    def hand_over(self, attach: Callable[[int], bool]) -> tuple[int, dict, dict] | None:
        """The whole state a new follower starts from, copied (the weights move on): (version, arrays, manifest),
        where ``attach(version)`` says yes; asked under the lock with no update half made, so that the updates after
        it are the ones the pair queues from then on.  None where it says no."""
        with self.lock:
            self.store.settle()
            if not attach(self.version):
                return None
            arrays, manifest = self._state()
            return self.version, {k: np.array(v) for k, v in arrays.items()}, manifest

    def adopt_policy(self, state: Mapping[str, Any]) -> None:
        """The primary's policy state (its clocks), on its replica."""
        with self.lock:
            self.policy.load_state_dict(dict(state))

    def apply_replicated(self, seq: int, worker: int, clock: int, staleness: int, lr_scale: float,
                         grads: Mapping[int, np.ndarray], answer: Callable[[str], None]) -> None:
        """On a replica: the primary's update ``seq`` (worker ``worker``'s push at ``clock``), checked against this
        process's policy before ``answer`` is called with "" (the primary acknowledges the push on it) or why not
        (then refused: FAILED_PRECONDITION), and applied after."""
        with self.lock:
            decision = self.policy.push(worker, clock) if self.version + 1 == seq else None
            if decision is None or decision.action != APPLY:
                why = (f"replica of shard {self.shard} at version {self.version} cannot apply update {seq} (worker "
                       f"{worker}, clock {clock}): "
                       f"{(decision.reason or decision.action) if decision else 'out of order'}")
                answer(why)
                raise ShardError("FAILED_PRECONDITION", why)
            answer("")  # held: applied while the next comes
            self._record_staleness(staleness)
            self._apply(grads, lr_scale, self.remedies.share)
            self.counters["pushes"] += 1
