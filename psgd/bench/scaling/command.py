"""``psgd bench scaling``'s command line: :data:`DESCRIPTION` (its help), :func:`add_arguments`, the flags
checked into :class:`Settings` (:func:`settings_from_args`), and :func:`run_from_args`."""

from __future__ import annotations

import argparse
from pathlib import Path

from psgd.bench.scaling.grid import CONFIGS, DEFAULT_OUT, DEFAULT_TIMEOUT, DEFAULTS, QUICK, WIDTHS, Settings
from psgd.bench.scaling.report import json_text
from psgd.bench.scaling.runner import run_benchmark
from psgd.config.parsing import comma_list

#: What the benchmark runs and measures, and what it writes: the command line's --help.
DESCRIPTION = """How training speed scales with the model's width, the workers and the mode, run as a user runs it.

Every run is a real ``psgd train`` or ``psgd launch`` process started exactly
as a user would type it, in the caller's environment, untouched: no thread
variable is set for them, so whatever psgd does (or fails to do) about BLAS
threads on this machine is what gets measured.  The single exception is the
labelled peer column, the same 2-worker sync launch with
OPENBLAS_NUM_THREADS, OMP_NUM_THREADS and MKL_NUM_THREADS set to 1 in that
one process's environment; "as shipped / peer" should be at least 0.8 at
every width.  Beside it, the "no budget" column passes ``--threads`` with
this machine's core count to every process, which is what every psgd
process did before it had a thread budget: it shows what the budget prevents.

For the MLP on the bundled digits at hidden widths 64-4096 (one hidden layer)
and for the CNN, with SGD (lr 0.1) and batch 32 per worker:
  - one process (``psgd train``);
  - 1, 2 and 4 workers under ``--policy sync`` and ``--policy async`` (one
    parameter-server shard), and ``--mode allreduce`` (needs the mpi extra;
    recorded as skipped without it).

steps/s counts minibatch gradients computed per second, by all workers
together, taken from what the processes record, not from the wall time around
them (Python and gRPC start-up would dominate): ``psgd train --json`` (steps /
seconds of its training loop), the workers' ``worker-K.jsonl`` (steps
completed while every worker was stepping, over that window) and rank 0's
``allreduce.jsonl`` (its steps/s after the first step, times N).  Scaling
efficiency of N workers = aggregate steps/s / (N x one process's steps/s).

Written to ``--out``: ``table.md`` (steps/s, per-worker steps/s, efficiency,
the peer ratio and the BLAS threads the launcher reported), ``scaling.json``
(every run and figure, the machine, this process's thread pools) and
``scaling.png`` (steps/s against width, log-log, one line per configuration).

    psgd bench scaling          # everything, 264 runs: about 15 minutes on 2 cores (an estimate*)
    psgd bench scaling --quick  # widths 64 and 512, 1-2 workers, sync + peer + no budget + one process
    psgd bench scaling --widths 256,1024 --configs single,sync,peer --repeats 5

*Estimated from --quick (8 runs in 12 s, ~1.5 s a run, mostly start-up) and the
heaviest rows (width 4096 and the CNN, 4 workers: ~5 s a run) on a busy 2-core
machine; where BLAS threads fight (many cores, 20-35 steps/s) a run of 880
gradients takes up to a minute, and the whole far longer.
"""


def _number(flag: str, text: str, kind=int, low: float = 1):
    try:
        value = kind(text)
    except ValueError:
        raise _config_error(f"{flag}: expected a {'whole ' if kind is int else ''}number, got {text!r}") from None
    if not value >= low:
        raise _config_error(f"{flag} must be at least {low:g}, got {text}")
    return value


