"""The checks of a job before (or while) it runs, for ``psgd doctor``: every shard address resolves, its ports
accept connections, it answers the health check and Status as the shard the job file says it is with the same
partition plan; the token, the TLS files and the GPU.  Each :class:`Finding` is one line in plain words."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import socket
import ssl
from typing import Any

from psgd.compute import backend
from psgd.config import ConfigError
from psgd.job import describe_job
from psgd.ops.ports import on_loopback, overlaps
from psgd.ops.reach import TOKEN_ENV, Connect, probe


@dataclasses.dataclass
class Finding:
    level: str  # ok, warn, FAIL
    subject: str
    message: str

    def line(self) -> str:
        return f"  {self.level:<4}  {self.subject}: {self.message}"


class Doctor:
    """Runs the checks for one job and collects :class:`Finding` objects."""

    def __init__(self, job: Any, connect: Connect):
        self.job, self.connect = job, connect
        self.findings: list[Finding] = []

    def add(self, level: str, subject: str, message: str) -> None:
        self.findings.append(Finding(level, subject, message))

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "FAIL"]

    def run(self) -> list[Finding]:
        plan_hash = self.check_plan()
        self.check_servers(plan_hash)
        self.check_tls_files()
        self.check_gpu()
        return self.findings

    # -- the job -----------------------------------------------------------------------------
    def check_plan(self) -> str | None:
        """The partition plan's hash as this job file makes it (None when it cannot be built here)."""
        c = self.job.cluster
        try:
            plan = describe_job(self.job).plan
        except Exception as exc:  # data not on this machine, a model module not importable here...
            self.add(
                "warn",
                "job",
                f"cannot build the model here to compare partition plans ({exc}); the "
                "shards are still compared with each other",
            )
            return None
        self.add(
            "ok",
            "job",
            f"{self.job.source}: {c.shards} shard(s), {c.workers} worker(s), policy {c.policy}, "
            f"model {self.job.model['name']}: partition plan {plan.hash} ({len(plan.specs)} variables)",
        )
        return plan.hash

    def check_servers(self, plan_hash: str | None) -> None:
        c = self.job.cluster
        if not c.servers:
            self.add(
                "FAIL",
                "servers",
                "[cluster] servers is empty: list the shards' addresses (host:port), in "
                "shard order, in the job file or with --servers",
            )
            return

        for overlap in overlaps(c):
            self.add(
                "FAIL",
                "ports",
                f"{overlap}: give each its own (a shard's data port is free by default, or [cluster] data_ports)",
            )
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(c.servers))) as pool:
            results = list(pool.map(lambda k: self.check_shard(k, c.servers[k], plan_hash), range(len(c.servers))))
        statuses = [s for _, s in results if s is not None]
        for found, _ in results:
            self.findings.extend(found)
        hashes = {s["plan_hash"] for s in statuses}
        if plan_hash is None and len(hashes) > 1:
            self.add(
                "FAIL",
                "plan",
                f"the shards hold different partition plans ({', '.join(sorted(hashes))}): "
                "they were not started from the same job file",
            )
        self.check_token(statuses, len(c.servers))

    def check_shard(self, k: int, address: str, plan_hash: str | None) -> tuple[list[Finding], dict | None]:
        found: list[Finding] = []
        say = lambda level, message: found.append(Finding(level, f"shard {k} at {address}", message))  # noqa: E731
        c, timeout = self.job.cluster, self.connect.timeout
        host, _, port_text = address.rpartition(":")
        host = host.strip("[]")
        port = int(port_text)
        if host in ("0.0.0.0", "::", ""):
            say(
                "FAIL",
                f"{host or '(empty)'} is a bind address, not one to connect to: list the shard's host name "
                "or IP in [cluster] servers (bind it with psgd-server --bind 0.0.0.0:PORT)",
            )
            return found, None
        ips, error = resolve(host, port, timeout)
        if error:
            say("FAIL", error)
            return found, None
        loopback = all(ip.startswith("127.") or ip == "::1" for ip in ips)
        # on loopback with every other shard: the one-machine job the pages describe; beside shards elsewhere, a
        # worker on another machine cannot reach it
        alone = loopback and any(not on_loopback(a) for a in c.servers)
        say(
            "warn" if alone else "ok",
            f"resolves to {', '.join(ips)}"
            + (
                " (loopback: only processes on this machine can reach it, and other shards are elsewhere)"
                if alone
                else " (loopback: a job on this machine)"
                if loopback
                else ""
            ),
        )
        error = tcp_check(ips[0], port, timeout)
        if error:
            say("FAIL", f"gRPC port {port}: {error}")
            return found, None
        say("ok", f"gRPC port {port} accepts connections")
        try:
            result = probe(address, self.connect)
        except ConfigError as exc:  # TLS files that cannot be read: said once more under TLS below
            say("FAIL", str(exc))
            return found, None
        if result.health != "SERVING":
            say("FAIL", result.error or f"health {result.health}")
        else:
            say("ok", "health check: SERVING")
        if c.links.transport != "grpc" and result.status is not None:
            data_port = result.status.get("data_port")
            error = (
                tcp_check(ips[0], data_port, timeout)
                if data_port
                else "the shard serves none (it was started with [cluster] transport = \"grpc\")"
            )
            if error:
                which = f" {data_port}" if data_port else ""
                say(
                    "FAIL",
                    f"data port{which}: {error}; workers send tensors there: open it (a free port unless "
                    "[cluster] data_ports or psgd-server --data-port names one), or set [cluster] transport = \"grpc\"",
                )
            else:
                say("ok", f"data port {data_port} accepts connections")
        s = result.status
        if s is None:
            if result.health == "SERVING" or result.code == "UNAUTHENTICATED":
                say("FAIL", f"Status: {result.error}")
            return found, None
        wrong = []
        if s["shard"] != k:
            wrong.append(
                f"it is shard {s['shard']}, but the job file lists it as shard {k}: [cluster] servers must "
                "be in shard order"
            )
        if s["num_shards"] != c.shards:
            wrong.append(f"it belongs to a job of {s['num_shards']} shard(s), the job file has {c.shards}")
        if s["policy"] != c.policy:
            wrong.append(f"its policy is {s['policy']}, the job file's is {c.policy}")
        if len(s["workers"]) != c.workers:
            wrong.append(f"it expects {len(s['workers'])} worker(s), the job file has {c.workers}")
        if plan_hash is not None and s["plan_hash"] != plan_hash:
            wrong.append(
                f"its partition plan is {s['plan_hash']}, this job file makes {plan_hash}: it was started "
                "from another model, dtype, shard count or slice size"
            )
        for message in wrong:
            say("FAIL", message)
        if not wrong:
            say(
                "ok",
                f"answers as shard {k} of {c.shards}, policy {s['policy']}, version {s['version']}, "
                f"{len(s['workers'])} worker(s)" + (", same partition plan" if plan_hash else ""),
            )
        return found, s

    def check_token(self, statuses: list[dict], total: int) -> None:
        token = self.connect.token
        if token and token != token.strip():
            self.add(
                "warn",
                "token",
                "has leading or trailing whitespace (quotes or a trailing space in an env "
                "file?); every process must use exactly the same token",
            )
        refused = any(f.level == "FAIL" and "UNAUTHENTICATED" in f.message for f in self.findings)
        if refused:
            return  # already said, per shard
        if len(statuses) != total:
            return  # not every shard answered: nothing to say about the token
        if token:
            self.add("ok", "token", "accepted by every shard")
        else:
            self.add(
                "warn",
                "token",
                f"none set ({TOKEN_ENV} or --token) and the shards accept calls without one: "
                "anyone who can reach their ports can change the weights",
            )

    # -- files and devices ---------------------------------------------------------------------
    def check_tls_files(self) -> None:
        cn = self.connect
        if not (cn.tls_ca or cn.tls_cert or cn.tls_key):
            self.add("ok", "TLS", "not configured (plain TCP): fine on a private network")
            return
        problems = []
        for label, path in (("CA certificate", cn.tls_ca), ("certificate", cn.tls_cert), ("private key", cn.tls_key)):
            if path and not os.path.isfile(path):
                problems.append(f"{label} {path} does not exist")
            elif path and not os.access(path, os.R_OK):
                problems.append(f"{label} {path} is not readable by this user")
        if bool(cn.tls_cert) != bool(cn.tls_key):
            problems.append("a certificate needs its private key and the other way round (--tls-cert with --tls-key)")
        if not problems and cn.tls_ca:
            try:
                ssl.create_default_context().load_verify_locations(cafile=cn.tls_ca)
            except (ssl.SSLError, ValueError) as exc:
                problems.append(f"CA certificate {cn.tls_ca} is not a PEM certificate ({exc})")
        if not problems and cn.tls_cert:
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cn.tls_cert, cn.tls_key)
            except (ssl.SSLError, ValueError) as exc:
                problems.append(
                    f"certificate {cn.tls_cert} and key {cn.tls_key} do not load together ({exc}): "
                    "not PEM, or the key does not belong to the certificate"
                )
        for p in problems:
            self.add("FAIL", "TLS", p)
        if not problems:
            what = ["CA " + cn.tls_ca] if cn.tls_ca else []
            what += [f"certificate {cn.tls_cert} with its key"] if cn.tls_cert else []
            self.add("ok", "TLS", "files parse: " + ", ".join(what))

    def check_gpu(self) -> None:
        seen = backend.gpu_names()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        listed = (
            f"{len(seen)} GPU(s) seen"
            + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
            + (": " + "; ".join(seen) if seen else "")
        )
        device = self.job.train.device
        if device.strip().lower() == "cpu":
            self.add("ok", "GPU", f"train.device is {device}: no GPU needed; {listed}")
            return
        try:  # parses cuda[:N] or cuda:0,2; checks CuPy, the driver, each index and a first kernel on each
            used = [str(backend.get_device(f"cuda:{i}")) for i in backend.gpu_indices(device)]
        except backend.DeviceError as exc:
            self.add("FAIL", "GPU", f"train.device is {device}, but {exc}; {listed}")
            return
        self.add("ok", "GPU", f"{device}: {', '.join(used)} run(s) CuPy's kernels; {listed}")


