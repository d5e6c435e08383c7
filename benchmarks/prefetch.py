"""A step's time with a slow loader, the next batch gathered ahead on a thread ([train] prefetch) against gathered in
the step, in one interleaved run, through psgd.train as a user calls it.

The loader stands for storage that answers each batch after a fixed latency (a network file system, an object
store): a dataset whose training rows take ``--latency`` milliseconds to give each batch, then the digits' rows.
Each measurement trains the MLP for ``--epochs`` epochs in one process; a step's time is the run's wall time over
its steps.  The two settings take turns, ``--rounds`` times, so that the machine's drift falls on both alike.
Results and their reading: ``benchmarks/RESULTS.md``.

    python benchmarks/prefetch.py --json benchmarks/results/prefetch/cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import psgd
from psgd.data import Dataset, load_dataset


class SlowRows:
    """Rows that take ``seconds`` to give each batch (the latency of the storage they stand for)."""

    def __init__(self, x, seconds: float):
        self.x, self.seconds = x, seconds
        self.shape, self.dtype, self.ndim = x.shape, x.dtype, x.ndim

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, rows):
        time.sleep(self.seconds)  # the storage's answer, after its latency
        return self.x[rows]


def step_ms(latency_ms: float, prefetch: bool, epochs: int, hidden: int) -> float:
    digits = load_dataset("digits")
    data = Dataset(
        "slow digits",
        SlowRows(digits.x_train, latency_ms / 1e3),
        digits.y_train,
        digits.x_test,
        digits.y_test,
        digits.num_classes,
        digits.input_shape,
    )
    result = psgd.train(
        "mlp", data, epochs=epochs, prefetch=prefetch, model_options={"hidden": [hidden]}, progress=False, threads=1
    )
    return 1e3 * result.seconds / result.steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency", default="0.5,2", help="each batch's latency in ms, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256, help="the MLP's hidden width (its step's compute)")
    parser.add_argument("--json", help="write every turn's figures here")
    args = parser.parse_args()
    latencies = [float(v) for v in args.latency.split(",")]
    turns: dict = {str(ms): {"in the step": [], "ahead": []} for ms in [0.0, *latencies]}
    for _ in range(args.rounds):
        for ms in [0.0, *latencies]:
            for label, on in (("in the step", False), ("ahead", True)):
                turns[str(ms)][label].append(step_ms(ms, on, args.epochs, args.hidden))
    print(f"{'latency ms':>10} {'gathered in the step, ms/step':>30} {'gathered ahead':>15} {'saved':>6}")
    summary = {}
    for ms, by in turns.items():
        t = {label: statistics.median(v) for label, v in by.items()}
        summary[ms] = {**t, "saved": 1 - t["ahead"] / t["in the step"]}
        print(f"{float(ms):10.1f} {t['in the step']:30.3f} {t['ahead']:15.3f} {summary[ms]['saved']:6.0%}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(),
                    "rounds": args.rounds,
                    "epochs": args.epochs,
                    "hidden": args.hidden,
                    "summary": summary,
                    "turns": turns,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
