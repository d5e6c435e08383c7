"""``psgd status`` and ``psgd doctor``: look at a running cluster, and check one before (or while) it runs.

``psgd status ADDRESS...`` asks every shard for its health and its Status
(version, policy, counters, staleness histogram, workers and their clocks)
and prints one table of shards and one of workers; with ``--watch`` it
refreshes, with rates computed between polls.  It needs only the addresses.

``psgd doctor -c job.toml`` walks through what a job needs, address by
address: the name resolves, the gRPC and data ports accept connections, the
shard answers the health check and Status as the shard the job file says it
is, with the same partition plan; then the token, the TLS files and the GPU.
Each finding is one line in plain words; the exit status is 1 when anything
is wrong.  ``psgd doctor --health [ADDRESS]`` is the one-line health check
used by the container images.

Every network call has a deadline (``--timeout``, default 3 s), and shards are
asked in parallel, so an unreachable address costs seconds, not minutes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import socket
import ssl
import sys
import time
from typing import Any, Sequence

import grpc

from psgd.channel import open_channel, token_metadata
from psgd.tls import TLSFiles

SERVICE_NAME = "psgd.v1.ParameterServer"
TOKEN_ENV = "PSGD_TOKEN"
HEALTH_ENV = "PSGD_HEALTH_ADDRESS"
DEFAULT_HEALTH_ADDRESS = "127.0.0.1:50051"
# -- connecting ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Connect:
    """How to reach shards: per-call deadline, token and TLS files."""

    timeout: float = 3.0
    token: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return token_metadata(self.token)

    @property
    def tls(self) -> TLSFiles:
        return TLSFiles(self.tls_cert or None, self.tls_key or None, self.tls_ca or None)

    def channel(self, address: str) -> grpc.Channel:
        return open_channel(address, self.tls)


def add_connect_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection")
    group.add_argument("--timeout", type=float, default=3.0, metavar="SECONDS",
                       help="deadline for each call to a shard (default 3)")
    group.add_argument("--token", default=None,
                       help=f"the job's shared token (default: the {TOKEN_ENV} environment variable)")
    group.add_argument("--tls-ca", metavar="FILE", default=None,
                       help="CA certificate (PEM) to check the shards' certificates: talk TLS to them")
    group.add_argument("--tls-cert", metavar="FILE", default=None, help="client certificate (PEM) for mutual TLS")
    group.add_argument("--tls-key", metavar="FILE", default=None, help="client private key (PEM) for mutual TLS")


def connect_from_args(args: argparse.Namespace) -> Connect:
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV, "")
    return Connect(timeout=args.timeout, token=token, tls_ca=args.tls_ca or "", tls_cert=args.tls_cert or "",
                   tls_key=args.tls_key or "")


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
            return (f"nothing listens at {address} (connection refused): is psgd-server running there, bound to "
                    "an address others can reach (not 127.0.0.1)?")
        if "ssl" in low or "handshake" in low or "tls" in low or "certificate" in low:
            return f"TLS failed with {address}: {details} (do the client and the shard agree on TLS and the CA?)"
        if "timeout" in low or "timed out" in low or "deadline" in low:
            return f"no answer from {address} within {timeout:g}s: a firewall may drop the packets, or the host is down"
        return (f"cannot talk to {address}: {details or 'unavailable'} (if the shards use TLS, pass --tls-ca; if "
                "not, check that the address is a psgd-server's gRPC port)")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer from {address} within {timeout:g}s: a firewall may drop the packets, or the host is down"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (f"{address} refused the token (UNAUTHENTICATED): set {TOKEN_ENV} or --token to the token the "
                "shards were started with")
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
    health: str                   # SERVING, NOT_SERVING, UNKNOWN, SERVICE_UNKNOWN or UNREACHABLE
    status: dict | None = None    # the StatusReply as a dict (counters parsed)
    error: str | None = None      # plain words, when something failed
    code: str | None = None       # the gRPC status code name of that failure
    taken: float = 0.0            # time.monotonic() when the Status arrived

    @property
    def ok(self) -> bool:
        return self.health == "SERVING" and self.status is not None


def status_dict(reply: Any) -> dict:
    try:
        counters = json.loads(reply.counters_json or "{}")
    except ValueError:
        counters = {}
    return {
        "shard": reply.shard, "num_shards": reply.num_shards, "policy": reply.policy, "version": reply.version,
        "plan_hash": reply.plan_hash, "bytes_held": reply.bytes_held, "incarnation": reply.incarnation,
        "data_port": getattr(reply, "data_port", 0),  # where Status reports it; else the gRPC port + 1
        "counters": counters, "staleness_histogram": list(reply.staleness_histogram),
        "workers": [{"worker_id": w.worker_id, "state": w.state, "clock": w.clock,
                     "lease_left_seconds": w.lease_left_seconds, "hostname": w.hostname, "pid": w.pid}
                    for w in reply.workers],
    }


def check_health(address: str, connect: Connect) -> tuple[str, str | None, str | None]:
    """``(health, error, code)`` of ``address`` from the standard gRPC health service."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with connect.channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=connect.timeout,
                metadata=connect.metadata)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN", (f"{address} runs a gRPC health service but not for {SERVICE_NAME}: "
                                           "is it a psgd shard?"), err.code().name
            return "UNREACHABLE", explain_rpc_error(address, err, connect.timeout), err.code().name
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if name != "SERVING":
        return name, f"{address} reports {name}: the shard is starting, shutting down or unwell", None
    return name, None, None


