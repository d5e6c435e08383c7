"""The click-log generator: any range made on its own, ids of unbounded range without collisions, a power law
with a growing vocabulary, and a teacher whose reachable accuracy is what its labels give."""

from __future__ import annotations

import numpy as np
import pytest

from psgd.data.clicks import GROWTH_START, Generator, cardinalities, reachable_accuracy

N = 20_000


@pytest.fixture(scope="module")
def gen():
    return Generator(seed=3)


def test_any_range_of_examples_is_the_same_made_alone_or_in_a_whole(gen):
    whole = gen.make("train", 0, 3000, N)
    part = gen.make("train", 1234, 2345, N)
    for key in ("ids", "dense", "y", "p"):
        assert np.array_equal(getattr(whole, key)[1234:2345], getattr(part, key)), key
    again = Generator(seed=3).make("train", 0, 3000, N)
    assert np.array_equal(again.ids, whole.ids) and np.array_equal(again.y, whole.y)
    assert not np.array_equal(Generator(seed=4).make("train", 0, 3000, N).ids, whole.ids)
    assert whole.ids.dtype == np.int64 and whole.ids.shape == (3000, 26) and whole.dense.shape == (3000, 13)


def test_ids_are_64_bit_hashes_no_two_values_share(gen):
    ranks = np.arange(50_000)
    ids = np.concatenate([gen.ids_of(f, ranks) for f in range(gen.fields)])
    assert np.unique(ids).size == ids.size  # 1.3 million values of 26 fields, no collision
    assert ids.min() < -(2**62) and ids.max() > 2**62  # spread over all of int64


def test_fields_have_very_different_vocabularies_drawn_by_a_power_law(gen):
    sizes = np.sort(cardinalities(seed=3))
    assert sizes[0] == 4 and sizes[-1] == 10**6 and np.all(np.diff(sizes) > 0)
    data = gen.make("train", 0, N, N)
    big = int(np.argmax(gen.cardinality))
    _, counts = np.unique(data.ids[:, big], return_counts=True)
    counts = np.sort(counts)[::-1]
    assert counts[:10].sum() > 0.2 * N  # ten values of a million are a fifth of the examples
    assert (counts == 1).sum() > 0.3 * counts.size  # and most values are seen once


def test_new_ids_keep_arriving_and_the_test_set_holds_ids_the_early_examples_never_saw(gen):
    big = int(np.argmax(gen.cardinality))
    early_limit = np.floor(gen.cardinality[big] * (GROWTH_START + (1 - GROWTH_START) * 0.1))
    possible_early = set(gen.ids_of(big, np.arange(int(early_limit))).tolist())
    early = gen.make("train", 0, N // 10, N).ids[:, big]
    assert set(early.tolist()) <= possible_early
    late = gen.make("test", 0, N, N).ids[:, big]
    assert np.mean([i not in possible_early for i in late.tolist()]) > 0.005


def test_the_reachable_accuracy_is_the_accuracy_the_teachers_own_guess_gets(gen):
    data = gen.make("test", 0, N, N)
    reach = reachable_accuracy(data)
    assert 0.75 < reach < 0.95
    guessed = np.mean((data.p > 0.5) == (data.y == 1))
    assert abs(guessed - reach) < 4 * np.sqrt(reach * (1 - reach) / N)
    assert 0.45 < data.y.mean() < 0.55  # about as many clicks as not


def test_a_split_that_cannot_be_is_refused():
    with pytest.raises(ValueError, match="no examples"):
        Generator().make("valid", 0, 10, 10)
    with pytest.raises(ValueError, match="alpha"):
        Generator(alpha=0.9)


def test_the_training_examples_are_made_when_a_batch_takes_them_and_never_held():
    import tracemalloc

    from psgd.data import load_dataset

    tracemalloc.start()
    ds = load_dataset("clicks", n_train=10**9, n_test=100)  # a billion examples: 208 GB of ids if held
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(ds.x_train) == 10**9 and ds.ids_train.shape == (10**9, 26) and peak < 64 << 20
    idx = np.array([7, 10**9 - 1, 123456789])
    want = Generator(0).at("train", idx, 10**9)
    assert np.array_equal(ds.ids_train[idx], want.ids) and np.array_equal(ds.y_train[idx], want.y)
    np.testing.assert_array_equal(ds.x_train[idx], want.dense)
    assert ds.x_train[-3:].shape == (3, 13)  # a slice makes its rows only
    small = load_dataset("clicks", n_train=500, n_test=10)
    whole = Generator(0).make("train", 0, 500, 500)
    assert np.array_equal(np.asarray(small.ids_train), whole.ids)
    assert np.array_equal(small.x_train[3:9], whole.dense[3:9])
