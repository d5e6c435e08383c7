"""``psgd``: the umbrella command."""

from __future__ import annotations

import argparse
import json
import sys

from psgd import __version__
from psgd.cli.common import add_job_arguments, job_from_args, run_command
from psgd.logs import setup_logging

DESCRIPTION = """\
psgd trains networks written in NumPy/CuPy across processes and machines.

commands:
  train    train in a single process: the reference the distributed modes are
           checked against (bundled digits + MLP by default, ~97% in seconds)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="psgd", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"psgd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser(
        "train", help="single-process reference trainer",
        description="Train a model in one process and print the final test accuracy. "
                    "With no arguments: the MLP on the bundled UCI digits, momentum SGD, 30 epochs.")
    add_job_arguments(train)
    train.add_argument("--metrics", metavar="FILE.jsonl", help="append evaluation points as JSON lines to FILE")
    train.add_argument("--save", metavar="FILE.npz", help="save the final weights (plain .npz, no pickle)")
    train.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    train.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    train.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-v: debug)")
    train.add_argument("-q", "--quiet", action="store_true", help="warnings only")
    train.set_defaults(func=cmd_train)
    return parser


def cmd_train(args: argparse.Namespace) -> int:
    import numpy as np

    from psgd.train import train_local

    setup_logging("local", -1 if args.quiet else args.verbose)
    job = job_from_args(args)
    result = train_local(job, progress=not args.no_progress, metrics_path=args.metrics)
    if args.save:
        np.savez(args.save, **result.params)
    summary = {"test_accuracy": result.test_accuracy, "test_loss": result.test_loss,
               "steps": result.steps, "seconds": round(result.seconds, 3)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"final test accuracy: {result.test_accuracy:.4f} (loss {result.test_loss:.4f}, "
              f"{result.steps} steps in {result.seconds:.1f}s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return run_command("psgd", lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
