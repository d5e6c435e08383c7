"""Which failures a worker retries: a shard restarting cancels calls in flight; a worker that stops does not
retry the calls it cancelled itself."""

from __future__ import annotations

import threading

import pytest

from helpers import make_job
from psgd.partition import PartitionPlan
from psgd.job import build_job
from psgd.link import LinkError
from psgd.worker.client import PSClient, PSError
from psgd.errors import Code


def client(stop: threading.Event | None = None) -> PSClient:
    job = make_job("cluster.shards=1")
    plan = PartitionPlan(build_job(job).model.specs(), 1, job.cluster.slice_bytes)
    return PSClient(["127.0.0.1:1"], plan, 0, request_timeout=5, config=job, stop=stop)


def failing(times: int, code: Code):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= times:
            raise LinkError(code, code.name.lower())
        return "answered"
    return call, calls


def test_a_call_cancelled_by_a_restarting_shard_is_retried():
    """Seen in the chaos suite: SIGTERM to a shard (to restart it) cancelled a push in flight, and the worker
    gave up with CANCELLED."""
    with client() as c:
        call, calls = failing(2, Code.CANCELLED)
        assert c.retrying(0, "push (clock 142)", call) == "answered"
        assert len(calls) == 3


def test_a_worker_that_stops_does_not_retry_the_calls_it_cancelled():
    stop = threading.Event()
    stop.set()
    with client(stop) as c:
        call, calls = failing(5, Code.CANCELLED)
        with pytest.raises(PSError, match="CANCELLED"):
            c.retrying(0, "pull (clock 3)", call)
        assert len(calls) == 1


def test_permanent_errors_are_not_retried():
    with client() as c:
        call, calls = failing(1, Code.INVALID_ARGUMENT)
        with pytest.raises(PSError, match="INVALID_ARGUMENT"):
            c.retrying(0, "push (clock 1)", call)
        assert len(calls) == 1


def test_a_push_without_a_free_receive_buffer_is_retried():
    """A worker exited 1 on RESOURCE_EXHAUSTED ("no receive buffer free within 15.0s"): the push was not
    applied, and a buffer frees up once the pushes ahead of it are in."""
    with client() as c:
        call, calls = failing(2, Code.RESOURCE_EXHAUSTED)
        assert c.retrying(0, "push (clock 7)", call) == "answered"
        assert len(calls) == 3


def test_a_stopping_worker_retries_nothing():
    """A worker in a sync round retried its interrupted pull after SIGTERM, and the retry waited 60 s."""
    stop = threading.Event()
    stop.set()
    with client(stop) as c:
        for code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
            call, calls = failing(5, code)
            with pytest.raises(PSError, match="the worker is stopping, so it did not retry"):
                c.retrying(0, "pull (clock 3)", call)
            assert len(calls) == 1


def test_heartbeats_stop_before_the_worker_says_it_is_done():
    """Seen in test_ps_processes: a heartbeat sent after Done was refused (a done worker holds no lease), and the
    worker registered again, so the shard listed it as live, not done, after it had exited."""
    import time

    with client() as c:
        told, beats_after, rejoined = threading.Event(), [], []

        def heartbeat(clock: int, timeout: float) -> None:
            if told.is_set():
                beats_after.append(clock)
                raise LinkError(Code.FAILED_PRECONDITION, "worker 0 is done", reason="NOT_REGISTERED")

        c.links[0].heartbeat = heartbeat
        c.links[0].done = lambda clock: told.set()
        c._register_one = rejoined.append
        c.lease_seconds = 0.03  # a heartbeat every 10 ms
        c.start_heartbeats()
        c.done()
        deadline = time.monotonic() + 1.0
        while not beats_after and time.monotonic() < deadline:
            time.sleep(0.01)  # polling for a heartbeat after Done, with a deadline: there must be none
        assert beats_after == [] and rejoined == []
