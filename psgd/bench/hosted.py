"""Lab runs on emulated links: each shard and worker on a host of its own, its link shaped to a rate.

:class:`Network` makes the hosts of one lab network (:mod:`psgd.bench.netns`:
shards ``s<k>``, workers ``w<r>`` and ``ctl``, all on one bridge), shapes
every shard's and worker's link to the rate, and measures what a link really
carries, worker 0 to shard 0 and back, before any run.  ``ctl`` is not
shaped: it is where a run's launcher and its observer live, so watching the
shards costs the shards' links what it would cost on a real network.

:func:`run_on` runs one (scenario, contender) of the lab on such a network:
:mod:`psgd.bench.hosted_run` is started on ``ctl`` (``python -m
psgd.bench.hosted_run SPEC OUT``) and runs :func:`psgd.bench.convergence.run_one`
there with the shards and workers on their hosts; the run's result comes back
as JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from psgd.bench import netns
from psgd.bench.labresult import RunResult

SUBNET = "10.99.2"
#: A measured link is trusted within this fraction of its rate (TCP/IP headers take about 5%).
RATE_TOLERANCE = 0.15


def host_addresses(shards: int, workers: int) -> dict[str, str]:
    """Every host of a lab network and its address."""
    if shards > 40 or workers > 150:
        raise netns.NetworkError(f"emulated links take at most 40 shards and 150 workers, not {shards} and {workers}")
    hosts = {"ctl": f"{SUBNET}.2"}
    hosts.update({f"s{k}": f"{SUBNET}.{10 + k}" for k in range(shards)})
    hosts.update({f"w{r}": f"{SUBNET}.{100 + r}" for r in range(workers)})
    return hosts


class Network:
    """The hosts of one lab network, ``rate`` bits/s per shard and worker link (None: unshaped veth)."""

    def __init__(self, name: str, shards: int, workers: int):
        self.name, self.rate = name, netns.parse_rate(name)
        self.net = netns.Namespaces(host_addresses(shards, workers))
        self.measured: dict[str, float] = {}

    def __enter__(self) -> Network:
        netns.remove_stale()
        self.net.__enter__()
        try:
            if self.rate is not None:
                for host in self.net.hosts:
                    if host != "ctl":
                        self.net.shape(host, self.rate)
            size = max(32 << 20, (self.rate or 10**10) // 8 // 2)  # half a second at the rate
            self.measured = {
                "w0 -> s0": self.net.measure("w0", "s0", size),
                "s0 -> w0": self.net.measure("s0", "w0", size),
            }
            for way, got in self.measured.items():
                if self.rate is not None and abs(got * 8 / self.rate - 1) > RATE_TOLERANCE:
                    raise netns.NetworkError(
                        f"the {self.name} link measured {got * 8 / 1e9:.3f} Gbit/s {way}, "
                        f"not within {RATE_TOLERANCE:.0%} of its rate: the machine cannot "
                        "emulate it (too busy, or the rate is above what veth carries here)"
                    )
        except BaseException:
            self.net.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        left = self.net.close()
        if left:
            raise netns.NetworkError(f"could not remove the namespaces {', '.join(left)}")

    def record(self) -> dict:
        """What the lab keeps of this network: its rate and what its links measured (bytes/s)."""
        return {
            "rate_bits_per_s": self.rate,
            "described": netns.describe_rate(self.rate),
            "measured_bytes_per_s": {k: round(v) for k, v in self.measured.items()},
            "measured_gbit_per_s": {k: round(v * 8 / 1e9, 3) for k, v in self.measured.items()},
        }

    def hosts_spec(self) -> dict:
        return {"prefixes": {h: self.net.prefix(h) for h in self.net.hosts}, "addresses": dict(self.net.hosts)}


def run_on(network: Network, config, scenario, contender, run_dir: Path, timeout: float):
    """Run one (scenario, contender) of the lab ``config`` with its launcher on ``ctl``; a RunResult."""
    run_dir.mkdir(parents=True, exist_ok=True)
    spec, out = run_dir / "hosted-spec.json", run_dir / "hosted-result.json"
    spec.write_text(
        json.dumps(
            {
                "config": config.to_dict(),
                "delay": scenario.delay,
                "contender": contender.spec,
                "run_dir": str(run_dir / "run"),
                "hosts": network.hosts_spec(),
            }
        )
    )
    out.unlink(missing_ok=True)
    done = subprocess.run(
        [*network.net.prefix("ctl"), sys.executable, "-m", "psgd.bench.hosted_run", str(spec), str(out)],
        capture_output=True,
        text=True,
        timeout=timeout + 120,
    )
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"the run on {network.name} links failed (exit {done.returncode}): {done.stderr.strip()[-600:]}"
        )
    return RunResult(**json.loads(out.read_text()))


def launch_argv(network: Network, folder: Path, argv: list[str]) -> list[str]:
    """The command that runs ``psgd <argv>`` (a ``launch``) on ``ctl`` with its shards, workers and ranks on
    ``network``'s hosts (``--emulated-hosts``), as ``psgd bench scaling --network`` starts its runs."""
    spec = folder / "hosts.json"
    folder.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps(network.hosts_spec()))
    return [*network.net.prefix("ctl"), sys.executable, "-m", "psgd.cli.main", *argv, "--emulated-hosts", str(spec)]
