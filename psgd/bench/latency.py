"""The fixed cost of a small step, on each link, beside a bare round trip on the same kind of socket, in one run.

A step of a small model moves few bytes; what it costs is the round trip and the work around it.  First, as users
run it: ``psgd train`` and ``psgd launch --policy sync --workers 1 --shards 1`` of the digits MLP with one hidden
layer of 64, in turns, and the launch's steps/s against one process's, beside the floor (:func:`floor`: the same
step split across two processes that share only the weights and the gradient in memory and spin for each other,
the most any parameter server reaches on the machine).  Then, for a model of ``size`` bytes (one
worker, one psgd-server shard process, async), on each link:

- a step as two round trips (a pull, then a push) and as one (a push whose answer brings the next weights);
- the shard's own share of a step: the CPU time its data port's thread spent from a request's header in to its
  answer sent, as the shard counts it (``data_cpu_seconds`` in its status; gRPC calls are not counted there);
- a bare round trip of a request-sized message over loopback TCP between two processes, the floor any step over
  a socket pays (the shared-memory link's requests and answers travel on a socket too), with both ends sleeping
  in the kernel until the bytes come and with both watching for them first; the steps are measured as psgd launch
  runs one worker and one shard on this machine (``[cluster] busy_poll_us``), and set beside the bare round trip
  of the same kind;
- the rest: the step less the shard's share and the bare round trip: the worker's own work, and the waits for a
  core and for wake-ups.

    psgd bench comm --parts latency --json latency.json
"""

from __future__ import annotations

import json
import mmap
import multiprocessing
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from psgd.bench.blob import BlobCluster, median
from psgd.wire import protocol

#: The digits MLP with one hidden layer of 64 (64-64-10 with biases: 4,810 float32 values), and a tiny model.
SIZES = (64, 19_240)
LINKS = ("tcp", "shm", "grpc")


def _echo(server: socket.socket, watch: float) -> None:
    conn, _ = server.accept()
    protocol.tune(conn)
    buf, spin = bytearray(protocol.REQUEST.size), protocol.Spin(conn, watch)
    while True:
        try:
            spin.read(lambda: protocol.recv_exact(conn, memoryview(buf)))
        except protocol.WireError:
            return
        conn.sendall(buf)


def bare_tcp_rtt(repeats: int = 2000, watch: float = 0.0) -> float:
    """Median seconds of a request-sized message to another process over loopback TCP and back, each end watching
    for the other's bytes for up to ``watch`` seconds before it sleeps (``[cluster] busy_poll_us``)."""
    server = socket.create_server(("127.0.0.1", 0))
    proc = multiprocessing.get_context("fork").Process(target=_echo, args=(server, watch), daemon=True)
    proc.start()
    try:
        with socket.create_connection(("127.0.0.1", server.getsockname()[1])) as conn:
            protocol.tune(conn)
            message, back = b"x" * protocol.REQUEST.size, memoryview(bytearray(protocol.REQUEST.size))
            times, spin = [], protocol.Spin(conn, watch)
            for i in range(repeats + 200):  # the first 200 warm up
                began = time.perf_counter()
                conn.sendall(message)
                spin.read(lambda: protocol.recv_exact(conn, back))
                if i >= 200:
                    times.append(time.perf_counter() - began)
        return median(times)
    finally:
        server.close()
        proc.join(10)


def bare_grpc_rtt(repeats: int = 2000) -> float:
    """Median seconds of a 100-byte unary call to a generic-handler echo server in another process."""
    code = (
        "import grpc, sys\nfrom concurrent import futures\n"
        "echo = grpc.unary_unary_rpc_method_handler(lambda r, c: r)\n"
        "h = grpc.method_handlers_generic_handler('b.Echo', {'E': echo})\n"
        "s = grpc.server(futures.ThreadPoolExecutor(4)); s.add_generic_rpc_handlers((h,))\n"
        "p = s.add_insecure_port('127.0.0.1:0'); s.start(); print(p, flush=True); sys.stdin.read()\n"
    )
    import grpc

    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            echo = ch.unary_unary("/b.Echo/E")
            payload = b"x" * 100
            for _ in range(200):
                echo(payload, timeout=10)
            times = []
            for _ in range(repeats):
                a = time.perf_counter()
                echo(payload, timeout=10)
                times.append(time.perf_counter() - a)
        return median(times)
    finally:
        proc.stdin.close()
        proc.wait(10)


def _shard_seconds(client) -> tuple[float, int]:
    counters = json.loads(client.status()[0].counters_json)
    return counters.get("data_cpu_seconds", 0.0), counters.get("data_requests", 0)


