"""psgd on one GPU against bare CuPy, each figure beside a reference measured in the same run.

  mlp       psgd's own training step: the built-in MLP (input 1024, hidden (w, w),
            10 classes, float32, batch 256, SGD) through psgd's one training loop
            (``psgd.training.loop.run_loop`` with the reference trainer's exchange:
            ``loss_and_grads``, then ``optimizer.update`` for every variable), the
            training set held on the device; the gradient replayed as a CUDA graph
            (psgd ms, as ``psgd train`` runs it) and launched kernel by kernel
            (eager ms, ``[train] graphs = false``).  ms per step and TFLOP/s, counting
            6 x batch x weight elements (forward 2, backward 4), beside the same
            matmuls written bare with CuPy (forward and backward, no input gradient
            for the first layer, as in psgd; psgd/bare is psgd's overhead)
            and the peak of one 8192 x 8192 float32 ``xp.matmul``.
  transfer  the worker's host<->device path for 40 and 400 MB of float32: pull as
            the worker does (``device.asarray(host)``) and into a preallocated
            array (``dev.set(host)``), push (``to_host(dev, out=host)``), each from
            pageable and from pinned (``psgd.compute.backend.host_empty``) memory, in GB/s
            (10^9 B/s) and against a raw pinned ``cudaMemcpy`` each way.
  shm       a GPU worker's bytes on the shared-memory link (psgd.bench.gpu_link):
            between a segment and the device through pinned buffers (two copies,
            as before), straight from the segment, and straight from the segment
            registered with the driver (cudaHostRegister), as a worker now does.
  nccl      psgd's ``NcclCollective.allreduce_`` (one rank) against a bare
            ``NcclCommunicator.allReduce`` + stream synchronize, 1-256 MB.

Each time is the median of --repeats timed runs after warm-ups, the device synchronized
before the clock is read; float32 matmuls are plain float32 unless CUPY_TF32=1.  Each
part is a function (device, Options) -> flat dicts: mlp_part, transfer_part, shm_part, nccl_part.

    psgd bench gpu
    psgd bench gpu --parts transfer --json gpu.json
    psgd bench gpu --widths 1024,4096 --repeats 3 --nccl-mb 1,64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from psgd.bench.gpu_link import shm_part
from psgd.bench.limits import machine, seconds_per_call
from psgd.compute import backend
from psgd.config.parsing import comma_list

MB = 1_000_000
PARTS = ("mlp", "transfer", "shm", "nccl")
INPUT, CLASSES = 1024, 10
H2D, D2H = 1, 2  # cudaMemcpyKind: host to device, device to host

DESCRIPTION = __doc__


@dataclasses.dataclass
class Options:
    """What the parts measure; the defaults are the command's."""

    widths: Sequence[int] = (1024, 2048, 4096, 8192)
    batch: int = 256
    steps: int = 100  # training steps in each timed run of the mlp part (bare steps: calls per timed run)
    repeats: int = 5  # timed runs per figure; the median is reported
    warmup: int = 2  # untimed runs first
    matmul_n: int = 8192
    transfer_sizes: Sequence[int] = (40 * MB, 400 * MB)  # bytes
    nccl_sizes: Sequence[int] = (1 * MB, 16 * MB, 64 * MB, 256 * MB)  # bytes
    lr: float = 0.1


# ---------------------------------------------------------------- pure helpers (tested without a GPU)


def mlp_step_flops(batch: int, widths: Sequence[int]) -> int:
    """Flops of one training step of a dense chain with layer ``widths`` (input, hidden..., classes):
    6 x batch x weight-matrix elements (forward 2, backward 4: input and weight gradients)."""
    return 6 * int(batch) * sum(int(a) * int(b) for a, b in zip(widths, widths[1:]))


def positive_ints(text: str) -> tuple[int, ...]:
    """``"1024,2048"`` -> (1024, 2048); anything else is an argparse error saying what was wrong."""
    return tuple(comma_list(text, kind=int, what="whole numbers", at_least=1, unique=True))


def positive_int(text: str) -> int:
    values = positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one whole number, got {text!r}")
    return values[0]


