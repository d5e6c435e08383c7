"""A sync round in the making: under a policy that accumulates (sync), each push of the round is added to a sum
of the shard's own, with the version it was computed from; when the round closes, the mean is applied once
(:meth:`psgd.server.state.core.ShardCore`) and the round starts again empty.  A checkpoint keeps a round in flight.

An ``ordered`` round (a job with cuts, ``[cluster] checkpoint_rounds``) keeps each push apart and adds them in
the order of their workers as it closes, not in the order they came: floating-point addition depends on the
order, and a job that went back to a cut must compute the same sums again as it did the first time.  It holds a
copy of each push of the round meanwhile (up to one per worker)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


class Round:
    """The sum of a round's pushes (one buffer, viewed per slice as the store views its weights) and the base
    version of each push.  Its passes over the sum are swept as the store's are (:mod:`psgd.wire.sweep`): the
    round's first push is copied in rather than added to zeros, a round of one push is its own mean (and, where it
    closes the round as it comes, is not even copied), and a round that ends leaves its buffer as it is (its content
    counts only while it has pushes: :meth:`so_far`)."""

    def __init__(self, store: Any, ordered: bool = False):
        self.store, self.ordered = store, ordered
        self.flat = np.zeros_like(store.flat)
        self.sums: dict[int, np.ndarray] = store.views(self.flat)
        self.bases: list[int] = []
        self.apart: dict[int, np.ndarray] = {}  # ordered: each worker's push, by worker
        self._lone: Mapping[int, np.ndarray] | None = None  # a round's only push, closing it: its own mean, uncopied

    def _sweep(self, fn) -> None:
        self.store.sweep.run(self.flat.size, self.flat.itemsize, fn)

    def _fold(self, push: np.ndarray, first: bool) -> None:
        """``push`` (laid out like the sum) into the sum: copied in as the round's first, else added, in one pass."""
        flat = self.flat
        self._sweep(
            lambda a, b: np.copyto(flat[a:b], push[a:b]) if first else np.add(flat[a:b], push[a:b], out=flat[a:b])
        )

    def add(self, grads: Mapping[int, np.ndarray], base_version: int, worker: int = 0, closes: bool = False) -> None:
        """Add a push computed from ``base_version``; ``closes``: the round closes with it, before its buffer is
        used again (a round's only push is then its mean as it is, neither copied nor added)."""
        whole = getattr(grads, "flat", None)
        if closes and not self.bases and whole is not None:
            self._lone = grads
        elif self.ordered:
            kept = self.apart[worker] = np.empty_like(self.flat)
            views = self.store.views(kept)
            for i, g in grads.items():
                np.copyto(views[i], g)
        elif whole is not None:  # laid out like the sum: one pass
            self._fold(whole, first=not self.bases)
        else:
            for i, g in grads.items():
                if self.bases:
                    self.sums[i] += g
                else:
                    np.copyto(self.sums[i], g)
        self.bases.append(base_version)

    def mean(self) -> list[int]:
        """Turn the sum into the mean of its pushes; returns their base versions (none: nothing was pushed)."""
        if self._lone is not None:
            return list(self.bases)
        for k, worker in enumerate(sorted(self.apart)):
            self._fold(self.apart[worker], first=k == 0)
        self.apart.clear()
        if len(self.bases) > 1:  # one push is its own mean (x * 1.0 is x, to the bit)
            flat, scale = self.flat, 1.0 / len(self.bases)
            self._sweep(lambda a, b: np.multiply(flat[a:b], scale, out=flat[a:b]))
        return list(self.bases)

    def total(self) -> Mapping[int, np.ndarray]:
        """What the round applies once :meth:`mean` has made it: its mean, per slice."""
        return self.sums if self._lone is None else self._lone

    def clear(self) -> None:
        self._lone = None
        self.bases.clear()
        self.apart.clear()

    def so_far(self) -> np.ndarray:
        """The sum of the pushes added so far: zeros before the first, and in an ordered round (its pushes are
        kept apart, and added only as it closes)."""
        if self._lone is not None:
            return self._lone.flat
        return self.flat if self.bases and not self.ordered else np.zeros_like(self.flat)

    def load(self, flat: np.ndarray, bases: Sequence[Any], apart: Mapping[int, np.ndarray] | None = None) -> None:
        """A round in flight, from a checkpoint: its sum so far, and (ordered) each push kept apart."""
        np.copyto(self.flat, flat)
        self.bases[:] = [int(b) for b in bases]
        self.apart = {int(w): np.array(a, dtype=self.flat.dtype) for w, a in (apart or {}).items()}
