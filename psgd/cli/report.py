"""``psgd report RUN``: a run's summary in lines, and its curves as a PNG (:mod:`psgd.ops.report`)."""

from __future__ import annotations

import argparse

from psgd.cli.common import add_log_arguments, verbosity
from psgd.errors import install_extra
from psgd.observe.logs import setup_logging
from psgd.ops.report import draw, summarise

DESCRIPTION = """\
A run read back from its folder (psgd launch --run-dir RUN, or the folder its last line names): a line for the
job, then for each worker the steps it took (a resumed run's: of every part), its steps/s and the last test
accuracy it measured, the staleness of its updates and where a step's time went (fetching weights, computing, the
exchange), each on a line of its own;
and the training loss of every worker and the test accuracy against the steps done, drawn into RUN/report.png
(needs matplotlib: python3 -m pip install -c requirements.lock -e ".[bench]").  The same curves, live:
tensorboard --logdir RUN/tensorboard; the same figures as rows: RUN/worker-R.csv.

Nothing in the folder is trusted: only regular files are read, a line over 1 MiB or one that is no metrics record
is skipped and counted, the PNG is never written through a symbolic link, and nothing is imported from the current
folder.
"""


def add_report_parser(sub) -> None:
    parser = sub.add_parser(
        "report",
        help="a run's summary and its curves as a PNG (psgd report RUN)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run", metavar="RUN", help="the run folder")
    parser.add_argument("--png", metavar="FILE", help="where to draw the curves (default: RUN/report.png)")
    parser.add_argument("--no-png", action="store_true", help="print the summary only")
    add_log_arguments(parser)
    parser.set_defaults(func=cmd_report, user_code=False)  # the folder is read, nothing in it (nor here) is run


def cmd_report(args: argparse.Namespace) -> int:
    setup_logging("report", verbosity(args), args.log_file)
    report = summarise(args.run)
    for line in report.lines():
        print(line)
    if args.no_png:
        return 0
    try:
        path = draw(report, args.png or report.folder / "report.png")
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        print(f"the curves are not drawn: matplotlib is not installed (in psgd's folder: {install_extra('bench')})")
        return 0
    print(f"curves: {path}")
    return 0
