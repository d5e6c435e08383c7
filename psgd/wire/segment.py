"""Shared-memory segments for the same-host link (:mod:`psgd.link.shm`), what both ends agree on.

A segment is an anonymous memory file (``memfd_create``) that the shard makes and keeps open, named

    psgd-<job fingerprint>-s<shard>-<shard's pid>-<weights|push>

(the name shows in ``/proc/<pid>/maps``; there is no file anywhere to remove), starting with a random
nonce, and sealed: it can never be shrunk or grown (a worker could otherwise cut the memory from under
the shard), and the weights' can never be written through a new mapping or ``write``, whoever holds a
descriptor (``F_SEAL_FUTURE_WRITE``; the shard's own mapping, made before, stays writable).  A worker
that asked for one, in a hello that passed the data port's token check, is sent the name, the nonce, a
Unix-domain socket's name and a one-time ticket; it trades the ticket for the descriptor over that
socket (:mod:`psgd.server.net.handout`, which also closes the shard's ``/proc/<pid>/fd`` to other
processes), checks the name, the seals, the size and the nonce (so it never uses a file it was not
given), and maps it.  There are two kinds:

- ``weights``: one per shard, its weights themselves, moved there when the shard first offers shared
  memory (the data port calls :meth:`psgd.server.state.core.ShardCore.place_weights`); workers map it read-only
  and copy their pulls out of it;
- ``push``: one per push connection, made after the data port has checked the hello (and its token);
  the worker writes its gradients there, and the shard closes it when the connection ends.

The memory goes when the last process that maps it does: whatever is killed, nothing is left behind.

Layout: ``HEADER`` bytes (magic, nonce, and at SEQ_AT one sequence number per slot), then the tensor bytes,
in slice order as on every link: the weights segment holds them twice (two slots, see
:mod:`psgd.server.state.store`; a pull's reply says which slot holds its version and what its sequence number
was, and the worker checks that number again after its copy), a push segment once.  The
control messages (requests, versions, outcomes, errors) stay on the data connection's socket; the
segment only carries the bytes, and is read only between a request and its reply (the version
handshake, see :mod:`psgd.link.shm`).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
import socket
from pathlib import Path

import numpy as np

from psgd.errors import TransportError

MAGIC = b"PSGDSHM1"
HEADER = 64  # magic, nonce, sequence numbers, padding: the tensor bytes start cache-line aligned
SEQ_AT = 32  # where the slots' sequence numbers (uint64, little-endian) start in the header
MAX_SLOTS = 4
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1
#: the seals of each kind of segment
SEALS = {
    "weights": fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL,
    "push": fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL,
}
HANDOUT_SECONDS = 5.0  # how long a worker waits for the shard to hand a segment over
PURPOSES = ("weights", "push")
NAME = re.compile(r"^psgd-(?P<job>[0-9a-zA-Z]+)-s(?P<shard>\d+)-(?P<pid>\d+)-(?P<purpose>weights|push)$")


class SegmentError(TransportError):
    """A segment could not be made or mapped here (no memory for it, another pid namespace, another user)."""


def host_id() -> str:
    """Who may share memory with whom: the kernel's boot id and the pid and network namespaces.  Processes
    with the same one run on one kernel, can hand each other descriptors over a Unix-domain socket with an
    abstract name (one network namespace) and are one host on the network; processes in different network namespaces
    count as
    different hosts, as the emulated hosts of ``psgd launch --emulated-hosts`` are.  "" where ``/proc``
    does not say."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pid = os.stat("/proc/self/ns/pid").st_ino
        net = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""
    return f"{boot}:{pid}:{net}"


