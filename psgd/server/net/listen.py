"""The ports a shard listens on: :class:`PortTaken` says which of them it cannot have and why, and
:func:`free_to_listen` checks the gRPC port before gRPC tries it (gRPC logs lines of its own where it fails).

And what connections that have not proven the token may take of a shard: the gRPC port holds at most
:func:`grpc_connection_cap` connections (gRPC closes more as they come), so that a flood of them never takes the
descriptors the shard needs for its data port, its checkpoints and its replica; one that has not finished its
handshake within the hello deadline is closed, and one with no call in flight for GRPC_IDLE_SECONDS too.  The data
port's own bounds are :mod:`psgd.server.net.gatekeeper`'s."""

from __future__ import annotations

import resource
import socket

from psgd.errors import ClusterError


class PortTaken(ClusterError):
    """A port a shard was to listen on that it cannot have: which of its ports (``what``: "gRPC port" or "data
    port"), its address and number, and why."""

    def __init__(self, what: str, address: str, port: int, why: str):
        super().__init__(f"cannot listen on its {what} {address}: {why}")
        self.what, self.address, self.port, self.why = what, address, port, why


def free_to_listen(bind: str) -> None:
    """Raise :class:`PortTaken` where ``bind``'s port (not 0) cannot be listened on just now."""
    host, _, port = bind.rpartition(":")
    if int(port) == 0:
        return
    host = host.strip("[]")
    try:
        socket.create_server(
            (host or "0.0.0.0", int(port)), family=socket.AF_INET6 if ":" in host else socket.AF_INET
        ).close()
    except OSError as exc:
        raise PortTaken("gRPC port", bind, int(port), exc.strerror or str(exc)) from None


# -- what a flood of connections may take ------------------------------------------------------------------
#: Connections to the gRPC port, at most (fewer where the process has few descriptors): a worker holds one to
#: each shard, as do ``psgd status``, the launcher and a replica.  More are closed by gRPC as they come.
GRPC_CONNECTIONS = 1024
#: Descriptors kept for the shard's own work beyond its connections: checkpoint files and their folder, the
#: replica's link, pipes, its log, the libraries gRPC and Python keep open.
OWN_DESCRIPTORS = 96
#: A gRPC connection with no call in flight for this long is closed (its client reconnects when it calls again):
#: a connection that spoke HTTP/2 and then nothing holds a place no longer.
GRPC_IDLE_SECONDS = 30.0
#: The descriptors a shard asks for at start where its hard limit allows (``ulimit -n`` is often 1,024).
WANTED_DESCRIPTORS = 65536


def raise_descriptor_limit(wanted: int = WANTED_DESCRIPTORS) -> int:
    """Raise this process's soft limit on open descriptors towards ``wanted`` (never past its hard limit, never
    down); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError):
            pass
    return soft


def grpc_connection_cap(data_connections: int, workers: int) -> tuple[int, str]:
    """How many connections the gRPC port may hold at once: GRPC_CONNECTIONS (or two per worker, where that is
    more), within what this process's descriptor limit leaves beside ``data_connections`` (the data port's caps)
    and OWN_DESCRIPTORS.  Second: a warning to log where the limit leaves too few for the workers, else ""."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = (1 << 30 if soft == resource.RLIM_INFINITY else soft) - data_connections - OWN_DESCRIPTORS
    wanted = max(GRPC_CONNECTIONS, 2 * workers + 16)
    cap = max(8, min(wanted, room))
    needed = 2 * workers + 16
    warning = (
        ""
        if cap >= needed
        else (
            f"only {soft} open files allowed (ulimit -n): the gRPC port takes {cap} connections at most, fewer than "
            f"the {needed} its {workers} workers and tools may need; raise the limit (ulimit -n {WANTED_DESCRIPTORS})"
        )
    )
    return cap, warning