def _timed(steps: int, step: Callable[[int], None], start: int) -> list[float]:
    times = []
    for clock in range(start, start + steps):
        began = time.perf_counter()
        step(clock)
        times.append(time.perf_counter() - began)
    return times


def step_costs(size: int, link: str, steps: int, tmp: str, busy_poll_us: int = 0) -> dict:
    """A step of a ``size``-byte model over ``link``, as two round trips and as one, with the shard's share; the
    shard and the worker watch for answers as ``[cluster] busy_poll_us`` says."""
    with BlobCluster(size, tmp=tmp, busy_poll_us=busy_poll_us) as cluster:
        client = cluster.client(0, link)
        try:
            host = {"blob": np.empty(cluster.elems, dtype=np.float32)}
            grads = {"blob": np.full(cluster.elems, 1e-3, dtype=np.float32)}
            clock = client.clock  # the clock it registered at (cluster.client registers it)
            client.pull(clock, host)

            def two(c: int) -> None:
                client.pull(c, host)
                client.push(c, grads)

            def one(c: int) -> None:
                if client.push_pull(c, grads, host)[1] is None:
                    raise SystemExit(f"the {link} link's push and pull brought no weights")

            _timed(100, one, clock)  # warm-up
            clock += 100
            phases = {}
            for name, fn in (("two", two), ("one", one)):
                seconds, _ = _shard_seconds(client)
                times = _timed(steps, fn, clock)
                clock += steps
                phases[name] = (median(times), (_shard_seconds(client)[0] - seconds) / steps)
            client.done()
        finally:
            client.close()
    (two_s, two_shard), (one_s, one_shard) = phases["two"], phases["one"]
    counted = link != "grpc"
    return {
        "size_bytes": size,
        "link": link,
        "two_round_trips_s": two_s,
        "one_round_trip_s": one_s,
        "shard_s": one_shard if counted else None,
        "shard_two_s": two_shard if counted else None,
    }


def _applier(memory: mmap.mmap, n: int, lr: float, deadline: float) -> None:
    """The floor's other process: wait (spinning) for each gradient, apply it, say so; until told to stop (a
    negative step) or the deadline, so that it never outlives a parent that died."""
    seq, weights, grads = _floor_arrays(memory, n)
    last = 0
    while True:
        while seq[0] == last:
            if time.monotonic() > deadline:
                return
        last = int(seq[0])
        if last < 0:
            return
        weights -= lr * grads
        seq[1] = last


