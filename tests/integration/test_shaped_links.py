"""Emulated links (psgd.bench.netns): rates as tc writes them, a shaped link that really runs at its rate,
and nothing left behind, even when the work on the network fails or its process is killed.

Namespaces are made by the tests themselves, named after this process; where they cannot be made (not
root, no ip or tc), the tests that need them are skipped with the reason (failed under PSGD_REQUIRE_NET=1).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import skip_or_fail

from psgd.bench import netns
from psgd.errors import install_extra

HOSTS = {"a": "10.99.5.1", "b": "10.99.5.2"}


def listed() -> str:
    return subprocess.run([netns.IP, "netns", "list"], capture_output=True, text=True, timeout=20).stdout


def needs_mpi() -> None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        skip_or_fail(f"the mpi extra is not installed ({install_extra('mpi')})")


@pytest.fixture(scope="module")
def shaping():
    why = netns.unavailable(shaping=True)
    if why:
        skip_or_fail(f"cannot shape links here: {why}")


@pytest.mark.parametrize(
    "text, bits",
    [
        ("1gbit", 10**9),
        ("10gbit", 10**10),
        ("100mbit", 10**8),
        ("2.5Gbit", 25 * 10**8),
        ("512kbit", 512_000),
        ("none", None),
        ("", None),
    ],
)
def test_rates_are_read_as_tc_writes_them(text, bits):
    assert netns.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["1gb", "fast", "-1gbit", "0gbit", "1 gbps", "1e9"])
def test_a_rate_tc_would_not_take_is_refused_with_an_example(text):
    with pytest.raises(netns.NetworkError, match="e.g. 1gbit, 10gbit, 100mbit, or none"):
        netns.parse_rate(text)


def test_rates_are_described_in_words():
    assert [netns.describe_rate(r) for r in (10**9, 10**10, 10**8, 25 * 10**8, None)] == [
        "1 Gbit/s",
        "10 Gbit/s",
        "100 Mbit/s",
        "2.5 Gbit/s",
        "unshaped",
    ]


def test_a_shaped_link_runs_at_its_rate_and_an_unshaped_one_faster(shaping):
    rate = 200 * 10**6
    with netns.Namespaces(HOSTS) as net:
        free = net.measure("a", "b", nbytes=16 << 20)
        net.shape("a", rate)
        net.shape("b", rate)
        assert len(net.qdiscs()) == 4  # each host's two directions
        shaped = net.measure("a", "b", nbytes=16 << 20)
        back = net.measure("b", "a", nbytes=16 << 20)
        tag = net.tag
    assert tag not in listed()
    for got in (shaped, back):
        assert 0.8 * rate / 8 <= got <= 1.02 * rate / 8, (got * 8, rate)  # TCP/IP headers take ~5%
    assert free > 2 * shaped


def test_nothing_is_left_behind_when_the_work_fails(shaping):
    with pytest.raises(RuntimeError, match="the work failed"):
        with netns.Namespaces(HOSTS) as net:
            net.shape("a", 10**9)
            tag = net.tag
            assert tag in listed()
            raise RuntimeError("the work failed")
    assert tag not in listed()


def test_the_namespaces_of_a_killed_process_are_removed_at_the_next_start(shaping):
    script = (
        "import sys, os; from psgd.bench import netns; net = netns.Namespaces({'a': '10.99.6.1'}).build(); "
        "net.shape('a', 10**9); print(net.tag, flush=True); os.kill(os.getpid(), 9)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr
    tag = done.stdout.split()[0]
    assert tag.startswith(netns.PREFIX) and tag in listed()
    removed = netns.remove_stale()
    assert {f"{tag}-hub", f"{tag}-a"} <= set(removed) and tag not in listed()
    assert not [n for n in removed if n.startswith(f"{netns.PREFIX}{os.getpid()}x")]  # never a live process's


# -- the convergence lab on emulated links ---------------------------------------------------------------


def quick_lab(**changes):
    from psgd.bench.lab import preset

    config = preset("quick")
    config.job += ["cluster.workers=1", "cluster.shards=1"]
    config.policies, config.delays, config.networks = ["sync"], ["none"], ["200mbit"]
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def ours() -> list[str]:
    return [n for n in listed().split() if n.startswith(f"{netns.PREFIX}{os.getpid()}x")]


def test_a_quick_lab_runs_on_two_hosts_over_one_shaped_link_and_leaves_nothing(shaping, tmp_path):
    from psgd.bench.convergence import run_lab

    result = run_lab(quick_lab(), tmp_path / "lab", progress=False)
    (run,) = result.runs
    assert run.error is None and run.network == "200mbit" and run.scenario == "200mbit-no-straggler", run.error
    assert run.summary["time_to_target"] is not None and run.summary["bytes"] > 0
    measured = result.links["200mbit"]["measured_bytes_per_s"]
    assert set(measured) == {"w0 -> s0", "s0 -> w0"}
    assert all(0.8 * 200e6 / 8 <= v <= 1.02 * 200e6 / 8 for v in measured.values()), measured
    table = (tmp_path / "lab" / "table.md").read_text()
    assert "| 200mbit-no-straggler | sync | 1/1 |" in table and "Emulated links" in table
    assert (tmp_path / "lab" / "accuracy-200mbit-no-straggler.png").exists()
    assert not ours()


@pytest.mark.slow
def test_a_lab_stopped_in_the_middle_leaves_no_namespace_behind(shaping, tmp_path, monkeypatch):
    from psgd.bench import hosted
    from psgd.bench.convergence import run_lab

    seen = []

    def interrupted(network, *args, **kwargs):
        seen.append(ours())
        raise KeyboardInterrupt

    monkeypatch.setattr(hosted, "run_on", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_lab(quick_lab(), tmp_path / "lab", progress=False)
    assert seen and len(seen[0]) == 4  # hub, ctl, s0, w0 were there during the run
    assert not ours()


def test_a_network_the_lab_cannot_read_is_refused_before_anything_runs():
    from psgd.config import ConfigError

    with pytest.raises(ConfigError, match="1gb.*e.g. 1gbit"):
        quick_lab(networks=["1gb"]).check()
    with pytest.raises(ConfigError, match="twice"):
        quick_lab(networks=["1gbit", "1gbit"]).check()


def test_without_root_or_tc_the_network_option_says_so(monkeypatch):
    from psgd.config import ConfigError

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match="--network needs emulated hosts.*need root"):
        quick_lab().check()
    monkeypatch.setattr(netns, "TC", "/nonexistent/tc")
    with pytest.raises(ConfigError, match="needs tc"):
        quick_lab().check()


def test_all_reduce_ranks_on_emulated_hosts_talk_over_their_links(shaping, tmp_path):
    """Ranks of one machine would otherwise use its shared memory: on emulated hosts the launcher makes MPI
    use TCP on each host's link, so the bytes of every step cross it."""
    import json

    hosts = {"ctl": "10.99.5.2", "w0": "10.99.5.10", "w1": "10.99.5.11"}
    script = (
        "import json, sys; from psgd.config import JobConfig; from psgd.launcher import Hosts, launch; "
        "spec = json.loads(sys.argv[1]); "
        "job = JobConfig().apply_sets(['cluster.workers=2', 'train.epochs=1', 'model.hidden=[256]']); "
        "r = launch(job, mode='allreduce', hosts=Hosts({h: tuple(p) for h, p in spec['prefixes'].items()}, "
        "spec['addresses']), run_dir=sys.argv[2], progress=False); print(json.dumps([r.test_accuracy]))"
    )
    with netns.Namespaces(hosts) as net:
        spec = {"prefixes": {h: net.prefix(h) for h in hosts}, "addresses": hosts}
        done = subprocess.run(
            [*net.prefix("ctl"), sys.executable, "-c", script, json.dumps(spec), str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        stats = json.loads(
            subprocess.run(
                [netns.IP, "-n", net.ns("w1"), "-s", "-j", "link", "show", "eth0"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout
        )
    accuracy = json.loads(done.stdout.splitlines()[-1])[0]
    assert accuracy > 0.8
    steps = sum(1 for line in (tmp_path / "allreduce.jsonl").read_text().splitlines() if '"step"' in line)
    model_bytes = (64 * 256 + 256 + 256 * 10 + 10) * 4
    # a 2-rank ring moves half the model each way per step: rank 1 receives at least that much
    assert stats[0]["stats64"]["rx"]["bytes"] >= steps * model_bytes / 2, (stats, steps)


@pytest.mark.slow
def test_loopback_runs_beside_a_shaped_network_in_one_lab(shaping, tmp_path):
    from psgd.bench.convergence import run_lab

    result = run_lab(quick_lab(networks=["200mbit", "loopback"]), tmp_path / "lab", progress=False)
    assert [(r.network, r.scenario, r.error) for r in result.runs] == [
        ("200mbit", "200mbit-no-straggler", None),
        ("loopback", "loopback-no-straggler", None),
    ]
    assert list(result.links) == ["200mbit"]  # loopback is this machine's own: nothing to measure
    summary = (tmp_path / "lab" / "summary.md").read_text()
    assert "**200 Mbit/s links, no straggler**" in summary and "**loopback, no straggler**" in summary
    assert not ours()


@pytest.mark.slow
def test_comm_on_a_shaped_link_sets_each_step_beside_the_link_bound(shaping, tmp_path):
    """psgd bench comm --network: a worker and a shard on hosts of their own, float32 and bf16 pushes,
    each step set beside what the measured link takes for its bytes; nothing left behind."""
    import json

    out = tmp_path / "comm.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "psgd.cli.main",
            "bench",
            "comm",
            "--network",
            "1gbit",
            "--sizes-mb",
            "2",
            "--steps",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "1gbit links: measured" in done.stdout and "link-bound ms" in done.stdout
    rows = json.loads(out.read_text())["links"]
    assert [(r["network"], r["wire_dtype"]) for r in rows] == [("1gbit", "float32"), ("1gbit", "bfloat16")]
    rate = min(rows[0]["link"]["measured_bytes_per_s"].values())
    for row in rows:
        fraction = 1.0 if row["wire_dtype"] == "float32" else 0.5
        assert row["link_bound_s"] == pytest.approx(2_000_000 * (1 + fraction) / rate)
        assert 0 < row["pull_s"] and 0 < row["push_s"] and row["step_s"] >= max(row["pull_s"], row["push_s"])
        assert row["step_over_bound"] == pytest.approx(row["step_s"] / row["link_bound_s"])
    assert netns.PREFIX not in listed()


@pytest.mark.slow
def test_allreduce_against_the_parameter_server_on_a_shaped_link(shaping, tmp_path):
    """benchmarks/allreduce.py --network: 2 MPI ranks against 2 workers on 2 shards, every process on a host
    of its own, each figure beside its link bound (a 2-rank ring: the buffer once over each link)."""
    import json

    needs_mpi()
    out = tmp_path / "allreduce.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "psgd.bench.allreduce",
            "--network",
            "1gbit",
            "--sizes-mb",
            "2",
            "--ranks",
            "2",
            "--repeats",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    rate = min(row["link"]["measured_bytes_per_s"].values())
    assert row["ring_bound_s"] == pytest.approx(2_000_000 / rate)
    assert row["ps_bound_s"] == pytest.approx(2 * 2_000_000 / rate)
    assert row["ps_bf16_bound_s"] == pytest.approx(1.5 * 2_000_000 / rate)
    for key in ("allreduce_s", "ps_step_s", "ps_bf16_step_s"):
        assert row[key] > 0
    assert row["ps_over_allreduce"] == pytest.approx(row["ps_step_s"] / row["allreduce_s"])
    assert netns.PREFIX not in listed()


def test_the_benchmarks_refuse_a_network_they_cannot_emulate(monkeypatch):
    from psgd.bench import shaped

    with pytest.raises(netns.NetworkError, match="twice"):
        shaped.networks_from("1gbit,1gbit")
    with pytest.raises(netns.NetworkError, match="e.g. 1gbit"):
        shaped.networks_from("1gb")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(netns.NetworkError, match="--network needs emulated hosts.*need root"):
        shaped.networks_from("1gbit")


@pytest.mark.slow
def test_scaling_runs_its_launches_on_a_shaped_link(shaping, tmp_path):
    """psgd bench scaling --network: each launch's shard, workers and ranks on hosts of their own (its
    record says so), the one-process run on this machine, the link measured first and named in the notes."""
    import json

    needs_mpi()
    out = tmp_path / "scaling.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "psgd.cli.main",
            "bench",
            "scaling",
            "--network",
            "1gbit",
            "--widths",
            "64",
            "--workers",
            "2",
            "--configs",
            "single,sync,allreduce",
            "--epochs",
            "1",
            "--repeats",
            "1",
            "--out",
            str(tmp_path / "out"),
            "--json",
            str(out),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["network"]["rate_bits_per_s"] == 10**9 and min(result["network"]["measured_bytes_per_s"].values()) > 0
    by_kind = {r["kind"]: r for r in result["runs"]}
    assert set(by_kind) == {"single", "sync", "allreduce"} and not any(r.get("error") for r in result["runs"])
    assert "network" not in by_kind["single"]
    assert by_kind["sync"]["network"] == by_kind["allreduce"]["network"] == "1gbit"
    assert all(r["steps_per_s"] > 0 for r in result["runs"])
    assert "emulated links of 1 Gbit/s" in (tmp_path / "out" / "table.md").read_text()
    assert netns.PREFIX not in listed()


def test_an_emulated_hosts_file_psgd_launch_cannot_read_is_a_clear_error(tmp_path):
    from psgd.launcher import Hosts
    from psgd.launcher.supervise import LaunchError

    with pytest.raises(LaunchError, match="--emulated-hosts .*missing.json"):
        Hosts.load(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"prefixes": {}}')
    with pytest.raises(LaunchError, match="needs 'prefixes' and 'addresses'"):
        Hosts.load(str(bad))
    good = tmp_path / "good.json"
    good.write_text('{"prefixes": {"s0": ["ip", "netns", "exec", "x"]}, "addresses": {"s0": "10.0.0.1"}}')
    assert Hosts.load(str(good)).prefix("s0") == ["ip", "netns", "exec", "x"]
    done = subprocess.run(
        [sys.executable, "-m", "psgd.cli.main", "launch", "--emulated-hosts", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "'addresses' is missing" in done.stderr, done.stderr[-1000:]
