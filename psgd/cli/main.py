"""``psgd``: the umbrella command."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import psgd
from psgd import __version__, launcher
from psgd.cli import bench, doctor, models, scale, status
from psgd.cli import export as export_cli
from psgd.cli import report as report_cli
from psgd.cli.common import (
    add_job_arguments,
    add_log_arguments,
    add_progress_argument,
    add_records_arguments,
    first_env_int,
    flags_not_kept,
    import_from_current_folder,
    import_nothing_from_current_folder,
    job_from_args,
    resumed_from,
    run_command,
    score_fields,
    score_said,
    shows_progress,
    verbosity,
)
from psgd.config import ConfigError
from psgd.config.parsing import Parser, comma_list
from psgd.observe.logs import setup_logging
from psgd.training.divergence import EXIT_DIVERGED
from psgd.wire.tls import add_tls_arguments, launch_tls
from psgd.worker.stop import STOP_SIGNALS

if TYPE_CHECKING:
    from psgd.launcher import LaunchResult

DESCRIPTION = """\
psgd trains networks written in NumPy/CuPy across processes and machines.

Across machines: `psgd launch --nnodes N --node-rank R --hosts ...` on each,
or start psgd-server (one per shard) and psgd-worker (one per rank) yourself
with the same job file; see their --help. Flags are never abbreviated.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="psgd", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"psgd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    train = sub.add_parser(
        "train",
        help="train in one process: the reference the other modes are checked against",
        description="Train a model in one process and print the final test accuracy. "
        "With no arguments: the MLP on the bundled UCI digits, momentum SGD, 30 epochs.",
    )
    add_job_arguments(train)
    add_records_arguments(train)
    train.add_argument("--save", metavar="FILE.npz", help="save the final weights (plain .npz, no pickle)")
    train.add_argument(
        "--checkpoint",
        metavar="FILE.npz",
        help="where a run stopped by SIGINT (Ctrl-C), SIGTERM or SIGHUP leaves its state: weights, "
        "optimizer and step (plain .npz); it says where as it stops (default: nowhere)",
    )
    train.add_argument(
        "--resume",
        metavar="FILE.npz",
        help="go on from the state a stopped run left in FILE (the same job: model, data, "
        "optimizer, dtype, batch size and seed), ending with the weights an unstopped run ends "
        "with; stopped again, it leaves its state there (or in --checkpoint)",
    )
    add_progress_argument(train)
    train.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    add_divergence_argument(train)
    add_log_arguments(train)
    train.set_defaults(func=cmd_train)

    launch = sub.add_parser(
        "launch",
        help="run a job: shards + workers (or all-reduce ranks) on 127.0.0.1 to its final test accuracy, "
        "or this node's share of a multi-node job",
        description="Start K psgd-server shards and N psgd-worker processes on 127.0.0.1, show worker 0's "
        "progress, wait for the workers to finish, then print the test accuracy of the weights "
        "held by the shards. With no arguments: 2 shards, 2 workers, sync, the MLP on the "
        "bundled digits. The cores are divided among the processes (one line says how), and "
        "where each has a core of its own a data connection watches for its answer up to 1 ms "
        "before it sleeps ([cluster] busy_poll_us; one line says so); "
        "SIGINT, SIGTERM and SIGHUP stop every process, which gets 10 s to leave "
        "before it is killed; no process outlives the launcher. A stop pauses the job (the workers "
        "are told with SIGINT, so that no round closes without them): "
        "psgd launch --resume RUN goes on from its shards' checkpoints in the run folder "
        "(runs/DATE-TIME-MODE unless --run-dir). Your own model in the current "
        "folder is found, as with python -m.",
        epilog="many machines, one command on each (shard k and worker r run on node k % nnodes and "
        "r % nnodes; node i's shards listen on hosts[i]:port, port+2, ...):\n"
        "  psgd launch --nnodes 2 --node-rank 0 --hosts 10.0.0.5,10.0.0.6 --shards 2 --workers 4\n"
        "  psgd launch --nnodes 2 --node-rank 1 --hosts 10.0.0.5,10.0.0.6 --shards 2 --workers 4\n"
        "node 0 prints the accuracy and keeps the weights once every worker is done.\n\n"
        "GPUs, as torchrun places local ranks: --device cuda puts worker (or rank) r of this node on GPU\n"
        "r mod G, G the GPUs visible (CUDA_VISIBLE_DEVICES decides which); --device cuda:0,2 goes round\n"
        "GPUs 0 and 2; --device cuda:N puts every worker on GPU N. Shards stay on the CPU. One line says\n"
        "the placement; psgd doctor lists the GPUs.\n"
        "  psgd launch --device cuda --workers 4\n\n"
        "Run as root with Open MPI's mpiexec (mode allreduce), the launcher sets OMPI_ALLOW_RUN_AS_ROOT\n"
        "and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM for the ranks, and says so.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_job_arguments(launch, cluster=True)
    launch.add_argument(
        "--mode",
        choices=("ps", "allreduce"),
        default="ps",
        help="ps: parameter-server shards and workers (default); allreduce: N ranks averaging "
        "gradients with --backend, no servers",
    )
    launch.add_argument(
        "--backend",
        choices=("mpi", "nccl"),
        default="mpi",
        help="allreduce mode: mpi (CPU, needs the mpi extra) or nccl (one rank per GPU) (default mpi)",
    )
    add_run_arguments(launch)
    launch.add_argument(
        "--emulated-hosts",
        metavar="FILE.json",
        help="run shard k on emulated host s<k> and worker (or rank) r on w<r>, as FILE says "
        "(each host's command prefix and address; psgd bench's --network writes such files)",
    )
    nodes = launch.add_argument_group("many machines")
    nodes.add_argument("--nnodes", type=int, default=1, help="machines taking part, one launch on each (default 1)")
    nodes.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this machine's index, 0..nnodes-1 (default: $PSGD_NODE_RANK, else $SLURM_NODEID, else 0)",
    )
    nodes.add_argument(
        "--hosts", metavar="HOST,HOST,...", help="every node's address, in node-rank order (default: $PSGD_HOSTS)"
    )
    nodes.add_argument(
        "--port",
        type=int,
        default=29500,
        help="first gRPC port of each node's shards; each data port is its gRPC port + 1 (default 29500)",
    )
    launch.add_argument(
        "--no-progress",
        action="store_true",
        help="hide worker 0's progress bar (shown where stderr is a terminal; elsewhere worker 0's "
        "log lines take its place)",
    )
    add_tls_arguments(launch, launch=True)
    launch.add_argument(
        "--accept-lost-updates",
        action="store_true",
        help="exit 0 even if the shards ended at different versions (a shard that restarted from "
        "an older checkpoint lost updates; without this flag: exit status 4, and one WARNING "
        "line and --json's \"lost_updates\" say how many per shard)",
    )
    add_divergence_argument(launch)
    add_log_arguments(launch)
    launch.set_defaults(func=cmd_launch, parser=launch)

    run = sub.add_parser(
        "run",
        help="your own training loop: the shards, and a copy of your script for every worker",
        description="Start K psgd-server shards on 127.0.0.1 and, for each of the N workers, a copy of SCRIPT "
        "(python SCRIPT ARGS...), as torchrun does; then print the test accuracy of the weights the "
        "shards hold. In the script, psgd.join() joins the job (its file, the worker's rank, its "
        "device and token come in the environment psgd run sets): pull, push, this worker's batches "
        "and share of the data, the policy's clock, a clean stop. The loop is the script's own. "
        "Worker 0's output is shown; every worker's is in its log in the run folder. Signals, the "
        "timeout and the run folder are as psgd launch's.",
        epilog="example (docs/howto/python.md has the script):\n"
        "  psgd run --workers 2 --shards 1 --epochs 5 hardest.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_job_arguments(run, cluster=True)
    add_run_arguments(run)
    add_tls_arguments(run, launch=True)
    add_log_arguments(run)
    run.add_argument("script", metavar="SCRIPT", help="the Python file each worker runs")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments")
    run.set_defaults(func=cmd_run, parser=run)
    bench.add_parser(sub)
    status.add_status_parser(sub)
    scale.add_scale_parser(sub)
    doctor.add_doctor_parser(sub)
    models.add_check_model_parser(sub)
    export_cli.add_export_parser(sub)
    export_cli.add_eval_parser(sub)
    report_cli.add_report_parser(sub)
    return parser


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """What psgd launch and psgd run share: the weights saved, the run folder, the time limit, the JSON result,
    going on from a run folder."""
    parser.add_argument(
        "--save",
        metavar="FILE.npz",
        help="where to keep the trained weights, a plain .npz keyed by variable name, see psgd eval "
        "(default: RUN/final.npz)",
    )
    parser.add_argument(
        "--run-dir",
        metavar="DIR",
        help="folder for the job file, logs and metrics (default: a new one in runs/ under the "
        "current folder, runs/DATE-TIME-MODE, said in the last line); one that holds another "
        "run's files is refused (continue that run with --resume)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        metavar="SECONDS",
        help="stop everything and fail if the job runs longer (default 900)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the result as one JSON object on stdout; a launch that failed prints its error "
        "and a record of each process that failed (\"failures\")",
    )
    parser.add_argument(
        "--resume",
        metavar="RUN",
        help="continue the stopped or crashed parameter-server job of run folder RUN (its job.toml, "
        "its shards' checkpoints in RUN/checkpoints, its logs, appended to): each worker goes on "
        "from the step its shards hold",
    )


def layout_from_args(args: argparse.Namespace, environ=None):
    """Where this node stands in a multi-node launch: flags first, then PSGD_NODE_RANK/SLURM_NODEID, PSGD_HOSTS."""
    environ = os.environ if environ is None else environ
    node_rank = args.node_rank
    if node_rank is None:
        found = first_env_int(("PSGD_NODE_RANK", "SLURM_NODEID"), environ) if args.nnodes > 1 else None
        node_rank = found[0] if found else 0
    hosts = args.hosts if args.hosts is not None else environ.get("PSGD_HOSTS", "")
    return launcher.Layout(args.nnodes, node_rank, tuple(comma_list(hosts, "--hosts", empty=True)), args.port)


def cmd_launch(args: argparse.Namespace) -> int:
    setup_logging("launch", verbosity(args), args.log_file)
    resumed_from(args)
    config = job_from_args(args)
    layout = layout_from_args(args)
    hosts = launcher.Hosts.load(args.emulated_hosts) if args.emulated_hosts else None
    result = launched(
        args,
        lambda: launcher.launch(
            config,
            mode=args.mode,
            backend=args.backend,
            run_dir=args.run_dir,
            progress=not args.no_progress,
            timeout=args.timeout,
            verbose=verbosity(args),
            save=args.save,
            layout=layout,
            hosts=hosts,
            tls=launch_tls(args),
            resume=bool(args.resume),
            resume_flags=flags_not_kept(args.parser, args),
        ),
    )
    c = config.cluster
    how = (
        f"{c.policy}, {c.shards} shard(s), {c.workers} worker(s)"
        if args.mode == "ps"
        else f"all-reduce over {args.backend}, {c.workers} rank(s)"
    )
    if args.json:
        print(
            json.dumps(
                {
                    **score_fields(result),
                    "test_loss": result.test_loss,
                    "seconds": round(result.seconds, 3),
                    "versions": result.versions,
                    "steps": sum(result.worker_steps),
                    "worker_steps": result.worker_steps,
                    "run_dir": result.run_dir,
                    "mode": args.mode,
                    "saved": result.saved,
                    "node_rank": layout.node_rank,
                    "policy": c.policy if args.mode == "ps" else args.backend,
                    "diverged": result.divergence is not None,
                    "divergence": result.divergence,
                    "lost_updates": {str(k): n for k, n in result.lost.items()},
                    "went_back": {str(k): b for k, b in result.went_back.items()},
                    "failed_over": {str(k): n for k, n in result.failed_over.items()},
                    "unreplicated": {str(k): n for k, n in result.unreplicated.items()},
                    "shard_seconds": {str(k): t for k, t in result.shard_seconds.items()},
                    "failures": [],
                }
            )
        )
    elif layout.node_rank > 0:
        print(
            f"node {layout.node_rank} of {layout.nnodes} done ({how}, {result.seconds:.1f}s; logs in "
            f"{result.run_dir}); node 0 prints the final accuracy"
        )
    else:
        saved = f"; weights saved to {result.saved}" if result.saved else ""
        print(
            f"final {score_said(result.test_accuracy, result.test_r2)} (loss {result.test_loss:.4f}; {how}, "
            f"{result.seconds:.1f}s; logs in {result.run_dir}{saved}){diverged_words(result.divergence)}"
        )
    if result.lost and not args.accept_lost_updates:
        return launcher.EXIT_LOST_UPDATES
    return divergence_status(args, result.divergence)


def launched(args: argparse.Namespace, start: Callable[[], LaunchResult]) -> LaunchResult:
    """The result of the launch ``start`` makes.  One that fails (exit status 1, its error on stderr) prints first,
    with --json, ``{"error": ..., "failures": [...]}`` on stdout: its error's first line and a record of each
    process of the job that failed (:class:`~psgd.launcher.failures.ChildFailure`); a launch that finished has
    none (any failure ends a launch), and its result says ``"failures": []``."""
    try:
        return start()
    except launcher.LaunchError as exc:
        if args.json:
            print(json.dumps({"error": str(exc).splitlines()[0], "failures": [f.record() for f in exc.failures]}))
        raise


def cmd_run(args: argparse.Namespace) -> int:
    setup_logging("run", verbosity(args), args.log_file)
    if not Path(args.script).is_file():
        raise ConfigError(f"{args.script}: no such file (the Python script each worker runs)")
    resumed_from(args)
    config = job_from_args(args)
    result = launched(
        args,
        lambda: launcher.launch(
            config,
            run_dir=args.run_dir,
            timeout=args.timeout,
            verbose=verbosity(args),
            save=args.save,
            tls=launch_tls(args),
            resume=bool(args.resume),
            resume_flags=flags_not_kept(args.parser, args),
            script=[str(Path(args.script).resolve()), *args.script_args],
        ),
    )
    c = config.cluster
    if args.json:
        print(
            json.dumps(
                {
                    **score_fields(result),
                    "test_loss": result.test_loss,
                    "seconds": round(result.seconds, 3),
                    "versions": result.versions,
                    "steps": sum(result.worker_steps),
                    "worker_steps": result.worker_steps,
                    "run_dir": result.run_dir,
                    "saved": result.saved,
                    "failures": [],
                }
            )
        )
    else:
        saved = f"; weights saved to {result.saved}" if result.saved else ""
        print(
            f"final {score_said(result.test_accuracy, result.test_r2)} (loss {result.test_loss:.4f}; {c.policy}, "
            f"{c.shards} shard(s), {c.workers} copies of {args.script}, {result.seconds:.1f}s; logs in "
            f"{result.run_dir}{saved})"
        )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import signal
    import threading

    setup_logging("local", verbosity(args), args.log_file)
    config = job_from_args(args)  # (its threads: psgd.train picks them, and says so)
    stop, heard = threading.Event(), []
    for signum in STOP_SIGNALS:  # the step in hand is finished, the state kept (--checkpoint), then the end
        signal.signal(signum, lambda signum, frame: (heard.append(signum), stop.set()))
    result = psgd.train(
        job=config,
        progress=shows_progress(args),
        metrics=args.metrics,
        save=args.save,
        checkpoint=args.checkpoint,
        resume=args.resume,
        stop=stop,
        run_dir=args.run_dir,
    )
    if heard:
        name = signal.Signals(heard[0]).name
        kept = (
            f"its state is in {result.checkpoint}: psgd train --resume {result.checkpoint} goes on from there"
            if result.checkpoint
            else "its state is not kept (--checkpoint FILE keeps it)"
        )
        print(f"psgd train: stopped by {name} after {result.steps} step(s); {kept}", file=sys.stderr)
        return 128 + heard[0]
    summary = {
        **score_fields(result),
        "test_loss": result.test_loss,
        "steps": result.steps,
        "seconds": round(result.seconds, 3),
        "run_dir": result.run_dir,
        "diverged": result.divergence is not None,
        "divergence": result.divergence,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        records = f"; records in {result.run_dir}" if result.run_dir else ""
        print(
            f"final {score_said(result.test_accuracy, result.test_r2)} (loss {result.test_loss:.4f}, "
            f"{result.steps} steps in {result.seconds:.1f}s{records}){diverged_words(result.divergence)}"
        )
    return divergence_status(args, result.divergence)


def add_divergence_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fail-on-divergence",
        action="store_true",
        help=f"exit with status {EXIT_DIVERGED} if the run diverged: a loss not finite, the test loss above its "
        "first value, or the accuracy at chance, for several evaluations in a row (one "
        "WARNING line says so either way, and --json carries \"diverged\")",
    )


def diverged_words(divergence: dict | None) -> str:
    return f"; DIVERGED: {divergence['why']} (see the warning above)" if divergence else ""


def divergence_status(args: argparse.Namespace, divergence: dict | None) -> int:
    return EXIT_DIVERGED if divergence and args.fail_on_divergence else 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    (import_from_current_folder if getattr(args, "user_code", True) else import_nothing_from_current_folder)()
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return run_command("psgd", lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
