"""``psgd scale RUN --workers N``: grow or shrink a running launch of a job with a range of workers."""

from __future__ import annotations

import argparse
from pathlib import Path

from psgd.launcher.scale import ask

SCALE_DESCRIPTION = """\
Bring the launch running in RUN (a psgd launch of a job with a range of
workers, --workers MIN:MAX) to N workers while it trains: it starts workers at
the lowest ranks it is not running, or stops its highest ranks with SIGTERM.
A worker that joins pulls the current weights and trains; one that leaves
finishes its step and tells the shards, which shrink the job at once (under
sync, the next round closes without it). Nobody else restarts. N must be
within the job's range; the command returns once the launch took the request.

examples:
  psgd launch --workers 2:8 --run-dir runs/big
  psgd scale runs/big --workers 4
  psgd scale runs/big --workers 2
"""


def add_scale_parser(sub) -> None:
    scale = sub.add_parser(
        "scale",
        help="grow or shrink a running launch of a job with a range of workers",
        description=SCALE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    scale.add_argument("run", metavar="RUN", help="the run folder of the launch (its --run-dir)")
    scale.add_argument("--workers", type=int, required=True, metavar="N", help="how many workers to train with")
    scale.set_defaults(func=cmd_scale, parser=scale)


def cmd_scale(args: argparse.Namespace) -> int:
    print(ask(Path(args.run), args.workers))
    return 0
