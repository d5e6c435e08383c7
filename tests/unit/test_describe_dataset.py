"""describe_dataset: a dataset's input shape and class count without loading its inputs.

Every case checks that ``describe_dataset`` agrees with ``load_dataset`` (name,
input shape, class count, and the same error for the same bad request), and
that the inputs are never read: a shard builds its model from the description
alone (``build_shard`` never calls ``load_dataset``).
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
import pytest
from helpers import idx_bytes, make_job, slice_weights

import psgd.data
import psgd.data.datasets
import psgd.data.files
from psgd.data import DataError, DataShape, describe_dataset, load_dataset, read_idx_header, read_npz_headers
from psgd.job import build_job, describe_job
from psgd.partition import PartitionPlan
from psgd.server import build_shard


def assert_same(spec: str, **kwargs) -> DataShape:
    """describe_dataset(spec) gives the name, shape and class count load_dataset(spec) gives."""
    shape = describe_dataset(spec, **kwargs)
    ds = load_dataset(spec, **kwargs)
    assert (shape.name, shape.input_shape, shape.num_classes) == (ds.name, ds.input_shape, ds.num_classes)
    assert all(type(d) is int for d in shape.input_shape) and type(shape.num_classes) is int
    return shape


def assert_same_error(spec, **kwargs) -> str:
    """describe_dataset and load_dataset refuse the request with the same DataError; its message."""
    with pytest.raises(DataError) as loading:
        load_dataset(spec, **kwargs)
    with pytest.raises(DataError) as describing:
        describe_dataset(spec, **kwargs)
    assert str(describing.value) == str(loading.value)
    return str(loading.value)


# ---------------------------------------------------------------- digits and synthetic


def test_digits():
    shape = assert_same("digits")
    assert shape == DataShape("digits", (8, 8), 10)
    assert assert_same(" digits ", test_fraction=0.3, seed=4, dtype="float64") == shape


def test_digits_does_not_read_the_file(monkeypatch):
    def refuse():
        raise AssertionError("describe_dataset read the digits")

    monkeypatch.setattr(psgd.data.datasets, "read_digits", refuse)
    assert describe_dataset("digits") == DataShape("digits", (8, 8), 10)


def test_synthetic_defaults_and_options():
    assert assert_same("synthetic") == DataShape("synthetic", (64,), 10)
    small = dict(n_train=60, n_test=20, teacher_hidden=8, data_seed=3)
    assert assert_same("synthetic", input_dim=7, num_classes=3, **small) == DataShape("synthetic", (7,), 3)
    # strings from a command line or job file are accepted alike
    assert assert_same("synthetic", input_dim="5", num_classes="4", **small) == DataShape("synthetic", (5,), 4)


def test_synthetic_does_not_make_data(monkeypatch):
    def refuse(**options):
        raise AssertionError("describe_dataset made the data")

    monkeypatch.setattr(psgd.data.datasets, "make_synthetic", refuse)
    assert describe_dataset("synthetic", n_train=10**9, input_dim=3) == DataShape("synthetic", (3,), 10)


@pytest.mark.parametrize(
    "options",
    [
        {"input_dim": 0},
        {"num_classes": 1},
        {"num_classes": 2.5},
        {"n_train": True},
        {"n_test": "many"},
        {"data_seed": -1},
        {"colour": "red"},
        {"input_dim": 0, "width": 3},
    ],
)
def test_synthetic_bad_options(options):
    assert assert_same_error("synthetic", **options).startswith("synthetic: ")


# ---------------------------------------------------------------- IDX


def write(path: Path, data: bytes, gz: bool) -> None:
    path.write_bytes(gzip.compress(data) if gz else data)


def mnist_dir(
    root: Path, *, gz=False, n_train=30, n_test=10, shape=(4, 3), test_shape=None, num_labels=10, images_dtype="u1"
) -> Path:
    """An MNIST-format directory of random images and labels."""
    rng = np.random.default_rng(1)
    root.mkdir(exist_ok=True)
    files = {
        "train-images-idx3-ubyte": rng.integers(0, 100, (n_train, *shape)).astype(images_dtype),
        "train-labels-idx1-ubyte": rng.integers(0, num_labels, n_train).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 100, (n_test, *(test_shape or shape))).astype(images_dtype),
        "t10k-labels-idx1-ubyte": rng.integers(0, num_labels, n_test).astype(np.uint8),
    }
    for name, arr in files.items():
        write(root / (name + (".gz" if gz else "")), idx_bytes(arr), gz)
    return root


@pytest.mark.parametrize("gz", [False, True])
def test_idx(tmp_path, gz):
    root = mnist_dir(tmp_path / "m", gz=gz)
    assert assert_same(f"idx:{root}") == DataShape(f"idx:{root}", (4, 3), 10)
    root = mnist_dir(tmp_path / "wide", gz=gz, shape=(2, 3, 5), num_labels=26, n_train=300, images_dtype="f4")
    assert assert_same(f"idx:{root}") == DataShape(f"idx:{root}", (2, 3, 5), 26)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_images_are_not_read(tmp_path, gz):
    """Image files cut short after their header still describe; loading them fails."""
    root = mnist_dir(tmp_path, gz=gz, n_train=500, shape=(28, 28))
    for name, n in (("train-images-idx3-ubyte", 500), ("t10k-images-idx3-ubyte", 10)):
        data = idx_bytes(np.zeros((n, 28, 28), np.uint8))
        write(root / (name + (".gz" if gz else "")), data[: 16 + 100], gz)
    assert describe_dataset(f"idx:{root}") == DataShape(f"idx:{root}", (28, 28), 10)
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte(\.gz)?: IDX payload is 100 bytes .*truncated"):
        load_dataset(f"idx:{root}")


def test_idx_reads_images_only_through_the_header(tmp_path, monkeypatch):
    root = mnist_dir(tmp_path, gz=True)
    real = psgd.data.files.read_idx

    def labels_only(path):
        assert "labels" in str(path), f"describe_dataset read the images {path}"
        return real(path)

    monkeypatch.setattr(psgd.data.files, "read_idx", labels_only)
    assert describe_dataset(f"idx:{root}").input_shape == (4, 3)


def test_read_idx_header_reads_only_the_head(tmp_path):
    path = tmp_path / "big-idx3-ubyte.gz"
    data = idx_bytes(np.zeros((2000, 28, 28), np.uint8))
    path.write_bytes(gzip.compress(data)[:200])  # a gzip stream cut short far past the header
    header = read_idx_header(path)
    assert header.dims == (2000, 28, 28) and header.dtype == np.uint8 and header.nbytes == 16
    with pytest.raises(DataError, match="corrupt or truncated gzip"):
        psgd.data.read_idx(path)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_errors_are_the_same(tmp_path, gz):
    suffix = ".gz" if gz else ""
    root = mnist_dir(tmp_path / "shape", gz=gz, test_shape=(3, 4))
    assert "has images of shape (4, 3) but" in assert_same_error(f"idx:{root}")

    root = mnist_dir(tmp_path / "count", gz=gz)
    write(root / ("train-labels-idx1-ubyte" + suffix), idx_bytes(np.zeros(29, np.uint8)), gz)
    assert "has 29 labels but" in assert_same_error(f"idx:{root}")

    root = mnist_dir(tmp_path / "flat", gz=gz)
    write(root / ("t10k-images-idx3-ubyte" + suffix), idx_bytes(np.zeros(10, np.uint8)), gz)
    assert "at least 2 dimensions" in assert_same_error(f"idx:{root}")

    root = mnist_dir(tmp_path / "header", gz=gz)
    write(root / ("train-images-idx3-ubyte" + suffix), b"\x00\x00\x08\x03\x00\x00\x00\x0a", gz)
    assert "truncated IDX header" in assert_same_error(f"idx:{root}")
    write(root / ("train-images-idx3-ubyte" + suffix), b"PK\x03\x04 not idx", gz)
    assert "bad IDX magic" in assert_same_error(f"idx:{root}")

    root = mnist_dir(tmp_path / "labels", gz=gz)
    write(root / ("t10k-labels-idx1-ubyte" + suffix), idx_bytes(np.zeros((10, 2), np.uint8)), gz)
    assert "labels must be 1-D" in assert_same_error(f"idx:{root}")

    root = mnist_dir(tmp_path / "missing", gz=gz)
    (root / ("t10k-labels-idx1-ubyte" + suffix)).unlink()
    assert "no t10k-labels file" in assert_same_error(f"idx:{root}")
    assert "no such directory" in assert_same_error(f"idx:{tmp_path / 'nowhere'}")
    assert "is not a directory" in assert_same_error(f"idx:{root / ('train-images-idx3-ubyte' + suffix)}")


# ---------------------------------------------------------------- NPZ


def split_arrays(rng, n_train=30, n_test=10, row=(6,)):
    return dict(
        x_train=rng.standard_normal((n_train, *row)),
        y_train=rng.integers(0, 4, n_train),
        x_test=rng.standard_normal((n_test, *row)).astype(np.float32),
        y_test=rng.integers(0, 4, n_test).astype(np.int32),
    )


def test_npz_split_layout(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "d.npz"
    np.savez(path, **split_arrays(rng, row=(3, 2)))
    for spec in (str(path), f"npz:{path}"):
        assert assert_same(spec) == DataShape(f"npz:{path}", (3, 2), 4)
    np.savez_compressed(tmp_path / "k.npz", **split_arrays(rng), num_classes=np.int64(7))
    assert assert_same(str(tmp_path / "k.npz")) == DataShape(f"npz:{tmp_path / 'k.npz'}", (6,), 7)


def test_npz_x_y_layout(tmp_path):
    x = (np.arange(200 * 5) % 256).astype(np.uint8).reshape(200, 5)
    y = np.repeat(np.arange(4), 50)
    np.savez_compressed(tmp_path / "xy.npz", x=x, y=y.astype(np.float32))
    assert assert_same(str(tmp_path / "xy.npz"), test_fraction=0.25).input_shape == (5,)
    assert assert_same(str(tmp_path / "xy.npz")).num_classes == 4
    np.savez(tmp_path / "k.npz", x=x, y=y, num_classes=np.uint8(12))
    assert assert_same(str(tmp_path / "k.npz")).num_classes == 12
    assert "test_fraction must be in (0, 1)" in assert_same_error(str(tmp_path / "k.npz"), test_fraction=1.5)


def test_npz_inputs_are_not_read(tmp_path, monkeypatch):
    """A corrupt x (its CRC no longer matches) still describes; loading it fails."""
    path = tmp_path / "c.npz"
    x = np.full((100, 6), 7.25)
    np.savez(path, x=x, y=np.arange(100) % 3)  # stored, not compressed: x's bytes are in the file
    data = bytearray(path.read_bytes())
    at = data.find(np.full(8, 7.25).tobytes())
    data[at + 200] ^= 0xFF
    path.write_bytes(bytes(data))
    assert describe_dataset(str(path)) == DataShape(f"npz:{path}", (6,), 3)
    with pytest.raises(DataError, match=r"array 'x' is corrupt"):
        load_dataset(str(path))

    real = np.lib.format.read_array
    read = []

    def spy(fp, *args, **kwargs):
        out = real(fp, *args, **kwargs)
        read.append(out.ndim)
        return out

    np.savez(tmp_path / "s.npz", **split_arrays(np.random.default_rng(0)))
    monkeypatch.setattr(np.lib.format, "read_array", spy)
    describe_dataset(str(tmp_path / "s.npz"))
    assert read and all(ndim == 1 for ndim in read)  # only the labels


def test_npz_object_arrays_are_refused_without_unpickling(tmp_path, monkeypatch):
    def boom(*args, **kwargs):  # pragma: no cover - must not be called
        raise AssertionError("unpickled")

    np.savez(tmp_path / "x.npz", x=np.array([{"a": 1}, None], dtype=object), y=np.array([0, 1]), allow_pickle=True)
    np.savez(tmp_path / "y.npz", x=np.zeros((2, 3)), y=np.array([0, None], dtype=object), allow_pickle=True)
    np.savez(
        tmp_path / "extra.npz",
        x=np.zeros((2, 3)),
        y=np.array([0, 1]),
        note=np.array(["a", 1], dtype=object),
        allow_pickle=True,
    )
    with open(tmp_path / "p.npz", "wb") as f:
        pickle.dump({"x": np.zeros((2, 3)), "y": np.array([0, 1])}, f)
    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "load", boom)
    for name, key in (("x", "x"), ("y", "y"), ("extra", "note")):
        msg = assert_same_error(str(tmp_path / f"{name}.npz"))
        assert f"array {key!r} is an object array; psgd never unpickles data" in msg
    assert "is a Python pickle" in assert_same_error(str(tmp_path / "p.npz"))
    with pytest.raises(DataError, match="object array"):
        read_npz_headers(tmp_path / "x.npz")


def test_npz_errors_are_the_same(tmp_path):
    def npz(name, **arrays):
        np.savez(tmp_path / name, **arrays)
        return str(tmp_path / name)

    cases = {
        "missing key(s) y_test": npz(
            "m.npz", x_train=np.zeros((3, 2)), y_train=np.zeros(3, int), x_test=np.zeros((1, 2))
        ),
        "found: images": npz("n.npz", images=np.zeros((3, 2))),
        "x has 5 rows but y has 4 targets": npz("l.npz", x=np.zeros((5, 2)), y=np.zeros(4, int)),
        "must have shape (n, features...)": npz("v.npz", x=np.zeros(5), y=np.zeros(5, int)),
        "class labels must be integers": npz(
            "f.npz", x=np.zeros((4, 2)), y=np.array([0.0, 1.5, 1.0, 0.0]), target=np.array("classes")
        ),
        "look like one-hot rows": npz("o.npz", x=np.zeros((2, 2)), y=np.eye(2)),
        "target must be a string": npz("t.npz", x=np.zeros((2, 2)), y=np.zeros(2), target=np.int64(1)),
        "inputs must be numeric": npz("b.npz", x=np.zeros((2, 2), bool), y=np.array([0, 1])),
        "x_train rows have shape (2,) but x_test rows (3,)": npz(
            "r.npz",
            x_train=np.zeros((3, 2)),
            y_train=np.zeros(3, int),
            x_test=np.zeros((1, 3)),
            y_test=np.zeros(1, int),
        ),
        "num_classes is 2 but a label is 3": npz("k.npz", x=np.zeros((4, 2)), y=np.arange(4), num_classes=np.int64(2)),
        "num_classes must be a scalar integer": npz(
            "q.npz", x=np.zeros((4, 2)), y=np.arange(4), num_classes=np.array([5, 6])
        ),
        "no labels at all": npz(
            "e.npz",
            x_train=np.zeros((0, 2)),
            y_train=np.zeros(0, int),
            x_test=np.zeros((0, 2)),
            y_test=np.zeros(0, int),
        ),
    }
    (tmp_path / "junk.npz").write_bytes(b"this is not a zip archive at all")
    cases["not an .npz archive"] = str(tmp_path / "junk.npz")
    np.save(tmp_path / "single.npy", np.zeros(3))
    cases["single .npy array"] = f"npz:{tmp_path / 'single.npy'}"
    cases["absent.npz: no such file"] = str(tmp_path / "absent.npz")
    cases["is a directory"] = f"npz:{tmp_path}"
    for expected, spec in cases.items():
        assert expected in assert_same_error(spec), spec


# ---------------------------------------------------------------- specs


@pytest.mark.parametrize(
    "spec, kwargs",
    [
        ("mnist", {}),
        ("", {}),
        ("   ", {}),
        (3, {}),
        ("idx:", {}),
        ("npz: ", {}),
        ("digits", {"dtype": "int32"}),
        ("digits", {"seed": "x"}),
        ("digits", {"test_fraction": 0}),
        ("digits", {"n_train": 10}),
        ("idx:/nowhere", {"input_dim": 3}),
        ("x.npz", {"num_classes": 3}),
    ],
)
def test_bad_specs_give_the_same_error(spec, kwargs):
    assert_same_error(spec, **kwargs)


# ---------------------------------------------------------------- shards


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("model.name=softmax", "train.dtype=float64"),
        ("data.name=synthetic", "data.input_dim=12", "data.num_classes=3"),
    ],
)
def test_build_shard_does_not_load_the_dataset(sets, monkeypatch):
    job = make_job("model.hidden=[16]", "cluster.shards=2", "cluster.slice_bytes=512", *sets)
    built = build_job(job)  # what a trainer builds, from the loaded data
    want = PartitionPlan(built.model.specs(), 2, 512)
    init = built.model.init(job.train.seed)

    def refuse(*args, **kwargs):
        raise AssertionError("a shard loaded the dataset")

    for module, name in (
        (psgd.data, "load_dataset"),
        (psgd.data.datasets, "load_dataset"),
        (psgd.data.datasets, "read_digits"),
        (psgd.data.datasets, "make_synthetic"),
    ):
        monkeypatch.setattr(module, name, refuse)
    for k in range(2):
        core = build_shard(describe_job(job), k)
        assert core.plan.hash == want.hash
        for s, w in slice_weights(core):
            np.testing.assert_array_equal(w, init[s.var].reshape(-1)[s.start : s.stop])


def test_build_shard_from_idx_headers(tmp_path):
    mnist_dir(tmp_path, shape=(5, 5))
    for name in ("train-images-idx3-ubyte", "t10k-images-idx3-ubyte"):
        path = tmp_path / name
        path.write_bytes(path.read_bytes()[:16])  # images gone: only their headers are left
    core = build_shard(describe_job(make_job(f"data.name=idx:{tmp_path}", "model.hidden=[8]", "cluster.shards=1")), 0)
    assert sum(s.size for s in core.slices.values()) == 25 * 8 + 8 + 8 * 10 + 10
