"""Passes in pieces over threads (psgd.wire.sweep): every element once, a bad value found wherever it is, and a
copy of many pairs each copied whole (the update swept piece by piece: test_update_pass.py)."""

from __future__ import annotations

import numpy as np
import pytest

from psgd.wire.sweep import PARALLEL_BYTES, PIECE_BYTES, Sweep, all_finite, extent

SIZES = [1, PIECE_BYTES // 4 - 1, PIECE_BYTES // 4 + 1, PARALLEL_BYTES // 4 + 12_345]


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("size", SIZES)
def test_a_sweep_covers_every_element_once(threads, size):
    sweep = Sweep(size * 4, "t", threads)
    seen = np.zeros(size, dtype=np.int64)
    pieces = []

    def piece(a, b):
        seen[a:b] += 1
        pieces.append((a, b))

    sweep.run(size, 4, piece)
    assert (seen == 1).all()
    assert all(b - a <= PIECE_BYTES // 4 for a, b in pieces)
    sweep.close()


def test_only_large_arrays_are_swept_on_threads():
    assert Sweep(PARALLEL_BYTES - 1, "t", 4).threads == 1
    assert Sweep(PARALLEL_BYTES, "t", 4).threads == 4
    assert Sweep(PARALLEL_BYTES, "t", 1).threads == 1


def test_an_error_in_a_piece_reaches_the_caller():
    sweep = Sweep(PARALLEL_BYTES * 2, "t", 2)

    def piece(a, b):
        if a > 0:
            raise ValueError(f"piece at {a}")

    with pytest.raises(ValueError, match="piece at"):
        sweep.run(PARALLEL_BYTES // 2, 4, piece)


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("where", [0, PIECE_BYTES // 4, PARALLEL_BYTES // 4 - 1])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -3e30])
def test_copy_checked_copies_and_finds_the_largest_value_wherever_it_is(threads, where, bad):
    n = PARALLEL_BYTES // 4
    sweep = Sweep(n * 4, "t", threads)
    src = np.random.default_rng(1).uniform(-1, 1, n).astype(np.float32)
    dst = np.empty_like(src)
    assert sweep.copy_checked(dst, src) == sweep.largest(src) == np.abs(src).max() and dst.tobytes() == src.tobytes()
    src[where] = bad
    found = sweep.copy_checked(dst, src)
    assert dst.tobytes() == src.tobytes()  # copied whole all the same: the caller refuses
    if np.isnan(bad):
        assert np.isnan(found) and np.isnan(sweep.largest(src))
    else:
        assert found == sweep.largest(src) == abs(np.float32(bad))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_all_finite_is_exact_where_a_sum_would_overflow(dtype):
    big = np.full(PIECE_BYTES // 8, np.finfo(dtype).max, dtype=dtype)
    assert all_finite(big) and extent(big) == np.finfo(dtype).max  # a sum of these would be infinite
    rng = np.random.default_rng(5)
    for special in (np.nan, np.inf, -np.inf, -0.0, np.finfo(dtype).tiny / 2, -np.finfo(dtype).max):
        a = rng.standard_normal(1000).astype(dtype)
        a[rng.integers(0, 1000)] = special
        assert all_finite(a) == bool(np.isfinite(a).all()), special
    assert all_finite(np.empty(0, dtype=dtype)) and extent(np.empty(0, dtype=dtype)) == 0


@pytest.mark.parametrize("threads", [1, 3])
def test_a_copy_of_many_pairs_copies_each_whole(threads):
    rng = np.random.default_rng(2)
    sizes = [5, PARALLEL_BYTES // 3 + 1, 0, PARALLEL_BYTES + 17, 64]
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    dsts = [np.zeros(n, dtype=np.uint8) for n in sizes]
    Sweep(PARALLEL_BYTES, "t", threads).copy(list(zip(dsts, srcs)))
    assert all(d.tobytes() == s.tobytes() for d, s in zip(dsts, srcs))
