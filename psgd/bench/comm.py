"""How fast psgd moves tensors, against this machine's own limits, in one run.

Measured side by side:
  - the limits: raw loopback TCP between two processes, memory-copy bandwidth;
  - the headline: a 40 MB model's pull+push (one worker, one shard) in rounds,
    each beside raw TCP measured just before it;
  - pull, push and pull+push through psgd-server shard processes for models of
    1 MB to 400 MB (one worker, one shard), and for a 40 MB model over 1-4
    shards and 1-4 workers (the bulk data path, and gRPC alone for contrast);
  - the same-host link (shared memory) against the data port on the same shard, 1 MB to 400 MB with one
    worker and the focus model with 2 and 4 workers, against memory-copy bandwidth;
  - an MPI all-reduce of the same bytes between 2 processes;
  - a small step's fixed cost on every link (pull then push, and one push and pull), the shard's share of it,
    beside a bare round trip over loopback TCP and a bare gRPC call;
  - the optimizers' update throughput against memory bandwidth;
  - peak memory (RSS) of a shard and of a worker against the model size.

Every figure is printed as it is measured; ``--json FILE`` writes them all.

    psgd bench comm --json comm.json     # everything, about 15 minutes on 2 cores
    psgd bench comm --quick              # 1-16 MB, under a minute
    psgd bench comm --parts sweep,latency --sizes-mb 40 --steps 20
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from psgd.bench import latency
from psgd.bench.blob import BlobCluster, median, time_steps
from psgd.bench.limits import machine, memcpy_gbps, tcp_loopback_gbps
from psgd.bench.step import host_copy_gbps
from psgd.config.parsing import comma_list

MB = 1_000_000
PY = sys.executable


# -- pieces -------------------------------------------------------------------------------------------
def optimizer_throughput(nbytes: int = 40 * MB, repeats: int = 5) -> dict:
    """GB/s of parameter bytes a shard updates per second, per optimizer: its weight store's update of one
    4 MiB-sliced tensor (the blob model's), as a push makes it (psgd.server.state.store, swept over the shard's
    threads)."""
    from psgd.bench.blob import Blob
    from psgd.config import JobConfig
    from psgd.job import describe_job
    from psgd.server import build_shard

    out = {}
    n = nbytes // 4
    gradient = np.full(n, 1e-3, dtype=np.float32).tobytes()
    for name in ("sgd", "momentum", "adam"):
        config = JobConfig()
        config = config.apply_sets(
            [
                "model.name=psgd.bench.blob:Blob",
                f"model.size={n}",
                "data.name=synthetic",
                f"optimizer.name={name}",
                "cluster.policy=async",
                "cluster.workers=1",
            ]
        )
        core = build_shard(describe_job(config, model=Blob((1,), 2, size=n)), 0)
        grads = core.store.gradient_views(gradient)

        def step():  # the store's update alone (one thread: no lock to take)
            core.store.apply(core.optimizer, grads, 1.0)

        step()
        best = min(_timed_once(step) for _ in range(repeats))
        out[name] = nbytes / best / 1e9
        core.store.sweep.close()
    return out


def _timed_once(fn) -> float:
    a = time.perf_counter()
    fn()
    return time.perf_counter() - a


def run_worker_process(cluster: BlobCluster) -> dict:
    """A real psgd-worker process training the blob model for one epoch (8 steps); its JSON summary."""
    from psgd.config import to_toml

    config = cluster.config
    config = config.override("cluster.servers", cluster.addresses)
    config = config.override("train.batch_size", 8)
    config = config.override("train.epochs", 1)
    path = cluster.tmp / "worker.toml"
    path.write_text(to_toml(config.to_dict()))
    done = subprocess.run(
        [PY, "-m", "psgd.cli.worker", "-c", str(path), "--rank", "0", "--no-progress", "-q", "--json"],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode:
        raise SystemExit(f"worker failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


# -- the run ----------------------------------------------------------------------------------------------
PARTS = ("headline", "sweep", "shm", "grid", "variants", "latency", "optimizer", "memory", "scale")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (``psgd bench comm``; ``benchmarks/comm.py`` runs the same command)."""
    parser.add_argument(
        "--sizes-mb",
        default="1,4,16,40,100,400",
        metavar="LIST",
        help="model sizes in MB (10^6 bytes) for the one-worker, one-shard sweep (default 1,4,16,40,100,400)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=8,
        metavar="N",
        help="timed steps per figure after one warm-up; medians are reported (default 8)",
    )
    parser.add_argument(
        "--focus-mb",
        type=float,
        default=None,
        metavar="MB",
        help="model size for the headline, the shards x workers grid and the transport variants "
        "(default 40; 16 with --quick)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        metavar="N",
        help="headline: rounds of raw TCP then the focus model's step, each ratio taken within "
        "its round; the median is reported (default 5)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="1-16 MB, 3 steps, a 16 MB focus model and no scale check: under a minute"
    )
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        metavar="LIST",
        help="which measurements, comma-separated, besides the limits (always measured): "
        + ", ".join(PARTS)
        + " (default: all)",
    )
    parser.add_argument(
        "--network",
        metavar="LIST",
        help="instead: on emulated links of these rates (e.g. 1gbit,10gbit,none; root and tc), one "
        "worker and one shard each on a host of its own, pull, push and step for every "
        "--sizes-mb with float32 and bf16 gradients, beside the link's measured rate",
    )
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")


