"""One round trip a step: a push whose answer brings the weights of the next clock, on every link.

The answer's weights are the shard's after the push (under sync, after the round it closes), the push is applied
once, a sync worker's run pulls on its own only at its first step, and a stop cuts the wait for the weights, never
the push.
"""

import contextlib
import threading
from concurrent import futures

import numpy as np
import pytest
from helpers import make_job, shards, wait_for

from psgd.job import build_job
from psgd.worker.client import PSClient, fetch_weights
from psgd.worker.exchange import run_worker

LINKS = ["tcp", "shm", "grpc"]


def _job(link: str, policy: str, workers: int = 1, *more: str):
    return make_job(
        "model.hidden=[24]",
        "train.epochs=1",
        "optimizer.name=momentum",
        "optimizer.lr=0.05",
        f"cluster.policy={policy}",
        f"cluster.workers={workers}",
        "cluster.shards=2",
        "cluster.slice_bytes=2048",
        f"cluster.transport={link}",
        *more,
    )


def _client(job, rank: int, **kw) -> PSClient:
    plan = build_job(job).plan
    client = PSClient(job.cluster.servers, plan, rank, links=job.cluster.links, config=job, **kw)
    client.wait_ready(30)
    client.register()
    return client


def _arrays(plan, value=None) -> dict:
    return {
        s.name: (np.empty(s.shape, s.dtype) if value is None else np.full(s.shape, value, s.dtype)) for s in plan.specs
    }


@pytest.mark.parametrize("link", LINKS)
def test_the_answer_to_a_push_is_the_next_clocks_weights_and_the_push_counts_once(link):
    job = _job(link, "async")
    with shards(job) as (job, servers):
        client = _client(job, 0)
        try:
            plan = client.plan
            host, grads = _arrays(plan), _arrays(plan, 0.01)
            client.pull(0, host)
            before = {k: v.copy() for k, v in host.items()}
            replies, versions = client.push_pull(0, grads, host)
            assert [r.outcome for r in replies] == ["applied", "applied"]
            assert versions == [s.core.version for s in servers] == [1, 1]
            now = fetch_weights(job.cluster.servers, plan)
            for name in host:  # what came with the answer is what the shards hold after the push
                np.testing.assert_array_equal(host[name], now[name])
                assert not np.array_equal(host[name], before[name])
            replies, versions = client.push_pull(0, grads, host)  # the same clock again: a retried push
            assert {r.outcome for r in replies} == {"duplicate"} and versions == [1, 1]
            assert [s.core.version for s in servers] == [1, 1]
        finally:
            client.close()


@contextlib.contextmanager
def _two_sync_workers(link: str, *more: str):
    """Two workers of a sync job on two shards, worker 0 with a stop event and clock 0's weights pulled:
    (the shards, the stop, worker 0, worker 1, worker 0's host arrays, a gradient)."""
    job = _job(link, "sync", 2, *more)
    with shards(job) as (job, servers):
        stop = threading.Event()
        first, second = _client(job, 0, stop=stop), _client(job, 1)
        try:
            host, grads = _arrays(first.plan), _arrays(first.plan, 0.01)
            first.pull(0, host)
            yield servers, stop, first, second, host, grads
        finally:
            first.close()
            second.close()


@pytest.mark.parametrize("link", LINKS)
def test_under_sync_the_answer_waits_for_the_round_and_a_stop_cuts_only_that_wait(link):
    with _two_sync_workers(link) as (servers, stop, first, second, host, grads):
        with futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(first.push_pull, 0, grads, host)
            wait_for(lambda: all(s.core.round.bases for s in servers), 30, "worker 0's push in both rounds")
            assert not pending.done()  # the round has not closed: no weights yet
            second.push(0, grads)
            replies, versions = pending.result(timeout=30)
        assert versions == [1, 1] and {r.outcome for r in replies} == {"accumulated"}
        now = fetch_weights(first.addresses, first.plan)
        for name in host:
            np.testing.assert_array_equal(host[name], now[name])

        with futures.ThreadPoolExecutor(1) as pool:  # the next round waits for worker 1, which is stopping
            pending = pool.submit(first.push_pull, 1, grads, host)
            wait_for(lambda: all(s.core.round.bases for s in servers), 30, "worker 0's second push")
            stop.set()
            replies, versions = pending.result(timeout=20)
        assert versions is None  # cut while it waited for the weights...
        assert {r.outcome for r in replies} == {"accumulated"}  # ...after the shards had its push
        assert [s.core.round.bases for s in servers] == [[1], [1]]


