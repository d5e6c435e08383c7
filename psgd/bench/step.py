"""A worker's step behind a shard, where it goes, beside its floor: ``psgd bench step``.

The MLP (input 1024, hidden (w, w), 10 classes, float32, batch 256, SGD, synthetic data) for each width w,
each run started as a user starts it, on this machine, on --device:

  alone    psgd train: one process and no shard, the device's own pace
  shm      psgd launch, one worker and one shard, over shared memory
  tcp      the same over the shard's data port
  sync2    psgd launch, two workers and two shards, shared memory, sync
  async2   the same, async

Each run's steps/s is its steady state: the second half of worker 0's steps, from its step records (start-up,
capture as a CUDA graph and the first evaluations left out).  For the one-worker runs, where a step goes: the
worker's compute (its kernels waited for) and exchange (the push and the next weights), medians of its step
records' "seconds"; the shard's receive (off the socket or out of shared memory, and checked) and apply, per push,
from the launch's "shard_seconds".  Beside them the floor of the exchange: the step's bytes moved at this
machine's measured rates, the gradient to the shard and the weights back (device to host and host to device
through a registered segment on a GPU, a memory copy with the shard's threads on a CPU), plus one pass of the
update over the host's memory (the gradient and the weights read, the weights written: 1.5 memory copies of the
weights' bytes); the floor of a step is that plus alone's step.

    psgd bench step --device cuda
    psgd bench step --widths 256 --steps 64 --runs shm,tcp      # a minute on a CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from psgd.bench.limits import machine
from psgd.bench.scaling.measure import read_steps
from psgd.config.parsing import comma_list
from psgd.errors import ClusterError

DESCRIPTION = __doc__
INPUT, CLASSES, STEPS_PER_EPOCH = 1024, 10, 64
#: run -> (workers, shards, policy, transport)
RUNS = {
    "shm": (1, 1, "sync", "shm"),
    "tcp": (1, 1, "sync", "tcp"),
    "sync2": (2, 2, "sync", "shm"),
    "async2": (2, 2, "async", "shm"),
}
BOUND = 900.0  # seconds any one run may take


class StepBenchError(ClusterError):
    """A run failed or left too little to measure."""


@dataclasses.dataclass
class Options:
    widths: Sequence[int] = (1024, 4096)
    device: str = "cpu"
    steps: int = 320  # worker 0's steps in each run, rounded up to whole epochs (two workers share the data)
    batch: int = 256
    runs: Sequence[str] = tuple(RUNS)


# ---------------------------------------------------------------- pure helpers (unit-tested)


def model_bytes(width: int) -> int:
    """Bytes of the MLP's float32 weights and biases at hidden width ``width``."""
    return 4 * (INPUT * width + width + width * width + width + width * CLASSES + CLASSES)


