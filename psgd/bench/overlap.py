"""Overlap of communication with computation, measured as users run it.

For the synthetic preset's model (an MLP 64-3072-3072-10, 38.7 MB) and one a quarter of its size
(64-1536-1536-10), with 1 and 2 workers under sync and async (2 shards) and 2 all-reduce ranks, in one run:

  - steps/s of ``psgd launch`` with ``[cluster] overlap`` false and true, read from the processes' own
    step records, as ``psgd bench scaling`` reads them;
  - one step's compute alone: a gradient in one process with one BLAS thread, as the launcher gives each
    process here (:func:`psgd.training.loop.gradient_seconds`);
  - one step's communication alone: the model's bytes pulled and pushed through 2 shard processes by as
    many workers at once (a free gradient), or all-reduced over MPI by as many ranks;
  - step / max(compute, communication): 1 when a step costs only its larger part.

    psgd bench overlap                        # about 5 minutes on 2 cores
    psgd bench overlap --models quarter --workers 2 --epochs 1 --json overlap.json
    sudo psgd bench overlap --network 1gbit   # every process on an emulated host, links of 1 Gbit/s
    psgd bench overlap --device cuda          # workers and ranks computing on the GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from psgd.config.parsing import comma_list

MODELS = {"synthetic": 3072, "quarter": 1536}
KINDS = ("sync", "async", "allreduce")
DATA = [
    "--dataset",
    "synthetic",
    "--set",
    "data.input_dim=64",
    "--set",
    "data.n_train=3072",
    "--set",
    "data.n_test=256",
]
PY = sys.executable


def launch_argv(
    kind: str, workers: int, width: int, overlap: bool, epochs: int, run_dir: Path, timeout: float, device: str = "cpu"
) -> list[str]:
    """The ``psgd`` command line of one run, as a user would type it (without the leading ``psgd``)."""
    mode = ["--mode", "allreduce"] if kind == "allreduce" else ["--mode", "ps", "--policy", kind, "--shards", "2"]
    return [
        "launch",
        *mode,
        "--workers",
        str(workers),
        "--optimizer",
        "momentum",
        "--lr",
        "0.01",
        "--epochs",
        str(epochs),
        "--set",
        f"model.hidden=[{width}, {width}]",
        *DATA,
        "--set",
        f"cluster.overlap={'true' if overlap else 'false'}",
        "--run-dir",
        str(run_dir),
        "--timeout",
        f"{timeout:g}",
        "--no-progress",
        "--json",
        *(["--device", device] if device != "cpu" else []),
    ]


def run_one(
    kind: str,
    workers: int,
    width: int,
    overlap: bool,
    epochs: int,
    run_dir: Path,
    timeout: float,
    network=None,
    device: str = "cpu",
) -> dict:
    """One launch (on ``network``'s emulated hosts, if given); its steps/s (aggregate and per worker) from
    what its processes recorded."""
    from psgd.bench.scaling.measure import MeasureError, allreduce_rates, ps_rates, read_steps

    argv = launch_argv(kind, workers, width, overlap, epochs, run_dir, timeout, device)
    record = {
        "kind": kind,
        "workers": workers,
        "width": width,
        "overlap": overlap,
        "command": shlex.join(["psgd", *argv]),
    }
    command = [PY, "-m", "psgd.cli.main", *argv]
    if network is not None:
        from psgd.bench.hosted import launch_argv as on_hosts

        command = on_hosts(network, run_dir, argv)
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout + 60)
    if done.returncode:
        record["error"] = f"exit status {done.returncode}: {done.stderr.strip()[-400:]}"
        return record
    try:
        if kind == "allreduce":
            record.update(allreduce_rates(read_steps(run_dir / "allreduce.jsonl"), workers))
        else:
            record.update(ps_rates([read_steps(run_dir / f"worker-{k}.jsonl") for k in range(workers)]))
    except (MeasureError, OSError, ValueError, KeyError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    return record


def compute_seconds(width: int, repeats: int = 10, device: str = "cpu") -> float:
    """One gradient of a batch of 32 in this process with one BLAS thread, or on the GPU ``device``."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    from psgd.compute import backend
    from psgd.model import build_model
    from psgd.training.loop import gradient_seconds

    where = backend.use_device(device)
    model = build_model("mlp", (64,), 10, hidden=(width, width))
    params = {k: where.asarray(v) for k, v in model.init(0).items()}
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 64)).astype(np.float32), rng.integers(0, 10, 32)
    with threadpool_limits(1):
        return gradient_seconds(model, params, where.asarray(x), where.asarray(y), repeats, where)


