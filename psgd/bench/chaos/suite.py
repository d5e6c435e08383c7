"""The whole suite: :func:`run_chaos` (runs one after another, for minutes or a number of runs), its
:func:`summary`, and the command line :func:`main` (``benchmarks/chaos.py``, ``python -m psgd.bench.chaos``)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from psgd.bench.chaos.draws import Planner
from psgd.bench.chaos.run import Run
from psgd.bench.chaos.settings import KINDS
from psgd.bench.netns import unavailable as namespaces_unavailable
from psgd.config.parsing import Parser, comma_list
from psgd.observe.progress import bar_wanted

#: What the suite does, faults and invariants: the command line's --help.
DESCRIPTION = """Chaos: the shards and workers of running jobs are faulted, and invariants are checked after each fault.

``run_chaos(minutes, seed, kinds)`` runs small jobs one after another (the
digits, softmax or MLP, and every third run a sparse job: embed on clicks,
an embedding table's rows made and held by the shards; 2 shards and 2-3
workers; sync or async, every async job on the digits with a replica per shard, ``replicas = 1``; tensors
over the data path or over gRPC), each started the way users start them
(``psgd-server -c job.toml --shard K --bind ... --checkpoint-dir D``,
``psgd-worker -c job.toml --rank R --metrics F``, the user's environment),
and faults them while they train.  Everything random is drawn from one seeded
generator before a run starts, so ``--seed`` replays the same jobs and the
same faults (their timing follows the machine).

Workers are paced (``--delay fixed:0.02``) so that a job trains for about
10 s whatever its model.  Faults (``KINDS``), each injected when the slowest
worker reaches a drawn fraction of its steps:

- ``kill-shard``: SIGKILL a shard, restart it at the same address (it
  restores its newest checkpoint, the workers find it again; a shard kept
  twice: its replica takes over, the workers fail over to it, and the
  process that comes back follows it as its replica);
- ``restart-shard``: SIGTERM a shard (it exits 0 with a last checkpoint),
  start it again: a graceful restart loses nothing;
- ``kill-worker``: SIGKILL a worker a few ms into a step (mid-pull or
  mid-push), restart it at once or after its lease ran out (it continues from
  the clock the shards hold; where the shards exit when done, before it runs
  out: a lapsed lease, the others done, ends such a job by design);
- ``stop-shard``, ``stop-worker``: SIGSTOP for 0.5-3 s, then SIGCONT (longer
  than the 2 s lease: the shard drops the worker, which registers again);
- ``stop-mid-pull``: a worker stopped in the middle of a pull for 0.5-3 s:
  SIGSTOPped while a pull of its rank is asked of every shard and left
  unfinished (through shared memory where the run has it: answered, never
  released); under async the other workers must go on meanwhile;
- ``hostile``: idle TCP connections and connections sending random bytes,
  held against every shard's gRPC and data ports for a few seconds;
- ``trickled-push``: pushes sent a byte every 0.25 s to every shard's data
  port, 2-4 per shard from connections of no registered worker and one as a
  live worker's rank; each must be closed by its transfer deadline (5 s for
  these models) and training must go on meanwhile;
- ``duplicate-rank``: a second ``psgd-worker`` with a live worker's rank (a
  typo in a hosts list); it must exit, refused with ALREADY_EXISTS naming the
  holder's pid (or, where the holder finished first, with nothing left to
  train), and never train a step beside it;
- ``outsider``: a process with the token that never registered calls every
  door in a live worker's name (push, pull, heartbeat, Done, Rollback, the
  data port's hello, follow): every call must be refused, nothing changed;
- ``corrupt-checkpoint``: a shard SIGKILLed and its newest checkpoint damaged
  (bytes flipped, arrays cut short, a manifest that is not JSON) before it
  starts again: it must say so, skip it and restore the one before;
- ``squatter`` (runs with replicas): a replica SIGKILLed and its address taken
  by a process without the token that claims to lead: the primary must not
  believe it nor send it the token nor answer what it heard when replayed,
  and the pair is whole again after;
- ``full-disk`` (as root): a shard's checkpoint folder on a tmpfs with no room
  left for 1.5-3 s (psgd.bench.chaos.disk): its checkpoints (cuts) fail, said
  once, the job goes on (a sync run drawing it sets ``on_cut_failure =
  "continue"``), and it says that it writes them again once there is room;
- ``flood``: 1,200-2,000 idle TCP connections against every shard process's
  gRPC port (more than it takes: psgd.server.net.listen), opened at once from
  the observer's host and held for 2-4 s, those a shard closes not opened
  again: every shard answers Status within the request timeout meanwhile,
  training goes on, and no shard logs an exception that ended a thread or
  counts ``background_errors``;
- ``insider-follower`` (runs with replicas): a process with the token asks
  to follow a primary as its replica, from an address that is not the
  replica's (and as a replica of its own address): it must be refused, and
  the real replica keeps following (both say so in Status);
