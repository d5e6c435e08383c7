"""Delay compensation (DC-ASGD, Zheng et al. 2017) on a shard, against the paper's update written out by
hand in float64: a gradient g computed on the weights w_pulled its worker pulled is applied as
g + λ·g⊙g⊙(w_now − w_pulled); adaptive λ is λ0 / √MeanSquare, MeanSquare ← 0.95·MeanSquare + 0.05·g⊙g."""

from __future__ import annotations

import numpy as np
import pytest
from test_shard_core import INIT, LR, grad, grads_of, make_core, register_all, weights

from psgd.server.state.remedies import EPSILON
from psgd.server.state.store import SLOTS


def flat(tree: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([tree["w"], tree["b"]])


def pull(core, worker: int) -> None:
    snap = core.pull(worker, core.roster.workers[worker].clock, timeout=0)
    snap.release()


def reference(lam0: float, adaptive: bool, staleness_lr: bool = False) -> np.ndarray:
    """Two async workers at lr / 2: both pull w0; worker 1 pushes g1 (nothing to compensate: the weights
    have not moved since its pull), then worker 0 pushes g0, computed on w0, onto w1, then pulls w2 and
    pushes g2 on it, stale by nothing."""
    g0, g1, g2 = (flat({"w": gw, "b": gb}) for gw, gb in (grad(1), grad(2), grad(3)))
    w0 = flat(INIT)
    ms = np.zeros_like(w0)
    rate = LR / 2

    def step(w, g, pulled, staleness):
        nonlocal ms
        ms = 0.95 * ms + 0.05 * g * g
        lam = lam0 / (np.sqrt(ms) + EPSILON) if adaptive else lam0
        compensated = g + lam * g * g * (w - pulled)
        return w - rate / (max(1, staleness) if staleness_lr else 1) * compensated

    w1 = step(w0, g1, w0, 0)
    w2 = step(w1, g0, w0, 1)
    return step(w2, g2, w2, 0)


@pytest.mark.parametrize("lam, adaptive", [(0.5, False), (2.0, False), (0.04, True)])
@pytest.mark.parametrize("policy, options", [("async", {}), ("ssp", {"staleness": 3})])
def test_a_stale_gradient_is_compensated_as_the_paper_writes_it(lam, adaptive, policy, options):
    core, _ = make_core(policy, 2, options=options, dc_lambda=lam, dc_adaptive=adaptive)
    register_all(core)
    pull(core, 0), pull(core, 1)
    assert core.push(1, 0, 0, grads_of(*grad(2))).staleness == 0
    assert core.push(0, 0, 0, grads_of(*grad(1))).staleness == 1
    pull(core, 0)
    assert core.push(0, 1, 2, grads_of(*grad(3))).staleness == 0
    want = reference(lam, adaptive)
    np.testing.assert_allclose(flat(weights(core)), want, rtol=1e-12, atol=1e-12)
    plain = reference(0.0, False)
    assert np.abs(want - plain).max() > 1e-3  # the compensation is not lost in the comparison
    assert core.remedies.uncompensated == 0


@pytest.mark.parametrize("where", ["moved", "read"])
def test_compensation_reads_the_weights_where_they_are_now(where):
    """The shard moves its weights into shared memory when it serves, and an update made while the current
    weights are being read goes to its other slot: the copy a pull leaves for compensation is of the weights
    as they are then, wherever they live."""
    core, _ = make_core("async", 2, dc_lambda=0.5)
    core.place_weights([np.empty_like(core.flat) for _ in range(SLOTS)], np.zeros(SLOTS, dtype=np.uint64))
    if where == "read":
        core.store.patience = 0.0  # every update made while a read is held goes to the other slot at once
    register_all(core)
    held = core.pull(0, 0, timeout=1, copy=False) if where == "read" else None
    pull(core, 0), pull(core, 1)
    assert core.push(1, 0, 0, grads_of(*grad(2))).staleness == 0
    assert core.push(0, 0, 0, grads_of(*grad(1))).staleness == 1
    pull(core, 0)
    assert core.push(0, 1, 2, grads_of(*grad(3))).staleness == 0
    np.testing.assert_allclose(flat(weights(core)), reference(0.5, False), rtol=1e-12, atol=1e-12)
    if held is not None:
        assert core.store.counters["copied_updates"] >= 1
        held.release()


def test_compensation_goes_with_staleness_lr():
    core, _ = make_core("async", 2, dc_lambda=0.5, staleness_lr=True)
    register_all(core)
    pull(core, 0), pull(core, 1)
    core.push(1, 0, 0, grads_of(*grad(2)))
    core.push(0, 0, 0, grads_of(*grad(1)))
    pull(core, 0)
    core.push(0, 1, 2, grads_of(*grad(3)))
    np.testing.assert_allclose(flat(weights(core)), reference(0.5, False, staleness_lr=True), rtol=1e-12, atol=1e-12)


def test_a_push_without_the_pull_it_names_is_applied_as_it_came_and_counted():
    """The worker's pull went to a shard process that has since restarted, or it names another version."""
    core, _ = make_core("async", 2, dc_lambda=0.5)
    register_all(core)
    core.push(1, 0, 0, grads_of(*grad(2)))  # no pull by worker 1 at all
    pull(core, 0)
    core.push(0, 0, 0, grads_of(*grad(1)))  # worker 0 pulled version 1, names version 0
    g1, g2 = (flat({"w": gw, "b": gb}) for gw, gb in (grad(2), grad(1)))
    np.testing.assert_allclose(flat(weights(core)), flat(INIT) - LR / 2 * (g1 + g2), rtol=1e-12, atol=1e-12)
    assert core.remedies.uncompensated == 2


def test_the_pushed_arrays_are_left_as_they_came():
    core, _ = make_core("async", 2, dc_lambda=0.5)
    register_all(core)
    pull(core, 0), pull(core, 1)
    core.push(1, 0, 0, grads_of(*grad(2)))
    pushed = grads_of(*grad(1))
    kept = {i: g.copy() for i, g in pushed.items()}
    core.push(0, 0, 0, pushed)
    for i in pushed:
        np.testing.assert_array_equal(pushed[i], kept[i])


def test_sync_rounds_are_not_compensated():
    """Every gradient of a sync round was computed on the same weights: there is no delay to compensate."""
    core, _ = make_core("sync", 2, dc_lambda=0.5)
    assert core.remedies.dc_lambda == 0.0


def test_memory_one_copy_of_the_shard_per_worker_that_pulled():
    core, _ = make_core("async", 3, dc_lambda=0.5, dc_adaptive=True)
    register_all(core)
    pull(core, 0), pull(core, 2), pull(core, 2)
    assert sorted(core.remedies._pulled) == [0, 2]
    assert all(copy.nbytes == core.nbytes for _, copy, _ in core.remedies._pulled.values())
    assert core.remedies._mean_square.nbytes == core.nbytes
