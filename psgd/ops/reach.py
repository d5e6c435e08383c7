"""Reaching running shards, for ``psgd status`` and ``psgd doctor``: how (:class:`Connect`: deadline, token,
TLS), one address's health check and Status as a :class:`ShardProbe`, and failed calls explained in plain words.

Every network call has a deadline (``--timeout``, default 3 s), and shards are
asked in parallel, so an unreachable address costs seconds, not minutes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from psgd.proto import ps_pb2, ps_pb2_grpc
from psgd.wire.channel import SERVICE_NAME, TOKEN_ENV, open_channel
from psgd.wire.tls import TLSFiles


# -- connecting ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Connect:
    """How to reach shards: per-call deadline, token and TLS files."""

    timeout: float = 3.0
    token: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    @classmethod
    def using(cls, tls: TLSFiles, token: str, timeout: float) -> Connect:
        """How to reach shards with the files of ``tls`` and ``token``, each call within ``timeout``."""
        return cls(timeout=timeout, token=token, tls_ca=tls.ca or "", tls_cert=tls.cert or "", tls_key=tls.key or "")

    @property
    def tls(self) -> TLSFiles:
        return TLSFiles(self.tls_cert or None, self.tls_key or None, self.tls_ca or None)

    def channel(self, address: str) -> grpc.Channel:
        return open_channel(address, self.tls, self.token)

    def call(self, address: str, ask: Callable[[grpc.Channel, float, bool], Any]) -> Any:
        """``ask(channel, timeout, wait_for_ready)`` on a channel to ``address``, within ``self.timeout`` in all.  A
        shard that closes the connection as it comes (its gRPC port is full: psgd.server.net.listen bounds it, and
        closes connections that never prove themselves within seconds) is asked again, waiting for a connection to
        be taken, until the deadline; one that refuses it fails at once.  Where the deadline passes, the first
        error is raised: it says most (a plaintext client at a TLS port is closed as it comes too)."""
        end = time.monotonic() + self.timeout
        with self.channel(address) as channel:
            try:
                return ask(channel, self.timeout, False)
            except grpc.RpcError as err:
                details = ((err.details() if hasattr(err, "details") else "") or "").lower()
                if err.code() != grpc.StatusCode.UNAVAILABLE or not any(w in details for w in CLOSED):
                    raise
                first = err
            try:
                return ask(channel, max(0.01, end - time.monotonic()), True)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise first from None
                raise


#: What gRPC says of a connection the other end closed as it came (a full port).
CLOSED = ("socket closed", "connection reset", "broken pipe")


def explain_rpc_error(address: str, err: grpc.RpcError, timeout: float) -> str:
    """A failed call to ``address`` in plain words."""
    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else "") or ""
    low = details.lower()
    host = address.rpartition(":")[0]
    if code == grpc.StatusCode.UNAVAILABLE:
        if "dns" in low or "resolve" in low or "name or service" in low:
            return f"cannot resolve the host name {host!r} (DNS): check the name, /etc/hosts or the cluster's DNS"
        if "refused" in low:
            return (
                f"nothing listens at {address} (connection refused): is psgd-server running there, bound to "
                "an address others can reach (not 127.0.0.1)?"
            )
        if "ssl" in low or "handshake" in low or "tls" in low or "certificate" in low:
            return f"TLS failed with {address}: {details} (do the client and the shard agree on TLS and the CA?)"
        if "timeout" in low or "timed out" in low or "deadline" in low:
            return f"no answer from {address} within {timeout:g}s: a firewall may drop the packets, or the host is down"
        return (
            f"cannot talk to {address}: {details or 'unavailable'} (if the shards use TLS, pass --tls-ca; if "
            "not, check that the address is a psgd-server's gRPC port, and that its connections are not all "
            "taken)"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer from {address} within {timeout:g}s: a firewall may drop the packets, or the host is down"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (
            f"{address} refused the token (UNAUTHENTICATED): set {TOKEN_ENV} or --token to the token the "
            "shards were started with"
        )
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return f"{address} refused the call (PERMISSION_DENIED): {details}"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return f"something answers at {address}, but it is not a psgd shard (the call is unknown there)"
    name = code.name if code is not None else "error"
    return f"{address}: {name}: {details}"


# -- one shard -----------------------------------------------------------------------------------
@dataclasses.dataclass
class ShardProbe:
    """What one address said: its health and Status, or why it could not say."""

    address: str
    health: str  # SERVING, NOT_SERVING, UNKNOWN, SERVICE_UNKNOWN or UNREACHABLE
    status: dict | None = None  # the StatusReply as a dict (counters parsed)
    error: str | None = None  # plain words, when something failed
    code: str | None = None  # the gRPC status code name of that failure
    taken: float = 0.0  # time.monotonic() when the Status arrived

    @property
    def ok(self) -> bool:
        return self.health == "SERVING" and self.status is not None


def status_dict(reply: Any) -> dict:
    try:
        counters = json.loads(reply.counters_json or "{}")
    except ValueError:
        counters = {}
    return {
        "shard": reply.shard,
        "num_shards": reply.num_shards,
        "policy": reply.policy,
        "version": reply.version,
        "plan_hash": reply.plan_hash,
        "bytes_held": reply.bytes_held,
        "incarnation": reply.incarnation,
        "data_port": getattr(reply, "data_port", 0),  # where Status reports it; 0: the shard serves none
        "role": getattr(reply, "role", ""),
        "replica_lag": getattr(reply, "replica_lag", -1),
        "follower": getattr(reply, "follower", ""),
        "counters": counters,
        "staleness_histogram": list(reply.staleness_histogram),
        "workers": [
            {
                "worker_id": w.worker_id,
                "state": w.state,
                "clock": w.clock,
                "lease_left_seconds": w.lease_left_seconds,
                "hostname": w.hostname,
                "pid": w.pid,
            }
            for w in reply.workers
        ],
    }


def check_health(address: str, connect: Connect) -> tuple[str, str | None, str | None]:
    """``(health, error, code)`` of ``address`` from the standard gRPC health service."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        reply = connect.call(
            address,
            lambda channel, timeout, wait: health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout, wait_for_ready=wait
            ),
        )
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.NOT_FOUND:
            return (
                "SERVICE_UNKNOWN",
                (f"{address} runs a gRPC health service but not for {SERVICE_NAME}: is it a psgd shard?"),
                err.code().name,
            )
        return "UNREACHABLE", explain_rpc_error(address, err, connect.timeout), err.code().name
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if name != "SERVING":
        return name, f"{address} reports {name}: the shard is starting, shutting down or unwell", None
    return name, None, None


