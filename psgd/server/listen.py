"""The ports a shard listens on: :class:`PortTaken` says which of them it cannot have and why, and
:func:`free_to_listen` checks the gRPC port before gRPC tries it (gRPC logs lines of its own where it fails)."""

from __future__ import annotations

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
        socket.create_server((host or "0.0.0.0", int(port)),
                             family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
    except OSError as exc:
        raise PortTaken("gRPC port", bind, int(port), exc.strerror or str(exc)) from None
