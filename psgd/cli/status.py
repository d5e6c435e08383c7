"""``psgd status``: a live view of a running cluster.

``psgd status ADDRESS...`` asks every shard for its health and its Status
(version, policy, counters, staleness histogram, workers and their clocks)
and prints one table of shards and one of workers; with ``--watch`` it
refreshes, with rates computed between polls.  It needs only the addresses.
:class:`psgd.ops.view.ClusterView` is one poll of every address (its rows,
problems, JSON and text); :func:`cmd_status` is the command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from psgd.cli.connect import add_connect_arguments, connect_from_args
from psgd.config import ConfigError, JobConfig
from psgd.ops.view import ClusterView, collect

# -- psgd status ---------------------------------------------------------------------------------
STATUS_DESCRIPTION = """\
Show a running cluster: every shard's health, version, policy, weights held,
push and pull counts, late/duplicate/rejected pushes and staleness (p50/p99
from the shard's histogram), and every worker's state, clock, throughput and
lease, merged over the shards. Rates (pushes/s, steps/s) come from two polls
--sample seconds apart, or from successive refreshes with --watch.

examples:
  psgd status 10.0.0.5:50051 10.0.0.6:50051
  psgd status -c job.toml --watch 2
  PSGD_TOKEN=... psgd status shard-0:50051 shard-1:50053 --json
"""


def add_status_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "status",
        help="live view of a running cluster: shards, workers, clocks, staleness",
        description=STATUS_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "addresses",
        nargs="*",
        metavar="ADDRESS",
        help="shard addresses host:port (default: [cluster] servers and replica_servers of the job file -c)",
    )
    parser.add_argument("--config", "-c", metavar="JOB.toml", help="take the addresses from this job file")
    parser.add_argument(
        "--watch", type=float, default=None, metavar="SECONDS", help="refresh every SECONDS until interrupted (Ctrl-C)"
    )
    parser.add_argument("--count", type=int, default=None, metavar="N", help="with --watch: stop after N refreshes")
    parser.add_argument(
        "--sample",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="without --watch: poll twice this far apart to measure rates (0: poll once; default 1)",
    )
    parser.add_argument("--json", action="store_true", help="print each poll as one JSON object")
    add_connect_arguments(parser)
    parser.set_defaults(func=cmd_status)
    return parser


def status_addresses(args: argparse.Namespace) -> list[str]:
    job = JobConfig.load(args.config) if args.config else None
    addresses = list(args.addresses) or ([*job.cluster.servers, *job.cluster.recovery.replica_servers] if job else [])
    if not addresses:
        raise ConfigError("psgd status needs shard addresses (host:port ...) or a job file (-c) that lists them")
    for a in addresses:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"{a!r} is not an address: expected host:port")
    return addresses


def cmd_status(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    addresses = status_addresses(args)
    connect = connect_from_args(args)
    if args.watch is None:
        view = collect(addresses, connect)
        if args.sample > 0:
            time.sleep(args.sample)  # the interval over which rates are measured
            view = collect(addresses, connect, previous=view)
        _show(view, args.json, out, clear=False)
        return 0 if view.healthy() else 1
    if args.watch <= 0:
        raise ConfigError("--watch needs a positive number of seconds")
    clear = hasattr(out, "isatty") and out.isatty() and not args.json
    view, shown = None, 0
    while True:
        view = collect(addresses, connect, previous=view)
        if view.previous is not None:
            view.previous.previous = None  # keep one poll of history
        _show(view, args.json, out, clear)
        shown += 1
        if args.count and shown >= args.count:
            return 0 if view.healthy() else 1
        time.sleep(args.watch)  # the refresh period the user asked for


def _show(view: ClusterView, as_json: bool, out, clear: bool) -> None:
    if as_json:
        out.write(json.dumps(view.to_json()) + "\n")
    else:
        if clear:
            out.write("\x1b[H\x1b[2J")
        out.write(view.render() + "\n" + ("" if clear else "\n"))
    out.flush()
