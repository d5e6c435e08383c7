"""``psgd-server``: serve one parameter-server shard of a job."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from psgd.cli.common import (
    add_job_arguments,
    add_log_arguments,
    add_token_argument,
    first_env_int,
    ignore_stop_signals,
    import_from_current_folder,
    job_from_args,
    run_command,
    start_process,
    token_from_args,
    verbosity,
)
from psgd.config import ConfigError
from psgd.config.parsing import Parser
from psgd.job import describe_job
from psgd.launcher import STOP_SIGNALS
from psgd.observe.files import open_own
from psgd.observe.logs import setup_logging
from psgd.observe.prometheus import ShardMetrics, add_metrics_arguments
from psgd.ops.ports import holder
from psgd.server import build_shard
from psgd.server.durable import recovery
from psgd.server.durable.replica import Replication
from psgd.server.net.listen import PortTaken, raise_descriptor_limit
from psgd.server.net.service import ShardServer
from psgd.server.state import checkpoint
from psgd.wire.channel import MAKE_TOKEN
from psgd.wire.tls import add_tls_arguments, tls_from_args

log = logging.getLogger("psgd.cli.server")

DESCRIPTION = """\
Serve shard K of a parameter-server job: hold that shard's slices of the
model's variables, answer workers' pulls and apply their pushes under the
job's consistency policy (sync, async or ssp).

Every process of a job reads the same job file; a worker built from another
model, dtype or shard count is refused when it registers. The shard index
comes from --shard, else PSGD_SHARD, else 0; the shard addresses from
--servers, PSGD_SERVERS or the job file. A shard needs the job's token
(--token or PSGD_TOKEN, the same on every process of the job) and refuses to
start without one: anyone who reaches its ports could otherwise read the
weights, push and stop the job. --no-token serves without one, saying so.
SIGTERM, SIGINT or SIGHUP: stop
serving, let calls in flight finish, write a last checkpoint, exit 0 (1 if
that checkpoint could not be written).

With [cluster] replicas = 1 (async, ssp) every shard runs twice: the first
process (its address in [cluster] servers) is the primary, the second
(--replica, at replica_servers) follows it, applying every update before the
push is acknowledged, and takes over when the primary dies; a killed
process started again follows whichever of the two leads.

examples:
  export PSGD_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')   # once, for every process
  psgd-server -c job.toml --shard 0 --bind 127.0.0.1:50051
  psgd-server --shards 1 --workers 4 --policy ssp --staleness 3 --bind 127.0.0.1:50051
  psgd-server -c job.toml --shard 0 --replica     # replicas = 1: shard 0's replica, at replica_servers[0]
