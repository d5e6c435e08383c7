"""``psgd doctor``: a preflight check of a job, before (or while) it runs.

``psgd doctor -c job.toml`` walks through what a job needs: no port given
twice on one host; then address by address: the name resolves, the gRPC and data ports accept connections, the
shard answers the health check and Status as the shard the job file says it
is, with the same partition plan; then the token, the TLS files and the GPU.
Each finding is one line in plain words; the exit status is 1 when anything
is wrong.  ``psgd doctor --health [ADDRESS]`` is the one-line health check
used by the container images.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from psgd.cli.common import add_job_arguments, job_from_args
from psgd.cli.connect import add_connect_arguments, connect_from_args
from psgd.ops.checks import Doctor
from psgd.ops.reach import check_health

HEALTH_ENV = "PSGD_HEALTH_ADDRESS"
DEFAULT_HEALTH_ADDRESS = "127.0.0.1:50051"


# -- psgd doctor ---------------------------------------------------------------------------------
DOCTOR_DESCRIPTION = """\
Check that a job can run, before starting workers or while it runs: no
port of the job file (the shards' and replicas' gRPC ports, [cluster]
data_ports) is given to two of its processes on one host; every shard
address resolves, its gRPC port and data port accept connections, it
answers the gRPC health check and Status as the shard the job file says it
is, with the same partition plan, policy and worker count; the token is
accepted; the TLS files exist and parse; the GPU asked for is
visible. Each finding is one line; the exit status is 1 when anything is
wrong, 0 otherwise.

--health [ADDRESS] only asks one shard's gRPC health service (default
$PSGD_HEALTH_ADDRESS, else 127.0.0.1:50051): exit 0 when it is SERVING. The
container images use it as their health check.

examples:
  psgd doctor -c job.toml
  PSGD_TOKEN=... psgd doctor -c job.toml --device cuda:0
  psgd doctor --health 127.0.0.1:50051
"""


def add_doctor_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "doctor",
        help="preflight check of a job: addresses, ports, health, plan, token, TLS, GPU",
        description=DOCTOR_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--health",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help=f"only check that ADDRESS (default ${HEALTH_ENV} or {DEFAULT_HEALTH_ADDRESS}) "
        "answers SERVING; no job file needed",
    )
    parser.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    add_connect_arguments(parser)
    add_job_arguments(parser, cluster=True)
    parser.set_defaults(func=cmd_doctor)
    return parser


def cmd_doctor(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    if args.health is not None:
        return health_check(args, out)

    config = job_from_args(args)
    doctor = Doctor(config, connect_from_args(args, config))
    findings = doctor.run()
    failures, warnings = doctor.failures, [f for f in findings if f.level == "warn"]
    if args.json:
        out.write(json.dumps({"ok": not failures, "findings": [dataclasses.asdict(f) for f in findings]}) + "\n")
    else:
        out.write(f"psgd doctor: {config.source}\n" + "\n".join(f.line() for f in findings) + "\n")
        if failures:
            out.write(
                f"{len(failures)} problem(s) found"
                + (f", {len(warnings)} warning(s)" if warnings else "")
                + ": fix the FAIL lines above.\n"
            )
        else:
            out.write("everything checked is in order" + (f" ({len(warnings)} warning(s))" if warnings else "") + ".\n")
    out.flush()
    return 1 if failures else 0


def health_check(args: argparse.Namespace, out) -> int:
    address = args.health or os.environ.get(HEALTH_ENV) or DEFAULT_HEALTH_ADDRESS
    health, error, _ = check_health(address, connect_from_args(args))
    out.write(f"{address}: {health}" + (f": {error}" if error else "") + "\n")
    out.flush()
    return 0 if health == "SERVING" else 1
