"""The data path's protocol (psgd.wire.protocol): header layout, exact receives, gathered sends.

Sockets here are ``socket.socketpair()`` ends with timeouts; every helper
thread is joined with a bound, so nothing can hang.
"""

from __future__ import annotations

import hashlib
import socket
import struct
import threading

import numpy as np
import pytest

from psgd.wire import protocol
from psgd.wire.protocol import WireError

JOIN = 20.0  # seconds; every thread below finishes in well under one


# --- headers ------------------------------------------------------------------------------------


def test_request_and_reply_layouts_are_stable():
    """The structs are the protocol: changing their size or field order breaks every peer."""
    assert protocol.REQUEST.size == 36 and protocol.REPLY.size == 40
    assert protocol.DATA_MAGIC == b"PSG1" and len(protocol.DATA_MAGIC) == 4
    assert (protocol.OP_HELLO, protocol.OP_PULL, protocol.OP_PUSH) == (1, 2, 3)
    assert protocol.OUTCOMES == ("applied", "accumulated", "duplicate", "late")
    assert protocol.READY not in range(len(protocol.OUTCOMES))  # the go-ahead is no outcome
    req = protocol.REQUEST.pack(protocol.DATA_MAGIC, protocol.OP_PUSH, 4, -1, 2**63 - 1, -(2**63), 2**64 - 1)
    assert req[:4] == b"PSG1" and req[4] == 3 and req[5] == 4 and req[6:8] == b"\0\0"
    assert req[8:12] == (-1).to_bytes(4, "little", signed=True)
    assert protocol.REQUEST.unpack(req) == (b"PSG1", 3, 4, -1, 2**63 - 1, -(2**63), 2**64 - 1)
    rep = protocol.REPLY.pack(protocol.DATA_MAGIC, 9, 2, 5, 6, -7, 8)
    assert rep[4:8] == bytes([9, 2, 0, 0])
    assert protocol.REPLY.unpack(rep) == (b"PSG1", 9, 2, 5, 6, -7, 8)
    assert int.from_bytes(rep[32:40], "little") == 8  # payload size last
    assert protocol.MAX_HELLO_BYTES == 64 << 10 and protocol.MAX_ERROR_BYTES == 8 << 10


