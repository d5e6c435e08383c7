"""The consistency policies, driven by scripted and random event sequences (no network, no threads)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psgd.policy import (
    ACCUMULATE,
    APPLY,
    DUPLICATE,
    LATE,
    REJECT,
    AsyncPolicy,
    Policy,
    PolicyError,
    PushDecision,
    SSPPolicy,
    SyncPolicy,
    make_policy,
)

PROPERTY = settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

ALL_POLICIES = [
    ("sync", {}),
    ("sync", {"backup_workers": 1}),
    ("async", {}),
    ("ssp", {"staleness": 0}),
    ("ssp", {"staleness": 2}),
]
POLICY_IDS = ["sync", "sync-b1", "async", "ssp0", "ssp2"]


class SyncCore:
    """What the server core does with sync decisions, reduced to bookkeeping: who is in which round."""

    def __init__(self, policy: SyncPolicy):
        self.policy = policy
        self.pending: dict[int, set[int]] = {}
        self.applied: list[frozenset[int]] = []  # applied[r]: the workers averaged into round r

    def _apply(self, closed: tuple[int, ...]) -> None:
        for rnd in closed:
            assert rnd == len(self.applied), f"round {rnd} closed out of order or twice"
            contributors = self.pending.pop(rnd, set())
            assert contributors, f"round {rnd} closed without a push"
            self.applied.append(frozenset(contributors))

    def push(self, worker: int, clock: int) -> PushDecision:
        decision = self.policy.push(worker, clock)
        if decision.action == ACCUMULATE:
            assert worker not in self.pending.setdefault(decision.round, set())
            self.pending[decision.round].add(worker)
        else:
            assert decision.closed_rounds == ()
        self._apply(decision.closed_rounds)
        return decision

    def leave(self, worker: int) -> tuple[int, ...]:
        closed = self.policy.leave(worker)
        self._apply(closed)
        return closed


# -- make_policy and errors ----------------------------------------------


def test_make_policy_builds_each_policy_with_its_options():
    sync = make_policy("sync", 4, backup_workers=1)
    assert isinstance(sync, SyncPolicy) and sync.backup_workers == 1 and sync.name == "sync"
    assert make_policy("sync", 4).backup_workers == 0
    assert type(make_policy("async", 3)) is AsyncPolicy
    ssp = make_policy("ssp", 2, staleness=5)
    assert isinstance(ssp, SSPPolicy) and ssp.staleness == 5
    assert ssp.describe()["options"] == {"staleness": 5}
    assert all(isinstance(p, Policy) for p in (sync, ssp))


@pytest.mark.parametrize(
    "name, num_workers, options, words",
    [
        ("bsp", 2, {}, ["'bsp'", "sync, async, ssp"]),
        (None, 2, {}, ["sync, async, ssp"]),
        ("sync", 2, {"staleness": 1}, ["staleness", "options it takes: backup_workers"]),
        ("async", 2, {"backup_workers": 1}, ["backup_workers", "options it takes: none"]),
        ("ssp", 2, {}, ["needs", "staleness"]),
        ("ssp", 2, {"staleness": -1}, ["staleness", ">= 0", "-1"]),
        ("ssp", 2, {"staleness": 1.5}, ["staleness", "1.5"]),
        ("ssp", 2, {"staleness": float("inf")}, ["staleness", "inf"]),
        ("ssp", 2, {"staleness": "2"}, ["staleness", "'2'"]),
        ("sync", 3, {"backup_workers": 3}, ["backup_workers", "0..2"]),
        ("sync", 3, {"backup_workers": -1}, ["backup_workers", "0..2"]),
        ("sync", 3, {"backup_workers": True}, ["backup_workers", "True"]),
        ("sync", 0, {}, ["num_workers", ">= 1"]),
        ("async", 2.0, {}, ["num_workers", "2.0"]),
        ("async", True, {}, ["num_workers"]),
    ],
)
def test_make_policy_errors_are_one_line_and_say_what_is_accepted(name, num_workers, options, words):
    with pytest.raises(PolicyError) as info:
        make_policy(name, num_workers, **options)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message


@pytest.mark.parametrize("name, options", ALL_POLICIES, ids=POLICY_IDS)
def test_bad_worker_ids_and_clocks(name, options):
    policy = make_policy(name, 3, **options)
    for worker, clock in [(3, 0), (-1, 0), (True, 0), ("0", 0), (None, 0), (1.0, 0), (0, -1), (0, 0.5), (0, None)]:
        decision = policy.push(worker, clock)
        assert decision.action == REJECT and decision.closed_rounds == ()
        assert "out of range" in decision.reason or "clock must be" in decision.reason
    assert policy.describe()["counters"]["rejected"] == 9
    for call in (policy.join, policy.leave, policy.clock_of):
        for worker in (3, -1, True, "1"):
            with pytest.raises(PolicyError, match="out of range"):
                call(worker)
    with pytest.raises(PolicyError, match="out of range"):
        policy.pull_ready(7, 0)
    with pytest.raises(PolicyError, match="clock must be"):
        policy.pull_ready(0, -1)
    assert policy.live_workers() == frozenset({0, 1, 2})  # nothing changed


@pytest.mark.parametrize("name, options", ALL_POLICIES, ids=POLICY_IDS)
def test_push_from_a_worker_that_left_is_rejected_until_it_registers_again(name, options):
    policy = make_policy(name, 2, **options)
    assert policy.leave(1) == ()
    assert policy.leave(1) == ()  # done then expired: leaving twice is harmless
    decision = policy.push(1, 0)
    assert decision.action == REJECT and "register again" in decision.reason
    assert policy.join(1) == 0
    assert policy.push(1, 0).action in (APPLY, ACCUMULATE)


@pytest.mark.parametrize("name, options", ALL_POLICIES, ids=POLICY_IDS)
def test_duplicate_push_is_applied_once(name, options):
    policy = make_policy(name, 2, **options)
    first = policy.push(0, 0)
    assert first.action in (APPLY, ACCUMULATE) and first.next_clock == 1
    for _ in range(3):  # retries of the same push
        again = policy.push(0, 0)
        assert again.action == DUPLICATE and again.closed_rounds == () and again.next_clock == 1
    counters = policy.describe()["counters"]
    assert counters["duplicates"] == 3
    assert counters.get("pushes_applied", counters.get("pushes_accumulated")) == 1


@pytest.mark.parametrize("name, options", ALL_POLICIES, ids=POLICY_IDS)
def test_describe_and_state_dict_are_json(name, options):
    policy = make_policy(name, 3, **options)
    policy.push(0, 0)
    policy.leave(2)
    described = json.loads(json.dumps(policy.describe()))
    assert described["name"] == name and described["options"] == policy.option_values()
    assert set(described["counters"]) >= {"duplicates", "late", "rejected"}
    assert ("rounds_closed" if name == "sync" else "pushes_applied") in described["counters"]
    assert described["live_workers"] == [0, 1]
    assert json.loads(json.dumps(policy.state_dict())) == policy.state_dict()


# -- async ---------------------------------------------------------------


def test_async_applies_every_new_push_and_never_waits():
    policy = AsyncPolicy(2)
    assert [policy.push(0, c).action for c in range(3)] == [APPLY] * 3
    assert policy.clock_of(0) == 3 and policy.clock_of(1) == 0
    assert policy.pull_ready(0, 100) and policy.pull_ready(1, 0)
    beyond = policy.push(1, 5)  # worker 1 pushes clock 0 next: it cannot have reached 5
    assert beyond.action == REJECT and beyond.next_clock == 0
    assert "beyond what worker 1 can have reached" in beyond.reason
    assert policy.push(1, 10**12).action == REJECT
    for c in range(6):
        assert policy.push(1, c).action == APPLY
    old = policy.push(1, 2)
    assert old.action == DUPLICATE and old.next_clock == 6
    assert policy.min_live_clock() == 3
    assert policy.describe()["counters"] == {"pushes_applied": 9, "duplicates": 1, "late": 0, "rejected": 2}


def test_local_sgd_may_skip_its_local_steps_and_no_more():
    policy = make_policy("local", 1, local_steps=4)
    assert policy.push(0, 3).action == APPLY  # the first period's push, after its 4 local steps
    assert policy.push(0, 7).action == APPLY
    assert policy.push(0, 13).action == REJECT  # 12 is the furthest one period can take it


@pytest.mark.parametrize("name, options", [("async", {}), ("ssp", {"staleness": 1})])
def test_rejoin_resumes_the_clock(name, options):
    policy = make_policy(name, 2, **options)
    for c in range(3):
        policy.push(0, c)
        policy.push(1, c)
    policy.leave(0)
    assert policy.live_workers() == frozenset({1})
    assert policy.join(0) == 3  # never sent back to 0
    assert policy.push(0, 2).action == DUPLICATE  # applied work is not redone
    assert policy.push(0, 3).action == APPLY


# -- ssp -----------------------------------------------------------------


def test_ssp_lock_step_with_zero_staleness():
    policy = SSPPolicy(3, staleness=0)
    assert all(policy.pull_ready(w, 0) for w in range(3))
    policy.push(0, 0)
    assert not policy.pull_ready(0, 1)  # 1 and 2 still at clock 0
    policy.push(1, 0)
    assert not policy.pull_ready(0, 1) and not policy.pull_ready(1, 1)
    assert policy.pull_ready(2, 0)
    policy.push(2, 0)
    assert all(policy.pull_ready(w, 1) for w in range(3))


def test_ssp_window_leave_and_join():
    policy = SSPPolicy(3, staleness=2)
    for c in range(3):
        policy.push(0, c)
    assert policy.clock_of(0) == 3 and policy.min_live_clock() == 0
    assert policy.pull_ready(0, 2) and not policy.pull_ready(0, 3)  # 3 - 2 > 0
    policy.push(1, 0)
    assert not policy.pull_ready(0, 3)  # worker 2 is still at 0
    assert policy.leave(2) == ()  # the slowest leaves: it no longer counts
    assert policy.pull_ready(0, 3) and not policy.pull_ready(0, 4)
    for c in range(1, 8):
        policy.push(1, c)
    assert policy.pull_ready(0, 5)
    # Worker 2 comes back: it continues at the back of the window (slowest other 3, minus s),
    # not at 0, so nobody waits while it replays old clocks; its own clock never goes back.
    assert policy.join(2) == 1
    assert policy.pull_ready(2, 1)
    assert policy.pull_ready(0, 3) and not policy.pull_ready(0, 4)
    assert policy.push(2, 1).action == APPLY
    assert policy.push(2, 1).action == DUPLICATE  # a retry
    assert policy.pull_ready(0, 4)


def test_ssp_applies_a_clock_a_join_jumped_over_as_the_shard_that_did_not_jump_does():
    """Two shards, each its own policy, a worker joining while they stand a clock apart: one jumps it to 2, the
    other to 1.  The worker goes on from the smaller (PSClient.register); its push of clock 1 was counted a
    duplicate where the jump was to 2, and that shard never had the gradient (found by psgd bench elastic: the
    shards ended a version apart)."""
    a, b = SSPPolicy(2, staleness=0), SSPPolicy(2, staleness=0)
    for c in range(3):
        a.push(0, c)
    for c in range(2):
        b.push(0, c)
    for shard in (a, b):
        shard.leave(1)
    assert (a.join(1), b.join(1)) == (3, 2)
    assert a.push(1, 2).action == b.push(1, 2).action == APPLY
    assert a.push(1, 2).action == b.push(1, 2).action == DUPLICATE  # a retry, applied once on each


def test_ssp_only_a_worker_that_had_left_jumps_ahead_on_join():
    policy = SSPPolicy(2, staleness=1)
    for c in range(5):
        policy.push(1, c)
    assert policy.join(0) == 0  # live (a quick restart): it keeps its clock
    assert not policy.pull_ready(1, 5)
    policy.leave(0)
    assert policy.join(0) == 4  # had left: back of the window behind worker 1 (5 - 1)
    assert policy.pull_ready(1, 5) and policy.pull_ready(0, 4)


def test_ssp_with_no_other_live_worker_never_waits():
    policy = SSPPolicy(2, staleness=0)
    policy.leave(1)
    assert policy.pull_ready(0, 50)
    policy.leave(0)
    assert policy.min_live_clock() is None and policy.pull_ready(1, 9)


def test_ssp_with_huge_staleness_is_async():
    ssp, asy = SSPPolicy(3, staleness=10**9), AsyncPolicy(3)
    for worker, clock in [(0, 0), (0, 1), (0, 1), (1, 4), (0, 7), (2, 0), (1, 2)]:
        assert ssp.push(worker, clock) == asy.push(worker, clock)
    assert all(ssp.pull_ready(w, c) for w in range(3) for c in range(20))
    ssp.leave(2)
    asy.leave(2)
    assert ssp.join(2) == asy.join(2) == 1


EVENT = st.tuples(
    st.sampled_from(["push", "push", "push", "pull", "leave", "join"]), st.integers(0, 5), st.integers(-2, 3)
)


def _model_push(clocks: list[int], pushed: list[int], live: set[int], w: int, clock: int) -> str:
    """The async/ssp push rule, on the test's own model of the clocks and of the last clock each pushed."""
    if w not in live or clock > clocks[w]:  # left, or a clock it cannot have reached
        return REJECT
    if clock <= pushed[w]:  # pushed before: a retry
        return DUPLICATE
    clocks[w], pushed[w] = max(clocks[w], clock + 1), clock  # (a clock a join jumped over is pushed here first)
    return APPLY


