"""An embedding table's step against its size: the parameter server, psgd's all-reduce and a dense all-reduce.

A thin script around ``psgd/bench/sparse.py`` (the same as ``psgd bench sparse``); results and their
reading are in ``benchmarks/RESULTS.md``.

    python benchmarks/sparse.py --json sparse.json --plot sparse.png     # 10^5 .. 10^8 rows
    python benchmarks/sparse.py --quick
"""

from __future__ import annotations

import sys

from psgd.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "sparse", *sys.argv[1:]]))
