"""The in-memory dataset every loader returns, its error type, and the fixed split.

Every process of a run (each worker, the evaluator) loads the dataset on its
own, so loading must be a pure function of the spec and the options: held-out
splits use a fixed permutation that does not depend on the run's seed, and
synthetic data depends only on its ``data_seed``.  The run's seed only
shuffles the training order, in :mod:`psgd.data.sharding`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from psgd.errors import InputError

# Seed of the permutation behind every held-out split.  Changing it changes
# which examples are held out, for every dataset: do not.
SPLIT_SEED = 0x5EED_5E7


#: What a dataset's targets are: ``classes`` (integer class indices, one per example or one per position of a
#: sequence), ``labels`` (several yes-or-no labels per example, 0 or 1), ``values`` (numbers to predict: regression)
TARGETS = ("classes", "labels", "values")
#: the score each kind of target is judged by on the held-out split, and its key in the metrics records
METRICS = {"classes": "accuracy", "labels": "accuracy", "values": "r2"}
SCORE_WORDS = {"accuracy": "test accuracy", "r2": "test R²"}
SCORE_KEYS = {"accuracy": "test_accuracy", "r2": "test_r2"}


def scores_of(metric: str, value: float) -> dict[str, float | None]:
    """Every score's key (:data:`SCORE_KEYS`): ``value`` under the one ``metric`` names, None under the others."""
    return {**dict.fromkeys(SCORE_KEYS.values()), SCORE_KEYS[metric]: value}


class DataError(InputError):
    """A dataset could not be loaded or sharded; the message names the file or name."""


@dataclasses.dataclass
class Dataset:
    """Training and held-out arrays on the host, plus what a model needs to know.

    ``x_*`` are floating arrays of shape ``(n, *input_shape)``; ``y_*`` are the targets, of shape
    ``(n, *target_shape)``, as ``target`` says (:data:`TARGETS`): ``classes``, integer class indices in
    ``[0, num_classes)`` (one per example, or one per position of a sequence); ``labels``, ``num_classes`` labels
    of 0 or 1 per example; ``values``, floating numbers to predict, ``num_classes`` of them per example (the
    width of a model's output, whatever the kind).  A dataset with categorical features also has ``ids_*``,
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
    target: str = "classes"

    @property
    def target_shape(self) -> tuple[int, ...]:
        """The shape of one example's target: () for one class or value, (T,) for a sequence, (K,) for labels."""
        return tuple(self.y_train.shape[1:])

    @property
    def metric(self) -> str:
        """What the held-out split is scored by: ``accuracy`` (classes, labels) or ``r2`` (values)."""
        return METRICS[self.target]

    @property
    def score_key(self) -> str:
        """The score's key in the metrics records and results: ``test_accuracy`` or ``test_r2``."""
        return SCORE_KEYS[self.metric]

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
                raise DataError(
                    f"{self.name}: ids_{split} must be int64 of shape ({len(x)}, "
                    f"*{self.ids_train.shape[1:]}), got {ids.dtype} {ids.shape}"
                )
        if self.target not in TARGETS:
            raise DataError(f"{self.name}: target must be one of {', '.join(TARGETS)}, got {self.target!r}")
        for split in ("train", "test"):
            x, y = getattr(self, "x_" + split), getattr(self, "y_" + split)
            if x.shape[1:] != self.input_shape:
                raise DataError(f"{self.name}: x_{split} has shape {x.shape}, expected (n, *{self.input_shape})")
            if y.ndim < 1 or len(y) != len(x) or y.shape[1:] != self.target_shape:
                raise DataError(
                    f"{self.name}: y_{split} has shape {y.shape}, expected ({len(x)}, *{self.target_shape})"
                )
            _check_kind(self.name, f"y_{split}", y, self.target, self.num_classes)

    @property
    def n_train(self) -> int:
        return int(len(self.x_train))

    @property
    def n_test(self) -> int:
        return int(len(self.x_test))

    def astype(self, dtype: Any) -> Dataset:
        """A copy with the inputs cast to ``dtype``, and the targets too where they are labels or values (class
        indices unchanged)."""
        dt = float_dtype(dtype, self.name)
        ys = (
            {}
            if self.target == "classes"
            else {"y_train": self.y_train.astype(dt, copy=False), "y_test": self.y_test.astype(dt, copy=False)}
        )
        return dataclasses.replace(
            self, x_train=self.x_train.astype(dt, copy=False), x_test=self.x_test.astype(dt, copy=False), **ys
        )

    def describe(self) -> str:
        """One line for logs."""
        ids = f", ids {self.id_shape}" if self.id_shape is not None else ""
        return (
            f"{self.name}: {self.n_train} train / {self.n_test} test, "
            f"input {self.input_shape} {self.x_train.dtype}{ids}, {self.targets_said()}"
        )

    def targets_said(self) -> str:
        """``10 classes``, ``16 classes per position, targets of shape (16,)``, ``4 labels per example``..."""
        per = f" of shape {self.target_shape}" if self.target_shape else ""
        if self.target == "classes":
            return f"{self.num_classes} classes" + (f" per position, targets{per}" if self.target_shape else "")
        return f"{self.num_classes} {self.target} per example" + (per if self.target == "values" else "")


