"""A sync round's sum (psgd.server.state.rounds): the first push copied in over whatever the last round left, a round of
one push its own mean, and the mean of several the same bits as adding them to zeros and scaling."""

from __future__ import annotations

import numpy as np
import pytest
from test_shard_core import grads_of, make_core, register_all

from psgd.server.state.rounds import Round
from psgd.wire.sweep import PARALLEL_BYTES


def pushes(n: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [grads_of(rng.standard_normal(12), rng.standard_normal(3)) for _ in range(n)]


def by_hand(gs: list) -> np.ndarray:
    """What a round's mean was as a sum over zeros, then scaled: the reference."""
    total = np.zeros(15)
    for g in gs:
        total += np.concatenate([g[i] for i in sorted(g)])
    return total * (1.0 / len(gs)) if len(gs) > 1 else total


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_rounds_mean_is_its_pushes_mean_whatever_the_last_round_left(ordered, n):
    core, _ = make_core("sync", 3)
    r = Round(core.store, ordered=ordered)
    for w, g in enumerate(pushes(3, seed=9)):  # a round before: its mean stays in the buffer
        r.add(g, 0, worker=w)
    r.mean()
    r.clear()
    assert r.flat.any() and not r.so_far().any()  # left over, and counted as nothing
    gs = pushes(n)
    for w, g in enumerate(gs):
        r.add(g, 0, worker=w)
    assert r.mean() == [0] * n
    assert r.flat.tobytes() == by_hand(gs).tobytes()


def test_a_rounds_sum_so_far_is_what_a_checkpoint_keeps():
    core, _ = make_core("sync", 3)
    r = Round(core.store)
    gs = pushes(2)
    r.add(gs[0], 0)
    r.add(gs[1], 1)
    assert (
        r.so_far().tobytes()
        == (
            np.concatenate([gs[0][i] for i in sorted(gs[0])]) + np.concatenate([gs[1][i] for i in sorted(gs[1])])
        ).tobytes()
    )
    ordered = Round(core.store, ordered=True)
    ordered.add(gs[0], 0, worker=0)
    assert not ordered.so_far().any() and set(ordered.apart) == {0}  # its pushes are kept apart


def test_a_large_rounds_passes_are_swept_on_threads_with_the_same_bits():
    from psgd.model.base import VarSpec
    from psgd.optim import build_optimizer
    from psgd.partition import PartitionPlan
    from psgd.policy import make_policy
    from psgd.server.state.core import ShardCore

    specs = [VarSpec("w", (PARALLEL_BYTES // 8 + 999,), "float64")]
    plan = PartitionPlan(specs, num_shards=1, slice_bytes=1 << 20)
    rng = np.random.default_rng(4)
    values = plan.split({"w": rng.standard_normal(specs[0].shape)}, shard=0)
    core = ShardCore(
        plan, 0, values, build_optimizer("sgd", lr=0.1), make_policy("sync", 3), num_workers=3, apply_threads=3
    )
    assert core.store.sweep.threads == 3
    gs = [core.store.views(rng.standard_normal(core.flat.size)) for _ in range(3)]
    r = Round(core.store)
    for g in gs:
        r.add(g, 0)
    r.mean()
    assert r.flat.tobytes() == ((gs[0].flat + gs[1].flat + gs[2].flat) * (1.0 / 3)).tobytes()


@pytest.mark.parametrize("ordered", [False, True])
def test_a_push_that_closes_its_round_alone_is_applied_as_it_came(ordered):
    core, _ = make_core("sync", 3)
    r = Round(core.store, ordered=ordered)
    r.flat.fill(7.0)  # whatever a round before left
    (g,) = [core.store.gradient_views(np.arange(15, dtype=np.float64).tobytes())]
    r.add(g, 4, worker=1, closes=True)
    assert r.so_far() is g.flat  # what a checkpoint would keep meanwhile
    assert r.mean() == [4] and r.total() is g and not r.apart
    assert (r.flat == 7.0).all()  # neither copied nor added
    r.clear()
    assert r.total() is r.sums and not r.so_far().any()


def test_a_sync_shard_of_one_worker_applies_each_push_as_a_round_of_its_own():
    one, _ = make_core("sync", 1)
    ref, _ = make_core("async", 1)
    register_all(one), register_all(ref)
    rng = np.random.default_rng(8)
    for clock in range(3):
        payload = rng.standard_normal(one.flat.size).tobytes()
        for core in (one, ref):
            core.push(0, clock, core.version, core.store.gradient_views(payload))
    assert one.version == ref.version == 3 and one.flat.tobytes() == ref.flat.tobytes()
