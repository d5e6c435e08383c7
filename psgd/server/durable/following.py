"""A shard's replica following its primary (:mod:`psgd.server.durable.replica`): the replica's side of the pair, which
applies the primary's stream (:mod:`psgd.server.durable.stream`), and takes over once its primary is lost and a worker
comes to it.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time

from psgd.server.durable import stream
from psgd.server.durable.peers import peer_status
from psgd.server.errors import ShardError
from psgd.wire import protocol

log = logging.getLogger("psgd.server.durable.replica")

PRIMARY, REPLICA = "primary", "replica"
#: a worker that came this long before its replica lost the primary counts too (it may find the primary gone first)
WORKERS_SECONDS = 2 * stream.SILENCE_SECONDS


class Following:
    """The replica's side of :class:`psgd.server.durable.replica.Replication` (its state is the pair's)."""

    def _follow(self) -> None:
        """Follow the peer while this process is a replica: apply its stream, answering for each update; take
        over when the stream ends without the job's end and the peer does not lead.  Told that the job is over, it
        still follows a primary that leads again (one restarted after the job's end), which sends its state anew."""
        core = self.core
        while not self._stop.is_set() and core.role == REPLICA:
            why = ""
            try:
                self._sock = self._connect()
                if self._sock is not None:
                    why = self._apply_stream(self._sock)
            except protocol.WireError as exc:
                why = str(exc)
            except ShardError as err:  # refused by this replica (it told the primary): it follows again from its state
                log.warning("shard %d: %s; following again from the primary's state", core.shard, err.message)
            finally:
                self.following = False
                if self._sock is not None:
                    stream.shut(self._sock)
                    self._sock.close()
                    self._sock = None
            if why and not self.job_over and not self._stop.is_set():
                self._orphan(why)
            if self.orphaned and self._asked_at >= self._orphaned_at - WORKERS_SECONDS and self._take_over(why):
                return
            self._woken.wait(0.2)
            self._woken.clear()

    def asked(self) -> None:
        """A worker came to this replica (so it cannot reach the primary): leave to lead once the primary is lost."""
        self._asked_at = time.monotonic()
        self._woken.set()

    def _orphan(self, why: str) -> None:
        """The primary's stream ended (``why``) and it does not answer: gone, or cut off from this process alone."""
        found = peer_status(self.peer, self.token, self.tls)
        if not self._held or (found is not None and found.role == PRIMARY) or self.orphaned:
            return
        self.orphaned, self._orphaned_at = why, time.monotonic()
        log.warning(
            "shard %d: its primary %s does not answer (%s): gone, or cut off from this process alone; this "
            "replica takes over as soon as a worker comes to it",
            self.core.shard,
            self.peer,
            why,
        )

    def _connect(self) -> socket.socket | None:
        """A data connection to the peer whose hello asks to follow; None where the peer does not lead now."""
        found = peer_status(self.peer, self.token, self.tls)
        if found is None or found.role != PRIMARY or not found.data_port or found.incarnation == self._ended_by:
            return None  # (the primary that said the job is over is followed again only once it restarted)
        self._leader = found.incarnation
        self.ticket = secrets.token_hex(16)  # the primary asks at this process's address who holds it
        return stream.connect(
            self.peer.rpartition(":")[0].strip("[]"),
            found.data_port,
            self.me,
            self.token,
            self.core.plan.hash,
            self.tls,
            stream.SILENCE_SECONDS * 5,
            self.ticket,
        )

    def _apply_stream(self, sock: socket.socket) -> str:
        """Apply frames from ``sock`` until it ends; returns why it ended ("" for the job's end)."""
        core = self.core
        reader = stream.Reader(core)
        while not self._stop.is_set():
            sock.settimeout(stream.SILENCE_SECONDS)  # a primary silent this long is taken for gone
            try:
                kind = reader.take(sock)
            except protocol.WireError as exc:
                return f"its stream ended ({exc})"
            self.following = True
            if self.orphaned:
                log.info("shard %d: its primary %s answers again: following it", core.shard, self.peer)
                self.orphaned = ""
            if kind == stream.FINISHED:
                self.job_over, self._ended_by = True, self._leader
                core.notify()
                return ""
            if kind == stream.STATE:  # a primary that leads again after the job's end: the job goes on
                self._held, self.job_over = True, False
        return ""

    def _take_over(self, why: str) -> bool:
        """Lead (True) where the peer does not lead and this process held the job's state (``why``: how it was lost)."""
        found = peer_status(self.peer, self.token, self.tls)
        if not self._held or (found is not None and found.role == PRIMARY):
            return False
        core = self.core
        core.take_role(PRIMARY, failover=True)
        with self._lock:
            self.alone, why, self.orphaned = True, self.orphaned or why, ""
        log.info(
            "shard %d: its primary %s is gone (%s): this replica takes over at version %d",
            core.shard,
            self.peer,
            why,
            core.version,
        )
        return True
