"""How many connections a shard's gRPC port takes, from the descriptors its process may open."""

from __future__ import annotations

import resource

import pytest

from psgd.server.net import listen


@pytest.fixture
def limit(monkeypatch):
    """Set the soft descriptor limit listen.py sees (the hard one: 4 times it)."""

    def set_to(soft: int) -> None:
        monkeypatch.setattr(listen.resource, "getrlimit", lambda what: (soft, 4 * soft))

    return set_to


def test_the_cap_leaves_the_data_port_and_the_shards_own_work_their_descriptors(limit):
    limit(1024)
    cap, warning = listen.grpc_connection_cap(data_connections=48, workers=4)
    assert cap == 1024 - 48 - listen.OWN_DESCRIPTORS and warning == ""


def test_a_generous_limit_caps_at_the_default_or_two_per_worker(limit):
    limit(1 << 20)
    assert listen.grpc_connection_cap(48, 4)[0] == listen.GRPC_CONNECTIONS
    assert listen.grpc_connection_cap(48, 2000)[0] == 2 * 2000 + 16


def test_too_few_descriptors_for_the_workers_is_said_with_the_way_out(limit):
    limit(256)
    cap, warning = listen.grpc_connection_cap(data_connections=4 * 100 + 8 + 32, workers=100)
    assert cap == 8  # the least it takes, whatever the limit
    assert "ulimit -n 256" not in warning and "only 256 open files allowed (ulimit -n)" in warning
    assert f"ulimit -n {listen.WANTED_DESCRIPTORS}" in warning


def test_the_soft_limit_is_raised_towards_the_hard_one_never_past_it_never_down():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512), hard))
        wanted = 600 if hard == resource.RLIM_INFINITY else min(600, hard)
        assert listen.raise_descriptor_limit(wanted) == wanted == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert listen.raise_descriptor_limit(100) == wanted  # never down
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
