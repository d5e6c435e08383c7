"""A shard kept twice (``[cluster] replicas = 1``): a primary that serves the workers, and a replica on another
process (or host) that applies every update the primary applies, before the primary acknowledges the push.

The primary streams to its replica (``Replicate``): first its whole state (the arrays and manifest of a checkpoint,
:func:`psgd.server.recovery.state`), then each update as it applied it (the gradient after any delay compensation,
its learning-rate scale, whose push at which clock), and the policy's state when a worker joins or leaves.  The
replica applies each in the same order, with the same optimizer, so it holds the primary's weights, optimizer state
and clocks, and answers with the update's number; a push waits for that answer before its worker hears back
(:meth:`Pair.confirm`).  A killed primary therefore loses no acknowledged push: its replica takes over, the workers
fail over to it (psgd.worker.failover), and a push they retry there is counted as the duplicate it is.

Roles: the first process of a pair (``[cluster] servers``) starts as the primary, the second (``replica_servers``)
as the replica, unless its peer already leads (a restarted primary becomes its old replica's replica and catches
up from its state).  A replica takes over when its primary's stream ends (the process died) or stays silent for
:data:`SILENCE_SECONDS`, and only once the primary does not answer a status call either.  A primary whose replica
cannot be reached at all goes on alone (acknowledging pushes the replica does not hold: the trade-off that keeps a
job running when the replica dies; it catches up when it comes back); one whose peer leads steps down, and its
pushes that were not acknowledged are retried by their workers on the new primary.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from typing import Iterator, Mapping

import grpc
import numpy as np

from psgd.channel import chunks, open_channel, token_metadata
from psgd.policy import APPLY
from psgd.proto import ps_pb2, ps_pb2_grpc
from psgd.server import checkpoint, recovery
from psgd.server.core import ShardCore
from psgd.server.errors import ShardError
from psgd.tls import NO_TLS, TLSFiles

log = logging.getLogger(__name__)

PRIMARY, REPLICA = "primary", "replica"
#: a primary with nothing to send says it is alive this often
KEEPALIVE_SECONDS = 0.2
#: a replica whose primary has sent nothing for this long takes it for dead (if it does not answer either)
SILENCE_SECONDS = 1.0
#: how long a status call to the peer may take before the peer counts as gone
PEER_SECONDS = 0.5
U = ps_pb2.ReplicaUpdate


def peer_role(address: str, token: str = "", tls: TLSFiles = NO_TLS) -> tuple[str, int, int] | None:
    """The role, version and failovers (how many times its pair changed leader) of the shard process at ``address``,
    or None when it does not answer in time."""
    try:
        with open_channel(address, tls) as channel:
            reply = ps_pb2_grpc.ParameterServerStub(channel).Status(
                ps_pb2.StatusRequest(), timeout=PEER_SECONDS, metadata=token_metadata(token))
        return reply.role, reply.version, int(json.loads(reply.counters_json or "{}").get("failovers", 0))
    except (grpc.RpcError, ValueError, TypeError, AttributeError):
        return None


class Pair:
    """This process's half of shard ``core.shard``'s pair.  ``peer``: the other process's gRPC address (a primary
    started without one learns it from its replica); ``me``: this one's, as the peer reaches it; ``second``: this
    is the pair's second process (a replica at the start)."""

    def __init__(self, core: ShardCore, me: str, peer: str = "", *, second: bool, token: str = "",
                 tls: TLSFiles = NO_TLS, ack_seconds: float = 60.0):
        self.core, self.me, self.peer, self.second, self.token, self.tls = core, me, peer, second, token, tls
        self.ack_seconds = ack_seconds  # the longest a push waits for its replica's answer
        self._lock = threading.Condition(threading.Lock())
        self._queue: deque = deque()
        self.attached = False    # a primary with a replica that follows (its stream open)
        self.alone = True        # a primary whose replica is gone: pushes are acknowledged without a copy
        self.acked = -1          # the newest update the replica answered for
        self.sent = -1           # the newest update queued for it
        self.job_over = False    # a replica told by its primary that the job is over
        self.following = False   # a replica with its primary's stream open
        self._held = False       # this process held the job's state (it followed a primary, or led)
        self._stop = threading.Event()
        self._call = None
        self._follower = threading.Thread(target=self._follow, name=f"shard{core.shard}-follow", daemon=True)
        with core.lock:
            core.pair, core.role = self, "starting"  # serving no worker until start() decides
            # times the pair's leader changed (copied with the state): the later of two leaders has the larger
            core.counters.setdefault("failovers", 0)

    # -- roles ----------------------------------------------------------------------------------------------
    def start(self) -> "Pair":
        """Take this process's role: replica where this is the pair's second or the peer already leads (it
        follows the peer from now on), else primary."""
        found = peer_role(self.peer, self.token, self.tls) if self.peer else None
        # a restarted primary whose replica holds more than it does (it will take over) follows it too
        ahead = found is not None and (found[0] == PRIMARY or found[1] > self.core.version)
        role = REPLICA if self.second or ahead else PRIMARY
        self._held = role == PRIMARY
        with self.core.lock:
            self.core.role = role
        log.info("shard %d: %s of the pair (peer %s: %s)", self.core.shard, role, self.peer or "not known yet",
                 f"{found[0] or 'no role'} at version {found[1]}" if found else "not answering")
        if role == REPLICA:
            self._follower.start()
        return self

    def stop(self, finished: bool) -> None:
        """Stop; ``finished``: a primary tells its replica the job is over (it stops rather than take over)."""
        with self._lock:
            if finished and self.attached:
                self._queue.append((U.FINISHED, self.core.version, None))
            self._lock.notify_all()
            deadline = time.monotonic() + 2.0
            while finished and self.attached and self._queue and time.monotonic() < deadline:
                self._lock.wait(0.1)  # the replica hears of the end before this process goes
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        if self._follower.is_alive():
            self._follower.join(timeout=2.0)

    def lag(self) -> int:
        """Updates the replica has not answered for (primary), 0 while following (replica); -1: no partner."""
        if self.core.role == REPLICA:
            return 0 if self.following else -1
        return max(0, self.sent - self.acked) if self.attached else -1

    # -- the primary's side -------------------------------------------------------------------------------------
    def applied(self, worker: int, clock: int, staleness: int, lr_scale: float,
                grads: Mapping[int, np.ndarray]) -> int:
        """An update the core just applied (under its lock): queued for the replica; returns its number."""
        seq = self.core.version
        with self._lock:
            if self.attached:
                self._queue.append((U.APPLY, seq, (worker, clock, staleness, lr_scale, grads)))
                self.sent = seq
                self._lock.notify_all()
        return seq

    def policy_changed(self) -> None:
        with self._lock:
            if self.attached:
                self._queue.append((U.POLICY, self.core.version, json.dumps(self.core.policy.state_dict())))
                self._lock.notify_all()

    def confirm(self, seq: int) -> None:
        """Wait until the replica holds update ``seq`` (or the primary goes on alone); a primary that stepped
        down meanwhile refuses (the worker retries on the new one), and so does one whose replica stays silent."""
        deadline = time.monotonic() + self.ack_seconds
        with self._lock:
            while self.acked < seq and not self.alone and self.core.role != REPLICA:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ShardError("UNAVAILABLE", f"shard {self.core.shard}: its replica at {self.peer} did not "
                                     f"confirm update {seq} within {self.ack_seconds:.0f}s; retry")
                self._lock.wait(min(left, 0.5))
        if self.core.role == REPLICA:
            raise ShardError("UNAVAILABLE", f"shard {self.core.shard} at this address stepped down: its peer "
                             f"{self.peer} leads now", reason="NOT_PRIMARY")

    def lead(self, acks: Iterator[ps_pb2.ReplicaAck], context: grpc.ServicerContext
             ) -> Iterator[ps_pb2.ReplicaUpdate]:
        """Serve a replica's ``Replicate``: the state, then each update as it is queued, keepalives between."""
        core = self.core
        first = next(acks, None)
        with core.lock, self._lock:
            if core.role != PRIMARY or self.attached or first is None:
                raise ShardError("FAILED_PRECONDITION", f"shard {core.shard} here is {core.role or 'no pair'}"
                                 f"{' and has a replica already' if self.attached else ''}: follow its primary",
                                 reason="NOT_PRIMARY" if core.role == REPLICA else "")
            arrays, manifest = recovery.state(core)
            arrays = {k: np.array(v) for k, v in arrays.items()}  # a copy: the weights move on
            seq = core.version
            self._queue.clear()
            self.attached, self.alone, self.sent, self.acked = True, False, seq, -1
            self.peer = first.address or self.peer
        heard = [time.monotonic()]
        threading.Thread(target=self._read_acks, args=(acks, heard), daemon=True,
                         name=f"shard{core.shard}-acks").start()
        try:
            manifest["arrays"] = {k: [a.dtype.str, list(a.shape)] for k, a in arrays.items()}
            for name, a in arrays.items():
                for offset, piece in chunks(np.ascontiguousarray(a).view(np.uint8).reshape(-1)):
                    yield U(kind=U.STATE, seq=seq, name=name, offset=offset, data=bytes(piece))
            yield U(kind=U.STATE, seq=seq, fingerprint=core.fingerprint, json=json.dumps(manifest), last=True)
            while context.is_active():
                with self._lock:
                    if not self._queue:
                        self._lock.wait(KEEPALIVE_SECONDS)
                    if time.monotonic() - heard[0] > 2 * SILENCE_SECONDS and self.attached:
                        log.warning("shard %d: its replica at %s has answered nothing for %.1fs", core.shard,
                                    self.peer, 2 * SILENCE_SECONDS)
                        return
                    if not self.attached:
                        return
                    item = self._queue.popleft() if self._queue else (U.KEEPALIVE, self.sent, None)
                yield from _pieces(*item)
                if item[0] == U.FINISHED:
                    return
        finally:
            with self._lock:
                was, self.attached, self.acked = self.attached, False, -1
                self._queue.clear()
                self._lock.notify_all()
            if was and not self._stop.is_set():
                threading.Thread(target=self._lost, daemon=True, name=f"shard{core.shard}-lost").start()

    def _read_acks(self, acks: Iterator[ps_pb2.ReplicaAck], heard: list) -> None:
        try:
            for ack in acks:
                heard[0] = time.monotonic()
                with self._lock:
                    if self.acked < 0 <= ack.seq:
                        log.info("shard %d: replica at %s holds version %d and follows", self.core.shard, self.peer,
                                 ack.seq)
                    self.acked, self.alone = max(self.acked, ack.seq), False
                    self._lock.notify_all()
        except grpc.RpcError:
            pass
        with self._lock:
            self.attached = False
            self._lock.notify_all()

    def _lost(self) -> None:
        """The replica's stream ended: find out whether the peer leads (step down), lives as a replica (wait for it
        to follow again) or is gone (go on alone, and keep asking: a peer cut off for a while may have taken over)."""
        while not self._stop.is_set() and self.core.role == PRIMARY and not self.attached:
            found = peer_role(self.peer, self.token, self.tls) if self.peer else None
            if found is not None and found[0] == PRIMARY and found[2] > self.core.counters["failovers"]:
                self._step_down(found[1])  # it took over from this process (a later term): it leads
                return
            with self._lock:
                if found is None and not self.alone:
                    log.warning("shard %d: its replica at %s is gone: going on alone, pushes acknowledged without "
                                "a copy until it follows again", self.core.shard, self.peer)
                self.alone = found is None
                self._lock.notify_all()
            self._stop.wait(4 * KEEPALIVE_SECONDS)

    def _step_down(self, theirs: int) -> None:
        with self.core.lock:
            self.core.role = REPLICA
            self.core.changed.notify_all()
        with self._lock:
            self.alone = False
            self._lock.notify_all()
        log.warning("shard %d: its peer %s leads now (at version %d, this process at %d): stepping down to "
                    "replica; pushes not yet acknowledged here are retried there", self.core.shard, self.peer,
                    theirs, self.core.version)
        self._call = None
        self._follower = threading.Thread(target=self._follow, name=f"shard{self.core.shard}-follow", daemon=True)
        self._follower.start()

    # -- the replica's side ---------------------------------------------------------------------------------------
    def _follow(self) -> None:
        """Follow the peer while this process is a replica: apply its stream, answering for each update; take
        over when the stream ends without the job's end and the peer does not answer."""
        core = self.core
        while not self._stop.is_set() and core.role == REPLICA and not self.job_over:
            answers: deque = deque([ps_pb2.ReplicaAck(seq=-1, address=self.me)])
            ready, done = threading.Condition(), threading.Event()
            reader = _Reader(core)
            channel = open_channel(self.peer, self.tls)
            why = ""
            try:
                self._call = ps_pb2_grpc.ParameterServerStub(channel).Replicate(
                    _answers(answers, ready, done), metadata=token_metadata(self.token))
                heard = [time.monotonic()]
                threading.Thread(target=self._watch, args=(self._call, heard), daemon=True,
                                 name=f"shard{core.shard}-primary-watch").start()
                for update in self._call:
                    heard[0] = time.monotonic()
                    self.following = True
                    if update.kind == U.FINISHED:
                        self.job_over = True
                        with core.lock:
                            core.changed.notify_all()
                        break
                    if reader.take(update) or update.kind == U.KEEPALIVE:
                        self._held = self._held or update.kind == U.STATE
                        with ready:
                            answers.append(ps_pb2.ReplicaAck(seq=core.version))
                            ready.notify()
                why = "its stream ended"
            except grpc.RpcError as err:
                why = f"{err.code().name}: {err.details()}"
            except ShardError as err:
                log.error("shard %d: %s", core.shard, err.message)  # the primary sends its state again
            finally:
                self.following = False
                done.set()
                if self._call is not None:
                    self._call.cancel()
                channel.close()
            if why and not self.job_over and not self._stop.is_set() and self._take_over(why):
                return
            self._stop.wait(0.2)

    def _watch(self, call, heard: list) -> None:
        """End the stream of a primary silent for SILENCE_SECONDS (a stopped or cut-off process)."""
        while call.is_active() and not self._stop.wait(KEEPALIVE_SECONDS):
            if time.monotonic() - heard[0] > SILENCE_SECONDS:
                log.warning("shard %d: its primary %s has sent nothing for %.1fs", self.core.shard, self.peer,
                            SILENCE_SECONDS)
                call.cancel()
                return

    def _take_over(self, why: str) -> bool:
        """Lead (True) where the peer does not lead, after following it (``why``: how its stream ended); a replica
        that never held its primary's state has nothing to lead with, and does not."""
        found = peer_role(self.peer, self.token, self.tls)
        if not self._held or (found is not None and found[0] == PRIMARY):
            return False
        core = self.core
        with core.lock:
            core.role = PRIMARY
            core.counters["failovers"] += 1
            core.changed.notify_all()
        with self._lock:
            self.alone = True
        log.info("shard %d: its primary %s is gone (%s): this replica takes over at version %d", core.shard,
                 self.peer, why, core.version)
        return True


