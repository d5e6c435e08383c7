"""What a step's parts cost on this machine, measured as psgd runs them, for the simulator (:class:`Costs`).

- the gradient: ``psgd train`` of the model (as ``psgd bench scaling`` starts it), one step's seconds;
- what busy processes get from the cores: two and four ``psgd train`` at once, their steps/s against one alone's;
- a worker's and a shard's CPU a step, from /proc, in three launches of one worker: one shard under sync, two
  under sync, one under async (their connections sleeping, so that CPU is work), and the step's wait beyond them;
  and the first and the third again with their connections watching: the CPU a watch saves a round trip;
- what a byte adds to a request: one worker and one ``psgd-server`` process
  (:func:`psgd.bench.latency.step_costs`) at 64 bytes and at 8 MiB (the model's size if larger), a step as one
  round trip (sync's push whose answer brings the weights) and as two (a push, then a pull), with the shard's own
  CPU counted by the shard, and a bare round trip with both ends watching;
- all-reduce: psgd's MPI all-reduce of 64 bytes and of the model's size between two ranks (when the mpi extra
  and an ``mpiexec`` are there).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

from psgd.bench.simulate.job import Costs, Layout
from psgd.wire.protocol import BUSY_POLL_US

#: sizes a request's costs are measured at: a tiny one, then the model's or this, whichever is larger (a byte's
#: cost where the bytes no longer fit in the caches, as in the models a prediction is for)
SMALL, LARGE = 64, 8 << 20
#: seconds of a launch's run its steps and its processes' CPU are measured over
WINDOW = 4.0


def gradient_seconds(width: int, tmp: Path) -> float:
    """Seconds of one step of ``psgd train`` of the digits MLP of one hidden layer of ``width``."""
    from psgd.bench.scaling.grid import Run
    from psgd.bench.scaling.runner import execute

    record = execute(Run(str(width), "single"), 200, 300, tmp / f"train-{width}")  # about 9,000 steps
    if "error" in record:
        raise SystemExit(f"{record['command']}: {record['error']}")
    return 1.0 / record["steps_per_s"]


def cores_for(width: int, busy: int, epochs: int = 2000) -> float:
    """What ``busy`` busy processes get from this machine's cores together, in cores: that many ``psgd train``
    started at once, their steps/s summed over one alone's (2 for two on two cores that do not slow each other;
    here, measured).  The runs are long (2,000 epochs, about 10 s here) so that their loops overlap whatever their
    start-ups take."""
    import json

    from psgd.bench.scaling.grid import Run
    from psgd.bench.scaling.measure import single_rates

    argv = [sys.executable, "-m", "psgd.cli.main", *Run(str(width), "single").argv(epochs), "--threads", "1"]

    def rate(out: str) -> float:
        return single_rates(json.loads(out.strip().splitlines()[-1]))["steps_per_s"]

    alone = rate(subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True).stdout)
    group = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(busy)]
    together = sum(rate(p.communicate(timeout=600)[0]) for p in group)
    return min(float(busy), together / alone)


def _cpu_seconds(run_dir: str) -> dict[str, float]:
    """CPU seconds so far of each psgd process of the launch writing into ``run_dir`` (its shards and workers),
    by role and number ("worker-0", "shard-1"), from /proc."""
    import os
    import re

    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                argv = f.read().split("\0")
            if not any(run_dir in a for a in argv) or "-m" not in argv:
                continue
            role = argv[argv.index("-m") + 1].rsplit(".", 1)[-1]
            number = re.search(r"--(?:rank|shard)\x00?(\d+)", "\0".join(argv))
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[f"{role}-{number.group(1) if number else pid}"] = (int(fields[11]) + int(fields[12])) / os.sysconf(
                "SC_CLK_TCK"
            )
        except (OSError, ValueError, IndexError):
            continue
    return out


def in_a_launch(
    width: int,
    shards: int,
    policy: str,
    workers: int = 1,
    window: float = WINDOW,
    busy_poll_us: int | None = 0,
    network=None,
) -> dict:
    """A ``psgd launch`` of ``workers`` workers and ``shards`` shards (all-reduce: ranks), its data connections
    sleeping (``busy_poll_us`` 0: what the processes use is their work), watching, or as psgd launch chooses
    (None); on ``network``'s hosts (:class:`psgd.bench.hosted.Network`) or this machine: each process's CPU per step
    of the job over ``window`` seconds of its run, the job's steps/s over that window and the busy_poll_us it ran
    with (all-reduce: 0)."""
    import glob
    import shutil

    from psgd.bench.scaling.grid import Run

    run = tempfile.mkdtemp(prefix="psgd-sim-launch-")
    argv = Run(str(width), policy, workers, shards=shards).argv(2000, Path(run))
    if busy_poll_us is not None and policy != "allreduce":
        argv += ["--set", f"cluster.busy_poll_us={busy_poll_us}"]
    if network is not None:
        from psgd.bench.hosted import launch_argv

        command = launch_argv(network, Path(run) / "hosts", argv)
    else:
        command = [sys.executable, "-m", "psgd.cli.main", *argv]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    records, each = ("allreduce.jsonl", workers) if policy == "allreduce" else ("worker-*.jsonl", 1)

    def steps() -> int:  # all workers' steps so far (all-reduce: rank 0's, each a step of every rank)
        return each * sum(
            sum(1 for line in open(f) if '"event": "step"' in line) for f in glob.glob(f"{run}/{records}")
        )

    try:
        deadline = time.monotonic() + 120
        while steps() < 2000:  # the job is under way (and warm) once its workers have taken this many steps
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"psgd launch for the costs did not get going: {' '.join(command)}")
            time.sleep(0.2)  # polling the workers' step records, with a deadline
        before, n0, t0 = _cpu_seconds(run), steps(), time.monotonic()
        time.sleep(window)  # the measuring window
        after, n1, t1 = _cpu_seconds(run), steps(), time.monotonic()
        job = (Path(run) / "job.toml").read_text()
    finally:
        from psgd.bench.scaling.runner import stop

        stop(proc)  # the launch and what it started
        shutil.rmtree(run, ignore_errors=True)
    n = n1 - n0
    return {
        "steps_per_s": n / (t1 - t0),
        "busy_poll_us": tomllib.loads(job)["cluster"].get("busy_poll_us", 0),
        **{k: (after[k] - before[k]) / n for k in after if k in before},
    }


def as_in(costs: Costs, launch: dict, layout: Layout) -> Costs:
    """The costs with each process's parts scaled to the CPU it spent a step in ``launch`` (:func:`in_a_launch` of a
    job of ``layout``, its connections sleeping): the job's own costs, crowding and all, for checking the
    simulation's structure apart from its calibration.  The cores are what the machine has: the CPU is measured."""
    import statistics

    sync, part = layout.policy == "sync", layout.model_bytes / layout.shards
    worker = statistics.mean(v for k, v in launch.items() if k.startswith("worker-")) * layout.workers
    shard = statistics.mean(v for k, v in launch.items() if k.startswith("server-")) / (1 if sync else 2)
    client = costs.worker_joint if sync else 2 * costs.worker_request
    f = worker / (costs.compute + costs.worker_step + layout.shards * (client + costs.worker_per_byte * part))
    g = shard / (
        costs.joint_request + costs.joint_per_byte * part if sync else costs.shard_request + costs.shard_per_byte * part
    )
    return dataclasses.replace(
        costs,
        compute=costs.compute * f,
        worker_step=costs.worker_step * f,
        worker_joint=costs.worker_joint * f,
        worker_request=costs.worker_request * f,
        worker_per_byte=costs.worker_per_byte * f,
        shard_request=costs.shard_request * g,
        shard_per_byte=costs.shard_per_byte * g,
        joint_request=costs.joint_request * g,
        joint_per_byte=costs.joint_per_byte * g,
        cores_four=0.0,
    )