@pytest.mark.parametrize("staleness", [0, 1, 3, 10**9])
@PROPERTY
@given(num_workers=st.integers(1, 5), events=st.lists(EVENT, max_size=60))
def test_ssp_and_async_against_a_model(staleness, num_workers, events):
    """After every event: no ssp pull is let through more than s clocks ahead of the slowest other
    live worker (and every other pull is), the slowest live worker can always pull, and pushes are
    applied exactly when they are not duplicates; async lets every pull through."""
    ssp, asy = SSPPolicy(num_workers, staleness), AsyncPolicy(num_workers)
    clocks, async_clocks = [0] * num_workers, [0] * num_workers
    pushed, async_pushed = [-1] * num_workers, [-1] * num_workers
    live = set(range(num_workers))
    for kind, w, delta in events:
        w %= num_workers
        clock = max(0, clocks[w] + delta)
        if kind == "push":
            for policy, model, done in ((ssp, clocks, pushed), (asy, async_clocks, async_pushed)):
                before = model[w]
                decision = policy.push(w, clock)
                assert decision.action == _model_push(model, done, live, w, clock)
                assert decision.closed_rounds == () and decision.round is None
                assert decision.next_clock == (before if decision.action != APPLY else clock + 1)
        elif kind == "pull":
            assert asy.pull_ready(w, clock)
            ssp.pull_ready(w, clock)
        elif kind == "leave":
            assert ssp.leave(w) == asy.leave(w) == ()
            live.discard(w)
        else:
            assert asy.join(w) == async_clocks[w]  # async resumes exactly where it was
            others = [clocks[o] for o in live if o != w]
            resume = ssp.join(w)
            assert resume >= clocks[w]  # never sent back, never made to repeat applied work
            came_back = w not in live and others  # a live worker re-registering keeps its clock
            assert resume == (max(clocks[w], min(others) - staleness) if came_back else clocks[w])
            clocks[w] = resume
            live.add(w)
        assert ssp.live_workers() == asy.live_workers() == frozenset(live)
        assert [ssp.clock_of(o) for o in range(num_workers)] == clocks
        assert [asy.clock_of(o) for o in range(num_workers)] == async_clocks
        assert ssp.min_live_clock() == min((clocks[o] for o in live), default=None)
        for puller in range(num_workers):
            slowest_other = min((clocks[o] for o in live if o != puller), default=None)
            probes = {0, clocks[puller], clocks[puller] + 1, max(clocks) + 1}
            if slowest_other is not None:  # both sides of the bound
                probes |= {slowest_other + staleness, slowest_other + staleness + 1}
            for c in probes:
                ready = ssp.pull_ready(puller, c)
                if ready and slowest_other is not None:
                    assert c - slowest_other <= staleness, "pull let through beyond the staleness bound"
                assert ready == (slowest_other is None or slowest_other >= c - staleness)
                assert asy.pull_ready(puller, c)
        if live:  # progress: the slowest live worker is never blocked at its own clock
            slowest = min(live, key=lambda o: clocks[o])
            assert ssp.pull_ready(slowest, clocks[slowest])
    if staleness >= 10**9:  # a huge s behaves as async, joins included
        assert ssp.counters() == asy.counters() and clocks == async_clocks


