"""psgd's training step against PyTorch eager's on the same networks, one CPU thread each, in one interleaved run.

A step is forward, backward and SGD on a batch of ``--batch`` random float32 examples with 10 classes (psgd:
``loss_and_grads`` and :class:`psgd.optim.rules.SGD`; PyTorch: ``cross_entropy(...).backward()`` and
``torch.optim.SGD``).  The networks, shaped alike on both sides (the run refuses to go on if their parameter
counts differ):

  mlp-64, mlp-256, mlp-1024  psgd's built-in MLP on 8x8 inputs, one hidden layer of that width
  cnn          psgd's built-in CNN (channels 8, 16, kernel 3, hidden 64) on 8x8 inputs
  convnet      (B, 8, 64) -> Conv1d to 32 channels -> two pre-norm residual blocks (LayerNorm over the channels,
               Conv1d, ReLU, dropout 0.1, Conv1d, then a max-pool by 2) -> the mean over length -> 10
  gru          (B, 16 steps, 16) -> a GRU of 64 (psgd: RNN(GRUCell); PyTorch: nn.GRU) -> the last step -> 10
  transformer  (B, 16, 64) -> x + multi-head attention (4 heads) of norm(x) -> x + MLP (hidden 128) of norm(x)
               -> the mean over positions -> 10

PyTorch is a peer to measure against, never part of psgd: it runs in ``benchmarks/torch_peer.py`` under the
Python named by ``--torch-python`` (an environment of its own with ``pip install torch numpy``), and psgd's side in
a process of this Python.  The two processes of a pair live through the run and take turns timing a chunk of
``--steps`` steps, the first to go swapping every round; ``--processes`` pairs per network share its ``--rounds``,
started one after the other.  Every process runs on one CPU (``--cpu``) with one thread (OMP, MKL and OpenBLAS
threads 1, ``torch.set_num_threads(1)``), as ``benchmarks/autodiff_step.py`` says why.  The step's time: the median
of the chunks' mean steps; the ratio psgd / PyTorch: the median over the pairs of each one's median ratio of its
chunks.  ``--profile NETWORK`` instead runs psgd's step under cProfile and prints its top lines (no PyTorch needed).
Results and their reading: ``benchmarks/RESULTS.md``.

    python3 -m venv /tmp/torchenv && /tmp/torchenv/bin/pip install torch numpy
    python benchmarks/torch_step.py --torch-python /tmp/torchenv/bin/python --json benchmarks/results/torch/cpu.json
    python benchmarks/torch_step.py --profile gru
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time

import numpy as np

from psgd.autodiff import ops
from psgd.bench.turns import ANSWER_S, Side
from psgd.model import (
    RNN,
    Conv1d,
    Dropout,
    GRUCell,
    LayerNorm,
    Linear,
    MaxPool1d,
    Module,
    MultiHeadAttention,
    Network,
    build_model,
)
from psgd.optim.rules import SGD

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "torch_peer.py")
#: each network's input (one example) and the goal for psgd's step over PyTorch's, on one CPU thread
INPUTS = {
    "mlp-64": (8, 8),
    "mlp-256": (8, 8),
    "mlp-1024": (8, 8),
    "cnn": (8, 8),
    "convnet": (8, 64),
    "gru": (16, 16),
    "transformer": (16, 64),
}
GOALS = {"mlp-64": 0.5, "mlp-256": 0.5, "mlp-1024": 0.5, "cnn": 1.2, "convnet": 1.2, "gru": 1.2, "transformer": 1.2}
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


class Residual(Module):
    """x + conv(dropout(relu(conv(norm(x))))), the norm over the channels; then a max-pool by 2."""

    def __init__(self, channels: int, rate: float = 0.1):
        super().__init__()
        self.norm = LayerNorm(channels)
        self.conv1, self.conv2 = Conv1d(channels, channels, 3), Conv1d(channels, channels, 3)
        self.drop, self.pool = Dropout(rate), MaxPool1d(2)

    def forward(self, x):
        h = ops.transpose(self.norm(ops.transpose(x, (0, 2, 1))), (0, 2, 1))
        h = self.conv2(self.drop(ops.relu(self.conv1(h))))
        return self.pool(ops.add(x, h))


class ConvNet(Network):
    """(B, 8, 64) -> a stem convolution to 32 channels -> two residual blocks -> the mean over length -> 10."""

    def __init__(self, dtype: str = "float32"):
        super().__init__(dtype)
        self.stem = Conv1d(8, 32, 5)
        self.block0, self.block1 = Residual(32), Residual(32)
        self.head = Linear(32, 10, "glorot_uniform")

    def forward(self, x):
        x = self.block1(self.block0(ops.relu(self.stem(x))))
        return self.head(ops.mean(x, axis=2))


class GRUNet(Network):
    """(B, 16 steps, 16) -> RNN(GRUCell) of 64 -> the last step -> 10."""

    def __init__(self, dtype: str = "float32"):
        super().__init__(dtype)
        self.rnn = RNN(GRUCell(16, 64))
        self.head = Linear(64, 10, "glorot_uniform")

    def forward(self, x):
        return self.head(self.rnn(x)[:, -1])


class TransformerNet(Network):
    """(B, 16, 64) -> x + attention(norm(x)), 4 heads -> x + mlp(norm(x)), hidden 128 -> the mean -> 10."""

    def __init__(self, dtype: str = "float32"):
        super().__init__(dtype)
        self.norm1, self.norm2 = LayerNorm(64), LayerNorm(64)
        self.attend = MultiHeadAttention(64, 4)
        self.up, self.down = Linear(64, 128, relu=True), Linear(128, 64, "glorot_uniform")
        self.head = Linear(64, 10, "glorot_uniform")

    def forward(self, x):
        x = ops.add(x, self.attend(self.norm1(x)))
        b, n, d = x.shape
        x = ops.add(x, ops.reshape(self.down(self.up(ops.reshape(self.norm2(x), (b * n, d)))), (b, n, d)))
        return self.head(ops.mean(x, axis=1))


def build(key: str) -> Network:
    """psgd's network ``key`` (float32, 10 classes)."""
    if key.startswith("mlp-"):
        return build_model("mlp", INPUTS[key], 10, hidden=[int(key[4:])])
    if key == "cnn":
        return build_model("cnn", INPUTS[key], 10)
    return {"convnet": ConvNet, "gru": GRUNet, "transformer": TransformerNet}[key]()


