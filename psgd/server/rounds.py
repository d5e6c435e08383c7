"""A sync round in the making: under a policy that accumulates (sync), each push of the round is added to a sum
of the shard's own, with the version it was computed from; when the round closes, the mean is applied once
(:meth:`psgd.server.core.ShardCore`) and the round starts again empty.  A checkpoint keeps a round in flight."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np


class Round:
    """The sum of a round's pushes (one buffer, viewed per slice as the store views its weights) and the base
    version of each push."""

    def __init__(self, store: Any):
        self.flat = np.zeros_like(store.flat)
        self.sums: dict[int, np.ndarray] = store.views(self.flat)
        self.bases: list[int] = []

    def add(self, grads: Mapping[int, np.ndarray], base_version: int) -> None:
        for i, g in grads.items():
            self.sums[i] += g
        self.bases.append(base_version)

    def mean(self) -> list[int]:
        """Turn the sum into the mean of its pushes; returns their base versions (none: nothing was pushed)."""
        if self.bases:
            self.flat *= 1.0 / len(self.bases)
        return list(self.bases)

    def clear(self) -> None:
        self.flat.fill(0)
        self.bases.clear()

    def load(self, flat: np.ndarray, bases: Sequence[Any]) -> None:
        """A round in flight, from a checkpoint."""
        np.copyto(self.flat, flat)
        self.bases[:] = [int(b) for b in bases]
