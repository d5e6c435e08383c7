"""Network namespaces for the ``netcut`` fault: whether they can be made here, and :class:`Namespaces`, the
hosts of one run on a bridge whose links can be cut."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Mapping

from psgd.bench.chaos.settings import IP


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([IP, *args], capture_output=True, text=True, timeout=20, check=check)


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if not os.path.exists(IP):
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (or CAP_SYS_ADMIN)"
    name = f"psgdchaos{os.getpid()}probe"
    try:
        made = _ip("netns", "add", name, check=False)
        if made.returncode != 0:
            return f"ip netns add failed: {made.stderr.strip() or made.returncode}"
        ran = subprocess.run([IP, "netns", "exec", name, "true"], capture_output=True, text=True, timeout=20)
        if ran.returncode != 0:
            return f"ip netns exec failed: {ran.stderr.strip() or ran.returncode}"
        for args in (("link", "add", "br0", "type", "bridge"),
                     ("link", "add", "va", "type", "veth", "peer", "name", "vb")):
            made = _ip("-n", name, *args, check=False)
            if made.returncode != 0:  # e.g. a kernel without bridge or veth support
                return f"ip {' '.join(args)} failed: {made.stderr.strip() or made.returncode}"
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"ip netns: {exc}"
    finally:
        _ip("netns", "del", name, check=False)


class Namespaces:
    """Hosts in network namespaces made for one run: a hub namespace holds a bridge, and each host has one end
    of a veth pair (``eth0``, 10.99.1.x) whose other end (``vI`` in the hub) is on the bridge.  Nothing on
    the machine's own interfaces is touched; :meth:`close` removes every namespace made."""

    def __init__(self, hosts: Mapping[str, str]):
        self.hosts = dict(hosts)  # name -> address
        self.tag = f"psgdchaos{os.getpid()}x{os.urandom(2).hex()}"
        self.made: list[str] = []
        self.ports: dict[str, str] = {}  # host -> its veth end on the bridge

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def _add(self, host: str) -> str:
        name = self.ns(host)
        _ip("netns", "add", name)
        self.made.append(name)
        return name

    def build(self) -> "Namespaces":
        hub = self._add("hub")
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, (host, address) in enumerate(self.hosts.items()):
            ns = self._add(host)
            self.ports[host] = f"v{i}"
            _ip("-n", hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", hub, "link", "set", f"v{i}", "master", "br0")
            _ip("-n", hub, "link", "set", f"v{i}", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def prefix(self, host: str) -> list[str]:
        return [IP, "netns", "exec", self.ns(host)]

    def link(self, host: str, up: bool) -> None:
        _ip("-n", self.ns("hub"), "link", "set", self.ports[host], "up" if up else "down")

    def close(self) -> list[str]:
        """Remove every namespace made; returns those that could not be removed."""
        left = []
        for name in reversed(self.made):
            if _ip("netns", "del", name, check=False).returncode != 0:
                left.append(name)
        self.made = left
        return left

