"""Rows of one embedding table held in one process: made when first needed, updated by a row rule, evicted when
idle.

:class:`RowTable` keeps the rows of one :class:`~psgd.model.table.TableSpec` that this process holds: a shard
its share (the plan says which: :meth:`psgd.partition.PartitionPlan.shard_of_ids`), the reference trainer or an
all-reduce rank all of them.  A row is made the first time its id is read,
from (seed, table, id) alone (:func:`psgd.model.table.initial_rows`), so a table of 10^9 possible ids costs only
the rows ever touched.  Its options (:class:`TableOptions`):

- ``admit_after = k`` (k > 1): a row is made only at its id's k-th sighting in a pull; until then the id reads
  as its initial value and its gradients are dropped (as Monolith's and PaddlePaddle's admission filters do).
  Sightings are counted in a count-min sketch of fixed size (:class:`Sightings`), so ids that never get a row
  cost no memory per id; the sketch may count an id high, never low: a row may be admitted early, never late.
- ``idle_updates = n``: rows neither read nor updated in the last n updates of the table are evicted (their
  state with them); an evicted id reads as its initial value again.
- ``max_rows = m``: at most m rows; one more is refused (:class:`TableFull`) (``when_full = "fail"``) or
  makes room by evicting the rows touched longest ago (``when_full = "evict"``).

Storage is one array of rows, one per state field of the rule and three of bookkeeping (id, update count, last
touch), grown by doubling; freed slots are reused.  Which slot holds an id is found by
:class:`psgd.tables.index.IdSlots`, a hash table in numpy arrays probed for a whole batch of ids at once.  Not
thread-safe: a shard core holds its
lock around every call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from psgd.errors import ClusterError
from psgd.model.table import Rows, TableSpec, initial_rows, table_keys, unique_lookups
from psgd.optim.base import WHOLE, Share
from psgd.tables.index import IdSlots, Sightings
from psgd.tables.rules import RowOptimizer

WHEN_FULL = ("fail", "evict")


class TableFull(ClusterError):
    """A table may not hold the rows asked for (``tables.max_rows``); a shard answers RESOURCE_EXHAUSTED."""

    code = "RESOURCE_EXHAUSTED"


@dataclasses.dataclass(frozen=True)
class TableOptions:
    """How a table keeps its rows (see the module docstring); the defaults keep every row forever."""

    admit_after: int = 0
    idle_updates: int = 0
    max_rows: int = 0
    when_full: str = "fail"

    def __post_init__(self) -> None:
        for name in ("admit_after", "idle_updates", "max_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"tables.{name} must be an integer >= 0, got {value!r}")
        if self.when_full not in WHEN_FULL:
            raise ValueError(f"tables.when_full must be one of {', '.join(WHEN_FULL)}, got {self.when_full!r}")


class RowTable:
    """The rows of table ``spec`` held ``where`` (``shard 2``: for messages), updated by ``optimizer``; see the
    module docstring."""

    def __init__(
        self,
        spec: TableSpec,
        seed: int,
        optimizer: RowOptimizer,
        options: TableOptions = TableOptions(),
        where: str = "this process",
    ):
        self.spec, self.seed, self.optimizer, self.options, self.where = spec, int(seed), optimizer, options, where
        self.dtype = np.dtype(spec.dtype)
        self.columns = optimizer.state_columns(spec.dim)
        self.index = IdSlots()  # id -> slot
        self.capacity = 0
        self.ids = np.zeros(0, np.int64)
        self.used = np.zeros(0, bool)
        self.rows = np.zeros((0, spec.dim), self.dtype)
        self.state = {
            name: np.zeros((0, cols), np.float32 if self.dtype.itemsize < 4 else self.dtype)
            for name, cols in self.columns.items()
        }
        self.t = np.zeros(0, np.int64)  # updates of each row
        self.last = np.zeros(0, np.int64)  # the table's update count when each row was last touched
        self.free: list[int] = []
        self.clock = 0  # updates applied to this table
        self.sightings = Sightings(spec.name) if options.admit_after > 1 else None
        self.counters = {"rows_created": 0, "rows_evicted": 0, "rows_read": 0, "rows_updated": 0, "grads_dropped": 0}

    def __len__(self) -> int:
        return self.index.size

    def held_ids(self) -> np.ndarray:
        """The ids of the rows that exist, increasing."""
        return np.sort(self.ids[self.used])

    def row_bytes(self) -> int:
        """Bytes one row takes: its values, its rule's state, its bookkeeping (id, use, updates, last touch) and its
        place in the index."""
        state = sum(cols * a.dtype.itemsize for cols, a in zip(self.columns.values(), self.state.values()))
        return self.spec.dim * self.dtype.itemsize + state + 8 + 1 + 8 + 8 + IdSlots.BYTES_PER_ID

    @property
    def nbytes(self) -> int:
        """Bytes this table's storage takes (every slot allocated, used or free, and the index)."""
        return int(
            self.ids.nbytes
            + self.used.nbytes
            + self.rows.nbytes
            + self.t.nbytes
            + self.last.nbytes
            + sum(a.nbytes for a in self.state.values())
            + self.index.nbytes
        )

    # -- reading and updating ----------------------------------------------------------------------------------
    def read(self, ids: np.ndarray) -> np.ndarray:
        """The rows ``ids`` (distinct int64), ``[len(ids), dim]``: made now where an id is admitted, its initial
        value where it is not (yet)."""
        slots = self._slots(ids, count=True)
        out = np.empty((ids.size, self.spec.dim), self.dtype)
        have = slots >= 0
        out[have] = self.rows[slots[have]]
        if not have.all():
            out[~have] = initial_rows(self.spec, self.seed, ids[~have])
        self.last[slots[have]] = self.clock
        self.counters["rows_read"] += int(ids.size)
        return out

    def peek(self, ids: np.ndarray) -> np.ndarray:
        """The rows ``ids`` as they are, without making, counting or touching any (an evaluation's read): a row
        that does not exist reads as its initial value."""
        slots = self.index.find(ids, self.ids)
        have = slots >= 0
        out = np.empty((ids.size, self.spec.dim), self.dtype)
        out[have] = self.rows[slots[have]]
        if not have.all():
            out[~have] = initial_rows(self.spec, self.seed, ids[~have])
        return out

    def apply(self, ids: np.ndarray, grads: np.ndarray, lr_scale: float = 1.0, share: Share = WHOLE) -> int:
        """Update the rows ``ids`` (distinct) by ``grads`` ``[len(ids), dim]`` as ``share`` of a round; the
        gradients of ids not admitted are dropped.  Returns how many rows were updated."""
        slots = self._slots(ids, count=False)
        keep = slots >= 0
        self.counters["grads_dropped"] += int(ids.size - keep.sum())
        s = slots[keep]
        self.clock += 1
        if s.size:
            rows = self.rows[s]
            state = {name: a[s] for name, a in self.state.items()}
            t = self.t[s] + 1
            self.optimizer.step(rows, np.asarray(grads, dtype=self.dtype)[keep], state, t, lr_scale, share)
            self.rows[s] = rows
            for name, a in self.state.items():
                a[s] = state[name]
            self.t[s] = t
            self.last[s] = self.clock
            self.counters["rows_updated"] += int(s.size)
        idle = self.options.idle_updates
        if idle and self.clock % max(1, idle // 4) == 0:
            self.evict_idle()
        return int(s.size)

    def evict_idle(self) -> int:
        """Evict the rows untouched in the last ``idle_updates`` updates; how many were."""
        idle = self.options.idle_updates
        if not idle:
            return 0
        victims = np.flatnonzero(self.used & (self.clock - self.last > idle))
        self._evict(victims)
        return int(victims.size)

    # -- columns of state beside the rule's ----------------------------------------------------------------------
    def add_column(self, name: str, width: int) -> None:
        """Keep ``width`` more values of state per row, zero at first (a shard's delay compensation keeps each
        row's gradients' mean square); they live and are checkpointed with the rule's state."""
        if name not in self.state:
            self.columns = {**self.columns, name: width}
            self.state[name] = np.zeros(
                (self.capacity, width), self.rows.dtype if self.dtype.itemsize >= 4 else np.float32
            )

    def column(self, name: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which of ``ids`` have a row, and those rows' values of state column ``name`` (a copy)."""
        slots = self.index.find(ids, self.ids)
        have = slots >= 0
        return have, self.state[name][slots[have]]

    def set_column(self, name: str, ids: np.ndarray, values: np.ndarray) -> None:
        """Set state column ``name`` of the rows ``ids`` (each held)."""
        self.state[name][self.index.find(ids, self.ids)] = values

    # -- slots ---------------------------------------------------------------------------------------------------
    def _slots(self, ids: np.ndarray, count: bool) -> np.ndarray:
        """Each id's slot, made now for ids that are admitted; -1 for ids that are not."""
        slots = self.index.find(ids, self.ids)
        missing = np.flatnonzero(slots < 0)
        if missing.size == 0:
            return slots
        if self.sightings is not None:
            new = ids[missing]
            seen = self.sightings.add(new) if count else self.sightings.count(new)
            missing = missing[seen >= self.options.admit_after]
        if missing.size:
            slots[missing] = self._make(ids[missing], keep=slots[slots >= 0])
        return slots

    def _make(self, ids: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """Slots for new rows ``ids``, at their initial values; never evicts the slots in ``keep``."""
        cap, n = self.options.max_rows, ids.size
        if cap and len(self) + n > cap:
            if self.options.when_full == "fail" or n + keep.size > cap:
                raise TableFull(
                    f"table {self.spec.name!r} on {self.where} holds "
                    f"{len(self):,} rows and may hold {cap:,} (tables.max_rows): {n:,} more do not "
                    f"fit; raise max_rows, add shards, or set tables.when_full = \"evict\""
                )
            self._evict_oldest(len(self) + n - cap, keep)
        while len(self.free) < n:
            self._grow()
        slots = np.array([self.free.pop() for _ in range(n)], np.int64)
        self.ids[slots], self.used[slots] = ids, True
        self.rows[slots] = initial_rows(self.spec, self.seed, ids)
        for a in self.state.values():
            a[slots] = 0
        self.t[slots], self.last[slots] = 0, self.clock
        self.index.add(ids, slots, self.ids)
        self.counters["rows_created"] += n
        return slots

    def _evict_oldest(self, need: int, keep: np.ndarray) -> None:
        age = np.where(self.used, self.last, np.iinfo(np.int64).max)
        age[keep] = np.iinfo(np.int64).max
        victims = np.argpartition(age, need - 1)[:need] if need < age.size else np.arange(age.size)
        self._evict(victims[self.used[victims]])

    def _evict(self, slots: np.ndarray) -> None:
        self.index.remove(self.ids[slots], self.ids)
        self.used[slots] = False
        self.free.extend(slots.tolist())
        self.counters["rows_evicted"] += int(slots.size)

    def _grow(self) -> None:
        old, new = self.capacity, max(1024, 2 * self.capacity)
        if self.options.max_rows:
            new = max(old + 1, min(new, self.options.max_rows))

        def wider(a: np.ndarray) -> np.ndarray:
            b = np.zeros((new,) + a.shape[1:], a.dtype)
            b[:old] = a
            return b

        self.ids, self.used, self.rows, self.t, self.last = (
            wider(a) for a in (self.ids, self.used, self.rows, self.t, self.last)
        )
        self.state = {name: wider(a) for name, a in self.state.items()}
        self.free.extend(range(new - 1, old - 1, -1))  # lowest slots first
        self.capacity = new

    # -- checkpoints and status ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """The rows that exist, by increasing id, with their state: arrays for a checkpoint."""
        slots = np.flatnonzero(self.used)
        slots = slots[np.argsort(self.ids[slots], kind="stable")]
        out = {
            "ids": self.ids[slots],
            "rows": self.rows[slots],
            "t": self.t[slots],
            "last": self.last[slots],
            "clock": np.array([self.clock], np.int64),
        }
        out.update({f"state/{name}": a[slots] for name, a in self.state.items()})
        if self.sightings is not None:
            out["sightings"] = self.sightings.counts
        return out

    def load_state_dict(self, arrays: dict[str, np.ndarray]) -> None:
        """Take the rows of :meth:`state_dict`, replacing every row held."""
        ids = np.asarray(arrays["ids"], np.int64)
        rows = np.asarray(arrays["rows"])
        if rows.shape != (ids.size, self.spec.dim) or np.unique(ids).size != ids.size:
            raise ValueError(f"table {self.spec.name!r}: {ids.size} ids with rows of shape {rows.shape} do not fit")
        added = {k: w for k, w in self.columns.items() if k not in self.optimizer.state_columns(self.spec.dim)}
        self.__init__(self.spec, self.seed, self.optimizer, self.options, self.where)
        for name, width in added.items():
            self.add_column(name, width)
        if self.options.max_rows and ids.size > self.options.max_rows:
            raise ValueError(
                f"table {self.spec.name!r}: {ids.size:,} rows saved, tables.max_rows is {self.options.max_rows:,}"
            )
        while len(self.free) < ids.size:
            self._grow()
        slots = np.arange(ids.size, dtype=np.int64)
        self.free = [s for s in self.free if s >= ids.size]
        self.ids[slots], self.used[slots], self.rows[slots] = ids, True, rows
        self.t[slots], self.last[slots] = arrays["t"], arrays["last"]
        for name, a in self.state.items():
            if name in self.optimizer.state_columns(self.spec.dim) or f"state/{name}" in arrays:
                a[slots] = arrays[f"state/{name}"]  # an added column a checkpoint lacks starts at zero
        self.clock = int(np.asarray(arrays["clock"]).reshape(-1)[0])
        if self.sightings is not None and "sightings" in arrays:
            self.sightings.counts[...] = arrays["sightings"]
        self.index.add(ids, slots, self.ids)

    def page(self, start: int, max_rows: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Up to ``max_rows`` rows that exist, from slot ``start`` on: (ids, rows, the slot the next page starts
        at, or -1 at the end).  Pages taken while no row is made or evicted list every row once."""
        ids, rows = [], []
        got, at = 0, max(0, int(start))
        while got < max_rows and at < self.capacity:
            window = slice(at, min(self.capacity, at + 2 * max_rows))
            slots = np.flatnonzero(self.used[window])[: max_rows - got] + at
            ids.append(self.ids[slots])
            rows.append(self.rows[slots])
            got += slots.size
            at = int(slots[-1]) + 1 if got == max_rows else window.stop
        found = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        values = np.concatenate(rows) if rows else np.zeros((0, self.spec.dim), self.dtype)
        return found, values, (at if at < self.capacity else -1)

    def saved(self) -> dict[str, np.ndarray]:
        """The rows that exist, as a weights file holds them (:func:`psgd.model.table.table_keys`)."""
        state = self.state_dict()
        key_ids, key_rows = table_keys(self.spec.name)
        return {key_ids: state["ids"], key_rows: state["rows"]}

    def status(self) -> dict[str, Any]:
        return {
            "rows": len(self),
            "bytes": self.nbytes,
            "capacity": self.capacity,
            "clock": self.clock,
            **self.counters,
        }


def lookup_rows(tables: Mapping[str, RowTable], lookups: Mapping[str, Any], device: Any, make: bool) -> dict[str, Rows]:
    """The :class:`~psgd.model.table.Rows` of each table that ``lookups`` (a batch's ids, by table) names, read
    from ``tables`` held whole in this process (the reference trainer's, an all-reduce rank's), on ``device``:
    made where they do not exist yet (``make``: a training step), or only read (an evaluation)."""
    out = {}
    for name, wanted in lookups.items():
        ids, index = unique_lookups(wanted)
        values = tables[name].read(ids) if make else tables[name].peek(ids)
        out[name] = Rows(ids, device.asarray(values), device.asarray(index))
    return out


def saved_tables(tables: Mapping[str, RowTable]) -> dict[str, np.ndarray]:
    """Every table's rows that exist, as a weights file holds them (:meth:`RowTable.saved`)."""
    return {k: v for table in tables.values() for k, v in table.saved().items()}
