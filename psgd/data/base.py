"""The in-memory dataset every loader returns, its error type, and the fixed split.

Every process of a run (each worker, the evaluator) loads the dataset on its
own, so loading must be a pure function of the spec and the options: held-out
splits use a fixed permutation that does not depend on the run's seed, and
synthetic data depends only on its ``data_seed``.  The run's seed only
shuffles the training order, in :mod:`psgd.data.sharding`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from psgd.errors import InputError

# Seed of the permutation behind every held-out split.  Changing it changes
# which examples are held out, for every dataset: do not.
SPLIT_SEED = 0x5EED_5E7


class DataError(InputError):
    """A dataset could not be loaded or sharded; the message names the file or name."""


@dataclasses.dataclass
class Dataset:
    """Training and held-out arrays on the host, plus what a model needs to know.

    ``x_*`` are floating arrays of shape ``(n, *input_shape)``; ``y_*`` are
    int64 class indices in ``[0, num_classes)``.  A dataset with categorical features also has ``ids_*``,
    int64 arrays of shape ``(n, *id_shape)`` (any int64: hashed feature values), which a model of embedding
    tables looks up (:mod:`psgd.model.embed`); ``id_shape`` is None where there are none.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    ids_train: np.ndarray | None = None
    ids_test: np.ndarray | None = None

    @property
    def id_shape(self) -> tuple[int, ...] | None:
        return None if self.ids_train is None else tuple(self.ids_train.shape[1:])

    def __post_init__(self) -> None:
        self.input_shape = tuple(int(d) for d in self.input_shape)
        self.num_classes = int(self.num_classes)
        if (self.ids_train is None) != (self.ids_test is None):
            raise DataError(f"{self.name}: ids for one split only")
        for split in ("train", "test") if self.ids_train is not None else ():
            ids, x = getattr(self, "ids_" + split), getattr(self, "x_" + split)
            if ids.dtype != np.int64 or len(ids) != len(x) or ids.shape[1:] != self.ids_train.shape[1:]:
                raise DataError(f"{self.name}: ids_{split} must be int64 of shape ({len(x)}, "
                                f"*{self.ids_train.shape[1:]}), got {ids.dtype} {ids.shape}")
        for split in ("train", "test"):
            x, y = getattr(self, "x_" + split), getattr(self, "y_" + split)
            if x.shape[1:] != self.input_shape:
                raise DataError(
                    f"{self.name}: x_{split} has shape {x.shape}, "
                    f"expected (n, *{self.input_shape})"
                )
            if y.ndim != 1 or len(y) != len(x):
                raise DataError(
                    f"{self.name}: y_{split} has shape {y.shape}, expected ({len(x)},)"
                )

    @property
    def n_train(self) -> int:
        return int(len(self.x_train))

    @property
    def n_test(self) -> int:
        return int(len(self.x_test))

    def astype(self, dtype: Any) -> Dataset:
        """A copy with ``x_train`` and ``x_test`` cast to ``dtype`` (labels unchanged)."""
        dt = float_dtype(dtype, self.name)
        return dataclasses.replace(
            self,
            x_train=self.x_train.astype(dt, copy=False),
            x_test=self.x_test.astype(dt, copy=False),
        )

    def describe(self) -> str:
        """One line for logs."""
        ids = f", ids {self.id_shape}" if self.id_shape is not None else ""
        return (
            f"{self.name}: {self.n_train} train / {self.n_test} test, "
            f"input {self.input_shape} {self.x_train.dtype}{ids}, {self.num_classes} classes"
        )


def float_dtype(dtype: Any, name: str) -> np.dtype:
    """``np.dtype(dtype)``, which must be a floating type; DataError otherwise."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise DataError(f"{name}: dtype {dtype!r} is not a NumPy dtype") from exc
    if dt.kind != "f":
        raise DataError(f"{name}: dtype must be a floating type (float32, float64...), got {dt}")
    return dt


def check_test_fraction(test_fraction: float, name: str) -> float:
    try:
        f = float(test_fraction)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{name}: test_fraction must be a number, got {test_fraction!r}") from exc
    if not 0.0 < f < 1.0:
        raise DataError(f"{name}: test_fraction must be in (0, 1), got {test_fraction!r}")
    return f


def stratified_split(y: np.ndarray, test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Fixed train/test indices holding out ``test_fraction`` of each class.

    Each class with ``n_c`` examples gives ``round(test_fraction * n_c)`` of
    them to the test side, at least one and at most ``n_c - 1`` (a class with a
    single example stays in training).  Which ones is decided by a permutation
    with a fixed seed, never the run's seed, so every process and every run
    holds out the same examples.  Both index arrays are in that permuted order,
    so neither side is sorted by class.
    """
    y = np.asarray(y)
    n = len(y)
    perm = np.random.default_rng(SPLIT_SEED).permutation(n)
    # group the permuted examples by class, keeping the permuted order inside each class
    by_class = perm[np.argsort(y[perm], kind="stable")]
    _, first, counts = np.unique(y[by_class], return_index=True, return_counts=True)
    k = np.floor(test_fraction * counts + 0.5).astype(np.int64)
    k = np.where(counts < 2, 0, np.clip(k, 1, counts - 1))  # held out per class
    rank_in_class = np.arange(n) - np.repeat(first, counts)
    is_test = np.zeros(n, dtype=bool)
    is_test[by_class] = rank_in_class < np.repeat(k, counts)
    return perm[~is_test[perm]], perm[is_test[perm]]


def labels_to_int64(y: np.ndarray, where: str) -> np.ndarray:
    """Check that ``y`` holds non-negative integer class indices; return them as int64.

    Floating labels are accepted when every value is integral (many tools
    save labels as floats); anything else is a DataError naming ``where``.
    """
    if y.ndim != 1:
        hint = " (class indices, not one-hot rows)" if y.ndim == 2 and y.shape[1] > 1 else ""
        raise DataError(f"{where}: labels must be 1-D{hint}, got shape {y.shape}")
    if y.dtype.kind in "iu":
        out = y.astype(np.int64)
    elif y.dtype.kind == "f":
        if not np.all(np.isfinite(y)) or not np.all(y == np.round(y)):
            raise DataError(f"{where}: labels must be integers, found non-integer values")
        out = y.astype(np.int64)
    else:
        raise DataError(f"{where}: labels must be integers, got dtype {y.dtype}")
    if out.size and out.min() < 0:
        raise DataError(f"{where}: labels must be >= 0, found {int(out.min())}")
    return out
