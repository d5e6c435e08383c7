"""The same-host link's copies between a shared-memory segment and a GPU: the ``shm`` part of ``psgd bench gpu``.

A GPU worker whose shard shares memory with it (:mod:`psgd.link.shm`) moves the weights from the shard's segment to
the device and its gradient from the device into its push segment.  For each size (``Options.transfer_sizes``, bytes
of float32), each way, three paths, in GB/s (10^9 B/s):

  two copies   the path through pinned buffers (``psgd.compute.backend.host_empty``): segment -> pinned on the host
               (``psgd.link.shm.copy_views``), then ``device.asarray``; ``to_host(dev, out=pinned)``, then pinned ->
               segment
  direct       straight between the segment and the device (``copy_to_device`` / ``copy_to_host``), unregistered
  registered   the same with the segment's mapping registered with the driver (``psgd.compute.backend.register_host``),
               what a GPU worker does on the shm link

The segment is a real one (``psgd.wire.segment.create``, a sealed memory file); pulls read it through a second,
read-only mapping, as a worker maps a shard's weights (registered with cudaHostRegisterReadOnly), pushes write the
writable one.  Each figure is the median of ``o.repeats`` timed calls after ``o.warmup``, the device synchronized
before the clock is read (``psgd.bench.gpu.seconds_per_call``).
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable
from typing import Any

import numpy as np

from psgd.bench.limits import seconds_per_call
from psgd.compute import backend
from psgd.link.shm import copy_views
from psgd.wire import segment

MB = 1_000_000
PATHS = ("two copies", "direct", "registered")


def shm_part(device: backend.Device, o: Any) -> list[dict]:
    """Per size, per way (pull: segment to device, push: device to segment), the three paths of the module's
    docstring; a registration the driver refuses leaves its figures None, and ``error`` says so."""
    device.use()
    rows = []
    for size in o.transfer_sizes:
        n = size // 4
        seg = segment.create("benchgpu", 0, "weights", n * 4)  # one slot; this, its maker's mapping, stays writable
        readonly = mmap.mmap(seg.fd, segment.HEADER + seg.size, prot=mmap.PROT_READ)
        try:
            rows += _measure(device, o, size, readonly, seg)
        finally:
            with contextlib.suppress(BufferError):  # an array over it left in a traceback: it goes with that
                readonly.close()
            seg.close()
    return rows


def _measure(device: backend.Device, o: Any, size: int, readonly: mmap.mmap, seg: segment.Segment) -> list[dict]:
    """The rows of one size, ``seg`` holding as many bytes, mapped a second time read-only (``readonly``)."""
    xp, n = device.xp, size // 4
    read = np.frombuffer(readonly, dtype=np.float32, count=n, offset=segment.HEADER)
    written = np.frombuffer(seg.data, dtype=np.float32, count=n)
    written.fill(1.0)  # every page touched before the clock starts
    dev = xp.ones(n, dtype=np.float32)
    pinned = backend.host_empty((n,), np.float32, device)

    def pull_twice() -> None:
        copy_views([(pinned, read)])
        device.asarray(pinned)

    def push_twice() -> None:
        backend.to_host(dev, out=pinned)
        copy_views([(written, pinned)])

    def pull_direct() -> None:
        backend.copy_to_device([(xp.empty(n, dtype=np.float32), read)], device)

    def push_direct() -> None:
        backend.copy_to_host([(dev, written)], device)

    def seconds(fn: Callable[[], None]) -> float:
        return seconds_per_call(fn, device, repeats=o.repeats, warmup=o.warmup)

    rows = []
    for way, twice, direct, address in (
        ("pull", pull_twice, pull_direct, _address(readonly)),
        ("push", push_twice, push_direct, seg.address()),
    ):
        taken = {"two copies": seconds(twice), "direct": seconds(direct), "registered": None}
        registered = backend.register_host(*address, device, read_only=way == "pull")
        if registered is not None:
            try:
                taken["registered"] = seconds(direct)
            finally:
                registered.close()
        rows += [_row(size, way, path, taken[path], taken["two copies"]) for path in PATHS]
    return rows


def _address(mapping: mmap.mmap) -> tuple[int, int]:
    """Where ``mapping`` starts, and its length."""
    whole = np.frombuffer(mapping, dtype=np.uint8)
    return whole.ctypes.data, whole.nbytes


def _row(size: int, way: str, path: str, seconds: float | None, twice: float) -> dict:
    row = {
        "part": "shm",
        "size_bytes": size,
        "size_mb": size / MB,
        "direction": way,
        "path": path,
        "ms": None,
        "gbps": None,
        "over_two_copies": None,
    }
    if seconds is None:
        row["error"] = "the driver refused to register the segment (psgd.compute.backend logged why)"
    else:
        row.update(ms=seconds * 1e3, gbps=size / seconds / 1e9, over_two_copies=twice / seconds)
    return row