def request_costs(size: int, tmp: str, steps: int, busy_poll_us: int) -> dict:
    """Per-request CPU of a shard and a worker, fixed and per byte, for a push and pull of their own and for a
    joint push and pull, and the round trip's wait, from one worker and one shard at 64 bytes and ``size``."""
    from psgd.bench.latency import bare_tcp_rtt, step_costs

    small, big = (step_costs(n, "tcp", steps, tmp, busy_poll_us) for n in (SMALL, size))
    wake = bare_tcp_rtt(max(steps, 1000), busy_poll_us / 1e6)
    watched = bare_tcp_rtt(max(steps, 1000), BUSY_POLL_US / 1e6)
    span = max(size - SMALL, 1)

    def line(at_small: float, at_big: float) -> tuple[float, float]:  # fixed part and per byte, neither below 0
        per_byte = max((at_big - at_small) / span, 0.0)
        return max(at_small - per_byte * SMALL, 0.0), per_byte

    shard = line(small["shard_two_s"] / 2, big["shard_two_s"] / 2)  # a pull and a push of their own: half each
    joint = line(small["shard_s"], big["shard_s"])
    # the worker's own share of a joint round trip: the step less the shard's CPU and the bare round trip
    worker = line(small["one_round_trip_s"] - small["shard_s"] - wake, big["one_round_trip_s"] - big["shard_s"] - wake)
    return {
        "shard_request": shard[0],
        "shard_per_byte": shard[1],
        "joint_request": joint[0],
        "joint_per_byte": joint[1],
        "worker_request": worker[0],
        "worker_per_byte": worker[1],
        "wake": wake,
        "wake_watching": watched,
        "measured": {"small": small, "big": big},
    }


def ring_costs(model_bytes: int, repeats: int = 20) -> tuple[float, float] | str:
    """(a ring step's fixed seconds, its bytes/s) from psgd's MPI all-reduce between two ranks at two sizes; or why
    it could not be measured."""
    from psgd.bench.allreduce import run_mpi
    from psgd.bench.scaling.runner import allreduce_unavailable

    why = allreduce_unavailable()
    if why:
        return why
    timed = run_mpi([SMALL, model_bytes], 2, repeats)
    small, big = timed[SMALL]["psgd_s"], timed[model_bytes]["psgd_s"]
    hop = small / 2  # two ranks: two ring steps
    return hop, model_bytes / max(big - small, 1e-9)  # two steps of half the bytes each: the bytes once


