"""Datasets that stay on disk: ``npy:DIR``, a folder of NumPy ``.npy`` files that every process memory-maps, so
that a worker reads the rows of its batches as it takes them and its memory does not grow with the data.

The folder holds ``x_train.npy``, ``y_train.npy``, ``x_test.npy`` and ``y_test.npy``; or, for data written in
pieces, ``x_train-0.npy``, ``x_train-1.npy``, ... and the same for the others, read one after the other (the
pieces of ``x_*`` and ``y_*`` must agree in rows).  Inputs must already be of the job's float type (a conversion
would read them whole); labels are integer classes from 0.  Nothing is unpickled: object arrays are refused.
"""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from psgd.data.base import DataError, Dataset

SPLITS = ("x_train", "y_train", "x_test", "y_test")


class Stacked:
    """The rows of several arrays on disk, one after the other, as one array of rows: ``len``, ``shape``,
    ``dtype``, ``ndim``, and indexing by row numbers (what a batch is), which reads those rows only."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.ends = np.cumsum([len(p) for p in parts])
        self.starts = self.ends - np.array([len(p) for p in parts])
        self.shape = (int(self.ends[-1]),) + parts[0].shape[1:]
        self.dtype, self.ndim = parts[0].dtype, parts[0].ndim

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> np.ndarray:
        rows = np.arange(len(self))[index] if isinstance(index, slice) else np.asarray(index)
        if rows.ndim == 0:
            return self[rows.reshape(1)][0]
        rows = np.where(rows < 0, rows + len(self), rows)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"row index out of range for {len(self)} rows")
        out = np.empty((len(rows),) + self.shape[1:], self.dtype)
        piece = np.searchsorted(self.ends, rows, side="right")
        for p in np.unique(piece):
            mine = piece == p
            out[mine] = self.parts[p][rows[mine] - self.starts[p]]
        return out

    def astype(self, dtype: Any, copy: bool = True) -> Stacked:
        if np.dtype(dtype) != self.dtype:
            raise DataError(f"rows of {self.dtype} asked for as {np.dtype(dtype)}: that would read them whole")
        return self


def load_npy_dir(directory: str | os.PathLike[str], dtype: Any) -> Dataset:
    """The dataset of ``npy:DIR``, its inputs memory-mapped (see the module)."""
    folder, arrays = _open(directory)
    want = np.dtype(dtype)
    for split in ("x_train", "x_test"):
        if arrays[split].dtype != want:
            raise DataError(
                f"npy:{folder}: {split} is {arrays[split].dtype}, the job's dtype {want}: write the "
                f"files as {want} (psgd would otherwise read them whole to convert them)"
            )
    labels = {split: _labels(folder, split, arrays[split]) for split in ("y_train", "y_test")}
    return Dataset(
        f"npy:{folder}",
        arrays["x_train"],
        arrays["y_train"],
        arrays["x_test"],
        arrays["y_test"],
        max(labels.values()) + 1,
        arrays["x_train"].shape[1:],
    )


def describe_npy_dir(directory: str | os.PathLike[str]) -> tuple[str, tuple[int, ...], int]:
    """(name, input shape, classes) of ``npy:DIR``, from the headers and the labels."""
    folder, arrays = _open(directory)
    top = max(_labels(folder, split, arrays[split]) for split in ("y_train", "y_test"))
    return f"npy:{folder}", tuple(arrays["x_train"].shape[1:]), top + 1


def _open(directory: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    folder = Path(directory).expanduser()
    if not folder.is_dir():
        raise DataError(
            f"npy:{folder}: not a folder (npy:DIR names a folder of x_train.npy, y_train.npy, x_test.npy, y_test.npy)"
        )
    arrays = {split: _split(folder, split) for split in SPLITS}
    for part in ("train", "test"):
        x, y = arrays[f"x_{part}"], arrays[f"y_{part}"]
        if x.ndim < 2 or x.dtype.kind != "f":
            raise DataError(f"npy:{folder}: x_{part} must be floats of shape (n, features...), got {x.dtype} {x.shape}")
        if y.ndim != 1 or y.dtype.kind not in "iu" or len(y) != len(x):
            raise DataError(f"npy:{folder}: y_{part} must be {len(x)} integer labels, got {y.dtype} {y.shape}")
        if not len(x):
            raise DataError(f"npy:{folder}: x_{part} has no rows: each split needs examples")
    if arrays["x_test"].shape[1:] != arrays["x_train"].shape[1:]:
        raise DataError(
            f"npy:{folder}: x_test's rows are {arrays['x_test'].shape[1:]}, x_train's {arrays['x_train'].shape[1:]}"
        )
    return folder, arrays


def _split(folder: Path, split: str) -> Any:
    """``split`` memory-mapped: its one file, or its pieces in order."""
    whole = folder / f"{split}.npy"
    pieces = sorted(
        (p for p in folder.glob(f"{split}-*.npy") if re.fullmatch(rf"{split}-\d+", p.stem)),
        key=lambda p: int(p.stem.rpartition("-")[2]),
    )
    if whole.exists() and pieces:
        raise DataError(f"npy:{folder}: both {whole.name} and {pieces[0].name}...: keep one or the other")
    paths = [whole] if whole.exists() else pieces
    if not paths:
        raise DataError(f"npy:{folder}: no {split}.npy (nor {split}-0.npy, {split}-1.npy, ...)")
    parts = []
    for path in paths:
        if not path.is_file():  # (a FIFO's open for reading would wait for a writer; a device may never end)
            raise DataError(f"npy:{path}: not a regular file; npy:DIR reads .npy files")
        try:
            parts.append(np.load(path, mmap_mode="r", allow_pickle=False))
        except (ValueError, OSError) as exc:
            raise DataError(f"npy:{path}: cannot be read as a .npy array ({exc})") from None
        if split == "x_train" and hasattr(mmap, "MADV_RANDOM") and getattr(parts[-1], "_mmap", None) is not None:
            # batches are rows drawn at random: read what a batch touches, not the pages after it (read ahead, then
            # evicted unused where memory is short, they made a step six times slower under a memory limit)
            parts[-1]._mmap.madvise(mmap.MADV_RANDOM)
    if any(p.shape[1:] != parts[0].shape[1:] or p.dtype != parts[0].dtype for p in parts):
        raise DataError(f"npy:{folder}: the pieces of {split} differ in row shape or dtype")
    return parts[0] if len(parts) == 1 else Stacked(parts)


def _labels(folder: Path, split: str, y: Any) -> int:
    """The largest label of ``y``, checked to be a class from 0 (read through once, not kept)."""
    low, high = _range(y)
    if low < 0:
        raise DataError(f"npy:{folder}: {split} holds a negative label ({low}); labels are classes from 0")
    return high


def _range(y: Any) -> tuple[int, int]:
    parts = y.parts if isinstance(y, Stacked) else [y]
    return (min(int(p.min()) for p in parts if len(p)), max(int(p.max()) for p in parts if len(p)))
