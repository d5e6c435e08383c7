"""A built-in MLP's training step counted instead of timed, where a shared machine's timings move by more than the
difference sought: cachegrind's instructions, data reads, cache misses and mispredicted branches per step.

Three versions of the step on the digits' shapes (8x8 inputs, 10 classes, batch 32, float32):

- ``hand-written``: ``loss_and_grads`` of the commit with the hand-written backward, checked out beside
  (``--before``);
- ``derived``: ``loss_and_grads`` of this tree, its gradients derived by psgd.autodiff;
- ``tape``: the same operations of this tree called directly, the parameters made tensors by hand and the
  network's ``inputs`` making its input: the tape without the module layer (a call's binding, the parameters
  read through their descriptors, the modules' ``forward`` and ``loss_and_grads``' bookkeeping).

Each figure is the difference between two runs of one process under cachegrind, ``--steps`` apart, divided by the
steps between them: what building the model and importing cost falls out.  Needs valgrind.  Results and their
reading: ``benchmarks/RESULTS.md``.

    git worktree add /tmp/before 0123abc
    python benchmarks/autodiff_count.py --before /tmp/before --width 64
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSIONS = ("hand-written", "derived", "tape")
SHOWN = ("Ir", "Dr", "D1mr", "Bcm", "Bim")  # instructions, data reads, L1 data read misses, mispredicted branches
RUN_S = 900  # the longest one run under cachegrind may take


def child(version: str, width: int, steps: int, batch: int) -> None:
    """Runs ``steps`` steps of ``version`` (psgd imported from whichever tree is first on the path)."""
    import numpy as np

    from psgd.model import build_model

    model = build_model("mlp", (8, 8), 10, dtype="float32", hidden=[width])
    params = model.init(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 8, 8)).astype("float32")
    y = rng.integers(0, 10, batch)
    step = tape_step(model) if version == "tape" else model.loss_and_grads
    for _ in range(steps):
        step(params, x, y)


def tape_step(model):
    """The MLP's step on the tape without the module layer, as ``step(params, x, y)`` (imported and worked out here,
    not on every step; the hand-written tree's models have no modules)."""
    from psgd.autodiff import Tensor, backward, nn

    layers = [(f"dense{n}/W", f"dense{n}/b", layer.relu) for n, layer in enumerate(model.chain)]

    def step(params, x, y) -> dict:
        leaves = {name: Tensor(value, True, name) for name, value in params.items()}
        h = model.inputs(params, x)
        for w, b, relu in layers:
            h = nn.linear(h, leaves[w], leaves[b], relu)
        backward(nn.cross_entropy(h, y))
        return {name: leaf.grad for name, leaf in leaves.items()}

    return step


def count(tree: str, version: str, width: int, steps: int, batch: int) -> dict[str, int]:
    """Cachegrind's totals for one process that runs ``steps`` steps of ``version`` from ``tree``."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "counts")
        env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        done = subprocess.run(
            [
                "valgrind",
                "--tool=cachegrind",
                "--cache-sim=yes",
                "--branch-sim=yes",
                f"--cachegrind-out-file={out}",
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                version,
                str(width),
                str(steps),
                str(batch),
            ],
            env=env,
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=RUN_S,
        )
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(
                f"{version}, {steps} steps, under cachegrind: exit {done.returncode}: {done.stderr[-2000:]}"
            )
        events = summary = None
        with open(out) as f:
            for line in f:
                if line.startswith("events:"):
                    events = line.split()[1:]
                elif line.startswith("summary:"):
                    summary = [int(v) for v in line.split()[1:]]
    if events is None or summary is None:
        raise RuntimeError(f"{version}: cachegrind wrote no totals")
    return dict(zip(events, summary))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="a checkout of the commit with the hand-written backward (needed)")
    parser.add_argument("--width", type=int, default=64, help="the MLP's hidden width (default 64)")
    parser.add_argument(
        "--steps",
        type=int,
        nargs=2,
        default=[50, 250],
        metavar=("FEW", "MANY"),
        help="steps of the two runs whose difference is counted (default 50 250)",
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at once (default: the CPUs)")
    parser.add_argument("--json", help="write the counts here")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]), int(args.child[3]))
        return 0
    if shutil.which("valgrind") is None:
        parser.error("needs valgrind (cachegrind) on the PATH")
    if not args.before or not os.path.isdir(os.path.join(args.before, "psgd")):
        parser.error(f"--before {args.before}: not a checkout of psgd (no psgd/ in it)")
    few, many = args.steps
    if not 0 <= few < many:
        parser.error(f"--steps {few} {many}: need 0 <= FEW < MANY")
    trees = {"hand-written": os.path.abspath(args.before), "derived": HERE, "tape": HERE}
    runs = [(version, n) for version in VERSIONS for n in (few, many)]
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        totals = dict(
            zip(runs, pool.map(lambda run: count(trees[run[0]], run[0], args.width, run[1], args.batch), runs))
        )
    per_step = {
        version: {
            event: (totals[(version, many)][event] - totals[(version, few)][event]) / (many - few)
            for event in totals[(version, many)]
        }
        for version in VERSIONS
    }
    base = per_step["hand-written"]
    print(f"MLP, hidden {args.width}, batch {args.batch}: per step, by cachegrind ({many} steps less {few})")
    print(f"{'version':14}" + "".join(f"{event:>18}" for event in SHOWN))
    for version in VERSIONS:
        cells = []
        for event in SHOWN:
            value = per_step[version][event]
            cells.append(f"{value:10.0f} ({value / base[event] - 1:+.1%})" if base[event] else f"{value:18.0f}")
        print(f"{version:14}" + "".join(f"{c:>18}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "width": args.width,
                    "batch": args.batch,
                    "steps": [few, many],
                    "per_step": per_step,
                    "totals": {f"{v} {n}": t for (v, n), t in totals.items()},
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