# --- send_buffers / recv_exact -------------------------------------------------------------------


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(10.0)
    b.settimeout(10.0)
    yield a, b
    a.close()
    b.close()


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    box: list = []

    def run():
        try:
            box.append(("ok", fn(*args)))
        except BaseException as exc:  # reported by finish()
            box.append(("error", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def finish(t: threading.Thread, box: list):
    t.join(JOIN)
    assert not t.is_alive(), "helper thread still running"
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def test_many_buffers_of_every_kind_arrive_in_order(pair):
    a, b = pair
    rng = np.random.default_rng(5)
    buffers: list = []
    for i in range(1500):  # more than the 512 sendmsg takes at once
        n = int(rng.integers(0, 300))
        data = rng.integers(0, 256, n, dtype=np.uint8)
        kind = i % 5
        if kind == 0:
            buffers.append(data.tobytes())
        elif kind == 1:
            buffers.append(bytearray(data.tobytes()))
        elif kind == 2:
            buffers.append(memoryview(data.tobytes()))
        elif kind == 3:
            buffers.append(np.frombuffer(data.tobytes() + b"\0" * (-n % 8), dtype=np.float64))
        else:
            buffers.append(b"")  # empty buffers are skipped
    expected = b"".join(bytes(memoryview(x).cast("B")) for x in buffers)
    t, box = in_thread(protocol.send_buffers, a, buffers)
    got = bytearray(len(expected))
    protocol.recv_exact(b, memoryview(got))
    finish(t, box)
    assert bytes(got) == expected


def test_empty_sends_and_receives_do_nothing(pair):
    a, b = pair
    protocol.send_buffers(a, [])
    protocol.send_buffers(a, [b"", bytearray(), memoryview(b""), np.empty(0)])
    protocol.recv_exact(b, memoryview(bytearray()))
    protocol.send_buffers(a, [b"x"])
    one = bytearray(1)
    protocol.recv_exact(b, memoryview(one))
    assert one == b"x"  # nothing else was sent before it
    b.settimeout(0.05)
    with pytest.raises(WireError, match="timed out"):
        protocol.recv_exact(b, memoryview(bytearray(1)))


def test_recv_exact_fills_typed_and_multidimensional_buffers(pair):
    a, b = pair
    values = np.arange(24, dtype=np.float64).reshape(4, 6)
    ints = np.arange(30, dtype=np.uint8).reshape(5, 6)
    protocol.send_buffers(a, [values, ints])
    got = np.zeros((4, 6), dtype=np.float64)
    protocol.recv_exact(b, memoryview(got))
    got_ints = np.zeros((5, 6), dtype=np.uint8)
    protocol.recv_exact(b, memoryview(got_ints))  # a 2-D byte buffer is filled whole, not one row per byte
    assert np.array_equal(got, values) and np.array_equal(got_ints, ints)


def test_a_64_mib_payload_in_pieces(pair):
    a, b = pair
    payload = np.random.default_rng(9).integers(0, 256, 64 << 20, dtype=np.uint8)
    pieces = [payload[:1], payload[1 : (40 << 20) + 3], payload[(40 << 20) + 3 :]]
    t, box = in_thread(protocol.send_buffers, a, pieces)
    got = np.empty(64 << 20, dtype=np.uint8)
    protocol.recv_exact(b, memoryview(got))
    finish(t, box)
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()


def test_a_peer_that_closes_mid_payload_is_a_wire_error(pair):
    a, b = pair
    protocol.send_buffers(a, [b"\1" * 1000])
    a.close()
    with pytest.raises(WireError, match="closed after 1000 of 4096 bytes"):
        protocol.recv_exact(b, memoryview(bytearray(4096)))


def test_a_peer_that_closes_before_a_header_is_a_wire_error(pair):
    a, b = pair
    a.close()
    with pytest.raises(WireError, match="closed after 0 of"):
        protocol.recv_struct(b, protocol.REPLY)


def test_a_receive_timeout_is_a_wire_error(pair):
    a, b = pair
    protocol.send_buffers(a, [b"\2" * 10])
    b.settimeout(0.2)
    with pytest.raises(WireError, match="timed out after 10 of 20 bytes"):
        protocol.recv_exact(b, memoryview(bytearray(20)))


def test_a_send_timeout_is_a_wire_error(pair):
    a, b = pair
    a.settimeout(0.2)  # b never reads: the kernel buffers fill up
    with pytest.raises(WireError, match="timed out while sending"):
        protocol.send_buffers(a, [bytearray(16 << 20)])


def test_sending_to_a_closed_peer_is_a_wire_error(pair):
    a, b = pair
    b.close()
    with pytest.raises(WireError, match="connection failed"):
        protocol.send_buffers(a, [b"\3" * 100_000])


def test_receiving_on_a_reset_tcp_connection_is_a_wire_error():
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5.0)
    try:
        client = socket.create_connection(listener.getsockname(), timeout=5.0)
        server, _ = listener.accept()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
        server.close()
        client.settimeout(5.0)
        with pytest.raises(WireError):
            protocol.recv_exact(client, memoryview(bytearray(8)))
        client.close()
    finally:
        listener.close()


def test_tune_sets_no_delay_on_tcp_sockets():
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        client = socket.create_connection(listener.getsockname(), timeout=5.0)
        protocol.tune(client)
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        client.close()
    finally:
        listener.close()


def test_pushes_from_four_mebibytes_wait_for_the_go_ahead():
    assert protocol.GO_AHEAD_BYTES == 4 << 20
    assert not protocol.wants_go_ahead(0) and not protocol.wants_go_ahead((4 << 20) - 1)
    assert protocol.wants_go_ahead(4 << 20) and protocol.wants_go_ahead(400_000_000)


# --- watching for an answer before sleeping (Spin) ------------------------------------------------------------


def test_a_watched_read_returns_the_bytes_whether_they_come_during_the_watch_or_after_it(pair):
    a, b = pair
    spin = protocol.Spin(a, 0.5)
    for gap in (0.0, 0.01):  # within the watch, then again after a read that saw them at once
        t, box = in_thread(lambda g=gap: (threading.Event().wait(g), b.sendall(b"x" * 8)))
        assert spin.read(lambda: protocol.recv_bytes(a, 8)) == b"x" * 8
        finish(t, box)
    short = protocol.Spin(a, 0.001)  # a watch too short for the answer: the read sleeps for it
    t, box = in_thread(lambda: (threading.Event().wait(0.05), b.sendall(b"y" * 8)))
    assert short.read(lambda: protocol.recv_bytes(a, 8)) == b"y" * 8
    finish(t, box)


def test_a_slow_peer_costs_a_watch_now_and_then_not_a_core(pair):
    """Each watch that sees nothing doubles the reads that sleep at once before the next: six reads of a peer that
    answers after 40 ms watch three times (reads 1, 3 and 6), 15 ms of CPU at 5 ms a watch, not 30."""
    import time

    a, b = pair
    spin = protocol.Spin(a, 0.005)
    used = 0.0
    for _ in range(6):
        t, box = in_thread(lambda: (threading.Event().wait(0.04), b.sendall(b"z")))
        began = time.thread_time()
        assert spin.read(lambda: protocol.recv_bytes(a, 1)) == b"z"
        used += time.thread_time() - began
        finish(t, box)
    assert used < 0.022, f"{used * 1e3:.1f} ms of CPU for six reads"
    off = protocol.Spin(a, 0.0)  # busy_poll_us = 0: never watches
    t, box = in_thread(lambda: (threading.Event().wait(0.04), b.sendall(b"z")))
    began = time.thread_time()
    off.read(lambda: protocol.recv_bytes(a, 1))
    assert time.thread_time() - began < 0.004
    finish(t, box)
