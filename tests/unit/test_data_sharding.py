"""Rank sharding: equal disjoint shards per epoch, and the N x B == 1 x N*B equivalence."""

from __future__ import annotations

import numpy as np
import pytest

from psgd.data import (
    DataError,
    ShardedBatches,
    epoch_batch_indices,
    epoch_batches,
    epoch_permutation,
    shard_indices,
    steps_per_epoch,
)


def test_epoch_permutation_is_the_documented_rng():
    np.testing.assert_array_equal(epoch_permutation(50, 3, 7), np.random.default_rng([7, 3]).permutation(50))
    np.testing.assert_array_equal(epoch_permutation(50, 3, 7), epoch_permutation(50, 3, 7))
    assert not np.array_equal(epoch_permutation(50, 3, 7), epoch_permutation(50, 4, 7))
    assert not np.array_equal(epoch_permutation(50, 3, 7), epoch_permutation(50, 3, 8))


@pytest.mark.parametrize("n", [0, 1, 7, 10, 101])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shards_are_disjoint_equal_and_cover_the_cut_permutation(n, world):
    m = n // world
    shards = [shard_indices(n, r, world, epoch=2, seed=5) for r in range(world)]
    assert all(len(s) == m for s in shards)
    union = np.concatenate(shards)
    assert len(np.unique(union)) == len(union) == m * world  # disjoint
    perm = epoch_permutation(n, 2, 5)
    assert set(union.tolist()) == set(perm[: m * world].tolist())
    for r, s in enumerate(shards):
        np.testing.assert_array_equal(s, perm[: m * world][r::world])


def test_shards_reshuffle_across_epochs_and_are_deterministic():
    a0 = shard_indices(100, 1, 4, epoch=0, seed=3)
    a1 = shard_indices(100, 1, 4, epoch=1, seed=3)
    assert not np.array_equal(a0, a1)
    assert not set(a0.tolist()) == set(a1.tolist())  # the shard's membership changes, not just its order
    np.testing.assert_array_equal(a0, shard_indices(100, 1, 4, epoch=0, seed=3))
    assert not np.array_equal(a0, shard_indices(100, 1, 4, epoch=0, seed=4))


def test_steps_per_epoch_drops_the_last_partial_batch():
    assert steps_per_epoch(100, 1, 10) == 10
    assert steps_per_epoch(100, 3, 10) == 3  # 33 each, 3 full batches
    assert steps_per_epoch(7, 4, 1) == 1
    assert steps_per_epoch(3, 4, 1) == 0
    for n in range(0, 60):
        for world in (1, 2, 3, 5):
            for b in (1, 2, 4):
                assert steps_per_epoch(n, world, b) == n // (world * b)


@pytest.mark.parametrize("n", [8, 37, 100, 257])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 5, 8])
def test_n_workers_with_batch_b_equal_one_process_with_batch_nb(n, world, batch):
    """THE equivalence: union over ranks of batch t == batch t of world=1 with batch world*B."""
    seed = 11
    if (n // world) < batch:
        with pytest.raises(DataError):
            epoch_batch_indices(n, 0, world, batch, 0, seed)
        return
    for epoch in (0, 1):
        per_rank = [epoch_batch_indices(n, r, world, batch, epoch, seed) for r in range(world)]
        steps = steps_per_epoch(n, world, batch)
        assert all(b.shape == (steps, batch) for b in per_rank)
        single = epoch_batch_indices(n, 0, 1, world * batch, epoch, seed)
        assert single.shape[0] == steps == steps_per_epoch(n, 1, world * batch)
        for t in range(steps):
            union = np.concatenate([b[t] for b in per_rank])
            assert len(np.unique(union)) == world * batch
            assert set(union.tolist()) == set(single[t].tolist())


def test_equivalence_of_averaged_gradients():
    # the mean of the workers' batch means is the mean of the big batch
    rng = np.random.default_rng(0)
    n, world, batch = 103, 4, 5
    values = rng.standard_normal(n)
    for t in range(steps_per_epoch(n, world, batch)):
        means = [values[epoch_batch_indices(n, r, world, batch, 0, 1)[t]].mean() for r in range(world)]
        big = values[epoch_batch_indices(n, 0, 1, world * batch, 0, 1)[t]].mean()
        assert np.mean(means) == pytest.approx(big, rel=1e-12)


def test_epoch_batches_yield_host_arrays():
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    y = np.arange(20)
    batches = list(epoch_batches(x, y, rank=1, world=2, batch_size=3, epoch=0, seed=0))
    shard = shard_indices(20, 1, 2, 0, 0)
    assert len(batches) == 3 == steps_per_epoch(20, 2, 3)
    for t, (xb, yb) in enumerate(batches):
        np.testing.assert_array_equal(yb, shard[t * 3 : (t + 1) * 3])
        np.testing.assert_array_equal(xb, x[yb])
        assert isinstance(xb, np.ndarray) and xb.shape == (3, 2)


def test_sharded_batches_give_each_epoch_its_own_order():
    x = np.arange(30, dtype=np.float32)[:, None]
    y = np.arange(30)
    sb = ShardedBatches(x, y, rank=0, world=3, batch_size=4, seed=9)
    assert sb.steps_per_epoch == len(sb) == 2  # 10 per shard
    epochs = [sb.indices(e) for e in range(3)]
    assert all(e.shape == (2, 4) for e in epochs)
    assert not all(np.array_equal(epochs[0], e) for e in epochs[1:])  # reshuffled every epoch
    for e, idx in enumerate(epochs):
        for (xb, yb), want in zip(sb.epoch(e), idx):
            np.testing.assert_array_equal(yb, want)
            np.testing.assert_array_equal(xb[:, 0], yb)
    np.testing.assert_array_equal(sb.indices(1), epochs[1])  # the same epoch, the same batches (a resumed run)


def test_argument_validation():
    with pytest.raises(DataError, match=r"rank must be in \[0, 2\) for world 2, got 2"):
        shard_indices(10, 2, 2, 0, 0)
    with pytest.raises(DataError, match="world must be >= 1, got 0"):
        shard_indices(10, 0, 0, 0, 0)
    with pytest.raises(DataError, match="rank must be >= 0"):
        shard_indices(10, -1, 2, 0, 0)
    with pytest.raises(DataError, match="batch_size must be >= 1, got 0"):
        steps_per_epoch(10, 1, 0)
    expected = r"batch_size 6 is larger than the shard of 5 examples \(11 examples over 2 workers\)"
    with pytest.raises(DataError, match=expected):
        epoch_batch_indices(11, 0, 2, 6, 0, 0)
    with pytest.raises(DataError, match="batch_size 6 is larger than the shard of 5"):
        ShardedBatches(np.zeros((11, 1)), np.zeros(11), rank=0, world=2, batch_size=6, seed=0)
    with pytest.raises(DataError, match="x has 3 rows but y has 2"):
        ShardedBatches(np.zeros((3, 1)), np.zeros(2), rank=0, world=1, batch_size=1, seed=0)
    with pytest.raises(DataError, match="rank must be an integer"):
        shard_indices(10, 0.5, 2, 0, 0)
    with pytest.raises(DataError, match="seed must be >= 0"):
        epoch_permutation(10, 0, -1)
