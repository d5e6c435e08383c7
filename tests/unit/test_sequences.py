"""psgd's sequence tasks (psgd.data.sequences, --dataset sequences): the classes are what each task says, the data
is the same in every process, and a bad option is one clear error."""

from __future__ import annotations

import re

import numpy as np
import pytest

from psgd.data import DataError, describe_dataset, load_dataset
from psgd.data.sequences import make_sequences


@pytest.mark.parametrize("task", ["majority", "lookup"])
def test_each_class_is_what_its_task_says(task):
    x, y, xt, yt = make_sequences(task=task, n_train=500, n_test=100, length=12, vocab=12)
    assert x.shape == (500, 12) and xt.shape == (100, 12) and x.dtype == np.float32 and y.dtype == np.int64
    for tokens, label in zip(x.astype(int), y):
        if task == "majority":
            counts = np.bincount(tokens, minlength=12)
            assert label == np.flatnonzero(counts == counts.max())[0]
        else:
            assert 1 <= tokens[0] < 12 and label == tokens[tokens[0]]
    assert set(np.unique(y)) <= set(range(12))


def test_every_process_makes_the_same_data_and_test_is_apart():
    a, b = make_sequences(n_train=50, n_test=50), make_sequences(n_train=50, n_test=50)
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    assert not np.array_equal(a[0], a[2])
    assert not np.array_equal(a[0], make_sequences(n_train=50, n_test=50, data_seed=1)[0])


def test_the_dataset_spec_loads_and_describes_alike():
    ds = load_dataset("sequences", n_train=64, n_test=16, length="10", vocab="5")
    shape = describe_dataset("sequences", length=10, vocab=5)
    assert ds.input_shape == shape.input_shape == (10,) and ds.num_classes == shape.num_classes == 5
    assert ds.x_train.shape == (64, 10)


@pytest.mark.parametrize(
    "options, said",
    [
        ({"task": "sorted"}, "task must be one of majority, lookup, sort"),
        ({"length": 1}, "length must be a whole number of at least 2"),
        ({"vocab": "x"}, "vocab must be a whole number"),
        ({"task": "lookup", "length": 9, "vocab": 8}, "vocab must be at least"),
        ({"tokens": 3}, "unknown option(s) tokens"),
    ],
)
def test_a_bad_option_is_one_clear_error(options, said):
    with pytest.raises(DataError, match=re.escape(said)):
        load_dataset("sequences", **options)
