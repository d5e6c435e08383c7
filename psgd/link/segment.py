"""Shared-memory segments for the same-host link (:mod:`psgd.link.shm`), what both ends agree on.

Segments are files in ``/dev/shm`` with owner-only permissions, named

    psgd-<job fingerprint>-s<shard>-<shard's pid>-<16 random hex digits>-<weights|push>

each starting with a random nonce that the shard sends to the worker it is meant for, so a worker never
uses a file it was not given.  There are two kinds:

- ``weights``: one per shard, its weights themselves, moved there when the shard first offers shared
  memory (:meth:`psgd.server.core.ShardCore.place_weights`); workers map it read-only and copy their
  pulls out of it.  Its name lives as long as the shard serves, so that workers can join; the shard
  removes it when it stops.
- ``push``: one per push connection, made after the data port has checked the hello (and its token);
  the worker writes its gradients there.  The shard removes its name as soon as the worker's first
  request arrives (the worker has mapped it by then), or when the connection ends.

Whatever is killed, a shard of the same job and index starting later removes every such name whose
process is gone (:func:`remove_stale`); a killed worker leaves nothing, and a killed shard at most
its weights and a push segment not yet mapped.

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

SHM_DIR = Path("/dev/shm")
MAGIC = b"PSGDSHM1"
HEADER = 64  # magic, nonce, padding: the tensor bytes start cache-line aligned
PURPOSES = ("weights", "push")
_NAME = re.compile(r"^psgd-(?P<job>[0-9a-zA-Z]+)-s(?P<shard>\d+)-(?P<pid>\d+)-[0-9a-f]{16}-(?:weights|push)$")


class SegmentError(Exception):
    """A segment could not be made or mapped here (no /dev/shm, another mount, another user)."""


#: copies at least this long are split in two, half on a helper thread (NumPy lets go of the GIL while it
#: copies): 1.2x a single thread's memory-copy rate here (8.3 against 6.8 ms for 100 MB on 2 cores)
SPLIT_BYTES = 8 << 20
_helper: ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()


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
    """Who shares memory with whom: the kernel's boot id, the device and inode of ``/dev/shm`` and the
    network namespace.  Two processes with the same one see the same shared-memory files (same machine,
    same mount) and are one host on the network; processes in different network namespaces count as
    different hosts, as the emulated hosts of ``psgd launch --emulated-hosts`` are.  "" where there is no
    ``/dev/shm`` to share."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        st = os.stat(SHM_DIR)
        net = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""
    return f"{boot}:{st.st_dev}:{st.st_ino}:{net}"


class Segment:
    """A mapped segment: ``data`` is a bytes view of its tensor area; ``close`` unmaps it (the name is
    removed separately, by its creator)."""

    def __init__(self, path: Path, size: int, fd: int, nonce: bytes, writable: bool = True):
        self.path, self.size, self.nonce = path, size, nonce
        try:
            self._map = mmap.mmap(fd, HEADER + size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        finally:
            os.close(fd)
        self.data = memoryview(self._map)[HEADER:HEADER + size]

    def array(self, dtype, count: int) -> np.ndarray:
        return np.frombuffer(self.data, dtype=dtype, count=count)

    def unlink(self) -> None:
        """Remove the name (idempotent); the mapping stays valid."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        try:
            self.data.release()
            self._map.close()
        except BufferError:  # an array over it is still alive somewhere: the mapping goes with the last one
            pass


def create(job: str, shard: int, purpose: str, size: int) -> Segment:
    """A new segment of ``size`` tensor bytes (the shard's side), owner-only, its memory reserved now (a
    full ``/dev/shm``, 64 MB in a container by default, fails here rather than later)."""
    if purpose not in PURPOSES:
        raise SegmentError(f"unknown segment purpose {purpose!r}")
    name = f"psgd-{job}-s{shard}-{os.getpid()}-{secrets.token_hex(8)}-{purpose}"
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise SegmentError(f"cannot create {path}: {exc}") from None
    try:
        os.posix_fallocate(fd, 0, HEADER + size)
    except OSError as exc:
        os.close(fd)
        _remove(path)
        raise SegmentError(f"cannot size {path} to {HEADER + size} bytes: {exc}") from None
    nonce = secrets.token_bytes(16)
    try:
        seg = Segment(path, size, fd, nonce)
    except (OSError, ValueError) as exc:
        _remove(path)
        raise SegmentError(f"cannot map {path}: {exc}") from None
    seg._map[:len(MAGIC) + 16] = MAGIC + nonce
    return seg


def attach(name: str, size: int, nonce: bytes, writable: bool = True) -> Segment:
    """Map the segment ``name`` the shard created (the worker's side), read-only unless ``writable``, and
    check it is the one meant."""
    if not _NAME.match(name):
        raise SegmentError(f"{name!r} is not a psgd segment name")
    path = SHM_DIR / name
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW)
    except OSError as exc:
        raise SegmentError(f"cannot open {path} ({exc}): not the shard's shared-memory mount, or "
                           "another user") from None
    try:
        length = os.fstat(fd).st_size
    except OSError as exc:
        os.close(fd)
        raise SegmentError(f"cannot read {path}: {exc}") from None
    if length != HEADER + size:
        os.close(fd)
        raise SegmentError(f"{path} is not {HEADER + size} bytes long")
    try:
        seg = Segment(path, size, fd, nonce, writable)  # closes fd, mapped or not
    except (OSError, ValueError) as exc:
        raise SegmentError(f"cannot map {path}: {exc}") from None
    if bytes(seg._map[:len(MAGIC) + 16]) != MAGIC + nonce:
        seg.close()
        raise SegmentError(f"{path} does not carry the nonce the shard sent: not the segment meant")
    return seg


def remove_stale(job: str, shard: int) -> list[str]:
    """Remove the segments of shard ``shard`` of job ``job`` whose creating process is gone; their names."""
    removed = []
    try:
        entries = list(SHM_DIR.iterdir())
    except OSError:
        return removed
    for path in entries:
        m = _NAME.match(path.name)
        if not m or m["job"] != job or int(m["shard"]) != shard or _alive(int(m["pid"])):
            continue
        if _remove(path):
            removed.append(path.name)
    return removed


def leftovers(job: str) -> list[str]:
    """The names in ``/dev/shm`` of job ``job``'s segments (for tests and ``psgd doctor``)."""
    try:
        return sorted(p.name for p in SHM_DIR.iterdir() if (m := _NAME.match(p.name)) and m["job"] == job)
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _remove(path: Path) -> bool:
    try:
        os.unlink(path)
    except OSError:
        return False
    return True
