"""What a killed shard costs a sync job with cuts, against the checkpoint interval.

A thin script around ``psgd/bench/rollback.py`` (the same as ``psgd bench rollback``); results and their
reading are in ``benchmarks/RESULTS.md``.

    python benchmarks/rollback.py                     # intervals 0, 5, 20, 50, 100
    python benchmarks/rollback.py --intervals 0,10 --epochs 6 --json rollback.json
"""

from __future__ import annotations

import sys

from psgd.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "rollback", *sys.argv[1:]]))
