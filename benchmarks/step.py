"""A worker's step behind a shard (psgd launch, shared memory and the data port), where it goes, beside its floor.

A thin script around ``psgd/bench/step.py`` (the same as ``psgd bench step``); results and their reading are in
``benchmarks/RESULTS.md``.

    python benchmarks/step.py --device cuda --json step.json     # widths 1024 and 4096, every run
    python benchmarks/step.py --widths 256 --steps 64 --runs shm,tcp
"""

from __future__ import annotations

import sys

from psgd.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "step", *sys.argv[1:]]))
