"""Embedding tables: rows made from (seed, table, id), spread over shards by a hash of the id, kept by a shard
(admission, eviction, a cap) and updated by the row rules, each checked against a dense reference."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from psgd.model import VarSpec
from psgd.model.table import TableSpec, TableSpecError, initial_rows
from psgd.optim import Adam
from psgd.optim.validation import OptimizerError
from psgd.partition import PartitionPlan, plan_differences
from psgd.tables.held import RowTable, TableFull, TableOptions
from psgd.tables.index import IdSlots
from psgd.tables.rules import LazyAdam, RowSGD, RowwiseAdagrad, build_row_optimizer

SPECS = [VarSpec("w", (4, 3), "float64", "normal")]
HUGE = np.array([0, 1, -1, 2**62, -(2**63), 2**63 - 1, 123456789012345, 7], np.int64)


def table(dim=4, init="normal", dtype="float64", name="emb"):
    return TableSpec(name, dim, dtype, init, scale=0.1)


# -- a row's first value ------------------------------------------------------------------------------------------
def test_a_rows_first_value_depends_on_seed_table_and_id_only():
    spec = table(8)
    alone = np.stack([initial_rows(spec, 3, [i])[0] for i in HUGE.tolist()])
    together = initial_rows(spec, 3, HUGE[::-1])[::-1]
    assert np.array_equal(alone, together)  # whatever else is asked, in whatever order
    assert not np.allclose(initial_rows(spec, 4, HUGE), alone)  # another seed
    assert not np.allclose(initial_rows(table(8, name="other"), 3, HUGE), alone)  # another table
    assert len({row.tobytes() for row in alone}) == len(HUGE)  # every id a row of its own


@pytest.mark.parametrize("init, mean, std", [("normal", 0.0, 0.1), ("uniform", 0.0, 0.1 / np.sqrt(3))])
def test_first_values_follow_their_distribution(init, mean, std):
    values = initial_rows(table(16, init), 0, np.arange(4000) * 7919)  # 64,000 values
    assert abs(values.mean() - mean) < 4 * std / np.sqrt(values.size)
    assert abs(values.std() - std) < 0.02 * std
    if init == "uniform":
        assert np.abs(values).max() <= 0.1
    assert not initial_rows(table(4, "zeros"), 0, HUGE).any()


def test_a_table_that_cannot_be_is_refused_in_one_line():
    for bad, words in [
        (dict(dim=0), "dim must be a positive integer"),
        (dict(init="he"), "unknown initializer"),
        (dict(dtype="nope"), "unknown dtype"),
        (dict(scale=float("nan")), "scale must be"),
    ]:
        with pytest.raises(TableSpecError, match=words):
            TableSpec("t", **{"dim": 4, **bad})


# -- which shard holds a row -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ids",
    [np.arange(100_000), np.arange(100_000) << 32, np.arange(100_000) * 1024 + 3],
    ids=["consecutive", "high-bits", "strided"],
)
def test_rows_spread_evenly_over_the_shards_whatever_the_ids(ids):
    plan = PartitionPlan(SPECS, 5, tables=[table()])
    counts = np.bincount(plan.shard_of_ids("emb", ids), minlength=5)
    assert counts.sum() == ids.size and np.abs(counts / (ids.size / 5) - 1).max() < 0.03, counts
    assert np.array_equal(
        plan.shard_of_ids("emb", ids), PartitionPlan(SPECS, 5, tables=[table()]).shard_of_ids("emb", ids)
    )


def test_tables_are_part_of_the_plan_and_its_hash():
    dense = PartitionPlan(SPECS, 2)
    assert "tables" not in dense.description()  # a plan without tables is the plan it always was
    a, b = PartitionPlan(SPECS, 2, tables=[table(4)]), PartitionPlan(SPECS, 2, tables=[table(8)])
    assert len({dense.hash, a.hash, b.hash}) == 3
    assert "table emb: worker dim 4 float64, normal 0.1 vs server dim 8 float64" in plan_differences(
        a.description(), b.description()
    )
    with pytest.raises(ValueError, match="names must be unique"):
        PartitionPlan(SPECS, 2, tables=[table(name="w")])


# -- the row rules, against dense references ----------------------------------------------------------------------
def touched_steps(seed=0, rows=12, dim=5, steps=6):
    """Steps that touch different subsets of the rows: (ids, grads) each."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids = np.sort(rng.choice(rows, size=rng.integers(1, rows), replace=False))
        out.append((ids, rng.standard_normal((ids.size, dim))))
    return out


