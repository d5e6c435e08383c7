"""The data path's wire helpers: 16-bit gradient formats, exact receives, gathered sends, header layout.

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

from psgd import wire
from psgd.wire import WireError

JOIN = 20.0  # seconds; every thread below finishes in well under one


# --- bfloat16 ----------------------------------------------------------------------------------


def f32(*bits: int) -> np.ndarray:
    return np.array(bits, dtype=np.uint32).view(np.float32)


def to_bf16(x: np.ndarray) -> np.ndarray:
    out = np.empty(x.shape, dtype=np.uint16)
    result = wire.to_bfloat16(np.ascontiguousarray(x, dtype=np.float32), out)
    assert result is out
    return out


def from_bf16(b: np.ndarray) -> np.ndarray:
    out = np.empty(b.shape, dtype=np.float32)
    result = wire.from_bfloat16(b, out)
    assert result is out
    return out


def reference_bf16(x: np.ndarray) -> np.ndarray:
    """Round finite float32 ``x`` to the nearest bfloat16 (ties to even), written independently of wire:
    pick between the truncated value and the next one up in magnitude by comparing distances in float64."""
    bits = x.view(np.uint32).astype(np.uint64)
    lo = (bits >> 16).astype(np.uint64)
    hi = lo + 1
    lo_val = (lo << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    hi_val = (hi << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    # one step up from the largest finite bfloat16 is 2**128 for rounding purposes (IEEE: overflow to inf)
    hi_val = np.where(np.isinf(hi_val), np.copysign(2.0**128, hi_val), hi_val)
    d_lo = np.abs(x.astype(np.float64) - lo_val)
    d_hi = np.abs(x.astype(np.float64) - hi_val)
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1))
    return np.where(pick_hi, hi, lo).astype(np.uint16)


def test_values_exact_in_bfloat16_survive_unchanged():
    exact = np.array([0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 3.0, -96.0, 1.5, 1.0078125, 2.0**-126, 2.0**-133, 2.0**127,
                      -3.3895313892515355e38, np.inf, -np.inf], dtype=np.float32)
    # and random bit patterns with the low 16 bits clear (excluding NaN, checked below)
    rng = np.random.default_rng(0)
    high = rng.integers(0, 1 << 16, size=5000, dtype=np.uint32) << np.uint32(16)
    randoms = high.view(np.float32)
    values = np.concatenate([exact, randoms[~np.isnan(randoms)]])
    back = from_bf16(to_bf16(values))
    assert back.tobytes() == values.tobytes()  # bitwise: the sign of zero too
    assert np.array_equal(to_bf16(values), (values.view(np.uint32) >> np.uint32(16)).astype(np.uint16))


@pytest.mark.parametrize("bits, expected", [
    (0x3F808000, 0x3F80),  # 1 + 2**-8: exactly halfway between 1 and 1 + 2**-7; 0x3F80 is even
    (0x3F818000, 0x3F82),  # halfway between 0x3F81 and 0x3F82: up to the even one
    (0x3F808001, 0x3F81),  # just above halfway: up
    (0x3F807FFF, 0x3F80),  # just below halfway: down
    (0xBF808000, 0xBF80),  # negative tie: to even, in magnitude
    (0xBF818000, 0xBF82),
    (0x3FFF8000, 0x4000),  # a tie that carries into the exponent
    (0x00008000, 0x0000),  # subnormal tie down to +0
    (0x00018000, 0x0002),  # subnormal tie up to even
    (0x7F7F7FFF, 0x7F7F),  # just under the midpoint above bfloat16's largest finite value
    (0x7F7F8000, 0x7F80),  # the midpoint itself ties to even, which is infinity (as IEEE rounding does)
    (0x7F7FFFFF, 0x7F80),  # float32's largest finite value is past it: rounds to infinity
    (0xFF7FFFFF, 0xFF80),
], ids=lambda v: f"{v:#x}")
def test_bfloat16_rounds_to_nearest_even(bits, expected):
    got = to_bf16(f32(bits))
    assert int(got[0]) == expected, f"{bits:#010x} -> {int(got[0]):#06x}, expected {expected:#06x}"
    assert int(reference_bf16(f32(bits))[0]) == expected


@pytest.mark.parametrize("bits", [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FFFFFFF,
                                  0xFFFFFFFF, 0x7FFF8000, 0x7F80FFFF, 0x7FC0FFFF], ids=hex)
def test_nan_stays_nan_whatever_its_payload(bits):
    """A NaN must never round into an infinity, a zero, or a number: the shard rejects non-finite
    gradients only if it still sees them."""
    packed = to_bf16(f32(bits))
    assert np.isnan(from_bf16(packed)[0]), f"NaN {bits:#010x} became {int(packed[0]):#06x}"
    assert (int(packed[0]) >> 15) == (bits >> 31)  # the sign survives too


def test_nan_among_other_values_leaves_them_alone():
    values = np.array([1.0, np.nan, -2.5, 3.0e-3, np.inf], dtype=np.float32)
    values.view(np.uint32)[1] = 0x7FFFFFFF
    back = from_bf16(to_bf16(values))
    assert np.isnan(back[1])
    keep = [0, 2, 3]
    assert np.array_equal(back[keep], from_bf16(reference_bf16(values[keep])))
    assert back[4] == np.inf


def test_infinities_stay_infinite():
    back = from_bf16(to_bf16(np.array([np.inf, -np.inf], dtype=np.float32)))
    assert back[0] == np.inf and back[1] == -np.inf


def test_random_float32_values_round_like_the_reference_within_2_to_the_minus_8():
    rng = np.random.default_rng(42)
    x = (rng.standard_normal(200_000) * np.exp2(rng.integers(-120, 120, 200_000))).astype(np.float32)
    x = x[np.isfinite(x) & (np.abs(x) < 3.0e38)]
    packed = to_bf16(x)
    assert np.array_equal(packed, reference_bf16(x))
    back = from_bf16(packed).astype(np.float64)
    normal = np.abs(x) >= np.finfo(np.float32).tiny
    rel = np.abs(back[normal] - x[normal]) / np.abs(x[normal].astype(np.float64))
    assert rel.max() <= 2.0**-8
    assert rel.max() > 2.0**-10  # the values were really rounded, not passed through


def test_bfloat16_works_in_place_on_views_of_larger_buffers():
    """The client packs each slice into a view of one reused uint16 buffer; the server widens into
    views of its float32 receive buffer."""
    rng = np.random.default_rng(7)
    src = rng.standard_normal(1000).astype(np.float32)
    packed = np.full(1200, 0xABCD, dtype=np.uint16)
    wire.to_bfloat16(src[100:600], packed[50:550])
    assert np.all(packed[:50] == 0xABCD) and np.all(packed[550:] == 0xABCD)
    assert np.array_equal(packed[50:550], reference_bf16(src[100:600]))
    wide = np.full(800, -7.0, dtype=np.float32)
    wire.from_bfloat16(packed[50:550], wide[200:700])
    assert np.all(wide[:200] == -7.0) and np.all(wide[700:] == -7.0)
    assert np.array_equal(wide[200:700], from_bf16(reference_bf16(src[100:600])))


# --- float16 ------------------------------------------------------------------------------------


def test_float16_path_matches_numpy_rounding():
    """What the client and server do for float16: copy into a uint16 buffer viewed as float16, then widen."""
    rng = np.random.default_rng(3)
    src = np.concatenate([rng.standard_normal(10_000).astype(np.float32),
                          np.array([0.0, -0.0, 1.0, 65504.0, 6.0e-8, np.inf, -np.inf], dtype=np.float32)])
    packed = np.empty(src.size, dtype=np.uint16)
    np.copyto(packed.view(np.float16), src, casting="same_kind")
    wide = np.empty(src.size, dtype=np.float32)
    np.copyto(wide, packed.view(np.float16))
    assert wide.tobytes() == src.astype(np.float16).astype(np.float32).tobytes()
    finite = np.isfinite(src) & (np.abs(src) >= 2.0**-14)
    rel = np.abs(wide[finite].astype(np.float64) - src[finite]) / np.abs(src[finite].astype(np.float64))
    assert rel.max() <= 2.0**-11
    nan = np.empty(1, dtype=np.uint16)
    np.copyto(nan.view(np.float16), np.array([np.nan], dtype=np.float32), casting="same_kind")
    assert np.isnan(nan.view(np.float16)[0])
    with np.errstate(over="ignore"):
        assert np.isinf(np.array([1.0e5], dtype=np.float32).astype(np.float16)[0])  # float16 overflows early


def test_wire_dtype_tables_are_consistent():
    assert wire.WIRE_DTYPES == {0: None, 1: "float32", 2: "float64", 3: "float16", 4: "bfloat16"}
    assert wire.WIRE_CODES == {"float32": 1, "float64": 2, "float16": 3, "bfloat16": 4}
    for name, size in wire.WIRE_ITEMSIZE.items():
        assert size == (2 if name == "bfloat16" else np.dtype(name).itemsize)


# --- headers ------------------------------------------------------------------------------------


def test_request_and_reply_layouts_are_stable():
    """The structs are the protocol: changing their size or field order breaks every peer."""
    assert wire.REQUEST.size == 36 and wire.REPLY.size == 40
    assert wire.DATA_MAGIC == b"PSG1" and len(wire.DATA_MAGIC) == 4
    assert (wire.OP_HELLO, wire.OP_PULL, wire.OP_PUSH) == (1, 2, 3)
    assert wire.OUTCOMES == ("applied", "accumulated", "duplicate", "late")
    assert wire.READY not in range(len(wire.OUTCOMES))  # the go-ahead is no outcome
    req = wire.REQUEST.pack(wire.DATA_MAGIC, wire.OP_PUSH, 4, -1, 2**63 - 1, -2**63, 2**64 - 1)
    assert req[:4] == b"PSG1" and req[4] == 3 and req[5] == 4 and req[6:8] == b"\0\0"
    assert req[8:12] == (-1).to_bytes(4, "little", signed=True)
    assert wire.REQUEST.unpack(req) == (b"PSG1", 3, 4, -1, 2**63 - 1, -2**63, 2**64 - 1)
    rep = wire.REPLY.pack(wire.DATA_MAGIC, 9, 2, 5, 6, -7, 8)
    assert rep[4:8] == bytes([9, 2, 0, 0])
    assert wire.REPLY.unpack(rep) == (b"PSG1", 9, 2, 5, 6, -7, 8)
    assert int.from_bytes(rep[32:40], "little") == 8  # payload size last
    assert wire.MAX_HELLO_BYTES == 64 << 10 and wire.MAX_ERROR_BYTES == 8 << 10


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
    t, box = in_thread(wire.send_buffers, a, buffers)
    got = bytearray(len(expected))
    wire.recv_exact(b, memoryview(got))
    finish(t, box)
    assert bytes(got) == expected


def test_empty_sends_and_receives_do_nothing(pair):
    a, b = pair
    wire.send_buffers(a, [])
    wire.send_buffers(a, [b"", bytearray(), memoryview(b""), np.empty(0)])
    wire.recv_exact(b, memoryview(bytearray()))
    wire.send_buffers(a, [b"x"])
    one = bytearray(1)
    wire.recv_exact(b, memoryview(one))
    assert one == b"x"  # nothing else was sent before it
    b.settimeout(0.05)
    with pytest.raises(WireError, match="timed out"):
        wire.recv_exact(b, memoryview(bytearray(1)))


def test_recv_exact_fills_typed_and_multidimensional_buffers(pair):
    a, b = pair
    values = np.arange(24, dtype=np.float64).reshape(4, 6)
    ints = np.arange(30, dtype=np.uint8).reshape(5, 6)
    wire.send_buffers(a, [values, ints])
    got = np.zeros((4, 6), dtype=np.float64)
    wire.recv_exact(b, memoryview(got))
    got_ints = np.zeros((5, 6), dtype=np.uint8)
    wire.recv_exact(b, memoryview(got_ints))  # a 2-D byte buffer is filled whole, not one row per byte
    assert np.array_equal(got, values) and np.array_equal(got_ints, ints)


def test_a_64_mib_payload_in_pieces(pair):
    a, b = pair
    payload = np.random.default_rng(9).integers(0, 256, 64 << 20, dtype=np.uint8)
    pieces = [payload[:1], payload[1:(40 << 20) + 3], payload[(40 << 20) + 3:]]
    t, box = in_thread(wire.send_buffers, a, pieces)
    got = np.empty(64 << 20, dtype=np.uint8)
    wire.recv_exact(b, memoryview(got))
    finish(t, box)
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()


def test_a_peer_that_closes_mid_payload_is_a_wire_error(pair):
    a, b = pair
    wire.send_buffers(a, [b"\1" * 1000])
    a.close()
    with pytest.raises(WireError, match="closed after 1000 of 4096 bytes"):
        wire.recv_exact(b, memoryview(bytearray(4096)))


def test_a_peer_that_closes_before_a_header_is_a_wire_error(pair):
    a, b = pair
    a.close()
    with pytest.raises(WireError, match="closed after 0 of"):
        wire.recv_struct(b, wire.REPLY)


def test_a_receive_timeout_is_a_wire_error(pair):
    a, b = pair
    wire.send_buffers(a, [b"\2" * 10])
    b.settimeout(0.2)
    with pytest.raises(WireError, match="timed out after 10 of 20 bytes"):
        wire.recv_exact(b, memoryview(bytearray(20)))


def test_a_send_timeout_is_a_wire_error(pair):
    a, b = pair
    a.settimeout(0.2)  # b never reads: the kernel buffers fill up
    with pytest.raises(WireError, match="timed out while sending"):
        wire.send_buffers(a, [bytearray(16 << 20)])


def test_sending_to_a_closed_peer_is_a_wire_error(pair):
    a, b = pair
    b.close()
    with pytest.raises(WireError, match="connection failed"):
        wire.send_buffers(a, [b"\3" * 100_000])


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
            wire.recv_exact(client, memoryview(bytearray(8)))
        client.close()
    finally:
        listener.close()


def test_tune_sets_no_delay_on_tcp_sockets():
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        client = socket.create_connection(listener.getsockname(), timeout=5.0)
        wire.tune(client)
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        client.close()
    finally:
        listener.close()


def test_pushes_from_four_mebibytes_wait_for_the_go_ahead():
    assert wire.GO_AHEAD_BYTES == 4 << 20
    assert not wire.wants_go_ahead(0) and not wire.wants_go_ahead((4 << 20) - 1)
    assert wire.wants_go_ahead(4 << 20) and wire.wants_go_ahead(400_000_000)