# -- sync ----------------------------------------------------------------


def test_sync_one_averaged_update_per_clock_and_pulls_wait_for_the_round():
    policy = SyncPolicy(3)
    core = SyncCore(policy)
    for rnd in range(4):
        assert all(policy.pull_ready(w, rnd) for w in range(3))
        assert not any(policy.pull_ready(w, rnd + 1) for w in range(3))
        for worker in (2, 0):
            decision = core.push(worker, rnd)
            assert decision == PushDecision(ACCUMULATE, round=rnd, next_clock=rnd + 1)
            assert not policy.pull_ready(worker, rnd + 1)
        assert core.push(0, rnd).action == DUPLICATE  # a retry while the round is open
        last = core.push(1, rnd)
        assert last.action == ACCUMULATE and last.closed_rounds == (rnd,)
        assert policy.applied_rounds == rnd + 1 and all(policy.pull_ready(w, rnd + 1) for w in range(3))
        assert core.push(1, rnd).action == DUPLICATE  # a retry after it closed
    assert core.applied == [frozenset({0, 1, 2})] * 4
    assert policy.describe()["counters"] == {
        "rounds_closed": 4,
        "pushes_accumulated": 12,
        "duplicates": 8,
        "late": 0,
        "rejected": 0,
        "rounds_skipped": 0,
    }


