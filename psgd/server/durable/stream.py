"""The stream from a shard's primary to its replica (``[cluster] replicas = 1``, :mod:`psgd.server.durable.replica`):
what travels on it and how the replica applies it.

The replica opens a data connection to its primary's data port whose hello asks to follow (:func:`connect`), and
says where it listens in its first frame; the primary answers the hello and takes that (:func:`accept`), then
sends frames (:func:`send`): a fixed header (:data:`FRAME`), JSON, then raw bytes sent from the arrays with
``sendmsg``, as pulls are.  The replica applies each (:class:`Reader`), receiving an update straight into a reused
buffer as a push is, and answers every frame but the job's end (:data:`ANSWER`): an update with its number as soon
as it is here whole (it is then held, and applied in order while the next one travels), the others with the version
the replica holds once it took them.  An update the replica cannot apply (out of order, or one its policy would not
apply) is answered with a refusal that says why (:class:`Refused`) instead: the primary counts its replica gone.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import struct

import numpy as np

from psgd.server.errors import ShardError
from psgd.server.state import checkpoint
from psgd.server.state.core import ShardCore
from psgd.wire import protocol
from psgd.wire.proofs import Prover
from psgd.wire.tls import TLSFiles

log = logging.getLogger("psgd.server.durable.replica")

#: What a frame is: the primary's whole state (JSON: its manifest and where each array lies in the bytes), one
#: applied update (the bytes: the gradient as applied, in slice order), the policy's state (JSON), a keepalive,
#: the end of the job (the replica stops rather than take over); and the replica's first frame (JSON: its own gRPC
#: address, where the primary asks after it).
STATE, APPLY, POLICY, KEEPALIVE, FINISHED, FOLLOW = range(1, 7)
MAGIC, ANSWER_MAGIC = b"PSGR", b"PSGA"
#: magic, kind, seq (the primary's version once it is applied), worker, clock, staleness, lr_scale, JSON bytes,
#: data bytes
FRAME = struct.Struct("<4sBxxxqiqqdIQ")
#: magic, the update now held (an update's number, else the version the replica holds); or, with REFUSED_MAGIC, the
#: length of the words that follow: the replica cannot apply the update it was sent, and says why
ANSWER = struct.Struct("<4sq")
REFUSED_MAGIC = b"PSGX"
#: a frame's bytes and its answer must come at this rate at least, after SILENCE_SECONDS * 2
MIN_RATE = 1e7
#: a primary silent this long (a keepalive goes every 0.2 s) is taken for gone by its replica; a replica that does
#: not answer within twice this (and the time its bytes need) is cut off by its primary
SILENCE_SECONDS = 1.0


#: where a replica may say it listens: a host name, an IPv4 address or a bracketed IPv6 one, and a port
ADDRESS = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._-]{0,252}|\[[0-9A-Fa-f:.]{2,45}\]):[0-9]{1,5}")
#: the ticket a follower gives after its address: a fresh random one per connection (or none)
TICKET = re.compile(r"(?:[0-9a-f]{32})?")


def frame(
    kind: int,
    seq: int,
    text: str = "",
    data_bytes: int = 0,
    worker: int = 0,
    clock: int = 0,
    staleness: int = 0,
    lr_scale: float = 0.0,
) -> list:
    body = text.encode()
    return [FRAME.pack(MAGIC, kind, seq, worker, clock, staleness, lr_scale, len(body), data_bytes), body]


def shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


# -- the primary's end ----------------------------------------------------------------------------------------
def accept(sock: socket.socket, version: int) -> tuple[str, str]:
    """Answer a follower's hello on ``sock`` and read its first frame; returns where it listens, and the ticket
    with which it says so at that address (psgd.server.durable.peers.confirms)."""
    protocol.send_buffers(sock, [protocol.REPLY.pack(protocol.DATA_MAGIC, 0, 0, version, 0, 0, 0)])
    magic, kind, _, _, _, _, _, size, nbytes = protocol.recv_struct(sock, FRAME)
    if magic != MAGIC or kind != FOLLOW or size > protocol.MAX_HELLO_BYTES or nbytes:
        raise protocol.WireError("a replica's first frame must say where it listens")
    address, _, ticket = protocol.recv_bytes(sock, size).decode("utf-8", "replace").partition(" ")
    if not ADDRESS.fullmatch(address) or not TICKET.fullmatch(ticket):  # logged and dialled: only a host and a port
        raise protocol.WireError(f"a replica must listen at HOST:PORT, not {address[:80]!r}")
    return address, ticket


def send(sock: socket.socket, batch: list[tuple]) -> int:
    """Send ``batch`` ((kind, seq, body) each, in order) in one go; returns how many answers to read, and sets
    the time they may take."""
    buffers = []
    for kind, seq, body in batch:
        if kind == STATE:
            manifest, arrays = body
            at, places = 0, {}
            for name, a in arrays.items():
                places[name] = [a.dtype.str, list(a.shape), at]
                at += a.nbytes
            buffers += frame(STATE, seq, json.dumps({**manifest, "arrays": places}), at)
            buffers += [np.ascontiguousarray(a) for a in arrays.values()]
        elif kind == APPLY:
            worker, clock, staleness, lr_scale, grads = body
            views = [np.ascontiguousarray(grads[i]) for i in sorted(grads)]
            buffers += frame(APPLY, seq, "", sum(v.nbytes for v in views), worker, clock, staleness, lr_scale)
            buffers += views
        else:
            buffers += frame(kind, seq, body or "")
    nbytes = sum(memoryview(b).nbytes for b in buffers)
    sock.settimeout(2 * SILENCE_SECONDS + nbytes / MIN_RATE)
    protocol.send_buffers(sock, buffers)
    return sum(1 for kind, _, _ in batch if kind != FINISHED)


class Refused(protocol.WireError):
    """The replica could not apply an update it was sent (the words say which and why): the pair has one copy."""


def answer(sock: socket.socket, deadline: float | None = None) -> int:
    """The next answer of the replica: the version it holds; :class:`Refused` where it could not apply an update,
    :class:`protocol.TooSlow` where it did not come by ``deadline`` (time.monotonic)."""
    try:
        magic, seq = protocol.recv_struct(sock, ANSWER, deadline)
        if magic == REFUSED_MAGIC and 0 <= seq <= protocol.MAX_ERROR_BYTES:
            raise Refused(protocol.recv_bytes(sock, seq).decode("utf-8", "replace"))
    except (Refused, protocol.TooSlow):
        raise
    except protocol.WireError as exc:
        raise protocol.WireError(f"no answer from the replica: {exc}") from None
    if magic != ANSWER_MAGIC:
        raise protocol.WireError("not a replica's answer")
    return seq


# -- the replica's end ------------------------------------------------------------------------------------------
def connect(
    host: str, port: int, me: str, token: str, plan_hash: str, tls: TLSFiles, timeout: float, ticket: str = ""
) -> socket.socket:
    """A data connection to a primary's data port at ``host``:``port`` whose hello asks to follow, its first frame
    saying that this replica listens at ``me`` (where it answers for ``ticket``: psgd.server.durable.peers.confirms)."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise protocol.WireError(f"cannot connect to {host}:{port}: {exc}") from None
    try:
        protocol.tune(sock)
        if tls.enabled:
            sock = tls.wrap_client(sock, host)
        hello = json.dumps(
            {"proof": Prover(token, f"{host}:{port}").prove("follow"), "plan_hash": plan_hash, "follow": True}
        ).encode()  # the token itself never travels to a peer
        protocol.send_buffers(
            sock,
            [
                protocol.REQUEST.pack(protocol.DATA_MAGIC, protocol.OP_HELLO, 0, protocol.OBSERVER, 0, 0, len(hello)),
                hello,
            ],
        )
        magic, op, _, _, _, _, size = protocol.recv_struct(sock, protocol.REPLY)
        if magic != protocol.DATA_MAGIC or op != 0:
            message = protocol.recv_bytes(sock, min(size, protocol.MAX_ERROR_BYTES)).decode("utf-8", "replace")
            raise protocol.WireError(f"the primary's data port refused to be followed: {message}")
        protocol.send_buffers(sock, frame(FOLLOW, 0, f"{me} {ticket}" if ticket else me))
    except BaseException:
        sock.close()
        raise
    return sock