def run_from_args(args: argparse.Namespace) -> dict:
    """Measure what the flags ask for, printing each figure as it comes; returns every figure."""
    from psgd.config import ConfigError

    parts = comma_list(args.parts, "--parts", choices=PARTS, error=ConfigError)
    if args.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {args.steps}")
    sizes = [
        int(mb * MB) // 4 * 4
        for mb in comma_list(
            "1,4,16" if args.quick else args.sizes_mb, "--sizes-mb", kind=float, what="sizes in MB", error=ConfigError
        )
    ]
    if not min(sizes) >= 4:
        raise ConfigError("--sizes-mb: every size must be at least 0.000004 MB (one float32)")
    if args.rounds < 1:
        raise ConfigError(f"--rounds must be at least 1, got {args.rounds}")
    steps = 3 if args.quick else args.steps
    focus = int((args.focus_mb if args.focus_mb is not None else 16 if args.quick else 40) * MB) // 4 * 4
    if focus < 4:
        raise ConfigError("--focus-mb: the focus model needs at least one float32")
    result: dict = {"machine": machine()}

    def say(text: str) -> None:
        print(text, flush=True)

    say(f"machine: {result['machine']}")
    if args.network:
        from psgd.bench import netns, shaped

        try:
            names = shaped.networks_from(args.network)
        except netns.NetworkError as exc:
            raise ConfigError(str(exc)) from None
        with tempfile.TemporaryDirectory() as tmp:
            result["links"] = shaped.comm_on(names, sizes, steps, tmp, say)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        return result
    tcp, mem = tcp_loopback_gbps(), memcpy_gbps()
    tcp_cold = tcp_loopback_gbps(buffer_bytes=focus)
    result.update(tcp_loopback_gbps=tcp, tcp_model_sized_gbps=tcp_cold, memcpy_gbps=mem)
    say(
        f"limits: raw loopback TCP {tcp:.2f} GB/s (two processes, a 4 MiB buffer in cache), "
        f"{tcp_cold:.2f} GB/s moving {focus / MB:.0f} MB buffers; memory copy {mem:.2f} GB/s"
    )

    with tempfile.TemporaryDirectory() as tmp:
        if "headline" in parts:
            _headline(result, focus, steps, tmp, say, args.rounds)
        if "sweep" in parts:
            _sweep(result, sizes, focus, steps, tcp, tmp, say)
        if "shm" in parts:
            _shm(result, sizes, focus, steps, tcp, mem, tmp, say)
        if "grid" in parts:
            _grid(result, focus, steps, tcp, tmp, say)
        if "variants" in parts:
            _variants(result, focus, steps, tcp, tcp_cold, tmp, say)
        if "latency" in parts:
            _latency(result, steps, tmp, say)
        if "optimizer" in parts:
            opt = optimizer_throughput()
            result["optimizer_gbps"] = opt
            threaded = host_copy_gbps(40 * MB)
            result["threaded_memcpy_gbps"] = threaded
            say(
                f"a shard's update throughput (parameter bytes/s), against a memory copy ({mem:.2f} GB/s) and the "
                f"shard's threaded copy ({threaded:.2f} GB/s): "
                + ", ".join(
                    f"{k} {v:.2f} GB/s ({v / mem:.2f} of memory copy, {v / threaded:.2f} of the threaded copy)"
                    for k, v in opt.items()
                )
            )
        if "memory" in parts:
            _memory(result, [16 * MB] if args.quick else [40 * MB, 400 * MB], tmp, say)
        if "scale" in parts and not args.quick:
            _scale(result, tmp, say)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def _headline(result: dict, focus: int, steps: int, tmp: str, say, rounds: int) -> None:
    """The focus model's 1x1 step against raw loopback TCP measured just before it, ``rounds`` times.

    The machine's speed drifts (shared hosts): measuring the limit beside each
    figure, rather than once at the start, exposes both to the same conditions.
    """
    say(
        f"\n{focus / MB:.0f} MB, 1 worker, 1 shard, step beside raw loopback TCP (cache-hot 4 MiB buffer), "
        f"{rounds} rounds"
    )
    rows = []
    for k in range(rounds):
        tcp = tcp_loopback_gbps()
        with BlobCluster(focus, tmp=tmp) as cluster:
            t = time_steps(cluster, 1, steps)
        rows.append({"tcp_loopback_gbps": tcp, **t, "step_over_tcp": t["step_gbps"] / tcp})
        say(
            f"  round {k + 1}: TCP {tcp:.2f} GB/s; pull {t['pull_s'] * 1e3:.1f} ms, push {t['push_s'] * 1e3:.1f} ms, "
            f"step {t['step_s'] * 1e3:.1f} ms = {t['step_gbps']:.2f} GB/s, {t['step_gbps'] / tcp:.2f} of TCP"
        )
    ratio = median([r["step_over_tcp"] for r in rows])
    result["headline"] = {"size_bytes": focus, "rounds": rows, "median_step_over_tcp": ratio}
    say(f"  median over the rounds: {ratio:.2f} of raw loopback TCP")