def test_sync_rejects_clocks_from_the_future():
    policy = SyncPolicy(2)
    decision = policy.push(0, 1)
    assert decision.action == REJECT and "future" in decision.reason and decision.next_clock == 0
    policy.push(0, 0)
    decision = policy.push(0, 1)  # round 0 is still open
    assert decision.action == REJECT and decision.next_clock == 1
    assert policy.describe()["counters"]["rejected"] == 2 and policy.applied_rounds == 0


def test_sync_backup_workers_close_at_n_minus_b_and_drop_late_pushes():
    policy = SyncPolicy(4, backup_workers=1)
    core = SyncCore(policy)
    assert core.push(0, 0).closed_rounds == ()
    assert core.push(1, 0).closed_rounds == ()
    assert core.push(3, 0).closed_rounds == (0,)  # 3 of 4
    late = core.push(2, 0)
    assert late.action == LATE and late.next_clock == 1 and late.round == 0 and "closed" in late.reason
    assert policy.clock_of(2) == 1
    for worker in (3, 0, 1):
        core.push(worker, 1)
    assert policy.applied_rounds == 2
    late = core.push(2, 1)  # worker 2 is still behind: it jumps to the open round
    assert late.action == LATE and late.next_clock == 2
    assert core.push(2, late.next_clock).action == ACCUMULATE
    core.push(1, 2)
    assert core.push(0, 2).closed_rounds == (2,)
    assert core.applied == [frozenset({0, 1, 3}), frozenset({0, 1, 3}), frozenset({0, 1, 2})]
    counters = policy.describe()["counters"]
    assert counters["late"] == 2 and counters["rounds_closed"] == 3
    assert policy.join(2) == 3  # a late worker that rejoins starts at the open round