def probe(address: str, connect: Connect) -> ShardProbe:
    """Health check and Status of one address, each within ``connect.timeout``."""
    from psgd.proto import ps_pb2, ps_pb2_grpc

    health, error, code = check_health(address, connect)
    if health == "UNREACHABLE":
        return ShardProbe(address, health, error=error, code=code, taken=time.monotonic())
    with connect.channel(address) as channel:
        try:
            reply = ps_pb2_grpc.ParameterServerStub(channel).Status(
                ps_pb2.StatusRequest(), timeout=connect.timeout, metadata=connect.metadata)
        except grpc.RpcError as err:
            return ShardProbe(address, health, error=explain_rpc_error(address, err, connect.timeout),
                              code=err.code().name, taken=time.monotonic())
    return ShardProbe(address, health, status_dict(reply), error=error, code=code, taken=time.monotonic())


def probe_all(addresses: Sequence[str], connect: Connect) -> list[ShardProbe]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(32, len(addresses)))) as pool:
        return list(pool.map(lambda a: probe(a, connect), addresses))


# -- the cluster view ----------------------------------------------------------------------------
def staleness_quantile(histogram: Sequence[int], q: float) -> str:
    """The ``q`` quantile of a staleness histogram (0..14, the last bucket 15+), as text; '-' when empty."""
    total = sum(histogram)
    if not total:
        return "-"
    need, acc = q * total, 0
    for i, n in enumerate(histogram):
        acc += n
        if acc >= need:
            return f"{i}+" if i == len(histogram) - 1 else str(i)
    return f"{len(histogram) - 1}+"


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@dataclasses.dataclass
class ClusterView:
    """One poll of every address, with rates against the previous poll (if any)."""

    probes: list[ShardProbe]
    when: float = dataclasses.field(default_factory=time.time)
    previous: "ClusterView | None" = None

    def _earlier(self, p: ShardProbe) -> ShardProbe | None:
        if self.previous is None:
            return None
        for q in self.previous.probes:
            if q.address == p.address and q.status and p.status and \
                    q.status["incarnation"] == p.status["incarnation"] and p.taken > q.taken:
                return q
        return None

    def shard_rows(self) -> list[dict]:
        rows = []
        for p in self.probes:
            row: dict[str, Any] = {"address": p.address, "health": p.health, "error": p.error}
            if p.status:
                s = p.status
                c = s["counters"]
                row.update({k: s[k] for k in ("shard", "num_shards", "policy", "version", "plan_hash", "bytes_held",
                                              "incarnation", "staleness_histogram", "counters")})
                written = c.get("checkpoint") or {}
                if written.get("written_at"):
                    row["checkpoint_version"] = written.get("version")
                    row["checkpoint_age_seconds"] = max(0.0, self.when - written["written_at"])
                row["staleness_p50"] = staleness_quantile(s["staleness_histogram"], 0.5)
                row["staleness_p99"] = staleness_quantile(s["staleness_histogram"], 0.99)
                q = self._earlier(p)
                if q:
                    dt = p.taken - q.taken
                    row["pushes_per_second"] = (c.get("pushes", 0) - q.status["counters"].get("pushes", 0)) / dt
                    row["versions_per_second"] = (s["version"] - q.status["version"]) / dt
            rows.append(row)
        return rows

    def worker_rows(self) -> list[dict]:
        merged: dict[int, dict] = {}
        for p in self.probes:
            if not p.status:
                continue
            for w in p.status["workers"]:
                m = merged.setdefault(w["worker_id"], {"worker_id": w["worker_id"], "states": {}, "clocks": {},
                                                       "lease_left_seconds": None, "hostname": "", "pid": 0})
                m["states"][p.status["shard"]] = w["state"]
                m["clocks"][p.status["shard"]] = w["clock"]
                if w["state"] == "live":
                    left = w["lease_left_seconds"]
                    m["lease_left_seconds"] = left if m["lease_left_seconds"] is None else \
                        min(left, m["lease_left_seconds"])
                if w["hostname"] or w["pid"]:
                    m["hostname"], m["pid"] = w["hostname"], w["pid"]
        before = {r["worker_id"]: r for r in self.previous.worker_rows()} if self.previous else {}
        dt = (self.when - self.previous.when) if self.previous else 0.0
        rows = []
        for wid in sorted(merged):
            m = merged[wid]
            states = set(m["states"].values())
            m["state"] = states.pop() if len(states) == 1 else \
                "/".join(f"{st}@{k}" for k, st in sorted(m["states"].items()))
            m["clock"] = max(m["clocks"].values())
            m["min_clock"] = min(m["clocks"].values())
            if wid in before and dt > 0:
                m["steps_per_second"] = (m["clock"] - before[wid]["clock"]) / dt
            rows.append(m)
        return rows

    def problems(self) -> list[str]:
        out = [f"shard at {p.address}: {p.error}" for p in self.probes if p.error]
        answered = [p.status for p in self.probes if p.status]
        if not answered:
            return out
        for key, what in (("plan_hash", "partition plans"), ("policy", "policies"), ("num_shards", "shard counts")):
            values = {s[key] for s in answered}
            if len(values) > 1:
                out.append(f"the shards disagree on their {what} ({', '.join(map(str, sorted(values)))}): they were "
                           "not all started from the same job file")
        seen: dict[int, list[str]] = {}
        for p in self.probes:
            if p.status:
                seen.setdefault(p.status["shard"], []).append(p.address)
        for k, where in sorted(seen.items()):
            if len(where) > 1:
                out.append(f"shard {k} answers at more than one address: {', '.join(where)}")
        total = max(s["num_shards"] for s in answered)
        missing = [k for k in range(total) if k not in seen]
        if len(missing) > len(self.probes) - len(answered):  # more than the addresses that failed (said above)
            out.append(f"shard(s) {', '.join(map(str, missing))} of {total} not among the addresses given")
        for w in self.worker_rows():
            if "expired" in w["state"]:
                out.append(f"worker {w['worker_id']} was dropped (lease or join deadline missed)"
                           + (f"; last seen on {w['hostname']} pid {w['pid']}" if w["hostname"] else ""))
        if self.previous:
            for p in self.probes:
                for q in self.previous.probes:
                    if q.address == p.address and p.status and q.status and \
                            p.status["incarnation"] != q.status["incarnation"]:
                        out.append(f"shard at {p.address} restarted since the last poll "
                                   f"(incarnation {q.status['incarnation']} -> {p.status['incarnation']})")
        return out

    def healthy(self) -> bool:
        return all(p.ok for p in self.probes)

    def to_json(self) -> dict:
        return {"time": round(self.when, 3), "shards": self.shard_rows(), "workers": self.worker_rows(),
                "problems": self.problems(), "healthy": self.healthy()}

    def render(self) -> str:
        shards, workers = self.shard_rows(), self.worker_rows()
        answered = [r for r in shards if "version" in r]
        policies = sorted({r["policy"] for r in answered})
        states: dict[str, int] = {}
        for w in workers:
            states[w["state"]] = states.get(w["state"], 0) + 1
        head = (f"psgd status at {time.strftime('%H:%M:%S', time.localtime(self.when))}: "
                f"{len(answered)} of {len(shards)} shard(s) answering"
                + (f", policy {'/'.join(policies)}" if policies else "")
                + (f"; {len(workers)} worker(s): " + ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
                   if workers else ""))
        rate = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        rows = []
        for r in shards:
            if "version" not in r:
                rows.append(["?", r["address"], r["health"], *["-"] * 9])
                continue
            c = r["counters"]
            dropped = sum(c.get(k, 0) for k in ("late", "duplicates", "rejected"))
            saved = "-" if "checkpoint_age_seconds" not in r else \
                f"v{r['checkpoint_version']}, {r['checkpoint_age_seconds']:.0f}s ago"
            rows.append([f"{r['shard']}/{r['num_shards']}", r["address"], r["health"], str(r["version"]),
                         human_bytes(r["bytes_held"]), str(c.get("pushes", 0)), str(c.get("pulls", 0)),
                         rate(r.get("pushes_per_second")), str(dropped),
                         f"{r['staleness_p50']}/{r['staleness_p99']}", saved, r["incarnation"]])
        lines = [head, "", table(["SHARD", "ADDRESS", "HEALTH", "VERSION", "HELD", "PUSHES", "PULLS", "PUSHES/S",
                                  "LATE/DUP/REJ", "STALENESS p50/p99", "CHECKPOINT", "INCARNATION"], rows)]
        if workers:
            wrows = []
            for w in workers:
                clock = str(w["clock"]) if w["clock"] == w["min_clock"] else f"{w['min_clock']}..{w['clock']}"
                lease = "-" if w["lease_left_seconds"] is None else f"{max(0.0, w['lease_left_seconds']):.1f}s"
                wrows.append([str(w["worker_id"]), w["state"], clock, rate(w.get("steps_per_second")), lease,
                              w["hostname"] or "-", str(w["pid"] or "-")])
            lines += ["", table(["WORKER", "STATE", "CLOCK", "STEPS/S", "LEASE LEFT", "HOST", "PID"], wrows)]
        problems = self.problems()
        if problems:
            lines += ["", "problems:"] + [f"  - {p}" for p in problems]
        return "\n".join(lines)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(headers), *(fmt(r) for r in rows)])