class Reader:
    """Applies a primary's frames on its replica, each once whole."""

    def __init__(self, core: ShardCore):
        self.core = core
        self.grad = bytearray(core.nbytes)
        self.limit = 8 * core.nbytes + (64 << 20)  # what a state may take: the weights and optimizer state, and more

    def take(self, sock: socket.socket) -> int:
        """Read and apply the next frame from ``sock``, answering it (an update as soon as it is here whole, then
        applied while the next comes: it is held, and applied in order); returns its kind."""
        magic, kind, seq, worker, clock, staleness, lr_scale, size, nbytes = protocol.recv_struct(sock, FRAME)
        if magic != MAGIC or size > self.limit or nbytes > self.limit:
            raise protocol.WireError("not a primary's frame")
        sock.settimeout(2 * SILENCE_SECONDS + (size + nbytes) / MIN_RATE)
        text = protocol.recv_bytes(sock, size).decode("utf-8", "replace") if size else ""
        core = self.core
        if kind == STATE:
            self._state(json.loads(text), protocol.recv_bytes(sock, nbytes))
        elif kind == POLICY:
            core.adopt_policy(json.loads(text))
        elif kind == APPLY:
            if nbytes != len(self.grad):
                raise protocol.WireError(f"an update of {nbytes} bytes; the shard holds {len(self.grad)}")
            protocol.recv_exact(sock, memoryview(self.grad))
            grads = core.store.gradient_views(self.grad)

            def answer(why: str) -> None:  # before it is applied: the primary acknowledges the push on it
                if why:
                    words = why.encode()[: protocol.MAX_ERROR_BYTES]
                    protocol.send_buffers(sock, [ANSWER.pack(REFUSED_MAGIC, len(words)), words])
                else:
                    protocol.send_buffers(sock, [ANSWER.pack(ANSWER_MAGIC, seq)])

            core.apply_replicated(seq, worker, clock, staleness, lr_scale, grads, answer)
        elif kind not in (KEEPALIVE, FINISHED):
            raise protocol.WireError(f"a frame of unknown kind {kind}")
        if kind not in (APPLY, FINISHED):
            protocol.send_buffers(sock, [ANSWER.pack(ANSWER_MAGIC, core.version)])
        return kind

    def _state(self, manifest: dict, data: bytearray) -> None:
        core = self.core
        if manifest.get("fingerprint") != core.fingerprint:
            raise ShardError(
                "FAILED_PRECONDITION",
                f"replica of shard {core.shard} of job {core.fingerprint} was "
                f"sent the state of job {manifest.get('fingerprint')}",
            )
        arrays = {}
        for name, (dtype, shape, at) in manifest.pop("arrays").items():
            kind = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            if at < 0 or at + count * kind.itemsize > len(data):
                raise protocol.WireError("a state whose arrays do not fit its bytes")
            arrays[name] = np.frombuffer(data, dtype=kind, count=count, offset=at).reshape(shape)
        core.adopt(checkpoint.Checkpoint(manifest, arrays, "the primary's state"))
        log.info("shard %d: following the primary from version %d", core.shard, core.version)
