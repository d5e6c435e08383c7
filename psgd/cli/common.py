"""Arguments and error handling shared by every psgd command."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from psgd.config import ConfigError, JobConfig
from psgd.data import DataError
from psgd.model import ModelError
from psgd.optim import OptimizerError
from psgd.partition import PlanError
from psgd.policy import PolicyError
from psgd.cli.launch import LaunchError
from psgd.collective import BackendUnavailable, CollectiveError
from psgd.worker.client import PSError
from psgd.tls import TLSError
from psgd.xp import DeviceError

#: Errors that are the user's to fix: printed as one line, exit status 2.
USER_ERRORS = (ConfigError, DataError, ModelError, OptimizerError, DeviceError, PlanError, PolicyError,
               BackendUnavailable, TLSError)
#: Errors of a running cluster (unreachable shard, refused request): one line, exit status 1.
CLUSTER_ERRORS = (PSError, LaunchError, CollectiveError)

JOB_FLAGS = {
    # flag: (dotted key, type, help)
    "--model": ("model.name", str, "model: softmax, mlp, cnn, or package.module:Class (default mlp)"),
    "--dataset": ("data.name", str, "dataset: digits (bundled), synthetic, idx:DIR or npz:FILE (default digits)"),
    "--optimizer": ("optimizer.name", str, "optimizer: sgd, momentum, nesterov, adam, adamw (default momentum)"),
    "--lr": ("optimizer.lr", float, "learning rate (default 0.05 for momentum)"),
    "--batch-size": ("train.batch_size", int, "minibatch size per process (default 32)"),
    "--epochs": ("train.epochs", int, "passes over the training data (default 30)"),
    "--seed": ("train.seed", int, "seed for initial weights and data order (default 0)"),
    "--device": ("train.device", str, "cpu, cuda or cuda:N (default cpu)"),
    "--dtype": ("train.dtype", str, "float32 or float64 (default float32)"),
}

CLUSTER_FLAGS = {
    "--policy": ("cluster.policy", str, "consistency policy: sync (BSP), async, or ssp (default sync)"),
    "--staleness": ("cluster.staleness", int, "ssp: clocks a worker may run ahead of the slowest (default 2)"),
    "--backup-workers": ("cluster.backup_workers", int,
                         "sync: close each round without the last B workers' pushes (default 0)"),
    "--shards": ("cluster.shards", int, "number of parameter-server shards (default 2)"),
    "--workers": ("cluster.workers", int, "number of workers (default 2)"),
    "--servers": ("cluster.servers", str, "shard addresses host:port,host:port,... in shard order"),
    "--lease": ("cluster.lease_seconds", float,
                "seconds a silent worker keeps its place in the round (default 10)"),
}


def add_job_arguments(parser: argparse.ArgumentParser, cluster: bool = False) -> None:
    """The job file and the flags that override it (with ``cluster``, the [cluster] flags too)."""
    group = parser.add_argument_group("job", "what to train; flags override the job file")
    group.add_argument("--config", "-c", metavar="JOB.toml",
                       help="TOML job file (sections model, data, optimizer, train, cluster)")
    for flag, (_, kind, text) in JOB_FLAGS.items():
        group.add_argument(flag, type=kind, default=None, help=text)
    group.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override any job-file key, e.g. --set model.hidden=[256,128] (repeatable)")
    if cluster:
        group = parser.add_argument_group("cluster", "how the parameter-server job is laid out")
        for flag, (_, kind, text) in CLUSTER_FLAGS.items():
            group.add_argument(flag, type=kind, default=None, help=text)


def job_from_args(args: argparse.Namespace) -> JobConfig:
    job = JobConfig.load(args.config) if args.config else JobConfig()
    for flag, (dotted, _, _) in {**JOB_FLAGS, **CLUSTER_FLAGS}.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None:
            job.override(dotted, value)
    job.apply_sets(args.set)
    return job


def add_token_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token", default=None, metavar="TOKEN",
                        help="shared secret every call must carry (default: $PSGD_TOKEN; none: no check). "
                             "Make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'")


def token_from_args(args: argparse.Namespace) -> str:
    return args.token if args.token is not None else os.environ.get("PSGD_TOKEN", "")


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-v: debug)")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings only")


def verbosity(args: argparse.Namespace) -> int:
    return -1 if args.quiet else args.verbose


def run_command(prog: str, body: Callable[[], int]) -> int:
    """Run ``body``; a user error becomes one line on stderr and exit status 2."""
    try:
        return body()
    except USER_ERRORS as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except CLUSTER_ERRORS as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
