"""A shard's update pass: its optimizer applied over the weights of the store (:mod:`psgd.server.state.store`).

A push costs a shard passes over memory the size of its weights: a gradient through shared memory is copied into a
buffer of the shard's own and checked (:meth:`psgd.wire.sweep.Sweep.copy_checked`), then applied by the optimizer,
whose rule on NumPy writes temporaries as large as the weights (SGD's ``p -= lr * g`` writes ``lr * g`` and reads it
back).  Made over the whole array at once, the update reads and writes all of it from memory several times (SGD
five times the gradient's bytes).  Made piece by piece on the store's sweep, a piece stays in the cache from one
operation of the rule to the next, and the update costs its own traffic: read the gradient and the weights, write
the weights.  An elementwise rule gives the same bits in any piece order: the same operations on the same values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import numpy as np

from psgd.optim import WHOLE, Optimizer, Share
from psgd.partition import Slice
from psgd.wire.sweep import Sweep


class UpdatePass:
    """Applies an optimizer to weights laid out as a store's (``slices``, each at its ``offsets`` in one flat
    array), on ``sweep``'s threads."""

    def __init__(self, slices: Mapping[int, Slice], offsets: Mapping[int, tuple[int, int]], sweep: Sweep):
        self.slices, self.sweep = slices, sweep
        order = sorted(slices)
        self._keys = tuple(slices[i].key for i in order)
        self._bounds = tuple(offsets[i] for i in order)

    def apply(
        self,
        optimizer: Optimizer,
        flat: np.ndarray,
        weights: Mapping[int, np.ndarray],
        grads: Mapping[int, np.ndarray],
        lr_scale: float,
        share: Share = WHOLE,
    ) -> None:
        """Update ``flat`` (whose slices ``weights`` views) with ``grads``: an elementwise rule all the slices at
        once, piece by piece, where the gradient is one array too (its ``flat``); else slice by slice, the slices
        spread over the threads."""
        whole = getattr(grads, "flat", None)
        if whole is not None and optimizer.elementwise:
            optimizer.update_flat(self._keys, flat, whole, self._bounds, lr_scale, share, over=self._pieces(flat))
        else:
            self.sweep.map(lambda i: optimizer.update(self.slices[i].key, weights[i], grads[i], lr_scale, share), grads)

    def _pieces(self, flat: np.ndarray) -> Callable[[Callable[[int, int], object]], None]:
        """What the optimizer runs its step over: each piece of ``flat``, spread over the sweep's threads."""
        return functools.partial(self.sweep.run, flat.size, flat.itemsize)
