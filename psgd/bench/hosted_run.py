"""One convergence-lab run on the control host of an emulated network (``python -m psgd.bench.hosted_run SPEC
OUT``, started by :func:`psgd.bench.hosted.run_on`): its launcher and observer run here, its shards and workers on
their hosts; its :class:`~psgd.bench.labresult.RunResult` is written to OUT as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from psgd.bench.convergence import run_one
from psgd.bench.lab import LabConfig, parse_contender, parse_scenario
from psgd.bench.observe import Evaluator
from psgd.compute import threads
from psgd.launcher import Hosts


def main(argv: list[str] | None = None) -> int:
    """On ``ctl``: run the one lab run SPEC describes, write its RunResult to OUT."""
    argv = sys.argv[1:] if argv is None else argv
    threads.apply(1)  # this process evaluates beside the run, as the lab's own process does
    spec_path, out_path = argv[:2]
    spec = json.loads(Path(spec_path).read_text())
    config = LabConfig(**spec["config"])
    hosts = Hosts.from_spec(spec["hosts"])
    run = run_one(
        config,
        Evaluator(config.job_config()),
        parse_scenario(spec["delay"] or "none"),
        parse_contender(spec["contender"]),
        Path(spec["run_dir"]),
        None,
        hosts=hosts,
    )
    Path(out_path).write_text(json.dumps(run.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
