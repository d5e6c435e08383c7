"""Steps/s with [cluster] overlap off and on, beside one step's compute-only and communication-only time.

A thin script around ``psgd/bench/overlap.py`` (the same as ``psgd bench
overlap``); results and their reading are in ``benchmarks/RESULTS.md``.

    python benchmarks/overlap.py                      # both models, 1-2 workers, sync/async/all-reduce
    python benchmarks/overlap.py --models quarter --workers 2 --json overlap.json
"""

from __future__ import annotations

import sys

from psgd.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "overlap", *sys.argv[1:]]))