def _sweep(result: dict, sizes: list[int], focus: int, steps: int, tcp: float, tmp: str, say) -> None:
    """One worker, one shard, every size; beside an MPI all-reduce of the same bytes between 2 processes."""
    from psgd.bench.allreduce import run_mpi

    mpi = run_mpi(sorted(set(sizes + [focus])), 2, max(3, steps // 2))
    say(
        "\n1 worker, 1 shard (async, sgd), bulk data path; AR = a bare mpi4py Allreduce of the same bytes "
        "between 2 processes in one call, psgd AR = psgd's all-reduce mode (4 MiB pieces, then the mean)"
    )
    say(
        f"{'MB':>5} {'pull ms':>8} {'push ms':>8} {'step ms':>8} {'GB/s':>6} {'/TCP':>5} "
        f"{'AR ms':>12} {'step/AR':>7} {'psgd AR ms':>10} {'step/psgd AR':>8} {'shard RSS MB':>12} {'RSS budget':>10}"
    )
    rows = []
    for size in sizes:
        with BlobCluster(size, tmp=tmp) as cluster:
            t = time_steps(cluster, 1, steps)
            rss = cluster.rss_mb()[0]
        ar, ours = mpi[size]["bare_s"], mpi[size]["psgd_s"]
        budget = 2 * size / MB + 200  # 2 x (weights + SGD's empty state) + 200 MB
        rows.append(
            {
                "size_bytes": size,
                **t,
                "allreduce_s": ar,
                "step_over_allreduce": t["step_s"] / ar,
                "psgd_allreduce_s": ours,
                "step_over_psgd_allreduce": t["step_s"] / ours,
                "step_over_tcp": t["step_gbps"] / tcp,
                "shard_peak_rss_mb": rss,
                "shard_rss_budget_mb": budget,
            }
        )
        say(
            f"{size / MB:5.0f} {t['pull_s'] * 1e3:8.2f} {t['push_s'] * 1e3:8.2f} {t['step_s'] * 1e3:8.2f} "
            f"{t['step_gbps']:6.2f} {t['step_gbps'] / tcp:5.2f} {ar * 1e3:12.2f} {t['step_s'] / ar:7.2f} "
            f"{ours * 1e3:10.2f} {t['step_s'] / ours:8.2f} {rss:12.0f} {budget:10.0f}"
        )
    result["sweep"] = rows


def _shm(result: dict, sizes: list[int], focus: int, steps: int, tcp: float, mem: float, tmp: str, say) -> None:
    """Shared memory against the data port, both against the same shard process, one after the other."""
    say(
        "\nshared memory (shm) against the data port (tcp), the same shard process (async, sgd); "
        "'of memcpy' = (2 x size / step) / memory-copy bandwidth, 'of TCP' the same over raw loopback TCP"
    )
    say(
        f"{'MB':>5} {'workers':>7} {'shm pull ms':>11} {'shm push ms':>11} {'shm step ms':>11} {'of memcpy':>9} "
        f"{'tcp step ms':>11} {'of TCP':>6} {'tcp/shm':>7}"
    )
    rows = []
    for size, workers in [(size, 1) for size in sizes] + [(focus, 2), (focus, 4)]:
        with BlobCluster(size, workers=workers, tmp=tmp) as cluster:
            shm = time_steps(cluster, workers, steps, "shm")
            tcp_run = time_steps(cluster, workers, steps, "tcp")
        row = {
            "size_bytes": size,
            "workers": workers,
            "shm": shm,
            "tcp": tcp_run,
            "shm_of_memcpy": shm["step_gbps"] / mem,
            "tcp_of_tcp": tcp_run["step_gbps"] / tcp,
            "tcp_over_shm": tcp_run["step_s"] / shm["step_s"],
        }
        rows.append(row)
        say(
            f"{size / MB:5.0f} {workers:7d} {shm['pull_s'] * 1e3:11.2f} {shm['push_s'] * 1e3:11.2f} "
            f"{shm['step_s'] * 1e3:11.2f} {row['shm_of_memcpy']:9.2f} {tcp_run['step_s'] * 1e3:11.2f} "
            f"{row['tcp_of_tcp']:6.2f} {row['tcp_over_shm']:7.2f}"
        )
    result["shm"] = rows


def _grid(result: dict, focus: int, steps: int, tcp: float, tmp: str, say) -> None:
    """The focus model over 1-4 shards and 1-4 workers."""
    say(f"\n{focus / MB:.0f} MB model: shards x workers (aggregate GB/s = bytes moved by all workers / wall)")
    grid = []
    for shards, workers in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (2, 4), (4, 4)):
        with BlobCluster(focus, shards, workers, tmp=tmp) as cluster:
            t = time_steps(cluster, workers, steps)
        grid.append({"shards": shards, "workers": workers, **t})
        say(
            f"  {shards} shard(s) {workers} worker(s): step {t['step_s'] * 1e3:7.1f} ms, "
            f"aggregate {t['aggregate_gbps']:.2f} GB/s ({t['aggregate_gbps'] / tcp:.2f} of TCP)"
        )
    result["grid"] = grid


def _variants(result: dict, focus: int, steps: int, tcp: float, tcp_cold: float, tmp: str, say) -> None:
    """The focus model, one worker and one shard: gRPC alone, the data path, compressed gradients."""
    say(f"\n{focus / MB:.0f} MB, 1x1: transport and wire-compression variants")
    variants = []
    for label, transport, wdt in (
        ("gRPC only", "grpc", None),
        ("data path", "tcp", None),
        ("data path, float16 gradients", "tcp", "float16"),
        ("data path, bfloat16 gradients", "tcp", "bfloat16"),
    ):
        with BlobCluster(focus, tmp=tmp) as cluster:
            t = time_steps(cluster, 1, steps, transport, wdt)
        variants.append({"variant": label, **t})
        say(
            f"  {label:32s} pull {t['pull_s'] * 1e3:7.1f} ms  push {t['push_s'] * 1e3:7.1f} ms  "
            f"step {t['step_s'] * 1e3:7.1f} ms  ({t['step_gbps'] / tcp:.2f} of TCP, "
            f"{t['step_gbps'] / tcp_cold:.2f} of model-sized TCP; pull alone {t['pull_gbps'] / tcp_cold:.2f})"
        )
    result["variants"] = variants


def _latency(result: dict, steps: int, tmp: str, say) -> None:
    """A small step's fixed cost on every link, beside bare round trips (:mod:`psgd.bench.latency`)."""
    result["latency"] = latency.measure(max(200, 60 * steps), tmp, say, rounds=1 if steps < 4 else 3)


def _memory(result: dict, sizes: list[int], tmp: str, say) -> None:
    """Peak RSS of a shard (SGD and momentum) and of a real worker process, against their budgets."""
    memory = []
    for size in sizes:
        for optimizer in ("sgd", "momentum"):
            with BlobCluster(size, optimizer=optimizer, tmp=tmp) as cluster:
                time_steps(cluster, 1, 2)
                worker = run_worker_process(cluster)["peak_rss_mb"] if optimizer == "sgd" else None
                shard = cluster.rss_mb()[0]
            state = size if optimizer == "momentum" else 0
            row = {
                "size_bytes": size,
                "optimizer": optimizer,
                "shard_peak_rss_mb": shard,
                "shard_budget_mb": 2 * (size + state) / MB + 200,
                "worker_peak_rss_mb": worker,
                "worker_budget_mb": 3 * size / MB + 200,
            }
            memory.append(row)
            say(
                f"peak RSS, {size / MB:.0f} MB model, {optimizer}: shard {shard:.0f} MB "
                f"(budget {row['shard_budget_mb']:.0f})"
                + (f", worker {worker:.0f} MB (budget {row['worker_budget_mb']:.0f})" if worker else "")
            )
    result["memory"] = memory


def _scale(result: dict, tmp: str, say) -> None:
    """100M float32 parameters (400 MB) over 4 shards, trained by a real psgd-worker process."""
    size = 400 * MB
    with BlobCluster(size, shards=4, optimizer="momentum", tmp=tmp) as cluster:
        worker = run_worker_process(cluster)
        shards = cluster.rss_mb()
    result["scale"] = {"parameters": size // 4, "shards": 4, "worker": worker, "shard_peak_rss_mb": shards}
    say(
        f"scale check: {size // 4 / 1e6:.0f}M parameters over 4 shards (momentum): {worker['steps']} steps "
        f"in {worker['seconds']:.1f}s, worker peak {worker['peak_rss_mb']:.0f} MB, shards peak "
        + ", ".join(f"{r:.0f}" for r in shards)
        + " MB"
    )