def test_sync_leaving_lets_the_round_close_but_never_early():
    policy = SyncPolicy(4)
    core = SyncCore(policy)
    core.push(0, 0)
    core.push(1, 0)
    assert core.leave(1) == ()  # 1 pushed and left: its push still counts, 2 and 3 are still awaited
    assert core.push(2, 0).closed_rounds == ()
    assert core.leave(3) == (0,)  # lease expired: nobody waits for it any more
    assert core.applied == [frozenset({0, 1, 2})]
    assert policy.live_workers() == frozenset({0, 2}) and policy.pull_ready(0, 1)
    # Leaving before anyone pushed closes nothing.
    assert core.leave(2) == ()
    assert policy.applied_rounds == 1
    assert core.push(0, 1).closed_rounds == (1,)  # the only live worker
    assert core.applied[1] == frozenset({0})


def test_sync_leave_with_backup_workers_counts_only_live_workers():
    policy = SyncPolicy(5, backup_workers=1)
    core = SyncCore(policy)
    core.push(0, 0)
    core.leave(4)
    core.leave(3)
    assert policy.applied_rounds == 0  # 1 and 2 live and not pushed: 2 > b
    assert core.leave(2) == (0,)


def test_sync_when_everyone_left_nothing_closes_without_pushes():
    policy = SyncPolicy(3)
    core = SyncCore(policy)
    assert [core.leave(w) for w in range(3)] == [(), (), ()]
    assert policy.applied_rounds == 0 and policy.min_live_clock() is None
    policy = SyncPolicy(3)
    core = SyncCore(policy)
    core.push(1, 0)
    assert core.leave(0) == () and core.leave(1) == ()
    assert core.leave(2) == (0,)  # the last live worker went: round 0 has worker 1's push
    assert core.applied == [frozenset({1})]


