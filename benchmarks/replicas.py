"""What a replica per shard costs an async job, and how soon it takes over.

A thin script around ``psgd/bench/replicas.py`` (the same as ``psgd bench replicas``); results and their
reading are in ``benchmarks/RESULTS.md``.

    python benchmarks/replicas.py                                  # loopback
    python benchmarks/replicas.py --network loopback,1gbit --repeats 3 --json replicas.json
"""

from __future__ import annotations

import sys

from psgd.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "replicas", *sys.argv[1:]]))
