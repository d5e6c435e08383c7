"""Embedding tables: row-sparse variables keyed by int64 ids of unbounded range.

A model declares its tables (:class:`TableSpec`: a name, the row width ``dim``, a dtype and how a row starts)
beside its dense variables.  A table has no size: ids are any int64 (hashed feature ids, as click logs carry
them), and a row exists only once an id is used, made from (seed, table, id) alone by :func:`initial_rows`, so
every process that needs a row's first value computes the same one and a table of 10^9 possible ids costs only
the rows ever touched.  :func:`mix64` is the hash both that and the spreading of rows over shards
(:meth:`psgd.partition.PartitionPlan.shard_of_ids`) are made of: SplitMix64's finalizer (Steele, Lea & Flood,
"Fast splittable pseudorandom number generators", OOPSLA 2014), written in NumPy's wrapping uint64 arithmetic,
the same on every machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from psgd.model.errors import ModelError

#: How a table's rows start: all zeros, N(0, scale^2), or uniform in [-scale, scale].
ROW_INITIALIZERS = ("zeros", "normal", "uniform")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


class TableSpecError(ModelError):
    """A :class:`TableSpec` that cannot be: a non-positive width, an unknown initializer or dtype."""


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One embedding table: rows of ``dim`` values of ``dtype``, keyed by int64 ids, each starting as
    ``init`` with ``scale`` (see :data:`ROW_INITIALIZERS`)."""

    name: str
    dim: int
    dtype: str = "float32"
    init: str = "normal"
    scale: float = 0.01

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, (int, np.integer)) or self.dim <= 0:
            raise TableSpecError(f"table {self.name!r}: dim must be a positive integer, got {self.dim!r}")
        object.__setattr__(self, "dim", int(self.dim))
        try:
            object.__setattr__(self, "dtype", np.dtype(self.dtype).name)
        except TypeError:
            raise TableSpecError(f"table {self.name!r}: unknown dtype {self.dtype!r}") from None
        if self.init not in ROW_INITIALIZERS:
            raise TableSpecError(
                f"table {self.name!r}: unknown initializer {self.init!r} (use one of {', '.join(ROW_INITIALIZERS)})"
            )
        if not np.isfinite(self.scale) or self.scale < 0:
            raise TableSpecError(f"table {self.name!r}: scale must be a finite number >= 0, got {self.scale!r}")

    @property
    def row_bytes(self) -> int:
        return self.dim * np.dtype(self.dtype).itemsize

    def description(self) -> dict:
        return dataclasses.asdict(self)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer of each uint64 in ``x``: a bijection whose outputs look independent."""
    z = np.asarray(x, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return z


def name_key(*parts: object) -> np.uint64:
    """A 64-bit key of a name (and a seed): what separates one table's rows from another's."""
    digest = hashlib.sha256("\x00".join(str(p) for p in parts).encode()).digest()
    return np.uint64(int.from_bytes(digest[:8], "little"))


def check_ids(ids: object, what: str = "ids") -> np.ndarray:
    """``ids`` as a 1-d int64 array; a :class:`ValueError` that says what is wrong otherwise."""
    array = np.asarray(ids)
    if array.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{what} must be integers, got {array.dtype}")
    return array.astype(np.int64, copy=False)


def initial_rows(spec: TableSpec, seed: int, ids: np.ndarray) -> np.ndarray:
    """The first value of the rows ``ids`` of table ``spec``, ``[len(ids), dim]``: a function of (seed, table,
    id, column) only, whichever process asks and whatever else it asks for."""
    ids = check_ids(ids)
    out_dtype = np.dtype(spec.dtype)
    if spec.init == "zeros" or spec.scale == 0:
        return np.zeros((ids.size, spec.dim), dtype=out_dtype)
    key = name_key("psgd-table", spec.name, int(seed))
    with np.errstate(over="ignore"):
        base = mix64(ids.view(np.uint64) ^ key)[:, None] * np.uint64(2 * spec.dim)
        cells = base + np.arange(2 * spec.dim, dtype=np.uint64)[None, :] * _GOLDEN
    bits = mix64(cells) >> np.uint64(11)  # 53 random bits each
    unit = (bits.astype(np.float64) + 0.5) * (1.0 / (1 << 53))  # in (0, 1)
    if spec.init == "uniform":
        values = (unit[:, : spec.dim] * 2.0 - 1.0) * spec.scale
    else:  # normal, by Box-Muller over the two halves
        u1, u2 = unit[:, : spec.dim], unit[:, spec.dim :]
        values = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2) * spec.scale
    return values.astype(out_dtype)


@dataclasses.dataclass
class Rows:
    """The rows of one table a batch looks up, as a model sees them: ``ids`` (distinct int64, a host array),
    ``values`` ``[len(ids), dim]`` (on the model's device) and ``index`` (positions into ``values``, one per
    lookup of the batch, in the shape of the lookups).  A model reads ``values[index]``; its gradient is the
    same ``Rows`` with the gradient of each row as ``values`` (every lookup of a row summed)."""

    ids: np.ndarray
    values: Any
    index: Any

    def with_values(self, values: Any) -> Rows:
        return Rows(self.ids, values, self.index)

    def copy(self) -> Rows:
        return Rows(self.ids, self.values.copy(), self.index)


def table_keys(table: str) -> tuple[str, str]:
    """The names a table's rows are saved under in a weights file: its ids (increasing) and its rows."""
    return f"table:{table}:ids", f"table:{table}:rows"


def joined_by_id(ids: Sequence[np.ndarray], rows: Sequence[np.ndarray], dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Parts of a table's rows (each shard's, say) joined into one: ids increasing, rows ``[n, dim]`` in their
    order, as a weights file holds them (:func:`table_keys`)."""
    joined = np.concatenate([np.asarray(i, np.int64) for i in ids]) if ids else np.zeros(0, np.int64)
    order = np.argsort(joined, kind="stable")
    values = np.concatenate([np.reshape(r, (-1, dim)) for r in rows]) if rows else np.zeros((0, dim))
    return joined[order], values[order]


def unique_lookups(lookups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ids of a batch's lookups, and each lookup's position among them (in the lookups' shape)."""
    ids, index = np.unique(check_ids(np.asarray(lookups).reshape(-1), "lookups"), return_inverse=True)
    return ids, index.reshape(np.shape(lookups))
