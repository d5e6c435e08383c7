"""Workers that join and leave a running job, measured as users drive it: ``psgd launch --workers 2:4`` and
``psgd scale``.

For each policy (``--policy``, default sync, async, ssp and local) one launch of the job on this machine with a
range of workers 2:4 (``--model`` on digits, default the demo's convnet, for ``--epochs``): it starts with 2; once
the workers have taken a fifth of the job's batches, ``psgd scale RUN --workers 4``; once the new workers have
stepped and half are taken, ``--workers 2``.  From the workers' own step records and the launch's result:

- steps lost: the job's batches less the steps every worker took (the goal: 0);
- the stall at each change: the longest step of workers 0 and 1 (who trained throughout) from the change (a joiner
  registering, a leaver hearing SIGTERM) to a few seconds after it settled, over their median step after it (the
  goal: at most 2, under sync at most one round more than a round; under async and ssp no step over twice the
  median); and the same from the moment ``psgd scale`` was run, its own start on this machine included.  On a
  machine with fewer cores than processes the median itself
  changes with the count (4 workers share the cores 2 had): the figure is against the steps after the change;
- two windows to judge them by, before the scale-up: a quiet one (nothing happens: what the figure is on this
  machine anyway), and the control: two processes that start as joining workers do (their imports, the job
  built) and end there (what a start costs the others in cores alone).

Then, for ``--compare`` (default sync), the same job fixed at 2 and at 4 workers and the range never scaled: the
test accuracy and seconds of each, and the median step of worker 0 (the range's against the fixed 2's: what
asking shard 0 for each step's batch costs).

    psgd bench elastic                          # about 6 minutes on 2 cores
    psgd bench elastic --policy sync --compare sync --model mlp --epochs 400 --json elastic.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from psgd.errors import ClusterError

POLICIES = ("sync", "async", "ssp", "local")
#: the model's options: the convnet is the compose demo's (deploy/job.toml), about 30 ms a step on 2 cores
MODEL_SETS = {"cnn": ("model.channels=[64, 128]", "model.hidden=512")}
WINDOW = 2.0  # seconds after a change whose steps are judged, and after which the median is taken
BOUND = 900.0  # seconds a launch may take
JOINED = 20  # steps each new worker takes before the job is scaled down


class ElasticBenchError(ClusterError):
    """A launch of the measurement failed or did not end."""


def _records(run: Path) -> dict[int, list[dict]]:
    """Each rank's step records so far (the processes that held it, in time order)."""
    out: dict[int, list[dict]] = {}
    for path in run.glob("worker-*.jsonl"):
        rank = int(path.stem.split("-")[1])
        for line in path.read_text(errors="replace").splitlines():
            if line.endswith("}"):
                r = json.loads(line)
                if r.get("event") == "step":
                    out.setdefault(rank, []).append(r)
    return {k: sorted(v, key=lambda r: r["time"]) for k, v in out.items()}


def _launch(run: Path, policy: str, workers: str, epochs: int, model: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "psgd.cli.main", "launch", "--policy", policy, "--workers", workers, "--model", model]
    argv += ["--epochs", str(epochs), "--run-dir", str(run), "--no-progress", "--json", "--timeout", str(BOUND)]
    argv += [f"--set={option}" for option in MODEL_SETS.get(model, ())]
    argv += ["--staleness", "2"] if policy == "ssp" else []
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(run.parent / f"{run.name}.log", "w"))


