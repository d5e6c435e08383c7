"""``psgd check-model``: check a model before training it, one line per check.

The model is built for the job's dataset (digits unless the job says
otherwise) and dtype, then called the way every trainer calls it, on a batch of
random inputs: see :mod:`psgd.model.check`.  Exit status 0 when every check
passes, 2 when any fails.
"""

from __future__ import annotations

import argparse
import time

from psgd import data as datasets
from psgd import model as models
from psgd.cli.common import add_job_arguments, job_from_args
from psgd.compute import backend
from psgd.config import ConfigError
from psgd.model.check import FAIL

CHECK_MODEL_DESCRIPTION = """\
Check a model before training it: build it for the job's dataset and dtype,
then call it the way every trainer does, on a batch of 4 random inputs, and
print one line per check:

  build               the class imports and takes the job's options
  specs               VarSpec objects, unique names, positive shapes, the job's dtype
  init                init(seed) gives every variable with its shape and dtype;
                      init(seed, names=[...]) only those (the shards ask so)
  loss_and_grads      returns (loss, gradients) in that order, the loss a finite number
  gradients           one per variable, none for unknown names, with the
                      variable's shape and dtype, finite
  predict             scores of shape (batch, num_classes)
  finite differences  3 coordinates of every gradient against central
                      differences of the loss, in float64

Every training process (psgd train, each psgd-worker, each all-reduce rank)
runs the same checks before its first step and stops with these lines if one
fails. MODEL is a built-in name (softmax, mlp, cnn, embed) or package.module:Class,
imported from the current folder or the Python path. Exit status 0 when all
checks pass, 2 when any fails.

examples:
  psgd check-model tanhnet:TanhMLP                      # tanhnet.py in this folder
  psgd check-model tanhnet:TanhMLP --set model.width=128 --dtype float64
  psgd check-model mlp --dataset synthetic --set data.input_dim=256 --set model.hidden=[512]
  psgd check-model -c job.toml                          # the job file's model
"""


def add_check_model_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``psgd check-model MODEL [job flags]``."""
    parser = sub.add_parser(
        "check-model",
        help="check a model before training: specs, init, gradients (against finite differences), predict",
        description=CHECK_MODEL_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model_name",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="softmax, mlp, cnn, embed or package.module:Class (default: the job's model, mlp)",
    )
    add_job_arguments(parser)
    parser.set_defaults(func=cmd_check_model)
    return parser


def _line(status: str, name: str, text: str) -> str:
    return f"{status:<4} {name}: {text}"


def cmd_check_model(args: argparse.Namespace) -> int:
    if args.model_name is not None:
        if args.model is not None and args.model != args.model_name:
            raise ConfigError(f"two models given, {args.model_name!r} and --model {args.model!r}: give one")
        args.model = args.model_name
    config = job_from_args(args)
    name, options, dtype = config.model["name"], config.options("model"), config.train.dtype
    device = backend.use_device(config.train.device)
    ds = datasets.load_dataset(config.data["name"], dtype=dtype, **config.options("data"))
    print(f"checking model {name} for {ds.name}: input {ds.input_shape} {dtype}, {ds.targets_said()}, on {device}")
    began = time.perf_counter()
    shown = "".join(f", {k}={v!r}" for k, v in options.items())
    try:
        model = models.build_model(
            name, ds.input_shape, ds.num_classes, dtype=dtype, id_shape=ds.id_shape, target=ds.target, **options
        )
    except Exception as exc:  # a ModelError says it in one line; anything else a user's constructor raises
        text = (
            str(exc)
            if isinstance(exc, models.ModelError)
            else f"model {name!r}: the constructor raised {type(exc).__name__}: {' '.join(str(exc).split())}"
        )
        print(_line("FAIL", "build", text))
        print("the model could not be built")
        return 2
    print(
        _line(
            "ok",
            "build",
            f"{type(model).__name__}(input_shape={ds.input_shape}, "
            f"num_classes={ds.num_classes}, dtype={dtype!r}{shown})",
        )
    )
    checks = models.run_checks(
        model,
        ds.input_shape,
        ds.num_classes,
        dtype,
        config.train.seed,
        name=name,
        options=options,
        device=device,
        budget=None,
        id_shape=ds.id_shape,
        target=ds.target,
        target_shape=ds.target_shape,
    )
    for check in checks:
        for text in check.lines:
            print(_line(check.status, check.name, text))
    failed = [c.name for c in checks if c.status == FAIL]
    seconds = time.perf_counter() - began
    if failed:
        print(
            f"{len(failed)} of {len(checks) + 1} checks failed ({', '.join(failed)}); "
            f"fix the first one first, the others may follow from it"
        )
        return 2
    print(f"all {len(checks) + 1} checks passed in {seconds:.2f} s")
    return 0
