"""A shard's update pass (psgd.server.state.update): an update swept piece by piece over threads equal to the update
made at once, to the bit, and a gradient of separate slices applied slice by slice as each key's own update."""

from __future__ import annotations

import numpy as np
import pytest

from psgd.optim import build_optimizer
from psgd.partition import Slice
from psgd.server.state.store import SliceViews
from psgd.server.state.update import UpdatePass
from psgd.wire.sweep import PARALLEL_BYTES, Sweep

OPTIMIZERS = [
    ("sgd", {}),
    ("sgd", {"weight_decay": 0.01}),
    ("momentum", {"weight_decay": 0.01}),
    ("nesterov", {}),
    ("adam", {"weight_decay": 0.01}),
    ("adamw", {"weight_decay": 0.01}),
]


def two_slices(n: int, dtype: str) -> tuple[dict[int, Slice], dict[int, tuple[int, int]]]:
    slices = {0: Slice(0, "a", 0, n // 3, 0, dtype), 1: Slice(1, "b", 0, n - n // 3, 0, dtype)}
    return slices, {0: (0, n // 3), 1: (n // 3, n)}


def views(flat: np.ndarray, offsets: dict[int, tuple[int, int]]) -> SliceViews:
    return SliceViews(flat, {i: flat[a:b] for i, (a, b) in offsets.items()})


@pytest.mark.parametrize("name,options", OPTIMIZERS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_an_update_swept_in_pieces_is_the_update_made_at_once(name, options, dtype):
    n = PARALLEL_BYTES // np.dtype(dtype).itemsize + 777
    slices, offsets = two_slices(n, dtype)
    bounds, keys = tuple(offsets.values()), tuple(s.key for s in slices.values())
    rng = np.random.default_rng(3)
    start = rng.standard_normal(n).astype(dtype)
    at_once, swept = build_optimizer(name, lr=0.05, **options), build_optimizer(name, lr=0.05, **options)
    p1, p2 = start.copy(), start.copy()
    sweep = Sweep(n * p1.itemsize, "t", 3)
    updates = UpdatePass(slices, offsets, sweep)
    for _ in range(3):
        g = rng.standard_normal(n).astype(dtype)
        at_once.update_flat(keys, p1, g, bounds, 0.5)
        updates.apply(swept, p2, views(p2, offsets), views(g, offsets), 0.5)
    sweep.close()
    assert p1.tobytes() == p2.tobytes()
    for k in keys:
        assert at_once.step_count(k) == swept.step_count(k) == 3
        for state in at_once.state(k):
            assert at_once.state(k)[state].tobytes() == swept.state(k)[state].tobytes()


@pytest.mark.parametrize("threads", [1, 3])
def test_a_gradient_of_separate_slices_is_applied_slice_by_slice(threads):
    n = 1000
    slices, offsets = two_slices(n, "float32")
    rng = np.random.default_rng(4)
    start, g = rng.standard_normal(n).astype("float32"), rng.standard_normal(n).astype("float32")
    each, passed = build_optimizer("adam", lr=0.05), build_optimizer("adam", lr=0.05)
    p1, p2 = start.copy(), start.copy()
    for i, (a, b) in offsets.items():
        each.update(slices[i].key, p1[a:b], g[a:b], 0.5)
    sweep = Sweep(PARALLEL_BYTES, "t", threads)
    grads = {i: g[a:b].copy() for i, (a, b) in offsets.items()}  # no ``flat``: not one array
    UpdatePass(slices, offsets, sweep).apply(passed, p2, views(p2, offsets), grads, 0.5)
    sweep.close()
    assert p1.tobytes() == p2.tobytes()