def sizes_mb(text: str) -> tuple[int, ...]:
    """``"1,0.5,400"`` (MB, 10^6 bytes) -> byte counts, each a whole number of float32s (at least one)."""
    values = comma_list(text, kind=float, what="sizes in MB")
    if not all(math.isfinite(v) and v * MB >= 4 for v in values):
        raise argparse.ArgumentTypeError(f"every size must be a finite number of MB, at least 4 bytes, got {text!r}")
    return tuple(dict.fromkeys(int(v * MB) // 4 * 4 for v in values))


def parse_parts(text: str) -> tuple[str, ...]:
    """``"nccl,mlp"`` -> ("mlp", "nccl"): known parts only, in the order they run."""
    asked = set(comma_list(text, choices=PARTS))
    return tuple(p for p in PARTS if p in asked)


# ---------------------------------------------------------------- part 1: psgd's training step


def matmul_tflops(device: backend.Device, n: int, o: Options) -> float:
    """TFLOP/s of one n x n float32 ``xp.matmul`` into a preallocated output (2 n^3 flops)."""
    xp, rng = device.xp, np.random.default_rng(1)
    a, b = (device.asarray(rng.random((n, n), dtype=np.float32)) for _ in range(2))
    c = xp.empty((n, n), dtype=np.float32)
    seconds = seconds_per_call(lambda: xp.matmul(a, b, out=c), device, repeats=o.repeats, warmup=o.warmup)
    return 2 * n**3 / seconds / 1e12


def bare_step_seconds(device: backend.Device, width: int, o: Options) -> float:
    """One step's matmuls written bare with xp, for psgd's MLP shapes: 3 forward, 5 backward."""
    rng = np.random.default_rng(2)
    x, w1, w2, w3, dout = (
        device.asarray(rng.random(shape, dtype=np.float32) - 0.5)
        for shape in ((o.batch, INPUT), (INPUT, width), (width, width), (width, CLASSES), (o.batch, CLASSES))
    )

    def step() -> tuple:
        h1 = x @ w1
        h2 = h1 @ w2
        scores = h2 @ w3
        dh2 = dout @ w3.T
        dh1 = dh2 @ w2.T
        # the class scores and the three weight gradients (no input gradient: training needs none)
        return scores, h2.T @ dout, h1.T @ dh2, x.T @ dh1

    return seconds_per_call(step, device, repeats=o.repeats, warmup=o.warmup, calls=o.steps)


def psgd_step_seconds(device: backend.Device, width: int, o: Options, graphs: bool = True) -> float:
    """Seconds per step of psgd's training loop (the reference trainer's: gradient, then SGD on every
    variable) for the MLP of ``width``, the data on the device: median over runs of ``o.steps`` steps,
    the loss read at the end of every step as the loop does; the gradient replayed as a CUDA graph
    (``[train] graphs``, the default) or launched kernel by kernel."""
    from psgd.config import JobConfig
    from psgd.data import Dataset
    from psgd.job import build_job
    from psgd.training.local import LocalExchange
    from psgd.training.loop import run_loop

    config = JobConfig()
    config = config.apply_sets(
        [
            "model.name=mlp",
            f"model.hidden=[{width}, {width}]",
            "data.name=synthetic",
            "optimizer.name=sgd",
            f"optimizer.lr={o.lr}",
            f"train.batch_size={o.batch}",
            "train.epochs=1",
            f"train.device={device}",
            "train.dtype=float32",
            f"train.graphs={str(graphs).lower()}",
        ]
    )
    rng = np.random.default_rng(3)
    n = o.steps * o.batch
    x = device.asarray(rng.random((n, INPUT), dtype=np.float32))
    y = device.asarray(rng.integers(0, CLASSES, n))
    job = build_job(config, Dataset("gpu-bench", x, y, x[: o.batch], y[: o.batch], CLASSES, (INPUT,)))
    exchange = LocalExchange(job)  # its final weights are copied to the host after each run, off the clock

    def run() -> float:
        # steady state: from the end of the second step to the end of the last (each ends reading its
        # loss, which waits for the step's work), so the run's start-up and the graph's capture (the
        # first step runs kernel by kernel, the second is captured) stay off the clock
        walls: list[float] = []
        backend.synchronize(device)
        run_loop(
            job,
            exchange,
            evaluate_every=0,
            final_evaluation=False,
            progress=False,
            on_step=lambda point: walls.append(point["wall"]),
        )
        first = 1 if len(walls) > 2 else 0
        return (walls[-1] - walls[first]) / max(len(walls) - 1 - first, 1)

    for _ in range(o.warmup):
        run()
    return float(np.median([run() for _ in range(o.repeats)]))


def mlp_part(device: backend.Device, o: Options) -> list[dict]:
    """One row per width: psgd's step and the bare one, in ms and TFLOP/s, and their ratios to the peak."""
    device.use()
    peak = matmul_tflops(device, o.matmul_n, o)
    rows = []
    for width in o.widths:
        flops = mlp_step_flops(o.batch, (INPUT, width, width, CLASSES))
        bare = bare_step_seconds(device, width, o)
        psgd = psgd_step_seconds(device, width, o)
        eager = psgd_step_seconds(device, width, o, graphs=False)
        rows.append(
            {
                "part": "mlp",
                "width": width,
                "batch": o.batch,
                "flops": flops,
                "psgd_ms": psgd * 1e3,
                "psgd_tflops": flops / psgd / 1e12,
                "eager_ms": eager * 1e3,
                "bare_ms": bare * 1e3,
                "bare_tflops": flops / bare / 1e12,
                "matmul_n": o.matmul_n,
                "matmul_tflops": peak,
                "psgd_over_peak": flops / psgd / 1e12 / peak,
                "bare_over_peak": flops / bare / 1e12 / peak,
                "psgd_over_bare": psgd / bare,
            }
        )
    return rows


# ---------------------------------------------------------------- part 2: host <-> device


def transfer_part(device: backend.Device, o: Options) -> list[dict]:
    """Per size: the raw pinned memcpy each way, then each psgd path from pageable and pinned memory."""
    device.use()
    xp = device.xp
    runtime = xp.cuda.runtime
    rows = []
    for size in o.transfer_sizes:
        n = size // 4
        dev = xp.ones(n, dtype=np.float32)
        pinned = backend.host_empty((n,), np.float32, device)
        pageable = np.empty(n, dtype=np.float32)
        pinned.fill(1.0)
        pageable.fill(1.0)  # touched: every page is mapped before the clock starts

        def raw(kind: int) -> None:
            dst, src = (dev.data.ptr, pinned.ctypes.data) if kind == H2D else (pinned.ctypes.data, dev.data.ptr)
            runtime.memcpy(dst, src, size, kind)
            runtime.deviceSynchronize()

        raw_gbps = {}
        for direction, kind in (("pull", H2D), ("push", D2H)):
            s = seconds_per_call(lambda: raw(kind), device, repeats=o.repeats, warmup=o.warmup)
            raw_gbps[direction] = size / s / 1e9
            rows.append(_transfer_row(size, "pinned", direction, "raw cudaMemcpy", s, raw_gbps[direction]))
        for kind_of_host, host in (("pageable", pageable), ("pinned", pinned)):
            paths = (
                ("pull", "device.asarray(host)", lambda h=host: device.asarray(h)),
                ("pull", "dev.set(host)", lambda h=host: dev.set(h)),
                ("push", "to_host(dev, out=host)", lambda h=host: backend.to_host(dev, out=h)),
            )
            for direction, name, fn in paths:
                s = seconds_per_call(fn, device, repeats=o.repeats, warmup=o.warmup)
                rows.append(_transfer_row(size, kind_of_host, direction, name, s, raw_gbps[direction]))
    return rows


def _transfer_row(size: int, host: str, direction: str, path: str, seconds: float, raw_gbps: float) -> dict:
    gbps = size / seconds / 1e9
    return {
        "part": "transfer",
        "size_bytes": size,
        "size_mb": size / MB,
        "host": host,
        "direction": direction,
        "path": path,
        "ms": seconds * 1e3,
        "gbps": gbps,
        "raw_gbps": raw_gbps,
        "over_raw": gbps / raw_gbps,
    }


# ---------------------------------------------------------------- part 3: NCCL all-reduce


def nccl_part(device: backend.Device, o: Options) -> list[dict]:
    """Per size: psgd's one-rank all-reduce and a bare communicator's, in ms and algorithm GB/s.

    If psgd's collective cannot be created, its figures are None and ``psgd_error`` says why."""
    from psgd.collective.nccl import NcclCollective

    device.use()
    xp, nccl = device.xp, backend.nccl_module()
    stream = xp.cuda.get_current_stream()
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)  # the id exactly as get_unique_id gives it
    group, error, rows = None, None, []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                group = NcclCollective(0, 1, device, rendezvous=f"file:{tmp}/nccl-id.json", timeout=60)
            except Exception as exc:  # reported in every row: the bare figures still stand
                error = f"{type(exc).__name__}: {exc}"
            for size in o.nccl_sizes:
                buf = xp.ones(size // 4, dtype=np.float32)

                def bare(buf=buf) -> None:
                    comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
                    stream.synchronize()

                timing = dict(repeats=o.repeats, warmup=o.warmup, calls=10)
                bare_s = seconds_per_call(bare, device, **timing)
                row = {
                    "part": "nccl",
                    "size_bytes": size,
                    "size_mb": size / MB,
                    "bare_ms": bare_s * 1e3,
                    "bare_algbw_gbps": size / bare_s / 1e9,
                    "psgd_ms": None,
                    "psgd_algbw_gbps": None,
                    "psgd_over_bare": None,
                    **({"psgd_error": error} if error else {}),
                }
                if group is not None:
                    psgd_s = seconds_per_call(lambda buf=buf: group.allreduce_(buf), device, **timing)
                    row.update(
                        psgd_ms=psgd_s * 1e3, psgd_algbw_gbps=size / psgd_s / 1e9, psgd_over_bare=psgd_s / bare_s
                    )
                rows.append(row)
    finally:
        if group is not None:
            group.close()
        comm.destroy()
    return rows


# ---------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Options()
    mb = lambda sizes: ",".join(f"{s / MB:g}" for s in sizes)  # noqa: E731
    parser.add_argument(
        "--parts",
        type=parse_parts,
        default=PARTS,
        metavar="PART,...",
        help="which parts to run: mlp, transfer, shm, nccl (default all four)",
    )
    parser.add_argument("--device", default="cuda:0", help="the GPU to measure (default cuda:0)")
    parser.add_argument(
        "--widths",
        type=positive_ints,
        default=tuple(d.widths),
        metavar="W,...",
        help=f"mlp: hidden widths (default {','.join(map(str, d.widths))})",
    )
    parser.add_argument("--batch", type=positive_int, default=d.batch, help=f"mlp: batch size (default {d.batch})")
    parser.add_argument(
        "--steps", type=positive_int, default=d.steps, help=f"mlp: training steps in each timed run (default {d.steps})"
    )
    parser.add_argument(
        "--matmul-n",
        type=positive_int,
        default=d.matmul_n,
        help=f"mlp: size of the n x n matmul peak (default {d.matmul_n})",
    )
    parser.add_argument(
        "--transfer-mb",
        type=sizes_mb,
        default=tuple(d.transfer_sizes),
        metavar="MB,...",
        help=f"transfer: sizes in MB, 10^6 bytes (default {mb(d.transfer_sizes)})",
    )
    parser.add_argument(
        "--nccl-mb",
        type=sizes_mb,
        default=tuple(d.nccl_sizes),
        metavar="MB,...",
        help=f"nccl: sizes in MB (default {mb(d.nccl_sizes)})",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=d.repeats,
        help=f"timed runs per figure; the median is reported (default {d.repeats})",
    )
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE")


#: each part's table: (header, row key, width (negative: left-aligned), precision and type)
COLUMNS = {
    "mlp": [
        ("width", "width", 6, "d"),
        ("psgd ms", "psgd_ms", 8, ".3f"),
        ("TFLOP/s", "psgd_tflops", 8, ".2f"),
        ("eager ms", "eager_ms", 8, ".3f"),
        ("/peak", "psgd_over_peak", 6, ".2f"),
        ("bare ms", "bare_ms", 8, ".3f"),
        ("TFLOP/s", "bare_tflops", 8, ".2f"),
        ("/peak", "bare_over_peak", 6, ".2f"),
        ("psgd/bare", "psgd_over_bare", 9, ".2f"),
    ],
    "transfer": [
        ("size MB", "size_mb", 8, "g"),
        ("host", "host", 8, ""),
        ("way", "direction", 4, ""),
        ("path", "path", -24, ""),
        ("ms", "ms", 8, ".2f"),
        ("GB/s", "gbps", 7, ".2f"),
        ("/raw", "over_raw", 5, ".2f"),
    ],
    "shm": [
        ("size MB", "size_mb", 8, "g"),
        ("way", "direction", 4, ""),
        ("path", "path", -10, ""),
        ("ms", "ms", 8, ".2f"),
        ("GB/s", "gbps", 7, ".2f"),
        ("x 2 copies", "over_two_copies", 10, ".2f"),
    ],
    "nccl": [
        ("size MB", "size_mb", 8, "g"),
        ("psgd ms", "psgd_ms", 8, ".3f"),
        ("bare ms", "bare_ms", 8, ".3f"),
        ("psgd/bare", "psgd_over_bare", 9, ".2f"),
        ("psgd GB/s", "psgd_algbw_gbps", 9, ".2f"),
        ("bare GB/s", "bare_algbw_gbps", 9, ".2f"),
    ],
}
TITLES = {
    "transfer": "transfer: float32, GB/s = 10^9 bytes/s; /raw: against a raw pinned cudaMemcpy the same way",
    "shm": "shm: float32 between a shared-memory segment and the device, GB/s = 10^9 bytes/s; "
    "x 2 copies: against staging through pinned buffers",
    "nccl": "nccl: one-rank all-reduce (sum) of float32, each call waited for",
}


def print_table(part: str, rows: list[dict]) -> None:
    """A part's title line, then its rows under COLUMNS[part] (a missing figure prints as "-")."""
    if part == "mlp":
        tf32 = "on" if os.environ.get("CUPY_TF32", "0") not in ("", "0") else "off"
        r = rows[0]
        print(
            f"mlp: input {INPUT}, hidden (w, w), {CLASSES} classes, float32 (TF32 {tf32}), batch {r['batch']}, "
            f"SGD; peak {r['matmul_n']}^2 xp.matmul {r['matmul_tflops']:.3g} TFLOP/s"
        )
    else:
        print(TITLES[part])
    cell = lambda width, value, kind="": format(value, f"{'<' if width < 0 else '>'}{abs(width)}{kind}")  # noqa: E731
    print(" ".join(cell(width, header) for header, _, width, _ in COLUMNS[part]))
    for r in rows:
        print(
            " ".join(
                cell(width, "-") if r.get(key) is None else cell(width, r[key], kind)
                for _, key, width, kind in COLUMNS[part]
            )
        )
    for error in sorted({r["psgd_error"] for r in rows if r.get("psgd_error")}):
        print(f"{part}: psgd's side could not be measured: {error}")


PART_FUNCTIONS = {"mlp": mlp_part, "transfer": transfer_part, "shm": shm_part, "nccl": nccl_part}


def run_from_args(args: argparse.Namespace) -> int:
    """``psgd bench gpu``: 2 with one line on stderr when no usable GPU is here."""
    try:
        device = backend.get_device(args.device)
        if not device.is_gpu:
            raise backend.DeviceError(f"this benchmark measures a CUDA device, not {device}; use --device cuda:N")
    except backend.DeviceError as exc:
        print(f"psgd bench gpu: no usable GPU: {exc}", file=sys.stderr)
        return 2
    options = Options(
        widths=args.widths,
        batch=args.batch,
        steps=args.steps,
        repeats=args.repeats,
        matmul_n=args.matmul_n,
        transfer_sizes=args.transfer_mb,
        nccl_sizes=args.nccl_mb,
    )
    device.use()
    name = device.xp.cuda.runtime.getDeviceProperties(device.index)["name"]
    name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
    print(f"machine: {machine()}, GPU {name} ({device}), CuPy {device.xp.__version__}", flush=True)
    result: dict[str, Any] = {
        "machine": machine(),
        "gpu": name,
        "device": str(device),
        "cupy": device.xp.__version__,
        "cupy_tf32": os.environ.get("CUPY_TF32", ""),
        "options": dataclasses.asdict(options),
    }
    failed = []
    for part in args.parts:
        print()
        try:
            rows = PART_FUNCTIONS[part](device, options)
        except backend.DeviceError as exc:  # e.g. no NCCL: say so, and go on with the other parts
            print(f"{part}: not measured: {exc}", flush=True)
            result[part], failed = {"error": str(exc)}, failed + [part]
            continue
        result[part] = rows
        print_table(part, rows)
        sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"\nwritten to {args.json}")
    return 1 if failed else 0
