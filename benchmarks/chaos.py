"""Chaos: shards and workers of running jobs are faulted, and invariants are checked after each fault.

A thin script around the library in ``psgd/bench/chaos/``: small jobs on the bundled digits (2 shards,
2-3 workers, sync or async, data path on or off), each started as users start them, faulted (SIGKILL or
SIGTERM and restart a shard, SIGKILL and restart a worker, SIGSTOP either, hostile connections, network
cuts in namespaces when root, SIGTERM to everything), with the invariants checked after each fault.  The
seed is printed first and in every violation; ``--seed`` replays the same jobs and faults.

    python benchmarks/chaos.py --minutes 0.5 --seed 1                   # a taste
    python benchmarks/chaos.py --minutes 10 --json benchmarks/results/chaos.json   # the long version
    python benchmarks/chaos.py --runs 3 --seed 2 --kinds kill-worker,stop-shard --out chaos-runs
    python benchmarks/chaos.py --help
"""

from __future__ import annotations

import sys

from psgd.bench.chaos.suite import main

if __name__ == "__main__":
    sys.exit(main())
