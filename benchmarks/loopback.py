"""The machine's own limits, measured in the same run as every communication figure."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

CHUNK = 4 << 20


def tcp_loopback_gbps(total_bytes: int = 1 << 30, chunk: int = CHUNK) -> float:
    """Raw loopback TCP from Python: ``sendall`` in one thread, ``recv_into`` a reused buffer in another."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = [0]

    def sink():
        conn, _ = server.accept()
        buf = bytearray(chunk)
        view = memoryview(buf)
        while received[0] < total_bytes:
            n = conn.recv_into(view)
            if n == 0:
                break
            received[0] += n
        conn.close()

    t = threading.Thread(target=sink, daemon=True)
    t.start()
    client = socket.create_connection(("127.0.0.1", port))
    payload = memoryview(bytearray(chunk))
    start = time.perf_counter()
    sent = 0
    while sent < total_bytes:
        client.sendall(payload)
        sent += chunk
    t.join(60)
    elapsed = time.perf_counter() - start
    client.close()
    server.close()
    return total_bytes / elapsed / 1e9


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
