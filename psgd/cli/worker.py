"""``psgd-worker``: train as one worker of a parameter-server job."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from psgd.cli.common import (
    RANK_VARIABLES,
    WORLD_VARIABLES,
    add_job_arguments,
    add_log_arguments,
    add_progress_argument,
    add_token_argument,
    first_env_int,
    ignore_stop_signals,
    import_from_current_folder,
    job_from_args,
    run_command,
    score_fields,
    score_said,
    shows_progress,
    start_process,
    token_from_args,
    verbosity,
)
from psgd.collective.exchange import train_allreduce
from psgd.config import ConfigError
from psgd.config.parsing import Parser
from psgd.observe.logs import setup_logging
from psgd.observe.prometheus import WorkerMetrics, add_metrics_arguments
from psgd.training.delay import DelayError, parse_delay
from psgd.training.loop import Interrupted
from psgd.weights import save_weights
from psgd.wire.tls import add_tls_arguments, tls_from_args
from psgd.worker.exchange import run_worker
from psgd.worker.stop import STOP_SIGNALS, Stop

DESCRIPTION = """\
Train as one worker of a job.

--mode ps (default): worker RANK of a parameter-server job: pull the weights
from every shard, compute gradients on this worker's share of the data (NumPy,
or CuPy with --device cuda), push them back, repeat for the job's epochs, then
leave.

--mode allreduce: one rank of an all-reduce job: compute gradients on this
rank's share, average them with the other ranks (--backend mpi on CPUs, under
mpiexec; --backend nccl on GPUs, one rank per GPU), and apply the same
optimizer update on every rank. No servers are involved.

Where things come from, first found wins: the rank from --rank, PSGD_RANK,
RANK, SLURM_PROCID or JOB_COMPLETION_INDEX; the shard addresses from
--servers, PSGD_SERVERS or the job file; the number of workers from
--workers, PSGD_WORKERS, WORLD_SIZE or the job file (PSGD_SHARDS likewise).
SIGTERM or SIGHUP: finish the step in hand, push it, leave the job, exit 0.
SIGINT (Ctrl-C): the same, but paused: the shards are not told it left (their
sync rounds wait for it), and started again it goes on from there.

examples:
  psgd-worker -c job.toml --rank 0
  psgd-worker --rank 1 --workers 2 --servers 10.0.0.5:50051,10.0.0.6:50051 --device cuda:0
  mpiexec -n 4 psgd-worker --mode allreduce --backend mpi --workers 4 --save weights.npz
  psgd-worker --mode allreduce --backend nccl --rank 0 --workers 2 --device cuda:0 \\
      --rendezvous tcp:10.0.0.5:29500
"""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="psgd-worker", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rank",
        type=_rank,
        default=None,
        help="this worker's rank, 0..workers-1 (ps and nccl modes; mpi takes it from mpiexec), or auto: join a job "
        "with a range of workers (--workers MIN:MAX) at the lowest rank nobody holds, which shard 0 gives",
    )
    parser.add_argument(
        "--mode",
        choices=("ps", "allreduce"),
        default="ps",
        help="ps: train against parameter-server shards (default); allreduce: average "
        "gradients between ranks, no servers",
    )
    parser.add_argument(
        "--backend",
        choices=("mpi", "nccl"),
        default="mpi",
        help="allreduce mode: mpi (CPU, start under mpiexec) or nccl (GPU) (default mpi)",
    )
    parser.add_argument(
        "--rendezvous",
        metavar="file:PATH|tcp:HOST:PORT",
        help="nccl: where rank 0 hands out the NCCL id (default file:/tmp/psgd-nccl-id.json; "
        "tcp:HOST:PORT is rank 0's address)",
    )
    parser.add_argument("--save", metavar="FILE.npz", help="allreduce mode: rank 0 saves the final weights here")
    parser.add_argument("--metrics", metavar="FILE.jsonl", help="append one JSON line per step to FILE")
    parser.add_argument(
        "--eval-every",
        type=int,
        default=None,
        metavar="STEPS",
        help="evaluate on the test split every STEPS steps (default: each epoch on rank 0)",
    )
    parser.add_argument(
        "--delay",
        metavar="SPEC",
        help="slow steps down, to play a straggler: fixed:S, exp:MEAN, uniform:LO:HI or "
        "slowdown:K (each step K times as long), optionally @RANKS (e.g. slowdown:4@0)",
    )
    add_progress_argument(parser)
    parser.add_argument("--json", action="store_true", help="print a summary as one JSON object on stdout")
    add_token_argument(parser)
    add_tls_arguments(parser, server=False)
    add_metrics_arguments(parser)
    add_job_arguments(parser, cluster=True)
    add_log_arguments(parser)
    return parser


def _rank(text: str) -> int | str:
    """--rank: a rank, or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a rank (an integer) or auto, got {text!r}") from None


