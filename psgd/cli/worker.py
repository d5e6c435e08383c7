"""``psgd-worker``: train as one worker of a parameter-server job."""

from __future__ import annotations

import argparse
import json
import sys

from psgd.cli.common import add_job_arguments, add_log_arguments, job_from_args, run_command, verbosity
from psgd.config import ConfigError
from psgd.logs import setup_logging

DESCRIPTION = """\
Train as worker RANK of a parameter-server job: pull the weights from every
shard, compute gradients on this worker's share of the data (NumPy, or CuPy
with --device cuda), push them back, repeat for the job's epochs, then leave.

examples:
  psgd-worker -c job.toml --rank 0
  psgd-worker --rank 1 --workers 2 --servers 10.0.0.5:50051,10.0.0.6:50051 --device cuda:0
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="psgd-worker", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, required=True, help="this worker's rank, 0..workers-1")
    parser.add_argument("--metrics", metavar="FILE.jsonl", help="append one JSON line per step to FILE")
    parser.add_argument("--eval-every", type=int, default=None, metavar="STEPS",
                        help="evaluate on the test split every STEPS steps (default: each epoch on rank 0)")
    parser.add_argument("--step-delay", type=float, default=0.0, metavar="SECONDS",
                        help="add SECONDS to every step, to play a slow machine (default 0)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--json", action="store_true", help="print a summary as one JSON object on stdout")
    add_job_arguments(parser, cluster=True)
    add_log_arguments(parser)
    return parser


def work(args: argparse.Namespace) -> int:
    from psgd.worker.loop import run_worker

    job = job_from_args(args)
    setup_logging(f"worker:{args.rank}", verbosity(args))
    if not job.cluster.servers:
        raise ConfigError("no server addresses: pass --servers host:port,... or set [cluster] servers in the job file")
    if not 0 <= args.rank < job.cluster.workers:
        raise ConfigError(f"--rank {args.rank} is out of range: the job has {job.cluster.workers} worker(s)")
    if args.step_delay < 0:
        raise ConfigError("--step-delay must be >= 0")
    result = run_worker(job, args.rank, job.cluster.servers, progress=not args.no_progress,
                        metrics_path=args.metrics, evaluate_every=args.eval_every, step_delay=args.step_delay)
    if args.json:
        print(json.dumps({"rank": result.rank, "steps": result.steps, "clock": result.final_clock,
                          "seconds": round(result.seconds, 3), "outcomes": result.outcomes}))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command("psgd-worker", lambda: work(args))


if __name__ == "__main__":
    sys.exit(main())
