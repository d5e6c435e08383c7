"""A job's ports on its hosts: which of them a job file gives twice (:func:`overlaps`, for ``psgd doctor``), and
which process of this machine holds a port another wants (:func:`holder`, for ``psgd-server``'s error)."""

from __future__ import annotations

import os
from typing import Any

#: host names that all mean this machine's loopback
_LOOPBACK = {"localhost", "127.0.0.1", "::1", "ip6-localhost"}


def _host(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    host = host.strip("[]").lower()
    return ("127.0.0.1" if host in _LOOPBACK else host), int(port)


def on_loopback(address: str) -> bool:
    """Whether ``host:port`` names this machine's loopback (by name or address)."""
    host = address.rpartition(":")[0].strip("[]")
    return host in _LOOPBACK or host.startswith("127.")


def overlaps(cluster: Any) -> list[str]:
    """Each port a job's ``[cluster]`` gives two of its processes on one host: the shards' gRPC ports
    (``servers``), their data ports (``data_ports``, on their shard's host) and the replicas' gRPC ports
    (``replica_servers``); one line each, saying whose ports they are."""
    owners: dict[tuple[str, int], list[str]] = {}
    for k, address in enumerate(cluster.servers):
        host, port = _host(address)
        owners.setdefault((host, port), []).append(f"shard {k}'s gRPC port")
        if k < len(cluster.links.data_ports):
            owners.setdefault((host, cluster.links.data_ports[k]), []).append(f"shard {k}'s data port")
    for k, address in enumerate(cluster.recovery.replica_servers):
        owners.setdefault(_host(address), []).append(f"replica {k}'s gRPC port")
    return [f"{host}:{port} is {' and '.join(names)}" for (host, port), names in owners.items() if len(names) > 1]


def holder(port: int) -> str:
    """Which process of this machine listens on TCP ``port`` ("pid 123: psgd-server -c job.toml ..."), from
    /proc (Linux); "another process" where that cannot be read."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                        inodes.add(fields[9])
        except (OSError, IndexError, ValueError, StopIteration):
            continue
    for pid in filter(str.isdigit, os.listdir("/proc")) if inodes else ():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] in inodes for fd in fds):  # "socket:[INODE]"
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
                return f"pid {pid}: {' '.join(argv)[:160]}"
        except OSError:
            continue
    return "another process"
