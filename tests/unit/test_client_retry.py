"""Which failures a worker retries: a shard restarting cancels calls in flight; a worker that stops does not
retry the calls it cancelled itself."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import make_job

from psgd.config import Deadlines
from psgd.errors import Code
from psgd.job import build_job
from psgd.link import LinkError
from psgd.partition import PartitionPlan
from psgd.worker.client import PSClient, PSError


def client(stop: threading.Event | None = None) -> PSClient:
    job = make_job("cluster.shards=1")
    plan = PartitionPlan(build_job(job).model.specs(), 1, job.cluster.links.slice_bytes)
    return PSClient(["127.0.0.1:1"], plan, 0, deadlines=Deadlines(request_timeout=5), config=job, stop=stop)


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


def registering(c: PSClient, gate: threading.Event | None = None) -> list[int]:
    """Make ``c``'s link to shard 0 answer registrations as the shard would (after ``gate``, when given)."""
    from psgd.proto import ps_pb2

    keys: list[int] = []

    def register(request) -> ps_pb2.RegisterReply:
        if gate is not None:
            assert gate.wait(5), "the test never let the registration through"
        keys.append(len(keys) + 1)  # each registration of a restarted shard makes a new key
        return ps_pb2.RegisterReply(
            shard=0, num_shards=1, num_workers=c.identity["workers"], version=30, lease_seconds=10.0, clock=30
        )

    c.links[0].register = register
    return keys


def denied() -> LinkError:
    return LinkError(
        Code.PERMISSION_DENIED,
        "worker 0 is registered with shard 0 by host pid 1: a call as worker "
        "0 must carry the key that process's registration got; this one does not",
    )


def test_a_call_refused_because_the_heartbeat_registered_meanwhile_is_retried():
    """Seen in the chaos suite (seed 162): a shard restarted from a checkpoint; the worker's heartbeat registered
    again (a new key) while its push-and-pull, carrying the old key, was on the way; the shard refused the push
    with PERMISSION_DENIED and the worker exited 1.  The refused call changed nothing: sent again, with the new
    key, it is applied once."""
    with client() as c:
        keys = registering(c)
        calls = []

        def call():
            calls.append(1)
            if len(calls) == 1:  # on the way: the heartbeat thread hears NOT_REGISTERED and registers again
                beat = threading.Thread(target=c._rejoin, args=(0,))
                beat.start()
                beat.join(5)
                raise denied()
            return "answered"

        assert c.retrying(0, "push and pull (clock 31)", call) == "answered"
        assert len(calls) == 2 and keys == [1]


def test_a_call_refused_while_a_registration_is_on_the_way_is_retried():
    """The same race, with the new registration admitted by the shard but its answer not yet back."""
    with client() as c:
        gate = threading.Event()
        keys = registering(c, gate)
        beat = threading.Thread(target=c._rejoin, args=(0,))
        calls = []

        def call():
            calls.append(1)
            if len(calls) == 1:
                beat.start()
                deadline = time.monotonic() + 5
                while not c._registering[0] and time.monotonic() < deadline:
                    time.sleep(0.001)  # polling, with a deadline, until the registration is on the way
                raise denied()
            gate.set()
            beat.join(5)
            return "answered"

        assert c.retrying(0, "push (clock 31)", call) == "answered"
        assert len(calls) == 2 and keys == [1]


def test_a_call_refused_for_another_processs_key_is_not_retried():
    """No registration of this process changed: the rank is someone else's, and retrying would not help."""
    with client() as c:
        registering(c)
        calls = []

        def call():
            calls.append(1)
            raise denied()

        with pytest.raises(PSError, match="PERMISSION_DENIED"):
            c.retrying(0, "push (clock 31)", call)
        assert len(calls) == 1


def test_a_killed_holder_not_yet_reaped_is_not_taken_for_alive():
    """Found by the chaos suite (seed 8, run 19): a worker SIGKILLed and started again at once gave up, refused for
    "pid N runs on this host": the killed process was a zombie its parent had not reaped yet, which still answers
    kill(pid, 0)."""
    import signal
    import socket
    import subprocess
    from pathlib import Path

    from psgd.job import alive_here

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert alive_here(socket.gethostname(), child.pid)
        child.send_signal(signal.SIGKILL)
        stat = Path(f"/proc/{child.pid}/stat")
        deadline = time.monotonic() + 10
        while stat.read_bytes().rpartition(b")")[2].split()[0] != b"Z" and time.monotonic() < deadline:
            time.sleep(0.01)  # polling until it is a zombie, with a deadline
        assert not alive_here(socket.gethostname(), child.pid)
    finally:
        child.kill()
        child.wait()


def test_waiting_for_a_shard_pair_leaves_no_thread_watching_a_channel(monkeypatch):
    """Seen as PytestUnhandledThreadExceptionWarning in a replica test: the wait for each shard pair watched every
    channel's state from a thread of gRPC's (channel_ready_future) and closed the replica's channel as soon as one
    of the pair answered.  That thread lives on for up to 0.2 s; one that looked at the closed channel then died
    with "ValueError: Cannot monitor channel state: Channel closed!".  Made to happen: each watching thread's next
    look, once its channel is ready, waits until the wait for the shards has returned.  The wait now asks with
    plain connections, so no thread of gRPC's watches any of its channels."""
    from concurrent import futures as cf

    import grpc
    import grpc._channel as grpc_channel

    from psgd.config import Recovery

    returned, died, watchers = threading.Event(), [], []
    real_poll = grpc_channel._poll_connectivity
    ready = grpc_channel.cygrpc.ConnectivityState.ready

    class Held:  # a channel as the watching thread sees it: its look after "ready" waits for the wait to return
        def __init__(self, channel):
            self.channel = channel

        def check_connectivity_state(self, try_to_connect):
            return self.channel.check_connectivity_state(try_to_connect)

        def watch_connectivity_state(self, last, deadline):
            if last == ready:
                returned.wait(10)
            return self.channel.watch_connectivity_state(last, deadline)

    def poll(state, channel, try_to_connect):
        watchers.append(threading.current_thread())
        real_poll(state, Held(channel), try_to_connect)

    monkeypatch.setattr(grpc_channel, "_poll_connectivity", poll)
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(repr(args.exc_value)))
    servers, addresses = [], []
    for _ in range(2):  # a pair: either may answer first
        server = grpc.server(cf.ThreadPoolExecutor(max_workers=1))
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    job = make_job("cluster.shards=1")
    plan = PartitionPlan(build_job(job).model.specs(), 1, job.cluster.links.slice_bytes)
    try:
        with PSClient(addresses[:1], plan, 0, config=job, recovery=Recovery(replica_servers=addresses[1:])) as c:
            c.wait_ready(10)
            returned.set()
            for thread in watchers:
                thread.join(10)
        assert died == [] and watchers == [], died
    finally:
        returned.set()
        for server in servers:
            server.stop(None)
