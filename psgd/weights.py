"""A model's weights as one plain ``.npz`` file, and back: :func:`save_weights` writes ``{name: array}`` (no
pickle; a temporary file, then a rename), :func:`load_weights` reads one back checked against the model's
variables (:func:`weight_differences` says how they differ).  The weights come from :mod:`psgd.export.shards`
(joined from shards) or from a trainer's end, and psgd train keeps its state in one
(:mod:`psgd.training.local`); :func:`psgd.training.evaluation.evaluate_file` scores one on the job's test split."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from psgd.compute.backend import to_host
from psgd.data import DataError
from psgd.data.readers import read_npz as read_arrays
from psgd.errors import InputError
from psgd.model.base import VarSpec
from psgd.model.table import TableSpec, table_keys


class ExportError(InputError):
    """Weights that cannot be exported, joined, written or loaded; the message is one line that says why."""


def save_weights(path: str | os.PathLike, weights: Mapping[str, Any]) -> int:
    """Write ``weights`` as a plain ``.npz`` keyed by variable name; returns its size in bytes.

    Loadable with ``numpy.load(path, allow_pickle=False)``.  Written to a
    temporary file in the same folder, fsynced, then renamed into place, so
    ``path`` is either the old file or the whole new one.  The name is used
    as given (no ``.npz`` is added).
    """
    path = Path(path)
    arrays = {}
    for name, value in weights.items():
        array = np.asarray(to_host(value), order="C")  # (a 0-d array stays one: ascontiguousarray makes it 1-d)
        if array.dtype.hasobject:
            raise ExportError(f"variable {name} holds Python objects ({array.dtype}); only plain arrays are saved")
        arrays[str(name)] = array
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
                for name, array in arrays.items():  # what numpy.savez does, without a way to pickle
                    with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                        np.lib.format.write_array(member, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ExportError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def read_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` at ``path`` (:func:`psgd.data.read_npz`: never unpickling);
    :class:`ExportError` when it is not one."""
    try:
        return read_arrays(path)
    except DataError as exc:
        raise ExportError(str(exc)) from None


def table_differences(arrays: Mapping[str, np.ndarray], tables: Sequence[TableSpec]) -> list[str]:
    """How the saved rows in ``arrays`` differ from the tables ``tables`` describe."""
    problems = []
    for spec in tables:
        key_ids, key_rows = table_keys(spec.name)
        ids, rows = arrays.get(key_ids), arrays.get(key_rows)
        if ids is None or rows is None:
            problems.append(f"no rows of table {spec.name}")
        elif ids.dtype != np.int64 or ids.ndim != 1 or (ids.size > 1 and not (np.diff(ids) > 0).all()):
            problems.append(f"the ids of table {spec.name} are not increasing int64s")
        elif rows.shape != (ids.size, spec.dim) or rows.dtype != np.dtype(spec.dtype):
            problems.append(
                f"table {spec.name} has rows of {rows.shape} {rows.dtype}, the model's are "
                f"({ids.size}, {spec.dim}) {spec.dtype}"
            )
    return problems


def weight_differences(arrays: Mapping[str, np.ndarray], specs: Sequence[VarSpec]) -> list[str]:
    """How ``arrays`` differ from the variables ``specs`` describe: missing, extra, wrong shape or dtype (the
    saved rows of embedding tables, ``table:NAME:...``, are :func:`table_differences`'s)."""
    arrays = {k: v for k, v in arrays.items() if not k.startswith("table:")}
    wanted = {s.name: s for s in specs}
    problems = []
    missing = [n for n in wanted if n not in arrays]
    extra = [n for n in arrays if n not in wanted]
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    if extra:
        problems.append(f"extra {', '.join(extra)}")
    dtypes = []
    for name, spec in wanted.items():
        if name not in arrays:
            continue
        a = arrays[name]
        if tuple(a.shape) != spec.shape:
            problems.append(f"{name} has shape {tuple(a.shape)}, the model's is {spec.shape}")
        if a.dtype != np.dtype(spec.dtype):
            dtypes.append((name, str(a.dtype), spec.dtype))
    pairs = {(got, want) for _, got, want in dtypes}
    if len(dtypes) > 1 and len(pairs) == 1 and len(dtypes) == len(wanted):
        got, want = pairs.pop()
        problems.append(f"every variable is {got}, the model's are {want}")
    else:
        problems.extend(f"{name} is {got}, the model's is {want}" for name, got, want in dtypes)
    return problems


def load_weights(
    path: str | os.PathLike | None,
    specs: Sequence[VarSpec],
    tables: Sequence[TableSpec] = (),
    arrays: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """The weights saved at ``path`` (or read already: ``arrays``), checked against the model's variables
    ``specs`` and its ``tables``."""
    arrays = read_npz(path) if arrays is None else dict(arrays)
    problems = weight_differences(arrays, specs) + table_differences(arrays, tables)
    if problems:
        raise ExportError(
            f"{path or 'the saved file'} does not fit this job's model: {'; '.join(problems)}; "
            "pass the job file or flags it was trained with (-c job.toml, or --model, --dtype, "
            "--set model.KEY=VALUE)"
        )
    return arrays
