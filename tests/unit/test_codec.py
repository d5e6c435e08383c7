"""Gradient codecs (psgd.wire.codec): bfloat16 and float16 rounding, and how each end finds a push's codec."""

from __future__ import annotations

import numpy as np
import pytest

from psgd.wire import codec

# --- bfloat16 ----------------------------------------------------------------------------------


def f32(*bits: int) -> np.ndarray:
    return np.array(bits, dtype=np.uint32).view(np.float32)


def to_bf16(x: np.ndarray) -> np.ndarray:
    out = np.empty(x.shape, dtype=np.uint16)
    result = codec.to_bfloat16(np.ascontiguousarray(x, dtype=np.float32), out)
    assert result is out
    return out


def from_bf16(b: np.ndarray) -> np.ndarray:
    out = np.empty(b.shape, dtype=np.float32)
    result = codec.from_bfloat16(b, out)
    assert result is out
    return out


def reference_bf16(x: np.ndarray) -> np.ndarray:
    """Round finite float32 ``x`` to the nearest bfloat16 (ties to even), written independently of psgd.wire.codec:
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
    exact = np.array(
        [
            0.0,
            -0.0,
            1.0,
            -1.0,
            0.5,
            2.0,
            3.0,
            -96.0,
            1.5,
            1.0078125,
            2.0**-126,
            2.0**-133,
            2.0**127,
            -3.3895313892515355e38,
            np.inf,
            -np.inf,
        ],
        dtype=np.float32,
    )
    # and random bit patterns with the low 16 bits clear (excluding NaN, checked below)
    rng = np.random.default_rng(0)
    high = rng.integers(0, 1 << 16, size=5000, dtype=np.uint32) << np.uint32(16)
    randoms = high.view(np.float32)
    values = np.concatenate([exact, randoms[~np.isnan(randoms)]])
    back = from_bf16(to_bf16(values))
    assert back.tobytes() == values.tobytes()  # bitwise: the sign of zero too
    assert np.array_equal(to_bf16(values), (values.view(np.uint32) >> np.uint32(16)).astype(np.uint16))


@pytest.mark.parametrize(
    "bits, expected",
    [
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
    ],
    ids=lambda v: f"{v:#x}",
)
def test_bfloat16_rounds_to_nearest_even(bits, expected):
    got = to_bf16(f32(bits))
    assert int(got[0]) == expected, f"{bits:#010x} -> {int(got[0]):#06x}, expected {expected:#06x}"
    assert int(reference_bf16(f32(bits))[0]) == expected


@pytest.mark.parametrize(
    "bits",
    [
        0x7FC00000,
        0xFFC00000,
        0x7F800001,
        0xFF800001,
        0x7FBFFFFF,
        0x7FFFFFFF,
        0xFFFFFFFF,
        0x7FFF8000,
        0x7F80FFFF,
        0x7FC0FFFF,
    ],
    ids=hex,
)
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
    codec.to_bfloat16(src[100:600], packed[50:550])
    assert np.all(packed[:50] == 0xABCD) and np.all(packed[550:] == 0xABCD)
    assert np.array_equal(packed[50:550], reference_bf16(src[100:600]))
    wide = np.full(800, -7.0, dtype=np.float32)
    codec.from_bfloat16(packed[50:550], wide[200:700])
    assert np.all(wide[:200] == -7.0) and np.all(wide[700:] == -7.0)
    assert np.array_equal(wide[200:700], from_bf16(reference_bf16(src[100:600])))


# --- float16 ------------------------------------------------------------------------------------


def test_float16_path_matches_numpy_rounding():
    """What the client and server do for float16: encode into a uint16 buffer, then widen."""
    f16 = codec.codec_for("float16")
    rng = np.random.default_rng(3)
    src = np.concatenate(
        [
            rng.standard_normal(10_000).astype(np.float32),
            np.array([0.0, -0.0, 1.0, 65504.0, 6.0e-8, np.inf, -np.inf], dtype=np.float32),
        ]
    )
    packed = np.empty(src.size, dtype=np.uint16)
    f16.encode(src, packed)
    wide = np.empty(src.size, dtype=np.float32)
    f16.decode(packed, wide)
    assert wide.tobytes() == src.astype(np.float16).astype(np.float32).tobytes()
    finite = np.isfinite(src) & (np.abs(src) >= 2.0**-14)
    rel = np.abs(wide[finite].astype(np.float64) - src[finite]) / np.abs(src[finite].astype(np.float64))
    assert rel.max() <= 2.0**-11
    nan = np.empty(1, dtype=np.uint16)
    f16.encode(np.array([np.nan], dtype=np.float32), nan)
    assert np.isnan(nan.view(np.float16)[0])
    with np.errstate(over="ignore"):
        assert np.isinf(np.array([1.0e5], dtype=np.float32).astype(np.float16)[0])  # float16 overflows early


def test_bfloat16_codec_round_trips_through_its_own_encode_and_decode():
    bf16 = codec.codec_for("bfloat16")
    src = np.array([0.0, -0.0, 1.0, -0.375, 3.0e38, 1.0e-40, np.inf], dtype=np.float32)
    packed, wide = np.empty(src.size, dtype=np.uint16), np.empty(src.size, dtype=np.float32)
    bf16.encode(src, packed)
    bf16.decode(packed, wide)
    assert np.array_equal(packed, reference_bf16(src[:-1]).tolist() + [0x7F80])
    assert wide[:4].tolist() == [0.0, -0.0, 1.0, -0.375] and np.isinf(wide[-1])


def test_codecs_are_found_by_name_and_by_wire_code_and_refuse_what_they_cannot_carry():
    assert [c.name for c in codec.CODECS.values()] == ["none", "float16", "bfloat16"]
    assert codec.codec_for(None) is codec.codec_for("") is codec.codec_for("none") is codec.IDENTITY
    assert [(c.code, c.itemsize) for c in codec.CODECS.values()] == [(0, 0), (3, 2), (4, 2)]
    with pytest.raises(codec.CodecError, match="use none, float16, bfloat16"):
        codec.codec_for("int8")
    # a data-path push names its codec by number (1 and 2: the variables' own float32 / float64)
    assert codec.by_code(0, "float64") is codec.by_code(2, "float64") is codec.by_code(1, "float32") is codec.IDENTITY
    assert codec.by_code(4, "float32").name == "bfloat16" and codec.by_code(3, "float32").name == "float16"
    for code, dtype in ((1, "float64"), (2, "float32"), (5, "float32"), (255, "float32")):
        with pytest.raises(codec.CodecError, match=f"code {code} cannot carry {dtype}"):
            codec.by_code(code, dtype)
    with pytest.raises(codec.CodecError, match="needs float32 variables"):
        codec.by_code(3, "float64")
    # a gRPC push names it by name (the variables' own dtype: as they are)
    assert codec.by_name("float64", "float64") is codec.IDENTITY and codec.by_name("float16", "float32").code == 3
    for name in ("float32", "", "none", "int8"):
        with pytest.raises(codec.CodecError, match="does not match the model's 'float64'"):
            codec.by_name(name, "float64")
    assert [codec.IDENTITY.wire_itemsize(d) for d in ("float32", "float64")] == [4, 8]
