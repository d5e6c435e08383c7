"""A built-in model's training step (``loss_and_grads``) with gradients derived by psgd.autodiff, against the same
step with the hand-written backward code it replaced, in one interleaved run.

The hand-written code is the commit before the change, checked out beside (``git worktree add DIR COMMIT``) and
named with ``--before DIR``; each measurement runs in a process of its own, the two versions taking turns, so that
the machine's drift falls on both alike.  A measurement: the median time of ``--steps`` steps after a warm-up,
and the peak of the memory NumPy allocates during one step (tracemalloc), on the digits' shapes (8x8 inputs, 10
classes, batch 32 as psgd launch's default).  Results and their reading: ``benchmarks/RESULTS.md``.

With ``--device cuda`` a turn times the step on the GPU twice, kernel by kernel and captured as a CUDA graph
(``psgd.compute.graphs.GraphedStep``, as psgd train and psgd-worker run a static step), each the median over chunks of 50
steps ended by a synchronization; the ratio is the graphed one's.  Memory there: what the CUDA memory pool grew by
during one eager step from an empty pool, and the pool a captured graph keeps.

    git worktree add /tmp/before 0123abc
    python benchmarks/autodiff_step.py --before /tmp/before --json autodiff.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc

MODELS = {"mlp-64": ("mlp", {"hidden": [64]}), "mlp-256": ("mlp", {"hidden": [256]}),
          "mlp-1024": ("mlp", {"hidden": [1024]}), "cnn": ("cnn", {})}
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(model_key: str, steps: int, batch: int) -> dict:
    """One process's figures for ``model_key`` (psgd imported from whichever tree is first on the path)."""
    import numpy as np

    from psgd.model import build_model

    name, options = MODELS[model_key]
    model = build_model(name, (8, 8), 10, dtype="float32", **options)
    params = model.init(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 8, 8)).astype("float32")
    y = rng.integers(0, 10, batch)
    for _ in range(20):
        model.loss_and_grads(params, x, y)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        model.loss_and_grads(params, x, y)
        times.append(time.perf_counter() - began)
    tracemalloc.start()
    model.loss_and_grads(params, x, y)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"step_us": statistics.median(times) * 1e6, "peak_bytes": peak}


def measure_gpu(model_key: str, steps: int, batch: int) -> dict:
    """One process's figures for ``model_key`` on the GPU: graphed and kernel by kernel."""
    import cupy
    import numpy as np

    from psgd.compute import backend
    from psgd.compute.graphs import GraphedStep
    from psgd.model import build_model

    gpu = backend.get_device("cuda")
    name, options = MODELS[model_key]
    model = build_model(name, (8, 8), 10, dtype="float32", **options)
    rng = np.random.default_rng(0)
    params = {k: gpu.asarray(v) for k, v in model.init(0).items()}
    x, y = gpu.asarray(rng.standard_normal((batch, 8, 8)).astype("float32")), gpu.asarray(rng.integers(0, 10, batch))
    stream = cupy.cuda.get_current_stream()
    model.loss_and_grads(params, x, y)  # kernels compiled
    pool = cupy.cuda.MemoryPool()
    with cupy.cuda.using_allocator(pool.malloc):
        model.loss_and_grads(params, x, y)
        stream.synchronize()
    peak = pool.total_bytes()

    def timed(step) -> float:
        for _ in range(20):
            step(params, x, y)
        stream.synchronize()
        chunks = []
        for _ in range(max(1, steps // 50)):
            began = time.perf_counter()
            for _ in range(50):
                step(params, x, y)
            stream.synchronize()
            chunks.append((time.perf_counter() - began) / 50)
        return statistics.median(chunks) * 1e6

    eager = timed(model.loss_and_grads)
    graphed = GraphedStep(model, gpu, name=model_key)
    graphed_us = timed(graphed)
    return {"step_us": graphed_us, "eager_us": eager, "peak_bytes": peak,
            "graph_bytes": sum(c.pool.total_bytes() for c in graphed._graphs.values()),
            "captured": graphed.failed is None and graphed.replays > 0, "failed": graphed.failed}


def _gpu_name() -> str:
    from psgd.compute import backend

    return ", ".join(backend.gpu_names())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a checkout of the commit with the hand-written backward")
    parser.add_argument("--rounds", type=int, default=5, help="turns each version takes per model (default 5)")
    parser.add_argument("--steps", type=int, default=300, help="steps timed per turn (default 300)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu (NumPy, one thread) or cuda (CuPy: kernel by kernel and graphed)")
    parser.add_argument("--json", help="write every turn's figures here")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        how = measure_gpu if args.child[3] == "cuda" else measure
        print(json.dumps(how(args.child[0], int(args.child[1]), int(args.child[2]))))
        return 0
    trees = {"hand-written": os.path.abspath(args.before), "autodiff": HERE}
    turns: dict = {k: {t: [] for t in trees} for k in MODELS}
    for _ in range(args.rounds):
        for key in MODELS:
            for label, tree in trees.items():
                path = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)
                env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
                child = [key, str(args.steps), str(args.batch), args.device]
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--before", tree, "--child", *child],
                                     env=env, capture_output=True, text=True, check=True, cwd=tree)
                turns[key][label].append(json.loads(out.stdout))
    print(f"{'model':10} {'hand-written us':>16} {'autodiff us':>12} {'ratio':>6} {'peak KB before':>15} "
          f"{'after':>8}")
    summary = {}
    for key, by in turns.items():
        t = {label: statistics.median(r["step_us"] for r in rows) for label, rows in by.items()}
        m = {label: max(r["peak_bytes"] for r in rows) for label, rows in by.items()}
        summary[key] = {"step_us": t, "peak_bytes": m, "ratio": t["autodiff"] / t["hand-written"]}
        print(f"{key:10} {t['hand-written']:16.1f} {t['autodiff']:12.1f} {summary[key]['ratio']:6.3f} "
              f"{m['hand-written'] / 1e3:15.1f} {m['autodiff'] / 1e3:8.1f}")
        if args.device == "cuda":
            e = summary[key]["eager_us"] = {label: statistics.median(r["eager_us"] for r in rows)
                                            for label, rows in by.items()}
            summary[key]["captured"] = {label: all(r["captured"] for r in rows) for label, rows in by.items()}
            print(f"{'':10} kernel by kernel: {e['hand-written']:.1f} against {e['autodiff']:.1f} us; captured: "
                  f"{summary[key]['captured']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                       "device": args.device, "gpu": _gpu_name() if args.device == "cuda" else None,
                       "rounds": args.rounds, "steps": args.steps, "batch": args.batch, "summary": summary,
                       "turns": turns}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