def rank_from(args: argparse.Namespace, environ=None) -> tuple[int | None, str]:
    """This worker's rank and where it came from: --rank, else the first of RANK_VARIABLES set."""
    if args.rank is not None:
        return args.rank, "--rank"
    found = first_env_int(RANK_VARIABLES, os.environ if environ is None else environ)
    return found if found else (None, "")


def work(args: argparse.Namespace) -> int:
    config = job_from_args(args, extra_env=[(name, "cluster.workers") for name in WORLD_VARIABLES])
    start_process(config)
    if not (args.mode == "allreduce" and args.backend == "mpi"):  # under mpiexec, MPI says the rank
        args.rank, rank_source = rank_from(args)
    try:
        delay = parse_delay(args.delay)
    except DelayError as exc:
        raise ConfigError(str(exc)) from None
    if args.mode == "allreduce":
        return allreduce(args, config, delay)

    if args.rank is None:
        raise ConfigError(f"no rank: pass --rank, or set one of {', '.join(RANK_VARIABLES)}")
    setup_logging(f"worker:{args.rank}", verbosity(args), args.log_file)
    if rank_source != "--rank":
        logging.getLogger("psgd.cli.worker").info("rank %d from %s", args.rank, rank_source)
    if not config.cluster.servers:
        raise ConfigError("no server addresses: pass --servers host:port,... or set [cluster] servers in the job file")
    auto = args.rank == "auto"
    if not auto and not 0 <= args.rank < config.cluster.workers:
        raise ConfigError(
            f"rank {args.rank} (from {rank_source}) is out of range: the job has {config.cluster.workers} worker(s)"
        )
    stop = _STOP  # set by SIGTERM, SIGINT or SIGHUP (see main): finish the step in hand, push it, leave

    def took(rank: int) -> None:  # --rank auto: the log says the rank shard 0 gave
        args.rank = rank
        setup_logging(f"worker:{rank}", verbosity(args), args.log_file)

    try:
        result = _train(args, config, None if auto else args.rank, stop, delay, took)
    except Interrupted as exc:  # stopped before it had a rank: nothing to leave
        logging.getLogger("psgd.cli.worker").info("%s", exc)
        return 0
    logging.getLogger("psgd.cli.worker").info("%s", last_line(result, config.cluster.shards))
    if args.json:
        print(
            json.dumps(
                {
                    "rank": result.rank,
                    "steps": result.steps,
                    "clock": result.final_clock,
                    "seconds": round(result.seconds, 3),
                    "outcomes": result.summary["outcomes"],
                    "peak_rss_mb": round(peak_rss_mb(), 1),
                }
            )
        )
    return 0