def resolve(host: str, port: int, timeout: float) -> tuple[list[str], str | None]:
    """The IP addresses of ``host`` (within ``timeout``), or an error in plain words."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    future = pool.submit(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
    pool.shutdown(wait=False)
    try:
        infos = future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        return [], f"cannot resolve {host!r} within {timeout:g}s: the DNS server does not answer"
    except socket.gaierror as exc:
        return [], (
            f"cannot resolve {host!r}: {exc.strerror}; check the name, /etc/hosts or the cluster's DNS "
            "(in Kubernetes: the headless Service and the pod's subdomain)"
        )
    ips = []
    for info in infos:
        if info[4][0] not in ips:
            ips.append(info[4][0])
    return ips, None


def tcp_check(ip: str, port: int, timeout: float) -> str | None:
    """None when a TCP connection to ``ip:port`` opens within ``timeout``, else why not in plain words."""
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return None
    except ConnectionRefusedError:
        return (
            f"nothing listens on {ip}:{port} (connection refused): is psgd-server running there, bound to an "
            "address others can reach (not 127.0.0.1)?"
        )
    except TimeoutError:
        return f"no answer from {ip}:{port} within {timeout:g}s: a firewall may drop the packets, or the host is down"
    except OSError as exc:
        return f"cannot connect to {ip}:{port}: {exc.strerror or exc}"
