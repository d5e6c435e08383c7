"""Where a table's ids are: :class:`IdSlots`, the index from an id to the slot of its row, and
:class:`Sightings`, the sketch that counts how often ids were seen (admission, :mod:`psgd.tables.held`).

Both take whole batches of ids at once, in numpy arrays.  The index is a hash table with open addressing: 8
bytes a place, from a quarter to three quarters of the places filled, so 11-32 bytes an id held, where a Python
dict took about 100 (more than a row of 16 float32).  The sketch has a fixed size whatever the ids.
"""

from __future__ import annotations

import numpy as np

from psgd.model.table import mix64, name_key


class Sightings:
    """A count-min sketch of how often each id was seen: ``depth`` rows of ``width`` saturating counters."""

    def __init__(self, salt: str, depth: int = 4, width: int = 1 << 18):
        self.width = width
        self.keys = [name_key("psgd-sightings", salt, d) for d in range(depth)]
        self.counts = np.zeros((depth, width), dtype=np.uint16)

    def _cells(self, ids: np.ndarray) -> list[np.ndarray]:
        return [(mix64(ids.view(np.uint64) ^ key) % np.uint64(self.width)).astype(np.int64) for key in self.keys]

    def add(self, ids: np.ndarray) -> np.ndarray:
        """Count one sighting of each of ``ids`` (distinct); how often each has been seen, this one included."""
        cells = self._cells(ids)
        seen = np.full(ids.size, np.iinfo(np.uint16).max, dtype=np.int64)
        for row, cell in zip(self.counts, cells):
            np.add.at(row, cell[row[cell] < np.iinfo(np.uint16).max], 1)
            seen = np.minimum(seen, row[cell])
        return seen

    def count(self, ids: np.ndarray) -> np.ndarray:
        seen = np.full(ids.size, np.iinfo(np.uint16).max, dtype=np.int64)
        for row, cell in zip(self.counts, self._cells(ids)):
            seen = np.minimum(seen, row[cell])
        return seen


class IdSlots:
    """Which slot of a :class:`RowTable` holds each id: open addressing with linear probing, the places holding
    slot numbers (-1 never used, -2 freed), the ids themselves read from the table's own ``keys`` array (passed to
    every call, since the table grows it).  Every call takes a batch of distinct ids and probes them together,
    one vector step per place along the probe sequences."""

    EMPTY, FREED = -1, -2
    MAX_LOAD = 0.75
    #: the most bytes one id takes: an int64 place, the places at least half free after a rebuild, twice while grown
    BYTES_PER_ID = 8 * 2 * 2

    def __init__(self):
        self.places = np.full(1024, self.EMPTY, np.int64)
        self.size = 0  # ids held
        self.freed = 0  # places freed since the last rebuild (they end no probe sequence)

    @property
    def nbytes(self) -> int:
        return int(self.places.nbytes)

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return (mix64(ids.view(np.uint64)) & np.uint64(self.places.size - 1)).astype(np.int64)

    def _probe(self, ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """The place of each id, -1 where it is not held."""
        mask = self.places.size - 1
        where = np.full(ids.size, -1, np.int64)
        pos = self._home(ids)
        pending = np.arange(ids.size)
        while pending.size:
            slot = self.places[pos]
            found = slot >= 0
            found[found] = keys[slot[found]] == ids[pending[found]]
            where[pending[found]] = pos[found]
            going = ~found & (slot != self.EMPTY)
            pending, pos = pending[going], (pos[going] + 1) & mask
        return where

    def find(self, ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """The slot of each of ``ids``, -1 where it is not held."""
        where = self._probe(ids, keys)
        return np.where(where >= 0, self.places[np.maximum(where, 0)], -1)

    def add(self, ids: np.ndarray, slots: np.ndarray, keys: np.ndarray) -> None:
        """Hold ``ids`` (none held yet) at ``slots``; ``keys[slots]`` are already ``ids``."""
        if (self.size + self.freed + ids.size) > self.MAX_LOAD * self.places.size:
            self._rebuild(self.size + ids.size, keys)
        self._place(ids, slots)
        self.size += ids.size

    def _place(self, ids: np.ndarray, slots: np.ndarray) -> None:
        mask = self.places.size - 1
        pos = self._home(ids)
        pending = np.arange(ids.size)
        while pending.size:
            open_ = self.places[pos] < 0
            here, first = np.unique(pos[open_], return_index=True)  # one id per open place this round
            winners = pending[open_][first]
            self.freed -= int((self.places[here] == self.FREED).sum())
            self.places[here] = slots[winners]
            going = np.ones(pending.size, bool)
            going[np.flatnonzero(open_)[first]] = False
            pending = pending[going]
            pos = np.where(open_[going], pos[going], (pos[going] + 1) & mask)  # a place just taken is not open
        return None

    def remove(self, ids: np.ndarray, keys: np.ndarray) -> None:
        """Let go of ``ids`` (all held)."""
        where = self._probe(ids, keys)
        where = where[where >= 0]
        self.places[where] = self.FREED
        self.size -= where.size
        self.freed += where.size

    def _rebuild(self, need: int, keys: np.ndarray) -> None:
        slots = self.places[self.places >= 0]
        size = 1024
        while need > self.MAX_LOAD / 1.5 * size:  # room to grow by half before the next rebuild
            size *= 2
        self.places = np.full(size, self.EMPTY, np.int64)
        self.freed = 0
        self._place(keys[slots], slots)
