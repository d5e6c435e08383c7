"""Emulated hosts on one machine: network namespaces on a bridge, each host's link shaped to a rate.

Each host is a network namespace holding one end of a veth pair (``eth0``,
with the host's address); the other end (``vI``) is on a bridge in a hub
namespace.  A shaped host's link is limited in both directions by a token
bucket (``tc qdisc ... tbf``): on ``eth0`` for what the host sends and on
its bridge port for what it receives, so every host has a link of its own
of that rate, as on a switch.  ``netem`` is not needed (nor available on
every kernel): there is no added latency.

Nothing on the machine's own interfaces, addresses or routes is touched,
and no traffic leaves the namespaces.  Names carry the creating process's
id: :func:`remove_stale` deletes those of processes that no longer run (a
lab killed with SIGKILL), and :meth:`Namespaces.close` removes a run's own.

The chaos suite cuts links with it (``netcut``), the multi-host test trains
across it, and the benchmarks' ``--network`` runs on shaped links.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping

from psgd.errors import ClusterError

IP = shutil.which("ip") or "/usr/sbin/ip"
TC = shutil.which("tc") or "/usr/sbin/tc"
#: Every namespace made here is named ``psgdnet<pid>x<tag>-<host>``.
PREFIX = "psgdnet"
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(k|m|g)?bit\s*$", re.IGNORECASE)
_SCALE = {None: 1, "k": 10**3, "m": 10**6, "g": 10**9}


class NetworkError(ClusterError):
    """Namespaces or shaping cannot be set up here, or a rate cannot be read."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetworkError(f"{' '.join(argv)} failed: {done.stderr.strip() or done.returncode}")
    return done


def parse_rate(text: str) -> int | None:
    """Bits per second of a rate such as ``1gbit``, ``10gbit``, ``100mbit`` (``none``: not shaped)."""
    if text.strip().lower() in ("none", "", "unshaped"):
        return None
    match = _RATE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise NetworkError(f"network rate {text!r}: write it as tc does, e.g. 1gbit, 10gbit, 100mbit, or none")
    return int(float(match.group(1)) * _SCALE[(match.group(2) or "").lower() or None])