def make_step(key: str, batch: int):
    """``(step, parameters)``: one training step of psgd's network ``key`` on a fixed random batch, and the number of
    values it trains."""
    model = build(key)
    params = model.init(0)
    optimizer = SGD(0.01)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch,) + INPUTS[key]).astype("float32")
    y = rng.integers(0, 10, batch)

    def step() -> float:
        loss, grads = model.loss_and_grads(params, x, y)
        for name, grad in grads.items():
            optimizer.update(name, params[name], grad)
        return float(loss)

    return step, sum(p.size for p in params.values())


def serve(key: str, batch: int) -> None:
    """psgd's child: its facts (one JSON line), then for each line ``N`` on stdin N steps and their seconds."""
    import threadpoolctl

    step, parameters = make_step(key, batch)
    step()
    blas = [
        f"{p['internal_api']} {p.get('architecture', '')} threads {p['num_threads']}"
        for p in threadpoolctl.threadpool_info()
    ]
    print(json.dumps({"parameters": parameters, "threads": blas, "version": f"numpy {np.__version__}"}), flush=True)
    for line in sys.stdin:
        n = int(line)
        began = time.perf_counter()
        for _ in range(n):
            step()
        print(time.perf_counter() - began, flush=True)


def compare(key: str, torch_python: str, rounds: int, steps: int, batch: int, processes: int) -> dict:
    """Both sides' chunks (each chunk's mean step, us, in turn), their facts, and each pair's median ratio."""
    argv = {
        "psgd": [sys.executable, os.path.abspath(__file__), "--child", key, str(batch)],
        "torch": [torch_python, PEER, key, str(batch)],
    }
    chunks: dict[str, list[float]] = {"psgd": [], "torch": []}
    each: list[float] = []
    facts: dict = {}
    processes = max(1, min(processes, rounds))
    for p in range(processes):
        children = {
            label: Side(label, command, {**os.environ, **THREADS}, os.path.dirname(HERE), "its network")
            for label, command in argv.items()
        }
        try:
            facts = {label: c.facts for label, c in children.items()}
            if facts["psgd"]["parameters"] != facts["torch"]["parameters"]:
                raise RuntimeError(
                    f"{key}: psgd's network has {facts['psgd']['parameters']} parameters and "
                    f"PyTorch's {facts['torch']['parameters']}: not the same network"
                )
            for child in children.values():  # warmed up alike
                child.seconds(str(max(5, steps // 2)), "steps")
            first = len(chunks["psgd"])
            for turn in range(p * rounds // processes, (p + 1) * rounds // processes):
                for label in ("psgd", "torch") if turn % 2 == 0 else ("torch", "psgd"):
                    chunks[label].append(children[label].seconds(str(steps), f"{steps} steps") / steps * 1e6)
        finally:
            for child in children.values():
                child.close()
        each.append(statistics.median(a / b for a, b in zip(chunks["psgd"][first:], chunks["torch"][first:])))
    return {"chunks_us": chunks, "facts": facts, "process_ratios": each}


def profile(key: str, batch: int, steps: int, top: int = 15) -> str:
    """The top ``top`` lines (by own time) of cProfile over ``steps`` of psgd's step of ``key``."""
    step, _ = make_step(key, batch)
    step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def _has_torch(python: str) -> str | None:
    """None where ``python`` imports torch, else why not (one line)."""
    try:
        done = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True, timeout=ANSWER_S)
    except OSError as e:
        return f"cannot run {python}: {e.strerror}"
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["it failed"])[-1]
        return f"{python} has no PyTorch ({said})"
    return None


def _networks(text: str) -> list[str]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in INPUTS]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(
            f"unknown network(s) {', '.join(unknown) or repr(text)} (networks: {', '.join(INPUTS)})"
        )
    return keys


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1 (got {text!r})")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch-python", help="the Python of an environment with PyTorch (never psgd's own)")
    parser.add_argument(
        "--networks",
        type=_networks,
        default=list(INPUTS),
        help=f"the networks, separated by commas (default all: {','.join(INPUTS)})",
    )
    parser.add_argument("--rounds", type=_positive, default=40, help="chunks each side times per network (default 40)")
    parser.add_argument("--steps", type=_positive, default=10, help="steps in a chunk (default 10)")
    parser.add_argument(
        "--processes",
        type=_positive,
        default=2,
        help="pairs of processes per network, started in turn, the rounds shared among them (default 2)",
    )
    parser.add_argument("--batch", type=_positive, default=32)
    parser.add_argument(
        "--cpu",
        type=int,
        default=max(os.sched_getaffinity(0)),
        help="the CPU every process runs on (default: the highest this process may use); -1 lets "
        "the system place and move them",
    )
    parser.add_argument("--json", help="write every chunk's figures here")
    parser.add_argument(
        "--profile",
        choices=list(INPUTS),
        help="profile psgd's step of this network instead (--rounds x --steps steps) and print cProfile's top lines",
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        serve(args.child[0], int(args.child[1]))
        return 0
    if args.cpu >= 0:  # the children are started from here: they inherit it
        try:
            os.sched_setaffinity(0, {args.cpu})
        except OSError:
            parser.error(f"--cpu {args.cpu}: not a CPU this process may use ({sorted(os.sched_getaffinity(0))})")
    if args.profile:
        print(profile(args.profile, args.batch, args.rounds * args.steps))
        return 0
    if not args.torch_python:
        parser.error("--torch-python: name the Python of an environment with PyTorch (see --help)")
    missing = _has_torch(args.torch_python)
    if missing:
        print(f"torch_step: {missing}; nothing to measure against", file=sys.stderr)
        return 2
    print(f"{'network':12} {'psgd us':>9} {'torch us':>9} {'ratio':>6} {'goal':>5}  each pair of processes' ratio")
    summary, runs = {}, {}
    for key in args.networks:
        run = runs[key] = compare(key, args.torch_python, args.rounds, args.steps, args.batch, args.processes)
        t = {label: statistics.median(c) for label, c in run["chunks_us"].items()}
        ratio = statistics.median(run["process_ratios"])
        summary[key] = {
            "step_us": t,
            "ratio": ratio,
            "goal": GOALS[key],
            "met": ratio <= GOALS[key],
            "process_ratios": run["process_ratios"],
        }
        print(
            f"{key:12} {t['psgd']:9.1f} {t['torch']:9.1f} {ratio:6.2f} {GOALS[key]:5.1f}  "
            f"{' '.join(f'{r:.2f}' for r in run['process_ratios'])}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(),
                    "pinned_to_cpu": args.cpu,
                    "date": time.strftime("%Y-%m-%d"),
                    "rounds": args.rounds,
                    "steps": args.steps,
                    "processes": args.processes,
                    "batch": args.batch,
                    "facts": {key: run["facts"] for key, run in runs.items()},
                    "summary": summary,
                    "runs": runs,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