def collect(addresses: Sequence[str], connect: Connect, previous: ClusterView | None = None) -> ClusterView:
    return ClusterView(probe_all(addresses, connect), previous=previous)


# -- psgd status ---------------------------------------------------------------------------------
STATUS_DESCRIPTION = """\
Show a running cluster: every shard's health, version, policy, weights held,
push and pull counts, late/duplicate/rejected pushes and staleness (p50/p99
from the shard's histogram), and every worker's state, clock, throughput and
lease, merged over the shards. Rates (pushes/s, steps/s) come from two polls
--sample seconds apart, or from successive refreshes with --watch.

examples:
  psgd status 10.0.0.5:50051 10.0.0.6:50051
  psgd status -c job.toml --watch 2
  PSGD_TOKEN=... psgd status shard-0:50051 shard-1:50053 --json
"""


def add_status_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser("status", help="live view of a running cluster: shards, workers, clocks, staleness",
                            description=STATUS_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("addresses", nargs="*", metavar="ADDRESS",
                        help="shard addresses host:port (default: [cluster] servers of the job file -c)")
    parser.add_argument("--config", "-c", metavar="JOB.toml", help="take the addresses from this job file")
    parser.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                        help="refresh every SECONDS until interrupted (Ctrl-C)")
    parser.add_argument("--count", type=int, default=None, metavar="N", help="with --watch: stop after N refreshes")
    parser.add_argument("--sample", type=float, default=1.0, metavar="SECONDS",
                        help="without --watch: poll twice this far apart to measure rates (0: poll once; default 1)")
    parser.add_argument("--json", action="store_true", help="print each poll as one JSON object")
    add_connect_arguments(parser)
    parser.set_defaults(func=cmd_status)
    return parser


