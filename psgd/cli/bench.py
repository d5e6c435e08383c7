"""``psgd bench KIND``: the benchmarks of psgd.bench, each kind's flags its module's own (``add_arguments``), loaded
when ``psgd`` builds its parser and run by ``run_from_args``."""

from __future__ import annotations

import argparse
import importlib

from psgd.observe.logs import setup_logging


def add_parser(sub) -> None:
    """``psgd bench KIND``: the benchmarks of psgd.bench."""
    bench = sub.add_parser(
        "bench",
        help="benchmarks (convergence: every consistency policy, with stragglers; "
        "comm: how fast tensors move; scaling: steps/s against model width "
        "and workers; gpu: psgd on one GPU against bare CuPy; overlap: "
        "communication beside computation, off and on; stall: the others' "
        "steps/s while one worker is stopped mid-pull; elastic: workers joining "
        "and leaving a running launch; flood: a shard under a "
        "flood of connections without the token; sparse: embedding tables' "
        "steps against table size, parameter server and all-reduce; rollback: "
        "what a killed shard costs a sync job with cuts; replicas: what a "
        "replica per shard costs async, and its failover time; simulate: psgd "
        "jobs simulated from costs measured here, checked against launches here)",
        description="Benchmarks of psgd itself. See `psgd bench KIND --help` for each: convergence, "
        "comm, scaling, gpu, overlap, stall, elastic, flood, sparse, rollback, replicas, "
        "step and simulate.",
    )
    kinds = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])
    _command(
        kinds,
        "convergence",
        "psgd.bench.convergence",
        logger="lab",
        help="sync vs async vs ssp vs backup workers vs all-reduce, with and without a straggler",
        description="Train the same model, data, seed, workers and optimizer under each consistency "
        "policy and all-reduce, as real processes on this machine, with and without an injected "
        "straggler; write lab.json (every evaluation point), table.md and PNG plots of accuracy "
        "and loss against wall time, updates and gradients. The default configuration (MLP on "
        "digits, 4 workers, 2 shards, 3 repeats) takes 3-5 minutes on 2 cores; --quick "
        "takes well under a minute.",
    )
    _command(
        kinds,
        "comm",
        "psgd.bench.comm",
        help="pull/push/all-reduce throughput, latency, optimizer speed and memory against raw TCP",
        description="Measure, in one run and side by side: raw loopback TCP and memory-copy bandwidth (the "
        "machine's limits); a 40 MB model's pull+push in rounds, each beside TCP measured just "
        "before it; pull, push and pull+push through psgd-server processes for models of "
        "1-400 MB, over 1-4 shards and 1-4 workers, over gRPC alone and with compressed "
        "gradients; an MPI all-reduce of the same bytes (needs the mpi extra); a small step's "
        "fixed cost on every link (two round trips and one), the shard's share of it, beside a "
        "bare round trip; the optimizers' update throughput; peak memory of "
        "shards and workers; and a 100M-parameter model over 4 shards. Ratios to the limits are "
        "printed as each figure comes; --json writes them all. Everything takes about 12 "
        "minutes on 2 cores, --quick under a minute.",
    )
    _command(
        kinds,
        "scaling",
        "psgd.bench.scaling.command",
        raw=True,
        help="steps/s of the MLP (widths 64-4096) and CNN: one process, 1-4 workers under sync, async "
        "and all-reduce, and a 1-BLAS-thread peer",
    )
    _command(
        kinds,
        "gpu",
        "psgd.bench.gpu",
        raw=True,
        help="psgd on one GPU against bare CuPy: the MLP's training step (mlp), host<->device "
        "transfers (transfer) and the NCCL all-reduce (nccl)",
    )
    _command(
        kinds,
        "step",
        "psgd.bench.step",
        raw=True,
        help="a worker's step behind a shard (psgd launch, shared memory and the data port, 1 and 2 workers) "
        "against psgd train on the same device, where it goes, beside its floor",
    )
    _command(
        kinds,
        "overlap",
        "psgd.bench.overlap",
        raw=True,
        help="steps/s with [cluster] overlap off and on, beside one step's compute-only and "
        "communication-only time (sync, async, all-reduce; the synthetic model and a quarter of it)",
    )
    _command(
        kinds,
        "flood",
        "psgd.bench.flood",
        raw=True,
        help="a shard's versions/s, Status and "
        "checkpoints under a flood of connections without the token, beside the job undisturbed",
    )
    _command(
        kinds,
        "stall",
        "psgd.bench.stall",
        raw=True,
        help="the other workers' async steps/s while one is stopped in the middle of a pull (shared "
        "memory and the data port)",
    )
    _command(
        kinds,
        "elastic",
        "psgd.bench.elastic",
        raw=True,
        help="workers joining and leaving a running launch (2 -> 4 -> 2 with psgd scale) under each policy: "
        "steps lost and the stall at each change; the same job fixed at 2 and 4",
    )
    _command(
        kinds,
        "sparse",
        "psgd.bench.sparse",
        raw=True,
        help="an embedding table's step time, bytes a step and memory against table size (10^5-10^8 "
        "rows): the parameter server, psgd's all-reduce and a dense all-reduce; the crossover",
    )
    _command(
        kinds,
        "rollback",
        "psgd.bench.rollback",
        raw=True,
        help="a sync job with cuts, undisturbed and with a shard SIGKILLed, against the checkpoint "
        "interval: the seconds and rounds a kill costs, and the final weights compared",
    )
    _command(
        kinds,
        "simulate",
        "psgd.bench.simulate.command",
        raw=True,
        help="a simulation of psgd jobs from costs measured here, checked against launches here "
        "(--validate) before it predicts past this machine",
    )
    _command(
        kinds,
        "replicas",
        "psgd.bench.replicas",
        raw=True,
        help="async steps/s with and without a replica per shard (loopback, emulated links), and the time "
        "from a primary's SIGKILL to the next push its replica applies",
    )


def _command(
    kinds, name: str, module: str, help: str, description: str | None = None, raw: bool = False, logger: str = "bench"
) -> None:
    """``psgd bench NAME``: ``module``'s add_arguments and run_from_args; ``raw``: its description is its
    ``DESCRIPTION`` (or docstring), laid out as written."""
    mod = importlib.import_module(module)
    if raw:
        description = getattr(mod, "DESCRIPTION", None) or mod.__doc__
    parser = kinds.add_parser(
        name,
        help=help,
        description=description,
        **({"formatter_class": argparse.RawDescriptionHelpFormatter} if raw else {}),
    )
    mod.add_arguments(parser)
    parser.set_defaults(func=lambda args: _run(module, logger, args))


def _run(module: str, logger: str, args: argparse.Namespace) -> int:
    setup_logging(logger, -1)
    result = importlib.import_module(module).run_from_args(args)
    return result if isinstance(result, int) else 0  # comm returns its figures: it exits 0