def read_status(address: str, connect: Connect) -> dict:
    """The Status of the shard at ``address`` (:func:`status_dict`), within ``connect.timeout``; the call's
    ``grpc.RpcError`` when it does not answer."""
    reply = connect.call(
        address,
        lambda channel, timeout, wait: ps_pb2_grpc.ParameterServerStub(channel).Status(
            ps_pb2.StatusRequest(), timeout=timeout, wait_for_ready=wait
        ),
    )
    return status_dict(reply)


def try_status(address: str, connect: Connect) -> tuple[dict | None, str, str]:
    """The Status of the shard at ``address`` (:func:`read_status`); or None, why it did not answer and the call's
    status code."""
    try:
        return read_status(address, connect), "", ""
    except grpc.RpcError as err:
        return None, explain_rpc_error(address, err, connect.timeout), err.code().name


def probe(address: str, connect: Connect) -> ShardProbe:
    """Health check and Status of one address, each within ``connect.timeout``."""
    health, error, code = check_health(address, connect)
    if health == "UNREACHABLE":
        return ShardProbe(address, health, error=error, code=code, taken=time.monotonic())
    status, why, failed = try_status(address, connect)
    if status is None:
        return ShardProbe(address, health, error=why, code=failed, taken=time.monotonic())
    return ShardProbe(address, health, status, error=error, code=code, taken=time.monotonic())


def probe_all(addresses: Sequence[str], connect: Connect) -> list[ShardProbe]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(32, len(addresses)))) as pool:
        return list(pool.map(lambda a: probe(a, connect), addresses))