def status_addresses(args: argparse.Namespace) -> list[str]:
    from psgd.config import ConfigError, JobConfig

    job = JobConfig.load(args.config) if args.config else None
    addresses = list(args.addresses) or (list(job.cluster.servers) if job else [])
    if not addresses:
        raise ConfigError("psgd status needs shard addresses (host:port ...) or a job file (-c) that lists them")
    for a in addresses:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"{a!r} is not an address: expected host:port")
    return addresses


def cmd_status(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    addresses = status_addresses(args)
    connect = connect_from_args(args)
    if args.watch is None:
        view = collect(addresses, connect)
        if args.sample > 0:
            time.sleep(args.sample)  # the interval over which rates are measured
            view = collect(addresses, connect, previous=view)
        _show(view, args.json, out, clear=False)
        return 0 if view.healthy() else 1
    if args.watch <= 0:
        from psgd.config import ConfigError

        raise ConfigError("--watch needs a positive number of seconds")
    clear = hasattr(out, "isatty") and out.isatty() and not args.json
    view, shown = None, 0
    while True:
        view = collect(addresses, connect, previous=view)
        if view.previous is not None:
            view.previous.previous = None  # keep one poll of history
        _show(view, args.json, out, clear)
        shown += 1
        if args.count and shown >= args.count:
            return 0 if view.healthy() else 1
        time.sleep(args.watch)  # the refresh period the user asked for


def _show(view: ClusterView, as_json: bool, out, clear: bool) -> None:
    if as_json:
        out.write(json.dumps(view.to_json()) + "\n")
    else:
        if clear:
            out.write("\x1b[H\x1b[2J")
        out.write(view.render() + "\n" + ("" if clear else "\n"))
    out.flush()


# -- psgd doctor ---------------------------------------------------------------------------------
DOCTOR_DESCRIPTION = """\
Check that a job can run, before starting workers or while it runs: every
shard address in the job file resolves, its gRPC port and data port accept
connections, it answers the gRPC health check and Status as the shard the job
file says it is, with the same partition plan, policy and worker count; the
token is accepted; the TLS files exist and parse; the GPU asked for is
visible. Each finding is one line; the exit status is 1 when anything is
wrong, 0 otherwise.

--health [ADDRESS] only asks one shard's gRPC health service (default
$PSGD_HEALTH_ADDRESS, else 127.0.0.1:50051): exit 0 when it is SERVING. The
container images use it as their health check.

examples:
  psgd doctor -c job.toml
  PSGD_TOKEN=... psgd doctor -c job.toml --device cuda:0
  psgd doctor --health 127.0.0.1:50051
"""


def add_doctor_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from psgd.cli.common import add_job_arguments

    parser = sub.add_parser("doctor", help="preflight check of a job: addresses, ports, health, plan, token, "
                                           "TLS, GPU", description=DOCTOR_DESCRIPTION,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--health", nargs="?", const="", default=None, metavar="ADDRESS",
                        help=f"only check that ADDRESS (default ${HEALTH_ENV} or {DEFAULT_HEALTH_ADDRESS}) "
                             "answers SERVING; no job file needed")
    parser.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    add_connect_arguments(parser)
    add_job_arguments(parser, cluster=True)
    parser.set_defaults(func=cmd_doctor)
    return parser


@dataclasses.dataclass
class Finding:
    level: str     # ok, warn, FAIL
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
        from psgd.config import JobConfig
        from psgd.partition import PartitionPlan
        from psgd.job import build_job

        c = self.job.cluster
        try:
            local = JobConfig.from_dict(self.job.to_dict(), source=self.job.source)
            local.override("train.device", "cpu")  # the plan does not depend on the device
            plan = PartitionPlan(build_job(local).model.specs(), c.shards, c.slice_bytes)
        except Exception as exc:  # data not on this machine, a model module not importable here...
            self.add("warn", "job", f"cannot build the model here to compare partition plans ({exc}); the "
                     "shards are still compared with each other")
            return None
        self.add("ok", "job", f"{self.job.source}: {c.shards} shard(s), {c.workers} worker(s), policy {c.policy}, "
                 f"model {self.job.model['name']}: partition plan {plan.hash} ({len(plan.specs)} variables)")
        return plan.hash

    def check_servers(self, plan_hash: str | None) -> None:
        c = self.job.cluster
        if not c.servers:
            self.add("FAIL", "servers", "[cluster] servers is empty: list the shards' addresses (host:port), in "
                     "shard order, in the job file or with --servers")
            return
        dupes = sorted({a for a in c.servers if c.servers.count(a) > 1})
        if dupes:
            self.add("FAIL", "servers", f"listed more than once: {', '.join(dupes)}; every shard needs its own "
                     "address")
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(c.servers))) as pool:
            results = list(pool.map(lambda k: self.check_shard(k, c.servers[k], plan_hash), range(len(c.servers))))
        statuses = [s for _, s in results if s is not None]
        for found, _ in results:
            self.findings.extend(found)
        hashes = {s["plan_hash"] for s in statuses}
        if plan_hash is None and len(hashes) > 1:
            self.add("FAIL", "plan", f"the shards hold different partition plans ({', '.join(sorted(hashes))}): "
                     "they were not started from the same job file")
        self.check_token(statuses, len(c.servers))

    def check_shard(self, k: int, address: str, plan_hash: str | None) -> tuple[list[Finding], dict | None]:
        from psgd.config import ConfigError

        found: list[Finding] = []
        say = lambda level, message: found.append(Finding(level, f"shard {k} at {address}", message))  # noqa: E731
        c, timeout = self.job.cluster, self.connect.timeout
        host, _, port_text = address.rpartition(":")
        host = host.strip("[]")
        port = int(port_text)
        if host in ("0.0.0.0", "::", ""):
            say("FAIL", f"{host or '(empty)'} is a bind address, not one to connect to: list the shard's host name "
                "or IP in [cluster] servers (bind it with psgd-server --bind 0.0.0.0:PORT)")
            return found, None
        ips, error = resolve(host, port, timeout)
        if error:
            say("FAIL", error)
            return found, None
        loopback = all(ip.startswith("127.") or ip == "::1" for ip in ips)
        say("warn" if loopback else "ok", f"resolves to {', '.join(ips)}" +
            (" (loopback: only processes on this machine can reach it)" if loopback else ""))
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
        if c.data_path:
            data_port = (result.status or {}).get("data_port") or port + 1
            error = tcp_check(ips[0], data_port, timeout)
            if error:
                say("FAIL", f"data port {data_port}: {error}; workers send tensors there: open it (the default is "
                    "the gRPC port + 1; psgd-server --data-port moves it), or set [cluster] data_path = false")
            else:
                say("ok", f"data port {data_port} accepts connections")
        s = result.status
        if s is None:
            if result.health == "SERVING" or result.code == "UNAUTHENTICATED":
                say("FAIL", f"Status: {result.error}")
            return found, None
        wrong = []
        if s["shard"] != k:
            wrong.append(f"it is shard {s['shard']}, but the job file lists it as shard {k}: [cluster] servers must "
                         "be in shard order")
        if s["num_shards"] != c.shards:
            wrong.append(f"it belongs to a job of {s['num_shards']} shard(s), the job file has {c.shards}")
        if s["policy"] != c.policy:
            wrong.append(f"its policy is {s['policy']}, the job file's is {c.policy}")
        if len(s["workers"]) != c.workers:
            wrong.append(f"it expects {len(s['workers'])} worker(s), the job file has {c.workers}")
        if plan_hash is not None and s["plan_hash"] != plan_hash:
            wrong.append(f"its partition plan is {s['plan_hash']}, this job file makes {plan_hash}: it was started "
                         "from another model, dtype, shard count or slice size")
        for message in wrong:
            say("FAIL", message)
        if not wrong:
            say("ok", f"answers as shard {k} of {c.shards}, policy {s['policy']}, version {s['version']}, "
                f"{len(s['workers'])} worker(s)" + (", same partition plan" if plan_hash else ""))
        return found, s

    def check_token(self, statuses: list[dict], total: int) -> None:
        token = self.connect.token
        if token.startswith("replace-me"):
            self.add("warn", "token", "is the placeholder from deploy/psgd.env.example: generate a real one (python3 -c "
                     "\"import secrets; print(secrets.token_urlsafe(32))\")")
        if token and token != token.strip():
            self.add("warn", "token", "has leading or trailing whitespace (quotes or a trailing space in an env "
                     "file?); every process must use exactly the same token")
        refused = any(f.level == "FAIL" and "UNAUTHENTICATED" in f.message for f in self.findings)
        if refused:
            return  # already said, per shard
        if len(statuses) != total:
            return  # not every shard answered: nothing to say about the token
        if token:
            self.add("ok", "token", "accepted by every shard")
        else:
            self.add("warn", "token", f"none set ({TOKEN_ENV} or --token) and the shards accept calls without one: "
                     "anyone who can reach their ports can change the weights")

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
                problems.append(f"certificate {cn.tls_cert} and key {cn.tls_key} do not load together ({exc}): "
                                "not PEM, or the key does not belong to the certificate")
        for p in problems:
            self.add("FAIL", "TLS", p)
        if not problems:
            what = ["CA " + cn.tls_ca] if cn.tls_ca else []
            what += [f"certificate {cn.tls_cert} with its key"] if cn.tls_cert else []
            self.add("ok", "TLS", "files parse: " + ", ".join(what))

    def check_gpu(self) -> None:
        from psgd import xp as backend

        device = self.job.train.device
        if device.strip().lower() == "cpu":
            self.add("ok", "GPU", f"train.device is {device}: no GPU needed")
            return
        try:
            backend.get_device(device)  # parses cuda[:N] and checks CuPy, the driver and the index
        except backend.DeviceError as exc:
            self.add("FAIL", "GPU", f"train.device is {device}, but {exc}")
            return
        self.add("ok", "GPU", f"{device} is visible ({backend.cuda_device_count()} CUDA device(s) on this machine)")


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
        return [], (f"cannot resolve {host!r}: {exc.strerror}; check the name, /etc/hosts or the cluster's DNS "
                    "(in Kubernetes: the headless Service and the pod's subdomain)")
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
        return (f"nothing listens on {ip}:{port} (connection refused): is psgd-server running there, bound to an "
                "address others can reach (not 127.0.0.1)?")
    except socket.timeout:
        return f"no answer from {ip}:{port} within {timeout:g}s: a firewall may drop the packets, or the host is down"
    except OSError as exc:
        return f"cannot connect to {ip}:{port}: {exc.strerror or exc}"


