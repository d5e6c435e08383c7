"""npy:DIR (psgd.data.stream): inputs memory-mapped, in one file or in pieces read as one; every refusal names the
file and says what to do."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import refused_at_a_fifo

from psgd.data import DataError, describe_dataset, load_dataset
from psgd.data.stream import Stacked


def folder_of(tmp_path, pieces=1, dtype=np.float32, n=90):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((n, 3, 2)).astype(dtype), rng.integers(0, 5, n)
    for split, rows in (("train", slice(0, 70)), ("test", slice(70, n))):
        if pieces == 1 or split == "test":
            np.save(tmp_path / f"x_{split}.npy", x[rows])
            np.save(tmp_path / f"y_{split}.npy", y[rows])
        else:
            for k, part in enumerate(np.array_split(np.arange(70), pieces)):
                np.save(tmp_path / f"x_train-{k}.npy", x[part])
                np.save(tmp_path / f"y_train-{k}.npy", y[part])
    return x, y


@pytest.mark.parametrize("pieces", [1, 3])
def test_npy_folders_read_as_the_arrays_they_hold(tmp_path, pieces):
    x, y = folder_of(tmp_path, pieces)
    ds = load_dataset(f"npy:{tmp_path}")
    assert isinstance(ds.x_train, np.memmap if pieces == 1 else Stacked)
    assert (ds.n_train, ds.n_test, ds.input_shape, ds.num_classes) == (70, 20, (3, 2), int(y.max()) + 1)
    rows = np.array([69, 0, 23, 24, 47, 48, 5])
    np.testing.assert_array_equal(ds.x_train[rows], x[rows])
    np.testing.assert_array_equal(ds.y_train[rows], y[rows])
    np.testing.assert_array_equal(ds.x_train[10:30], x[10:30])
    shape = describe_dataset(f"npy:{tmp_path}")
    assert (shape.input_shape, shape.num_classes) == ((3, 2), ds.num_classes)


def test_what_npy_folders_refuse(tmp_path):
    folder_of(tmp_path, dtype=np.float64)
    with pytest.raises(DataError, match="x_train is float64, the job's dtype float32: write the files as float32"):
        load_dataset(f"npy:{tmp_path}")
    assert load_dataset(f"npy:{tmp_path}", dtype="float64").x_train.dtype == np.float64
    np.save(tmp_path / "x_train-0.npy", np.zeros((2, 3, 2)))
    with pytest.raises(DataError, match="both x_train.npy and x_train-0.npy"):
        load_dataset(f"npy:{tmp_path}", dtype="float64")
    (tmp_path / "x_train-0.npy").unlink()
    np.save(tmp_path / "y_test.npy", np.array([object()] * 20), allow_pickle=True)
    with pytest.raises(DataError, match="y_test.npy: cannot be read"):  # never unpickled
        load_dataset(f"npy:{tmp_path}", dtype="float64")
    np.save(tmp_path / "y_test.npy", -np.ones(20, dtype=np.int64))
    with pytest.raises(DataError, match="y_test holds a negative label"):
        load_dataset(f"npy:{tmp_path}", dtype="float64")
    with pytest.raises(DataError, match="not a folder"):
        load_dataset(f"npy:{tmp_path / 'nowhere'}")


def test_batches_gathered_ahead_train_exactly_as_batches_gathered_in_the_step(tmp_path):
    import psgd

    folder_of(tmp_path, pieces=2, dtype=np.float64)
    runs = [
        psgd.train(
            "mlp",
            f"npy:{tmp_path}",
            epochs=2,
            dtype="float64",
            batch_size=16,
            prefetch=on,
            model_options={"hidden": [8]},
        )
        for on in (True, False)
    ]
    assert runs[0].steps == 2 * (70 // 16)
    for name, w in runs[0].weights.items():
        np.testing.assert_array_equal(w, runs[1].weights[name])


def test_a_batch_gathered_ahead_is_taken_by_its_own_step_only():
    from psgd.data.ahead import Ahead

    x, y = np.arange(20.0).reshape(10, 2), np.arange(10)
    rows = Ahead(x, y, on=True)
    try:
        rows.ahead(5, np.array([1, 2]))
        got = rows.take(4, np.array([7, 8]))  # a step that went back: its own rows, not the ones gathered ahead
        np.testing.assert_array_equal(got[1], [7, 8])
        rows.ahead(6, np.array([3, 9]))
        np.testing.assert_array_equal(rows.take(6, np.array([3, 9]))[0], x[[3, 9]])
    finally:
        rows.close()


@pytest.mark.parametrize("split", ["test", "train"])
def test_an_npy_folder_with_an_empty_split_is_refused(tmp_path, split):
    folder_of(tmp_path)
    np.save(tmp_path / f"x_{split}.npy", np.zeros((0, 3, 2), np.float32))
    np.save(tmp_path / f"y_{split}.npy", np.zeros(0, np.int64))
    with pytest.raises(DataError, match=f"npy:{tmp_path}: x_{split} has no rows"):  # was a ValueError from min()
        load_dataset(f"npy:{tmp_path}")
    with pytest.raises(DataError, match=f"x_{split} has no rows"):
        describe_dataset(f"npy:{tmp_path}")


def test_an_npy_file_that_is_not_a_regular_file_is_refused_without_being_opened(tmp_path):
    """A FIFO named x_train.npy: its open for reading waited for a writer that never came."""
    import os

    folder_of(tmp_path)
    (tmp_path / "x_train.npy").unlink()
    os.mkfifo(tmp_path / "x_train.npy")
    said = refused_at_a_fifo(tmp_path / "x_train.npy", lambda: load_dataset(f"npy:{tmp_path}"), DataError)
    assert "x_train.npy: not a regular file" in str(said)
