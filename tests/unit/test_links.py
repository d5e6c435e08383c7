"""A worker's link to one shard: which data link carries its tensors, chosen from the shard's answer to a
registration (no shard runs here: the control link's stub answers as a shard would)."""

from __future__ import annotations

import logging

import pytest

from psgd.link import Endpoint, open_link
from psgd.proto import ps_pb2
from psgd.wire import segment


class Registrar:
    """A control link's stub that answers every registration with ``reply``."""

    def __init__(self, reply: ps_pb2.RegisterReply):
        self.reply = reply

    def Register(self, request, timeout):  # noqa: N802 (the stub's name)
        return self.reply


def registered(kind: str, **reply) -> object:
    link = open_link(kind, Endpoint("127.0.0.1:1", 0, [], 0, "plan", transport=kind))
    link.control.stub = Registrar(ps_pb2.RegisterReply(registration="k" * 32, **reply))
    link.register(ps_pb2.RegisterRequest(worker_id=0))
    return link


@pytest.mark.parametrize("kind", ["grpc", "tcp", "shm"])
def test_tensors_go_over_grpc_until_a_shard_gives_a_data_port(kind):
    link = open_link(kind, Endpoint("127.0.0.1:1", 0, [], 0, "plan"))
    try:
        assert (link.kind, link.via, link.data_port) == (kind, "grpc", 0)  # an observer never registers
    finally:
        link.close()
    link = registered(kind)
    try:
        assert (link.via, link.data_port, link.registration) == ("grpc", 0, "k" * 32)
    finally:
        link.close()


def test_a_data_port_carries_the_tensors_of_a_tcp_link_and_of_a_shm_link_without_shared_memory(caplog):
    with caplog.at_level(logging.INFO, logger="psgd.link.shm"):
        tcp, shm = registered("tcp", data_port=7), registered("shm", data_port=7)
    try:
        assert [(link.via, link.data_port, link.shared) for link in (tcp, shm)] == [("tcp", 7, False)] * 2
        assert "offers no shared memory" in caplog.text
    finally:
        tcp.close()
        shm.close()


def test_a_shm_link_shares_memory_with_a_shard_of_its_host():
    link = registered("shm", data_port=7, host_id=segment.host_id())
    try:
        assert (link.via, link.shared, link.direct) == ("shm", True, False)  # direct: only from a GPU
    finally:
        link.close()


def test_a_shard_that_restarts_without_a_data_port_is_reached_over_grpc_again():
    link = registered("tcp", data_port=7)
    try:
        link.control.stub.reply = ps_pb2.RegisterReply(registration="j" * 32)
        link.register(ps_pb2.RegisterRequest(worker_id=0))
        assert (link.via, link.data_port) == ("grpc", 0)
    finally:
        link.close()


def test_a_shm_link_to_a_shard_without_a_data_port_says_its_tensors_go_over_grpc(caplog):
    with caplog.at_level(logging.INFO, logger="psgd.link.shm"):
        link = registered("shm")
    try:
        assert link.via == "grpc"
        lines = [r.getMessage() for r in caplog.records if "not through shared memory" in r.getMessage()]
        assert len(lines) == 1 and "over gRPC, since it has no data port" in lines[0], lines
    finally:
        link.close()
