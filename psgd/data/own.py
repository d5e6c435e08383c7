"""A user's own data as a :class:`~psgd.data.Dataset`: arrays, any map-style dataset (``len(d)`` examples,
``d[i]`` the i-th as ``(x, y)``), as PyTorch's ``Dataset`` is, or an iterable factory (a function that returns a
new iterator over the ``(x, y)`` pairs each time it is called, as a generator function does).

The examples are read once, in order, into arrays on the host: the whole of it must fit in memory.  Inputs become
the job's float dtype.  The targets are classes (integers from 0, one per example or one per position), labels
(several 0-or-1 per example) or values (floats: regression), as ``target=`` says or as they look
(:func:`psgd.data.base.read_targets`).  Without a held-out part of its own, a fixed share of each class (of the
examples, for other targets) is held out by the fixed permutation every psgd dataset uses
(:func:`psgd.data.stratified_split`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psgd.data.base import DataError, Dataset, check_test_fraction, float_dtype, held_out, outputs_for, read_targets


def dataset_from(
    data: Any,
    test: Any = None,
    *,
    test_fraction: float = 0.2,
    num_classes: int | None = None,
    dtype: Any = "float32",
    name: str | None = None,
    target: str | None = None,
) -> Dataset:
    """``data`` as a :class:`Dataset`: a ``Dataset`` as it is; a pair of arrays ``(x, y)``; a map-style dataset;
    an iterable factory.

    ``test``: the held-out examples, in the same forms (else ``test_fraction`` of ``data`` is held out).
    ``num_classes``: the number of classes (else the largest label + 1).  ``name``: what logs call it (else the
    class of ``data``).  ``target``: ``"classes"``, ``"labels"`` or ``"values"`` (else worked out from the
    targets: whole numbers are classes, other floats values)."""
    if isinstance(data, Dataset):
        if test is not None:
            raise DataError(f"{data.name}: a Dataset holds its own held-out split; give no test= beside it")
        return data
    label = name or _name_of(data)
    dtype = float_dtype(dtype, label)
    x, y, target = _arrays(data, label, dtype, target)
    if test is None:
        train, held = held_out(y, check_test_fraction(test_fraction, label), target)
        x_train, y_train, x_test, y_test = x[train], y[train], x[held], y[held]
    else:
        x_train, y_train = x, y
        x_test, y_test, _ = _arrays(test, f"{label} (test)", dtype, target)
        if x_test.shape[1:] != x_train.shape[1:]:
            raise DataError(
                f"{label}: the test examples have shape {x_test.shape[1:]}, the training examples {x_train.shape[1:]}"
            )
        if y_test.shape[1:] != y_train.shape[1:]:
            raise DataError(
                f"{label}: the test targets have shape {y_test.shape[1:]}, the training targets {y_train.shape[1:]}"
            )
    num_classes = outputs_for((y_train, y_test), target, label, num_classes)
    return Dataset(label, x_train, y_train, x_test, y_test, num_classes, x_train.shape[1:], target=target).astype(dtype)


def _name_of(data: Any) -> str:
    if isinstance(data, (tuple, list)):
        return "arrays"
    return getattr(data, "__name__", None) or type(data).__name__


def _arrays(data: Any, label: str, dtype: np.dtype, target: str | None) -> tuple[np.ndarray, np.ndarray, str]:
    """(inputs, targets, their kind) of ``data``: a pair of arrays, or a map-style dataset read example by
    example."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(hasattr(a, "shape") for a in data):
        x, y = np.asarray(data[0]), np.asarray(data[1])
    elif (hasattr(data, "__len__") and hasattr(data, "__getitem__")) or callable(data):
        examples = (data[i] for i in range(len(data))) if hasattr(data, "__getitem__") else iter(data())
        xs, ys = [], []
        for i, example in enumerate(examples):
            if not (isinstance(example, (tuple, list)) and len(example) == 2):
                raise DataError(f"{label}[{i}] must be a pair (x, y), got {type(example).__name__}")
            xs.append(np.asarray(example[0]))
            ys.append(example[1])
            if xs[-1].shape != xs[0].shape:
                raise DataError(f"{label}[{i}]: x has shape {xs[-1].shape}, the first example's is {xs[0].shape}")
        if not xs:
            raise DataError(f"{label}: has no examples")
        x, y = np.stack(xs), np.asarray(ys)
    else:
        raise DataError(
            f"{label}: give a pair of arrays (x, y), a dataset with __len__ and __getitem__ giving "
            f"(x, y), or a function returning an iterator of (x, y); got a {type(data).__name__}"
        )
    if x.ndim < 2:
        raise DataError(f"{label}: inputs must have shape (n, features...), got {x.shape}")
    if x.dtype.kind not in "biuf":
        raise DataError(f"{label}: inputs must be numbers, got {x.dtype}")
    y, target = read_targets(y, label, target)
    if len(y) != len(x):
        raise DataError(f"{label}: {len(x)} inputs but {len(y)} targets")
    return np.ascontiguousarray(x, dtype=dtype), y, target