def _floor_arrays(memory: mmap.mmap, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step asked and the step applied, the weights and the gradient, in ``memory``."""
    return (
        np.ndarray((2,), np.int64, memory, 0),
        np.ndarray((n,), np.float32, memory, 16),
        np.ndarray((n,), np.float32, memory, 16 + 4 * n),
    )


def floor(steps: int = 4000, turns: int = 3) -> dict:
    """What no parameter server on this machine can beat: the digits MLP 64's step (batch 32, SGD) in one process,
    and split across two, the gradient in one and the update in the other, sharing nothing but the weights and the
    gradient in shared memory and spinning for each other (no sockets, no checks, no framework), in ``turns``
    alternating turns of ``steps``; their steps/s and the split's against one process's (medians)."""
    from threadpoolctl import threadpool_limits

    from psgd.model.nets import MLP

    model = MLP((64,), 10, hidden=[64])
    params = model.init(0)
    names = list(params)
    n = sum(params[k].size for k in names)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 64)).astype(np.float32), rng.integers(0, 10, 32)

    def views(flat: np.ndarray) -> dict[str, np.ndarray]:
        out, at = {}, 0
        for k in names:
            out[k] = flat[at : at + params[k].size].reshape(params[k].shape)
            at += params[k].size
        return out

    def alone() -> float:
        flat = np.concatenate([params[k].ravel() for k in names])
        grads = np.empty_like(flat)
        p, g = views(flat), views(grads)
        began = time.perf_counter()
        for _ in range(steps):
            for k, v in model.loss_and_grads(p, x, y)[1].items():
                g[k][...] = v
            flat -= 0.01 * grads
        return steps / (time.perf_counter() - began)

    def split() -> float:
        memory = mmap.mmap(-1, 16 + 8 * n)  # anonymous and shared: the forked process maps the same pages
        seq, weights, grads = _floor_arrays(memory, n)
        weights[:] = np.concatenate([params[k].ravel() for k in names])
        other = multiprocessing.get_context("fork").Process(
            target=_applier, daemon=True, args=(memory, n, 0.01, time.monotonic() + 600)
        )
        other.start()
        try:
            local = np.empty(n, np.float32)
            p, g = views(local), views(grads)
            began = time.perf_counter()
            for step in range(1, steps + 1):
                np.copyto(local, weights)
                for k, v in model.loss_and_grads(p, x, y)[1].items():
                    g[k][...] = v
                seq[0] = step
                while seq[1] != step:
                    pass
            return steps / (time.perf_counter() - began)
        finally:
            seq[0] = -1
            other.join(10)
            del seq, weights, grads
            memory.close()

    rates: dict[str, list[float]] = {"alone": [], "split": []}
    with threadpool_limits(limits=1):  # as psgd launch gives each of two processes on 2 cores
        for _ in range(turns):
            rates["alone"].append(alone())
            rates["split"].append(split())
    return {
        "one_process_steps_per_s": rates["alone"],
        "two_processes_steps_per_s": rates["split"],
        "split_over_one": median(rates["split"]) / median(rates["alone"]),
    }


def as_users_run_it(rounds: int, tmp: str, say: Callable[[str], None]) -> dict:
    """``rounds`` turns of one process and a 1-worker, 1-shard launch of the digits MLP 64 (20 epochs each, as
    ``psgd bench scaling`` runs them): each one's steps/s, and the launch's against one process's (medians)."""
    from pathlib import Path

    from psgd.bench.scaling.grid import Run
    from psgd.bench.scaling.runner import execute

    rates: dict[str, list[float]] = {"single": [], "sync": []}
    for turn in range(rounds):
        for kind in rates:
            record = execute(Run("64", kind), 20, 300, Path(tmp) / f"as-users-{kind}-{turn}")
            if "error" in record:
                raise SystemExit(f"{record['command']}: {record['error']}")
            rates[kind].append(record["steps_per_s"])
    single, launch = median(rates["single"]), median(rates["sync"])
    say(
        f"\nas users run it (digits MLP 64, {rounds} turns): psgd train {single:,.0f} steps/s, psgd launch "
        f"--workers 1 --shards 1 {launch:,.0f} steps/s: {launch / single:.2f} of one process"
    )
    return {
        "single_steps_per_s": rates["single"],
        "launch_steps_per_s": rates["sync"],
        "launch_over_single": launch / single,
    }


def measure(steps: int, tmp: str, say: Callable[[str], None], sizes=SIZES, links=LINKS, rounds: int = 3) -> dict:
    """One process and a launch as users run them, then every size and link beside the bare round trips measured in
    the same run."""
    from psgd.launcher.layout import busy_poll

    users = as_users_run_it(rounds, tmp, say)
    limit = floor()
    say(
        f"the floor: that step in one process {median(limit['one_process_steps_per_s']):,.0f} steps/s; split "
        f"across two (the gradient in one, the update in the other) that share only the weights and the gradient "
        f"in shared memory and spin for each other, {median(limit['two_processes_steps_per_s']):,.0f}: "
        f"{limit['split_over_one']:.2f} of one process, the most any parameter server reaches here"
    )
    watch = busy_poll(2)[0]  # what psgd launch chooses for one worker and one shard on this machine
    bare, watched = bare_tcp_rtt(max(steps, 1000)), bare_tcp_rtt(max(steps, 1000), watch / 1e6)
    bare_grpc = bare_grpc_rtt(max(steps, 1000))
    say(
        f"\na small step's fixed cost: a bare round trip over loopback TCP {bare * 1e6:.0f} us sleeping, "
        f"{watched * 1e6:.0f} us watching (busy_poll_us = {watch}, as psgd launch chooses for one worker and one "
        f"shard here), a bare gRPC call {bare_grpc * 1e6:.0f} us"
    )
    rows = []
    for size in sizes:
        for link in links:
            row = step_costs(size, link, steps, tmp, watch)
            bare_link = row["bare_s"] = bare_grpc if link == "grpc" else watched
            row["rest_s"] = row["one_round_trip_s"] - (row["shard_s"] or 0.0) - bare_link
            rows.append(row)
            shard = f"shard CPU {row['shard_s'] * 1e6:4.0f} us, " if row["shard_s"] is not None else ""
            say(
                f"  {size:>7,} B over {link:4s}: pull then push {row['two_round_trips_s'] * 1e6:5.0f} us, push and "
                f"pull {row['one_round_trip_s'] * 1e6:5.0f} us = {shard}bare round trip {bare_link * 1e6:4.0f} us, "
                f"the rest {row['rest_s'] * 1e6:4.0f} us"
            )
    return {
        **users,
        "floor": limit,
        "busy_poll_us": watch,
        "bare_tcp_rtt_s": bare,
        "bare_tcp_watched_rtt_s": watched,
        "bare_grpc_rtt_s": bare_grpc,
        "steps": rows,
    }
