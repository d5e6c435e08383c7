"""A worker's rows of its model's embedding tables: the distinct ids of a step's lookups, the host arrays their rows
are pulled into, and those rows as the model reads them (:class:`~psgd.model.table.Rows`, on the device); every row
a table's shards hold, listed (an export's)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from psgd.model.table import Rows, joined_by_id, unique_lookups
from psgd.worker.client import PSError


def asked_rows(plan: Any, lookups: Mapping[str, np.ndarray] | None) -> dict[str, tuple[np.ndarray, Any, np.ndarray]]:
    """(distinct ids, index, a host array their rows are pulled into) of each table ``lookups`` names."""
    out = {}
    for name, wanted in (lookups or {}).items():
        ids, index = unique_lookups(wanted)
        spec = plan.table_by_name[name]
        out[name] = (ids, index, np.empty((ids.size, spec.dim), spec.dtype))
    return out


def as_rows(rows: Mapping[str, tuple[np.ndarray, Any, np.ndarray]], device: Any) -> dict[str, Rows]:
    return {t: Rows(ids, device.asarray(values), device.asarray(index)) for t, (ids, index, values) in rows.items()}


def read_rows(observer: Any, lookups: Mapping[str, np.ndarray], device: Any) -> dict[str, Rows]:
    """The rows ``lookups`` names (ids by table), read by ``observer`` (an observer's :class:`PSClient`) from the
    shards that hold them, as they are (none is made), on ``device``: what an evaluation looks up."""
    rows = asked_rows(observer.plan, lookups)
    observer.pull(
        0,
        {s.name: np.empty(s.shape, s.dtype) for s in observer.plan.specs},
        {t: (ids, out) for t, (ids, _, out) in rows.items()},
    )
    return as_rows(rows, device)


def held_rows(client: Any) -> str:
    """How many rows (and MB) the shards ``client`` reaches hold, in words; "unknown" where they do not say."""
    try:
        held = [json.loads(s.counters_json or "{}").get("tables", {}) for s in client.status()]
    except (PSError, ValueError):
        return "unknown"
    rows = sum(t.get("rows", 0) for h in held for t in h.values())
    return f"{rows:,} rows, {sum(t.get('bytes', 0) for h in held for t in h.values()) / 1e6:.1f} MB"


def list_rows(client: Any, table: str) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """Every row of ``table`` the shards ``client`` (a :class:`PSClient`) reaches hold, as they are: ids
    (increasing), values, and each shard's versions at its first and last page (different: it was updated while
    listed, so its rows may be of different versions, and a row made or evicted meanwhile may be missing)."""
    spec = client.plan.table_by_name[table]

    def one(k: int) -> tuple[list, list, tuple[int, int]]:
        ids, values, versions, start = [], [], [], 0
        while start != -1:
            page = client.retrying(k, f"listing of table {table!r}", lambda: client.links[k].list_rows(table, start))
            got = np.frombuffer(page.rows.ids, "<i8")
            if (
                len(page.rows.values) != got.size * spec.dim * np.dtype(spec.dtype).itemsize
                or (client.plan.shard_of_ids(table, got) != k).any()
            ):
                raise PSError(
                    f"shard {k} listed rows of table {table!r} that are not its own, or values that "
                    f"are not one row of {spec.dim} {spec.dtype} per id"
                )
            ids.append(got)
            values.append(np.frombuffer(page.rows.values, spec.dtype).reshape(got.size, spec.dim))
            versions.append(page.version)
            if page.next != -1 and page.next <= start:
                raise PSError(
                    f"shard {k} listed table {table!r} out of order (a page at {start} said the next "
                    f"starts at {page.next})"
                )
            start = page.next
        return ids, values, (versions[0], versions[-1])

    parts = client.on_all(one)
    ids, values = joined_by_id([i for p in parts for i in p[0]], [v for p in parts for v in p[1]], spec.dim)
    return ids, values, [p[2] for p in parts]
