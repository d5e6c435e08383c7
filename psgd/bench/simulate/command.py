"""``psgd bench simulate``: :data:`DESCRIPTION` (its help), :func:`add_arguments` and :func:`run_from_args`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

from psgd.bench.simulate.job import Costs, Layout, simulate

DESCRIPTION = """Simulate psgd jobs from what their parts cost on this machine, and check the simulation against
launches here before it predicts anything past this machine.

A discrete-event simulation of the job as psgd runs it: workers computing
gradients on their host's cores, shards applying pushes one at a time under
their lock, bytes over each host's link (full duplex, a rate per link), and
the policies as psgd implements them (sync rounds, with backup workers;
async; ssp's bound), beside ring all-reduce.  What each part costs is
measured here first, as psgd runs them: a gradient (psgd train), what two
busy processes get from the cores, a shard's and a worker's CPU for a
request and a round trip's wait (one psgd-server process and one worker at
two sizes), and psgd's all-reduce between two ranks (mpi extra); or read
back from a file an earlier run wrote (--costs).

    psgd bench simulate --validate --json sim.json
    psgd bench simulate --validate --costs sim.json   # the costs measured before, the launches again

--validate runs psgd launch for 1, 2 and 4 workers with 1 and 2 shards
under sync, async and ssp, and all-reduce with 2 and 4 ranks, on this
machine, and prints each beside the simulation of the same job on one host
with the measured costs, with the error.  Predictions for many workers,
shards and links come once the simulation is within 15% of every launch
here; benchmarks/RESULTS.md says how far it is.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--validate", action="store_true",
                        help="launch the validation grid here and print measured against simulated steps/s")
    parser.add_argument("--width", type=int, default=64,
                        help="the digits MLP's hidden width whose costs are measured (default 64)")
    parser.add_argument("--costs", type=Path, default=None, help="read the costs from this file (a --json of an "
                        "earlier run) instead of measuring them")
    parser.add_argument("--repeats", type=int, default=2, help="--validate: launches of each job (default 2)")
    parser.add_argument("--json", type=Path, default=None, help="write the costs and every figure here")


def _model_bytes(width: int) -> int:
    """Bytes of the digits MLP of one hidden layer of ``width`` (64 inputs, 10 classes, float32, with biases)."""
    return 4 * (64 * width + width + width * 10 + 10)


def _costs(args: argparse.Namespace, say) -> tuple[Costs, dict]:
    if args.costs is not None:
        saved = json.loads(args.costs.read_text())
        return Costs(**saved["costs"]), saved.get("calibration", {})
    from psgd.bench.simulate.calibrate import measure

    say(f"measuring the costs here (digits MLP {args.width}, {_model_bytes(args.width):,} bytes):")
    return measure(args.width, _model_bytes(args.width), say)


def validation_grid(have_allreduce: bool) -> list[tuple[int, int, str]]:
    """(workers, shards, policy) of every validation run."""
    grid = [(n, k, policy) for policy in ("sync", "async", "ssp") for k in (1, 2) for n in (1, 2, 4)]
    return grid + ([(n, 1, "allreduce") for n in (2, 4)] if have_allreduce else [])


def _watching(workers: int, shards: int, policy: str) -> bool:
    """Whether psgd launch has the job's data connections watch on this machine (its rule, psgd.launch.layout)."""
    from psgd.launch.layout import busy_poll

    return policy != "allreduce" and busy_poll(workers + shards)[0] > 0


def validate(costs: Costs, calibration: dict, width: int, repeats: int, say) -> list[dict]:
    """Each job of the grid launched here ``repeats`` times and simulated on one host; measured, simulated, error."""
    from psgd.bench.scaling.grid import Run
    from psgd.bench.scaling.runner import execute

    rows = []
    with tempfile.TemporaryDirectory(prefix="psgd-sim-") as tmp:
        for workers, shards, policy in validation_grid(costs.ring_rate > 0):
            run = Run(str(width), policy, workers, shards=shards)
            rates = []
            for repeat in range(repeats):
                record = execute(run, 20, 300, Path(tmp) / f"{policy}-{workers}-{shards}-{repeat}")
                if "error" in record:
                    raise SystemExit(f"{record['command']}: {record['error']}")
                rates.append(record["steps_per_s"])
            measured = statistics.median(rates)
            watching = _watching(workers, shards, policy)
            here = dataclasses.replace(costs, wake=calibration.get("wake_watching", costs.wake)) if watching else costs
            predicted = simulate(here, Layout(workers, shards, policy, _model_bytes(width),
                                              watching=watching))["steps_per_s"]
            error = predicted / measured - 1
            rows.append({"workers": workers, "shards": shards, "policy": policy, "measured_steps_per_s": measured,
                         "runs": rates, "simulated_steps_per_s": predicted, "error": error})
            mark = " (its costs come from this job, its watching aside)" \
                if f"{policy} {workers}w {shards}s" in calibration.get("calibrated_on", ()) else ""
            say(f"  {policy:9s} {workers}w {shards}s: measured {measured:8,.0f} steps/s, simulated "
                f"{predicted:8,.0f}: {error:+.0%}{mark}")
    return rows


def run_from_args(args: argparse.Namespace) -> int:
    def say(line: str) -> None:
        print(line, flush=True)

    costs, calibration = _costs(args, say)
    result: dict = {"costs": dataclasses.asdict(costs), "calibration": calibration}
    if args.validate:
        say("\nvalidation: psgd launch here against the simulation of the same job on one host (20 epochs, "
            f"median of {args.repeats}):")
        rows = result["validation"] = validate(costs, calibration, args.width, args.repeats, say)
        worst = max(rows, key=lambda r: abs(r["error"]))
        within = sum(abs(r["error"]) <= 0.15 for r in rows)
        say(f"{within} of {len(rows)} within 15%; the worst: {worst['policy']} {worst['workers']}w "
            f"{worst['shards']}s at {worst['error']:+.0%}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0
