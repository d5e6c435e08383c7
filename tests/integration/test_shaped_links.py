"""Emulated links (psgd.bench.netns): rates as tc writes them, a shaped link that really runs at its rate,
and nothing left behind, even when the work on the network fails or its process is killed.

Namespaces are made by the tests themselves, named after this process; where they cannot be made (not
root, no ip or tc), the tests that need them are skipped with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from psgd.bench import netns

HOSTS = {"a": "10.99.5.1", "b": "10.99.5.2"}


def listed() -> str:
    return subprocess.run([netns.IP, "netns", "list"], capture_output=True, text=True, timeout=20).stdout


@pytest.fixture(scope="module")
def shaping():
    why = netns.unavailable(shaping=True)
    if why:
        pytest.skip(f"cannot shape links here: {why}")


@pytest.mark.parametrize("text, bits", [("1gbit", 10**9), ("10gbit", 10**10), ("100mbit", 10**8), ("2.5Gbit", 25 * 10**8),
                                        ("512kbit", 512_000), ("none", None), ("", None)])
def test_rates_are_read_as_tc_writes_them(text, bits):
    assert netns.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["1gb", "fast", "-1gbit", "0gbit", "1 gbps", "1e9"])
def test_a_rate_tc_would_not_take_is_refused_with_an_example(text):
    with pytest.raises(netns.NetworkError, match="e.g. 1gbit, 10gbit, 100mbit, or none"):
        netns.parse_rate(text)


def test_rates_are_described_in_words():
    assert [netns.describe_rate(r) for r in (10**9, 10**10, 10**8, 25 * 10**8, None)] == \
        ["1 Gbit/s", "10 Gbit/s", "100 Mbit/s", "2.5 Gbit/s", "unshaped"]


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
    script = ("import sys, os; from psgd.bench import netns; net = netns.Namespaces({'a': '10.99.6.1'}).build(); "
              "net.shape('a', 10**9); print(net.tag, flush=True); os.kill(os.getpid(), 9)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr
    tag = done.stdout.split()[0]
    assert tag.startswith(netns.PREFIX) and tag in listed()
    removed = netns.remove_stale()
    assert {f"{tag}-hub", f"{tag}-a"} <= set(removed) and tag not in listed()
    assert not [n for n in removed if n.startswith(f"{netns.PREFIX}{os.getpid()}x")]  # never a live process's
