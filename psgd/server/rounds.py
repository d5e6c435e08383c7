"""A sync round in the making: under a policy that accumulates (sync), each push of the round is added to a sum
of the shard's own, with the version it was computed from; when the round closes, the mean is applied once
(:meth:`psgd.server.core.ShardCore`) and the round starts again empty.  A checkpoint keeps a round in flight.

An ``ordered`` round (a job with cuts, ``[cluster] checkpoint_rounds``) keeps each push apart and adds them in
the order of their workers as it closes, not in the order they came: floating-point addition depends on the
order, and a job that went back to a cut must compute the same sums again as it did the first time.  It holds a
copy of each push of the round meanwhile (up to one per worker)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np


class Round:
    """The sum of a round's pushes (one buffer, viewed per slice as the store views its weights) and the base
    version of each push."""

    def __init__(self, store: Any, ordered: bool = False):
        self.store, self.ordered = store, ordered
        self.flat = np.zeros_like(store.flat)
        self.sums: dict[int, np.ndarray] = store.views(self.flat)
        self.bases: list[int] = []
        self.apart: dict[int, np.ndarray] = {}  # ordered: each worker's push, by worker

    def add(self, grads: Mapping[int, np.ndarray], base_version: int, worker: int = 0) -> None:
        if self.ordered:
            kept = self.apart[worker] = np.empty_like(self.flat)
            views = self.store.views(kept)
            for i, g in grads.items():
                np.copyto(views[i], g)
        elif getattr(grads, "flat", None) is not None:  # laid out like the sum: one addition
            self.flat += grads.flat
        else:
            for i, g in grads.items():
                self.sums[i] += g
        self.bases.append(base_version)

    def mean(self) -> list[int]:
        """Turn the sum into the mean of its pushes; returns their base versions (none: nothing was pushed)."""
        for worker in sorted(self.apart):
            self.flat += self.apart[worker]
        self.apart.clear()
        if self.bases:
            self.flat *= 1.0 / len(self.bases)
        return list(self.bases)

    def clear(self) -> None:
        self.flat.fill(0)
        self.bases.clear()
        self.apart.clear()

    def load(self, flat: np.ndarray, bases: Sequence[Any], apart: Mapping[int, np.ndarray] | None = None) -> None:
        """A round in flight, from a checkpoint: its sum so far, and (ordered) each push kept apart."""
        np.copyto(self.flat, flat)
        self.bases[:] = [int(b) for b in bases]
        self.apart = {int(w): np.array(a, dtype=self.flat.dtype) for w, a in (apart or {}).items()}
