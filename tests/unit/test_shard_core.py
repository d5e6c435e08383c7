"""ShardCore and the gRPC push assembler driven directly: no network, time from a fake clock, tiny plans.

The plan has two float64 variables, ``w`` (12 elements, cut by 64-byte slices
into ``w#0`` = w[0:8] and ``w#8`` = w[8:12]) and ``b`` (3 elements), all on
shard 0.  The optimizer is plain SGD with lr 0.1, so every expected weight is
``init - lr * (what the policy says was applied)``.  Pull timeouts are real
time but tiny (0 or a few ms); every thread is joined with a bounded timeout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time

import numpy as np
import pytest
from helpers import slice_weights, wait_for

from psgd.config import Deadlines, Remedies
from psgd.model.base import VarSpec
from psgd.optim import build_optimizer
from psgd.partition import PartitionPlan
from psgd.policy import make_policy
from psgd.server.durable import recovery
from psgd.server.errors import ShardError
from psgd.server.net.assembly import PushAssembler
from psgd.server.state import checkpoint
from psgd.server.state.core import MAX_CLOCK, STALENESS_BUCKETS, ShardCore

LR = 0.1
LEASE = 10.0
JOIN = 60.0
SPECS = [VarSpec("w", (12,), "float64"), VarSpec("b", (3,), "float64")]
PLAN = PartitionPlan(SPECS, num_shards=1, slice_bytes=64)
INIT = {"w": np.arange(12, dtype=np.float64) - 6.0, "b": np.array([1.0, 2.0, 3.0])}
JOIN_WAIT = 10.0  # seconds a test waits for one of its threads, at most


class FakeClock:
    """The core's clock: time moves only when a test says so."""

    def __init__(self, start: float = 1000.0):
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


REMEDIES = {f.name for f in dataclasses.fields(Remedies)}


def make_core(
    policy: str = "sync", workers: int = 2, *, clock: FakeClock | None = None, options: dict | None = None, **kwargs
) -> tuple[ShardCore, FakeClock]:
    clock = clock or FakeClock()
    values = PLAN.split(INIT, shard=0)
    remedies = Remedies(**{k: kwargs.pop(k) for k in list(kwargs) if k in REMEDIES})
    core = ShardCore(
        PLAN,
        0,
        values,
        build_optimizer("sgd", lr=LR),
        make_policy(policy, workers, **(options or {})),
        num_workers=workers,
        deadlines=Deadlines(lease_seconds=LEASE, join_timeout=JOIN),
        now=clock,
        remedies=remedies,
        **kwargs,
    )
    return core, clock


def register_all(core: ShardCore, workers=None) -> None:
    for w in range(core.num_workers) if workers is None else workers:
        assert core.register(w, PLAN.hash, json.dumps(PLAN.description())) == 0


def grads_of(w: np.ndarray, b: np.ndarray) -> dict[int, np.ndarray]:
    """Per-slice gradients of the whole-variable gradients (w, b)."""
    return {
        i: np.array(g, dtype=np.float64)
        for i, g in PLAN.split({"w": np.asarray(w, float), "b": np.asarray(b, float)}).items()
    }


