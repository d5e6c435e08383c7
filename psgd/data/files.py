"""Datasets in files: MNIST-format IDX files in a folder (``idx:DIR``) and ``.npz`` archives (``npz:PATH``), each
loaded whole (:func:`load_idx_dir`, :func:`load_npz`) or described from its headers and labels alone
(:func:`describe_idx_dir`, :func:`describe_npz`), with the same errors.  Nothing is unpickled."""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence

import numpy as np

from psgd.data.base import DataError, Dataset, DataShape, check_test_fraction, held_out, outputs_for, read_targets
from psgd.data.readers import read_idx, read_idx_header, read_npz, read_npz_headers

# (logical name, IDX kind) of the four files of an MNIST-format directory.
IDX_FILES = (
    ("train-images", "idx3"),
    ("train-labels", "idx1"),
    ("t10k-images", "idx3"),
    ("t10k-labels", "idx1"),
)


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
    if labels.ndim != 1:
        raise DataError(f"{labels_path}: labels must be 1-D, got shape {labels.shape}")
    y, _ = read_targets(labels, labels_path, "classes")
    if len(y) != images_shape[0]:
        raise DataError(f"{labels_path} has {len(y)} labels but {images_path} has {images_shape[0]} images")
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

    With only ``x, y``, ``test_fraction`` of each class (of the examples, for targets other than one class each)
    is held out by a fixed permutation.  ``x`` of dtype uint8 is scaled by /255, other numeric types are cast to
    float.  An optional scalar ``num_classes`` overrides the default of the largest label + 1; an optional string
    ``target`` (``classes``, ``labels`` or ``values``) says what the targets are, else it is worked out from them
    (:func:`psgd.data.base.read_targets`).
    """
    path = os.fspath(path)
    arrays = read_npz(path)
    pairs = _npz_layout(path, arrays)
    target = _npz_target(path, arrays.get("target"))
    if len(pairs) == 2:
        x_train, y_train, target = _npz_pair(path, arrays, *pairs[0], target)
        x_test, y_test, _ = _npz_pair(path, arrays, *pairs[1], target)
        _npz_same_rows(path, x_train.shape, x_test.shape)
    else:
        x, y, target = _npz_pair(path, arrays, *pairs[0], target)
        train, test = held_out(y, check_test_fraction(test_fraction, path), target)
        x_train, y_train, x_test, y_test = x[train], y[train], x[test], y[test]
    num_classes = _npz_num_classes(path, (y_train, y_test), arrays.get("num_classes"), target)
    return Dataset(f"npz:{path}", x_train, y_train, x_test, y_test, num_classes, x_train.shape[1:], target=target)


def describe_npz(path: str | os.PathLike[str], *, test_fraction: float = 0.2) -> DataShape:
    """What :func:`load_npz` would give as shape and classes, from the ``.npy`` headers and the labels.

    The inputs are never read; object arrays are refused from their headers, so nothing is unpickled.
    """
    path = os.fspath(path)
    headers = read_npz_headers(path)
    pairs = _npz_layout(path, headers)
    wanted = [ykey for _, ykey in pairs] + [k for k in ("num_classes", "target") if k in headers]
    arrays = read_npz(path, wanted)
    target = _npz_target(path, arrays.get("target"))
    ys = []
    for xkey, ykey in pairs:
        x = headers[xkey]
        y, target = _npz_labels(path, xkey, x.shape, ykey, arrays[ykey], target)
        ys.append(y)
        _check_numeric(x.dtype, f"{path}: {xkey}")
    if len(pairs) == 2:
        _npz_same_rows(path, headers["x_train"].shape, headers["x_test"].shape)
    else:
        check_test_fraction(test_fraction, path)
    num_classes = _npz_num_classes(path, ys, arrays.get("num_classes"), target)
    return DataShape(
        f"npz:{path}", headers[pairs[0][0]].shape[1:], num_classes, target=target, target_shape=tuple(ys[0].shape[1:])
    )


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
    raise DataError(f"{path}: an .npz needs arrays x_train, y_train, x_test, y_test (or just x, y); found: {found}")


def _npz_pair(
    path: str, arrays: dict[str, np.ndarray], xkey: str, ykey: str, target: str | None
) -> tuple[np.ndarray, np.ndarray, str]:
    x = arrays[xkey]
    y, target = _npz_labels(path, xkey, x.shape, ykey, arrays[ykey], target)
    return _scale_inputs(x, f"{path}: {xkey}"), y, target


def _npz_labels(
    path: str, xkey: str, xshape: tuple[int, ...], ykey: str, y: np.ndarray, target: str | None
) -> tuple[np.ndarray, str]:
    """The targets ``y`` for inputs of ``xshape`` (rows first), checked against them, and their kind."""
    if len(xshape) < 2:
        raise DataError(f"{path}: {xkey} must have shape (n, features...), got {xshape}")
    y, target = read_targets(y, f"{path}: {ykey}", target)
    if xshape[0] != len(y):
        raise DataError(f"{path}: {xkey} has {xshape[0]} rows but {ykey} has {len(y)} targets")
    return y, target


def _npz_target(path: str, value: np.ndarray | None) -> str | None:
    """The archive's ``target`` (a string array of one), or None where it has none."""
    if value is None:
        return None
    if value.shape != () or value.dtype.kind != "U":
        raise DataError(f"{path}: target must be a string (classes, labels or values), got {value.dtype} {value.shape}")
    return str(value)


def _npz_same_rows(path: str, train: tuple[int, ...], test: tuple[int, ...]) -> None:
    if train[1:] != test[1:]:
        raise DataError(f"{path}: x_train rows have shape {train[1:]} but x_test rows {test[1:]}")


def _npz_num_classes(path: str, ys: Sequence[np.ndarray], value: np.ndarray | None, target: str) -> int:
    """The largest label + 1, or the archive's scalar ``num_classes`` (``value``) when it has one; for labels or
    values, the model's outputs they want."""
    if target != "classes":
        return outputs_for(ys, target, path)
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
