"""A shard's passes in pieces over threads (psgd.wire.sweep): every element once, a bad value found wherever
it is, and an update swept piece by piece equal to the update made at once, to the bit."""

from __future__ import annotations

import numpy as np
import pytest

from psgd.optim import build_optimizer
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


OPTIMIZERS = [("sgd", {}), ("sgd", {"weight_decay": 0.01}), ("momentum", {"weight_decay": 0.01}),
              ("nesterov", {}), ("adam", {"weight_decay": 0.01}), ("adamw", {"weight_decay": 0.01})]


@pytest.mark.parametrize("name,options", OPTIMIZERS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_an_update_swept_in_pieces_is_the_update_made_at_once(name, options, dtype):
    n = PARALLEL_BYTES // np.dtype(dtype).itemsize + 777
    bounds = ((0, n // 3), (n // 3, n))
    keys = ("a", "b")
    rng = np.random.default_rng(3)
    start = rng.standard_normal(n).astype(dtype)
    at_once, swept = build_optimizer(name, lr=0.05, **options), build_optimizer(name, lr=0.05, **options)
    p1, p2 = start.copy(), start.copy()
    sweep = Sweep(n * p1.itemsize, "t", 3)
    for _ in range(3):
        g = rng.standard_normal(n).astype(dtype)
        at_once.update_flat(keys, p1, g, bounds, 0.5)
        swept.update_flat(keys, p2, g, bounds, 0.5, over=lambda step: sweep.run(n, p2.itemsize, step))
    assert p1.tobytes() == p2.tobytes()
    for k in keys:
        assert at_once.step_count(k) == swept.step_count(k) == 3
        for state in at_once.state(k):
            assert at_once.state(k)[state].tobytes() == swept.state(k)[state].tobytes()


@pytest.mark.parametrize("threads", [1, 3])
def test_a_copy_of_many_pairs_copies_each_whole(threads):
    rng = np.random.default_rng(2)
    sizes = [5, PARALLEL_BYTES // 3 + 1, 0, PARALLEL_BYTES + 17, 64]
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    dsts = [np.zeros(n, dtype=np.uint8) for n in sizes]
    Sweep(PARALLEL_BYTES, "t", threads).copy(list(zip(dsts, srcs)))
    assert all(d.tobytes() == s.tobytes() for d, s in zip(dsts, srcs))
