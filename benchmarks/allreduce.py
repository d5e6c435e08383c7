"""All-reduce against the parameter server, for the same bytes, in one run.

A thin script around ``psgd/bench/allreduce.py``; results are in
``benchmarks/RESULTS.md``.

    python benchmarks/allreduce.py                    # 1 MB .. 400 MB, 2 ranks
    python benchmarks/allreduce.py --sizes-mb 1,16 --repeats 3 --json out.json
"""

from __future__ import annotations

import sys

from psgd.bench.allreduce import main

if __name__ == "__main__":
    sys.exit(main())