def measure(width: int, model_bytes: int, say: Callable[[str], None], steps: int = 400) -> tuple[Costs, dict]:
    """The costs of the digits MLP of hidden ``width`` (``model_bytes`` of weights) on this machine, and the
    figures they came from.  What a worker and a shard spend on a step is taken from three launches of one worker
    (1 shard under sync, 2 under sync, 1 under async; their connections sleeping, so that a process's CPU is its
    work): the processes' CPU a step; what a byte adds, from one worker and one shard at two sizes."""
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="psgd-sim-") as tmp:
        compute = gradient_seconds(width, Path(tmp))
        say(f"  a gradient (psgd train, MLP {width}): {compute * 1e6:,.0f} us")
        cores, four = cores_for(width, 2), cores_for(width, 4)
        say(f"  busy processes get this machine's cores together: two {cores:.2f}, four {four:.2f}")
        req = request_costs(max(model_bytes, LARGE), tmp, steps, 0)
        launches = {
            name: in_a_launch(width, shards, policy)
            for name, shards, policy in (("sync1", 1, "sync"), ("sync2", 2, "sync"), ("async1", 1, "async"))
        }
        watched = {
            name: in_a_launch(width, 1, policy, busy_poll_us=BUSY_POLL_US)
            for name, policy in (("sync1", "sync"), ("async1", "async"))
        }
        ring = ring_costs(model_bytes)
    m, w_byte, s_byte, j_byte = model_bytes, req["worker_per_byte"], req["shard_per_byte"], req["joint_per_byte"]
    w1, w2, wa = (launches[n]["worker-0"] for n in ("sync1", "sync2", "async1"))
    worker_joint = max(w2 - w1, 0.0)  # a second shard's share of a step
    worker_step = max(w1 - compute - worker_joint - w_byte * m, 0.0)
    worker_request = max((wa - compute - worker_step - w_byte * m) / 2, 0.0)
    joint_request = max(launches["sync1"]["server-0"] - j_byte * m, 0.0)
    shard_request = max((launches["async1"]["server-0"] - 2 * s_byte * m) / 2, 0.0)
    wake = max(
        1 / launches["sync1"]["steps_per_s"] - launches["sync1"]["worker-0"] - launches["sync1"]["server-0"], 0.0
    )
    say(
        f"  in a launch, a step's CPU: the worker {w1 * 1e6:.0f} us with one shard, {w2 * 1e6:.0f} with two, "
        f"{wa * 1e6:.0f} under async; the shard {launches['sync1']['server-0'] * 1e6:.0f} us (sync), "
        f"{launches['async1']['server-0'] * 1e6:.0f} (async: a push and a pull)"
    )

    # both ends watching, the same step takes less: what is left of the difference once the watch's own wait is paid
    # is CPU the sleeping ends spent going to sleep and waking (sync: a joint round trip a step; async: two of its
    # own)
    def saved(name: str, trips: int) -> float:
        gained = 1 / launches[name]["steps_per_s"] - 1 / watched[name]["steps_per_s"]
        return max(gained / trips + req["wake_watching"] - wake, 0.0)

    saves, saves_request = saved("sync1", 1), saved("async1", 2)
    say(
        f"  a round trip's wait beyond the CPU: {wake * 1e6:.0f} us sleeping, {req['wake_watching'] * 1e6:.0f} us "
        f"watching, which saves the ends {saves * 1e6:.0f} us of CPU (sync's joint round trip), "
        f"{saves_request * 1e6:.0f} us (async's own)"
    )
    if isinstance(ring, str):
        say(f"  all-reduce: not measured ({ring})")
        hop, ring_rate = 0.0, 0.0
    else:
        hop, ring_rate = ring
        say(f"  a ring step: {hop * 1e6:.0f} us + its bytes at {ring_rate / 1e9:.2f} GB/s")
    costs = Costs(
        compute=compute,
        shard_request=shard_request,
        shard_per_byte=s_byte,
        joint_request=joint_request,
        joint_per_byte=j_byte,
        worker_request=worker_request,
        worker_per_byte=w_byte,
        wake=wake,
        cores=cores,
        worker_joint=worker_joint,
        worker_step=worker_step,
        cores_four=four,
        watch_saves=saves,
        watch_saves_request=saves_request,
        wake_watching=req["wake_watching"],
        hop=hop,
        ring_rate=ring_rate,
    )
    watching = {f"{name}_watching": launch for name, launch in watched.items()}
    return costs, {
        "requests": req["measured"],
        "launches": {**launches, **watching},
        "calibrated_on": ["sync 1w 1s", "sync 1w 2s", "async 1w 1s"],
        "seconds": time.monotonic() - began,
    }
