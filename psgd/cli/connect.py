"""The command line's connection flags to running shards (``--timeout``, ``--token``, TLS), read into a
:class:`psgd.ops.reach.Connect`."""

from __future__ import annotations

import argparse

from psgd.ops.reach import Connect
from psgd.wire.channel import TOKEN_ENV, read_token
from psgd.wire.tls import tls_from_args


def add_connect_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--timeout", type=float, default=3.0, metavar="SECONDS", help="deadline for each call to a shard (default 3)"
    )
    group.add_argument(
        "--token", default=None, help=f"the job's shared token (default: the {TOKEN_ENV} environment variable)"
    )
    group.add_argument(
        "--tls-ca",
        metavar="FILE",
        default=None,
        help="CA certificate (PEM) to check the shards' certificates: talk TLS to them",
    )
    group.add_argument("--tls-cert", metavar="FILE", default=None, help="client certificate (PEM) for mutual TLS")
    group.add_argument("--tls-key", metavar="FILE", default=None, help="client private key (PEM) for mutual TLS")


def connect_from_args(args: argparse.Namespace, config=None) -> Connect:
    """How to reach the shards: the flags, and where they name no TLS file, the job file ``config``'s [tls]
    table (if any)."""
    return Connect.using(tls_from_args(args, config), read_token(args.token), args.timeout)