def run_rule(rule, steps, start, lr_scale=1.0):
    """``rule`` over ``steps`` on a table of float64 rows ``start``, through RowTable."""
    spec = TableSpec("emb", start.shape[1], "float64", "zeros")
    t = RowTable(spec, 0, rule)
    t.read(np.arange(start.shape[0]))
    t.rows[: start.shape[0]] = start  # slots 0.. hold ids 0.. (made in order)
    for ids, grads in steps:
        t.apply(ids, grads, lr_scale)
    return t.read(np.arange(start.shape[0]))


def test_lazy_adam_is_adam_on_each_touched_row_with_the_rows_own_count():
    steps, start = touched_steps(), np.random.default_rng(9).standard_normal((12, 5))
    got = run_rule(LazyAdam(lr=0.01), steps, start)
    dense, want = Adam(lr=0.01), start.copy()
    for ids, grads in steps:  # the reference: dense Adam, one key per row, updated only when touched
        for i, g in zip(ids.tolist(), grads):
            dense.update(f"row{i}", want[i], g)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_rowwise_adagrad_keeps_one_sum_per_row():
    steps, start = touched_steps(1), np.random.default_rng(8).standard_normal((12, 5))
    got = run_rule(RowwiseAdagrad(lr=0.1, eps=1e-8), steps, start)
    want, total = start.copy(), np.zeros(12)
    for ids, grads in steps:
        for i, g in zip(ids.tolist(), grads):
            total[i] += np.mean(g * g)
            want[i] -= 0.1 * g / (np.sqrt(total[i]) + 1e-8)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_sgd_on_touched_rows_is_dense_sgd_and_an_async_push_is_scaled():
    steps, start = touched_steps(2), np.random.default_rng(7).standard_normal((12, 5))
    got = run_rule(RowSGD(lr=0.5), steps, start, lr_scale=0.25)
    want = start.copy()
    for ids, grads in steps:
        full = np.zeros_like(want)
        full[ids] = grads
        want -= 0.5 * 0.25 * full  # every row, with zeros where untouched
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_row_rules_are_found_by_name_and_say_whether_they_are_lazy():
    assert build_row_optimizer("lazy_adam", lr=0.01).describe()["lazy"] is True
    assert build_row_optimizer("rowwise_adagrad", lr=None).lr == 0.05  # None: not given
    assert not build_row_optimizer("sgd", lr=0.1).lazy
    with pytest.raises(OptimizerError, match="unknown table optimizer 'adam': choose sgd, rowwise_adagrad, lazy"):
        build_row_optimizer("adam")
    with pytest.raises(OptimizerError, match="unknown option 'beta1'"):
        build_row_optimizer("sgd", beta1=0.9)


# -- a shard's rows ------------------------------------------------------------------------------------------------
def test_rows_are_made_when_first_read_and_cost_only_the_rows_touched():
    t = RowTable(table(16), 5, RowSGD(0.1))
    ids = np.array([10**15, -3, 2**62 + 11], np.int64)  # anywhere in int64
    np.testing.assert_array_equal(t.read(ids), initial_rows(table(16), 5, ids))
    assert len(t) == 3 and t.counters["rows_created"] == 3
    t.read(ids)
    assert t.counters["rows_created"] == 3  # made once
    assert t.nbytes < 1024 * (16 * 8 + 64)  # the first block of slots, whatever the range of the ids