- ``restart-primary-at-end`` (runs with replicas, drawn only for runs that
  train to their end without --exit-when-done): once every worker has
  finished, a primary is SIGTERMed (it exits 0) and started again at its
  address with its checkpoint folder: its replica must follow it again
  within 45 s, and a push made then (worker 0's, of zeros) must be copied
  (no ``unreplicated`` push counted, the replica at the primary's version);
- ``rollback-storm`` (sync runs, drawn only for runs that train to their end
  without --exit-when-done): once every worker has finished, a process with
  the token registers as one of them and asks every shard for 20-50
  rollbacks in a row to its newest cut, each for a restart it cannot prove
  (a made-up incarnation, a shard's that never restarted, a shard of the
  job of its own at another address), then says Done: every
  request must be refused with FAILED_PRECONDITION and counted
  (``rollbacks_refused``), no version may go back, and each shard says so in
  one ERROR line (at most two), not one per request;
- ``netcut`` (as root, with ``ip netns``): the run's processes live in network
  namespaces made for it (veth pairs on a bridge, 10.99.1.x) and one host's
  link goes down for 1-3 s; skipped, with the reason, where namespaces
  cannot be made;
- ``sigterm``: the run ends by SIGTERM to every process at once (each must
  exit 0 within 10 s) instead of training to the end.

A kind a run cannot take (one "with replicas" in a run without them, one
for "sync runs" in an async run) waits in the draws for a later run that can.

Invariants (the ``check_*`` functions, pure, on plain data): the job finishes
or stops within its bounds (every wait here is bounded: a stall is a
violation); no update is applied twice (a shard's version never exceeds the
updates its pushes could make: the sum of the workers' clocks under async,
the largest clock under sync; a shard that was never killed lost none, and
neither did a shard kept twice, killed or not: every push a worker had
acknowledged is in its survivor's version); the
counters add up; a restarted shard restores at least its newest checkpoint;
the weights stay finite; a job that trained to its end learned (0.8 on the
digits, half the way from chance to what the teacher allows on clicks, its
rows read from the last checkpoints); every process exits with the documented code (0
when done or after SIGTERM, -9 when killed); nothing is leaked (temporary
files, more than ``--keep-checkpoints`` checkpoints, checkpoints that do not
match their manifest, stray port files, processes).  Each violation carries
the seed, the run, the faults so far and the ends of the logs.

``psgd bench``-style command line: ``benchmarks/chaos.py`` (see :func:`main`).
"""


def parse_kinds(text: str | Sequence[str] | None) -> list[str]:
    """``"kill-shard,hostile"`` (or a list, or None/"all" for every kind) -> kinds, checked."""
    if text is None or text == "all":
        return list(KINDS)
    return comma_list(
        text if isinstance(text, str) else ",".join(text), "--kinds", choices=KINDS, unique=True, error=ValueError
    )


def run_chaos(
    minutes: float,
    seed: int,
    kinds: str | Sequence[str] | None = None,
    out: str | os.PathLike | None = None,
    progress: bool = True,
    runs: int | None = None,
) -> dict:
    """Run faulted jobs for about ``minutes`` (the run in hand is finished; at least one run), or ``runs``
    runs; returns the figures: runs, faults by kind, violations (each with seed, faults and log tails),
    per-run durations and final accuracies.  ``out``: where the runs' folders go (default: a temporary
    folder, of which only the runs with violations are kept)."""
    from tqdm import tqdm

    kinds = parse_kinds(kinds)
    why_not = namespaces_unavailable() if "netcut" in kinds else None
    planner = Planner(seed, kinds, why_not)
    keep_all = out is not None
    root = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="psgd-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    budget = max(0.0, minutes * 60)
    began = time.monotonic()
    by_runs = runs is not None
    bar = tqdm(
        total=runs if by_runs else round(budget),
        unit="run" if by_runs else "s",
        desc="chaos",
        file=sys.stderr,
        disable=not bar_wanted(None if progress else False),
        leave=False,
        dynamic_ncols=True,
        bar_format="{desc}: {n_fmt}/{total_fmt}" + (" runs" if by_runs else "s") + " |{bar}|",
    )

    def say(line: str) -> None:
        if progress:
            bar.write(line, file=sys.stderr)

    print(
        f"chaos: seed {seed} (replay with --seed {seed}); kinds {', '.join(kinds)}; runs in {root}",
        file=sys.stderr,
        flush=True,
    )
    if why_not:
        print(f"chaos: netcut skipped: {why_not}", file=sys.stderr, flush=True)
    records, violations = [], []
    faults: dict[str, int] = dict.fromkeys(kinds, 0)
    try:
        index = 0
        while (runs is None and (index == 0 or time.monotonic() - began < budget)) or (
            runs is not None and index < runs
        ):
            spec = planner.next(index)
            folder = root / f"run-{index:03d}"
            if folder.exists():  # an earlier run into the same --out: its metrics logs would be appended to
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
            say(f"run {index}: {spec.describe()}")
            run = Run(spec, folder, seed, say)
            record = run.execute()
            records.append(record)
            violations += run.violations
            for kind, n in run.counts.items():
                faults[kind] = faults.get(kind, 0) + n
            say(
                f"run {index}: {'finished' if record['finished'] else 'ended'} in {record['seconds']:.1f}s, "
                f"accuracy {record['accuracy']}, {len(run.violations)} violation(s)"
            )
            if not run.violations and not keep_all:
                shutil.rmtree(folder, ignore_errors=True)
            bar.n = index + 1 if by_runs else min(round(budget), round(time.monotonic() - began))
            bar.refresh()
            index += 1
    finally:
        bar.close()
        if not keep_all and not violations:
            shutil.rmtree(root, ignore_errors=True)
    for v in violations:
        print(f"chaos: VIOLATION [{v['invariant']}] seed {v['seed']} run {v['run']}: {v['message']}", file=sys.stderr)
    return {
        "seed": seed,
        "kinds": kinds,
        "minutes": minutes,
        "seconds": round(time.monotonic() - began, 1),
        "runs": len(records),
        "faults": faults,
        "faults_total": sum(faults.values()),
        "skipped": dict(planner.skipped),
        "violations": violations,
        "violation_count": len(violations),
        "durations": [r["seconds"] for r in records],
        "accuracies": accuracies(records),
        "run_records": records,
        "folder": str(root) if keep_all or violations else None,
    }


def accuracies(records: Sequence[Mapping[str, Any]]) -> list[float]:
    """The final accuracies of the runs that finished and were measured (one stopped by a violation in its last
    checks finished without one)."""
    return [r["accuracy"] for r in records if r["finished"] and r["accuracy"] is not None]


def summary(result: Mapping[str, Any]) -> str:
    """The figures in a few lines."""
    faults = ", ".join(f"{k} {n}" for k, n in result["faults"].items())
    lines = [
        f"seed {result['seed']}: {result['runs']} run(s) in {result['seconds']:.0f}s, "
        f"{result['faults_total']} fault(s) ({faults}), {result['violation_count']} violation(s)",
        f"run durations (s): {', '.join(f'{d:.1f}' for d in result['durations'])}",
        f"final accuracies: {', '.join(f'{a:.3f}' for a in result['accuracies']) or '-'}",
    ]
    lines += [f"skipped {k}: {why}" for k, why in result["skipped"].items()]
    lines += [f"VIOLATION [{v['invariant']}] run {v['run']}: {v['message']}" for v in result["violations"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="chaos", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to keep starting runs (default 10)")
    parser.add_argument(
        "--seed", type=int, default=None, help="the seed to draw jobs and faults from (default: a random one, printed)"
    )
    parser.add_argument("--kinds", default="all", help=f"fault kinds, comma-separated (default all: {','.join(KINDS)})")
    parser.add_argument("--runs", type=int, default=None, help="stop after this many runs instead of --minutes")
    parser.add_argument("--out", metavar="DIR", help="keep every run's folder (job file, logs, checkpoints) here")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or per-fault lines")
    parser.add_argument(
        "--elastic",
        action="store_true",
        help='run jobs with a range of workers (workers = "MIN:MAX") instead: workers join, leave, are killed and '
        "are paused past their lease while they train, with their own invariants (psgd.bench.chaos.elastic; "
        "--runs of them, default 8; --kinds and --minutes do not apply)",
    )
    args = parser.parse_args(argv)
    try:
        kinds = parse_kinds(args.kinds)
    except ValueError as exc:
        parser.error(str(exc))
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "big")

    def stop(signum, frame):  # so that every process and namespace is cleaned up on the way out
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    if args.elastic:
        return _elastic(args, seed)
    result = run_chaos(args.minutes, seed, kinds, out=args.out, progress=not args.no_progress, runs=args.runs)
    if args.json:  # first: the figures are kept whatever the summary meets
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(summary(result))
    return 0 if not result["violations"] else 1


def _elastic(args: argparse.Namespace, seed: int) -> int:
    """``--elastic``: the runs of jobs with a range of workers, their records and violations."""
    from psgd.bench.chaos.elastic import run_elastic

    say = (lambda line: None) if args.no_progress else print
    with tempfile.TemporaryDirectory(prefix="psgd-chaos-elastic-") as tmp:
        records = run_elastic(args.runs or 8, seed, Path(args.out or tmp), say)
    violations = [v for r in records for v in r["violations"]]
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": seed, "runs": records, "violations": violations}, indent=1))
    print(
        f"chaos, jobs with a range of workers: {len(records)} run(s) from seed {seed}, {len(violations)} violation(s)"
    )
    return 0 if not violations else 1


if __name__ == "__main__":
    sys.exit(main())
