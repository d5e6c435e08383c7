"""A shard's versions/s, Status and checkpoints under a flood of connections that never prove the token.

A thin script around ``psgd/bench/flood.py`` (the same as ``psgd bench flood``); results and their reading are in
``benchmarks/RESULTS.md``.

    python benchmarks/flood.py
    python benchmarks/flood.py --seconds 20 --json flood.json
"""

from __future__ import annotations

import sys

from psgd.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "flood", *sys.argv[1:]]))