def _check_kind(name: str, where: str, y: Any, target: str, num_classes: int) -> None:
    """The dtype and width a kind of target needs (the values themselves are checked where they are read)."""
    if target == "classes" and y.dtype.kind not in "iu":
        raise DataError(f"{name}: {where} must hold integer class indices, got {y.dtype}")
    if target == "labels" and (y.ndim != 2 or y.shape[1] != num_classes):
        raise DataError(f"{name}: {where} must hold {num_classes} labels per example, got shape {y.shape}")
    if target == "values":
        if y.dtype.kind != "f":
            raise DataError(f"{name}: {where} must hold floating values, got {y.dtype}")
        if math.prod(y.shape[1:]) != num_classes:
            raise DataError(
                f"{name}: {where} holds {math.prod(y.shape[1:])} values per example, but num_classes "
                f"(the model's outputs) is {num_classes}"
            )


@dataclasses.dataclass(frozen=True)
class DataShape:
    """What a model needs to know of a dataset: the shape of one input, the number of classes (the width of a
    model's output), the shape of one example's ids where it has categorical ones, and what its targets are
    (:attr:`Dataset.target`, :attr:`Dataset.target_shape`)."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    id_shape: tuple[int, ...] | None = None
    target: str = "classes"
    target_shape: tuple[int, ...] = ()


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


def held_out(y: np.ndarray, test_fraction: float, target: str = "classes") -> tuple[np.ndarray, np.ndarray]:
    """Fixed train/test indices: :func:`stratified_split` for one class per example; otherwise
    ``test_fraction`` of the examples (at least one, and one left to train on), by the same fixed permutation."""
    if target == "classes" and y.ndim == 1:
        return stratified_split(y, test_fraction)
    n = len(y)
    perm = np.random.default_rng(SPLIT_SEED).permutation(n)
    k = min(max(int(np.floor(test_fraction * n + 0.5)), 1), n - 1) if n > 1 else 0
    return perm[k:], perm[:k]


def read_targets(y: Any, where: str, target: str | None = None) -> tuple[np.ndarray, str]:
    """Check the targets ``y`` (one row per example) as the kind ``target`` (:data:`TARGETS`) wants them; return
    them (class indices as int64) and their kind.

    Without ``target`` the kind is worked out: integers (or floats that are all whole numbers, as many tools
    save labels) are classes, one per example or one per position; other floats are values.  Several labels per
    example (0 or 1 each) must be asked for as ``labels``: rows of 0s and 1s summing to one are refused unless
    named, as one-hot rows and labels look alike.  Anything else is a DataError naming ``where``.
    """
    y = np.asarray(y)
    if y.ndim < 1:
        raise DataError(f"{where}: targets must have one row per example, got a scalar")
    if target is not None and target not in TARGETS:
        raise DataError(f"{where}: target must be one of {', '.join(TARGETS)}, got {target!r}")
    if y.dtype.kind not in "biuf":
        raise DataError(f"{where}: targets must be numbers, got dtype {y.dtype}")
    whole = y.dtype.kind in "biu" or bool(np.all(np.isfinite(y)) and np.all(y == np.round(y)))
    if target is None:
        target = "classes" if whole else "values"
        if whole and y.ndim == 2 and y.shape[1] > 1 and np.isin(y, (0, 1)).all() and (y.sum(axis=1) == 1).all():
            raise DataError(
                f"{where}: the targets look like one-hot rows; give class indices (y.argmax(axis=1)), "
                "or say target='labels' for several labels per example, or target='classes' for a "
                "class per position"
            )
    if target == "classes":
        if not whole:
            raise DataError(f"{where}: class labels must be integers, found non-integer values")
        out = y.astype(np.int64)
        if out.size and out.min() < 0:
            raise DataError(f"{where}: class labels must be >= 0, found {int(out.min())}")
        return out, target
    if target == "labels":
        if y.ndim != 2 or not np.isin(y, (0, 1)).all():
            raise DataError(f"{where}: labels must be rows of 0s and 1s (n, labels), got {y.dtype} {y.shape}")
        return y.astype(np.float32), target
    if y.dtype.kind != "f":
        y = y.astype(np.float32)
    if not np.all(np.isfinite(y)):
        raise DataError(f"{where}: target values contain NaN or infinite values")
    return y, target


def outputs_for(ys: Sequence[np.ndarray], target: str, where: str, num_classes: Any = None) -> int:
    """The width of a model's output the targets ``ys`` (each split's) want: the classes (the largest + 1, or
    ``num_classes`` where given, at least two), the labels, or the values per example."""
    if target == "labels":
        return int(ys[0].shape[1])
    if target == "values":
        return int(math.prod(ys[0].shape[1:]))
    top = int(max(y.max(initial=0) for y in ys)) + 1
    if num_classes is None:
        num_classes = top
    elif int(num_classes) < top:
        raise DataError(f"{where}: num_classes={num_classes}, but a label is {top - 1}")
    if int(num_classes) < 2:
        raise DataError(f"{where}: needs at least two classes, its labels are all {top - 1}")
    return int(num_classes)
