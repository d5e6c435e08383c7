"""The machine's own limits, measured in the same run as every communication figure, and how a call is timed."""

from __future__ import annotations

import multiprocessing
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from psgd.compute import backend

CHUNK = 4 << 20


def _sink(server: socket.socket, total_bytes: int, buffer_bytes: int) -> None:
    conn, _ = server.accept()
    view = memoryview(bytearray(buffer_bytes))
    received = 0
    while received < total_bytes:
        at = received % buffer_bytes
        n = conn.recv_into(view[at:], min(CHUNK, buffer_bytes - at))
        if n == 0:
            break
        received += n
    conn.sendall(b"k")
    conn.close()


def tcp_loopback_gbps(total_bytes: int = 2 << 30, buffer_bytes: int = CHUNK, repeats: int = 3) -> float:
    """Raw loopback TCP from Python between two processes (best of ``repeats``).

    With the default ``buffer_bytes`` (4 MiB) both sides reuse one buffer that
    stays in cache: ``sendall`` of 4 MiB chunks into ``recv_into``, the usual
    figure for "raw loopback TCP".  With a model-sized ``buffer_bytes`` the
    bytes come from and go to memory, as a model's tensors do.
    """
    ctx = multiprocessing.get_context("fork")
    total_bytes = max(total_bytes // buffer_bytes, 1) * buffer_bytes
    best = 0.0
    for _ in range(repeats):
        server = socket.create_server(("127.0.0.1", 0))
        proc = ctx.Process(target=_sink, args=(server, total_bytes, buffer_bytes), daemon=True)
        proc.start()
        client = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
        payload = memoryview(bytearray(buffer_bytes))
        start = time.perf_counter()
        sent = 0
        while sent < total_bytes:
            client.sendall(payload)
            sent += buffer_bytes
        client.recv(1)  # the receiver has everything
        best = max(best, total_bytes / (time.perf_counter() - start) / 1e9)
        client.close()
        server.close()
        proc.join(30)
    return best


def memcpy_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """numpy copy into an existing buffer: bytes copied per second (best of ``repeats``)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def machine() -> str:
    import os
    import platform

    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, Python {platform.python_version()}, {platform.system()}"


def seconds_per_call(
    fn: Callable[[], Any], device: backend.Device, *, repeats: int, warmup: int, calls: int = 1
) -> float:
    """Median over ``repeats`` runs of (``calls`` calls of ``fn``, then a synchronize of ``device``) /
    ``calls``, after ``warmup`` untimed calls; ``device`` is also synchronized before each clock start."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        backend.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        backend.synchronize(device)
        times.append((time.perf_counter() - start) / calls)
    return float(np.median(times))
