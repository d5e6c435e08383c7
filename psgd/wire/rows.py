"""Rows of embedding tables on the wire, as both ends read and write them: blocks of (ids, values).

A block is int64 little-endian ids and, where values travel, the rows' values row after row in the table's
dtype.  :func:`blocks` cuts rows into blocks of at most ``BLOCK_BYTES`` of values (so no message nears a
transport's size limit); :class:`RowCollector` puts a message's blocks back together, refusing what does not fit
the tables it knows (a table it does not have, ids that are not whole int64s, values that are not one row per
id) and more rows than ``MAX_ROWS`` in all, before anything is allocated for them.

On the data port (:mod:`psgd.wire.protocol`) rows travel as *sections*, one per table: a :data:`SECTION`
header (the table name's length in bytes, the count of rows), the name (UTF-8), the ids, and for a push the
values.  :func:`sections` writes them; :func:`read_sections` reads a given number of bytes of them from a
socket, block by block, into a :class:`RowCollector`, so what is allocated grows with the bytes that came, never
with what a header declares.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from psgd.errors import InputError
from psgd.wire.channel import CHUNK_BYTES
from psgd.wire.codec import Codec

BLOCK_BYTES = 1 << 20
#: Rows one message may carry in all, per table: far past a batch's (a batch of 65,536 with 64 ids each).
MAX_ROWS = 1 << 22
IDS = np.dtype("<i8")
#: Rows one pull may ask one shard for: their ids travel in one gRPC request, of at most a chunk's size.
MAX_PULL_ROWS = CHUNK_BYTES // IDS.itemsize


#: a table's section on the data port: the length of its name in bytes, its count of rows
SECTION = struct.Struct("<HQ")
MAX_NAME_BYTES = 255


class RowsError(InputError):
    """Rows that do not fit the tables: the message says why (INVALID_ARGUMENT)."""


def blocks(ids: np.ndarray, values: np.ndarray | None = None) -> Iterator[tuple[bytes, bytes]]:
    """``(ids bytes, values bytes)`` of consecutive runs of the rows, at most BLOCK_BYTES of values each (ids
    alone: runs of BLOCK_BYTES // 8 ids)."""
    ids = np.ascontiguousarray(ids, dtype=IDS)
    per = max(1, BLOCK_BYTES // (values[0].nbytes if values is not None and len(values) else 8))
    for start in range(0, len(ids), per):
        part = ids[start : start + per].tobytes()
        yield part, (np.ascontiguousarray(values[start : start + per]).tobytes() if values is not None else b"")


def read_ids(data: bytes, what: str) -> np.ndarray:
    if len(data) % IDS.itemsize:
        raise RowsError(f"{what}: {len(data)} bytes of ids is not a whole number of int64s")
    return np.frombuffer(data, dtype=IDS).astype(np.int64)


class RowCollector:
    """The rows of one message, table by table; ``tables`` maps each known table to (dim, dtype) of its rows,
    ``with_values`` says whether blocks carry values (a push) or ids only (a pull's request); a push's values are
    written by ``codec`` (float16 or bfloat16 gradients are widened back to the table's float32 here)."""

    def __init__(self, tables: Mapping[str, tuple[int, str]], with_values: bool, what: str, codec: Codec | None = None):
        self.tables, self.with_values, self.what = tables, with_values, what
        self.codec = codec if codec is not None and codec.compresses else None
        self._ids: dict[str, list[np.ndarray]] = {}
        self._values: dict[str, list[np.ndarray]] = {}
        self._count: dict[str, int] = {}

    def shape(self, table: str) -> tuple[int, str]:
        """(dim, dtype) of ``table``'s rows; a :class:`RowsError` where there is no such table."""
        if table not in self.tables:
            raise RowsError(f"{self.what}: no table {table!r} (this job's tables: {', '.join(self.tables) or 'none'})")
        return self.tables[table]

    def row_bytes(self, table: str) -> int:
        """Bytes one row's values take on the wire (0 for ids only)."""
        dim, dtype = self.shape(table)
        if not self.with_values:
            return 0
        return dim * (self.codec.wire_itemsize(dtype) if self.codec else np.dtype(dtype).itemsize)

    def add(self, table: str, ids: bytes, values: bytes = b"") -> None:
        dim, dtype = self.shape(table)
        got = read_ids(ids, f"{self.what}: table {table!r}")
        count = self._count.get(table, 0) + got.size
        if count > MAX_ROWS:
            raise RowsError(f"{self.what}: table {table!r}: more than {MAX_ROWS:,} rows in one message")
        self._count[table] = count
        self._ids.setdefault(table, []).append(got)
        if self.with_values:
            want = got.size * self.row_bytes(table)
            if len(values) != want:
                wire = f"{self.codec.name} " if self.codec else ""
                raise RowsError(
                    f"{self.what}: table {table!r}: {got.size} rows of {dim} {wire or dtype + ' '}values "
                    f"take {want} bytes, the block has {len(values)}"
                )
            if self.codec:
                wide = np.empty((got.size, dim), dtype=dtype)
                self.codec.decode(np.frombuffer(values, dtype=np.uint16), wide.reshape(-1))
            else:
                wide = np.frombuffer(values, dtype=dtype).reshape(got.size, dim)
            self._values.setdefault(table, []).append(wide)
        elif values:
            raise RowsError(f"{self.what}: table {table!r}: a request for rows carries ids only")

    def lookups(self) -> dict[str, np.ndarray]:
        """Ids by table (a pull's request)."""
        return {t: np.concatenate(parts) for t, parts in self._ids.items()}

    def rows(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """(ids, values) by table (a push)."""
        return {t: (np.concatenate(parts), np.concatenate(self._values[t])) for t, parts in self._ids.items()}


def sections(rows: Mapping[str, tuple[np.ndarray, np.ndarray | None]]) -> tuple[list, int]:
    """The data port's buffers for ``rows`` (table -> (ids, values, or None for a pull's request)) and their
    bytes in all."""
    out: list = []
    for table, (ids, values) in rows.items():
        name = table.encode()
        ids = np.ascontiguousarray(ids, dtype=IDS)
        out += [SECTION.pack(len(name), ids.size), name, ids]
        if values is not None:
            out.append(np.ascontiguousarray(values))
    return out, sum(memoryview(b).nbytes for b in out)


def sections_bytes(tables: Mapping[str, tuple[int, str]], with_values: bool) -> int:
    """The most bytes sections for ``tables`` may take: MAX_ROWS rows of each."""
    return sum(
        SECTION.size
        + MAX_NAME_BYTES
        + MAX_ROWS * (IDS.itemsize + (dim * np.dtype(dtype).itemsize if with_values else 0))
        for dim, dtype in tables.values()
    )


def read_sections(recv: Callable[[int], bytes], size: int, into: RowCollector) -> None:
    """Read ``size`` bytes of sections with ``recv(n)`` (exactly n bytes, or an exception) into ``into``; a
    :class:`RowsError` for sections that do not fit its tables or do not add up to ``size`` (the stream is then
    out of step: the caller closes it)."""
    left = size
    while left:
        if left < SECTION.size:
            raise RowsError(f"{into.what}: {left} bytes left of the rows, too few for a table's header")
        length, count = SECTION.unpack(recv(SECTION.size))
        left -= SECTION.size
        if not 0 < length <= min(MAX_NAME_BYTES, left):
            raise RowsError(f"{into.what}: a table name of {length} bytes")
        table = bytes(recv(length)).decode("utf-8", "replace")
        left -= length
        row = into.row_bytes(table)
        if count > MAX_ROWS or count * (IDS.itemsize + row) > left:
            raise RowsError(
                f"{into.what}: table {table!r}: {count:,} rows do not fit the {left:,} bytes left "
                f"(at most {MAX_ROWS:,} rows a message)"
            )
        per = max(1, BLOCK_BYTES // max(row, IDS.itemsize))
        for start in range(0, count, per):
            n = min(per, count - start)
            ids = recv(n * IDS.itemsize)
            into.add(table, ids, recv(n * row) if row else b"")
        left -= count * (IDS.itemsize + row)
