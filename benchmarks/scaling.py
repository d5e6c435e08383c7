"""Training speed against model width, workers and mode, as a user runs psgd, beside a 1-BLAS-thread peer.

A thin script around ``psgd/bench/scaling/`` (the same as ``psgd bench
scaling``); results and their reading are in ``benchmarks/RESULTS.md``.

    python benchmarks/scaling.py            # everything: about 15 minutes on 2 cores (an estimate)
    python benchmarks/scaling.py --quick    # widths 64 and 512, 1-2 workers, sync + peer: ~15 s
    python benchmarks/scaling.py --widths 256,1024 --configs single,sync,peer --repeats 5
    python benchmarks/scaling.py --help
"""

from __future__ import annotations

import sys

from psgd.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "scaling", *sys.argv[1:]]))