def _answers(answers: deque, ready: threading.Condition, done: threading.Event) -> Iterator[ps_pb2.ReplicaAck]:
    """A replica's side of the stream: its answers, as they come, until the stream is over."""
    while not done.is_set():
        with ready:
            if not answers:
                ready.wait(KEEPALIVE_SECONDS)
            batch = list(answers)
            answers.clear()
        yield from batch


def _pieces(kind: int, seq: int, body) -> Iterator[ps_pb2.ReplicaUpdate]:
    """One queued update as the stream's messages: an update's gradient in pieces, else one message."""
    if kind != U.APPLY:
        yield U(kind=kind, seq=seq, json=body or "", last=True)
        return
    worker, clock, staleness, lr_scale, grads = body
    flat = b"".join(memoryview(np.ascontiguousarray(grads[i])).cast("B") for i in sorted(grads))
    for offset, piece in chunks(flat):
        yield U(kind=kind, seq=seq, worker_id=worker, clock=clock, staleness=staleness, lr_scale=lr_scale,
                offset=offset, data=bytes(piece), last=offset + len(piece) >= len(flat))


class _Reader:
    """Puts a primary's updates back together on its replica and applies each once whole."""

    def __init__(self, core: ShardCore):
        self.core = core
        self.grad = bytearray(core.nbytes)
        self.arrays: dict[str, bytearray] = {}
        self.got = 0
        self.limit = 8 * core.nbytes + (64 << 20)  # what a state may take: the weights and optimizer state, and more

    def take(self, u: ps_pb2.ReplicaUpdate) -> bool:
        """Take one message; True once it completed an update, applied now."""
        core = self.core
        if u.kind == U.STATE:
            if not u.last:
                buf = self.arrays.setdefault(u.name, bytearray())
                self.got += len(u.data)
                if u.offset != len(buf) or self.got > self.limit:
                    raise ShardError("INVALID_ARGUMENT", f"replica of shard {core.shard}: state out of order or "
                                     "larger than a shard's")
                buf += u.data
                return False
            if u.fingerprint != core.fingerprint:
                raise ShardError("FAILED_PRECONDITION", f"replica of shard {core.shard} of job {core.fingerprint} "
                                 f"was sent the state of job {u.fingerprint}")
            manifest = json.loads(u.json)
            arrays = {k: np.frombuffer(bytes(self.arrays.get(k, b"")), dtype=np.dtype(d)).reshape(shape)
                      for k, (d, shape) in manifest.pop("arrays").items()}
            with core.lock:
                recovery.put_back(core, checkpoint.Checkpoint(manifest, arrays, "the primary's state"))
                core.roster.keep_for(manifest.get("holders", {}))
                core.counters.update({k: int(v) for k, v in manifest.get("counters", {}).items()
                                      if k in core.counters and isinstance(v, int)})
                core.staleness_histogram[:] = [int(v) for v in manifest["staleness_histogram"]]
            self.arrays, self.got = {}, 0
            log.info("shard %d: following the primary from version %d", core.shard, core.version)
            return True
        if u.kind == U.POLICY:
            with core.lock:
                core.policy.load_state_dict(json.loads(u.json))
            return True
        if u.kind != U.APPLY:
            return False  # a keepalive
        end = u.offset + len(u.data)
        if end > len(self.grad):
            raise ShardError("INVALID_ARGUMENT", f"replica of shard {core.shard}: an update larger than the shard")
        self.grad[u.offset:end] = u.data
        if not u.last:
            return False
        if end != len(self.grad):
            raise ShardError("INVALID_ARGUMENT", f"replica of shard {core.shard}: an update of {end} bytes, the "
                             f"shard holds {len(self.grad)}")
        grads = core.store.gradient_views(self.grad)
        with core.lock:
            decision = core.policy.push(u.worker_id, u.clock)
            if decision.action != APPLY or core.version + 1 != u.seq:
                raise ShardError("FAILED_PRECONDITION", f"replica of shard {core.shard} at version {core.version} "
                                 f"cannot apply update {u.seq} (worker {u.worker_id}, clock {u.clock}): "
                                 f"{decision.reason or 'out of order'}")
            core._record_staleness(u.staleness)
            core._apply(grads, u.lr_scale, core.remedies.share)
            core.counters["pushes"] += 1
        return True

