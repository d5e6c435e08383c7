"""``load_dataset(spec)``: one entry point for every dataset psgd can train on.

Specs:

- ``digits``: the bundled UCI handwritten digits (1797 8x8 images, 10 classes).
- ``synthetic``: teacher-network data of any size (see :mod:`psgd.data.synthetic`).
- ``idx:DIR``: MNIST-format IDX files in ``DIR``.
- ``npz:PATH``, or any spec ending in ``.npz``: arrays in an ``.npz`` archive.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from psgd.data.base import (
    DataError,
    Dataset,
    check_test_fraction,
    float_dtype,
    labels_to_int64,
    stratified_split,
)
from psgd.data.readers import read_digits, read_idx, read_npz
from psgd.data.synthetic import make_synthetic

ACCEPTED_SPECS = (
    "'digits' (bundled 8x8 handwritten digits), "
    "'synthetic' (teacher-network data; options n_train, n_test, input_dim, num_classes, "
    "teacher_hidden, data_seed), "
    "'idx:DIR' (MNIST-format IDX files in DIR), "
    "'npz:PATH' or 'PATH.npz' (arrays x_train, y_train, x_test, y_test, or x, y)"
)

SYNTHETIC_OPTIONS = ("n_train", "n_test", "input_dim", "num_classes", "teacher_hidden", "data_seed")

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
    if not isinstance(spec, str) or not spec.strip():
        raise DataError(f"dataset spec must be a non-empty string, got {spec!r}; accepted: {ACCEPTED_SPECS}")
    spec = spec.strip()
    dt = float_dtype(dtype, spec)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise DataError(f"{spec}: seed must be an integer, got {seed!r}")
    kind, path = _parse_spec(spec)
    if kind == "digits":
        _no_options(spec, options)
        ds = _load_digits(check_test_fraction(test_fraction, spec))
    elif kind == "synthetic":
        unknown = sorted(set(options) - set(SYNTHETIC_OPTIONS))
        if unknown:
            raise DataError(
                f"synthetic: unknown option(s) {', '.join(unknown)}; accepted: {', '.join(SYNTHETIC_OPTIONS)}"
            )
        ds = _load_synthetic(**options)
    elif kind == "idx":
        _no_options(spec, options)
        ds = load_idx_dir(path)
    else:
        _no_options(spec, options)
        ds = load_npz(path, test_fraction=test_fraction)
    return ds.astype(dt)


def _parse_spec(spec: str) -> tuple[str, str]:
    name = spec.lower()
    if name in ("digits", "synthetic"):
        return name, ""
    for prefix in ("idx", "npz"):
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


def _load_digits(test_fraction: float) -> Dataset:
    pixels, labels = read_digits()
    x = (pixels / 16.0).astype(np.float32)
    train, test = stratified_split(labels, test_fraction)
    return Dataset("digits", x[train], labels[train], x[test], labels[test], 10, (8, 8))


def _load_synthetic(**options: Any) -> Dataset:
    x_train, y_train, x_test, y_test = make_synthetic(**options)
    num_classes = int(options.get("num_classes", 10))
    return Dataset("synthetic", x_train, y_train, x_test, y_test, num_classes, x_train.shape[1:])


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
    directory = os.fspath(directory)
    if not os.path.exists(directory):
        raise DataError(f"{directory}: no such directory")
    if not os.path.isdir(directory):
        raise DataError(f"{directory}: is not a directory; idx:DIR wants the directory holding the IDX files")
    paths = [find_idx_file(directory, stem, kind) for stem, kind in IDX_FILES]
    x_train, y_train = _idx_pair(paths[0], paths[1])
    x_test, y_test = _idx_pair(paths[2], paths[3])
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(
            f"{paths[0]} has images of shape {x_train.shape[1:]} but {paths[2]} has {x_test.shape[1:]}"
        )
    top = int(max(y_train.max(initial=0), y_test.max(initial=0)))
    num_classes = 10 if top <= 9 else top + 1
    name = f"idx:{directory}"
    return Dataset(name, x_train, y_train, x_test, y_test, num_classes, x_train.shape[1:])


def _idx_pair(images_path: str, labels_path: str) -> tuple[np.ndarray, np.ndarray]:
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.ndim < 2:
        raise DataError(f"{images_path}: images must have at least 2 dimensions (count, ...), got {images.shape}")
    y = labels_to_int64(labels, labels_path)
    if len(y) != len(images):
        raise DataError(
            f"{labels_path} has {len(y)} labels but {images_path} has {len(images)} images"
        )
    x = _scale_inputs(images, images_path)
    return x, y


def _scale_inputs(x: np.ndarray, where: str) -> np.ndarray:
    """float32 inputs: uint8 scaled to [0, 1] by /255, other numeric types cast; must be finite."""
    if x.dtype == np.uint8:
        return x.astype(np.float32) / np.float32(255.0)
    if x.dtype.kind not in "iuf":
        raise DataError(f"{where}: inputs must be numeric, got dtype {x.dtype}")
    out = x.astype(np.float32)
    if out.dtype.kind == "f" and not np.all(np.isfinite(out)):
        raise DataError(f"{where}: inputs contain NaN or infinite values")
    return out


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
    found = ", ".join(sorted(arrays)) or "none"
    if any(k in arrays for k in _NPZ_SPLIT_KEYS):
        missing = [k for k in _NPZ_SPLIT_KEYS if k not in arrays]
        if missing:
            raise DataError(
                f"{path}: missing key(s) {', '.join(missing)}; an .npz needs x_train, y_train, x_test, y_test "
                f"(or just x, y); found: {found}"
            )
        x_train, y_train = _npz_pair(path, arrays, "x_train", "y_train")
        x_test, y_test = _npz_pair(path, arrays, "x_test", "y_test")
        if x_train.shape[1:] != x_test.shape[1:]:
            raise DataError(f"{path}: x_train rows have shape {x_train.shape[1:]} but x_test rows {x_test.shape[1:]}")
    elif "x" in arrays and "y" in arrays:
        x, y = _npz_pair(path, arrays, "x", "y")
        train, test = stratified_split(y, check_test_fraction(test_fraction, path))
        x_train, y_train, x_test, y_test = x[train], y[train], x[test], y[test]
    else:
        raise DataError(
            f"{path}: an .npz needs arrays x_train, y_train, x_test, y_test (or just x, y); found: {found}"
        )
    top = int(max(y_train.max(initial=-1), y_test.max(initial=-1)))
    num_classes = top + 1
    if "num_classes" in arrays:
        num_classes = _npz_num_classes(path, arrays["num_classes"], top)
    if num_classes < 1:
        raise DataError(f"{path}: no labels at all")
    return Dataset(f"npz:{path}", x_train, y_train, x_test, y_test, num_classes, x_train.shape[1:])


def _npz_pair(path: str, arrays: dict[str, np.ndarray], xkey: str, ykey: str) -> tuple[np.ndarray, np.ndarray]:
    x, y = arrays[xkey], arrays[ykey]
    if x.ndim < 2:
        raise DataError(f"{path}: {xkey} must have shape (n, features...), got {x.shape}")
    y = labels_to_int64(y, f"{path}: {ykey}")
    if len(x) != len(y):
        raise DataError(f"{path}: {xkey} has {len(x)} rows but {ykey} has {len(y)} labels")
    return _scale_inputs(x, f"{path}: {xkey}"), y


def _npz_num_classes(path: str, value: np.ndarray, top: int) -> int:
    if value.shape != () or value.dtype.kind not in "iu":
        raise DataError(f"{path}: num_classes must be a scalar integer, got {value.dtype} {value.shape}")
    n = int(value)
    if n <= top:
        raise DataError(f"{path}: num_classes is {n} but a label is {top}")
    return n