def burst_bytes(bits_per_second: int) -> int:
    """The token bucket of a link shaped to ``bits_per_second`` (:meth:`Namespaces.shape`): 4 ms of traffic at the
    rate, at least 256 KiB."""
    return max(256 << 10, bits_per_second // 8 // 250)


def describe_rate(bits: int | None) -> str:
    """``1 Gbit/s``, ``100 Mbit/s``; ``unshaped`` for None."""
    if bits is None:
        return "unshaped"
    for unit, scale in (("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits} bit/s"


def unavailable(shaping: bool = False) -> str | None:
    """Why namespaces (and, with ``shaping``, token-bucket shaping) cannot be used here; None: they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if not os.path.exists(IP):
        return "iproute2's ip is not installed"
    if shaping and not os.path.exists(TC):
        return "shaping links needs tc (iproute2), which is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (or CAP_SYS_ADMIN)"
    probe = Namespaces({"a": "10.99.250.1"}, tag="probe")
    try:
        probe.build()
        if shaping:
            probe.shape("a", 10**9)
        return None
    except (NetworkError, OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        probe.close()


def check_networks(names: list[str]) -> None:
    """Refuse (:class:`NetworkError`) a ``--network`` list with a rate tc would not take or named twice, and
    one this machine cannot emulate; loopback (no emulated hosts) is left to the caller."""
    if len(set(names)) != len(names):
        raise NetworkError(f"--network lists a rate twice: {','.join(names)}")
    rates = [parse_rate(n) for n in names]
    why = unavailable(shaping=any(r is not None for r in rates)) if rates else None
    if why:
        raise NetworkError(f"--network needs emulated hosts, which cannot be made here: {why}")


def remove_stale() -> list[str]:
    """Delete the namespaces made here by processes that are gone; returns their names."""
    listed = _run(IP, "netns", "list", check=False).stdout.split()
    gone = []
    for name in listed:
        match = re.match(rf"^{PREFIX}(\d+)x", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            if _run(IP, "netns", "del", name, check=False).returncode == 0:
                gone.append(name)
    return gone


class Namespaces:
    """The hosts of one run (name -> address, all in one /24) on a bridge; a context manager that
    removes everything it made."""

    def __init__(self, hosts: Mapping[str, str], tag: str | None = None):
        self.hosts = dict(hosts)
        self.tag = f"{PREFIX}{os.getpid()}x{tag or os.urandom(2).hex()}"
        self.made: list[str] = []
        self.ports: dict[str, str] = {}  # host -> its veth end on the bridge
        self.rates: dict[str, int] = {}  # host -> bits/s of its shaped link

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def _add(self, host: str) -> str:
        name = self.ns(host)
        _run(IP, "netns", "add", name)
        self.made.append(name)
        return name

    def build(self) -> Namespaces:
        hub = self._add("hub")
        _run(IP, "-n", hub, "link", "add", "br0", "type", "bridge")
        _run(IP, "-n", hub, "link", "set", "br0", "up")
        for i, (host, address) in enumerate(self.hosts.items()):
            ns = self._add(host)
            self.ports[host] = f"v{i}"
            _run(IP, "-n", hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run(IP, "-n", hub, "link", "set", f"v{i}", "master", "br0")
            _run(IP, "-n", hub, "link", "set", f"v{i}", "up")
            _run(IP, "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _run(IP, "-n", ns, "link", "set", "eth0", "up")
            _run(IP, "-n", ns, "link", "set", "lo", "up")
        return self

    def prefix(self, host: str) -> list[str]:
        """The argv prefix that runs a command on ``host``."""
        return [IP, "netns", "exec", self.ns(host)]

    def link(self, host: str, up: bool) -> None:
        """Plug or unplug ``host``'s cable (its bridge port)."""
        _run(IP, "-n", self.ns("hub"), "link", "set", self.ports[host], "up" if up else "down")

    def shape(self, host: str, bits_per_second: int) -> None:
        """Limit ``host``'s link to ``bits_per_second`` in each direction (a token bucket each way).

        The bucket holds at least 256 KiB: veth hands over segments of up to
        64 KiB at once (segmentation offload), and a bucket smaller than a
        segment would drop it whole.  Queued packets wait at most 100 ms.
        """
        spec = [
            "root",
            "tbf",
            "rate",
            f"{bits_per_second}bit",
            "burst",
            str(burst_bytes(bits_per_second)),
            "latency",
            "100ms",
        ]
        _run(IP, "netns", "exec", self.ns(host), TC, "qdisc", "replace", "dev", "eth0", *spec)
        _run(IP, "netns", "exec", self.ns("hub"), TC, "qdisc", "replace", "dev", self.ports[host], *spec)
        self.rates[host] = bits_per_second

    def qdiscs(self) -> list[str]:
        """The token buckets in place, one line each (what :meth:`close` removes with the namespaces)."""
        lines = []
        for host in self.rates:
            for ns, dev in ((self.ns(host), "eth0"), (self.ns("hub"), self.ports[host])):
                shown = _run(IP, "netns", "exec", ns, TC, "qdisc", "show", "dev", dev, check=False).stdout
                lines += [f"{ns} {dev}: {line}" for line in shown.splitlines() if "tbf" in line]
        return lines

    def measure(self, sender: str, receiver: str, nbytes: int = 64 << 20, port: int = 5999) -> float:
        """Bytes per second that ``sender`` moves to ``receiver`` over one TCP connection (``nbytes``
        after a warm-up of an eighth of that): the link's real throughput, shaping included."""
        address = self.hosts[receiver]
        server = subprocess.Popen(
            [*self.prefix(receiver), sys.executable, "-c", _SINK, address, str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            ready = server.stdout.readline().strip()
            if ready != "ready":
                raise NetworkError(f"the throughput sink on {receiver} did not start: {server.stderr.read()[-300:]}")
            sent = subprocess.run(
                [*self.prefix(sender), sys.executable, "-c", _SOURCE, address, str(port), str(nbytes)],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if sent.returncode != 0:
                raise NetworkError(f"measuring {sender} -> {receiver} failed: {sent.stderr.strip()[-300:]}")
            return float(sent.stdout.split()[-1])
        finally:
            if server.poll() is None:
                server.kill()
            server.wait(10)
            for stream in (server.stdout, server.stderr):
                stream.close()

    def close(self) -> list[str]:
        """Remove every namespace made (their links and qdiscs go with them); returns those that could not
        be removed."""
        left = []
        for name in reversed(self.made):
            if _run(IP, "netns", "del", name, check=False).returncode != 0:
                left.append(name)
        self.made = left
        return left

    def __enter__(self) -> Namespaces:
        try:
            return self.build()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()


# The two ends of a throughput measurement, run in the namespaces as `python -c`.
_SINK = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
srv.settimeout(120)
conn, _ = srv.accept()
conn.settimeout(120)
buf = bytearray(1 << 20)
while conn.recv_into(buf):
    pass
conn.sendall(b"k")
"""

_SOURCE = """
import socket, sys, time
address, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
conn = socket.create_connection((address, port), timeout=120)
block = memoryview(bytearray(1 << 20))
def send(n):
    while n > 0:
        k = min(n, len(block))
        conn.sendall(block[:k])
        n -= k
send(nbytes // 8)  # warm-up: the bucket's burst and TCP's slow start are not the link's rate
began = time.perf_counter()
send(nbytes)
conn.shutdown(socket.SHUT_WR)
conn.recv(1)  # the sink has read everything
print(nbytes / (time.perf_counter() - began))
"""