"""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="psgd-server", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shard",
        type=int,
        default=None,
        help="which shard this process serves, 0..shards-1 (default: $PSGD_SHARD, else 0)",
    )
    parser.add_argument(
        "--replica",
        action="store_true",
        help="with [cluster] replicas = 1: start as shard K's replica, which follows its primary "
        "(the shard's entry in [cluster] servers, or --peer) and takes over when it dies; "
        "without it, the process is the primary unless its peer leads already "
        "(default: $PSGD_REPLICA=1)",
    )
    parser.add_argument(
        "--peer",
        metavar="HOST:PORT",
        help="with replicas: the other process of this shard's pair (default: its entry in "
        "[cluster] replica_servers for a primary, servers for a replica)",
    )
    parser.add_argument(
        "--bind",
        metavar="HOST:PORT",
        help="address to listen on (default: this shard's entry in [cluster] servers, or "
        "replica_servers with --replica, else 127.0.0.1 with a free port); never all "
        "interfaces unless you name 0.0.0.0",
    )
    parser.add_argument(
        "--data-port",
        type=int,
        default=None,
        metavar="PORT",
        help="port of the bulk data path (plain TCP, same host) for pulls and pushes (default: "
        "this shard's entry in [cluster] data_ports, else a free port, which workers learn "
        "from the shard; name one to open it in a firewall)",
    )
    parser.add_argument(
        "--port-file",
        metavar="FILE",
        help="write the address actually bound to FILE once serving; removed when the shard stops",
    )
    parser.add_argument(
        "--exit-when-done",
        action="store_true",
        help="exit once every worker has finished, or was dropped (lease expired) and has not "
        "come back within another lease",
    )
    parser.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="write crash-safe checkpoints into DIR/<job fingerprint>/shard-K and restore the "
        "newest intact one on start (default: no checkpoints)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start from the initial weights even though DIR holds this shard's checkpoints of "
        "another job, or only checkpoints of this job that do not pass their checks (without "
        "it, the shard refuses to start; the files are left alone). This job's own "
        "checkpoints that pass are still restored",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="seconds between checkpoints (default 30); one more is written on SIGTERM. A sync "
        "job checkpoints at every K-th round instead ([cluster] checkpoint_rounds, 100 unless "
        "set; 0: by seconds), every shard at the same versions (cuts), and the initial weights: "
        "a shard restarted from its cut takes the job back to it, and no round is lost",
    )
    parser.add_argument(
        "--keep-checkpoints",
        type=int,
        default=3,
        metavar="N",
        help="how many checkpoints to keep (default 3; a shard with cuts keeps at least 2: "
        "another shard killed before it wrote the newest comes back from the one before)",
    )
    add_token_argument(parser)
    parser.add_argument(
        "--no-token",
        action="store_true",
        help="serve without a token: anyone who reaches this shard's ports can read the weights, "
        "push and stop the job (without it, a shard with no token refuses to start)",
    )
    add_tls_arguments(parser, server=True)
    add_metrics_arguments(parser)
    add_job_arguments(parser, cluster=True)
    add_log_arguments(parser)
    return parser


def serve(args: argparse.Namespace) -> int:
    raise_descriptor_limit()  # a flood of connections meets the gRPC port's cap (listen.py), not this limit
    config = job_from_args(args)
    start_process(config)
    if args.shard is None:
        found = first_env_int(("PSGD_SHARD",), os.environ)
        args.shard = found[0] if found else 0
    if not 0 <= args.shard < config.cluster.shards:
        raise ConfigError(f"shard {args.shard} is out of range: the job has {config.cluster.shards} shard(s)")
    c = config.cluster
    args.replica = args.replica or os.environ.get("PSGD_REPLICA", "") == "1"
    if args.replica and not c.recovery.replicas:
        raise ConfigError("--replica starts a shard's replica, and this job keeps none: set [cluster] replicas = 1")
    setup_logging(f"server:{args.shard}{'r' if args.replica else ''}", verbosity(args), args.log_file)
    mine, theirs = (c.recovery.replica_servers, c.servers) if args.replica else (c.servers, c.recovery.replica_servers)
    bind = args.bind
    if bind is None:
        bind = mine[args.shard] if args.shard < len(mine) else "127.0.0.1:0"
    host, _, port_text = bind.rpartition(":")
    if not host or not port_text.isdigit():
        raise ConfigError(f"--bind {bind!r}: expected HOST:PORT")
    if args.checkpoint_every <= 0 or args.keep_checkpoints < 1:
        raise ConfigError("--checkpoint-every must be > 0 and --keep-checkpoints at least 1")
    core = build_shard(describe_job(config), args.shard, checkpoints=bool(args.checkpoint_dir))
    token = token_from_args(args)
    if not token and not args.no_token:
        raise ConfigError(
            "psgd-server needs the job's token, so that only the job's own processes can read or "
            "change it: pass --token or set PSGD_TOKEN, the same on every process of the job (make "
            f"one: {MAKE_TOKEN}); or --no-token to "
            "serve anyone who can reach this shard's ports"
        )
    if token and args.no_token:
        raise ConfigError("--no-token and a token (--token or PSGD_TOKEN) together: give one or the other")
    if args.checkpoint_dir:
        try:
            recovery.resume(core, args.checkpoint_dir, fresh=args.fresh, key=checkpoint.signing_key(token))
        except checkpoint.CheckpointError as exc:
            raise ConfigError(str(exc)) from None
    metrics = ShardMetrics.from_args(core, args, default_host=host).start()
    tls = tls_from_args(args, config)
    if not token:
        log.warning(
            "serving WITHOUT a token (--no-token): anyone who can reach %s and its data port can read the "
            "weights, push gradients and stop the job",
            bind,
        )
    try:
        data_port = (
            args.data_port
            if args.data_port is not None
            else c.links.data_ports[args.shard]
            if c.links.data_ports and not args.replica
            else 0
        )
        server = ShardServer(
            core,
            bind,
            request_timeout=c.deadlines.request_timeout,
            transport=c.links.transport,
            data_port=data_port,
            token=token,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_seconds=args.checkpoint_every,
            keep_checkpoints=args.keep_checkpoints,
            tls=tls,
            interceptors=metrics.interceptors,
            hello_timeout=c.links.hello_timeout,
            replicated=bool(c.recovery.replicas),
            busy_poll=c.links.busy_poll_seconds,
            on_cut_failure=c.recovery.on_cut_failure,
            job_shards=_job_shards(args, config),
        ).start()
    except PortTaken as exc:
        raise ConfigError(_port_taken(args, exc)) from None
    except (OSError, RuntimeError) as exc:
        raise ConfigError(f"shard {args.shard}: cannot listen on {bind}: {exc}") from None
    pair = None
    if c.recovery.replicas:
        peer = args.peer or (theirs[args.shard] if args.shard < len(theirs) else "")
        if args.replica and not peer:
            raise ConfigError(f"shard {args.shard}'s replica needs its primary's address: --peer, or [cluster] servers")
        me = mine[args.shard] if args.shard < len(mine) else server.address  # as the peer reaches it, not 0.0.0.0
        pair = Replication(
            core, me, peer, second=args.replica, token=token, tls=tls, ack_seconds=c.deadlines.request_timeout
        ).start()
    try:
        if args.port_file:
            _write_port_file(args.port_file, server.address)
        stop = _STOP
        if stop.is_set():
            log.info("received %s while starting: stopping", _RECEIVED[0])
        while not stop.is_set():
            if args.exit_when_done and server.wait_finished(timeout=0.5, settle=c.deadlines.lease_seconds):
                log.info(
                    "every worker has finished: stopping"
                    if core.role != "replica"
                    else "the primary says the job is over: stopping"
                )
                break
            stop.wait(0.5)
    finally:
        if pair is not None:  # the replica takes over unless the job is over
            pair.stop(finished=core.finished())
        saved = server.stop(grace=5.0)
        metrics.stop()
        if args.port_file:
            _remove_port_file(args.port_file, server.address)
    if not saved:
        log.error(
            "stopped at version %d, but its last checkpoint failed (above): restarted from %s it would "
            "lose the updates since the newest one there; exiting 1",
            core.version,
            args.checkpoint_dir,
        )
        return 1
    log.info("stopped at version %d", core.version)
    return 0


def _job_shards(args: argparse.Namespace, config) -> Callable[[], list[str]]:
    """The addresses of the job's shards and replicas ([cluster] servers and replica_servers), where a shard checks
    the cause of a rollback.  ``psgd launch`` writes them into the job file once every shard has bound its port,
    after this one started: where the job gave none at the start, the file is read again each time (a rollback's
    check, seldom)."""

    def of(job) -> list[str]:
        return [*job.cluster.servers, *job.cluster.recovery.replica_servers]

    known = of(config)
    if config.cluster.servers:
        return lambda: known

    def now() -> list[str]:
        try:
            return of(job_from_args(args))
        except ConfigError as exc:  # the rollback is refused for want of them, saying so
            log.warning("cannot read the job's shard addresses again: %s", exc)
            return []

    return now


def _port_taken(args: argparse.Namespace, exc) -> str:
    """One line: which of the shard's ports it cannot have, whose it is, and what to write instead."""
    who = f"; {holder(exc.port)} holds it" if "in use" in exc.why.lower() else ""
    if exc.what == "data port":
        way = (
            "give this shard another data port (--data-port or [cluster] data_ports), or leave both out and it "
            "takes a free one, which workers learn from the shard"
        )
    else:
        way = (
            "give this shard a free port on an address of this machine (its entry in [cluster] servers, or "
            "--bind HOST:PORT)"
        )
    return f"shard {args.shard}: cannot listen on its {exc.what} {exc.address} ({exc.why}{who}): {way}"