def _config_error(message: str) -> Exception:
    from psgd.config import ConfigError

    return ConfigError(message)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The flags, checked (a bad one is a one-line :class:`ConfigError`); --quick fills what is not given."""
    base = QUICK if args.quick else DEFAULTS
    ints = dict(kind=int, what="whole numbers", at_least=1, unique=True, error=_config_error)
    widths = (
        comma_list(args.widths, "--widths", empty=True, **ints) if args.widths is not None else list(base["widths"])
    )
    workers = comma_list(args.workers, "--workers", **ints) if args.workers is not None else list(base["workers"])
    configs = (
        comma_list(args.configs, "--configs", choices=CONFIGS, empty=True, error=_config_error)
        if args.configs is not None
        else list(base["configs"])
    )
    if not set(configs) - {"cnn"}:
        raise _config_error(f"--configs: nothing to run; name at least one of {', '.join(CONFIGS[:-1])}")
    epochs = _number("--epochs", args.epochs) if args.epochs is not None else base["epochs"]
    repeats = _number("--repeats", args.repeats) if args.repeats is not None else base["repeats"]
    timeout = _number("--timeout", args.timeout, float, 1) if args.timeout is not None else DEFAULT_TIMEOUT
    network = (args.network or "").strip()
    if network:
        from psgd.bench import netns

        try:
            netns.check_networks([network])
        except netns.NetworkError as exc:
            raise _config_error(str(exc)) from None
    settings = Settings(
        widths,
        workers,
        list(dict.fromkeys(configs)),
        epochs,
        repeats,
        timeout,
        args.out or DEFAULT_OUT,
        args.quick,
        network,
    )
    if not settings.rows:
        raise _config_error("nothing to run: give --widths, or add cnn to --configs")
    if not settings.plan():
        raise _config_error(f"--configs {args.configs} with --workers {args.workers}: nothing to run")
    return settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (``psgd bench scaling``; ``benchmarks/scaling.py`` runs the same command)."""
    parser.add_argument(
        "--widths",
        metavar="LIST",
        help="MLP hidden widths, comma-separated (default " + ",".join(map(str, WIDTHS)) + "; quick 64,512)",
    )
    parser.add_argument(
        "--workers",
        metavar="LIST",
        help="worker (rank) counts for sync, async and all-reduce (default 1,2,4; quick 1,2)",
    )
    parser.add_argument(
        "--configs",
        metavar="LIST",
        help="comma-separated, from " + ", ".join(CONFIGS) + ": single (psgd train), sync and "
        "async (psgd launch --mode ps, 1 shard), allreduce (psgd launch --mode allreduce), "
        "peer (2w sync with 1 BLAS thread, beside its as-shipped twin), allcores (2w sync "
        "with a thread per core in every process, i.e. no thread budget), cnn (add the CNN "
        "row) (default: all; quick single,sync,peer,allcores)",
    )
    parser.add_argument(
        "--epochs",
        metavar="N",
        help="passes over the training data per run, ~45 gradients each whatever the workers "
        f"(default {DEFAULTS['epochs']}; quick {QUICK['epochs']})",
    )
    parser.add_argument(
        "--repeats",
        metavar="N",
        help="run everything N times, going round the whole list; the table shows medians "
        f"(default {DEFAULTS['repeats']}; quick {QUICK['repeats']})",
    )
    parser.add_argument(
        "--timeout", metavar="SECONDS", help=f"fail a run that takes longer (default {DEFAULT_TIMEOUT:g})"
    )
    parser.add_argument(
        "--out", metavar="DIR", help=f"where table.md, scaling.json and scaling.png go (default {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="widths 64 and 512, 1 and 2 workers, sync + peer + one process, 1 epoch, 1 repeat "
        "(~15 s); flags given beside it win",
    )
    parser.add_argument(
        "--network",
        metavar="RATE",
        help="run every launch on emulated links of this rate (e.g. 1gbit, 10gbit, none; root and "
        "tc): each shard, worker and all-reduce rank on a host of its own, its link shaped to "
        "the rate and measured first; one-process runs stay on this machine",
    )
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE as JSON")
    parser.add_argument("--keep-runs", metavar="DIR", help="keep every run's logs and metrics under DIR")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run_from_args(args: argparse.Namespace) -> int:
    """Run what the flags ask for and print the table; 1 when a run failed."""
    settings = settings_from_args(args)
    result = run_benchmark(settings, progress=not args.no_progress, keep_runs=args.keep_runs)
    if args.json:
        Path(args.json).write_text(json_text(result))
    print(Path(result["files"]["table"]).read_text())
    print(
        f"{len(result['runs'])} runs in {result['seconds']:.0f}s; wrote {', '.join(sorted(result['files'].values()))}"
    )
    return 1 if any(r.get("error") for r in result["runs"]) else 0
