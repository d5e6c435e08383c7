"""Shared-memory segments for the same-host link (:mod:`psgd.link.shm`), what both ends agree on.

A segment is an anonymous memory file (``memfd_create``) that the shard makes and keeps open, named

    psgd-<job fingerprint>-s<shard>-<shard's pid>-<weights|push>

(the name shows in ``/proc/<pid>/maps`` and ``ls -l /proc/<pid>/fd``; there is no file anywhere to
remove), starting with a random nonce.  A worker that asked for one is sent the shard's pid, the
descriptor's number, the name and the nonce; it opens ``/proc/<shard pid>/fd/<n>``, which the kernel
allows only to a process of the shard's user in the shard's pid namespace, checks the name and the
nonce (so it never uses a file it was not given), and maps it.  There are two kinds:

- ``weights``: one per shard, its weights themselves, moved there when the shard first offers shared
  memory (the data port calls :meth:`psgd.server.core.ShardCore.place_weights`); workers map it read-only
  and copy their pulls out of it;
- ``push``: one per push connection, made after the data port has checked the hello (and its token);
  the worker writes its gradients there, and the shard closes it when the connection ends.

The memory goes when the last process that maps it does: whatever is killed, nothing is left behind.

Layout: ``HEADER`` bytes (magic, nonce), then the tensor bytes, in slice order as on every link.  The
control messages (requests, versions, outcomes, errors) stay on the data connection's socket; the
segment only carries the bytes, and is read only between a request and its reply (the version
handshake, see :mod:`psgd.link.shm`).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

MAGIC = b"PSGDSHM1"
HEADER = 64  # magic, nonce, padding: the tensor bytes start cache-line aligned
PURPOSES = ("weights", "push")
NAME = re.compile(r"^psgd-(?P<job>[0-9a-zA-Z]+)-s(?P<shard>\d+)-(?P<pid>\d+)-(?P<purpose>weights|push)$")

#: copies at least this long are split in two, half on a helper thread (NumPy lets go of the GIL while it
#: copies): 1.2x a single thread's memory-copy rate here (8.3 against 6.8 ms for 100 MB on 2 cores)
SPLIT_BYTES = 8 << 20
_helper: ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()


class SegmentError(Exception):
    """A segment could not be made or mapped here (no memory for it, another pid namespace, another user)."""


def copy_bytes(dst, src) -> None:
    """Copy the bytes of ``src`` into ``dst`` (buffers of one length), a long copy on two threads."""
    d, s = np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8)
    if d.size < SPLIT_BYTES:
        np.copyto(d, s)
        return
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = ThreadPoolExecutor(1, thread_name_prefix="psgd-copy")
    half = d.size // 2 // 64 * 64
    other = _helper.submit(np.copyto, d[half:], s[half:])
    np.copyto(d[:half], s[:half])
    other.result()


def host_id() -> str:
    """Who may share memory with whom: the kernel's boot id and the pid and network namespaces.  Processes
    with the same one run on one kernel, can open each other's descriptors through ``/proc`` (given the
    same user) and are one host on the network; processes in different network namespaces count as
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

    def __init__(self, name: str, size: int, fd: int, nonce: bytes, writable: bool = True, keep_fd: bool = False):
        self.name, self.size, self.nonce = name, size, nonce
        try:
            self._map = mmap.mmap(fd, HEADER + size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        except BaseException:
            os.close(fd)
            raise
        if not keep_fd:
            os.close(fd)
            fd = -1
        self.fd = fd
        self.data = memoryview(self._map)[HEADER:HEADER + size]

    def array(self, dtype, count: int) -> np.ndarray:
        return np.frombuffer(self.data, dtype=dtype, count=count)

    def offer(self) -> dict:
        """What the shard sends a worker for it to map this segment (:func:`attach`)."""
        return {"pid": os.getpid(), "fd": self.fd, "name": self.name, "nonce": self.nonce.hex(), "bytes": self.size}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.data.release()
            self._map.close()
        except BufferError:  # an array over it is still alive somewhere: the mapping goes with the last one
            pass


def create(job: str, shard: int, purpose: str, size: int) -> Segment:
    """A new segment of ``size`` tensor bytes (the shard's side), its memory reserved now: a machine without
    that much to spare fails here rather than later."""
    if purpose not in PURPOSES:
        raise SegmentError(f"unknown segment purpose {purpose!r}")
    name = f"psgd-{job}-s{shard}-{os.getpid()}-{purpose}"
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    except (OSError, AttributeError) as exc:
        raise SegmentError(f"cannot make a memory file ({exc})") from None
    try:
        os.ftruncate(fd, HEADER + size)
        os.posix_fallocate(fd, 0, HEADER + size)
    except OSError as exc:
        os.close(fd)
        raise SegmentError(f"cannot reserve {HEADER + size} bytes of shared memory: {exc}") from None
    nonce = secrets.token_bytes(16)
    try:
        seg = Segment(name, size, fd, nonce, keep_fd=True)
    except (OSError, ValueError) as exc:
        raise SegmentError(f"cannot map {name}: {exc}") from None
    seg._map[:len(MAGIC) + 16] = MAGIC + nonce
    return seg


def attach(offer: dict, size: int, writable: bool = True) -> Segment:
    """Map the segment a shard offered (the worker's side), read-only unless ``writable``, once it is checked
    to be the one meant: its name, its size and its nonce."""
    try:
        pid, fd, name, nonce = int(offer["pid"]), int(offer["fd"]), str(offer["name"]), bytes.fromhex(offer["nonce"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SegmentError(f"not a segment offer ({type(exc).__name__}: {exc})") from None
    m = NAME.match(name)
    if not m or int(m["pid"]) != pid:
        raise SegmentError(f"{name!r} is not the name of a psgd segment of process {pid}")
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if os.readlink(path) != f"/memfd:{name} (deleted)":
            raise SegmentError(f"{path} is not the memory file {name}")
        handle = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except OSError as exc:
        raise SegmentError(f"cannot open {path} ({exc}): another pid namespace or another user") from None
    try:
        length = os.fstat(handle).st_size
    except OSError as exc:
        os.close(handle)
        raise SegmentError(f"cannot read {path}: {exc}") from None
    if length != HEADER + size:
        os.close(handle)
        raise SegmentError(f"{name} is not {HEADER + size} bytes long")
    try:
        seg = Segment(name, size, handle, nonce, writable)  # closes the descriptor, mapped or not
    except (OSError, ValueError) as exc:
        raise SegmentError(f"cannot map {name}: {exc}") from None
    if bytes(seg._map[:len(MAGIC) + 16]) != MAGIC + nonce:
        seg.close()
        raise SegmentError(f"{name} does not carry the nonce the shard sent: not the segment meant")
    return seg


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