def steady(records: Sequence[dict]) -> dict:
    """Steps/s over the second half of ``records`` (step lines: ``wall`` and ``seconds``), and the medians of its
    steps' weights, compute and exchange seconds."""
    if len(records) < 4:
        raise StepBenchError(f"{len(records)} step(s) recorded: too few for a steady state (raise --steps)")
    half = records[len(records) // 2 - 1 :]  # the step before the half marks its start
    walls = [r["wall"] for r in half]
    out = {"steps": len(records), "steps_per_s": (len(walls) - 1) / (walls[-1] - walls[0])}
    for part in ("weights", "compute", "exchange"):
        values = [r["seconds"][part] for r in half[1:] if "seconds" in r]
        out[f"{part}_ms"] = 1e3 * statistics.median(values) if values else None
    return out


def floor_seconds(nbytes: int, to_shard_gbps: float, from_shard_gbps: float, memcpy_gbps: float) -> float:
    """The floor of one exchange of ``nbytes`` of weights: the gradient to the shard and the weights back at the
    rates given (GB/s, 10^9 bytes), and one pass of the update over host memory (read two, write one: 1.5 copies)."""
    return nbytes / (to_shard_gbps * 1e9) + nbytes / (from_shard_gbps * 1e9) + 1.5 * nbytes / (memcpy_gbps * 1e9)


def per_epoch(o: Options) -> int:
    """Steps an epoch of one worker alone (the training set holds as many batches)."""
    return min(o.steps, STEPS_PER_EPOCH)


def sets(width: int, o: Options) -> list[str]:
    """The job's --set flags."""
    return [
        "model.name=mlp",
        f"model.hidden=[{width},{width}]",
        "data.name=synthetic",
        f"data.input_dim={INPUT}",
        f"data.n_train={o.batch * per_epoch(o)}",
        "data.n_test=1024",
        "optimizer.name=sgd",
        f"train.batch_size={o.batch}",
    ]


# ---------------------------------------------------------------- the machine's rates


def host_copy_gbps(nbytes: int, repeats: int = 5) -> float:
    """GB/s of a memory copy of ``nbytes`` as a shard and a worker make it (psgd.wire.sweep, their threads)."""
    from psgd.wire.sweep import PARALLEL_BYTES, Sweep

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    sweep = Sweep(max(nbytes, PARALLEL_BYTES), "bench-copy")
    times = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        sweep.copy([(dst, src)])
        times.append(time.perf_counter() - began)
    sweep.close()
    return nbytes / min(times[1:]) / 1e9


def link_gbps(nbytes: int, device: str) -> tuple[float, float, float]:
    """(to the shard, from the shard, host memory copy) in GB/s: on a GPU, device to a registered segment and back
    (psgd bench gpu's shm part); on a CPU, the memory copy both ways."""
    from psgd.compute import backend

    copy = host_copy_gbps(nbytes)
    dev = backend.get_device(device)
    if not dev.is_gpu:
        return copy, copy, copy
    from psgd.bench.gpu_link import shm_part

    rows = shm_part(dev, SimpleNamespace(transfer_sizes=(nbytes // 4 * 4,), repeats=5, warmup=2))
    rate = {r["direction"]: r["gbps"] for r in rows if r["path"] == "registered"}
    if None in (rate.get("push"), rate.get("pull")):
        raise StepBenchError("the GPU's driver refused to register a segment: no floor through registered memory")
    return rate["push"], rate["pull"], copy


# ---------------------------------------------------------------- the runs


def _psgd(argv: list[str], folder: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "psgd.cli.main", *argv], capture_output=True, text=True, timeout=BOUND, cwd=folder
    )
    if done.returncode:
        raise StepBenchError(f"psgd {' '.join(argv[:1])} exited {done.returncode}: {done.stderr.strip()[-1500:]}")
    return done.stdout


def alone(width: int, o: Options, folder: Path) -> dict:
    run_dir = folder / f"alone-{width}"  # its metrics lines are RUN/local.jsonl, as a launch's are RUN/worker-0.jsonl
    _psgd(
        [
            "train",
            "--device",
            o.device,
            "--epochs",
            str(-(-o.steps // per_epoch(o))),
            "--run-dir",
            str(run_dir),
            "--no-progress",
            "-q",
            *(f for s in sets(width, o) for f in ("--set", s)),
        ],
        folder,
    )
    return steady(read_steps(run_dir / "local.jsonl"))


def launched(width: int, run: str, o: Options, folder: Path) -> dict:
    workers, shards, policy, transport = RUNS[run]
    run_dir = folder / f"{run}-{width}"
    epochs = -(-o.steps * workers // per_epoch(o))  # each worker takes 1/workers of an epoch's batches
    out = json.loads(
        _psgd(
            [
                "launch",
                "--device",
                o.device,
                "--workers",
                str(workers),
                "--shards",
                str(shards),
                "--policy",
                policy,
                "--epochs",
                str(epochs),
                "--set",
                f"cluster.transport={transport}",
                "--run-dir",
                str(run_dir),
                "--no-progress",
                "--json",
                *(f for s in sets(width, o) for f in ("--set", s)),
            ],
            folder,
        )
        .strip()
        .splitlines()[-1]
    )
    result = steady(read_steps(run_dir / "worker-0.jsonl"))
    result["test_accuracy"] = out["test_accuracy"]
    spent = out.get("shard_seconds", {}).get("0")
    if spent and spent["pushes"]:
        result["shard_receive_ms"] = 1e3 * spent["receive"] / spent["pushes"]
        result["shard_apply_ms"] = 1e3 * spent["apply"] / spent["pushes"]
    return result


def measure(o: Options, say=print) -> dict:
    result = {"machine": machine(), "device": o.device, "options": dataclasses.asdict(o), "widths": []}
    say(f"machine: {result['machine']}; device {o.device}")
    with tempfile.TemporaryDirectory(prefix="psgd-bench-step-") as tmp:
        for width in o.widths:
            nbytes = model_bytes(width)
            to_shard, from_shard, copy = link_gbps(nbytes, o.device)
            row = {
                "width": width,
                "bytes": nbytes,
                "to_shard_gbps": to_shard,
                "from_shard_gbps": from_shard,
                "memcpy_gbps": copy,
                "floor_exchange_ms": 1e3 * floor_seconds(nbytes, to_shard, from_shard, copy),
            }
            row["alone"] = alone(width, o, Path(tmp))
            floor_step = 1 / row["alone"]["steps_per_s"] + row["floor_exchange_ms"] / 1e3
            row["floor_steps_per_s"] = 1 / floor_step
            say(
                f"\nwidth {width} ({nbytes / 1e6:.1f} MB): to the shard {to_shard:.1f} GB/s, back {from_shard:.1f}, "
                f"memory copy {copy:.1f}; floor of the exchange {row['floor_exchange_ms']:.2f} ms; alone "
                f"{row['alone']['steps_per_s']:.1f} steps/s; floor of a step behind a shard "
                f"{row['floor_steps_per_s']:.1f} steps/s"
            )
            say(
                f"{'run':>7} {'steps/s':>8} {'/alone':>6} {'/floor':>6} {'compute ms':>10} {'exchange ms':>11} "
                f"{'shard receive ms':>16} {'shard apply ms':>14} {'accuracy':>8}"
            )
            for run in ("alone", *o.runs):
                if run != "alone":
                    row[run] = launched(width, run, o, Path(tmp))
                r = row[run]
                cells = [
                    f"{r['steps_per_s']:8.1f}",
                    f"{r['steps_per_s'] / row['alone']['steps_per_s']:6.2f}",
                    f"{r['steps_per_s'] / row['floor_steps_per_s']:6.2f}",
                ]
                for key, width_ in (
                    ("compute_ms", 10),
                    ("exchange_ms", 11),
                    ("shard_receive_ms", 16),
                    ("shard_apply_ms", 14),
                ):
                    cells.append(f"{r[key]:{width_}.2f}" if r.get(key) is not None else f"{'-':>{width_}}")
                cells.append(f"{r['test_accuracy']:8.3f}" if "test_accuracy" in r else f"{'-':>8}")
                say(f"{run:>7} " + " ".join(cells))
            result["widths"].append(row)
    return result


def _widths(text: str) -> tuple[int, ...]:
    return tuple(comma_list(text, kind=int, what="whole numbers", at_least=1, unique=True))


def _runs(text: str) -> tuple[str, ...]:
    asked = set(comma_list(text, choices=tuple(RUNS), empty=True))
    return tuple(r for r in RUNS if r in asked)


def _steps(text: str) -> int:
    (steps,) = comma_list(text, kind=int, what="a whole number", at_least=8)
    return steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Options()
    parser.add_argument(
        "--device",
        default=d.device,
        help="cpu, cuda or cuda:N: where the workers (and psgd train) compute (default cpu)",
    )
    parser.add_argument(
        "--widths",
        type=_widths,
        default=tuple(d.widths),
        metavar="W,...",
        help=f"hidden widths of the MLP (default {','.join(map(str, d.widths))})",
    )
    parser.add_argument(
        "--steps", type=_steps, default=d.steps, help=f"worker 0's steps a run, at least 8 (default {d.steps})"
    )
    parser.add_argument(
        "--runs",
        type=_runs,
        default=tuple(RUNS),
        metavar="LIST",
        help=f"the launches beside psgd train, of {', '.join(RUNS)} (default all; '' for none)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE")


def run_from_args(args: argparse.Namespace) -> int:
    try:
        result = measure(Options(widths=args.widths, device=args.device, steps=args.steps, runs=args.runs))
    except StepBenchError as exc:
        print(f"psgd bench step: {exc}", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"\nwritten to {args.json}")
    return 0