def _write_port_file(path: str, address: str) -> None:
    tmp = f"{path}.tmp"
    with open_own(tmp, "w") as f:  # (a run folder's file: never through a link planted there)
        f.write(address + "\n")
    os.replace(tmp, path)  # whoever waits for the file never reads half an address


def _remove_port_file(path: str, address: str) -> None:
    """The port file goes with the shard (a stopped shard's address is not one to dial), unless it names
    another address by now: a shard started since on the same file owns it."""
    with contextlib.suppress(OSError):
        if Path(path).read_text().strip() == address:
            os.unlink(path)


_STOP = threading.Event()
_RECEIVED: list[str] = []


def _on_signal(signum, frame) -> None:
    _RECEIVED.append(signal.Signals(signum).name)
    if not _STOP.is_set():
        log.info("received %s: stopping", _RECEIVED[-1])
    _STOP.set()


def main(argv: list[str] | None = None) -> int:
    import_from_current_folder()
    # First thing: a stop signal that arrives while the shard is still starting ends it cleanly too.
    for signum in STOP_SIGNALS:
        signal.signal(signum, _on_signal)
    args = build_parser().parse_args(argv)
    code = run_command("psgd-server", lambda: serve(args))
    ignore_stop_signals()  # a stop signal during teardown must not turn exit 0 into death by signal
    return code


if __name__ == "__main__":
    sys.exit(main())