def test_sync_rejoin_catches_up():
    policy = SyncPolicy(3)
    core = SyncCore(policy)
    core.push(0, 0)
    core.leave(0)  # pushed round 0, then its lease expired
    assert policy.join(0) == 1  # its push stays in round 0; it continues at 1
    assert not policy.pull_ready(0, 1)
    core.push(1, 0)
    core.push(2, 0)
    assert core.applied == [frozenset({0, 1, 2})]
    core.leave(0)
    for rnd in (1, 2):
        core.push(1, rnd)
        core.push(2, rnd)
    assert policy.applied_rounds == 3
    assert policy.join(0) == 3  # the rounds it missed are not replayed
    assert policy.push(0, 1).action == LATE
    assert core.push(0, 3).action == ACCUMULATE
    core.push(1, 3)
    assert core.push(2, 3).closed_rounds == (3,)
    assert core.applied[3] == frozenset({0, 1, 2})


SYNC_EVENT = st.tuples(
    st.sampled_from(["push", "push", "push", "push", "leave", "join"]), st.integers(0, 5), st.integers(-2, 1)
)


@pytest.mark.parametrize("backup_workers", [0, 1, 2])
@PROPERTY
@given(num_workers=st.integers(1, 5), events=st.lists(SYNC_EVENT, max_size=80))
def test_sync_against_a_model(backup_workers, num_workers, events):
    """Every closed round is applied exactly once, in order, with a push from each live worker but
    at most b; no round stays open once it could close; pulls for c + 1 wait for round c."""
    b = min(backup_workers, num_workers - 1)
    policy = SyncPolicy(num_workers, backup_workers=b)
    core = SyncCore(policy)
    live = set(range(num_workers))
    last = [-1] * num_workers
    for kind, w, delta in events:
        w %= num_workers
        rounds = len(core.applied)
        clock = max(0, policy.clock_of(w) + delta)
        if kind == "push":
            before_live = set(live)
            decision = core.push(w, clock)
            expected = (
                REJECT
                if w not in live
                else DUPLICATE
                if clock <= last[w]
                else LATE
                if clock < rounds
                else REJECT
                if clock > rounds
                else ACCUMULATE
            )
            assert decision.action == expected
            if expected == ACCUMULATE:
                last[w] = clock
                assert decision.next_clock == clock + 1
                if decision.closed_rounds:
                    assert decision.closed_rounds == (rounds,)
                    assert len(before_live - core.applied[-1]) <= b
            elif expected == LATE:
                assert decision.next_clock == rounds
        elif kind == "leave":
            closed = core.leave(w)
            if closed:
                assert w in live and len(live - {w} - core.applied[-1]) <= b
            live.discard(w)
        else:
            assert policy.join(w) == max(last[w] + 1, len(core.applied))
            live.add(w)
        rounds = len(core.applied)
        assert policy.applied_rounds == rounds
        pushed = core.pending.get(rounds, set())
        assert not (pushed and len(live - pushed) <= b), "a complete round was left open"
        assert policy.open_round_pushers() == frozenset(pushed)
        assert all(policy.pull_ready(o, c) == (c <= rounds) for o in range(num_workers) for c in range(rounds + 3))
        assert policy.live_workers() == frozenset(live)
    assert policy.counters()["rounds_closed"] == len(core.applied)


