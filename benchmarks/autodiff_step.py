"""A built-in model's training step (``loss_and_grads``) with gradients derived by psgd.autodiff, against the same
step with the hand-written backward code it replaced, in one interleaved run.

The hand-written code is the commit before the change, checked out beside (``git worktree add DIR COMMIT``) and
named with ``--before DIR``.  Each version runs in a process of its own; the two take turns timing a chunk of
``--steps`` steps, the first to go swapping every round, so that a change in the machine's speed (a shared machine
can run at half speed for seconds at a time) falls on both halves of a pair alike.  A model's ``--rounds`` are
shared among ``--processes`` such pairs of processes, started one pair after the other: a process that runs slow
all along biases one pair's ratio, not the result.  Every process runs on one CPU (``--cpu``): left to the system,
a process that is moved between cores or shares one can run a third slower than its twin throughout (the ratios
of ten pairs of processes at width 64 spread from 0.90 to 1.57 on a two-core machine; from 1.16 to 1.26 on one).
The step's time: the median over the chunks of each chunk's mean; the ratio: the median over the pairs of
processes of each one's median ratio of its chunks.  Memory: the peak of what NumPy allocates during one step
(tracemalloc), on the digits' shapes (8x8 inputs, 10 classes, batch 32 as psgd launch's default).  Results and
their reading: ``benchmarks/RESULTS.md``.

With ``--device cuda`` the steps are timed on the GPU twice, kernel by kernel and captured as a CUDA graph
(``psgd.compute.graphs.GraphedStep``, as psgd train and psgd-worker run a static step), each chunk ended by a
synchronization; the ratio is the graphed one's.  Memory there: what the CUDA memory pool grew by during one eager
step from an empty pool, and the pool a captured graph keeps.

    git worktree add /tmp/before 0123abc
    python benchmarks/autodiff_step.py --before /tmp/before --json autodiff.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc

MODELS = {
    "mlp-64": ("mlp", {"hidden": [64]}),
    "mlp-256": ("mlp", {"hidden": [256]}),
    "mlp-1024": ("mlp", {"hidden": [1024]}),
    "cnn": ("cnn", {}),
}
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpu_steps(model_key: str, batch: int) -> tuple[dict, dict, object]:
    """The step on NumPy, and its memory figure (psgd imported from whichever tree is first on the path)."""
    import numpy as np

    from psgd.model import build_model

    name, options = MODELS[model_key]
    model = build_model(name, (8, 8), 10, dtype="float32", **options)
    params = model.init(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 8, 8)).astype("float32")
    y = rng.integers(0, 10, batch)

    def step() -> None:
        model.loss_and_grads(params, x, y)

    step()
    tracemalloc.start()
    step()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"step": step}, {"peak_bytes": peak}, lambda: None


def _gpu_steps(model_key: str, batch: int) -> tuple[dict, dict, object]:
    """The step on the GPU, kernel by kernel ("eager") and captured ("step"), and the memory figures."""
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
    graphed = GraphedStep(model, gpu, name=model_key)
    for _ in range(3):  # an eager first step, then the capture
        graphed(params, x, y)
    stream.synchronize()
    facts = {
        "peak_bytes": pool.total_bytes(),
        "captured": graphed.failed is None and graphed.replays > 0,
        "graph_bytes": sum(c.pool.total_bytes() for c in graphed._graphs.values()),
        "failed": graphed.failed,
    }
    return (
        {"step": lambda: graphed(params, x, y), "eager": lambda: model.loss_and_grads(params, x, y)},
        facts,
        stream.synchronize,
    )


def serve(model_key: str, batch: int, device: str) -> None:
    """A child: says its memory figures (one JSON line), then for each line ``KIND N`` on stdin runs N steps of that
    kind and says how many seconds they took, until stdin closes."""
    steps, facts, sync = (_gpu_steps if device == "cuda" else _cpu_steps)(model_key, batch)
    print(json.dumps({**facts, "kinds": sorted(steps)}), flush=True)
    for line in sys.stdin:
        kind, n = line.split()
        step = steps[kind]
        sync()
        began = time.perf_counter()
        for _ in range(int(n)):
            step()
        sync()
        print(time.perf_counter() - began, flush=True)


def start_child(label: str, tree: str, model_key: str, batch: int, device: str):
    """One version's process for one model (a psgd.bench.turns.Side, from this tree: the child imports psgd from
    the tree it times)."""
    from psgd.bench.turns import Side

    path = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    return Side(
        label,
        [sys.executable, os.path.abspath(__file__), "--before", tree, "--child", model_key, str(batch), device],
        env,
        tree,
    )


def compare(
    trees: dict[str, str], model_key: str, rounds: int, steps: int, batch: int, device: str, processes: int
) -> dict:
    """Both versions' figures for one model: per kind of step, each chunk's mean step (us) in turn, the facts, and
    per pair of processes the median of its chunks' ratios (``rounds`` shared among ``processes`` pairs started in
    turn: a process that runs slow throughout, on a core shared with something else, weighs as one of them)."""
    chunks: dict = {}
    each: list[float] = []
    facts: dict = {}
    processes = max(1, min(processes, rounds))
    for p in range(processes):
        children = {label: start_child(label, tree, model_key, batch, device) for label, tree in trees.items()}
        try:
            kinds = children["autodiff"].facts["kinds"]
            for child in children.values():  # warmed up alike
                for kind in kinds:
                    child.seconds(f"{kind} {max(20, steps // 5)}", f"{kind} steps")
            chunks = chunks or {kind: {label: [] for label in trees} for kind in kinds}
            first = len(chunks["step"]["autodiff"])  # this pair's chunks follow
            for turn in range(p * rounds // processes, (p + 1) * rounds // processes):
                for kind in kinds:
                    order = list(trees) if turn % 2 == 0 else list(reversed(trees))
                    for label in order:
                        took = children[label].seconds(f"{kind} {steps}", f"{steps} {kind} steps")
                        chunks[kind][label].append(took / steps * 1e6)
            facts = {label: c.facts for label, c in children.items()}
        finally:
            for child in children.values():
                child.close()
        step = chunks["step"]
        each.append(statistics.median(a / b for a, b in zip(step["autodiff"][first:], step["hand-written"][first:])))
    return {"chunks_us": chunks, "facts": facts, "process_ratios": each}


def _gpu_name() -> str:
    from psgd.compute import backend

    return ", ".join(backend.gpu_names())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a checkout of the commit with the hand-written backward")
    parser.add_argument("--rounds", type=int, default=400, help="chunks each version times per model (default 400)")
    parser.add_argument("--steps", type=int, default=20, help="steps in a chunk (default 20)")
    parser.add_argument(
        "--processes",
        type=int,
        default=10,
        help="pairs of processes per model, started in turn, the rounds shared among them (default 10;"
        " at most one per round)",
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu (NumPy, one thread) or cuda (CuPy: kernel by kernel and graphed)",
    )
    parser.add_argument(
        "--cpu",
        type=int,
        default=max(os.sched_getaffinity(0)),
        help="the CPU both versions' processes run on, one at a time (default: the highest this "
        "process may use); -1 lets the system place and move them",
    )
    parser.add_argument("--json", help="write every chunk's figures here")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        serve(args.child[0], int(args.child[1]), args.child[2])
        return 0
    if not os.path.isdir(os.path.join(args.before, "psgd")):
        parser.error(f"--before {args.before}: not a checkout of psgd (no psgd/ in it)")
    trees = {"hand-written": os.path.abspath(args.before), "autodiff": HERE}
    if args.cpu >= 0:  # the children are started from here: they inherit it
        os.sched_setaffinity(0, {args.cpu})
    print(
        f"{'model':10} {'hand-written us':>16} {'autodiff us':>12} {'ratio':>6} {'peak KB before':>15} "
        f"{'after':>8}  each pair of processes' ratio"
    )
    summary, runs = {}, {}
    for key in MODELS:
        run = runs[key] = compare(trees, key, args.rounds, args.steps, args.batch, args.device, args.processes)
        chunks, facts = run["chunks_us"], run["facts"]
        t = {label: statistics.median(c) for label, c in chunks["step"].items()}
        m = {label: f["peak_bytes"] for label, f in facts.items()}
        each = run["process_ratios"]
        summary[key] = {"step_us": t, "peak_bytes": m, "ratio": statistics.median(each), "process_ratios": each}
        print(
            f"{key:10} {t['hand-written']:16.1f} {t['autodiff']:12.1f} {summary[key]['ratio']:6.3f} "
            f"{m['hand-written'] / 1e3:15.1f} {m['autodiff'] / 1e3:8.1f}  "
            f"{' '.join(f'{r:.3f}' for r in each)}"
        )
        if args.device == "cuda":
            e = summary[key]["eager_us"] = {label: statistics.median(c) for label, c in chunks["eager"].items()}
            summary[key]["captured"] = {label: f["captured"] for label, f in facts.items()}
            summary[key]["graph_bytes"] = {label: f["graph_bytes"] for label, f in facts.items()}
            print(
                f"{'':10} kernel by kernel: {e['hand-written']:.1f} against {e['autodiff']:.1f} us; captured: "
                f"{summary[key]['captured']}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(),
                    "pinned_to_cpu": args.cpu,
                    "processes": args.processes,
                    "device": args.device,
                    "gpu": _gpu_name() if args.device == "cuda" else None,
                    "rounds": args.rounds,
                    "steps": args.steps,
                    "batch": args.batch,
                    "summary": summary,
                    "runs": runs,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
