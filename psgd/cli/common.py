"""Arguments and error handling shared by every psgd command."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from psgd.collective import BackendUnavailable
from psgd.compute import threads
from psgd.config import ClusterConfig, ConfigError, JobConfig
from psgd.data.base import SCORE_WORDS
from psgd.errors import InputError, PsgdError
from psgd.launcher import STOP_SIGNALS, LaunchInterrupted
from psgd.observe.progress import bar_wanted
from psgd.policy import POLICIES
from psgd.wire.channel import MAKE_TOKEN, SHORTEST_TOKEN, read_token

log = logging.getLogger("psgd.cli")

#: Errors that are the user's to fix (psgd.errors.InputError; and an all-reduce backend this machine lacks): printed
#: as one line, exit status 2.  Every other error psgd raises (psgd.errors.PsgdError): one line, exit status 1.
USER_ERRORS = (InputError, BackendUnavailable)

JOB_FLAGS = {
    # flag: (dotted key, type, help)
    "--model": (
        "model.name",
        str,
        "model: softmax, mlp, cnn, embed (ids in a table: clicks), or package.module:Class (default mlp)",
    ),
    "--dataset": (
        "data.name",
        str,
        "dataset: digits (bundled), synthetic, clicks, idx:DIR, npz:FILE or npy:DIR (default digits)",
    ),
    "--optimizer": ("optimizer.name", str, "optimizer: sgd, momentum, nesterov, adam, adamw (default momentum)"),
    "--lr": ("optimizer.lr", float, "learning rate (default 0.05 for momentum)"),
    "--batch-size": ("train.batch_size", int, "minibatch size per process (default 32)"),
    "--epochs": ("train.epochs", int, "passes over the training data (default 30)"),
    "--seed": ("train.seed", int, "seed for initial weights and data order (default 0)"),
    "--device": ("train.device", str, "cpu, cuda or cuda:N (default cpu)"),
    "--dtype": ("train.dtype", str, "float32 or float64 (default float32)"),
    "--threads": (
        "train.threads",
        int,
        "BLAS/OpenMP threads per process (default: all cores for a lone "
        "process; psgd launch divides the cores among the processes it starts; "
        "OMP_NUM_THREADS or OPENBLAS_NUM_THREADS, when set, rule instead)",
    ),
}


def _policy_flags() -> dict[str, tuple[str, type, str]]:
    """--policy and a flag for each policy option, from the registry (psgd.policy.POLICIES)."""
    defaults = ClusterConfig()
    described = " ".join(f"{name}: {cls.summary}." for name, cls in POLICIES.items())
    flags = {"--policy": ("cluster.policy", str, f"consistency policy (default {defaults.policy}). {described}")}
    for name, cls in POLICIES.items():
        for option in cls.options:
            key = option.cluster_key
            flags["--" + key.replace("_", "-")] = (
                f"cluster.{key}",
                option.type,
                f"{name}: {option.help} (default {getattr(defaults.consistency, key)})",
            )
    return flags


CLUSTER_FLAGS = {
    **_policy_flags(),
    "--shards": ("cluster.shards", int, "number of parameter-server shards (default 2)"),
    "--workers": (
        "cluster.workers",
        str,
        "number of workers (default 2), or a range MIN:MAX: the job starts with MIN and workers may join "
        "(psgd-worker --rank auto) and leave while it runs, as torchrun's --nnodes",
    ),
    "--servers": ("cluster.servers", str, "shard addresses host:port,host:port,... in shard order"),
    "--replicas": (
        "cluster.replicas",
        int,
        "async, ssp: 1 keeps a replica of every shard, which applies each update "
        "before the push is acknowledged and takes over when its primary dies (default 0)",
    ),
    "--replica-servers": (
        "cluster.replica_servers",
        str,
        "with --replicas 1: the replicas' addresses host:port,... in shard order",
    ),
    "--lease": ("cluster.lease_seconds", float, "seconds a silent worker keeps its place in the round (default 10)"),
}


def add_job_arguments(parser: argparse.ArgumentParser, cluster: bool = False) -> None:
    """The job file and the flags that override it (with ``cluster``, the [cluster] flags too)."""
    group = parser.add_argument_group("job", "what to train; flags override the job file")
    group.add_argument(
        "--config", "-c", metavar="JOB.toml", help="TOML job file (sections model, data, optimizer, train, cluster)"
    )
    for flag, (_, kind, text) in JOB_FLAGS.items():
        group.add_argument(flag, type=kind, default=None, help=text)
    group.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override any job-file key, e.g. --set model.hidden=[256,128] (repeatable)",
    )
    if cluster:
        group = parser.add_argument_group("cluster", "how the parameter-server job is laid out")
        for flag, (_, kind, text) in CLUSTER_FLAGS.items():
            group.add_argument(flag, type=kind, default=None, help=text)


#: Variables read by every command, between the job file and the flags: (variable, job key).
ENV_OVERRIDES = (
    ("PSGD_SERVERS", "cluster.servers"),
    ("PSGD_REPLICA_SERVERS", "cluster.replica_servers"),
    ("PSGD_SHARDS", "cluster.shards"),
    ("PSGD_WORKERS", "cluster.workers"),
)
#: Where psgd-worker finds its rank when --rank is not given, in this order.
RANK_VARIABLES = ("PSGD_RANK", "RANK", "SLURM_PROCID", "JOB_COMPLETION_INDEX")
#: Where psgd-worker finds the number of workers when neither --workers nor PSGD_WORKERS is given.
WORLD_VARIABLES = ("WORLD_SIZE",)


def env_int(name: str, environ: Mapping[str, str]) -> int:
    """An integer variable of the environment, or a ConfigError that names it."""
    raw = environ[name].strip()
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < 0:
        raise ConfigError(f"environment variable {name}={raw!r} must not be negative")
    return value


def first_env_int(names: Sequence[str], environ: Mapping[str, str]) -> tuple[int, str] | None:
    """(value, variable) of the first of ``names`` set in ``environ``, or None."""
    for name in names:
        if environ.get(name, "").strip():
            return env_int(name, environ), name
    return None


def job_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None, extra_env: Sequence[tuple[str, str]] = ()
) -> JobConfig:
    """The job: its file, then ``PSGD_*`` variables (and ``extra_env``: (variable, key) pairs read
    only when the key's own ``PSGD_`` variable is unset), then flags and ``--set``; validated once.  A value
    refused is blamed on what gave it: the flag, the variable or the ``--set``, else the job file."""
    environ = os.environ if environ is None else environ
    job = JobConfig.load(args.config) if args.config else JobConfig()
    given: dict[str, str] = {}  # section.key -> the flag, variable or --set that gave its value
    try:
        for name, dotted in (*ENV_OVERRIDES, *extra_env):
            own = [n for n, d in ENV_OVERRIDES if d == dotted and n != name]
            if environ.get(name, "").strip() and not any(environ.get(n, "").strip() for n in own):
                raw = environ[name].strip()
                given[dotted] = f"{name}={raw}"
                job = job.override(
                    dotted, raw if dotted in ("cluster.servers", "cluster.workers") else env_int(name, environ)
                )
        for flag, (dotted, _, _) in {**JOB_FLAGS, **CLUSTER_FLAGS}.items():
            value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
            if value is not None:
                given[dotted] = f"{flag} {value}"
                job = job.override(dotted, value)
        for item in args.set:
            given[item.partition("=")[0].strip()] = f"--set {item}"
        job = job.apply_sets(args.set, validate=False)
        job.validate()
    except ConfigError as exc:
        raise blamed(exc, job.source, given) from None
    return job


def blamed(exc: ConfigError, source: str, given: Mapping[str, str]) -> ConfigError:
    """``exc`` (``SOURCE: [section] key ...``) said of the flag, variable or ``--set`` in ``given`` that set that
    key, where one did; as it is otherwise."""
    text = str(exc)
    key = re.search(r"^[^:]*: \[(\w+)\] (?:unknown key '(\w+)'|(\w+))", text)
    origin = given.get(f"{key[1]}.{key[2] or key[3]}") if key else None
    if origin is None or not text.startswith(f"{source}: "):
        return exc
    return ConfigError(f"{origin}: {text[len(source) + 2 :]}")


def import_from_current_folder() -> None:
    """Put the current folder first on the import path, as ``python -m`` does, so that
    ``--model mymodule:MyNet`` finds ``./mymodule.py`` from every psgd command."""
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)


def import_nothing_from_current_folder() -> None:
    """For a command that runs no code of the user's (psgd report, which reads a folder someone else may have
    written): the current folder off the import path, where ``python -m`` put it, so that a module planted there (a
    ``matplotlib.py``) is never run."""
    here = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", ".", here)]


def ignore_stop_signals() -> None:
    """Once a command's work is done: SIGTERM, SIGINT and SIGHUP change nothing any more. (CPython puts
    back the default handlers early in its shutdown; a signal after that would kill the process and
    turn its exit status 0 into 128 + the signal's number.)"""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def start_process(config: JobConfig) -> None:
    """What every psgd process does once its job is known: its BLAS/OpenMP thread budget (psgd train's own is
    picked, and said, by the training in one process: :func:`psgd.training.local.train_local`)."""
    log.debug("BLAS/OpenMP threads: %s", threads.apply(config.train.threads))