# -- checkpoints ---------------------------------------------------------


def _replay(policy: Policy, events) -> list:
    out = []
    for kind, w, delta in events:
        w %= policy.num_workers
        clock = max(0, policy.clock_of(w) + delta)
        if kind == "push":
            out.append(policy.push(w, clock))
        elif kind == "pull":
            out.append(policy.pull_ready(w, clock))
        elif kind == "leave":
            out.append(policy.leave(w))
        else:
            out.append(policy.join(w))
    return out


@pytest.mark.parametrize("name, options", ALL_POLICIES, ids=POLICY_IDS)
@settings(max_examples=60, deadline=None, database=None)
@given(events=st.lists(EVENT, max_size=40), more=st.lists(EVENT, max_size=40))
def test_state_dict_round_trip_gives_the_same_future(name, options, events, more):
    original = make_policy(name, 3, **options)
    _replay(original, events)
    saved = json.loads(json.dumps(original.state_dict()))
    restored = make_policy(name, 3, **options)
    restored.load_state_dict(saved)
    assert restored.state_dict() == original.state_dict()
    assert restored.describe() == original.describe()
    assert _replay(restored, more) == _replay(original, more)
    assert restored.state_dict() == original.state_dict()


@pytest.mark.parametrize("name, options", ALL_POLICIES, ids=POLICY_IDS)
def test_load_state_dict_refuses_bad_state_and_changes_nothing(name, options):
    policy = make_policy(name, 3, **options)
    policy.push(0, 0)
    good = policy.state_dict()
    other = "async" if name != "async" else "sync"
    key = "last_pushed" if name == "sync" else "clocks"
    bad = [
        ("not a dict", "must be a dict"),
        ({**good, "format": 99}, "format"),
        ({**good, "policy": other}, "policy"),
        ({**good, "num_workers": 4}, "4 workers"),
        ({**good, "live": [0, 0]}, "'live'"),
        ({**good, "live": [5]}, "'live'"),
        ({**good, "counters": {}}, "counters"),
        ({**good, key: [0, 0]}, key),
        ({**good, key: [-5, 0, 0]}, key),
    ]
    if name == "sync":
        bad += [({**good, "applied_rounds": -1}, "applied_rounds"), ({**good, "last_pushed": [3, -1, -1]}, "beyond")]
    fresh = make_policy(name, 3, **options)
    for state, words in bad:
        with pytest.raises(PolicyError, match=words):
            fresh.load_state_dict(state)
        assert fresh.state_dict() == make_policy(name, 3, **options).state_dict()
    fresh.load_state_dict(good)
    assert fresh.state_dict() == good


def test_load_state_dict_keeps_the_configured_options():
    saved = SSPPolicy(2, staleness=0)
    saved.push(0, 0)
    saved.push(0, 1)
    restored = SSPPolicy(2, staleness=5)
    restored.load_state_dict(saved.state_dict())
    assert restored.staleness == 5 and restored.clock_of(0) == 2
    assert restored.pull_ready(0, 2) and not saved.pull_ready(0, 2)


def test_fast_forward_after_a_restore():
    sync = make_policy("sync", 2)
    for w in (0, 1):
        sync.join(w)
    sync.push(0, 0)  # round 0 open, worker 0 contributed
    assert sync.fast_forward(1, 0) is False and sync.applied_rounds == 0  # not ahead: nothing changes
    assert sync.fast_forward(1, 3) is True  # a worker is at clock 3: rounds 0..2 are skipped here
    assert sync.applied_rounds == 3 and sync.pull_ready(0, 3) and not sync.pull_ready(0, 4)
    assert sync.push(0, 3).action == "accumulate" and sync.push(1, 3).closed_rounds == (3,)
    assert sync.counters()["rounds_skipped"] == 3
    for name, options in (("async", {}), ("ssp", {"staleness": 1})):
        policy = make_policy(name, 2, **options)
        policy.join(0)
        assert policy.fast_forward(0, 5) is False and policy.clock_of(0) == 5
        assert policy.push(0, 4).action == "duplicate" and policy.push(0, 5).action == "apply"
