"""Moving tensors on emulated links: pull and push through shards, and an MPI all-reduce, each process on a
host of its own whose link is shaped to a rate (:class:`psgd.bench.hosted.Network`).

Every figure is set beside what the bytes alone take on the link measured in the same network, so a ratio
near 1 means the link is the limit:

  - a parameter-server step moves the model in (pull) and the gradient out (push) over the worker's link,
    one after the other, and each shard's link carries its share of every worker's bytes
    (:func:`psgd.bench.convergence.link_step_seconds`); a 16-bit gradient (bf16) halves the push;
  - a ring all-reduce of N ranks sends and receives 2 (N-1)/N of the buffer over each rank's link.

``psgd bench comm --network`` (one worker, one shard, model sizes) and ``benchmarks/allreduce.py
--network`` (N workers on N shards against N all-reduce ranks) run on it; this module is also the worker
process they start on a host (``python -m psgd.bench.shaped worker SPEC``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import numpy as np

from psgd.config import Links
from psgd.config.parsing import comma_list

PY = sys.executable
#: How long one worker process may take for its steps before the figure is given up as failed.
WORKER_TIMEOUT = 900


def ring_allreduce_seconds(nbytes: int, ranks: int, bytes_per_s: float) -> float:
    """What a ring all-reduce of ``nbytes`` over ``ranks`` takes on links of ``bytes_per_s``, for the bytes alone."""
    return 2 * (ranks - 1) / ranks * nbytes / bytes_per_s if ranks > 1 else 0.0


def link_rate(network) -> float:
    """The slower of the two directions measured on ``network``'s links (bytes/s), or None when unmeasured."""
    return min(network.measured.values()) if network.measured else None