def test_an_id_gets_a_row_only_at_its_kth_sighting_and_its_gradients_are_dropped_until_then():
    t = RowTable(table(4), 0, RowSGD(1.0), TableOptions(admit_after=3))
    ids, grad = np.array([42, 43], np.int64), np.ones((2, 4))
    first = initial_rows(table(4), 0, ids)
    for sighting in (1, 2):
        np.testing.assert_array_equal(t.read(ids), first)
        assert t.apply(ids, grad) == 0 and len(t) == 0  # not admitted: dropped, nothing kept
    assert t.counters["grads_dropped"] == 4
    np.testing.assert_array_equal(t.read(ids), first)  # the third sighting makes the rows
    assert len(t) == 2 and t.apply(ids, grad) == 2
    np.testing.assert_allclose(t.read(ids), first - 1.0)


def test_rows_idle_for_longer_than_idle_updates_are_evicted_and_start_over():
    t = RowTable(table(4), 0, RowSGD(1.0), TableOptions(idle_updates=4))
    cold, hot = np.array([1], np.int64), np.array([2], np.int64)
    t.read(cold)
    t.apply(cold, np.ones((1, 4)))
    for _ in range(8):
        t.read(hot)
        t.apply(hot, np.ones((1, 4)))
    assert 1 not in t.held_ids() and 2 in t.held_ids() and t.counters["rows_evicted"] == 1
    np.testing.assert_array_equal(t.read(cold), initial_rows(table(4), 0, cold))  # its update went with it


def test_a_full_table_refuses_or_evicts_the_rows_touched_longest_ago():
    full = RowTable(table(4), 0, RowSGD(1.0), TableOptions(max_rows=3))
    full.read(np.array([1, 2, 3], np.int64))
    before = full.state_dict()
    with pytest.raises(TableFull, match="tables.max_rows") as info:
        full.read(np.array([4], np.int64))
    assert info.value.code == "RESOURCE_EXHAUSTED"
    after = full.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before)  # nothing changed
    lru = RowTable(table(4), 0, RowSGD(1.0), TableOptions(max_rows=3, when_full="evict"))
    for i in (1, 2, 3):
        lru.read(np.array([i], np.int64))
        lru.apply(np.array([i], np.int64), np.ones((1, 4)))
    lru.read(np.array([1], np.int64))  # 2 is now the one touched longest ago
    lru.read(np.array([4], np.int64))
    assert lru.held_ids().tolist() == [1, 3, 4] and lru.capacity == 3
    with pytest.raises(TableFull, match="do not fit"):
        lru.read(np.array([5, 6, 7, 8], np.int64))  # more than the cap in one read


def test_a_tables_rows_and_state_survive_a_checkpoint():
    a = RowTable(table(4), 0, LazyAdam(0.01), TableOptions(admit_after=2))
    ids = np.array([5, 9, 2**40], np.int64)
    for _ in range(3):
        a.read(ids)
        a.apply(ids, np.full((3, 4), 0.5))
    b = RowTable(table(4), 0, LazyAdam(0.01), TableOptions(admit_after=2))
    b.load_state_dict({k: v.copy() for k, v in a.state_dict().items()})
    more = np.array([9, 11], np.int64)
    for t in (a, b):
        t.read(more)
        t.apply(more, np.ones((2, 4)))
    assert a.held_ids().tolist() == b.held_ids().tolist() == [5, 9, 2**40]  # 11 seen once since: not admitted in either
    np.testing.assert_array_equal(a.read(ids), b.read(ids))