class Segment:
    """A mapped segment: ``data`` is a bytes view of its tensor area; ``close`` unmaps it (and, in the shard,
    closes its descriptor).  ``offer`` is what a worker needs to map a segment the shard made."""

    def __init__(
        self, name: str, size: int, fd: int, nonce: bytes, writable: bool = True, keep_fd: bool = False, slots: int = 1
    ):
        self.name, self.size, self.nonce, self.slots = name, size, nonce, slots
        try:
            self._map = mmap.mmap(fd, HEADER + slots * size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        except BaseException:
            os.close(fd)
            raise
        if not keep_fd:
            os.close(fd)
            fd = -1
        self.fd = fd
        self.data = memoryview(self._map)[HEADER : HEADER + size]  # slot 0

    def slot(self, index: int) -> memoryview:
        """The tensor bytes of slot ``index``."""
        if not 0 <= index < self.slots:
            raise IndexError(f"{self.name} has {self.slots} slot(s), not slot {index}")
        return memoryview(self._map)[HEADER + index * self.size : HEADER + (index + 1) * self.size]

    def arrays(self, dtype, count: int) -> list[np.ndarray]:
        """Each slot's tensor bytes as ``count`` values of ``dtype``."""
        return [np.frombuffer(self.slot(i), dtype=dtype, count=count) for i in range(self.slots)]

    def address(self) -> tuple[int, int]:
        """Where the whole mapping (header and slots) starts in this process, and its length: what a GPU worker
        registers with its driver (:func:`psgd.compute.backend.register_host`)."""
        whole = np.frombuffer(self._map, dtype=np.uint8)
        return whole.ctypes.data, whole.nbytes

    def seq_array(self) -> np.ndarray:
        """The slots' sequence numbers, as an array over the header (the shard's side writes them)."""
        return np.frombuffer(self._map, dtype="<u8", count=self.slots, offset=SEQ_AT)

    def seq(self, index: int) -> int:
        """Slot ``index``'s sequence number now (one aligned 8-byte read)."""
        at = SEQ_AT + 8 * index
        return int.from_bytes(self._map[at : at + 8], "little")

    def offer(self) -> dict:
        """What a worker needs to check this segment once it has its descriptor (the handout adds how to
        get that: :meth:`psgd.server.net.handout.Handout.offer`)."""
        return {"name": self.name, "nonce": self.nonce.hex(), "bytes": self.size, "slots": self.slots}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.data.release()
            self._map.close()
        except BufferError:  # an array over it is still alive somewhere: the mapping goes with the last one
            pass


def create(job: str, shard: int, purpose: str, size: int, slots: int = 1) -> Segment:
    """A new segment of ``slots`` times ``size`` tensor bytes (the shard's side), its memory reserved now: a
    machine without that much to spare fails here rather than later."""
    if purpose not in PURPOSES:
        raise SegmentError(f"unknown segment purpose {purpose!r}")
    total = HEADER + slots * size
    name = f"psgd-{job}-s{shard}-{os.getpid()}-{purpose}"
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (OSError, AttributeError) as exc:
        raise SegmentError(f"cannot make a memory file ({exc})") from None
    try:
        os.ftruncate(fd, total)
        os.posix_fallocate(fd, 0, total)
    except OSError as exc:
        os.close(fd)
        raise SegmentError(f"cannot reserve {total} bytes of shared memory: {exc}") from None
    nonce = secrets.token_bytes(16)
    try:
        seg = Segment(name, size, fd, nonce, keep_fd=True, slots=slots)
    except (OSError, ValueError) as exc:
        raise SegmentError(f"cannot map {name}: {exc}") from None
    seg._map[: len(MAGIC) + 16] = MAGIC + nonce
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS[purpose])
    except OSError as exc:
        seg.close()
        raise SegmentError(
            f"cannot seal {name} ({exc}; Linux 5.1 or later seals a memory file against writing)"
        ) from None
    return seg


def attach(offer: dict, size: int, writable: bool = True) -> Segment:
    """Take the segment a shard offered (the worker's side): trade the offer's ticket for its descriptor over
    the shard's Unix-domain socket, and map it, read-only unless ``writable``, once it is checked to be the
    one meant: its name, its seals, its size and its nonce."""
    try:
        name, nonce, where = str(offer["name"]), bytes.fromhex(offer["nonce"]), str(offer["socket"])
        ticket, slots = bytes.fromhex(offer["ticket"]), int(offer.get("slots", 1))
    except (KeyError, TypeError, ValueError) as exc:
        raise SegmentError(f"not a segment offer ({type(exc).__name__}: {exc})") from None
    m = NAME.match(name)
    if not m:
        raise SegmentError(f"{name!r} is not the name of a psgd segment")
    if not 1 <= slots <= MAX_SLOTS:
        raise SegmentError(f"a segment of {slots} slots: at most {MAX_SLOTS}")
    if not where.startswith("@psgd-"):
        raise SegmentError(f"{where!r} is not the name of a psgd shard's socket")
    handle = _handed(where, ticket)
    try:
        if os.readlink(f"/proc/self/fd/{handle}") != f"/memfd:{name} (deleted)":
            raise SegmentError(f"the descriptor handed over is not the memory file {name}")
        seals = fcntl.fcntl(handle, fcntl.F_GET_SEALS)
        if seals & SEALS[m["purpose"]] != SEALS[m["purpose"]]:
            raise SegmentError(f"{name} is not sealed as a {m['purpose']} segment must be")
        if os.fstat(handle).st_size != HEADER + slots * size:
            raise SegmentError(f"{name} is not {HEADER + slots * size} bytes long")
    except OSError as exc:
        os.close(handle)
        raise SegmentError(f"cannot check the descriptor handed over for {name}: {exc}") from None
    except SegmentError:
        os.close(handle)
        raise
    try:
        seg = Segment(name, size, handle, nonce, writable, slots=slots)  # closes the descriptor, mapped or not
    except (OSError, ValueError) as exc:
        raise SegmentError(f"cannot map {name}: {exc}") from None
    if bytes(seg._map[: len(MAGIC) + 16]) != MAGIC + nonce:
        seg.close()
        raise SegmentError(f"{name} does not carry the nonce the shard sent: not the segment meant")
    return seg


def _handed(where: str, ticket: bytes) -> int:
    """The descriptor the shard's socket ``where`` hands over for ``ticket``."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(HANDOUT_SECONDS)
            sock.connect("\0" + where[1:])
            sock.sendall(ticket)
            answer, fds, _, _ = socket.recv_fds(sock, 1, 4)
    except OSError as exc:
        raise SegmentError(
            f"cannot reach the shard's socket {where} ({exc}): another network namespace, or the shard has gone"
        ) from None
    for extra in fds[1:]:
        os.close(extra)
    if answer != b"\x01" or not fds:
        for fd in fds[:1]:
            os.close(fd)
        raise SegmentError("the shard handed nothing over for the ticket (used already, or too late)")
    return fds[0]


def mapped(pid: int, job: str) -> list[str]:
    """The names of job ``job``'s segments that process ``pid`` maps (what tests look for)."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return []
    names = set()
    for line in lines:
        where = line.split("/memfd:", 1)
        if len(where) == 2:
            m = NAME.match(where[1].removesuffix(" (deleted)"))
            if m and m["job"] == job:
                names.add(m.group(0))
    return sorted(names)