def cmd_doctor(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    if args.health is not None:
        return health_check(args, out)
    from psgd.cli.common import job_from_args

    job = job_from_args(args)
    doctor = Doctor(job, connect_from_args(args))
    findings = doctor.run()
    failures, warnings = doctor.failures, [f for f in findings if f.level == "warn"]
    if args.json:
        out.write(json.dumps({"ok": not failures, "findings": [dataclasses.asdict(f) for f in findings]}) + "\n")
    else:
        out.write(f"psgd doctor: {job.source}\n" + "\n".join(f.line() for f in findings) + "\n")
        if failures:
            out.write(f"{len(failures)} problem(s) found" + (f", {len(warnings)} warning(s)" if warnings else "")
                      + ": fix the FAIL lines above.\n")
        else:
            out.write("everything checked is in order" + (f" ({len(warnings)} warning(s))" if warnings else "")
                      + ".\n")
    out.flush()
    return 1 if failures else 0


def health_check(args: argparse.Namespace, out) -> int:
    address = args.health or os.environ.get(HEALTH_ENV) or DEFAULT_HEALTH_ADDRESS
    health, error, _ = check_health(address, connect_from_args(args))
    out.write(f"{address}: {health}" + (f": {error}" if error else "") + "\n")
    out.flush()
    return 0 if health == "SERVING" else 1

