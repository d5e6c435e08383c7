"""``psgd bench simulate``: :data:`DESCRIPTION` (its help), :func:`add_arguments` and :func:`run_from_args`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
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
    sudo psgd bench simulate --validate --costs sim.json --network 1gbit

--validate runs psgd launch for 1, 2 and 4 workers with 1 and 2 shards
under sync, async and ssp, and all-reduce with 2 and 4 ranks, on this
machine (--network: each process on an emulated host of its own), measures
each job's steps/s and each process's CPU a step over a few seconds of its
run, and prints it beside two simulations of the same job: with the
measured costs (what a prediction would say), and with the job's own CPU a
step (the simulation's structure alone: sync's rounds, async's two round
trips, the cores shared).  benchmarks/RESULTS.md has the tables: within
the launches' spread where each process has a core; too fast where more
processes than cores crowd them, and for MPI over TCP.

A prediction puts every worker and shard on a host of its own, each host's
link at --network's rate, with the costs measured here and the model's size
and gradient (--model; --compute for your own device's step):

    psgd bench simulate --costs sim.json --workers 256 --shards 16 --network 25gbit --model resnet50
    psgd bench simulate --costs sim.json --workers 64 --model job.toml --compute 0.05
    psgd bench simulate --costs sim.json --questions out/   # the tables of benchmarks/RESULTS.md
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--validate",
        action="store_true",
        help="launch the validation grid here and print measured against simulated steps/s",
    )
    parser.add_argument(
        "--width", type=int, default=64, help="the digits MLP's hidden width whose costs are measured (default 64)"
    )
    parser.add_argument(
        "--costs",
        type=Path,
        default=None,
        help="read the costs from this file (a --json of an earlier run) instead of measuring them",
    )
    parser.add_argument("--repeats", type=int, default=2, help="--validate: launches of each job (default 2)")
    parser.add_argument(
        "--network",
        metavar="RATE",
        default=None,
        help="links of this rate (e.g. 1gbit, 10gbit, 25gbit): --validate runs on emulated links "
        "(root and tc; each shard, worker and rank on a host of its own, on this machine's "
        "cores); a prediction's hosts have them (default 25gbit)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="predict a job of N workers, each on a host of its own (with --model; default 64)",
    )
    parser.add_argument(
        "--shards",
        type=int,
        default=None,
        metavar="K",
        help="... with K shards, each on a host of its own (default: N / 4, at least 1)",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="MODEL",
        help="the prediction's model: resnet50 or vgg16 (their size, a P100's published step), "
        "synthetic (the convergence lab's), or a job file (its model's size; its gradient "
        "measured here with psgd train, or --compute)",
    )
    parser.add_argument(
        "--compute",
        type=float,
        default=None,
        metavar="SECONDS",
        help="one gradient's seconds on a worker (say, on your GPU) instead of the model's own",
    )
    parser.add_argument(
        "--questions",
        type=Path,
        default=None,
        metavar="DIR",
        help="answer the questions of benchmarks/RESULTS.md into DIR: 16-1,024 workers, 1-64 shards, "
        "10/25/100 Gbit/s, three models (tables, JSON, a plot)",
    )
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


def validate(costs: Costs, width: int, repeats: int, say, network=None) -> list[dict]:
    """Each job of the grid launched here ``repeats`` times (on ``network``'s emulated hosts, if given) and
    simulated twice: with the calibrated costs, and with the job's own (each process's CPU a step in the launch,
    :func:`psgd.bench.simulate.calibrate.as_in`: the simulation's structure apart from its calibration; not where
    the job's connections watch, as a watch's CPU is no work, nor for all-reduce, whose ranks spin)."""
    from psgd.bench.simulate.calibrate import as_in, in_a_launch

    link = {}
    if network is not None:  # hosts of their own on this machine's cores, their links shaped as tc shapes them
        from psgd.bench.netns import burst_bytes

        link = {
            "rate": statistics.mean(network.measured.values()),
            "latency": 0.0,
            "one_machine": True,
            "burst": burst_bytes(network.rate),
        }
    rows = []
    for workers, shards, policy in validation_grid(costs.ring_rate > 0):
        launches = [
            in_a_launch(width, shards, policy, workers, busy_poll_us=None, network=network) for _ in range(repeats)
        ]
        measured = statistics.median(launch["steps_per_s"] for launch in launches)
        watching = max(launch["busy_poll_us"] for launch in launches) > 0
        layout = Layout(workers, shards, policy, _model_bytes(width), watching=watching, **link)
        predicted = simulate(costs, layout)["steps_per_s"]
        own = (
            None
            if watching or policy == "allreduce"
            else statistics.median(simulate(as_in(costs, launch, layout), layout)["steps_per_s"] for launch in launches)
        )
        busy = statistics.median(
            launch["steps_per_s"] * sum(v for k, v in launch.items() if "-" in k) for launch in launches
        )  # cores the job's processes kept busy
        rows.append(
            {
                "workers": workers,
                "shards": shards,
                "policy": policy,
                "measured_steps_per_s": measured,
                "runs": launches,
                "watching": watching,
                "simulated_steps_per_s": predicted,
                "error": predicted / measured - 1,
                "own_costs_steps_per_s": own,
                "own_costs_error": None if own is None else own / measured - 1,
                "cores_busy": busy,
            }
        )
        with_own = "" if own is None else f"; with its own costs {own:8,.0f}: {own / measured - 1:+.0%}"
        say(
            f"  {policy:9s} {workers}w {shards}s: measured {measured:8,.0f} steps/s, simulated "
            f"{predicted:8,.0f}: {predicted / measured - 1:+.0%}{with_own}"
        )
    return rows


def _validation(args: argparse.Namespace, costs: Costs, result: dict, say) -> None:
    from psgd.bench.simulate import calibrate

    with contextlib.ExitStack() as stack:
        network = None
        if args.network:
            from psgd.bench import netns
            from psgd.bench.hosted import Network

            netns.check_networks([args.network])
            network = stack.enter_context(Network(args.network, 2, 4))
            result["network"] = network.record()
            say(f"{args.network} links: measured {result['network']['measured_gbit_per_s']} Gbit/s")
        say(
            f"\nvalidation: psgd launch here{' on ' + args.network + ' links' if network else ''} against the "
            f"simulation of the same job (steps/s over {calibrate.WINDOW:g} s of its run, median of {args.repeats}):"
        )
        rows = result["validation"] = validate(costs, args.width, args.repeats, say, network)
    for key, what in (("error", "with the calibrated costs"), ("own_costs_error", "with each job's own costs")):
        errors = [r for r in rows if r[key] is not None]
        worst = max(errors, key=lambda r: abs(r[key]))
        say(
            f"{what}: {sum(abs(r[key]) <= 0.15 for r in errors)} of {len(errors)} within 15%; the worst: "
            f"{worst['policy']} {worst['workers']}w {worst['shards']}s at {worst[key]:+.0%}"
        )


def _prediction(args: argparse.Namespace, costs: Costs, result: dict, say) -> None:
    """One job of the user's: sync, async and ssp with their shards, ring all-reduce, the shards for 90% of it."""
    from psgd.bench.simulate.predict import MOST_SHARDS, efficiency, link_rate, model, shards_for, steps_per_s

    found = model(args.model, args.compute)
    network = args.network or "25gbit"
    rate = link_rate(network)
    n = args.workers or 64
    k = args.shards or max(1, n // 4)
    say(
        f"\n{n:,} workers, {k:,} shard(s), {found.name} ({found.nbytes / 1e6:,.1f} MB, a gradient "
        f"{found.compute * 1e3:,.1f} ms: {found.source}), every process on a host of its own with a "
        f"{network} link:"
    )
    figures = {}
    for policy in ("sync", "async", "ssp", "allreduce"):
        figures[policy] = steps_per_s(costs, found, n, k, rate, policy)
        say(
            f"  {'all-reduce' if policy == 'allreduce' else policy:10s} {figures[policy]:12,.1f} steps/s, "
            f"efficiency {efficiency(figures[policy], n, found):.0%}"
        )
    need = shards_for(costs, found, n, rate, 0.9 * figures["allreduce"], known={k: figures["sync"]})
    say(f"  sync reaches 90% of all-reduce's steps/s with {need if need else f'more than {MOST_SHARDS}'} shard(s)")
    result["prediction"] = {
        "model": found.__dict__,
        "workers": n,
        "shards": k,
        "network": network,
        "steps_per_s": figures,
        "shards_for_90": need,
    }


def _questions(args: argparse.Namespace, costs: Costs, result: dict, say) -> None:
    from psgd.bench.simulate import questions
    from psgd.bench.simulate.predict import model

    models = [model(name) for name in ("synthetic", "resnet50", "vgg16")]
    say(f"\nthe questions, into {args.questions}:")
    result["questions"] = questions.answer(costs, models, say)
    for name, path in questions.write(result["questions"], args.questions).items():
        say(f"  wrote {path}")


def run_from_args(args: argparse.Namespace) -> int:
    def say(line: str) -> None:
        print(line, flush=True)

    if args.workers is not None and not args.model:
        raise SystemExit(
            "--workers asks for a prediction: name the model too (--model resnet50, vgg16, synthetic or a job file)"
        )
    costs, calibration = _costs(args, say)
    result: dict = {"costs": dataclasses.asdict(costs), "calibration": calibration}
    if args.validate:
        _validation(args, costs, result, say)
    if args.model:
        _prediction(args, costs, result, say)
    if args.questions is not None:
        _questions(args, costs, result, say)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0
