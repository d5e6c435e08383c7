"""The other workers' async steps/s while one worker is stopped in the middle of a pull.

A thin script around ``psgd/bench/stall.py`` (the same as ``psgd bench stall``); results and their
reading are in ``benchmarks/RESULTS.md``.

    python benchmarks/stall.py                        # shared memory and the data port, a 68 MB model
    python benchmarks/stall.py --transport tcp --json stall.json
"""

from __future__ import annotations

import sys

from psgd.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "stall", *sys.argv[1:]]))
