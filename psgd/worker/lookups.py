"""A worker's rows of its model's embedding tables: the distinct ids of a step's lookups, the host arrays their rows
are pulled into, and those rows as the model reads them (:class:`~psgd.model.table.Rows`, on the device)."""

from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np

from psgd.model.table import Rows, unique_lookups
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
    observer.pull(0, {s.name: np.empty(s.shape, s.dtype) for s in observer.plan.specs},
                  {t: (ids, out) for t, (ids, _, out) in rows.items()})
    return as_rows(rows, device)


def held_rows(client: Any) -> str:
    """How many rows (and MB) the shards ``client`` reaches hold, in words; "unknown" where they do not say."""
    try:
        held = [json.loads(s.counters_json or "{}").get("tables", {}) for s in client.status()]
    except (PSError, ValueError):
        return "unknown"
    rows = sum(t.get("rows", 0) for h in held for t in h.values())
    return f"{rows:,} rows, {sum(t.get('bytes', 0) for h in held for t in h.values()) / 1e6:.1f} MB"
