"""The partition plan: which shard holds which part of which variable.

Every process derives the same plan from the model's variable specs, the
number of shards and the slice size.  Variables larger than the slice size are
cut into flat slices of at most ``slice_bytes``; slices are then placed on
shards largest first, each on the shard holding the fewest bytes so far (ties
to the lower shard index), which keeps shards within one slice of each other.

The plan's hash is compared when a worker registers: a worker built for
another model, dtype, shard count or slice size is refused with a message
that says what differs (see :func:`plan_differences`).

Embedding tables (:class:`psgd.model.table.TableSpec`) are not sliced: each row lives on the shard a hash of its
id names (:meth:`PartitionPlan.shard_of_ids`), so every shard holds about the same share of any set of rows.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from psgd.errors import InputError
from psgd.model.base import VarSpec
from psgd.model.table import TableSpec, check_ids, mix64, name_key

DEFAULT_SLICE_BYTES = 4 << 20
#: How a row's shard follows from its id, named in the plan's description (and so in its hash).
ROW_HASH = "splitmix64(id ^ key(table)) mod shards"


class PlanError(InputError):
    """A plan that cannot be made, or two plans that do not match."""


@dataclasses.dataclass(frozen=True)
class Slice:
    """Elements ``[start, stop)`` of variable ``var`` (flattened), held by ``shard``."""

    id: int
    var: str
    start: int
    stop: int
    shard: int
    dtype: str

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    @property
    def key(self) -> str:
        """A stable name, used for optimizer state and checkpoints: ``var#start``."""
        return f"{self.var}#{self.start}"


