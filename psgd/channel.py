"""A gRPC channel to a shard, and the token every call to it carries: one place for every caller
(a worker's client, ``psgd status``/``doctor``/``export``, the launcher, the benchmarks)."""

from __future__ import annotations

import grpc

from psgd.tls import NO_TLS, TLSFiles
from psgd.wire import CHANNEL_OPTIONS

#: The gRPC metadata key that carries the job's shared token, as ``Bearer TOKEN``.
TOKEN_METADATA_KEY = "authorization"


def open_channel(address: str, tls: TLSFiles = NO_TLS) -> grpc.Channel:
    """A channel to ``address`` with psgd's message limits: TLS when ``tls`` names files (mutual TLS
    with a client certificate), plaintext otherwise."""
    if tls.enabled:
        return grpc.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token`` (none without one)."""
    return ((TOKEN_METADATA_KEY, f"Bearer {token}"),) if token else ()