def model_bytes(width: int) -> int:
    return 4 * (64 * width + width + width * width + width + width * 10 + 10)


def comm_seconds(kind: str, workers: int, width: int, steps: int, tmp: str, network=None) -> float:
    """One step's communication alone: pull+push of the model through 2 shards by ``workers`` workers at
    once (the median step), or an all-reduce of its bytes over ``workers`` MPI ranks; 0 for one rank.
    With ``network``, every process on a host of its own (:mod:`psgd.bench.shaped`)."""
    size = model_bytes(width) // 4 * 4
    if kind == "allreduce" and workers < 2:
        return 0.0
    if network is not None:
        from psgd.bench import shaped

        if kind == "allreduce":
            return shaped.mpi_allreduce(network, [size], workers, steps)[size]["psgd_s"]
        return shaped.ps_steps(network, size, 2, workers, steps, tmp)["step_s"]
    if kind == "allreduce":
        from psgd.bench.allreduce import run_mpi

        return run_mpi([size], workers, steps)[size]["psgd_s"]
    from psgd.bench.blob import BlobCluster, time_steps

    with BlobCluster(size, shards=2, workers=workers, tmp=tmp) as cluster:
        return time_steps(cluster, workers, steps, transport="auto")["step_s"]  # as psgd launch moves them