def _result(proc: subprocess.Popen, run: Path) -> dict:
    try:
        out, _ = proc.communicate(timeout=BOUND + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise ElasticBenchError(f"the launch in {run} did not end within {BOUND + 60:.0f}s") from None
    if proc.returncode != 0:
        tail = (run.parent / f"{run.name}.log").read_text(errors="replace")[-1500:]
        raise ElasticBenchError(f"the launch in {run} exited with status {proc.returncode}:\n{tail}")
    return json.loads(out)


def _scale(run: Path, workers: int) -> float:
    """``psgd scale RUN --workers N``; returns when it was asked (the epoch time the records use)."""
    asked = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "psgd.cli.main", "scale", str(run), "--workers", str(workers)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0:
        raise ElasticBenchError(f"psgd scale {run} --workers {workers}: {done.stderr.strip()}")
    return asked


def _wait_until(run: Path, proc: subprocess.Popen, ready, what: str) -> None:
    """Until ``ready(records)`` (each rank's step records) holds, bounded by the launch's own time."""
    deadline = time.monotonic() + BOUND
    while not ready(_records(run)):
        if proc.poll() is not None:
            raise ElasticBenchError(f"the launch in {run} ended before {what}")
        if time.monotonic() > deadline:
            raise ElasticBenchError(f"the launch in {run} did not reach {what} within {BOUND:.0f}s")
        time.sleep(0.2)  # polling the workers' records, with a deadline


def _done_times(run: Path, since: float) -> list[float]:
    """When the processes of ranks 2 and 3 that ended after ``since`` said they were done (their "done" lines)."""
    out = []
    for r in (2, 3):
        path = run / f"worker-{r}.jsonl"
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            if line.endswith("}"):
                record = json.loads(line)
                if record.get("event") == "done" and record["time"] > since:
                    out.append(float(record["time"]))
    return out


def _taken(recs: dict[int, list[dict]]) -> int:
    return sum(len(v) for v in recs.values())


def _gaps(records: list[dict], start: float, end: float) -> list[float]:
    """The steps of one worker that ended in [start, end), each as the time since its previous step."""
    times = [r["time"] for r in records]
    return [b - a for a, b in zip(times, times[1:]) if start <= b < end]


def stall(recs: dict[int, list[dict]], at: float, settled: float) -> dict:
    """Workers 0 and 1 around a change that began at ``at`` and was ``settled`` (the new count trains: a joiner's
    first step, a leaver's last word): their longest step from ``at`` to ``settled + WINDOW``, over their median in
    the ``WINDOW`` after that."""
    during = [g for r in (0, 1) for g in _gaps(recs.get(r, []), at, settled + WINDOW)]
    after = [g for r in (0, 1) for g in _gaps(recs.get(r, []), settled + WINDOW, settled + 2 * WINDOW)]
    if not during or not after:
        return {"error": "too few steps around the change: raise --epochs"}
    median = statistics.median(after)
    return {
        "longest_step_s": round(max(during), 5),
        "median_step_after_s": round(median, 5),
        "longest_over_median": round(max(during) / median, 2),
        "seconds_to_settle": round(settled - at, 3),
    }


#: what a joining worker does before it joins, without joining: its imports, and the job built from the job file
STARTING = (
    "import sys; import psgd.worker.exchange; from psgd.config import JobConfig; from psgd.job import build_job; "
    "build_job(JobConfig.load(sys.argv[1]), check=True)"
)


def _control(run: Path) -> tuple[float, float]:
    """Two processes that start as joining workers do and end there (the control: the cores a start takes from
    the others on a small machine); returns when they started and ended."""
    began = time.time()
    starting = [subprocess.Popen([sys.executable, "-c", STARTING, str(run / "job.toml")]) for _ in range(2)]
    for proc in starting:
        if proc.wait(timeout=120) != 0:
            raise ElasticBenchError("a control process (a worker's start, without joining) failed")
    return began, time.time()


def measure_policy(policy: str, epochs: int, folder: Path, blocks: int, model: str = "cnn") -> dict:
    """One launch 2:4 scaled 2 -> 4 -> 2; see the module docstring."""
    run = folder / f"elastic-{policy}"
    proc = _launch(run, policy, "2:4", epochs, model)
    try:
        _wait_until(run, proc, lambda recs: _taken(recs) >= blocks // 20, "a twentieth of the job")
        quiet = time.time()
        _wait_until(run, proc, lambda recs: _taken(recs) >= blocks // 10, "a tenth of the job")
        control = _control(run)
        _wait_until(run, proc, lambda recs: _taken(recs) >= blocks // 5, "a fifth of the job")
        up = _scale(run, 4)
        _wait_until(
            run, proc, lambda recs: all(len(recs.get(r, [])) >= JOINED for r in (2, 3)), "the new workers stepping"
        )
        _wait_until(run, proc, lambda recs: _taken(recs) >= blocks // 2, "half the job")
        down = _scale(run, 2)
        result = _result(proc, run)
    finally:
        if proc.poll() is None:
            proc.kill()
    recs = _records(run)
    # the changes themselves: a joiner registered (its first step less the time since its loop began) and stepped;
    # a leaver heard SIGTERM during its last step and said it left (its "done" line)
    firsts = [recs[r][0] for r in (2, 3) if r in recs and recs[r][0]["time"] > up]
    registered = min((f["time"] - f["wall"] for f in firsts), default=up)
    joined = min((f["time"] for f in firsts), default=up)
    lasts = [recs[r][-1]["time"] for r in (2, 3) if r in recs and recs[r][-1]["time"] > down - WINDOW]
    left = max(_done_times(run, down), default=down)
    return {
        "policy": policy,
        "job_batches": blocks,
        "steps": sum(result["worker_steps"]),
        "steps_lost": blocks - sum(result["worker_steps"]),
        "worker_steps": result["worker_steps"],
        "test_accuracy": result["test_accuracy"],
        "seconds": result["seconds"],
        "quiet": stall(recs, quiet, quiet),
        "control": stall(recs, control[0], control[1]),
        "scale_up": stall(recs, registered, joined),
        "scale_down": stall(recs, min(lasts, default=down), left),
        "scale_up_with_the_command": stall(recs, up, joined),
        "scale_down_with_the_command": stall(recs, down, left),
    }


def compare(policy: str, epochs: int, folder: Path, model: str = "cnn") -> list[dict]:
    """The same job fixed at 2 and 4 workers and the range 2:4 never scaled."""
    out = []
    for workers in ("2", "4", "2:4"):
        run = folder / f"{policy}-{workers.replace(':', '-')}"
        result = _result(_launch(run, policy, workers, epochs, model), run)
        recs = _records(run)
        gaps = _gaps(recs.get(0, []), 0.0, float("inf"))
        out.append(
            {
                "policy": policy,
                "workers": workers,
                "test_accuracy": result["test_accuracy"],
                "seconds": result["seconds"],
                "steps": sum(result["worker_steps"]),
                "median_step_s": round(statistics.median(gaps), 6) if gaps else None,
            }
        )
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy",
        action="append",
        choices=POLICIES,
        dest="policies",
        help="a policy to scale 2 -> 4 -> 2 under; repeat for more (default: all four)",
    )
    parser.add_argument(
        "--compare",
        action="append",
        choices=POLICIES,
        default=None,
        help="a policy whose job also runs fixed at 2 and 4 and as 2:4 never scaled (default: sync)",
    )
    parser.add_argument("--model", default="cnn", help="the model on digits (default cnn, the demo's)")
    parser.add_argument("--epochs", type=int, default=40, metavar="E", help="the job's epochs (default 40)")
    parser.add_argument("--json", metavar="FILE", help="write the figures here")


def run_from_args(args: argparse.Namespace) -> int:
    from psgd.data import load_dataset

    if args.epochs < 3:
        raise SystemExit("psgd bench elastic: --epochs must be at least 3")
    blocks = args.epochs * (load_dataset("digits").n_train // 32)
    figures: dict = {"model": args.model, "epochs": args.epochs, "scaled": [], "compared": []}
    failed = False
    with tempfile.TemporaryDirectory(prefix="psgd-elastic-") as folder:
        for policy in args.policies or POLICIES:
            try:
                row = measure_policy(policy, args.epochs, Path(folder), blocks, args.model)
            except ElasticBenchError as exc:
                print(f"{policy}: {exc}")
                figures["scaled"].append({"policy": policy, "error": str(exc)})
                failed = True
                continue
            figures["scaled"].append(row)
            ratio = {k: row[k].get("longest_over_median") for k in ("scale_up", "scale_down", "quiet", "control")}
            print(
                f"{policy:6s} 2->4->2: {row['steps']} of {blocks} batches trained ({row['steps_lost']} lost), "
                f"accuracy {row['test_accuracy']:.4f} in {row['seconds']:.1f}s; longest step over the median after: "
                f"join {ratio['scale_up']} (new workers stepping "
                f"{row['scale_up_with_the_command'].get('seconds_to_settle')}s after psgd scale), leave "
                f"{ratio['scale_down']}; nothing happening {ratio['quiet']}, two workers starting without joining "
                f"(the control) {ratio['control']}"
            )
        for policy in args.compare or ["sync"]:
            try:
                rows = compare(policy, args.epochs, Path(folder), args.model)
            except ElasticBenchError as exc:
                print(f"{policy}: {exc}")
                figures["compared"].append({"policy": policy, "error": str(exc)})
                failed = True
                continue
            figures["compared"] += rows
            for row in rows:
                print(
                    f"{policy:6s} workers {row['workers']:>4s}: accuracy {row['test_accuracy']:.4f} in "
                    f"{row['seconds']:.1f}s, {row['steps']} steps, worker 0's median step {row['median_step_s']}s"
                )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 1 if failed else 0
