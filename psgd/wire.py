"""What client and server agree on about moving tensors: chunk sizes and message limits."""

from __future__ import annotations

from typing import Iterator

CHUNK_BYTES = 2 << 20
#: Largest message either side accepts: one chunk plus its envelope.  Anything
#: bigger is refused by gRPC itself with RESOURCE_EXHAUSTED.
MAX_MESSAGE_BYTES = CHUNK_BYTES + (64 << 10)

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


def chunks(data: bytes | memoryview, size: int = CHUNK_BYTES) -> Iterator[tuple[int, memoryview]]:
    """(offset, piece) pairs covering ``data``; an empty buffer still yields one empty piece."""
    view = memoryview(data).cast("B")
    if len(view) == 0:
        yield 0, view
        return
    for offset in range(0, len(view), size):
        yield offset, view[offset:offset + size]


# -- the bulk data path ----------------------------------------------------------------
#
# Beside gRPC (the control plane: register, heartbeat, done, status, and a
# pull/push fallback), every shard listens on a plain TCP port for pulls and
# pushes.  A connection starts with HELLO (worker id, plan hash, token); then
# each request is one fixed header and, for a push, the gradient bytes of the
# shard's slices in slice order; each reply is one fixed header and, for a
# pull, the weight bytes in the same order, or an error message.  Payload
# sizes are fixed by the partition plan, so neither side ever allocates what
# the other declares.
#
# A push of at least GO_AHEAD_BYTES waits, after its header, for a reply with
# the outcome code READY (the shard has checked the header and has a receive
# buffer for it) before it sends the payload.  Besides sparing a refused push
# its payload, the short exchange keeps Linux from treating the connection as
# interactive: a large transfer that follows one in the other direction
# straight away is otherwise paced by delayed ACKs, and a 40 MB push took
# twice as long as the pull before it (benchmarks/RESULTS.md).  Smaller
# pushes go in one message: below 4 MiB the round trip cost more than it saved.  A client may always
# send the payload without waiting; the shard reads it after its READY.

import socket
import ssl
import struct

import numpy as np

DATA_MAGIC = b"PSG1"
OP_HELLO, OP_PULL, OP_PUSH = 1, 2, 3
OPS = {OP_HELLO: "hello", OP_PULL: "pull", OP_PUSH: "push"}
#: magic, op, wire dtype code, worker id, clock, base version, payload bytes
REQUEST = struct.Struct("<4sBBxxiqqQ")
#: magic, status (a grpc.StatusCode number), outcome code, version, next clock, staleness, payload bytes
REPLY = struct.Struct("<4sBBxxqqqQ")
MAX_HELLO_BYTES = 64 << 10
MAX_ERROR_BYTES = 8 << 10
OUTCOMES = ("applied", "accumulated", "duplicate", "late")
#: the outcome code of a push's go-ahead (status 0, no payload)
READY = 255
GO_AHEAD_BYTES = 4 << 20


def wants_go_ahead(payload_bytes: int) -> bool:
    """Whether a push of ``payload_bytes`` waits for the shard's READY before its payload."""
    return payload_bytes >= GO_AHEAD_BYTES

#: wire dtypes of pushed gradients: 0 = the variables' own dtype; the others compress float32 gradients
WIRE_DTYPES = {0: None, 1: "float32", 2: "float64", 3: "float16", 4: "bfloat16"}
WIRE_CODES = {v: k for k, v in WIRE_DTYPES.items() if v}
WIRE_ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}


class WireError(Exception):
    """The peer broke the data-path protocol or went away."""


def tune(sock: socket.socket) -> None:
    """Options for every data-path socket: no Nagle delay.  Buffer sizes are left to the kernel:
    setting SO_SNDBUF/SO_RCVBUF turns Linux's autotuning off, which made pushes slower here."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def recv_exact(sock: socket.socket, into: memoryview) -> None:
    """Fill ``into`` from ``sock`` or raise WireError (the peer closed, or the timeout passed)."""
    view = into.cast("B") if into.format != "B" or into.ndim != 1 else into
    got, n = 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], min(n - got, 8 << 20))
        except socket.timeout:
            raise WireError(f"timed out after {got} of {n} bytes") from None
        except OSError as exc:
            raise WireError(f"connection failed: {exc}") from None
        if k == 0:
            raise WireError(f"connection closed after {got} of {n} bytes")
        got += k


def recv_struct(sock: socket.socket, fmt: struct.Struct) -> tuple:
    buf = bytearray(fmt.size)
    recv_exact(sock, memoryview(buf))
    return fmt.unpack(buf)


def send_buffers(sock: socket.socket, buffers: list) -> None:
    """Send every buffer, in order, with as few system calls as the kernel allows."""
    views = [memoryview(b).cast("B") for b in buffers if len(memoryview(b).cast("B"))]
    try:
        if isinstance(sock, ssl.SSLSocket):  # TLS sockets have no sendmsg: one buffer at a time
            for view in views:
                sock.sendall(view)
            return
        while views:
            sent = sock.sendmsg(views[:512])
            while views and sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            if sent:
                views[0] = views[0][sent:]
    except socket.timeout:
        raise WireError("timed out while sending") from None
    except OSError as exc:
        raise WireError(f"connection failed: {exc}") from None


def to_bfloat16(src: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Round float32 ``src`` to bfloat16 bit patterns (uint16) in ``out`` (round to nearest even)."""
    bits = src.view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    np.right_shift(rounded, np.uint32(16), out=out, casting="unsafe")
    nan = np.isnan(src)
    if nan.any():  # rounding would carry a NaN's payload into inf, 0 or -0: keep it a (quiet) NaN
        out[nan] = (bits[nan] >> np.uint32(16)) | np.uint32(0x0040)
    return out


def from_bfloat16(src: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) in ``src`` to float32 ``out``."""
    wide = out.view(np.uint32)
    np.left_shift(src.astype(np.uint32), np.uint32(16), out=wide)
    return out
