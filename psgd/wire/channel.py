"""A gRPC channel to a shard, its TLS and the shard's, the proof of the token every call on it carries
(:mod:`psgd.wire.proofs`), and the size of the messages on it: one place for every caller (a worker's links,
``psgd status``/``doctor``/``export``, the launcher, the benchmarks) and for the shard's gRPC server."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Mapping

import grpc

from psgd.errors import ConfigError
from psgd.wire.proofs import PROOF_METADATA_KEY, Prover
from psgd.wire.tls import NO_TLS, TLSFiles

#: Tensors travel over gRPC in chunks of this many bytes (a pull's TensorChunk, a push's).
CHUNK_BYTES = 2 << 20
#: Largest message either side accepts: one chunk plus its envelope.  Anything
#: bigger is refused by gRPC itself with RESOURCE_EXHAUSTED.
MAX_MESSAGE_BYTES = CHUNK_BYTES + (64 << 10)

#: A channel whose shard went away tries again after 0.1 s, backing off to at most 2 s (a worker's own retries
#: back off to 2 s too), not gRPC's 1 s to 120 s: a restarted shard is rejoined as soon as it serves, where a
#: channel in backoff would fail every call at once until its next attempt.
RECONNECT_MS = (100, 2000)

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_MS[0]),
    ("grpc.min_reconnect_backoff_ms", RECONNECT_MS[0]),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_MS[1]),
]

#: The gRPC service of a shard, as health checks name it.
SERVICE_NAME = "psgd.v1.ParameterServer"
#: Where every process of a job finds its token when no --token flag gives one.
TOKEN_ENV = "PSGD_TOKEN"
#: The fewest characters a token may have, and the example deploy/psgd.env.example shows: both anyone could guess.
SHORTEST_TOKEN, EXAMPLE_TOKEN = 16, "replace-me-with-a-generated-token"
MAKE_TOKEN = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"


def open_channel(address: str, tls: TLSFiles = NO_TLS, token: str = "") -> grpc.Channel:
    """A channel to ``address`` with psgd's message limits: TLS when ``tls`` names files (mutual TLS
    with a client certificate), plaintext otherwise; each call on it proves ``token`` (never sends it)."""
    if tls.enabled:
        tls.check_client()
        credentials = grpc.ssl_channel_credentials(
            root_certificates=tls.pem("ca"), private_key=tls.pem("key"), certificate_chain=tls.pem("cert")
        )
        return _proving(grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS), token, address)
    return _proving(grpc.insecure_channel(address, options=CHANNEL_OPTIONS), token, address)


def accepts_connections(address: str, timeout: float) -> bool:
    """Whether a process at ``address`` (``host:port``) accepts a TCP connection within ``timeout`` seconds.  A plain
    connection, closed at once: no gRPC channel is left watching its own state from a thread of gRPC's (one that
    outlived its closed channel died with "Cannot monitor channel state")."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def server_credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    """A shard's gRPC port's TLS (mutual where ``tls`` names a CA: clients must show a certificate it signed)."""
    tls.check_server()
    ca = tls.pem("ca")
    return grpc.ssl_server_credentials(
        [(tls.pem("key"), tls.pem("cert"))], root_certificates=ca, require_client_auth=ca is not None
    )


def read_token(given: str | None = None, environ: Mapping[str, str] = os.environ, source: str = "") -> str:
    """The job's token: ``given`` (a --token flag's, or what ``source`` names) if any, else $PSGD_TOKEN; "" for none
    (whether a process may go without one is its own to say).  Every token enters here, so that one anyone could
    guess is refused wherever it comes from: :class:`ConfigError`, which says how to make a good one."""
    source = source or ("--token" if given is not None else TOKEN_ENV)
    token = given if given is not None else environ.get(TOKEN_ENV, "")
    if token == EXAMPLE_TOKEN:
        raise ConfigError(f"the token in {source} is the example the docs show: {_MAKE_ONE}")
    if 0 < len(token) < SHORTEST_TOKEN:
        raise ConfigError(
            f"the token in {source} has {len(token)} character(s), fewer than {SHORTEST_TOKEN}: {_MAKE_ONE}"
        )
    return token


_MAKE_ONE = f"anyone could guess it; make one: {MAKE_TOKEN}"


def chunks(data: bytes | memoryview, size: int = CHUNK_BYTES) -> Iterator[tuple[int, memoryview]]:
    """(offset, piece) pairs covering ``data``; an empty buffer still yields one empty piece."""
    view = memoryview(data).cast("B")
    if len(view) == 0:
        yield 0, view
        return
    for offset in range(0, len(view), size):
        yield offset, view[offset : offset + size]


class _Proving(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Puts a fresh proof for its method into every call's metadata."""

    def __init__(self, prover: Prover):
        self.prover = prover

    def _proven(self, details):
        metadata = [*(details.metadata or ()), (PROOF_METADATA_KEY, "Proof " + self.prover.prove(details.method))]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._proven(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._proven(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._proven(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._proven(details), requests)


def _proving(channel: grpc.Channel, token: str, to: str) -> grpc.Channel:
    """``channel`` (to ``to``), each call on it proving ``token``; unchanged without a token."""
    return grpc.intercept_channel(channel, _Proving(Prover(token, to))) if token else channel
