"""How fast psgd moves tensors, against this machine's own limits, in one run.

A thin script around ``psgd/bench/comm.py`` (the same as ``psgd bench comm``);
results and their reading are in ``benchmarks/RESULTS.md``.

    python benchmarks/comm.py --json benchmarks/results/comm.json   # everything, about 15 minutes on 2 cores
    python benchmarks/comm.py --quick                               # 1-16 MB, under a minute
    python benchmarks/comm.py --parts sweep --sizes-mb 40 --steps 20
    python benchmarks/comm.py --help
"""

from __future__ import annotations

import sys

from psgd.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "comm", *sys.argv[1:]]))
