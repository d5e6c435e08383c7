"""A parameter-server shard without any transport: the policy, the optimizer, a sync round in the making
(:mod:`psgd.server.state.rounds`), the weight store (:mod:`psgd.server.state.store`) and the workers' roster
(:class:`psgd.server.state.admission.Roster`).

A worker's requests reach it through one handler (:mod:`psgd.server.net.handler`) behind both transports (gRPC,
the data path); tests drive the core directly.  Its state is taken and given whole by its own methods too (a
checkpoint written or adopted, a replica's hand-over: :mod:`psgd.server.state.whole`; a cut gone back to:
:mod:`psgd.server.state.rewind`; a replica's updates), so that no other module takes its lock or touches its private
members.  Every failure is a :class:`ShardError`
carrying the name of the gRPC status code it maps to, and a message that says what to do.

Locking: one lock guards weights, policy and leases; pulls wait on a condition variable until the policy lets them
through, never longer than their timeout.  Updates are applied under the lock, so a pull sees whole versions; a read
in flight keeps its version without holding updates back, and what reads the whole state (a checkpoint, a replica)
finds no update half made (psgd.server.state.store).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import numpy as np

from psgd.config import Deadlines, Remedies
from psgd.job import fingerprint as job_fingerprint
from psgd.optim import WHOLE, Optimizer, Share
from psgd.partition import PartitionPlan
from psgd.policy import ACCUMULATE, APPLY, OUTCOME_COUNTERS, OUTCOMES, REJECT, Policy
from psgd.server.errors import ShardError
from psgd.server.state import admission, said
from psgd.server.state.checkpoint import Checkpoint
from psgd.server.state.lobby import Lobby
from psgd.server.state.remedies import PushRemedies
from psgd.server.state.rewind import Rewind
from psgd.server.state.rounds import Round
from psgd.server.state.store import LiveRead, Snapshot, WeightStore
from psgd.server.state.tables import RowsIn, ShardTables
from psgd.server.state.whole import WholeState

log = logging.getLogger(__name__)

MAX_CLOCK = 2**63 - 2  # the largest clock a push may carry: the next clock (clock + 1) must fit the wire's int64
STALENESS_BUCKETS = 16  # histogram entries 0..14 exact, the last counts 15 and more

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class PushResult:
    outcome: str  # one of psgd.policy.OUTCOMES' values
    next_clock: int
    version: int
    staleness: int
    pull_ready: bool = True  # whether the pusher's pull of the next clock may go at once (not so in an open round)


class ShardCore:
    """Shard ``shard`` of a job: its slices' weights, the policy and the optimizer.

    The weights of all slices live in one contiguous array (``flat``), in slice-id order, which is also the order
    slices travel in on the wire."""

    def __init__(
        self,
        plan: PartitionPlan,
        shard: int,
        values: Mapping[int, np.ndarray],
        optimizer: Optimizer,
        policy: Policy,
        *,
        num_workers: int,
        fewest: int | None = None,  # a job with a range of workers ("MIN:MAX"): MIN, the workers it starts with
        deadlines: Deadlines | None = None,  # how long a silent or missing worker keeps its place ([cluster]'s part)
        allow_nonfinite: bool = False,
        apply_threads: int | None = None,
        identity: Mapping[str, Any] | None = None,
        tables: ShardTables | None = None,
        cut_rounds: int = 0,
        now: Callable[[], float] = time.monotonic,
        remedies: Remedies | None = None,  # what the shard does to a stale async push ([cluster]'s part)
    ):
        self.plan, self.shard = plan, shard
        # What every process of the job must agree on (psgd.job.identity); None: only the plan is compared.
        self.identity = dict(identity) if identity is not None else None
        self.fingerprint = job_fingerprint(identity) if identity is not None else plan.hash[:16]
        self.slices = {s.id: s for s in plan.slices_for_shard(shard)}
        dtypes = {s.dtype for s in plan.specs}
        if len(dtypes) != 1:
            raise ValueError(f"all variables must share one dtype, got {sorted(dtypes)}")
        self.dtype = dtypes.pop()
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.serving_changed = threading.Condition(self.lock)  # who serves changed (see wake); not at every update
        self.store = WeightStore(self.slices, values, self.dtype, self.changed, shard, apply_threads)
        self.offsets, self.nbytes = self.store.offsets, self.store.nbytes
        self.optimizer, self.policy = optimizer, policy
        self.num_workers, self.allow_nonfinite = num_workers, allow_nonfinite
        self.roster = admission.Roster(shard, num_workers, deadlines or Deadlines(), now, fewest)
        for w in range(self.roster.fewest, num_workers):  # a rank above the fewest trains once a worker takes it
            policy.leave(w)
        # shard 0 of a job with a range: the ranks and batches joining workers take (psgd.server.state.lobby)
        self.lobby = Lobby(shard, plan, self.identity, self.roster, self.lock, self._check_serving)
        # "divided" divides by the workers training when a push is applied: a job with a range grows and shrinks
        members = (lambda: len(policy.live_workers())) if self.roster.ranged else (lambda: num_workers)
        self.remedies = PushRemedies(
            members, policy.accumulates, lambda: self.store.flat, self.store.views, remedies or Remedies()
        )
        self.version = 0
        # a sync round in the making, its pushes added in the workers' order where the job goes back to cuts
        self.round = Round(self.store, ordered=bool(cut_rounds)) if policy.accumulates else None
        self.tables = tables if tables is not None else ShardTables(plan, shard, {})  # this shard's rows
        self.remedies.watch_tables(self.tables.tables)
        self.staleness_histogram = [0] * STALENESS_BUCKETS
        self.counters = {
            "pushes": 0,
            "pulls": 0,
            "applied": 0,
            "accumulated": 0,
            "duplicates": 0,
            "late": 0,
            "rejected": 0,
            "expired": 0,
            "bytes_in": 0,
            "bytes_out": 0,
            "rollbacks": 0,
            "rounds_undone": 0,
            "data_requests": 0,
            "data_cpu_seconds": 0.0,
            "receive_seconds": 0.0,
        }
        self.closing = False
        self.halted = ""  # why it refuses every call (a cut it could not write: psgd.server.durable.recovery.Failures)
        # sync: at each multiple of ``cut_rounds`` rounds, ``on_cut`` runs under the lock, before the next round
        # ([cluster] checkpoint_rounds: every shard checkpoints the same versions)
        self.cut_rounds = cut_rounds
        self.on_cut: Callable[[], None] | None = None
        # its state taken and given whole, and its checkpoints' versions (psgd.server.durable.recovery)
        self.whole = WholeState(
            plan,
            shard,
            self.fingerprint,
            self.identity,
            self.store,
            optimizer,
            policy,
            self.round,
            self.tables,
            self.roster,
            self.lobby.blocks,  # kept in its checkpoints
        )
        self.rewind = Rewind(shard, num_workers)  # what its rollbacks leave (psgd.server.durable.recovery.rollback)
        # [cluster] replicas = 1: "primary", "replica" ("starting" until it knows, "stopping" a primary that stops
        # while its workers train), and the pair (psgd.server.durable.replica)
        self.role, self.replication = "", None

    @property
    def flat(self) -> np.ndarray:
        """The weights of this version, in slice order (the store's current slot)."""
        return self.store.flat

    @property
    def weights(self) -> dict[int, np.ndarray]:
        return self.store.weights

    def place_weights(self, slots: list[np.ndarray], seq: np.ndarray) -> None:
        """Keep the weights in ``slots`` (each as long as :attr:`flat`, of its dtype) with their sequence numbers in
        ``seq`` from now on: the data port moves them into shared memory this way (psgd.server.net.datapath)."""
        with self.lock:
            self.store.rehome(slots, seq)

    # -- helpers ------------------------------------------------------------
    def _record_staleness(self, staleness: int) -> None:
        self.staleness_histogram[min(max(staleness, 0), STALENESS_BUCKETS - 1)] += 1

    def _apply(self, grads: Mapping[int, np.ndarray], lr_scale: float, share: Share = WHOLE) -> None:
        """Update the weights (under the lock), once no live read is sending from them."""
        self.store.apply(self.optimizer, grads, lr_scale, share)
        self.version += 1
        self.counters["applied"] += 1

    def _close_rounds(self, rounds: Iterable[int]) -> None:
        for _ in rounds:
            bases = self.round.mean()
            if not bases:
                continue
            for base in bases:
                self._record_staleness(self.version - base)
            self.tables.close_round(len(bases))  # the version the dense update below makes
            self._apply(self.round.total(), 1.0)
            self.round.clear()
            if self.cut_rounds and self.version % self.cut_rounds == 0 and self.on_cut is not None:
                self.on_cut()
        self.changed.notify_all()

    def _check_serving(self) -> None:
        if self.halted:
            raise ShardError("FAILED_PRECONDITION", self.halted)
        if self.role in ("replica", "starting", "stopping"):
            if self.role == "replica" and self.replication is not None:
                self.replication.asked()  # a worker that cannot reach the primary: a replica that lost it may lead
            raise ShardError(
                "UNAVAILABLE",
                f"this process of shard {self.shard} serves no worker ({self.role}): the "
                "other process of its pair does",
                reason="NOT_PRIMARY",
            )

    def _policy_changed(self) -> None:
        if self.replication is not None:  # the policy's state, no update half made (the replica applies each after)
            self.store.settle()
            self.replication.policy_changed()

    # -- requests -----------------------------------------------------------------
    def register(
        self,
        worker: int,
        plan_hash: str,
        plan_json: str = "",
        hostname: str = "",
        pid: int = 0,
        clock: int = 0,
        job_json: str | None = None,
        incarnation: str = "",
    ) -> int:
        """(Re)join ``worker``; returns the clock it continues from.

        ``clock`` is where the worker is: a shard process that meets it for the first time ahead of itself jumps
        ahead to it, or goes back to a cut (WholeState.met).  ``incarnation`` names the registering process:
        another one is refused while this rank's lease runs (Roster.admit).
        """
        self.roster.check(worker)
        admission.check_job(self.shard, self.plan, self.identity, worker, plan_hash, plan_json, job_json)
        if clock < 0:
            raise ShardError("INVALID_ARGUMENT", f"clock {clock} is negative")
        with self.lock:
            self._check_serving()
            info = self.roster.admit(worker, hostname, pid, incarnation)
            if self.whole.met(worker, clock, self.version, bool(self.cut_rounds)):
                self.rewind.ask(worker, self.version)
            info.clock = clock = self.policy.join(worker)
            self.lobby.registered(worker)
            self._policy_changed()
            self.changed.notify_all()
        log.info(
            "shard %d: worker %d registered (%s pid %d), continues at clock %d",
            self.shard,
            worker,
            hostname or "?",
            pid,
            clock,
        )
        return clock

    def pull(
        self,
        worker: int | None,
        clock: int,
        timeout: float,
        cancelled: Callable[[], bool] = lambda: False,
        copy: bool = True,
        hold: float = float("inf"),
        on_revoke: Callable[[], None] = lambda: None,
        key: str | None = None,
    ) -> Snapshot | LiveRead:
        """Wait until the policy lets ``worker`` (None: an observer, which never waits) read the weights
        for ``clock``, then return a read of them: a shared :class:`Snapshot` (``copy``), or a
        :class:`LiveRead` of the live weights, valid for ``hold`` seconds at least (psgd.server.state.store says
        what happens after).  Release either once the bytes are sent.  ``key``: the worker's registration's (see
        :meth:`Roster.live`: None only for a caller in this process).

        Waiting does not renew the worker's lease (its heartbeats do), so a
        worker that dies while its pull waits is still dropped on time; a
        pull whose caller has gone (``cancelled``) stops waiting.
        """
        if worker is not None:
            self.roster.check(worker)
            if clock < 0:
                raise ShardError("INVALID_ARGUMENT", f"clock {clock} is negative")
        deadline = time.monotonic() + max(timeout, 0.0)
        with self.lock:
            if worker is not None:
                self._check_serving()
                self.roster.live(worker, key)
                self.rewind.check(worker, clock)
                while not self.policy.pull_ready(worker, clock):
                    self.rewind.check(worker, clock)  # a rollback while it waited
                    self._check_serving()  # this process stepped down meanwhile
                    if self.closing:
                        raise ShardError("UNAVAILABLE", f"shard {self.shard} is shutting down")
                    if cancelled():
                        raise ShardError("CANCELLED", f"worker {worker} went away while its pull waited")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ShardError(
                            "DEADLINE_EXCEEDED",
                            f"pull for clock {clock} by worker {worker} waited "
                            f"{timeout:.1f}s under {self.policy.name}; "
                            f"{self.roster.behind(worker, clock)}",
                        )
                    self.changed.wait(min(left, 0.5))
                    self.roster.live(worker, key, renew=False)
            if not self.store.before_reading(deadline):
                raise ShardError("DEADLINE_EXCEEDED", f"pull waited {timeout:.1f}s for an update to finish")
            self.counters["pulls"] += 1
            self.counters["bytes_out"] += self.nbytes
            self.remedies.pulled(worker, self.version)
            return self.store.snapshot(self.version) if copy else self.store.live(self.version, worker, hold, on_revoke)

    def read_rows(self, worker: int | None, lookups: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The rows of each table ``lookups`` names (this shard's ids, distinct), after the pull that lets
        ``worker`` compute: made where they do not exist yet; an observer's (None) only read."""
        who = "an observer" if worker is None else f"worker {worker}"
        if worker is not None:
            self.roster.check(worker)
        with self.lock:
            rows = self.tables.read(lookups, who, make=worker is not None)
            self.remedies.pulled_rows(
                worker, self.version, {n: (np.asarray(lookups[n], np.int64), v) for n, v in rows.items()}
            )
            return rows

    def list_rows(self, table: str, start: int, max_rows: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """A page of ``table``'s rows as they are (:meth:`ShardTables.page`): ids, values, where the next page
        starts (-1: none), and the version they were read at."""
        with self.lock:
            return (*self.tables.page(table, start, max_rows, "a listing"), self.version)

    def push(
        self,
        worker: int,
        clock: int,
        base_version: int,
        grads: Mapping[int, np.ndarray],
        wire_bytes: int | None = None,
        rows: RowsIn | None = None,
        largest: float | None = None,
        key: str | None = None,
    ) -> PushResult:
        """Apply, accumulate or drop one gradient for every slice of this shard, and of the rows it touched
        (``rows``: ids and gradients by table, :mod:`psgd.server.state.tables`), as the policy says.
        ``wire_bytes``: what the push took on the wire (less than the gradient when compressed); ``largest``: the
        largest magnitude in ``grads``, where the receive measured it (not measured again); ``key``: the worker's
        registration's."""
        self.roster.check(worker)
        if clock < 0 or base_version < 0:
            raise ShardError("INVALID_ARGUMENT", f"clock ({clock}) and base version ({base_version}) must be >= 0")
        if clock > MAX_CLOCK:
            raise ShardError(
                "INVALID_ARGUMENT", f"clock {clock} is too large: a push's clock must be at most {MAX_CLOCK}"
            )
        self.store.check(grads, f"worker {worker}", largest, self.allow_nonfinite)
        rows = self.tables.check(rows or {}, f"push from worker {worker}", self.allow_nonfinite)
        with self.lock:
            self.store.after_settling()
            self._check_serving()
            info = self.roster.live(worker, key)  # first: a restarted shard asks the worker to register again
            self.rewind.check(worker, clock)
            if base_version > self.version:
                raise ShardError(
                    "INVALID_ARGUMENT",
                    f"base version {base_version} is ahead of shard {self.shard}'s version {self.version}",
                )
            decision = self.policy.push(worker, clock)
            staleness = self.version - base_version
            action = decision.action
            # a push is counted with its outcome, never before it: an update may let go of the lock while it waits
            # for a read (psgd.server.state.store), and a Status read meanwhile must find the counters adding up
            if action == REJECT:
                self.counters["pushes"] += 1
                self.counters["rejected"] += 1
                raise ShardError(
                    "FAILED_PRECONDITION",
                    f"push from worker {worker} at clock {clock} refused: {decision.reason}",
                    reason=decision.reason_code,
                )
            self.counters["bytes_in"] += sum(g.nbytes for g in grads.values()) if wire_bytes is None else wire_bytes
            info.clock = max(info.clock, decision.next_clock)
            outcome = OUTCOMES[action]
            if action == APPLY:
                self._record_staleness(staleness)
                grads = self.remedies.compensate(worker, base_version, grads, self.weights)
                rows = self.remedies.compensate_rows(worker, base_version, rows, self.tables.tables)
                lr_scale = self.remedies.lr_scale(staleness)
                self.tables.apply(rows, lr_scale, self.remedies.share)
                self._apply(grads, lr_scale, self.remedies.share)
                self.counters["pushes"] += 1
                self.changed.notify_all()
                if self.replication is not None:  # the replica applies it too before the worker hears back
                    ticket = self.replication.applied(worker, clock, staleness, lr_scale, grads)
            else:
                self.counters["pushes"] += 1
                self.counters[OUTCOME_COUNTERS[outcome]] += 1
            if action == ACCUMULATE:
                self.round.add(grads, base_version, worker, closes=bool(decision.closed_rounds))
                self.tables.add(rows, worker)
                self._close_rounds(decision.closed_rounds)
            result = PushResult(
                outcome, decision.next_clock, self.version, staleness, self.policy.pull_ready(worker, clock + 1)
            )
        if self.replication is not None:  # a duplicate too: the replica must hold the push before it is acknowledged
            self.replication.confirm(ticket if action == APPLY else result.version)
        return result

    def heartbeat(self, worker: int, clock: int, key: str | None = None) -> None:
        self.roster.check(worker)
        with self.lock:
            self._check_serving()
            self.roster.live(worker, key)

    def done(self, worker: int, clock: int, key: str | None = None) -> int:
        """``worker`` (its registration's ``key``) has finished; returns how many workers are still live."""
        self.roster.check(worker)
        with self.lock:
            self._check_serving()
            self.rewind.check(worker, clock)
            if self.roster.leave(worker, clock, key):
                self.lobby.gone(worker, clock)
                self._close_rounds(self.policy.leave(worker))
                self._policy_changed()
                how = "left the job" if self.roster.workers[worker].state == "left" else "is done"
                log.info("shard %d: worker %d %s at clock %d", self.shard, worker, how, clock)
            self.wake()
            return self.roster.live_count()

    def expire_leases(self) -> list[int]:
        """Drop workers whose lease (or join deadline) has passed; returns their ids."""
        with self.lock:
            # a replica's workers are its primary's
            expired = self.roster.overdue() if self.role not in ("replica", "starting") else []
            for w in expired:
                self.counters["expired"] += 1
                self.lobby.lapsed(w, self.roster.workers[w].clock)
                self._close_rounds(self.policy.leave(w))
            if expired:
                self._policy_changed()
                self.wake()
        return expired

    def finished(self, settle: float = 0.0) -> bool:
        """True once no worker is pending or live: each is done, or was dropped at least ``settle``
        seconds ago (a shard paused longer than the lease drops every worker at once when it resumes;
        they come back within a lease, so a dropped worker counts as gone only once that has passed)."""
        with self.lock:
            if self.role == "replica":  # a replica is done when its primary says the job is
                return self.replication is not None and self.replication.job_over
            return self.roster.finished(settle)

    def wait_serving_changed(self, timeout: float) -> None:
        with self.lock:  # a worker left, the role changed or the core closes (at most ``timeout`` seconds)
            self.serving_changed.wait(timeout)

    def wake(self) -> None:
        """(Under the lock.)  Wake the waits on the policy (``changed``) and on who serves (``serving_changed``)."""
        self.changed.notify_all()
        self.serving_changed.notify_all()

    def close(self) -> None:
        """Wake every waiting pull so that it ends with UNAVAILABLE."""
        with self.lock:
            self.closing = True
            self.wake()

    def status(self) -> dict:
        """What the shard says of itself (psgd status, Prometheus): :func:`psgd.server.state.said.shard_status`."""
        with self.lock:
            return said.shard_status(self)

    # -- its state, taken and given whole (psgd.server.state.whole) --------------------------------------------------
    def write_checkpoint(
        self, save: Callable[[int, dict, dict], T], held: bool = False, force: bool = False
    ) -> T | None:
        """``save(version, arrays, manifest)`` of this core's whole state (what it returns: the file's path), or
        nothing where the state is the one last saved (unless ``force``).  Under the lock, straight from the live
        arrays with no update half made: consistent, and no second copy of the weights; training pauses meanwhile.
        ``held``: the caller holds the lock already (a sync round's cut, as it closes).  A failure is counted
        (``checkpoint_failures``) and raised (CheckpointError)."""
        with contextlib.nullcontext() if held else self.lock:
            if not held:
                self.store.settle()  # the policy's clocks and the weights say the same
            return self.whole.write(save, self.version, self.counters, self.staleness_histogram, force)

    def adopt(self, ckpt: Checkpoint, restored: bool = False) -> None:
        """Everything of ``ckpt`` (checked: psgd.server.durable.recovery.check), or of a primary's state on its replica:
        the training state, the counters, the staleness histogram, and each rank kept for its holder.
        ``restored``: the shard starts from it (it says so in Status, and it is its last checkpoint)."""
        with self.lock:
            self.version = self.whole.adopt(ckpt, self.counters, self.staleness_histogram, restored)

    # -- going back to a cut ---------------------------------------------------------------------------------------
    def went_back_for(self, cause: str) -> bool:
        """Whether this shard went back for ``cause`` already (it goes back once per cause)."""
        with self.lock:
            return cause in self.rewind.causes

    def go_back(self, version: int, cause: str, worker: int, load: Callable[[], Checkpoint]) -> int:
        """Go back to the cut at ``version`` for ``cause`` (once per cause), as ``worker`` asks; ``load()`` reads and
        checks this shard's checkpoint of it, outside the lock (the shard serves meanwhile; under sync nobody can go
        on).  Every worker then continues from ``version``: a request with a later clock is refused with
        ROLLED_BACK, naming it, until the worker comes with one no later.  Returns the rounds undone."""
        with self.lock:
            if not self.rewind.must_go_back(cause, self.version, version, worker):
                self.changed.notify_all()  # there already: its workers continue from it
                return 0
        ckpt = load()
        with self.lock:
            if cause in self.rewind.causes:
                return 0
            undone = self.version - version
            self.version = self.whole.put_back(ckpt)
            self.rewind.went_back(cause, version)
            self.changed.notify_all()
            self.counters["rollbacks"] += 1
            self.counters["rounds_undone"] += undone
            self.counters["applied"] -= undone  # the updates the weights hold: the version
        return undone

    # -- a pair of processes ---------------------------------------------------------------------------------------
    def join_pair(self, pair: Any) -> None:
        """This process is one of a pair (psgd.server.durable.replica.Replication): it serves no worker until it takes a
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
            self.store.settle()  # first: the version it may move on
            return self.whole.hand_over(attach, self.version, self.counters, self.staleness_histogram)

    def adopt_policy(self, state: Mapping[str, Any]) -> None:
        """The primary's policy state (its clocks), on its replica."""
        with self.lock:
            self.policy.load_state_dict(dict(state))

    def apply_replicated(
        self,
        seq: int,
        worker: int,
        clock: int,
        staleness: int,
        lr_scale: float,
        grads: Mapping[int, np.ndarray],
        answer: Callable[[str], None],
    ) -> None:
        """On a replica: the primary's update ``seq`` (worker ``worker``'s push at ``clock``), checked against this
        process's policy before ``answer`` is called with "" (the primary acknowledges the push on it) or why not
        (then refused: FAILED_PRECONDITION), and applied after."""
        with self.lock:
            decision = self.policy.push(worker, clock) if self.version + 1 == seq else None
            if decision is None or decision.action != APPLY:
                why = (
                    f"replica of shard {self.shard} at version {self.version} cannot apply update {seq} (worker "
                    f"{worker}, clock {clock}): "
                    f"{(decision.reason or decision.action) if decision else 'out of order'}"
                )
                answer(why)
                raise ShardError("FAILED_PRECONDITION", why)
            answer("")  # held: applied while the next comes
            self._record_staleness(staleness)
            self._apply(grads, lr_scale, self.remedies.share)
            self.counters["pushes"] += 1
