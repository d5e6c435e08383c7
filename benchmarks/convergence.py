"""The convergence lab: sync vs async vs bounded staleness vs all-reduce, with stragglers.

A thin script around the library in ``psgd/bench/`` (the same as ``psgd bench
convergence``); results and their reading are in ``benchmarks/RESULTS.md``.

    python benchmarks/convergence.py                      # the default configuration (< 10 min on 2 cores)
    python benchmarks/convergence.py --quick              # every output, in well under a minute
    python benchmarks/convergence.py --preset synthetic   # a ~10M-parameter MLP: communication dominates
    python benchmarks/convergence.py --help
"""

from __future__ import annotations

import sys

from psgd.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "convergence", *sys.argv[1:]]))