class PartitionPlan:
    """Slices of every variable and their shards; immutable once made."""

    def __init__(
        self,
        specs: Sequence[VarSpec],
        num_shards: int,
        slice_bytes: int = DEFAULT_SLICE_BYTES,
        tables: Sequence[TableSpec] = (),
    ):
        if num_shards < 1:
            raise PlanError(f"the number of shards must be at least 1, got {num_shards}")
        if slice_bytes < 64:
            raise PlanError(f"slice size must be at least 64 bytes, got {slice_bytes}")
        names = [s.name for s in specs] + [t.name for t in tables]
        if len(set(names)) != len(names):
            raise PlanError(
                f"variable and table names must be unique: {sorted(n for n in set(names) if names.count(n) > 1)}"
            )
        if not specs:
            raise PlanError("a model needs at least one variable")
        self.tables = tuple(tables)
        self.table_by_name = {t.name: t for t in self.tables}
        self.specs = tuple(specs)
        self.num_shards = int(num_shards)
        self.slice_bytes = int(slice_bytes)
        self.slices = tuple(_place(_cut(self.specs, self.slice_bytes), self.num_shards))
        self._by_var: dict[str, list[Slice]] = {}
        for sl in self.slices:
            self._by_var.setdefault(sl.var, []).append(sl)
        self.spec_by_name = {s.name: s for s in self.specs}

    # -- lookups ------------------------------------------------------------
    def slices_for_shard(self, shard: int) -> list[Slice]:
        return [s for s in self.slices if s.shard == shard]

    def slices_of(self, var: str) -> list[Slice]:
        return self._by_var[var]

    def shard_bytes(self) -> list[int]:
        totals = [0] * self.num_shards
        for s in self.slices:
            totals[s.shard] += s.nbytes
        return totals

    @functools.cached_property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    # -- identity -------------------------------------------------------------
    def description(self) -> dict[str, Any]:
        """What the plan is made from: compared field by field on a mismatch."""
        return {
            "num_shards": self.num_shards,
            "slice_bytes": self.slice_bytes,
            # a state variable (VarSpec.state) says so; the others keep the description they had before
            "variables": [[s.name, list(s.shape), s.dtype, *(["state"] if s.state else [])] for s in self.specs],
            # a plan without tables keeps the description (and the hash) it had before there were tables
            **(
                {"tables": [[t.name, t.dim, t.dtype, t.init, t.scale] for t in self.tables], "row_hash": ROW_HASH}
                if self.tables
                else {}
            ),
        }

    @property
    def hash(self) -> str:
        text = json.dumps(self.description(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def shard_of_ids(self, table: str, ids: np.ndarray) -> np.ndarray:
        """The shard that holds each row ``ids`` of ``table``: a hash of the id (:data:`ROW_HASH`), spread evenly
        whatever the ids are, and independent of how dense variables are sliced."""
        if table not in self.table_by_name:
            raise PlanError(f"no table {table!r} in this plan (tables: {', '.join(self.table_by_name) or 'none'})")
        mixed = mix64(check_ids(ids).view(np.uint64) ^ name_key("psgd-rows", table))
        return (mixed % np.uint64(self.num_shards)).astype(np.int64)

    # -- moving between whole variables and slices -----------------------------
    def split(self, values: dict[str, Any], shard: int | None = None) -> dict[int, Any]:
        """Flat views of ``values`` per slice id (of one shard, or all)."""
        out = {}
        for s in self.slices:
            if shard is None or s.shard == shard:
                out[s.id] = values[s.var].reshape(-1)[s.start : s.stop]
        return out

    def __repr__(self) -> str:
        return (
            f"PartitionPlan({len(self.specs)} variables, {len(self.slices)} slices, "
            f"{self.num_shards} shards, hash {self.hash})"
        )


def _cut(specs: Iterable[VarSpec], slice_bytes: int) -> list[tuple[str, int, int, str]]:
    pieces = []
    for spec in specs:
        per_slice = max(1, slice_bytes // np.dtype(spec.dtype).itemsize)
        for start in range(0, spec.size, per_slice):
            pieces.append((spec.name, start, min(spec.size, start + per_slice), spec.dtype))
    return pieces


def _place(pieces: list[tuple[str, int, int, str]], num_shards: int) -> list[Slice]:
    """Largest first onto the least-loaded shard; slice ids follow variable order."""
    itemsize = {p: np.dtype(p[3]).itemsize for p in pieces}
    order = sorted(range(len(pieces)), key=lambda i: (-(pieces[i][2] - pieces[i][1]) * itemsize[pieces[i]], i))
    heap = [(0, k) for k in range(num_shards)]
    shard_of = [0] * len(pieces)
    for i in order:
        load, k = heapq.heappop(heap)
        shard_of[i] = k
        name, start, stop, dtype = pieces[i]
        heapq.heappush(heap, (load + (stop - start) * itemsize[pieces[i]], k))
    return [Slice(i, name, start, stop, shard_of[i], dtype) for i, (name, start, stop, dtype) in enumerate(pieces)]


def plan_differences(
    mine: dict[str, Any], theirs: dict[str, Any], mine_label: str = "worker", theirs_label: str = "server"
) -> str:
    """One readable line saying how two plan descriptions differ (empty when equal)."""
    problems = []
    for key in ("num_shards", "slice_bytes"):
        if mine.get(key) != theirs.get(key):
            problems.append(f"{key}: {mine_label} {mine.get(key)} vs {theirs_label} {theirs.get(key)}")
    a = {v[0]: v for v in mine.get("variables", [])}
    b = {v[0]: v for v in theirs.get("variables", [])}
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a:
        problems.append(f"variables only the {mine_label} has: {', '.join(only_a)}")
    if only_b:
        problems.append(f"variables only the {theirs_label} has: {', '.join(only_b)}")
    for name in sorted(set(a) & set(b)):
        if a[name] != b[name]:
            problems.append(
                f"{name}: {mine_label} shape {tuple(a[name][1])} {a[name][2]} vs "
                f"{theirs_label} shape {tuple(b[name][1])} {b[name][2]}"
            )
    if not problems and [v[0] for v in mine.get("variables", [])] != [v[0] for v in theirs.get("variables", [])]:
        problems.append("the variables are listed in a different order")
    ta = {t[0]: t for t in mine.get("tables", [])}
    tb = {t[0]: t for t in theirs.get("tables", [])}
    for name in sorted(set(ta) | set(tb)):
        if ta.get(name) != tb.get(name):

            def show(t):
                return "no such table" if t is None else f"dim {t[1]} {t[2]}, {t[3]} {t[4]}"

            problems.append(f"table {name}: {mine_label} {show(ta.get(name))} vs {theirs_label} {show(tb.get(name))}")
    if not problems and mine.get("row_hash") != theirs.get("row_hash"):
        problems.append(f"rows spread by {mine.get('row_hash')!r} vs {theirs.get('row_hash')!r}")
    return "; ".join(problems)
