"""The convergence lab: the same job under every consistency policy, with and without stragglers.

``run_lab(config, out_dir)`` launches each (scenario, contender) pair as real
processes on this machine (``psgd.launcher.launch``: shards and workers, or
MPI ranks), records every evaluation point, and writes into ``out_dir``:

- ``lab.json``: the lab's configuration, the machine, and per run its job,
  injected delay, evaluation points and summary;
- ``table.md``: one row per (scenario, policy), medians over the repeats
  (time to target accuracy, final accuracy, steps/s, updates/s, staleness
  p50/p99, bytes moved);
- ``accuracy-<scenario>.png`` and ``loss-<scenario>.png``: one line per
  policy, against wall time, applied updates and gradients computed.

``psgd bench convergence`` and ``benchmarks/convergence.py`` are its command line.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from psgd.bench import hosted, plots, report
from psgd.bench.lab import LOOPBACK, PRESETS, Contender, LabConfig, Scenario, preset
from psgd.bench.labresult import LabResult, RunResult, load_result
from psgd.bench.observe import (
    Evaluator,
    ShardObserver,
    allreduce_points,
    initial_point,
    origin,
    ps_points,
    read_jsonl,
    start_skew,
    step_lines,
)
from psgd.compute import threads
from psgd.config import ConfigError
from psgd.config.parsing import comma_list

log = logging.getLogger(__name__)


def machine() -> str:
    """This machine in words (CPU, cores, memory, Python, OS), as benchmarks/loopback.py describes it."""
    import platform

    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, Python {platform.python_version()}, {platform.system()}"


def run_lab(
    config: LabConfig, out_dir: str | os.PathLike, *, progress: bool = True, keep_runs: str | os.PathLike | None = None
) -> LabResult:
    """Run every (scenario, contender) of ``config`` and write JSON, table and plots into ``out_dir``.

    Repeats go round the whole list, so background noise falls on every
    policy alike.  Each run's logs and metrics go to a folder under
    ``keep_runs`` (kept), or to a temporary folder removed at the end.
    """
    from tqdm import tqdm

    config.check()
    plots.require_matplotlib()
    # The lab's own evaluations run beside the runs: one thread, so they disturb them least. This
    # limits this process only (threadpoolctl); every launched process takes its own budget.
    threads.apply(1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(keep_runs) if keep_runs else Path(tempfile.mkdtemp(prefix="psgd-lab-"))
    evaluator = Evaluator(config.job_config())
    todo = [(r, s, p) for r in range(config.repeats) for s in config.scenarios() for p in config.contenders()]
    networks = list(config.networks)
    began, load_before = time.perf_counter(), os.getloadavg()
    runs: list[RunResult] = []
    links: dict = {}
    try:
        with tqdm(
            total=len(todo) * max(1, len(networks)),
            desc="convergence lab",
            unit="run",
            disable=not progress,
            file=sys.stderr,
            dynamic_ncols=True,
        ) as bar:
            for network in networks or [None]:
                with _network(network, config) as net:
                    if net is not None:
                        links[network] = net.record()
                        bar.write(
                            f"{network} links: measured {net.record()['measured_gbit_per_s']} Gbit/s", file=sys.stderr
                        )
                    for repeat, scenario, contender in todo:
                        repeat_text = f" #{repeat}" if config.repeats > 1 else ""
                        where = f"{network} / " if network else ""
                        bar.set_description(f"{where}{scenario.name} / {contender.label}{repeat_text}")
                        slug = f"{network}-{scenario.name}" if network else scenario.name
                        folder = root / f"{slug}-{contender.spec.replace(':', '')}-{repeat}"
                        if net is not None:
                            run = _run_hosted(net, config, scenario, contender, folder, evaluator.model_bytes)
                        else:
                            run = run_one(config, evaluator, scenario, contender, folder, bar)
                            if network:  # LOOPBACK, named among the networks: this machine's own loopback
                                run.network, run.key, run.scenario = network, f"{network}/{run.key}", slug
                        run.repeat = repeat
                        runs.append(run)
                        bar.update(1)
                        if progress:
                            bar.write(_one_line(run, config.target_accuracy), file=sys.stderr)
    finally:
        if not keep_runs:
            shutil.rmtree(root, ignore_errors=True)
    seconds = time.perf_counter() - began
    load = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]}
    compute = evaluator.gradient_seconds()
    result = LabResult(
        config, machine(), evaluator.parameters, evaluator.model_bytes, runs, seconds, {}, load, compute, links
    )
    result.files = report.write_all(result, out)
    return result


def _network(name: str | None, config: LabConfig):
    """The emulated hosts of one network of the lab (a context); none on loopback."""
    if name is None or name == LOOPBACK:
        return contextlib.nullcontext()

    job = config.job_config()
    return hosted.Network(name, job.cluster.shards, job.cluster.workers)


def link_step_seconds(
    model_bytes: int, workers: int, shards: int, bytes_per_s: float, wire_fraction: float = 1.0
) -> float:
    """What a worker's parameter-server step takes on links carrying ``bytes_per_s``, for the bytes alone,
    with a step's pull and push one after the other: a worker pulls the model and pushes its gradient
    (``wire_fraction`` of the model's bytes: 0.5 with 16-bit compression) over its link, and each shard's
    link carries its 1/shards share of that for every worker, so it is shared by workers/shards of them."""
    return max(1.0, workers / shards) * model_bytes * (1 + wire_fraction) / bytes_per_s


def _run_hosted(
    net, config: LabConfig, scenario: Scenario, contender: Contender, folder: Path, model_bytes: int
) -> RunResult:
    """One run with its shards and workers on ``net``'s hosts; a failure is reported in its row."""

    try:
        run = hosted.run_on(net, config, scenario, contender, folder, config.run_timeout)
    except Exception as exc:
        run = RunResult(
            f"{scenario.name}/{contender.spec}",
            scenario.name,
            scenario.delay,
            contender.spec,
            contender.label,
            contender.mode,
            config.job_config().to_dict(),
            [],
            [],
            {},
            error=f"{type(exc).__name__}: {exc}",
        )
    run.network = net.name
    run.key, run.scenario = f"{net.name}/{run.key}", f"{net.name}-{run.scenario}"
    if net.rate and contender.mode == "ps" and not run.error:
        cluster = run.job["cluster"]  # the job the run recorded, its contender's settings applied
        fraction = 0.5 if cluster["wire_dtype"] else 1.0
        carried = min(net.measured.values())  # what one TCP stream really got through, not the nominal rate
        run.summary["link_step_seconds"] = link_step_seconds(
            model_bytes, cluster["workers"], cluster["shards"], carried, fraction
        )
    return run


def _one_line(run: RunResult, target: float) -> str:
    if run.error:
        return f"{run.key} #{run.repeat}: FAILED: {run.error.splitlines()[0]}"
    s = run.summary
    reached = f"{s['time_to_target']:.2f}s" if s["time_to_target"] is not None else "not reached"
    return (
        f"{run.key} #{run.repeat}: target {target:g} {reached}, final accuracy {s['final_accuracy']:.3f}, "
        f"{s['steps_per_s']:.0f} steps/s, {s['updates_per_s']:.0f} updates/s"
    )


def run_one(
    config: LabConfig,
    evaluator: Evaluator,
    scenario: Scenario,
    contender: Contender,
    run_dir: Path,
    bar=None,
    hosts=None,
) -> RunResult:
    """Launch one run and turn what it recorded into evaluation points and a summary."""
    job = config.job_config()
    job = job.apply_sets(list(contender.sets))
    if run_dir.exists():
        shutil.rmtree(run_dir)  # the metrics logs append
    delay_args = ["--delay", scenario.delay] if scenario.delay else []
    run = RunResult(
        f"{scenario.name}/{contender.spec}",
        scenario.name,
        scenario.delay,
        contender.spec,
        contender.label,
        contender.mode,
        job.to_dict(),
        delay_args,
        [],
        {},
    )
    try:
        if contender.mode == "allreduce":  # rank 0 evaluates beside its steps: no rank waits for it
            job = job.apply_sets(["train.eval_beside=true"])
            run.job = job.to_dict()
            run.worker_args += ["--eval-every", str(config.allreduce_eval_every)]
            seconds, accuracy, train_seconds = _run_allreduce(config, evaluator, job, run, run_dir, hosts)
        else:
            run.worker_args += ["--eval-every", "0"]  # the observer evaluates; workers only train
            seconds, accuracy, train_seconds = _run_ps(config, evaluator, job, run, run_dir, bar, hosts)
        run.summary.update(summarize(run.points, config.target_accuracy, train_seconds))
        steps_per_s = run.summary["steps_per_s"]
        run.summary["step_seconds"] = job.cluster.workers / steps_per_s if steps_per_s else None
        run.summary.update(launch_seconds=round(seconds, 2), launch_test_accuracy=accuracy)
    except Exception as exc:  # one failed run is reported in its row; the lab carries on
        log.warning("run %s failed: %s", run.key, exc)
        run.error = f"{type(exc).__name__}: {exc}"
    return run


def _run_allreduce(config: LabConfig, evaluator: Evaluator, job, run: RunResult, run_dir: Path, hosts=None):
    """N MPI ranks; the points are rank 0's evaluations.  Returns (launch s, final accuracy, train s)."""
    from psgd.launcher import launch

    result = launch(
        job,
        mode="allreduce",
        backend="mpi",
        run_dir=str(run_dir),
        progress=False,
        timeout=config.run_timeout,
        worker_args=run.worker_args,
        verbose=-1,
        hosts=hosts,
    )
    steps = step_lines([run_dir / "allreduce.jsonl"])
    evals = [rec for rec in read_jsonl(run_dir / "allreduce.jsonl") if rec.get("event") == "eval"]
    run.points = allreduce_points(steps, evals, job.cluster.workers, evaluator.model_bytes, initial_point(evaluator))
    return result.seconds, result.test_accuracy, steps[-1]["time"] - origin(steps)


def _run_ps(config: LabConfig, evaluator: Evaluator, job, run: RunResult, run_dir: Path, bar, hosts=None):
    """Shards and workers, watched by a :class:`ShardObserver`.  Returns (launch s, final accuracy, train s)."""
    from psgd.launcher import launch

    observer = ShardObserver(evaluator, config.eval_interval, _postfix(bar))
    result = launch(
        job,
        mode="ps",
        run_dir=str(run_dir),
        progress=False,
        timeout=config.run_timeout,
        worker_args=run.worker_args,
        verbose=-1,
        monitor=observer,
        hosts=hosts,
    )
    steps = step_lines(run_dir / f"worker-{r}.jsonl" for r in range(job.cluster.workers))
    start = origin(steps)
    run.points = ps_points(observer.samples, steps, start, evaluator.model_bytes, initial_point(evaluator))
    run.error = observer.error
    last = observer.samples[-1].counters if observer.samples else {}
    run.summary.update(start_skew=round(start_skew(steps), 3), late_gradients=int(last.get("late", 0)))
    return result.seconds, result.test_accuracy, steps[-1]["time"] - start


def _postfix(bar):
    if bar is None:
        return None
    return lambda s: bar.set_postfix(acc=f"{s.test_accuracy:.3f}", updates=min(s.versions), refresh=False)


def summarize(points: list[dict], target: float, train_seconds: float) -> dict:
    """Time, updates and gradients to ``target`` accuracy (None if never reached), final figures, rates."""
    hit = next((p for p in points if (p["test_accuracy"] or 0.0) >= target), None)
    last = points[-1]
    seconds = max(train_seconds, 1e-9)
    accuracies = [p["test_accuracy"] for p in points if p["test_accuracy"] is not None]
    return {
        "target_accuracy": target,
        "time_to_target": hit["wall"] if hit else None,
        "updates_to_target": hit["updates"] if hit else None,
        "steps_to_target": hit["steps"] if hit else None,
        "final_accuracy": last["test_accuracy"],
        "best_accuracy": max(accuracies) if accuracies else None,
        "final_loss": last["loss"],
        "train_seconds": round(train_seconds, 3),
        "steps": last["steps"],
        "updates": last["updates"],
        "steps_per_s": last["steps"] / seconds,
        "updates_per_s": last["updates"] / seconds,
        "staleness_p50": last["staleness_p50"],
        "staleness_p99": last["staleness_p99"],
        "bytes": last["bytes"],
        "eval_points": len(points),
    }


# -- command line -------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The lab's flags (``psgd bench convergence``; ``benchmarks/convergence.py`` runs the same command)."""
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="starting configuration: default (MLP on digits, 4 workers, 2 shards, every policy, "
        "no straggler and worker 0 4x slower), quick (a few seconds a run, for CI) or "
        "synthetic (a ~10M-parameter MLP: communication dominates) or mnist (a CNN on 5,000 MNIST "
        "images, minutes a run; needs the mnist extra) (default: default)",
    )
    parser.add_argument(
        "--quick", action="store_const", const="quick", dest="preset_quick", help="same as --preset quick"
    )
    parser.add_argument(
        "--policies",
        metavar="LIST",
        help="comma-separated: sync, async, ssp:S, local:T (local SGD, T steps between pushes), "
        "backup:B (sync with B backup workers), allreduce; a parameter-server policy may go on with "
        "+bf16 or +fp16 (gradients compressed on the wire) and remedies for staleness: +slr "
        "(lr / staleness), +dc or +dca (delay compensation, constant or adaptive), +im "
        "(implicit momentum), e.g. async+dc,ssp:2+slr+bf16",
    )
    parser.add_argument(
        "--delays",
        metavar="LIST",
        help="comma-separated scenarios: none, or a --delay spec of psgd-worker such as "
        "slowdown:4@0, fixed:0.01@1, exp:0.005 (default: none,slowdown:4@0)",
    )
    parser.add_argument(
        "--network",
        metavar="LIST",
        help="comma-separated link rates to run the whole lab on, e.g. 1gbit,10gbit,none: every "
        "shard and worker then runs on a host of its own (a network namespace, as root), its "
        "link shaped to the rate (none: not shaped), measured before the runs; loopback: "
        "this machine's loopback, no emulated hosts, as without the flag",
    )
    parser.add_argument("--target", type=float, metavar="ACC", help="target test accuracy (default 0.95 on digits)")
    parser.add_argument("--workers", type=int, help="workers (ranks) in every run")
    parser.add_argument("--shards", type=int, help="parameter-server shards")
    parser.add_argument("--epochs", type=int, help="passes over the training data")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override any job-file key for every run (repeatable)",
    )
    parser.add_argument(
        "--eval-interval",
        type=float,
        metavar="SECONDS",
        help="seconds between evaluations of the shards' weights in ps runs",
    )
    parser.add_argument(
        "--allreduce-eval-every",
        type=int,
        metavar="STEPS",
        help="steps between rank 0's evaluations in all-reduce runs",
    )
    parser.add_argument("--timeout", type=float, metavar="SECONDS", help="fail a run that takes longer (default 600)")
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="where lab.json, table.md and the plots go (default runs/convergence/PRESET under the "
        "current folder, as psgd launch keeps its runs)",
    )
    parser.add_argument("--keep-runs", metavar="DIR", help="keep every run's logs and metrics under DIR")
    parser.add_argument(
        "--repeats",
        type=int,
        metavar="N",
        help="run every (scenario, policy) N times; the table shows medians (default 3, quick 1)",
    )
    parser.add_argument(
        "--from",
        dest="from_json",
        metavar="LAB.json",
        help="run nothing: redraw the table and plots of an earlier lab (into --out, default "
        "runs/convergence/PRESET-redrawn: the lab's own files are left as they are)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


#: where a lab writes by default: a folder of the current one, beside psgd launch's runs
RUNS = Path("runs") / "convergence"


def config_from_args(args: argparse.Namespace) -> LabConfig:
    config = preset(args.preset_quick or args.preset)
    if args.policies:
        config.policies = comma_list(args.policies, "--policies", what="policies", error=ConfigError)
    if args.delays:
        config.delays = comma_list(args.delays, "--delays", what="delays", error=ConfigError)
    if args.network:
        config.networks = comma_list(args.network, "--network", what="link rates", error=ConfigError)
    for flag, key in (("workers", "cluster.workers"), ("shards", "cluster.shards"), ("epochs", "train.epochs")):
        if getattr(args, flag) is not None:
            config.job.append(f"{key}={getattr(args, flag)}")
    config.job += args.set
    for flag, attr in (
        ("target", "target_accuracy"),
        ("eval_interval", "eval_interval"),
        ("allreduce_eval_every", "allreduce_eval_every"),
        ("timeout", "run_timeout"),
        ("repeats", "repeats"),
    ):
        if getattr(args, flag) is not None:
            setattr(config, attr, getattr(args, flag))
    return config


def run_from_args(args: argparse.Namespace) -> int:
    """Run the lab the flags describe (or redraw one, with --from) and print the table; 1 when a run failed."""

    if args.from_json:
        result = load_result(args.from_json)
        out = Path(args.out or RUNS / f"{result.config.name}-redrawn")
        if out.resolve() == Path(args.from_json).resolve().parent:
            raise ConfigError(
                f"--out {out} is where {args.from_json} is: redrawing there would replace the lab's own "
                "table and plots; give another --out"
            )
        result.files = report.write_all(result, out)
        done = f"{len(result.runs)} runs read from {args.from_json} (they took {result.seconds:.0f}s), none run"
    else:
        config = config_from_args(args)
        result = run_lab(
            config, args.out or str(RUNS / config.name), progress=not args.no_progress, keep_runs=args.keep_runs
        )
        done = f"{len(result.runs)} runs in {result.seconds:.0f}s"
    print(report.terminal_text(result))
    folders = sorted({str(Path(f).parent) for f in result.files.values()})
    print(f"{done}; wrote {len(result.files)} files in {', '.join(folders)} (table.md: the whole table)")
    return 1 if any(r.error for r in result.runs) else 0