def grad(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A distinct, exactly representable whole-model gradient per seed."""
    return (np.arange(12, dtype=np.float64) * 0.25 + seed, np.array([seed, -seed, 0.5 * seed], dtype=np.float64))


def weights(core: ShardCore) -> dict[str, np.ndarray]:
    out = {s.name: np.empty(s.size) for s in SPECS}
    for sl, values in slice_weights(core):
        out[sl.var][sl.start : sl.stop] = values
    return out


def expect(*steps: tuple[float, tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """INIT minus the sum of ``scale * lr * grad`` over steps."""
    w, b = INIT["w"].copy(), INIT["b"].copy()
    for scale, (gw, gb) in steps:
        w -= LR * scale * gw
        b -= LR * scale * gb
    return {"w": w, "b": b}


def assert_weights(core: ShardCore, expected: dict[str, np.ndarray]) -> None:
    got = weights(core)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-12, atol=1e-12, err_msg=name)


def push(core: ShardCore, worker: int, clock: int, g=None, base: int | None = None):
    g = grad(worker + 10 * clock + 1) if g is None else g
    return core.push(worker, clock, core.version if base is None else base, grads_of(*g))


def error(fn, *args, **kwargs) -> ShardError:
    with pytest.raises(ShardError) as info:
        fn(*args, **kwargs)
    return info.value


def run_in_thread(fn, *args, **kwargs):
    """Start fn in a thread; returns a join() that gives its result (or raises its exception)."""
    box: dict = {}

    def body():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the test thread
            box["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()

    def join():
        t.join(JOIN_WAIT)
        assert not t.is_alive(), f"thread running {fn.__name__} did not finish within {JOIN_WAIT}s"
        if "error" in box:
            raise box["error"]
        return box["result"]

    return join


def test_plan_is_cut_into_several_slices():
    assert [(s.id, s.key, s.nbytes) for s in PLAN.slices] == [(0, "w#0", 64), (1, "w#8", 32), (2, "b#0", 24)]
    core, _ = make_core()
    assert core.dtype == "float64" and set(core.slices) == {0, 1, 2}
    assert_weights(core, INIT)


# --- sync -----------------------------------------------------------------------------


def test_sync_applies_one_averaged_update_per_clock():
    core, _ = make_core("sync", 2)
    register_all(core)
    g00, g10, g01, g11 = grad(1), grad(2), grad(3), grad(4)

    r = push(core, 0, 0, g00)
    assert (r.outcome, r.next_clock, r.version) == ("accumulated", 1, 0)
    assert_weights(core, INIT)  # nothing applied before the round closes
    r = push(core, 1, 0, g10)
    assert (r.outcome, r.next_clock, r.version) == ("accumulated", 1, 1)
    after0 = expect((0.5, g00), (0.5, g10))
    assert_weights(core, after0)
    assert core.version == 1

    assert push(core, 1, 1, g11, base=1).outcome == "accumulated"
    assert core.version == 1
    assert_weights(core, after0)
    r = push(core, 0, 1, g01, base=1)
    assert (r.outcome, r.version, r.staleness) == ("accumulated", 2, 0)
    assert core.version == 2
    assert_weights(core, expect((0.5, g00), (0.5, g10), (0.5, g01), (0.5, g11)))
    c = core.status()["counters"]
    assert (c["pushes"], c["accumulated"], c["applied"]) == (4, 4, 2)
    assert core.status()["staleness_histogram"][0] == 4


def test_sync_pull_waits_for_the_round_and_names_the_missing_worker():
    core, _ = make_core("sync", 2)
    register_all(core)
    version, data = core.pull(0, 0, timeout=0)
    assert version == 0 and set(data) == {0, 1, 2}
    assert np.array_equal(np.frombuffer(data[2], dtype=np.float64), INIT["b"])

    push(core, 0, 0)
    err = error(core.pull, 0, 1, timeout=0.01)
    assert err.code == "DEADLINE_EXCEEDED"
    assert "worker 1 at clock 0" in err.message and "sync" in err.message and "clock 1" in err.message

    waiting = run_in_thread(core.pull, 0, 1, timeout=JOIN_WAIT)
    push(core, 1, 0)
    version, data = waiting()
    assert version == 1
    assert np.array_equal(np.frombuffer(data[2], dtype=np.float64), weights(core)["b"])
    assert not np.array_equal(weights(core)["b"], INIT["b"])
    # a pull for an earlier clock, or by an observer, never waits
    assert core.pull(1, 0, timeout=0)[0] == 1
    assert core.pull(None, 0, timeout=0)[0] == 1


def test_sync_push_from_the_future_is_refused():
    core, _ = make_core("sync", 2)
    register_all(core)
    err = error(push, core, 0, 3)
    assert err.code == "FAILED_PRECONDITION" and "future" in err.message
    assert core.version == 0 and core.status()["counters"]["rejected"] == 1
    assert_weights(core, INIT)
    assert push(core, 0, 0).outcome == "accumulated"  # the refusal changed no state


@pytest.mark.parametrize("policy,options", [("sync", {}), ("async", {}), ("ssp", {"staleness": 1})])
def test_a_duplicate_push_changes_the_weights_once(policy, options):
    core, _ = make_core(policy, 2, options=options)
    register_all(core)
    g0, g1 = grad(1), grad(2)
    first = push(core, 0, 0, g0, base=0)
    after_first = weights(core)
    again = push(core, 0, 0, g0, base=0)
    assert again.outcome == "duplicate" and again.next_clock == 1
    for name, value in after_first.items():
        assert np.array_equal(weights(core)[name], value)
    assert core.status()["counters"]["duplicates"] == 1
    if policy == "sync":
        assert first.outcome == "accumulated"
        push(core, 1, 0, g1, base=0)
        assert core.version == 1
        assert_weights(core, expect((0.5, g0), (0.5, g1)))  # averaged over two pushes, not three
        # a retry after the round closed is still a duplicate, not a second contribution
        assert push(core, 0, 0, g0, base=0).outcome == "duplicate"
        assert core.version == 1
        assert_weights(core, expect((0.5, g0), (0.5, g1)))
    else:
        assert first.outcome == "applied" and core.version == 1
        assert_weights(core, expect((0.5, g0)))  # lr / 2 workers


def test_backup_worker_push_is_late_and_dropped():
    core, _ = make_core("sync", 3, options={"backup_workers": 1})
    register_all(core)
    g0, g1, g2 = grad(1), grad(2), grad(3)
    assert push(core, 0, 0, g0).outcome == "accumulated"
    assert core.version == 0
    assert push(core, 1, 0, g1).outcome == "accumulated"
    assert core.version == 1  # closed with one worker missing
    after = expect((0.5, g0), (0.5, g1))
    assert_weights(core, after)

    late = push(core, 2, 0, g2, base=0)
    assert (late.outcome, late.next_clock, late.version) == ("late", 1, 1)
    assert_weights(core, after)
    assert core.status()["counters"]["late"] == 1
    assert core.status()["workers"][2]["clock"] == 1
    # the late worker continues with the open round
    assert push(core, 2, 1, g2).outcome == "accumulated"


# --- async, ssp, staleness ---------------------------------------------------------------


def test_async_applies_every_push_and_records_staleness():
    core, _ = make_core("async", 2)
    register_all(core)
    g = [grad(k) for k in range(1, 5)]
    r = push(core, 0, 0, g[0], base=0)
    assert (r.outcome, r.version, r.staleness, r.next_clock) == ("applied", 1, 0, 1)
    r = push(core, 1, 0, g[1], base=0)
    assert (r.outcome, r.version, r.staleness) == ("applied", 2, 1)
    r = push(core, 0, 1, g[2], base=1)
    assert (r.outcome, r.version, r.staleness) == ("applied", 3, 1)
    r = push(core, 1, 1, g[3], base=3)
    assert (r.outcome, r.version, r.staleness, r.next_clock) == ("applied", 4, 0, 2)
    assert_weights(core, expect(*((0.5, x) for x in g)))  # each push at lr / 2 workers
    hist = core.status()["staleness_histogram"]
    assert len(hist) == STALENESS_BUCKETS
    assert hist[:3] == [2, 2, 0] and sum(hist) == 4
    assert core.pull(0, 100, timeout=0)[0] == 4  # async pulls never wait


def test_staleness_histogram_clamps_large_staleness_into_the_last_bucket():
    core, _ = make_core("async", 2)
    register_all(core)
    for clock in range(STALENESS_BUCKETS + 4):
        push(core, 0, clock, base=core.version)
    push(core, 1, 0, base=0)
    hist = core.status()["staleness_histogram"]
    assert hist[0] == STALENESS_BUCKETS + 4 and hist[-1] == 1


def test_staleness_lr_scales_the_step_by_one_over_staleness():
    core, _ = make_core("async", 2, staleness_lr=True)
    register_all(core)
    g0, g1, g2, g3 = grad(1), grad(2), grad(3), grad(4)
    assert push(core, 0, 0, g0, base=0).staleness == 0  # scale 1/2 (staleness 0 counts as 1; lr / 2 workers)
    assert push(core, 1, 0, g1, base=0).staleness == 1  # scale 1/2
    assert push(core, 0, 1, g2, base=0).staleness == 2  # scale 1/4
    assert push(core, 1, 1, g3, base=0).staleness == 3  # scale 1/6
    assert_weights(core, expect((0.5, g0), (0.5, g1), (0.25, g2), (1.0 / 6.0, g3)))

    plain, _ = make_core("async", 2, staleness_lr=True, async_lr="full")
    register_all(plain)
    for w, c, g in ((0, 0, g0), (1, 0, g1), (0, 1, g2), (1, 1, g3)):
        push(plain, w, c, g, base=0)
    assert_weights(plain, expect((1.0, g0), (1.0, g1), (0.5, g2), (1.0 / 3.0, g3)))


@pytest.mark.parametrize("policy, options", [("async", {}), ("ssp", {"staleness": 1})])
def test_async_lr_divided_applies_each_push_at_lr_over_workers_and_full_at_lr(policy, options):
    g = [grad(k) for k in range(1, 5)]
    for async_lr, scale in (("divided", 0.25), ("full", 1.0)):
        core, _ = make_core(policy, 4, options=options, async_lr=async_lr)
        register_all(core)
        for w in range(4):
            assert push(core, w, 0, g[w], base=0).outcome == "applied"
        assert_weights(core, expect(*((scale, x) for x in g)))


def test_async_lr_does_not_touch_sync_whose_round_is_already_an_average():
    g0, g1 = grad(1), grad(2)
    for async_lr in ("divided", "full"):
        core, _ = make_core("sync", 2, async_lr=async_lr)
        register_all(core)
        push(core, 0, 0, g0, base=0)
        push(core, 1, 0, g1, base=0)
        assert_weights(core, expect((0.5, g0), (0.5, g1)))


def test_ssp_pull_waits_only_beyond_the_staleness_bound():
    core, _ = make_core("ssp", 2, options={"staleness": 1})
    register_all(core)
    push(core, 0, 0)
    assert core.pull(0, 1, timeout=0)[0] == 1  # one ahead of worker 1: allowed
    push(core, 0, 1)
    err = error(core.pull, 0, 2, timeout=0.01)
    assert err.code == "DEADLINE_EXCEEDED" and "worker 1 at clock 0" in err.message
    waiting = run_in_thread(core.pull, 0, 2, timeout=JOIN_WAIT)
    push(core, 1, 0)
    assert waiting()[0] == 3


# --- leases, joining, leaving ----------------------------------------------------------------


def test_lease_expiry_drops_a_silent_worker_and_closes_the_round():
    core, clock = make_core("sync", 2)
    register_all(core)
    g0 = grad(1)
    push(core, 0, 0, g0)
    waiting = run_in_thread(core.pull, 0, 1, timeout=JOIN_WAIT)  # blocked on worker 1

    clock.advance(LEASE - 1)
    assert core.expire_leases() == []
    core.heartbeat(0, 1)  # worker 0 stays alive, worker 1 stays silent
    clock.advance(2)
    assert core.expire_leases() == [1]
    assert waiting()[0] == 1  # the round closed without worker 1, waking the pull
    assert core.version == 1
    assert_weights(core, expect((1.0, g0)))  # averaged over the one push it got
    s = core.status()
    assert [w["state"] for w in s["workers"]] == ["live", "expired"]
    assert s["counters"]["expired"] == 1
    assert core.expire_leases() == []  # dropped once

    for call in (lambda: core.pull(1, 0, timeout=0), lambda: push(core, 1, 0), lambda: core.heartbeat(1, 0)):
        err = error(call)
        assert err.code == "FAILED_PRECONDITION"
        assert "worker 1 is not registered" in err.message and "expired" in err.message
        assert "register again" in err.message
    assert core.version == 1

    assert core.register(1, PLAN.hash) == 1  # rejoins at the open round
    assert core.pull(1, 1, timeout=0)[0] == 1
    assert push(core, 1, 1).outcome == "accumulated"
    assert push(core, 0, 1).outcome == "accumulated"
    assert core.version == 2


def test_a_waiting_pull_ends_with_failed_precondition_when_its_worker_expires():
    core, clock = make_core("sync", 2)
    register_all(core)
    push(core, 0, 0)
    waiting = run_in_thread(core.pull, 0, 1, timeout=JOIN_WAIT)
    clock.advance(LEASE + 1)  # both silent (a waiting pull renews the lease only when it wakes)
    assert core.expire_leases() == [0, 1]
    with pytest.raises(ShardError) as info:
        waiting()
    assert info.value.code == "FAILED_PRECONDITION" and "expired" in info.value.message
    assert core.version == 1  # worker 1 leaving closed the round worker 0 had pushed to
    assert core.finished()


def test_a_worker_that_never_registers_is_dropped_after_join_timeout():
    core, clock = make_core("sync", 2)
    register_all(core, [0])
    g0 = grad(1)
    push(core, 0, 0, g0)
    assert [w["state"] for w in core.status()["workers"]] == ["live", "pending"]
    for _ in range(int(JOIN // (LEASE / 2))):  # worker 0 keeps its lease; worker 1 never shows up
        clock.advance(LEASE / 2)
        core.heartbeat(0, 1)
        assert core.expire_leases() == []  # up to and including the join deadline itself
    clock.advance(1)
    assert core.expire_leases() == [1]
    assert core.version == 1
    assert_weights(core, expect((1.0, g0)))
    assert [w["state"] for w in core.status()["workers"]] == ["live", "expired"]
    assert core.register(1, PLAN.hash) == 1  # it may still join later


def test_done_lets_the_round_close_and_finished_follows_the_workers():
    core, clock = make_core("sync", 2)
    register_all(core)
    assert not core.finished()
    g0 = grad(1)
    push(core, 0, 0, g0)
    assert core.done(1, 0) == 1
    assert core.version == 1
    assert_weights(core, expect((1.0, g0)))
    assert not core.finished()
    assert core.done(1, 0) == 1  # idempotent
    push(core, 0, 1, g0)
    assert core.version == 2  # worker 0 alone now closes every round
    assert core.done(0, 2) == 0
    assert core.finished()
    s = core.status()
    assert [(w["state"], w["clock"]) for w in s["workers"]] == [("done", 2), ("done", 0)]
    err = error(push, core, 0, 2)
    assert err.code == "FAILED_PRECONDITION" and "done" in err.message
    clock.advance(JOIN * 10)
    assert core.expire_leases() == []  # done workers do not expire


def test_finished_with_expired_and_done_workers():
    core, clock = make_core("async", 3)
    register_all(core, [0])
    core.done(0, 0)
    assert not core.finished()  # 1 and 2 are still expected
    clock.advance(JOIN + 1)
    assert sorted(core.expire_leases()) == [1, 2]
    assert core.finished()


def test_a_rank_is_held_by_one_process_while_its_lease_runs():
    """Two processes registering as worker 0 (a typo in a hosts list) were both accepted, their pushes
    mixed under one rank; now the second is refused naming the first, until the first's lease runs out."""
    core, clock = make_core("async", 2)
    hello = (PLAN.hash, json.dumps(PLAN.description()))
    assert core.register(0, *hello, hostname="node-a", pid=111, incarnation="first") == 0
    err = error(core.register, 0, *hello, hostname="node-b", pid=222, incarnation="second")
    assert err.code == "ALREADY_EXISTS"
    assert "node-a pid 111" in err.message and "rank 0" in err.message and f"{LEASE:.1f}s" in err.message
    assert core.status()["workers"][0]["pid"] == 111  # the holder is untouched
    assert core.register(0, *hello, hostname="node-a", pid=111, incarnation="first") == 0  # the holder rejoins
    clock.advance(LEASE - 1)
    assert error(core.register, 0, *hello, hostname="node-b", pid=222, incarnation="second").code == "ALREADY_EXISTS"
    clock.advance(2)  # the holder is silent past its lease: it died, and this is its restart
    assert core.register(0, *hello, hostname="node-b", pid=222, incarnation="second") == 0
    assert core.status()["workers"][0]["pid"] == 222
    assert error(core.register, 0, *hello, hostname="node-a", pid=111, incarnation="first").code == "ALREADY_EXISTS"
    core.done(0, 0)  # a rank whose holder finished is free at once
    assert core.register(0, *hello, hostname="node-c", pid=333, incarnation="third") == 0


def test_a_restarted_shard_keeps_each_rank_for_the_process_that_held_it(tmp_path):
    """Found by the chaos suite: a second process of rank 0, started while shard 0 restarted, registered with
    the restarted shard (which knew no holder) before the holder came back; the holder's next push, computed from
    the version it had pulled before the restart, was refused and it exited 1.  Now a shard's checkpoint says who
    held each live rank, and the restarted shard keeps the rank for that process for one lease."""
    core, clock = make_core("async", 2)
    hello = (PLAN.hash, json.dumps(PLAN.description()))
    assert core.register(0, *hello, hostname="node-a", pid=111, incarnation="first") == 0
    recovery.write(core, tmp_path, force=True)
    restarted, clock = make_core("async", 2)
    recovery.restore(restarted, checkpoint.load_latest(tmp_path, PLAN.hash, restarted.fingerprint))
    err = error(restarted.register, 0, *hello, hostname="node-b", pid=222, incarnation="second")
    assert err.code == "ALREADY_EXISTS" and "node-a pid 111" in err.message, err.message
    assert restarted.register(0, *hello, hostname="node-a", pid=111, incarnation="first") == 0  # the holder rejoins
    assert restarted.register(1, *hello, hostname="node-c", pid=333, incarnation="other") == 0  # rank 1 was free
    again, clock = make_core("async", 2)
    recovery.restore(again, checkpoint.load_latest(tmp_path, PLAN.hash, again.fingerprint))
    clock.advance(LEASE + 1)  # the holder did not come back within a lease: it died with the shard
    assert again.register(0, *hello, hostname="node-b", pid=222, incarnation="second") == 0


def test_close_wakes_a_waiting_pull_with_unavailable():
    core, _ = make_core("sync", 2)
    register_all(core)
    push(core, 0, 0)
    waiting = run_in_thread(core.pull, 0, 1, timeout=JOIN_WAIT)
    core.close()
    with pytest.raises(ShardError) as info:
        waiting()
    assert info.value.code == "UNAVAILABLE"


# --- refusals ---------------------------------------------------------------------------


def test_plan_hash_mismatch_explains_the_difference():
    core, _ = make_core("sync", 2)
    other = PartitionPlan([VarSpec("w", (12,), "float64"), VarSpec("b", (4,), "float64")], 1, 128)
    err = error(core.register, 0, other.hash, json.dumps(other.description()))
    assert err.code == "FAILED_PRECONDITION"
    assert other.hash in err.message and PLAN.hash in err.message
    assert "slice_bytes: worker 128 vs server 64" in err.message
    assert "b: worker shape (4,) float64 vs server shape (3,) float64" in err.message
    assert core.status()["workers"][0]["state"] == "pending"
    err = error(push, core, 0, 0)
    assert err.code == "FAILED_PRECONDITION"


MALFORMED_PLANS = [
    "",
    "not json",
    "[]",
    "null",
    "7",
    '{"variables": 5}',
    '{"variables": [[]]}',
    '{"variables": [{}]}',
    '{"variables": [["w"]]}',
    '{"variables": [[["w"]]]}',
    '{"num_shards": 1, "slice_bytes": 64, "variables": [["w", 12, "float64"]]}',
    "[" * 100_000 + "]" * 100_000,
]


@pytest.mark.parametrize("plan_json", MALFORMED_PLANS, ids=[f"plan{i}" for i in range(len(MALFORMED_PLANS))])
def test_plan_hash_mismatch_with_a_malformed_plan_description(plan_json):
    core, _ = make_core("sync", 2)
    err = error(core.register, 1, "0123456789abcdef", plan_json)
    assert err.code == "FAILED_PRECONDITION"
    assert "0123456789abcdef" in err.message and "same job file" in err.message


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("policy", ["sync", "async"])
def test_non_finite_gradients_are_refused_and_change_nothing(bad, policy):
    core, _ = make_core(policy, 2)
    register_all(core)
    gw, gb = grad(1)
    gw = gw.copy()
    gw[9] = bad  # in slice w#8
    err = error(push, core, 0, 0, (gw, gb))
    assert err.code == "INVALID_ARGUMENT"
    assert "w#8" in err.message and "worker 0" in err.message and "non-finite" in err.message
    assert core.version == 0
    assert_weights(core, INIT)
    # the refused push did not count: the same clock with a good gradient is accepted, not a duplicate
    assert push(core, 0, 0).outcome in ("accumulated", "applied")


def test_non_finite_gradients_are_allowed_when_configured():
    core, _ = make_core("async", 1, allow_nonfinite=True)
    register_all(core)
    gw, gb = grad(1)
    gb = gb.copy()
    gb[0] = math.nan
    assert push(core, 0, 0, (gw, gb)).outcome == "applied"
    assert np.isnan(weights(core)["b"][0])


def test_malformed_pushes_are_refused():
    core, _ = make_core("async", 2)
    register_all(core)
    good = grads_of(*grad(1))
    cases = [
        (lambda: core.push(2, 0, 0, good), "INVALID_ARGUMENT", "out of range"),
        (lambda: core.push(-1, 0, 0, good), "INVALID_ARGUMENT", "out of range"),
        (lambda: core.push(0, -1, 0, good), "INVALID_ARGUMENT", "must be >= 0"),
        (lambda: core.push(0, 0, -1, good), "INVALID_ARGUMENT", "must be >= 0"),
        (lambda: core.push(0, 0, 5, good), "INVALID_ARGUMENT", "ahead"),
        (lambda: core.push(0, 0, 0, {i: g for i, g in good.items() if i != 1}), "INVALID_ARGUMENT", "every slice"),
        (lambda: core.push(0, 0, 0, {**good, 7: good[2]}), "INVALID_ARGUMENT", "every slice"),
        (lambda: core.pull(5, 0, timeout=0), "INVALID_ARGUMENT", "out of range"),
        (lambda: core.pull(0, -3, timeout=0), "INVALID_ARGUMENT", "negative"),
        (lambda: core.register(9, PLAN.hash), "INVALID_ARGUMENT", "out of range"),
        (lambda: core.heartbeat(-2, 0), "INVALID_ARGUMENT", "out of range"),
        (lambda: core.done(2, 0), "INVALID_ARGUMENT", "out of range"),
    ]
    for call, code, words in cases:
        err = error(call)
        assert err.code == code, err.message
        assert words in err.message
    assert core.version == 0
    assert_weights(core, INIT)


@pytest.mark.parametrize("policy,options", [("async", {}), ("ssp", {"staleness": 1})])
def test_a_push_clock_must_leave_room_for_the_next_clock_in_int64(policy, options):
    core, _ = make_core(policy, 2, options=options)
    register_all(core, [0])
    err = error(push, core, 0, MAX_CLOCK + 1)
    assert err.code == "INVALID_ARGUMENT" and "too large" in err.message
    assert core.version == 0
    assert_weights(core, INIT)
    core.register(1, PLAN.hash, clock=MAX_CLOCK)  # first seen there (a shard that started again without a checkpoint)
    r = push(core, 1, MAX_CLOCK)  # the largest clock is still applied
    assert (r.outcome, r.next_clock) == ("applied", 2**63 - 1)
    assert core.status()["workers"][1]["clock"] == 2**63 - 1


@pytest.mark.parametrize("policy,options", [("async", {}), ("ssp", {"staleness": 1}), ("local", {"local_steps": 2})])
def test_a_push_with_a_clock_the_worker_cannot_have_reached_is_refused_and_counted(policy, options):
    core, _ = make_core(policy, 2, options=options)
    register_all(core)
    push(core, 0, 0)
    before = {k: v.copy() for k, v in core.weights.items()}
    err = error(push, core, 0, 10**12)
    assert err.code == "FAILED_PRECONDITION" and "beyond what worker 0 can have reached" in err.message
    assert core.version == 1 and all(np.array_equal(core.weights[k], v) for k, v in before.items())
    assert core.status()["counters"]["rejected"] == 1
    assert push(core, 0, 1).outcome == "applied"  # its own next clock goes on


def test_pull_and_push_from_a_worker_that_has_not_registered():
    core, _ = make_core("sync", 2)
    register_all(core, [0])
    for call in (lambda: core.pull(1, 0, timeout=0), lambda: push(core, 1, 0), lambda: core.heartbeat(1, 0)):
        err = error(call)
        assert err.code == "FAILED_PRECONDITION"
        assert "not registered" in err.message and "pending" in err.message
    assert core.version == 0


# --- status ----------------------------------------------------------------------------------


def test_status_reports_everything():
    core, clock = make_core("sync", 2)
    core.register(0, PLAN.hash, hostname="host-a", pid=4242)
    clock.advance(3)
    push(core, 0, 0)
    clock.advance(4)
    s = core.status()
    assert s["checkpoint"] is None and s["restored_version"] is None and s["rewinding"] == {} and s["last_cause"] == ""
    assert (s["role"], s["replica_lag"]) == ("", -1)  # no replica
    assert set(s) == {
        "shard",
        "num_shards",
        "workers_range",
        "members",
        "policy",
        "version",
        "plan_hash",
        "bytes_held",
        "workers",
        "checkpoint",
        "restored_version",
        "reads",
        "rewinding",
        "last_cause",
        "role",
        "replica_lag",
        "counters",
        "staleness_histogram",
    }
    assert (s["shard"], s["num_shards"], s["policy"], s["version"]) == (0, 1, "sync", 0)
    assert s["plan_hash"] == PLAN.hash
    assert s["bytes_held"] == 15 * 8
    w0, w1 = s["workers"]
    assert w0 == {
        "worker_id": 0,
        "state": "live",
        "clock": 1,
        "lease_left_seconds": pytest.approx(LEASE - 4),
        "hostname": "host-a",
        "pid": 4242,
    }
    assert (w1["worker_id"], w1["state"], w1["clock"]) == (1, "pending", 0)
    assert w1["lease_left_seconds"] == pytest.approx(JOIN - 7)
    c = s["counters"]
    assert (c["pushes"], c["accumulated"], c["applied"], c["rejected"]) == (1, 1, 0, 0)
    assert c["bytes_in"] == 15 * 8 and c["bytes_out"] == 0
    assert c["policy"]["name"] == "sync" and c["policy"]["open_round_pushers"] == [0]
    assert s["staleness_histogram"] == [0] * STALENESS_BUCKETS
    core.pull(0, 0, timeout=0)
    assert core.status()["counters"]["bytes_out"] == 15 * 8
    json.dumps(s)  # everything is JSON-serialisable (the service sends counters as JSON)


# --- PushAssembler -------------------------------------------------------------------------


def assembler(declared: str = "float64") -> PushAssembler:
    core, _ = make_core()
    return PushAssembler(core, declared)


def slice_bytes(seed: int) -> dict[int, bytes]:
    return {i: g.tobytes() for i, g in grads_of(*grad(seed)).items()}


def test_assembler_puts_chunks_together():
    a = assembler()
    data = slice_bytes(3)
    a.add(0, 0, data[0][:24])
    a.add(2, 0, data[2])
    a.add(0, 24, data[0][24:])
    a.add(1, 0, b"")  # an empty chunk is harmless
    a.add(1, 0, data[1])
    got = a.finish()
    assert set(got) == {0, 1, 2}
    for i, g in grads_of(*grad(3)).items():
        assert got[i].dtype == np.float64 and np.array_equal(got[i], g)


def test_assembler_refuses_an_out_of_order_chunk():
    a = assembler()
    err = error(a.add, 0, 8, b"\0" * 8)
    assert err.code == "INVALID_ARGUMENT" and "w#0" in err.message and "expected 0" in err.message
    a.add(0, 0, b"\0" * 16)
    err = error(a.add, 0, 8, b"\0" * 8)  # overlapping, going back
    assert err.code == "INVALID_ARGUMENT" and "in order" in err.message


def test_assembler_refuses_an_overlong_chunk():
    a = assembler()
    err = error(a.add, 2, 0, b"\0" * 25)
    assert err.code == "INVALID_ARGUMENT" and "b#0" in err.message and "holds 24 bytes" in err.message
    a.add(2, 0, b"\0" * 24)
    err = error(a.add, 2, 24, b"\0" * 8)  # more after a complete slice
    assert err.code == "INVALID_ARGUMENT" and "holds 24 bytes" in err.message


def test_assembler_refuses_an_unknown_slice():
    a = assembler()
    for slice_id in (3, 99, 2**32 - 1):
        err = error(a.add, slice_id, 0, b"\0" * 8)
        assert err.code == "NOT_FOUND" and f"slice {slice_id}" in err.message and "partition plan" in err.message


def test_assembler_refuses_an_incomplete_push():
    a = assembler()
    data = slice_bytes(1)
    a.add(0, 0, data[0])
    a.add(1, 0, data[1][:16])
    err = error(a.finish)
    assert err.code == "INVALID_ARGUMENT" and "incomplete push" in err.message
    assert "w#8 (16 of 32 bytes)" in err.message and "b#0 (0 of 24 bytes)" in err.message
    assert "w#0" not in err.message
    err = error(assembler().finish)  # nothing at all
    assert err.code == "INVALID_ARGUMENT" and "w#0 (0 of 64 bytes)" in err.message


def test_assembler_refuses_a_wrong_dtype():
    for dtype in ("float32", "", "<f8", "float64 ", "int64"):
        err = error(assembler, dtype)
        assert err.code == "INVALID_ARGUMENT" and "'float64'" in err.message and "dtype" in err.message
    assert "(none)" in error(assembler, "").message
    for codec in ("float16", "bfloat16"):  # compression is for float32 variables only
        err = error(assembler, codec)
        assert err.code == "INVALID_ARGUMENT" and "needs float32 variables" in err.message


def test_an_update_waits_for_a_zero_copy_read_that_ends_within_the_patience_and_copies_nothing():
    core, _ = make_core("async", 1)
    register_all(core)
    core.store.patience = JOIN_WAIT
    live = core.pull(0, 0, timeout=1, copy=False)
    before = bytes(live.buffer)
    pushed = run_in_thread(push, core, 0, 0)
    wait_for(lambda: core.store.writers_waiting == 1, JOIN_WAIT, "the push to wait for the zero-copy pull")
    assert bytes(live.buffer) == before and core.version == 0  # nothing changed under the sender
    err = error(core.pull, 0, 1, timeout=0.05)  # a new pull defers to the waiting update
    assert err.code == "DEADLINE_EXCEEDED" and "update" in err.message
    live.release()
    live.release()  # idempotent
    assert pushed().outcome == "applied" and core.version == 1
    assert core.store.counters["copied_updates"] == 0 and core.store.current == 0  # made in place
    with core.pull(0, 1, timeout=1, copy=False) as again:
        assert bytes(again.buffer) != before
    assert core.store.reads() == []


def test_a_zero_copy_read_past_the_patience_keeps_its_version_and_the_update_goes_elsewhere():
    core, _ = make_core("async", 1)
    register_all(core)
    core.store.patience = 0.1
    live = core.pull(0, 0, timeout=1, copy=False)
    before = bytes(live.buffer)
    began = time.monotonic()
    assert push(core, 0, 0).outcome == "applied" and core.version == 1
    assert 0.1 <= time.monotonic() - began < JOIN_WAIT
    assert core.store.counters["copied_updates"] == 1 and core.store.current == 1
    assert bytes(live.buffer) == before != core.flat.tobytes()  # the reader's version, whole
    assert [r["worker"] for r in core.status()["reads"]] == [0]
    began = time.monotonic()
    assert push(core, 0, 1).outcome == "applied"  # the new slot is unread: in place, no waiting
    assert time.monotonic() - began < 0.1 and core.store.counters["copied_updates"] == 1
    assert bytes(live.buffer) == before
    live.release()
    assert core.status()["reads"] == []


def test_the_counters_add_up_while_an_update_waits_for_a_read():
    """Found by the chaos suite: a Status read while an update waited for a pull (letting go of the lock) counted
    the push without its outcome."""
    core, _ = make_core("async", 1)
    register_all(core)
    core.store.patience = JOIN_WAIT
    live = core.pull(0, 0, timeout=1, copy=False)
    pushed = run_in_thread(push, core, 0, 0)
    wait_for(lambda: core.store.writers_waiting == 1, JOIN_WAIT, "the push to wait for the read")
    c = core.status()["counters"]
    assert c["pushes"] == sum(c[k] for k in ("applied", "accumulated", "duplicates", "late", "rejected")) == 0
    live.release()
    assert pushed().outcome == "applied"
    c = core.status()["counters"]
    assert c["pushes"] == c["applied"] == 1


def test_reads_of_both_slots_past_their_hold_are_revoked_for_an_update_oldest_first():
    core, _ = make_core("async", 1)
    register_all(core)
    core.store.patience = 0.0
    revoked = []
    a = core.pull(0, 0, timeout=1, copy=False, hold=0.2, on_revoke=lambda: revoked.append("a"))
    push(core, 0, 0)  # no patience: made in the other slot at once
    b = core.pull(0, 1, timeout=1, copy=False, hold=JOIN_WAIT, on_revoke=lambda: revoked.append("b"))
    kept = bytes(b.buffer)
    began = time.monotonic()
    push(core, 0, 1)  # both slots read: waits for a's hold, then takes its slot
    assert 0.1 < time.monotonic() - began < JOIN_WAIT
    assert revoked == ["a"] and a.revoked and not b.revoked and core.store.counters["revoked_reads"] == 1
    assert bytes(b.buffer) == kept and core.store.seq[a.slot] != a.seq and core.store.seq[b.slot] == b.seq
    a.release()  # a revoked read's release changes nothing
    b.release()
    assert core.store.reads() == []


# -- large shards check and update their slices on several threads ---------------------------------------


def _big_core(threads: int, optimizer: str) -> ShardCore:
    from psgd.wire.sweep import PARALLEL_BYTES

    specs = [VarSpec("w", (PARALLEL_BYTES // 8 + 1000,), "float64"), VarSpec("b", (7,), "float64")]
    plan = PartitionPlan(specs, num_shards=1, slice_bytes=1 << 20)
    rng = np.random.default_rng(5)
    values = plan.split({s.name: rng.standard_normal(s.shape) for s in specs}, shard=0)
    core = ShardCore(
        plan,
        0,
        values,
        build_optimizer(optimizer, lr=LR),
        make_policy("async", 1),
        num_workers=1,
        apply_threads=threads,
    )
    core.register(0, plan.hash)
    return core


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_a_large_shard_updates_on_threads_bitwise_as_on_one(optimizer):
    one, many = _big_core(1, optimizer), _big_core(3, optimizer)
    assert one.store.sweep.threads == 1 and many.store.sweep.threads == 3 and len(many.slices) > 8
    rng = np.random.default_rng(6)
    for clock in range(3):
        grads = {i: rng.standard_normal(s.size) for i, s in one.slices.items()}
        for core in (one, many):
            core.push(0, clock, core.version, {i: g.copy() for i, g in grads.items()})
    assert one.version == many.version == 3
    assert one.flat.tobytes() == many.flat.tobytes()


def test_a_large_shard_names_the_first_bad_slice_and_changes_nothing():
    core = _big_core(3, "sgd")
    before = core.flat.tobytes()
    grads = {i: np.zeros(s.size) for i, s in core.slices.items()}
    ids = sorted(grads)
    grads[ids[2]][5] = np.nan
    grads[ids[6]][:3] = np.inf
    with pytest.raises(ShardError, match=rf"{core.slices[ids[2]].key} from worker 0 has 1 non-finite"):
        core.push(0, 0, 0, grads)
    assert core.flat.tobytes() == before and core.version == 0


def test_small_shards_stay_on_one_thread():
    core, _ = make_core("async", 1)
    assert core.store.sweep.threads == 1  # 15 values: threads would only add latency


def hold_an_update(core: ShardCore, worker: int, clock: int):
    """Push in a thread and hold that update between its policy's decision and its write: a live read of the weights
    that is never released on its own, and an update that waits for it (no patience runs out).  Returns the read
    (release it to let the update go on) and the push's join."""
    core.store.patience = 3600.0
    with core.lock:
        read = core.store.live(core.version)
    join = run_in_thread(push, core, worker, clock)
    wait_for(lambda: core.store.writers_waiting == 1, JOIN_WAIT, "the update to wait for the read")
    assert core.policy.clock_of(worker) == clock + 1 and core.version == 0  # decided, not yet written
    return read, join


@pytest.mark.parametrize("policy, options", [("async", {}), ("ssp", {"staleness": 2})])
def test_a_checkpoint_holds_an_update_whole_or_not_at_all(tmp_path, policy, options):
    """An update that waits for a read has been decided (the policy counts the push) but not written; a checkpoint
    taken then held the policy's clocks without the weights, and a shard restored from it counted the worker's retry
    as a duplicate: the push was lost.  The checkpoint now waits for the update to be written."""
    core, _ = make_core(policy, 2, options=options)
    register_all(core)
    read, pushed = hold_an_update(core, 1, 0)
    written = run_in_thread(recovery.write, core, tmp_path, force=True)
    wait_for(
        lambda: core.whole.last_checkpoint is not None or core.store.settling == 1,
        JOIN_WAIT,
        "the checkpoint to be written or to wait",
    )
    read.release()
    pushed()
    written()
    ckpt = checkpoint.load_latest(tmp_path, PLAN.hash, core.fingerprint)
    restored, _ = make_core(policy, 2, options=options)
    recovery.restore(restored, ckpt)
    assert (restored.version, restored.policy.clock_of(1)) == (1, 1)
    assert_weights(restored, expect((1.0 / 2, grad(1 + 1))))


@pytest.mark.parametrize("policy", ["async", "sync"])
def test_a_gradient_too_large_for_finite_weights_is_refused_and_leaves_them_as_they_were(policy):
    """Three pushes of 3e38 (finite) were applied: then 4,810 weights were infinite, with no log line."""
    core, _ = make_core(policy, 1)
    register_all(core)
    before = core.flat.copy()
    # float64 here: 3e38 is float32's; beyond the bound (8.4e152 in float64, 1.15e18 in float32) either way
    huge = {i: np.full(s.size, core.store.max_gradient * 4) for i, s in core.slices.items()}
    for clock in range(3):
        with pytest.raises(ShardError, match="beyond the .* gradient may hold") as info:
            core.push(0, 0, 0, huge)
        assert info.value.code == "INVALID_ARGUMENT"
    assert core.version == 0 and core.flat.tobytes() == before.tobytes() and np.isfinite(core.flat).all()
    assert core.policy.clock_of(0) == 0  # not counted: the worker's push at clock 0 is still to come
    fine = {i: np.full(s.size, 1e3) for i, s in core.slices.items()}
    assert core.push(0, 0, 0, fine).outcome in ("applied", "accumulated") and core.version == 1
    assert np.isfinite(core.flat).all() and core.flat.tobytes() != before.tobytes()


def test_what_a_checkpoint_says_of_a_rank_holder_does_not_get_its_registration_key(tmp_path):
    """A worker's registration key could be had through its incarnation string: the checkpoint's manifest wrote it
    as the worker sent it, and a registration with the same incarnation is the same process keeping its key; a
    reader of the manifest registered with it and received the live worker's key (then pushed as the worker)."""
    core, _ = make_core("async", 1)
    secret = "f00dfeedbeef0123-4242"  # the worker's own (psgd.job.process_incarnation)
    core.register(0, PLAN.hash, json.dumps(PLAN.description()), "host", 4242, 0, incarnation=secret)
    key = core.roster.workers[0].key
    recovery.write(core, tmp_path, force=True)
    manifest = checkpoint.load_latest(tmp_path, PLAN.hash, core.fingerprint).manifest
    written = json.dumps(manifest)
    assert secret not in written and key not in written
    said = manifest["holders"]["0"]["incarnation"]
    with pytest.raises(ShardError) as info:  # held by another process: refused, not handed the key
        core.register(0, PLAN.hash, json.dumps(PLAN.description()), "elsewhere", 1, 0, incarnation=said)
    assert info.value.code == "ALREADY_EXISTS" and core.roster.workers[0].key == key
    core.register(0, PLAN.hash, json.dumps(PLAN.description()), "host", 4242, 0, incarnation=secret)
    assert core.roster.workers[0].key == key  # the holder itself registering again keeps its key

    restored, _ = make_core("async", 1)  # restarted from the checkpoint: the rank is kept for its holder only
    recovery.restore(restored, checkpoint.load_latest(tmp_path, PLAN.hash, core.fingerprint))
    with pytest.raises(ShardError) as info:
        restored.register(0, PLAN.hash, json.dumps(PLAN.description()), "elsewhere", 1, 0, incarnation=said)
    assert info.value.code == "ALREADY_EXISTS"
    restored.register(0, PLAN.hash, json.dumps(PLAN.description()), "host", 4242, 0, incarnation=secret)
    assert restored.roster.workers[0].state == "live"


def test_a_resumed_launchs_worker_takes_its_kept_rank_at_once_and_no_other_process_does(tmp_path):
    """A launch resumed after Ctrl-C: its new worker processes waited a lease (10 s) with a WARNING that asked
    whether each was 'a second psgd-worker started with rank 0', as the rank was kept for the process that held it
    when the checkpoint was written.  The launcher gives each rank a claim that outlives its process
    (psgd.job.process_incarnation sends it): a process with the rank's claim takes the kept rank at once; one
    without it (started by hand), or with another rank's or another job's, is refused as before."""
    claim, other = "c1aa" * 8, "0dd5" * 8
    core, _ = make_core("async", 2)
    plan = (PLAN.hash, json.dumps(PLAN.description()))
    core.register(0, *plan, "host", 100, 0, incarnation=f"{claim}/b00t1-100")
    core.register(1, *plan, "host", 101, 0, incarnation=f"{other}/b00t1-101")
    recovery.write(core, tmp_path, force=True)
    written = json.dumps(checkpoint.load_latest(tmp_path, PLAN.hash, core.fingerprint).manifest)
    assert claim not in written and other not in written  # what a manifest says of a claim cannot be sent back

    restored, _ = make_core("async", 2)
    recovery.restore(restored, checkpoint.load_latest(tmp_path, PLAN.hash, core.fingerprint))
    said = json.loads(written)["holders"]["0"]
    for stranger in ("b00t2-300", f"{other}/b00t2-301", f"{said.get('claim')}/b00t2-302", f"/{said['incarnation']}"):
        with pytest.raises(ShardError) as info:
            restored.register(0, *plan, "elsewhere", 300, 0, incarnation=stranger)
        assert info.value.code == "ALREADY_EXISTS", stranger
    restored.register(0, *plan, "host", 200, 0, incarnation=f"{claim}/b00t2-200")  # the launch's own, resumed
    assert restored.roster.workers[0].state == "live" and restored.roster.workers[0].pid == 200
    with pytest.raises(ShardError) as info:  # live: the same claim from another process is a second process
        restored.register(0, *plan, "host", 201, 0, incarnation=f"{claim}/b00t2-201")
    assert info.value.code == "ALREADY_EXISTS"


def test_a_launchs_claim_on_a_rank_outlives_its_process_and_only_its_job_can_make_it(monkeypatch):
    from psgd.job import RANK_CLAIM, process_incarnation
    from psgd.launcher.run import rank_claim

    token = "t" * 43
    assert rank_claim(token, 0) == rank_claim(token, 0)  # the resumed launch's worker: the same claim
    assert len({rank_claim(token, 0), rank_claim(token, 1), rank_claim("u" * 43, 0)}) == 3
    monkeypatch.delenv(RANK_CLAIM, raising=False)
    alone = process_incarnation()  # started by hand: no claim
    assert "/" not in alone
    monkeypatch.setenv(RANK_CLAIM, rank_claim(token, 0))
    assert process_incarnation() == f"{rank_claim(token, 0)}/{alone}"


def test_done_from_a_caller_that_does_not_hold_the_rank_is_refused_whatever_the_ranks_state(tmp_path):
    """Found by the chaos suite's outsider: right after a shard restarted from a checkpoint, Done as worker 0 without
    its key was answered as if it had been accepted (worker 0 was not live there yet, so nothing changed, but the
    caller was told nothing was wrong).  Done as a rank not live here is refused as every other call is (register
    again), and once a rank is done a repeated Done must carry its key."""
    core, _ = make_core("async", 1)
    core.register(0, PLAN.hash, json.dumps(PLAN.description()), "host", 1, 0, incarnation="real")
    key = core.roster.workers[0].key
    recovery.write(core, tmp_path, force=True)
    restarted, _ = make_core("async", 1)
    recovery.restore(restarted, checkpoint.load_latest(tmp_path, PLAN.hash, core.fingerprint))
    for who in ("", "0" * 32):  # no key, a made-up one: the rank is kept for its holder, not live
        err = error(restarted.done, 0, 0, key=who)
        assert (err.code, err.reason) == ("FAILED_PRECONDITION", "NOT_REGISTERED")
    assert restarted.roster.workers[0].state == "pending"
    assert core.done(0, 0, key=key) == 0 and core.roster.workers[0].state == "done"
    assert core.done(0, 0, key=key) == 0  # said again (its answer was lost): nothing more to do
    err = error(core.done, 0, 0, key="")
    assert err.code == "PERMISSION_DENIED" and core.roster.impostors == 1