def _train(args, config, rank: int | None, stop, delay, took):
    """One parameter-server worker's training, its metrics served where asked (``rank`` None: --rank auto)."""
    metrics = WorkerMetrics.from_args(args, rank if rank is not None else -1)

    def joined(given: int) -> None:  # --rank auto: its metrics and its log say the rank shard 0 gave
        metrics.took_rank(given)
        took(given)

    with metrics:
        return run_worker(
            config,
            rank,
            config.cluster.servers,
            progress=shows_progress(args),
            stop=stop,
            metrics_path=args.metrics,
            evaluate_every=args.eval_every,
            delay=delay,
            token=token_from_args(args),
            tls=tls_from_args(args, config),
            on_step=metrics.on_step,
            on_rank=joined,
        )


#: what a shard did with a push, in words (psgd.policy's outcomes)
DID = {
    "applied": "applied",
    "accumulated": "added to a round",
    "duplicate": "already had (a retry)",
    "late": "too late for its round",
    "rejected": "refused",
}


def last_line(result, shards: int) -> str:
    """A parameter-server worker's last line, in plain words: what it did, and the test accuracy of the weights its
    last step left where it evaluated them."""
    summary, total = result.summary, result.summary.get("job_steps", 0)
    if total is None:  # a job with a range of workers: it trained the batches shard 0 handed it
        ended = "left the job" if summary.get("stopped") else "done (no batch of the job left)"
    elif result.steps == 0 and result.final_clock >= total:
        return (
            f"worker {result.rank}: nothing to do, the job is already finished (its shards are past its last "
            f"step, {total})"
        )
    else:
        ended = "done" if result.final_clock >= total else f"stopped at step {result.final_clock} of {total}"
    done = ", ".join(f"{n} {DID.get(k, k)}" for k, n in sorted(summary["outcomes"].items()))
    line = (
        f"worker {result.rank} {ended}: {result.steps} steps in {result.seconds:.1f}s (its pushes, counted at "
        f"each of {shards} shard(s): {done or 'none'})"
    )
    if "final_versions" in summary:
        line += (
            f"; {score_said(result.test_accuracy, result.test_r2, ' ')} of the weights its last step left "
            f"(versions {', '.join(map(str, summary['final_versions']))})"
        )
    return line


def allreduce(args: argparse.Namespace, job, delay) -> int:
    if args.backend == "nccl" and args.rank is None:
        raise ConfigError("--backend nccl needs --rank (0..workers-1) and --device cuda:N")
    result, rank, world = train_allreduce(
        job,
        args.backend,
        rank=args.rank,
        rendezvous=args.rendezvous,
        on_rank=lambda r: setup_logging(f"allreduce:{r}", verbosity(args), args.log_file),
        progress=shows_progress(args),
        metrics_path=args.metrics,
        evaluate_every=args.eval_every,
        delay=delay,
    )
    if rank == 0:
        if args.save:
            save_weights(args.save, result.params)
        if args.json:
            print(
                json.dumps(
                    {
                        "rank": 0,
                        "world_size": world,
                        "steps": result.steps,
                        "seconds": round(result.seconds, 3),
                        "comm_seconds": round(result.summary["comm_seconds"], 3),
                        **score_fields(result),
                    }
                )
            )
        else:
            print(
                f"final {score_said(result.test_accuracy, result.test_r2)} ({world} rank(s), "
                f"{args.backend}, {result.steps} steps in {result.seconds:.1f}s)"
            )
    return 0


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (``VmHWM``: unlike ``ru_maxrss`` it does
    not carry over the parent's memory from before ``exec``); NaN where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


_STOP = Stop()


def main(argv: list[str] | None = None) -> int:
    import_from_current_folder()
    # First thing: a stop signal that arrives while the worker is still starting ends it cleanly too.
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda signum, frame: _STOP.signalled(signum))
    args = build_parser().parse_args(argv)
    if args.mode == "allreduce":  # ranks stop together: MPI and the launcher end them with a signal
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
    code = run_command("psgd-worker", lambda: work(args))
    ignore_stop_signals()  # a stop signal during teardown must not turn exit 0 into death by signal
    return code


if __name__ == "__main__":
    sys.exit(main())