def add_token_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--token",
        default=None,
        metavar="TOKEN",
        help="the job's shared secret, which every call carries (default: $PSGD_TOKEN), at "
        f"least {SHORTEST_TOKEN} characters. Make one with: {MAKE_TOKEN}",
    )


def token_from_args(args: argparse.Namespace) -> str:
    """The token --token or $PSGD_TOKEN gives; "" for none; a weak one refused (:func:`read_token`)."""
    return read_token(args.token)


def add_records_arguments(parser: argparse.ArgumentParser) -> None:
    """Where a single process keeps its records (psgd train): the JSON lines, and the run folder of their CSV and
    TensorBoard files, of this run alone (psgd.train's ``metrics`` and ``run_dir``)."""
    parser.add_argument(
        "--metrics",
        metavar="FILE.jsonl",
        help="append each step and evaluation as JSON lines to FILE (CSV and TensorBoard: --run-dir)",
    )
    parser.add_argument(
        "--run-dir",
        metavar="DIR",
        help="the run folder, of this run alone: its metrics' CSV and TensorBoard files, and "
        "DIR/local.jsonl without --metrics; one that holds another run's files is refused "
        "(default with --metrics: a new runs/DATE-TIME-local, said in the last line)",
    )


def add_progress_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="hide the progress bar (shown only where stderr is a terminal; elsewhere, as in a file "
        "or a pipe, a line each epoch takes its place)",
    )


