"""A model's weights as one plain ``.npz`` file, and back: :func:`save_weights` writes ``{name: array}`` (no
pickle; a temporary file, then a rename), :func:`load_weights` reads one back checked against the model's
variables (:func:`weight_differences` says how they differ), and :func:`evaluate_file` scores one on the job's
test split.  The weights come from :mod:`psgd.export.shards` (joined from shards) or from a trainer's end."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from psgd.config import JobConfig
from psgd.export.shards import ExportError
from psgd.model.base import VarSpec
from psgd.model.table import Rows, TableSpec, initial_rows, table_keys, unique_lookups


def save_weights(path: str | os.PathLike, weights: Mapping[str, Any]) -> int:
    """Write ``weights`` as a plain ``.npz`` keyed by variable name; returns its size in bytes.

    Loadable with ``numpy.load(path, allow_pickle=False)``.  Written to a
    temporary file in the same folder, fsynced, then renamed into place, so
    ``path`` is either the old file or the whole new one.  The name is used
    as given (no ``.npz`` is added).
    """
    from psgd.compute.backend import to_host

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
    from psgd.data import DataError
    from psgd.data.readers import read_npz as read_arrays

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
            problems.append(f"table {spec.name} has rows of {rows.shape} {rows.dtype}, the model's are "
                            f"({ids.size}, {spec.dim}) {spec.dtype}")
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


def load_weights(path: str | os.PathLike | None, specs: Sequence[VarSpec], tables: Sequence[TableSpec] = (),
                 arrays: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The weights saved at ``path`` (or read already: ``arrays``), checked against the model's variables
    ``specs`` and its ``tables``."""
    arrays = read_npz(path) if arrays is None else dict(arrays)
    problems = weight_differences(arrays, specs) + table_differences(arrays, tables)
    if problems:
        raise ExportError(f"{path or 'the saved file'} does not fit this job's model: {'; '.join(problems)}; "
                          "pass the job file or flags it was trained with (-c job.toml, or --model, --dtype, "
                          "--set model.KEY=VALUE)")
    return arrays


def evaluate_file(config: JobConfig, path: str | os.PathLike) -> dict[str, Any]:
    """Test loss and score (``test_accuracy``, or ``test_r2`` for values) of the weights saved at ``path``, for the
    model and data of ``config``."""
    from psgd.training.evaluation import evaluate
    from psgd.job import build_job, params_to_device

    job = build_job(config)
    weights = load_weights(path, job.model.specs(), job.plan.tables)
    params = params_to_device({s.name: weights[s.name] for s in job.model.specs()}, job.device)
    ds = job.dataset
    loss, score = evaluate(job.model, params, ds.x_test, ds.y_test, job.device, config.train.eval_batch_size,
                           ds.ids_test, saved_rows(job, weights), ds.target)
    return {ds.score_key: score, "test_loss": loss, "examples": int(len(ds.y_test)),
            "dataset": config.data["name"], "model": config.model["name"], "variables": len(weights),
            "parameters": int(sum(w.size for w in weights.values())), "file": str(path)}


def saved_rows(job: Any, weights: Mapping[str, np.ndarray]) -> Any:
    """How an evaluation reads the tables of ``job`` from the rows saved in ``weights`` (None: no tables)."""
    saved = {t.name: SavedRows(t, job.config.train.seed, *(weights[k] for k in table_keys(t.name)))
             for t in job.plan.tables}
    if not saved:
        return None
    return lambda lookups: {name: saved[name].rows(wanted, job.device) for name, wanted in lookups.items()}


class SavedRows:
    """A table's saved rows (``ids`` increasing, ``rows`` one per id), looked up as an evaluation reads a table:
    an id that has no saved row reads as its first value."""

    def __init__(self, spec: TableSpec, seed: int, ids: np.ndarray, rows: np.ndarray):
        self.spec, self.seed, self.ids, self.values = spec, seed, ids, rows

    def rows(self, lookups: np.ndarray, device: Any) -> Rows:
        ids, index = unique_lookups(lookups)
        at = np.minimum(np.searchsorted(self.ids, ids), max(self.ids.size - 1, 0))
        have = (self.ids[at] == ids) if self.ids.size else np.zeros(ids.size, bool)
        out = np.empty((ids.size, self.spec.dim), self.spec.dtype)
        out[have] = self.values[at[have]]
        out[~have] = initial_rows(self.spec, self.seed, ids[~have])
        return Rows(ids, device.asarray(out), device.asarray(index))
