"""``psgd``: the umbrella command."""

from __future__ import annotations

import argparse
import json
import sys

from psgd import __version__
from psgd.cli import ops
from psgd.cli.common import add_job_arguments, add_log_arguments, job_from_args, run_command, verbosity
from psgd.logs import setup_logging

DESCRIPTION = """\
psgd trains networks written in NumPy/CuPy across processes and machines.

commands:
  launch   run a whole parameter-server job on this machine: K shards and N
           workers on 127.0.0.1, progress shown, final test accuracy printed
  train    train in a single process: the reference the distributed modes are
           checked against (bundled digits + MLP by default, ~98% in seconds)
  bench    benchmarks: `psgd bench convergence` trains one job under sync,
           async, ssp, sync with backup workers and all-reduce, with and
           without a straggler, and writes a table, plots and JSON;
           `psgd bench comm` measures pull/push/all-reduce throughput,
           latency, optimizer speed and memory against raw loopback TCP
  status   live view of a running cluster: shards' health, versions and
           staleness, workers' clocks and throughput (psgd status HOST:PORT...)
  doctor   preflight check of a job file: every address resolves and answers,
           ports, plan, token, TLS files and GPU, said in plain words

Across machines, start psgd-server (one per shard) and psgd-worker (one per
rank) yourself with the same job file; see their --help.
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
    add_log_arguments(train)
    train.set_defaults(func=cmd_train)

    launch = sub.add_parser(
        "launch", help="run a parameter-server job locally (shards + workers on 127.0.0.1)",
        description="Start K psgd-server shards and N psgd-worker processes on 127.0.0.1, show worker 0's "
                    "progress, wait for the workers to finish, then print the test accuracy of the weights "
                    "held by the shards. With no arguments: 2 shards, 2 workers, sync, the MLP on the "
                    "bundled digits.")
    add_job_arguments(launch, cluster=True)
    launch.add_argument("--mode", choices=("ps", "allreduce"), default="ps",
                        help="ps: parameter-server shards and workers (default); allreduce: N ranks averaging "
                             "gradients with --backend, no servers")
    launch.add_argument("--backend", choices=("mpi", "nccl"), default="mpi",
                        help="allreduce mode: mpi (CPU, needs the mpi extra) or nccl (one rank per GPU) "
                             "(default mpi)")
    launch.add_argument("--run-dir", metavar="DIR",
                        help="folder for the job file, logs and metrics (default: a new temporary folder)")
    launch.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                        help="stop everything and fail if the job runs longer (default 900)")
    launch.add_argument("--no-progress", action="store_true", help="hide worker 0's progress bar")
    launch.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    add_log_arguments(launch)
    launch.set_defaults(func=cmd_launch)
    _add_bench(sub)
    ops.add_status_parser(sub)
    ops.add_doctor_parser(sub)
    return parser


def _add_bench(sub) -> None:
    """``psgd bench convergence`` (the convergence lab) and ``psgd bench comm`` (psgd.bench)."""
    from psgd.bench import comm
    from psgd.bench.convergence import add_arguments

    bench = sub.add_parser("bench", help="benchmarks (convergence: every consistency policy, with stragglers; "
                                         "comm: how fast tensors move)",
                           description="Benchmarks of psgd itself. See `psgd bench convergence --help` and "
                                       "`psgd bench comm --help`.")
    kinds = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])
    lab = kinds.add_parser(
        "convergence", help="sync vs async vs ssp vs backup workers vs all-reduce, with and without a straggler",
        description="Train the same model, data, seed, workers and optimizer under each consistency policy "
                    "and all-reduce, as real processes on this machine, with and without an injected "
                    "straggler; write lab.json (every evaluation point), table.md and PNG plots of accuracy "
                    "and loss against wall time, updates and gradients. The default configuration (MLP on "
                    "digits, 4 workers, 2 shards, 3 repeats) takes 3-5 minutes on 2 cores; --quick "
                    "takes well under a minute.")
    add_arguments(lab)
    lab.set_defaults(func=cmd_bench_convergence)
    speed = kinds.add_parser(
        "comm", help="pull/push/all-reduce throughput, latency, optimizer speed and memory against raw TCP",
        description="Measure, in one run and side by side: raw loopback TCP and memory-copy bandwidth (the "
                    "machine's limits); a 40 MB model's pull+push in rounds, each beside TCP measured just before it; "
                    "pull, push and pull+push through psgd-server processes for models of "
                    "1-400 MB, over 1-4 shards and 1-4 workers, over gRPC alone and with compressed gradients; "
                    "an MPI all-reduce of the same bytes (needs the mpi extra); a tiny model's round trip "
                    "against a bare gRPC call; the optimizers' update throughput; peak memory of shards and "
                    "workers; and a 100M-parameter model over 4 shards. Ratios to the limits are printed as "
                    "each figure comes; --json writes them all. Everything takes about 12 minutes on 2 cores, "
                    "--quick under a minute.")
    comm.add_arguments(speed)
    speed.set_defaults(func=cmd_bench_comm)


def cmd_bench_convergence(args: argparse.Namespace) -> int:
    from psgd.bench.convergence import run_from_args

    setup_logging("lab", -1)
    return run_from_args(args)


def cmd_bench_comm(args: argparse.Namespace) -> int:
    from psgd.bench.comm import run_from_args

    setup_logging("bench", -1)
    run_from_args(args)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from psgd.cli.launch import launch

    setup_logging("launch", verbosity(args))
    job = job_from_args(args)
    result = launch(job, mode=args.mode, backend=args.backend, run_dir=args.run_dir,
                    progress=not args.no_progress, timeout=args.timeout, verbose=verbosity(args))
    c = job.cluster
    how = (f"{c.policy}, {c.shards} shard(s), {c.workers} worker(s)" if args.mode == "ps"
           else f"all-reduce over {args.backend}, {c.workers} rank(s)")
    if args.json:
        print(json.dumps({"test_accuracy": result.test_accuracy, "test_loss": result.test_loss,
                          "seconds": round(result.seconds, 3), "versions": result.versions,
                          "run_dir": result.run_dir, "mode": args.mode,
                          "policy": c.policy if args.mode == "ps" else args.backend}))
    else:
        print(f"final test accuracy: {result.test_accuracy:.4f} (loss {result.test_loss:.4f}; {how}, "
              f"{result.seconds:.1f}s; logs in {result.run_dir})")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import numpy as np

    from psgd.train import train_local

    setup_logging("local", verbosity(args))
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