def shows_progress(args: argparse.Namespace) -> bool:
    """Whether to draw a progress bar: not asked away, and stderr a terminal (a file or a pipe gets lines)."""
    return bar_wanted(False if args.no_progress else None)


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-v: debug)")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings only")
    parser.add_argument(
        "--log-file",
        metavar="PATH",
        default=None,
        help="also append the log to PATH, at INFO (DEBUG with -v) whatever -q says: psgd launch "
        "gives it to the worker whose progress bar the terminal shows",
    )


def verbosity(args: argparse.Namespace) -> int:
    return -1 if args.quiet else args.verbose


def run_command(prog: str, body: Callable[[], int]) -> int:
    """Run ``body``; a user error becomes one line on stderr and exit status 2."""
    try:
        return body()
    except USER_ERRORS as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except LaunchInterrupted as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except PsgdError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def score_fields(result: Any) -> dict[str, float | None]:
    """A result's score for a JSON line: ``test_accuracy``, and ``test_r2`` where the targets are values."""
    r2 = getattr(result, "test_r2", None)
    return {"test_accuracy": result.test_accuracy, **({"test_r2": r2} if r2 is not None else {})}


def score_said(accuracy: float | None, r2: float | None = None, sep: str = ": ") -> str:
    """``test accuracy: 0.9731``, or ``test R²: 0.9120`` where the targets are values (``r2`` set)."""
    metric, value = ("r2", r2) if r2 is not None else ("accuracy", accuracy)
    return f"{SCORE_WORDS[metric]}{sep}{value:.4f}"


#: what a run folder keeps of the command that started it (its job file holds the job; the folder is --resume's)
KEPT_IN_RUN = frozenset({"--config", "--set", "--run-dir", "--resume", *JOB_FLAGS, *CLUSTER_FLAGS})


def flags_not_kept(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The options ``args`` gives that the run folder does not keep (:data:`KEPT_IN_RUN`), as they are typed, in
    the parser's order: what the command that continues the run says again (psgd launch, psgd run)."""
    flags: list[str] = []
    for action in parser._actions:
        name = action.option_strings[0] if action.option_strings else None
        value = getattr(args, action.dest, None)
        if name is None or set(action.option_strings) & KEPT_IN_RUN or value in (None, False, action.default):
            continue
        if action.nargs == 0:  # a switch, or one counted (-v -v)
            flags += [name] * (1 if value is True else int(value))
        else:
            flags += [name, str(value)]
    return flags


def resumed_from(args: argparse.Namespace) -> None:
    """``--resume RUN``: the job file and the run folder are RUN's (psgd launch, psgd run)."""
    if args.resume:
        if args.config or args.run_dir:
            raise ConfigError("--resume RUN takes the job file and the run folder from RUN: drop -c and --run-dir")
        if not (Path(args.resume) / "job.toml").is_file():
            raise ConfigError(
                f"--resume {args.resume}: no job.toml there (not the run folder of a psgd launch or psgd run)"
            )
        args.config, args.run_dir = str(Path(args.resume) / "job.toml"), args.resume