@pytest.mark.parametrize("link", LINKS)
def test_a_stop_that_came_while_the_worker_computed_cuts_its_next_wait_for_the_weights(link):
    """The defect: a sync worker asked to stop while it computed (its client's watcher found no pull to cut) then
    pushed its step and waited for a round its paused peer would never close, until the launcher killed it (a
    launch stopped by SIGINT took 6.9 s, and lost that worker's clean exit).  Worker 1 keeps its place in the
    round here (a long lease), so only a cut wait lets the push's call return."""
    with _two_sync_workers(link, "cluster.lease_seconds=120") as (servers, stop, first, second, host, grads):
        stop.set()  # ... while it computes its step: nothing to cut yet
        wait_for(
            lambda: not any(t.name == "ps-stop" for t in threading.enumerate()),
            10,
            "the client's stop watcher to have looked for a pull",
        )
        with futures.ThreadPoolExecutor(1) as pool:
            replies, versions = pool.submit(first.push_pull, 0, grads, host).result(timeout=20)
        assert versions is None and {r.outcome for r in replies} == {"accumulated"}  # pushed, not waited
        assert [s.core.round.bases for s in servers] == [[0], [0]]


@pytest.mark.parametrize("link", LINKS)
def test_links_cut_a_moment_before_a_push_and_pull_began_cut_its_wait_for_the_weights(link):
    """The defect: the stop came after the client had looked at it and before the link began the push and pull;
    the watcher cut the links, which had nothing in flight yet and forgot it, and the push then waited for a round
    the paused peer would never close (psgd launch stopped by SIGINT took 7 s in about one run of fifteen)."""
    with _two_sync_workers(link, "cluster.lease_seconds=120") as (servers, stop, first, second, host, grads):
        for each in first.links:  # what the watcher does, the client's own look at its stop behind it
            each.interrupt()
        with futures.ThreadPoolExecutor(1) as pool:
            replies, versions = pool.submit(first.push_pull, 0, grads, host).result(timeout=20)
        assert versions is None and {r.outcome for r in replies} == {"accumulated"}
        assert [s.core.round.bases for s in servers] == [[0], [0]]


@pytest.mark.slow
@pytest.mark.parametrize("link", LINKS)
def test_a_sync_worker_pulls_on_its_own_only_for_its_first_step(link, monkeypatch):
    """The defect: two round trips a step (a pull, then a push) where one does.  Under async a worker still pulls
    each step once its push is answered: weights read then are fresher than those read with the push."""
    pulls = []
    original = PSClient.pull
    monkeypatch.setattr(
        PSClient, "pull", lambda self, clock, *a, **k: pulls.append(clock) or original(self, clock, *a, **k)
    )
    for policy in ("sync", "async"):
        pulls.clear()
        job = _job(link, policy, 1)
        with shards(job) as (job, servers):
            result = run_worker(job, 0, job.cluster.servers, progress=False, evaluate_every=0)
            assert result.steps > 20 and [s.core.version for s in servers] == [result.steps] * 2
        # under sync, cuts (the default) add one pull of the last round's weights before it leaves (settle)
        assert pulls == ([0, result.steps] if policy == "sync" else list(range(result.steps))), policy


@pytest.mark.parametrize("link", LINKS)
def test_a_stop_never_cuts_a_push_in_flight(link):
    """Seen in test_reliability's SIGTERMed worker (async): the worker was asked to stop just as its pull ended and
    its next push began; the stop, meant to end a pull that may wait for ever, shut the data connection the push
    was on, so the worker counted the push as failed although the shard had applied it.  Here the shard holds the
    push until the stop has come."""
    job = _job(link, "async", 1)
    with shards(job) as (job, servers):
        stop, entered, release = threading.Event(), threading.Event(), threading.Event()
        client = _client(job, 0, stop=stop)
        core = servers[0].core
        push = core.push

        def held(*args, **kwargs):
            entered.set()
            release.wait(10)
            return push(*args, **kwargs)

        core.push = held
        try:
            plan = client.plan
            client.pull(0, _arrays(plan))
            with futures.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(client.push, 0, _arrays(plan, 0.01))
                assert entered.wait(30), "the push did not reach shard 0"
                stop.set()
                for one in client.links:  # what the stop does to a pull in flight, now, whatever the timing
                    one.interrupt()
                release.set()
                replies = pending.result(timeout=30)
            assert [r.outcome for r in replies] == ["applied", "applied"]
            assert [s.core.version for s in servers] == [1, 1]
        finally:
            core.push = push
            client.close()
