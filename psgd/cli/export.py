"""``psgd export`` and ``psgd eval``: keep a job's trained model as one plain .npz, and test it.

Parsing and printing only; the work is in :mod:`psgd.export.shards`.
"""

from __future__ import annotations

import argparse
import json

from psgd.cli.common import (
    add_job_arguments,
    add_log_arguments,
    add_token_argument,
    job_from_args,
    score_said,
    start_process,
    token_from_args,
    verbosity,
)
from psgd.config.parsing import comma_list
from psgd.observe.logs import setup_logging
from psgd.training.evaluation import evaluate_file
from psgd.weights import ExportError, save_weights
from psgd.wire.tls import add_tls_arguments, tls_from_args

EXPORT_DESCRIPTION = """\
Save the weights of a parameter-server job as one plain .npz file, keyed by
variable name (load it with numpy.load(FILE, allow_pickle=False), or test it
with `psgd eval FILE`), a model's embedding tables as the rows that exist
(table:NAME:ids, increasing, and table:NAME:rows). The file is written to a
temporary name and renamed into place.

Two sources:

  running shards   the current weights, pulled from every shard as an
                   observer (no worker is disturbed, no round waited for),
                   and the tables' rows, listed a page at a time:
                   --servers HOST:PORT,... in shard order, or -c job.toml
                   whose [cluster] servers lists them. --token and the TLS
                   flags as for psgd-worker. The shards must be at one
                   version (a sync job between rounds, any job once it has
                   finished); --mixed-versions joins them as they are.
  checkpoints      --checkpoints DIR (psgd-server's --checkpoint-dir): the
                   newest intact checkpoint of each shard of this job
                   (DIR/<job fingerprint>/shard-K), each
                   checked against its SHA-256 (a damaged one is skipped for
                   the one before, and said). They must be of one version:
                   --version V takes checkpoint V of every shard, and
                   --mixed-versions joins the newest of each as it is.

The job flags (or -c job.toml) must describe the model that was trained
(model, dtype, number of shards, options): the partition plan is derived from
them, and checked against the shards' or the checkpoints' plan.

examples:
  psgd export -c job.toml model.npz
  psgd export --servers 10.0.0.5:50051,10.0.0.6:50051 --token "$PSGD_TOKEN" model.npz
  psgd export -c job.toml --tls-ca ca.pem model.npz
  psgd export -c job.toml --checkpoints ckpt/ model.npz
  psgd export --model cnn --shards 2 --checkpoints ckpt/ --version 1200 model.npz
  psgd eval -c job.toml model.npz
"""

EVAL_DESCRIPTION = """\
Evaluate weights saved in an .npz file (by psgd export, psgd train --save,
psgd launch --save or psgd-worker --save) on the test split of the job's
dataset, and print the test accuracy and loss. The file's variable names,
shapes and dtypes are first checked against the job's model; files with
pickled objects are refused. With no job flags: the MLP on the bundled
digits, as `psgd train` trains it.

examples:
  psgd eval model.npz
  psgd eval -c job.toml model.npz --json
  psgd eval --model cnn --dataset idx:data/mnist model.npz
"""


def add_export_parser(sub) -> None:
    parser = sub.add_parser(
        "export",
        help="save a job's weights as one plain .npz, from running shards or their checkpoints",
        description=EXPORT_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("file", metavar="FILE.npz", help="where to write the weights")
    source = parser.add_argument_group("checkpoints", "join the shards' checkpoints instead of asking running shards")
    source.add_argument(
        "--checkpoints", metavar="DIR", help="psgd-server's --checkpoint-dir, holding shard-0, shard-1, ..."
    )
    pick = source.add_mutually_exclusive_group()
    pick.add_argument(
        "--version",
        type=int,
        metavar="V",
        help="take checkpoint V (ckpt-V) of every shard (default: the newest intact of each, "
        "which must be of one version)",
    )
    pick.add_argument(
        "--mixed-versions",
        action="store_true",
        help="join the shards' weights (the newest intact checkpoint of each, or what running shards "
        "hold) even when their versions differ",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="running shards: give up on a shard after this long (default: the job's request_timeout, 60)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    add_token_argument(parser)
    add_tls_arguments(parser, server=False)
    add_job_arguments(parser, cluster=True)
    add_log_arguments(parser)
    parser.set_defaults(func=cmd_export)


def add_eval_parser(sub) -> None:
    parser = sub.add_parser(
        "eval",
        help="test accuracy and loss of weights saved in an .npz",
        description=EVAL_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("file", metavar="FILE.npz", help="the weights (plain .npz keyed by variable name)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    add_job_arguments(parser)
    add_log_arguments(parser)
    parser.set_defaults(func=cmd_eval)


def cmd_export(args: argparse.Namespace) -> int:
    from psgd.export.shards import join_checkpoints, pull_from_servers

    setup_logging("export", verbosity(args), args.log_file)
    if args.checkpoints and args.servers:
        raise ExportError("give either --servers (running shards) or --checkpoints DIR, not both")
    if not args.checkpoints and args.version is not None:
        raise ExportError("--version chooses among checkpoints: use it with --checkpoints DIR")
    if args.servers and args.shards is None:  # the addresses say how many shards there are
        args.shards = len(comma_list(args.servers, "--servers", what="addresses", error=ExportError))
    config = job_from_args(args)
    start_process(config)
    if args.checkpoints:
        result = join_checkpoints(config, args.checkpoints, args.version, args.mixed_versions)
    else:
        result = pull_from_servers(
            config,
            config.cluster.servers,
            token_from_args(args),
            tls_from_args(args),
            request_timeout=args.timeout,
            mixed=args.mixed_versions,
        )
    size = save_weights(args.file, result.weights)
    if args.json:
        print(
            json.dumps(
                {
                    "file": args.file,
                    "variables": len(result.weights),
                    "parameters": result.parameters,
                    "bytes": size,
                    "versions": result.versions,
                    "source": result.source,
                    "checkpoints": result.files,
                    "notes": result.notes,
                }
            )
        )
    else:
        versions = ", ".join(f"shard {k}: {v}" for k, v in enumerate(result.versions))
        notes = "".join(f"; note: {n}" for n in result.notes)
        print(
            f"wrote {args.file}: {len(result.weights)} variables, {result.parameters} parameters, {size} bytes; "
            f"versions {versions}; from {result.source}{notes}"
        )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    setup_logging("eval", verbosity(args), args.log_file)
    config = job_from_args(args)
    start_process(config)
    result = evaluate_file(config, args.file)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{score_said(result.get('test_accuracy'), result.get('test_r2'))}"
            f" (loss {result['test_loss']:.4f}) of {args.file}: "
            f"{result['variables']} variables, {result['parameters']} parameters; model {result['model']} on "
            f"{result['examples']} test examples of {result['dataset']}"
        )
    return 0
