import json

import numpy as np
import pytest

from psgd.model.base import VarSpec
from psgd.partition import PartitionPlan, PlanError, plan_differences


def specs(*shapes, dtype="float32"):
    return [VarSpec(f"v{i}", shape, dtype) for i, shape in enumerate(shapes)]


def test_small_variables_stay_whole_and_cover_everything():
    plan = PartitionPlan(specs((64, 128), (128,), (128, 10), (10,)), num_shards=2)
    assert len(plan.slices) == 4
    for spec in plan.specs:
        pieces = plan.slices_of(spec.name)
        assert [(p.start, p.stop) for p in pieces] == [(0, spec.size)]
    assert sum(plan.shard_bytes()) == plan.total_bytes


def test_large_tensors_are_cut_and_balanced():
    plan = PartitionPlan(specs((1000, 1000), (3000,), (10,)), num_shards=3, slice_bytes=400_000)
    big = plan.slices_of("v0")
    assert len(big) == 10 and all(s.nbytes <= 400_000 for s in big)
    # contiguous, covering [0, size)
    assert big[0].start == 0 and big[-1].stop == 1_000_000
    assert all(a.stop == b.start for a, b in zip(big, big[1:]))
    loads = plan.shard_bytes()
    assert max(loads) - min(loads) <= 400_000
    assert [s.id for s in plan.slices] == list(range(len(plan.slices)))
    assert len({s.key for s in plan.slices}) == len(plan.slices)


def test_plan_is_deterministic_and_hash_tracks_inputs():
    a = PartitionPlan(specs((50, 50), (7,)), 2, slice_bytes=1024)
    b = PartitionPlan(specs((50, 50), (7,)), 2, slice_bytes=1024)
    assert a.hash == b.hash and [s.shard for s in a.slices] == [s.shard for s in b.slices]
    assert PartitionPlan(specs((50, 50), (7,)), 3, slice_bytes=1024).hash != a.hash
    assert PartitionPlan(specs((50, 50), (7,), dtype="float64"), 2, slice_bytes=1024).hash != a.hash
    assert PartitionPlan(specs((50, 51), (7,)), 2, slice_bytes=1024).hash != a.hash


def test_split_gives_views_that_reassemble():
    plan = PartitionPlan(specs((30, 40), (5,)), 2, slice_bytes=256)
    values = {s.name: np.arange(s.size, dtype=np.float32).reshape(s.shape) for s in plan.specs}
    parts = plan.split(values)
    rebuilt = {s.name: np.empty(s.size, np.float32) for s in plan.specs}
    for sl in plan.slices:
        rebuilt[sl.var][sl.start : sl.stop] = parts[sl.id]
    for s in plan.specs:
        np.testing.assert_array_equal(rebuilt[s.name].reshape(s.shape), values[s.name])
    only0 = plan.split(values, shard=0)
    assert set(only0) == {s.id for s in plan.slices_for_shard(0)}


def test_differences_are_explained():
    mine = PartitionPlan(specs((64, 128), (128,)), 2).description()
    theirs = PartitionPlan([VarSpec("v0", (64, 256)), VarSpec("w", (3,))], 3).description()
    text = plan_differences(json.loads(json.dumps(mine)), theirs)
    assert "num_shards: worker 2 vs server 3" in text
    assert "v0: worker shape (64, 128) float32 vs server shape (64, 256) float32" in text
    assert "only the worker has: v1" in text and "only the server has: w" in text
    assert plan_differences(mine, mine) == ""


@pytest.mark.parametrize(
    "args, words",
    [
        ((specs((3,)), 0), "at least 1"),
        (([], 1), "at least one variable"),
        (([VarSpec("a", (2,)), VarSpec("a", (3,))], 1), "unique"),
    ],
)
def test_bad_plans(args, words):
    with pytest.raises(PlanError, match=words):
        PartitionPlan(*args)
