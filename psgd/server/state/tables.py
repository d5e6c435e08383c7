"""A shard's share of every embedding table: the rows a pull asks for, a push's row gradients checked and applied,
and a sync round's row gradients summed until the round closes.

:class:`ShardTables` holds one :class:`psgd.tables.held.RowTable` per table of the plan, with the rows whose id hashes
to this shard (:meth:`psgd.partition.PartitionPlan.shard_of_ids`).  A push carries, beside its dense slices,
``(ids, values)`` per table: the distinct ids of this shard's rows its batch touched and each one's gradient
(duplicates summed by the worker).  :meth:`check` refuses what the shard must not apply (ids repeated or not this
shard's, a shape that is not ``[len(ids), dim]``, NaN or Inf) before anything is counted, so a refused push
leaves every row as it was.  Under a policy that applies on arrival the rows are updated with the dense slices,
as one update; under sync (:meth:`add`) a round's row gradients are kept until it closes and then averaged over
the round's pushes, as the dense sums are (a row no push of the round touched gets no update): the same
arithmetic as one process computing the gradient of the round's whole batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from psgd.optim import WHOLE, Share
from psgd.partition import PartitionPlan
from psgd.server.errors import ShardError
from psgd.tables.held import RowTable, TableFull
from psgd.wire.rows import BLOCK_BYTES

#: What a push or pull says of a table's rows: ids, and for a push their gradients ``[len(ids), dim]``.
RowsIn = Mapping[str, tuple[np.ndarray, np.ndarray]]


class ShardTables:
    """Shard ``shard``'s rows of every table of ``plan``, kept in ``tables`` (:meth:`psgd.job.Job.row_tables`)."""

    def __init__(self, plan: PartitionPlan, shard: int, tables: Mapping[str, RowTable]):
        self.plan, self.shard, self.tables = plan, shard, dict(tables)
        self.round: dict[str, list[tuple[np.ndarray, np.ndarray, int]]] = {name: [] for name in self.tables}
        self.counters = {"rows_pulled": 0, "rows_pushed": 0}

    def __bool__(self) -> bool:
        return bool(self.tables)

    def shapes(self) -> dict[str, tuple[int, str]]:
        """(dim, dtype) of each table's rows, by name: what the wire's rows are read against."""
        return {name: (t.spec.dim, t.spec.dtype) for name, t in self.tables.items()}

    # -- checks ----------------------------------------------------------------------------------------------
    def check_ids(self, name: str, ids: Any, who: str) -> np.ndarray:
        """``ids`` of table ``name`` as int64, once they are distinct and all this shard's."""
        if name not in self.tables:
            raise ShardError(
                "INVALID_ARGUMENT", f"{who}: no table {name!r} (this job's tables: {', '.join(self.tables) or 'none'})"
            )
        array = np.asarray(ids)
        if array.ndim != 1 or array.dtype != np.int64:
            raise ShardError(
                "INVALID_ARGUMENT",
                f"{who}: the ids of table {name!r} must be one int64 array, got {array.dtype} of shape {array.shape}",
            )
        if np.unique(array).size != array.size:
            raise ShardError(
                "INVALID_ARGUMENT",
                f"{who}: table {name!r}: an id is repeated (sum a batch's "
                "gradients of one row before pushing, and ask for each row once)",
            )
        if array.size and (self.plan.shard_of_ids(name, array) != self.shard).any():
            raise ShardError(
                "INVALID_ARGUMENT",
                f"{who}: table {name!r}: some ids are not shard {self.shard}'s "
                "(the plan spreads rows by a hash of the id: send each id to the shard it names)",
            )
        return array

    def check(self, rows: RowsIn, who: str, allow_nonfinite: bool = False) -> dict[str, tuple[np.ndarray, Any]]:
        """A push's rows, checked (see the module docstring); every table missing from it pushed no rows."""
        out = {}
        for name, (ids, values) in rows.items():
            ids = self.check_ids(name, ids, who)
            dim = self.tables[name].spec.dim
            values = np.asarray(values)
            if values.shape != (ids.size, dim) or values.dtype.kind != "f":
                raise ShardError(
                    "INVALID_ARGUMENT",
                    f"{who}: table {name!r}: {ids.size} ids need gradients of "
                    f"shape ({ids.size}, {dim}) of floats, got {values.dtype} {values.shape}",
                )
            if not allow_nonfinite and not np.isfinite(values).all():
                bad = int((~np.isfinite(values)).sum())
                raise ShardError(
                    "INVALID_ARGUMENT",
                    f"{who}: table {name!r}: the row gradients have {bad} non-finite "
                    "value(s) (NaN/Inf); lower the learning rate or check the data",
                )
            out[name] = (ids, values)
        return out

    # -- pulls and pushes -------------------------------------------------------------------------------------
    def read(self, lookups: Mapping[str, Any], who: str, make: bool = True) -> dict[str, np.ndarray]:
        """The rows ``lookups`` names (ids by table), in the order asked: made where needed (a worker's pull), or
        read as they are (``make=False``: an observer's)."""
        out = {}
        for name, ids in lookups.items():
            ids = self.check_ids(name, ids, who)
            table = self.tables[name]
            try:
                out[name] = table.read(ids) if make else table.peek(ids)
            except TableFull as full:
                raise ShardError(full.code, str(full)) from None
            self.counters["rows_pulled"] += int(ids.size)
        return out

    def page(self, name: str, start: int, max_rows: int, who: str) -> tuple[np.ndarray, np.ndarray, int]:
        """A page of table ``name``'s rows (:meth:`psgd.tables.held.RowTable.page`), at most ``max_rows`` and
        BLOCK_BYTES of values."""
        if name not in self.tables:
            raise ShardError(
                "INVALID_ARGUMENT",
                f"{who} asked for the rows of table {name!r}; this job's tables: {', '.join(self.tables) or 'none'}",
            )
        if start < -1:
            raise ShardError("INVALID_ARGUMENT", f"{who}: a listing starts at 0 or a reply's next, not {start}")
        table = self.tables[name]
        most = max(1, BLOCK_BYTES // (table.spec.dim * table.dtype.itemsize))
        if start == -1:
            return np.zeros(0, np.int64), np.zeros((0, table.spec.dim), table.dtype), -1
        return table.page(start, min(most, max_rows) if max_rows > 0 else most)

    def apply(self, rows: Mapping[str, tuple[np.ndarray, np.ndarray]], lr_scale: float, share: Share = WHOLE) -> None:
        for name, (ids, values) in rows.items():
            self.tables[name].apply(ids, values, lr_scale, share)
            self.counters["rows_pushed"] += int(ids.size)

    def add(self, rows: Mapping[str, tuple[np.ndarray, np.ndarray]], worker: int = 0) -> None:
        """Keep a sync push's rows for its round (by ``worker``: the round adds them in the workers' order)."""
        for name, (ids, values) in rows.items():
            self.round[name].append((ids, np.array(values, dtype=np.float64), worker))
            self.counters["rows_pushed"] += int(ids.size)

    def close_round(self, pushes: int, lr_scale: float = 1.0) -> None:
        """Apply the round's row gradients averaged over its ``pushes``, then forget them.  They are added in the
        order of their workers, not the order they came: the sum of an id's gradients is the same bits however
        the round's pushes arrived (a job that goes back to a cut computes the same rounds again)."""
        for name, parts in self.round.items():
            parts.sort(key=lambda p: p[2])  # stable: a round carried from a checkpoint (worker -1) first
            if parts and pushes:
                ids = np.concatenate([p[0] for p in parts])
                distinct, where = np.unique(ids, return_inverse=True)
                sums = np.zeros((distinct.size, parts[0][1].shape[1]))
                np.add.at(sums, where, np.concatenate([p[1] for p in parts]))
                self.tables[name].apply(distinct, sums / pushes, lr_scale)
            parts.clear()

    def clear_round(self) -> None:
        for parts in self.round.values():
            parts.clear()

    # -- checkpoints and status -------------------------------------------------------------------------------
    def arrays(self) -> dict[str, np.ndarray]:
        """Every table's rows and a round's row gradients in flight, for a checkpoint."""
        out = {}
        for name, table in self.tables.items():
            out.update({f"table/{name}/{k}": v for k, v in table.state_dict().items()})
            parts = self.round[name]
            out[f"round_rows/{name}/ids"] = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
            out[f"round_rows/{name}/values"] = (
                np.concatenate([p[1] for p in parts]) if parts else np.zeros((0, table.spec.dim))
            )
            out[f"round_rows/{name}/workers"] = (
                np.concatenate([np.full(p[0].size, p[2]) for p in parts]) if parts else np.zeros(0, np.int64)
            )
        return out

    def load(self, arrays: Mapping[str, np.ndarray]) -> None:
        for name, table in self.tables.items():
            prefix = f"table/{name}/"
            table.load_state_dict({k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)})
            ids = arrays.get(f"round_rows/{name}/ids")
            self.round[name] = []
            if ids is not None and len(ids):  # each push's rows apart again, by its worker (-1: unknown)
                values = np.asarray(arrays[f"round_rows/{name}/values"])
                who = np.asarray(arrays.get(f"round_rows/{name}/workers", np.full(len(ids), -1)), np.int64)
                for w in dict.fromkeys(who.tolist()):
                    mask = who == w
                    self.round[name].append((np.asarray(ids, np.int64)[mask], values[mask], w))

    def status(self) -> dict[str, Any]:
        return {name: table.status() for name, table in self.tables.items()}