def ps_steps(
    network, size: int, shards: int, workers: int, steps: int, tmp: str, wire_dtype: str | None = None
) -> dict:
    """Pull+push of a ``size``-byte model by ``workers`` worker processes on hosts ``w<r>`` through ``shards``
    shards on hosts ``s<k>`` (async: no worker waits for another); medians over all workers' steps."""
    from psgd.bench.blob import BlobCluster

    with BlobCluster(size, shards=shards, workers=workers, tmp=tmp, hosts=network.net) as cluster:
        spec = {"job": str(cluster.path), "addresses": cluster.addresses, "steps": steps, "wire_dtype": wire_dtype}
        runs = []
        for r in range(workers):
            path = cluster.tmp / f"worker-{r}.json"
            path.write_text(json.dumps({**spec, "rank": r}))
            runs.append(
                subprocess.Popen(
                    [*network.net.prefix(f"w{r}"), PY, "-m", "psgd.bench.shaped", "worker", str(path)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=cluster.env,
                )
            )
        with futures.ThreadPoolExecutor(workers) as pool:
            outputs = list(pool.map(lambda p: p.communicate(timeout=WORKER_TIMEOUT), runs))
    for proc, (out, err) in zip(runs, outputs):
        if proc.returncode:
            raise RuntimeError(f"a worker on {network.name} links failed: {err.strip()[-600:]}")
    times = [json.loads(out) for out, _ in outputs]
    pulls = [x for t in times for x in t["pull_s"]]
    pushes = [x for t in times for x in t["push_s"]]
    step = float(np.median([a + b for t in times for a, b in zip(t["pull_s"], t["push_s"])]))
    return {"pull_s": float(np.median(pulls)), "push_s": float(np.median(pushes)), "step_s": step}


def mpi_allreduce(network, sizes: list[int], ranks: int, repeats: int) -> dict[int, dict]:
    """An all-reduce of each size through psgd's mpi backend, rank r on host ``w<r>`` (mpiexec's MPMD form,
    as ``psgd launch`` puts ranks on hosts); rank 0's figures per size."""
    from psgd.launcher import find_mpiexec
    from psgd.launcher.allreduce import MPI_ON_HOSTS

    argv = [find_mpiexec(), *MPI_ON_HOSTS]
    child = [
        "-m",
        "psgd.bench.allreduce",
        "--child",
        "mpi",
        "--sizes-mb",
        ",".join(str(s / 1e6) for s in sizes),
        "--repeats",
        str(repeats),
    ]
    for r in range(ranks):
        argv += [":"] * (r > 0) + ["-n", "1", *network.net.prefix(f"w{r}"), PY, *child]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=WORKER_TIMEOUT)
    if done.returncode:
        raise RuntimeError(f"the all-reduce on {network.name} links failed: {done.stderr.strip()[-1500:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {r["size"]: r for r in rows}


def networks_from(text: str) -> list[str]:
    """``--network``'s rates (e.g. ``1gbit,10gbit,none``), checked, with the machine able to emulate them;
    :class:`psgd.bench.netns.NetworkError` saying why not."""
    from psgd.bench import netns

    names = comma_list(text, "--network", what="link rates (e.g. 1gbit,10gbit,none)", error=netns.NetworkError)
    netns.check_networks(names)
    return names


@contextlib.contextmanager
def _network(name: str, shards: int, workers: int, rows: list[dict], say):
    """The emulated hosts of network ``name``, or None where this machine cannot emulate it now (its links
    measure off their rate, e.g. too busy): that is said, and left in ``rows`` as an error."""
    from psgd.bench.hosted import Network
    from psgd.bench.netns import NetworkError

    net = Network(name, shards=shards, workers=workers)
    try:
        net.__enter__()
    except NetworkError as exc:
        say(f"\n{name} links: skipped: {exc}")
        rows.append({"network": name, "error": str(exc)})
        yield None
        return
    try:
        yield net
    finally:
        net.__exit__(None, None, None)


def comm_on(names: list[str], sizes: list[int], steps: int, tmp: str, say) -> list[dict]:
    """``psgd bench comm --network``: one worker and one shard on each network, every size, the gradient
    pushed as float32 and as bf16, each step beside the link-bound step."""
    from psgd.bench.convergence import link_step_seconds

    rows: list[dict] = []
    for name in names:
        with _network(name, 1, 1, rows, say) as net:
            if net is None:
                continue
            rate = link_rate(net)
            say(
                f"\n{name} links: measured {net.record()['measured_gbit_per_s']} Gbit/s; 1 worker, 1 shard, each on "
                "a host of its own\n  size MB  push  pull ms  push ms  step ms  link-bound ms  step/bound"
            )
            for size in sizes:
                for wire in (None, "bfloat16"):
                    t = ps_steps(net, size, 1, 1, steps, tmp, wire)
                    bound = link_step_seconds(size, 1, 1, rate, 0.5 if wire else 1.0)
                    rows.append(
                        {
                            "network": name,
                            "link": net.record(),
                            "size_bytes": size,
                            "wire_dtype": wire or "float32",
                            **t,
                            "link_bound_s": bound,
                            "step_over_bound": t["step_s"] / bound,
                        }
                    )
                    say(
                        f"  {size / 1e6:7.0f}  {'bf16' if wire else 'fp32'} {t['pull_s'] * 1e3:8.1f} "
                        f"{t['push_s'] * 1e3:8.1f} {t['step_s'] * 1e3:8.1f} {bound * 1e3:14.1f} "
                        f"{t['step_s'] / bound:11.2f}"
                    )
    return rows


def ps_against_allreduce_on(names: list[str], sizes: list[int], ranks: int, repeats: int, tmp: str, say) -> list[dict]:
    """``benchmarks/allreduce.py --network``: on each network, ``ranks`` MPI ranks all-reduce each size, and
    as many workers pull+push it through as many shards (gradients as float32 and bf16), every process on
    a host of its own; each figure beside what the link's bytes alone take."""
    from psgd.bench.convergence import link_step_seconds

    rows: list[dict] = []
    for name in names:
        with _network(name, ranks, ranks, rows, say) as net:
            if net is None:
                continue
            rate = link_rate(net)
            say(
                f"\n{name} links: measured {net.record()['measured_gbit_per_s']} Gbit/s; {ranks} ranks, and "
                f"{ranks} workers on {ranks} shards, each on a host of its own\n"
                "  size MB  all-reduce ms  ring bound  PS ms  PS bound  PS bf16 ms  bf16 bound  PS/all-reduce  "
                "bf16/all-reduce"
            )
            mpi = mpi_allreduce(net, sizes, ranks, repeats)
            for size in sizes:
                ps = ps_steps(net, size, ranks, ranks, repeats, tmp)
                bf16 = ps_steps(net, size, ranks, ranks, repeats, tmp, "bfloat16")
                row = {
                    "network": name,
                    "link": net.record(),
                    "size_bytes": size,
                    "ranks": ranks,
                    "allreduce_s": mpi[size]["psgd_s"],
                    "ring_bound_s": ring_allreduce_seconds(size, ranks, rate),
                    "ps_step_s": ps["step_s"],
                    "ps_bound_s": link_step_seconds(size, ranks, ranks, rate),
                    "ps_bf16_step_s": bf16["step_s"],
                    "ps_bf16_bound_s": link_step_seconds(size, ranks, ranks, rate, 0.5),
                }
                row["ps_over_allreduce"] = row["ps_step_s"] / row["allreduce_s"]
                row["ps_bf16_over_allreduce"] = row["ps_bf16_step_s"] / row["allreduce_s"]
                rows.append(row)
                say(
                    f"  {size / 1e6:7.0f} {row['allreduce_s'] * 1e3:14.1f} {row['ring_bound_s'] * 1e3:10.1f} "
                    f"{row['ps_step_s'] * 1e3:6.1f} {row['ps_bound_s'] * 1e3:9.1f} {row['ps_bf16_step_s'] * 1e3:11.1f} "
                    f"{row['ps_bf16_bound_s'] * 1e3:11.1f} {row['ps_over_allreduce']:14.2f} "
                    f"{row['ps_bf16_over_allreduce']:16.2f}"
                )
    return rows


def worker_main(spec_path: str) -> int:
    """One worker's pull+push steps (the first a warm-up) against the shards SPEC names; JSON on stdout."""
    from psgd.bench.blob import Blob, pull_push_loop
    from psgd.config import JobConfig
    from psgd.job import describe_job
    from psgd.worker.client import PSClient

    spec = json.loads(Path(spec_path).read_text())
    config = JobConfig.load(spec["job"])
    elems = int(config.model["size"])
    plan = describe_job(config, model=Blob((1,), 2, size=elems)).plan
    with PSClient(
        spec["addresses"],
        plan,
        spec["rank"],
        links=Links(wire_dtype=spec["wire_dtype"] or ""),
        config=config,
        token=os.environ.get("PSGD_TOKEN", ""),
    ) as client:
        client.wait_ready(60)
        client.register()
        pulls, pushes = pull_push_loop(client, elems, spec["steps"])
        client.done()
    print(json.dumps({"pull_s": pulls, "push_s": pushes}))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"] and len(sys.argv) == 3:
        sys.exit(worker_main(sys.argv[2]))
    sys.exit("usage: python -m psgd.bench.shaped worker SPEC.json")
