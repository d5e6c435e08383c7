"""Rows of embedding tables on the wire, as both ends read and write them: blocks of (ids, values).

A block is int64 little-endian ids and, where values travel, the rows' values row after row in the table's
dtype.  :func:`blocks` cuts rows into blocks of at most ``BLOCK_BYTES`` of values (so no message nears a
transport's size limit); :class:`RowCollector` puts a message's blocks back together, refusing what does not fit
the tables it knows (a table it does not have, ids that are not whole int64s, values that are not one row per
id) and more rows than ``max_rows`` in all, before anything is allocated for them.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np

from psgd.channel import CHUNK_BYTES

BLOCK_BYTES = 1 << 20
#: Rows one message may carry in all, per table: far past a batch's (a batch of 65,536 with 64 ids each).
MAX_ROWS = 1 << 22
IDS = np.dtype("<i8")
#: Rows one pull may ask one shard for: their ids travel in one gRPC request, of at most a chunk's size.
MAX_PULL_ROWS = CHUNK_BYTES // IDS.itemsize


class RowsError(ValueError):
    """Rows that do not fit the tables: the message says why (INVALID_ARGUMENT)."""


def blocks(ids: np.ndarray, values: np.ndarray | None = None) -> Iterator[tuple[bytes, bytes]]:
    """``(ids bytes, values bytes)`` of consecutive runs of the rows, at most BLOCK_BYTES of values each (ids
    alone: runs of BLOCK_BYTES // 8 ids)."""
    ids = np.ascontiguousarray(ids, dtype=IDS)
    per = max(1, BLOCK_BYTES // (values[0].nbytes if values is not None and len(values) else 8))
    for start in range(0, len(ids), per):
        part = ids[start:start + per].tobytes()
        yield part, (np.ascontiguousarray(values[start:start + per]).tobytes() if values is not None else b"")


def read_ids(data: bytes, what: str) -> np.ndarray:
    if len(data) % IDS.itemsize:
        raise RowsError(f"{what}: {len(data)} bytes of ids is not a whole number of int64s")
    return np.frombuffer(data, dtype=IDS).astype(np.int64)


class RowCollector:
    """The rows of one message, table by table; ``tables`` maps each known table to (dim, dtype) of its rows,
    ``with_values`` says whether blocks carry values (a push) or ids only (a pull's request)."""

    def __init__(self, tables: Mapping[str, tuple[int, str]], with_values: bool, what: str):
        self.tables, self.with_values, self.what = tables, with_values, what
        self._ids: dict[str, list[np.ndarray]] = {}
        self._values: dict[str, list[np.ndarray]] = {}
        self._count: dict[str, int] = {}

    def add(self, table: str, ids: bytes, values: bytes = b"") -> None:
        if table not in self.tables:
            raise RowsError(f"{self.what}: no table {table!r} (this job's tables: {', '.join(self.tables) or 'none'})")
        dim, dtype = self.tables[table]
        got = read_ids(ids, f"{self.what}: table {table!r}")
        count = self._count.get(table, 0) + got.size
        if count > MAX_ROWS:
            raise RowsError(f"{self.what}: table {table!r}: more than {MAX_ROWS:,} rows in one message")
        self._count[table] = count
        self._ids.setdefault(table, []).append(got)
        if self.with_values:
            want = got.size * dim * np.dtype(dtype).itemsize
            if len(values) != want:
                raise RowsError(f"{self.what}: table {table!r}: {got.size} rows of {dim} {dtype} take {want} bytes, "
                                f"the block has {len(values)}")
            self._values.setdefault(table, []).append(np.frombuffer(values, dtype=dtype).reshape(got.size, dim))
        elif values:
            raise RowsError(f"{self.what}: table {table!r}: a request for rows carries ids only")

    def lookups(self) -> dict[str, np.ndarray]:
        """Ids by table (a pull's request)."""
        return {t: np.concatenate(parts) for t, parts in self._ids.items()}

    def rows(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """(ids, values) by table (a push)."""
        return {t: (np.concatenate(parts), np.concatenate(self._values[t])) for t, parts in self._ids.items()}