def test_the_id_index_agrees_with_a_dict_through_adds_removals_and_rebuilds():
    rng = np.random.default_rng(3)
    index, model = IdSlots(), {}
    keys = np.zeros(1 << 16, np.int64)
    free = list(range(keys.size))
    for _ in range(60):
        new = np.setdiff1d(
            rng.integers(-(2**63), 2**63 - 1, 400, dtype=np.int64, endpoint=True),
            np.fromiter(model, np.int64, len(model)),
        )
        new = np.concatenate([new, np.arange(50) + rng.integers(0, 1000)])  # neighbours, some held already
        new = np.setdiff1d(np.unique(new), np.fromiter(model, np.int64, len(model)))
        slots = np.array([free.pop() for _ in range(new.size)], np.int64)
        keys[slots] = new
        index.add(new, slots, keys)
        model.update(zip(new.tolist(), slots.tolist()))
        gone = rng.choice(np.fromiter(model, np.int64, len(model)), size=len(model) // 3, replace=False)
        index.remove(gone, keys)
        for i in gone.tolist():
            free.append(model.pop(i))
        asked = np.concatenate([np.fromiter(model, np.int64, len(model)), gone, new[:5]])
        found = index.find(asked, keys)
        np.testing.assert_array_equal(found, [model.get(i, -1) for i in asked.tolist()])
        assert index.size == len(model)
    assert index.places.size <= 8 * 1024 and index.nbytes == 8 * index.places.size  # rebuilt, not only grown


def test_a_table_of_a_million_rows_costs_its_arrays_and_eight_bytes_a_place():
    t = RowTable(table(4), 0, RowSGD(0.1))
    ids = np.arange(1_000_000, dtype=np.int64) * 7919
    t.read(ids)
    assert len(t) == ids.size and t.index.nbytes <= 8 * (1 << 21)
    np.testing.assert_array_equal(t.peek(ids[::1000]), t.rows[t.index.find(ids[::1000], t.ids)])


@pytest.mark.parametrize("rule", [LazyAdam(0.01), RowSGD(0.1)])
def test_n_pushes_of_a_rounds_share_move_a_row_as_one_round_does(rule):
    """Async's accounting, per row: N pushes of one steady gradient, each at lr / N and counted as 1/N of a
    round (lazy Adam's decays and bias corrections), move a row as one sync round of it does."""
    from psgd.optim import Share

    g = np.array([[0.3, -0.2, 0.05]])
    whole = RowTable(table(3), 1, rule)
    parts = RowTable(table(3), 1, copy.deepcopy(rule))
    ids = np.array([42], np.int64)
    for _ in range(3):  # three rounds
        whole.apply(ids, g)
        for _ in range(4):
            parts.apply(ids, g, lr_scale=1 / 4, share=Share(4))
    np.testing.assert_allclose(parts.peek(ids), whole.peek(ids), rtol=1e-6, atol=1e-7)
    assert not np.allclose(whole.peek(ids), initial_rows(table(3), 1, ids))


def test_rows_are_bounded_by_default_from_the_memory_a_process_may_use(monkeypatch):
    """[tables] max_rows = 0 used to mean no cap: four pulls of about 600k new ids took a shard from 66 MB to 520 MB
    in 9 s.  0 now means a cap from this machine's memory (a quarter of it, shared by the tables); -1 asks for none."""
    from psgd import job as job_module
    from psgd.config import JobConfig
    from psgd.job import describe_job

    monkeypatch.setattr(job_module, "physical_memory", lambda: 64 << 20)  # a 64 MiB machine
    config = JobConfig()
    config = config.apply_sets(
        ["model.name=embed", "data.name=clicks", "data.fields=2", "data.dense=2", "model.dim=16"]
    )
    job = describe_job(config)
    tables = job.row_tables("shard 0")
    table = next(iter(tables.values()))
    cap = table.options.max_rows
    per_row = table.row_bytes()
    assert 0 < cap and cap * per_row * 2 <= (64 << 20) // 4 // len(tables)  # room for growth by doubling
    with pytest.raises(TableFull, match="may hold"):
        table.read(np.arange(cap + 1, dtype=np.int64))
    config = config.apply_sets(["tables.max_rows=-1"])
    unbounded = next(iter(describe_job(config).row_tables().values()))
    assert unbounded.options.max_rows == 0
    unbounded.read(np.arange(cap + 1, dtype=np.int64))
    assert len(unbounded) == cap + 1
