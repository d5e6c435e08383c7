"""A shard kept twice (``[cluster] replicas = 1``): a primary that serves the workers, and a replica on another
process (or host) that applies every update the primary applies, before the primary acknowledges the push.

The replica connects to its primary's data port (a hello that asks to follow) and the primary streams to it over
that connection: first its whole state (the arrays and manifest of a checkpoint, :meth:`ShardCore.hand_over`),
then each update as it applied it (the gradient after any delay compensation, its learning-rate scale, whose push at
which clock), and the policy's state when a worker joins or leaves.  The replica applies each in the same order,
with the same optimizer, so it holds the primary's weights, optimizer state and clocks, and answers with the
update's number; a push waits for that answer before its worker hears back (:meth:`Replication.confirm`).  A killed
primary therefore loses no acknowledged push: its replica takes over, the workers fail over to it
(psgd.worker.failover), and a push they retry there is counted as the duplicate it is.  Frames are a fixed header
(:data:`FRAME`) then JSON then raw bytes, sent from the arrays with ``sendmsg`` and received into a reused buffer,
as pulls and pushes are; each answer is one :data:`ANSWER`.

Roles: the first process of a pair (``[cluster] servers``) starts as the primary, the second (``replica_servers``)
as the replica, unless its peer already leads or holds more (a restarted primary becomes its old replica's replica
and catches up from its state; a replica follows a restarted primary again, also one told that the job was over). A
replica takes for lost a primary whose stream ends or stays silent for :data:`SILENCE_SECONDS` and that does not
answer a status call either, and takes over once a worker comes to it (a worker calls a replica only when it cannot
reach the primary): a primary cut off from its replica alone, which looks the same from there, goes on serving the
workers, and the replica follows it again when the cut heals. A primary whose replica cannot be reached at all goes
on alone (acknowledging pushes the replica does not hold: the trade-off that keeps a job running when the replica
dies; it catches up when it comes back), and keeps asking after it (from its start: a replica that lives is waited
for; the first push acknowledged without a copy is said in a WARNING line and each is counted): one whose peer took
over (a later count of failovers) steps down, and its pushes not yet acknowledged are retried by their workers on
the new primary. Only the pair's own replica follows (the address the job file gives it, or the first to follow a
primary that knew none; the primary asks at that address whether it follows with the connection's ticket, so that
another holder of the token cannot take its place), and the two processes prove to each other that they hold the
job's token without sending it (:mod:`psgd.server.durable.peers`): a stranger at a dead peer's address learns nothing
and is not believed. A replica that does not keep up is cut off as Kafka drops a follower from its in-sync set: silent
(an update waits longer than :data:`KEEP_UP_SECONDS` for its answer) or slow (over a window of as long, updates waited
for its answers more than half the time, :data:`SLOW_ANSWER_SECONDS` each on average, beyond the time their bytes
need at :data:`psgd.server.durable.stream.MIN_RATE`). The primary says so in one line and goes on alone; one cut off
again without having kept up in between is taken back only after :data:`BENCH_SECONDS` (doubled each time), so that a
follower that cannot keep up costs the job a few seconds now and then, not its pace, while one that kept up and
stalled once (a paused process) follows again as soon as it answers.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping

import numpy as np

from psgd.observe.logs import Quieted
from psgd.server.durable import stream
from psgd.server.durable.following import PRIMARY, REPLICA, Following
from psgd.server.durable.peers import confirms, failovers, peer_status
from psgd.server.errors import ShardError
from psgd.server.state.core import ShardCore
from psgd.wire import protocol
from psgd.wire.tls import NO_TLS, TLSFiles

log = logging.getLogger(__name__)

#: a primary with nothing to send says it is alive this often
KEEPALIVE_SECONDS = 0.2
#: a replica whose primary has sent nothing for this long takes it for dead (if it does not answer either)
SILENCE_SECONDS = stream.SILENCE_SECONDS
#: seconds between two lines saying that followers were refused (one that retries without end is said once a minute)
REFUSALS_SAID_EVERY = 60.0
#: how long a primary that ends the job waits for a replica that lives but is connecting again, to tell it
FINISH_SECONDS = 5 * SILENCE_SECONDS
#: the longest an update may wait for its replica's answer (from when it was queued) before the replica is cut off
KEEP_UP_SECONDS = 2 * SILENCE_SECONDS
#: a replica is slow when, over a window of KEEP_UP_SECONDS, updates waited for it more than half the time and its
#: answers took this long on average (beyond the time their bytes need): a healthy one answers in milliseconds
SLOW_ANSWER_SECONDS = 0.1
#: how long a replica cut off for not keeping up is refused before it may follow again: the first time, and the most
#: (doubled each time it is cut off again)
BENCH_SECONDS = (30.0, 300.0)


class Replication(Following):
    """This process's end of shard ``core.shard``'s replication (a pair: a primary and its replica).  ``peer``: the
    other process's gRPC address (a primary started without one learns it from its replica); ``me``: this one's, as
    the peer reaches it; ``second``: this is the pair's second process (a replica at the start)."""

    def __init__(
        self,
        core: ShardCore,
        me: str,
        peer: str = "",
        *,
        second: bool,
        token: str = "",
        tls: TLSFiles = NO_TLS,
        ack_seconds: float = 60.0,
    ):
        self.core, self.me, self.peer, self.second, self.token, self.tls = core, me, peer, second, token, tls
        self.ack_seconds = ack_seconds  # the longest a push waits for its replica's answer
        self._lock = threading.Condition(threading.Lock())
        self._queue: deque = deque()
        self.attached = False  # a primary with a replica that follows (its stream open)
        self.alone = True  # a primary whose replica is gone: pushes are acknowledged without a copy
        self._said_alone = False  # ... which a WARNING said since its replica last followed (once, not per push)
        self.acked = -1  # the newest update the replica answered for
        self.sent = -1  # the newest update queued for it
        self.job_over = False  # a replica told by its primary that the job is over
        self._leader = self._ended_by = ""  # the incarnation of the primary followed, of the one that said so
        self.ticket = ""  # a replica's last connection to its primary: it says so when the primary asks
        self.follower = ""  # a primary's replica that follows: where it listens, from where it connected
        self._told = False  # a primary that told its replica so
        self.following = False  # a replica with its primary's stream open
        self.orphaned = ""  # why a replica lost its primary, while it waits for a worker to come (then leads)
        self._orphaned_at = 0.0  # since when (monotonic)
        self._asked_at = -1e9  # when a worker last came to this process while it was a replica (monotonic)
        self._held = False  # this process held the job's state (it followed a primary, or led)
        self._refused = Quieted(REFUSALS_SAID_EVERY)  # followers refused: said once a minute at most
        # a replica cut off twice without keeping up in between waits (doubling) before it may follow again
        self._benched_until, self._bench, self._strikes = 0.0, BENCH_SECONDS[0], 0
        self._lagged = False  # the last replica was cut off for not keeping up (until one follows again)
        self._queued_at = 0.0  # when the oldest update in the queue was queued (0: none)
        self._stop, self._woken = threading.Event(), threading.Event()  # _woken: a worker came
        self._sock: socket.socket | None = None  # a replica's connection to its primary
        self._follower = threading.Thread(target=self._follow, name=f"shard{core.shard}-follow", daemon=True)
        core.join_pair(self)  # serving no worker until start() decides

    # -- roles ----------------------------------------------------------------------------------------------
    def start(self) -> Replication:
        """Take this process's role: replica where the peer already leads or holds more (it follows the peer from
        now on), or where this is the pair's second and its peer is not a replica that follows no one; else
        primary."""
        found = peer_status(self.peer, self.token, self.tls) if self.peer else None
        # a restarted primary whose replica holds more than it does (it will take over) follows it too
        ahead = found is not None and (found.role == PRIMARY or found.version > self.core.version)
        # a peer that is a replica no further on than this process follows no one (its primary was this process,
        # gone): this one leads, whichever of the pair it is, and the peer follows it (one told that the job was
        # over stood by, and the second process, a replica by its flag, did too: neither led)
        idle = found is not None and found.role == REPLICA and not ahead
        role = REPLICA if ahead or (self.second and not idle) else PRIMARY
        self._held = role == PRIMARY
        self.core.take_role(role)
        log.info(
            "shard %d: %s of the pair (peer %s: %s)",
            self.core.shard,
            role,
            self.peer or "not known yet",
            f"{found.role or 'no role yet'} at version {found.version}" if found else "not answering",
        )
        if role == REPLICA:
            self._follower.start()
        return self

    def stop(self, finished: bool) -> None:
        """Stop; ``finished``: a primary tells its replica the job is over (it stops rather than take over), also
        one that was connecting again (FINISH_SECONDS at most); else it stops leading at once (the workers go to the
        replica, which takes over)."""
        if self._stop.is_set():
            return  # stopped already
        if not finished:
            self.core.take_role("stopping", only_from=PRIMARY)
        with self._lock:  # the replica hears of the end before this process goes: also one between two connections,
            deadline = time.monotonic() + FINISH_SECONDS  # or whose stream broke as the end was sent (told again)
            while finished and not self._told and (self.attached or not self.alone) and time.monotonic() < deadline:
                if self.attached and not any(kind == stream.FINISHED for kind, _, _ in self._queue):
                    self._queue.append((stream.FINISHED, self.core.version, None))
                    self._lock.notify_all()
                self._lock.wait(0.1)
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._sock is not None:
            stream.shut(self._sock)
        if self._follower.is_alive():
            self._follower.join(timeout=2.0)

    def lag(self) -> int:
        """Updates the replica has not answered for (primary), 0 while following (replica); -1: no partner."""
        if self.core.role == REPLICA:
            return 0 if self.following else -1
        return max(0, self.sent - self.acked) if self.attached else -1

    # -- the primary's side -------------------------------------------------------------------------------------
    def applied(self, worker: int, clock: int, staleness: int, lr_scale: float, grads: Mapping[int, np.ndarray]) -> int:
        """An update the core just applied (under its lock): queued for the replica; returns its number."""
        seq = self.core.version
        with self._lock:
            if self.attached:
                self._queued_at = self._queued_at or time.monotonic()
                self._queue.append((stream.APPLY, seq, (worker, clock, staleness, lr_scale, grads)))
                self.sent = seq
                self._lock.notify_all()
        return seq

    def policy_changed(self) -> None:
        with self._lock:
            if self.attached:
                self._queued_at = self._queued_at or time.monotonic()
                self._queue.append((stream.POLICY, self.core.version, json.dumps(self.core.policy.state_dict())))
                self._lock.notify_all()

    def confirm(self, seq: int) -> None:
        """Wait until the replica holds update ``seq`` (or the primary goes on alone); a primary that stepped
        down meanwhile refuses (the worker retries on the new one), and so does one whose replica stays silent."""
        deadline = time.monotonic() + self.ack_seconds
        with self._lock:
            self._wait_for(seq, deadline)
            copied = self.acked >= seq
        if not copied and self.core.role != REPLICA:
            self.core.count("unreplicated")  # acknowledged without a copy: psgd status and psgd launch say how many
            with self._lock:
                if not self._said_alone and self.acked < seq:
                    self._said_alone = True
                    log.warning(
                        "shard %d: acknowledging pushes without a copy: its replica%s does not follow; "
                        "counted (unreplicated) until it follows again",
                        self.core.shard,
                        f" at {self.peer}" if self.peer else "",
                    )
        if self.core.role == REPLICA:
            raise ShardError(
                "UNAVAILABLE",
                f"shard {self.core.shard} at this address stepped down: its peer {self.peer} leads now",
                reason="NOT_PRIMARY",
            )

    def _wait_for(self, seq: int, deadline: float) -> None:
        """(Under the pair's lock.)  Wait until the replica holds update ``seq``, the primary goes on alone or it
        stepped down; refuse where it shuts down meanwhile or the replica stays silent past ``deadline``."""
        while self.acked < seq and not self.alone and self.core.role != REPLICA:
            if self._stop.is_set() or self.core.closing:
                raise ShardError(
                    "UNAVAILABLE", f"shard {self.core.shard} is shutting down before its replica confirmed update {seq}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise ShardError(
                    "UNAVAILABLE",
                    f"shard {self.core.shard}: its replica at {self.peer} did not "
                    f"confirm update {seq} within {self.ack_seconds:.0f}s; retry",
                )
            self._lock.wait(min(left, 0.5))

    def _refuse(self, address: str, why: str) -> None:
        """A follower refused: said at once, then at most once a minute with how many more (one that retries
        without end logs two lines a minute, not thousands)."""
        unsaid = self._refused.due()
        if unsaid is not None:
            more = f" ({unsaid} more refused since the last line)" if unsaid else ""
            log.warning(
                "shard %d: refused a replica at %s: this process is %s%s; further refusals are said at most "
                "once a minute",
                self.core.shard,
                address,
                why,
                more,
            )

    def serve_follower(self, sock: socket.socket) -> None:
        """Serve a replica on ``sock`` (a data connection whose hello asked to follow, psgd.server.net.datapath): the
        state, then what is queued, in batches, each batch's answers read before the next goes (one thread uses
        the connection: a TLS one too); a keepalive when nothing is queued."""
        core = self.core
        sock.settimeout(SILENCE_SECONDS * 5)
        address, ticket = stream.accept(sock, core.version)
        # the pair's replica proves that it is the process at its address (the job's): a token holder elsewhere
        # that says it listens there cannot
        proven = (
            address == (self.peer or address)
            and core.role == PRIMARY
            and not self.attached
            and confirms(address, ticket, self.token, self.tls)
        )  # (asked only of one that may follow)

        def attach(version: int) -> bool:  # asked under the core's lock: the updates after the state are queued
            with self._lock:
                benched = self._benched_until - time.monotonic()
                if core.role != PRIMARY or self.attached or benched > 0 or not proven:
                    self._refuse(
                        address,
                        "led by its peer"
                        if core.role != PRIMARY
                        else "followed already"
                        if self.attached
                        else f"the pair of {self.peer}, not of {address}"
                        if address != (self.peer or address)
                        else f"not followed by the process at {address} (it does not say so)"
                        if not proven
                        else f"taking its replica back only in {benched:.0f}s (cut off)",
                    )
                    return False
                self._queue.clear()
                self.attached, self.alone, self.sent, self.acked = True, False, version, -1
                self._said_alone = False
                self._queued_at, self._lagged = 0.0, False
                self.peer = self.peer or address  # where it said it listens, unless the job file says
                self.follower = f"{address} from {_far_end(sock)}"
                return True

        handed = core.hand_over(attach)
        if handed is None:
            return
        version, arrays, manifest = handed
        batch = [(stream.STATE, version, (manifest, arrays))]
        refused, lagging, oldest = "", "", time.monotonic()
        window, waited, batches = oldest, 0.0, 0  # how long updates waited for the replica, in windows
        kept_up = False  # a whole window passed with the replica keeping up
        try:
            while batch:
                answers = stream.send(sock, batch)
                # every frame must be answered within KEEP_UP_SECONDS of being queued, and the time its bytes need
                updates = sum(1 for kind, _, _ in batch if kind == stream.APPLY)
                state = sum(a.nbytes for a in batch[0][2][1].values()) if batch[0][0] == stream.STATE else 0
                deadline = oldest + KEEP_UP_SECONDS + (updates * core.nbytes + state) / stream.MIN_RATE
                for _ in range(answers):  # the replica answers every frame but the end of the job
                    seq = stream.answer(sock, deadline)
                    with self._lock:
                        if self.acked < 0:
                            log.info("shard %d: replica at %s holds version %d and follows", core.shard, self.peer, seq)
                        self.acked = max(self.acked, seq)
                        self._lock.notify_all()
                if batch[-1][0] == stream.FINISHED:
                    with self._lock:
                        self._told = True
                        self._lock.notify_all()
                    return
                if not state:  # slow: past a window, updates waited for it more than half of it
                    now = time.monotonic()
                    waited += max(0.0, now - oldest - updates * core.nbytes / stream.MIN_RATE)
                    batches += 1
                    if now - window >= KEEP_UP_SECONDS:
                        if waited > (now - window) / 2 and waited / batches > SLOW_ANSWER_SECONDS:
                            lagging = (
                                f"did not keep up (updates waited {waited:.1f}s of the last "
                                f"{now - window:.1f}s for its answers, {waited / batches:.2f}s each)"
                            )
                            return
                        window, waited, batches, kept_up = now, 0.0, 0, True
                with self._lock:
                    if not self._queue and not self._stop.is_set():
                        self._lock.wait(KEEPALIVE_SECONDS)
                    batch = list(self._queue) or [(stream.KEEPALIVE, self.sent, None)]
                    oldest, self._queued_at = self._queued_at or time.monotonic(), 0.0
                    self._queue.clear()
                    if self._stop.is_set() and batch[-1][0] != stream.FINISHED:
                        return
        except stream.Refused as exc:  # its copy is behind for good: the pair has one, as when it is gone
            refused = str(exc)
        except protocol.TooSlow:  # silent: cut off, as a follower that leaves the in-sync set
            lagging = (
                f"did not keep up (an update waited {time.monotonic() - oldest:.1f}s for its answer, more "
                f"than {KEEP_UP_SECONDS:g}s and the time its bytes need)"
            )
        except protocol.WireError as exc:
            log.warning("shard %d: the stream to its replica at %s ended: %s", core.shard, self.peer, exc)
        finally:
            stream.shut(sock)
            with self._lock:
                self.attached, self.acked, self.follower = False, -1, ""
                self._queue.clear()
                if refused:
                    self._go_alone(f"is gone ({refused})")
                if lagging:  # a replica that kept up before (paused, say) may follow again at once; else it waits
                    self._strikes, wait = (1 if kept_up else self._strikes + 1), 0.0
                    if kept_up:
                        self._bench = BENCH_SECONDS[0]
                    if self._strikes >= 2:
                        self._benched_until, wait = time.monotonic() + self._bench, self._bench
                        self._bench = min(2 * self._bench, BENCH_SECONDS[1])
                    if not self.alone:
                        log.warning(
                            "shard %d: its replica at %s %s: cut off; going on alone, pushes acknowledged "
                            "without a copy; it may follow again %s",
                            core.shard,
                            self.peer,
                            lagging,
                            f"in {wait:.0f}s" if wait else "at once",
                        )
                        self._said_alone = True
                    self.alone = self._lagged = True
                self._lock.notify_all()
            if not self._stop.is_set():
                threading.Thread(target=self._lost, daemon=True, name=f"shard{core.shard}-lost").start()

    def _lost(self, followed: bool = True) -> None:
        """The replica's stream ended (``followed``; else this primary just started): find out whether the peer
        leads (step down), lives as a replica (wait for it to follow again) or is gone (go on alone, and keep asking:
        a peer cut off for a while may have taken over)."""
        while not self._stop.is_set() and self.core.role == PRIMARY and not self.attached:
            found = peer_status(self.peer, self.token, self.tls) if self.peer else None
            if found is not None and found.role == PRIMARY and failovers(found) > self.core.counters["failovers"]:
                self._step_down(found.version)  # it took over from this process (it counts more failovers)
                return
            with self._lock:
                if found is None and (followed or not self.alone):  # (a replica not up yet at the start: no line)
                    self._go_alone("is gone")
                elif not self._lagged:  # (one cut off for not keeping up: pushes go on alone until it follows)
                    self.alone = False  # it lives: pushes wait for it to follow again (ack_seconds at most)
                self._lock.notify_all()
            self._stop.wait(4 * KEEPALIVE_SECONDS)

    def _go_alone(self, why: str) -> None:
        """(Under the pair's lock.)  The replica cannot hold the updates from now on (``why``): pushes are
        acknowledged without a copy (counted: ``unreplicated``) until it follows again; one WARNING says so."""
        if not self.alone:
            log.warning(
                "shard %d: its replica at %s %s: going on alone, pushes acknowledged without a copy until it "
                "follows again",
                self.core.shard,
                self.peer,
                why,
            )
            self._said_alone = True
        self.alone = True

    def _step_down(self, theirs: int) -> None:
        ahead = self.core.version - theirs
        self.core.take_role(REPLICA)
        with self._lock:
            self.alone = False
            self._lock.notify_all()
        log.warning(
            "shard %d: its peer %s leads now (at version %d, this process at %d): stepping down to "
            "replica; pushes not yet acknowledged here are retried there",
            self.core.shard,
            self.peer,
            theirs,
            self.core.version,
        )
        if ahead > 0:  # applied here and not there: the pushes among them acknowledged without a copy are gone
            log.error(
                "shard %d: %d update(s) applied here are not at its peer, which took over while this process "
                "went on alone (a cut link looks like a dead peer to both): pushes acknowledged for them "
                "without a copy are lost",
                self.core.shard,
                ahead,
            )
        self._follower = threading.Thread(target=self._follow, name=f"shard{self.core.shard}-follow", daemon=True)
        self._follower.start()


def _far_end(sock: socket.socket) -> str:
    """HOST:PORT of the far end of ``sock`` ("?" once it is gone)."""
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "?"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