def measure(
    models: list[str],
    workers: list[int],
    kinds: list[str],
    epochs: int,
    timeout: float,
    say,
    network=None,
    timeline: Path | None = None,
    device: str = "cpu",
) -> list[dict]:
    """Every (model, kind, workers): steps/s off and on, compute and communication alone, and the ratio;
    on ``network``'s emulated hosts where given; ``timeline``: the first overlapped async run, drawn."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="psgd-overlap-") as tmp:
        for name in models:
            width = MODELS[name]
            compute = compute_seconds(width, device=device)
            say(
                f"\n{name} (MLP 64-{width}-{width}-10, {model_bytes(width) / 1e6:.1f} MB): one gradient alone "
                f"{compute * 1e3:.1f} ms\n  run              steps/s off  steps/s on  on/off  compute s  comm s  "
                "step off s  step on s  on / max"
            )
            for kind in kinds:
                for n in workers:
                    if kind == "allreduce" and n < 2:
                        continue
                    comm = comm_seconds(kind, n, width, 5, tmp, network)
                    runs = {
                        overlap: run_one(
                            kind,
                            n,
                            width,
                            overlap,
                            epochs,
                            Path(tmp) / f"{name}-{kind}{n}-{overlap}",
                            timeout,
                            network,
                            device,
                        )
                        for overlap in (False, True)
                    }
                    row = {
                        "model": name,
                        "width": width,
                        "model_bytes": model_bytes(width),
                        "kind": kind,
                        "workers": n,
                        "compute_s": compute,
                        "comm_s": comm,
                        "runs": list(runs.values()),
                    }
                    if any("error" in r for r in runs.values()):
                        row["error"] = "; ".join(r["error"] for r in runs.values() if "error" in r)
                        say(f"  {kind} {n}w: FAILED: {row['error']}")
                        rows.append(row)
                        continue
                    if timeline is not None and kind == "async":
                        draw_timeline(
                            Path(tmp) / f"{name}-{kind}{n}-True" / "worker-0.jsonl",
                            timeline,
                            f"worker 0 of {n}, async, overlap on: {name} model "
                            f"({model_bytes(width) / 1e6:.1f} MB)"
                            + (f", {network.record()['described']} links" if network else ""),
                        )
                        say(f"  timeline of {kind} {n}w written to {timeline}")
                        timeline = None
                    off, on = (runs[o]["per_worker_steps_per_s"] for o in (False, True))
                    row.update(
                        steps_per_s_off=runs[False]["steps_per_s"],
                        steps_per_s_on=runs[True]["steps_per_s"],
                        speedup=on / off,
                        step_off_s=1 / off,
                        step_on_s=1 / on,
                        on_over_max=(1 / on) / max(compute, comm),
                    )
                    rows.append(row)
                    say(
                        f"  {kind + f' {n}w':<16} {row['steps_per_s_off']:11.1f} {row['steps_per_s_on']:11.1f} "
                        f"{row['speedup']:7.2f} {compute:10.4f} {comm:7.4f} {row['step_off_s']:11.4f} "
                        f"{row['step_on_s']:10.4f} {row['on_over_max']:9.2f}"
                    )
    return rows


def draw_timeline(worker_log: Path, path: Path, title: str, steps: int = 4) -> None:
    """What ran when in ``steps`` consecutive steps (from the middle of the run) of one worker with overlap
    on, one lane per thread: the gradient (main thread), the push and the next step's pull (their own
    threads), from the ``spans`` the loop writes to the worker's step records."""
    from psgd.bench.plots import OKABE_ITO, require_matplotlib
    from psgd.bench.scaling.measure import read_steps

    require_matplotlib("psgd bench overlap --timeline")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in read_steps(worker_log) if "spans" in r]
    if len(records) < steps:
        raise ValueError(f"{worker_log}: {len(records)} step(s) with spans, {steps} wanted")
    middle = len(records) // 2
    shown = records[middle - steps // 2 : middle - steps // 2 + steps]
    origin = min(a for r in shown for a, _ in r["spans"].values())
    lanes = [("compute", "gradient (main thread)"), ("push", "push (its thread)"), ("pull", "pull (its thread)")]
    fig, ax = plt.subplots(figsize=(9, 2.8), dpi=150)
    for lane, (key, label) in enumerate(lanes):
        for r in shown:
            if key in r["spans"]:
                a, b = r["spans"][key]
                ax.broken_barh(
                    [((a - origin) * 1e3, (b - a) * 1e3)],
                    (lane - 0.35, 0.7),
                    facecolors=OKABE_ITO[lane],
                    edgecolor="white",
                )
                ax.text(
                    (a - origin + (b - a) / 2) * 1e3,
                    lane,
                    str(r["clock"]),
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white",
                )
    ax.set_yticks(range(len(lanes)), [label for _, label in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds (numbers: the step each piece of work belongs to)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models", default=",".join(MODELS), metavar="LIST", help=f"from {', '.join(MODELS)} (default: both)"
    )
    parser.add_argument("--workers", default="1,2", metavar="LIST", help="worker (rank) counts (default 1,2)")
    parser.add_argument(
        "--kinds",
        default=",".join(KINDS),
        metavar="LIST",
        help=f"from {', '.join(KINDS)} (default: all; all-reduce runs with 2 or more ranks)",
    )
    parser.add_argument("--epochs", type=int, default=1, help="passes over the 3,072 examples per run (default 1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="fail a run that takes longer (default 600)")
    parser.add_argument(
        "--network",
        metavar="RATE",
        help="on emulated links of this rate (e.g. 1gbit; root and tc): every shard, worker and "
        "rank on a host of its own, for the runs and the communication-only figures",
    )
    parser.add_argument(
        "--timeline",
        metavar="FILE.png",
        help="draw what ran when in four steps of worker 0 of the first overlapped async run (one lane per thread)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the workers and ranks compute: cpu (default) or cuda (every process on "
        "cuda:0 for a parameter server, all-reduce ranks staged through MPI)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE")


def run_from_args(args: argparse.Namespace) -> int:
    from psgd.bench.limits import machine
    from psgd.config import ConfigError

    models = comma_list(args.models, "--models", choices=MODELS, error=ConfigError)
    kinds = comma_list(args.kinds, "--kinds", choices=KINDS, error=ConfigError)
    workers = comma_list(args.workers, "--workers", kind=int, what="whole numbers", at_least=1, error=ConfigError)
    if args.epochs < 1:
        raise ConfigError(f"--epochs must be at least 1, got {args.epochs}")
    from psgd.compute import backend

    try:
        backend.get_device(args.device)
    except backend.DeviceError as exc:
        raise ConfigError(f"--device: {exc}") from None
    print(f"machine: {machine()}", flush=True)
    say = lambda text: print(text, flush=True)  # noqa: E731
    link = None
    with contextlib.ExitStack() as stack:
        network = None
        if args.network:
            from psgd.bench import netns
            from psgd.bench.hosted import Network

            try:
                netns.check_networks([args.network])
            except netns.NetworkError as exc:
                raise ConfigError(str(exc)) from None
            network = stack.enter_context(Network(args.network, 2, max(workers)))
            link = network.record()
            say(
                f"{args.network} links: measured {link['measured_gbit_per_s']} Gbit/s; every shard, worker and "
                "rank on a host of its own"
            )
        if args.timeline:
            from psgd.bench.plots import require_matplotlib

            require_matplotlib("psgd bench overlap --timeline")
        rows = measure(
            models,
            workers,
            kinds,
            args.epochs,
            args.timeout,
            say,
            network,
            Path(args.timeline) if args.timeline else None,
            args.device,
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"machine": machine(), "epochs": args.epochs, "network": link, "device": args.device, "rows": rows},
                indent=2,
            )
        )
    return 1 if any("error" in r for r in rows) else 0
