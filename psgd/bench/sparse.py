"""Embedding tables against their size: the parameter server's step and all-reduce's, side by side.

For each table size N (rows that exist, as in a job that has looked up each of its N ids once):

  parameter server   --shards psgd-server processes hold the N rows between them, made by the pulls of one
                     client as a job's first lookups make them (rows made a second, per shard, is reported);
                     then --workers clients (threads of this process, over the data port, async policy so no
                     step waits for another) time --steps steps each: pull the rows a batch looks up, push
                     their gradients;
  all-reduce         --workers MPI ranks run psgd's all-reduce exchange (psgd.collective.exchange), every rank
                     holding all N rows and gathering each step's row gradients from every rank;
  dense all-reduce   the same ranks all-reduce a [N, dim] gradient, as data parallelism does with a table whose
                     gradient it cannot send row by row; measured where the ranks' copies fit in memory.

A batch looks up --lookups ids per worker, drawn from a power law (exponent --alpha) over the N ids, hashed into
int64 as click logs' ids are; duplicates are summed before a push.  Reported for each: the median step in ms,
the bytes a step moves (a worker's pull and push; the rows a rank gathers from the others, the buffer it
all-reduces for the dense gradient, as a ring sends it), each process's
resident memory, and rows pulled and pushed a second per shard.  The crossover is the smallest table at which
the dense all-reduce step takes longer than the parameter server's; a size a mode cannot hold on this machine
(its estimated memory above 85% of what is available) is said so, not run.

    psgd bench sparse --json sparse.json --plot sparse.png     # 10^5 .. 10^8 rows
    psgd bench sparse --quick                                   # 10^4 and 10^5 rows, under a minute
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import numpy as np

from psgd.bench.blob import median, rss_mb
from psgd.bench.limits import machine
from psgd.config.parsing import comma_list
from psgd.data.clicks import zipf_ranks
from psgd.model import BaseModel, VarSpec
from psgd.model.table import Rows, TableSpec, mix64, name_key

PY = sys.executable
TABLE = "emb"
#: ids one pull asks each shard for while the table is filled (the wire's bound is 262,144)
FILL_ROWS = 200_000
#: bytes a row costs a table beside its values: its id, update count and last touch, a used flag, the index
ROW_OVERHEAD = 8 + 8 + 8 + 1 + 16


class Rowed(BaseModel):
    """A benchmark model: one table ``emb`` of rows of ``dim`` values and one dense weight; its gradients cost
    nothing, so a step's time is the time to move and apply the rows (``psgd.bench.sparse:Rowed``)."""

    check_gradients = False

    def __init__(self, input_shape, num_classes, dtype="float32", dim=16, id_shape=None):
        self.dtype, self.dim, self.num_classes = dtype, int(dim), num_classes

    def specs(self):
        return [VarSpec("w", (1,), self.dtype, "zeros")]

    def tables(self):
        return [TableSpec(TABLE, self.dim, self.dtype, "normal", 0.01)]

    def loss_and_grads(self, params, x, y):
        return 0.0, {"w": np.zeros(1, self.dtype)}

    def predict(self, params, x):
        return np.zeros((len(x), self.num_classes), dtype=self.dtype)


def table_ids(n: int, ranks: np.ndarray) -> np.ndarray:
    """The int64 id of each rank (0..n-1) of a table of ``n`` ids: hashed, as click logs' ids are."""
    return (mix64(ranks.astype(np.uint64) ^ name_key("psgd-bench-sparse", n))).view(np.int64)


def draw_lookups(rng: np.random.Generator, n: int, count: int, alpha: float) -> np.ndarray:
    """``count`` ids of a table of ``n``, by rank from a power law with exponent ``alpha`` (rank 0 most often)."""
    return table_ids(n, zipf_ranks(rng.random(count), np.int64(n), alpha))


def table_bytes(rows: int, dim: int) -> int:
    """What ``rows`` rows of ``dim`` float32 cost one process's table, room to grow included (it doubles)."""
    capacity = 1024
    while capacity < rows:
        capacity *= 2
    return capacity * (dim * 4 + ROW_OVERHEAD)


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def job_config(dim: int, shards: int, workers: int, policy: str = "async"):
    from psgd.config import JobConfig

    config = JobConfig()
    config = config.apply_sets(
        [
            f"model.name={__name__}:Rowed",
            f"model.dim={dim}",
            "data.name=synthetic",
            "data.n_train=64",
            "data.n_test=16",
            "optimizer.name=sgd",
            "optimizer.lr=0.001",
            "tables.optimizer=sgd",
            "tables.lr=0.001",
            f"cluster.policy={policy}",
            f"cluster.shards={shards}",
            f"cluster.workers={workers}",
        ]
    )
    return config


# -- the parameter server ----------------------------------------------------------------------------------------
def run_ps(
    n: int,
    dim: int,
    shards: int,
    workers: int,
    lookups: int,
    alpha: float,
    steps: int,
    tmp: str,
    say: Callable[[str], None],
) -> dict:
    """Fill ``n`` rows on ``shards`` psgd-server processes, then time ``workers`` clients' steps."""
    from psgd.bench.blob import ShardProcesses
    from psgd.job import describe_job

    config = job_config(dim, shards, workers)
    with ShardProcesses(config, describe_job(config, model=Rowed((1,), 2, dim=dim)).plan, tmp) as cluster:
        clients = [cluster.client(0)]  # the others register once the table is filled: they send no heartbeats
        began = time.perf_counter()
        chunk = FILL_ROWS * shards
        for start in range(0, n, chunk):
            ids = table_ids(n, np.arange(start, min(n, start + chunk)))
            clients[0].pull(
                0,
                {"w": np.empty(1, np.float32)},  # the first lookups of every id make the rows
                rows={TABLE: (ids, np.empty((ids.size, dim), np.float32))},
            )
        fill_s = time.perf_counter() - began
        say(
            f"  parameter server: {n:,} rows made on {shards} shard(s) in {fill_s:.1f} s "
            f"({n / fill_s / shards:,.0f} rows/s per shard)"
        )
        clients += [cluster.client(w) for w in range(1, workers)]
        began = time.perf_counter()
        with futures.ThreadPoolExecutor(workers) as pool:
            done = list(pool.map(lambda w: _ps_steps(clients[w], n, dim, lookups, alpha, steps, w), range(workers)))
        wall = time.perf_counter() - began
        for c in clients:
            c.done()
            c.close()
        rows_moved = sum(d["rows"] for d in done)  # pulled, and as many pushed
        result = {
            "step_s": median([s for d in done for s in d["steps"]]),
            "bytes_per_step": median([b for d in done for b in d["bytes"]]),
            "rows_per_step": rows_moved / (workers * (steps + 1)),
            "rows_per_s_per_shard": 2 * rows_moved / wall / shards,
            "fill_s": fill_s,
            "fill_rows_per_s_per_shard": n / fill_s / shards,
            "shard_rss_mb": cluster.rss_mb(peak=False),
            "shard_peak_rss_mb": cluster.rss_mb(),
        }
        return result


def _ps_steps(client, n: int, dim: int, lookups: int, alpha: float, steps: int, worker: int) -> dict:
    """One worker's steps (after one warm-up): seconds and bytes of each, rows moved."""
    rng = np.random.default_rng(1000 + worker)
    host = {"w": np.empty(1, np.float32)}
    dense = {"w": np.zeros(1, np.float32)}
    times, moved, rows = [], [], 0
    for clock in range(steps + 1):
        ids = np.unique(draw_lookups(rng, n, lookups, alpha))
        values = np.empty((ids.size, dim), np.float32)
        began = time.perf_counter()
        client.pull(clock, host, rows={TABLE: (ids, values)})
        client.push(clock, dense, rows={TABLE: (ids, np.full_like(values, 1e-3))})
        if clock:
            times.append(time.perf_counter() - began)
            moved.append(2 * (ids.nbytes + values.nbytes + host["w"].nbytes))  # ids and rows down, and up
        rows += ids.size
    return {"steps": times, "bytes": moved, "rows": rows}


# -- all-reduce (run under mpiexec) ----------------------------------------------------------------------------------
def allreduce_child(n: int, dim: int, lookups: int, alpha: float, steps: int, dense: bool, table: bool) -> None:
    from psgd.collective.exchange import AllReduceExchange
    from psgd.collective.mpi import MpiCollective
    from psgd.job import build_job

    group = MpiCollective()
    comm, rank, world = group.comm, group.rank, group.world_size
    out: dict[str, Any] = {}
    if dense:  # first, before the table takes its memory
        from psgd.collective import Bucketer

        grads = {"emb": np.full(n * dim, 1e-3, np.float32)}
        bucketer = Bucketer({"emb": (n * dim,)}, "float32", np, bucket_bytes=32 << 20)
        times = []
        for i in range(min(steps, 5) + 1):
            comm.Barrier()
            began = time.perf_counter()
            bucketer.allreduce_mean(group, grads)
            if i:
                times.append(time.perf_counter() - began)
        out["dense_step_s"] = comm.allreduce(median(times), op=group.MPI.MAX)
        out["dense_bytes_per_step"] = 2 * (world - 1) / world * n * dim * 4  # a ring's share, each way
        del grads, bucketer
    if table:
        job = build_job(job_config(dim, 1, world, policy="sync"))
        exchange = AllReduceExchange(job, group)
        held = exchange.tables[TABLE]
        began = time.perf_counter()
        for start in range(0, n, FILL_ROWS):
            held.read(table_ids(n, np.arange(start, min(n, start + FILL_ROWS))))
        fill_s = comm.allreduce(time.perf_counter() - began, op=group.MPI.MAX)
        rng = np.random.default_rng(1000 + rank)
        times, moved = [], []
        for step in range(steps + 1):
            wanted = draw_lookups(rng, n, lookups, alpha)
            comm.Barrier()
            began = time.perf_counter()
            rows = exchange.weights(step, {TABLE: wanted})[TABLE]
            grads = {"w": np.zeros(1, np.float32), TABLE: Rows(rows.ids, np.full_like(rows.values, 1e-3), rows.index)}
            exchange.exchange(step, grads)
            if step:
                times.append(time.perf_counter() - began)
                others = comm.allreduce(rows.ids.size, op=group.MPI.SUM) - rows.ids.size
                moved.append(others * (8 + dim * 4))  # an all-gather: every other rank's rows come in
        out.update(
            step_s=comm.allreduce(median(times), op=group.MPI.MAX),
            bytes_per_step=median(moved),
            fill_s=fill_s,
            rank_rss_mb=comm.allreduce(rss_mb(os.getpid(), peak=False), op=group.MPI.MAX),
            table_bytes=held.nbytes,
        )
    if rank == 0:
        print(json.dumps(out), flush=True)


def run_allreduce(
    n: int, dim: int, ranks: int, lookups: int, alpha: float, steps: int, dense: bool, table: bool
) -> dict:
    from psgd.launcher import find_mpiexec

    argv = [
        find_mpiexec(),
        "-n",
        str(ranks),
        PY,
        "-m",
        __name__,
        "--child",
        "--rows",
        str(n),
        "--dim",
        str(dim),
        "--lookups",
        str(lookups),
        "--alpha",
        str(alpha),
        "--steps",
        str(steps),
        *(["--dense"] if dense else []),
        *(["--table"] if table else []),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"the all-reduce ranks failed:\n{done.stderr[-3000:]}")
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


# -- the run ------------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (``psgd bench sparse``; ``benchmarks/sparse.py`` runs the same command)."""
    parser.add_argument(
        "--rows",
        default="1e5,1e6,1e7,1e8",
        metavar="LIST",
        help="table sizes, rows that exist (default 1e5,1e6,1e7,1e8)",
    )
    parser.add_argument("--dim", type=int, default=16, help="values a row, float32 (default 16)")
    parser.add_argument("--shards", type=int, default=2, help="parameter-server shards (default 2)")
    parser.add_argument(
        "--workers",
        type=int,
        default=2,
        help="workers of the parameter server, and MPI ranks of all-reduce (default 2)",
    )
    parser.add_argument(
        "--lookups",
        type=int,
        default=26 * 128,
        metavar="N",
        help="ids a batch looks up per worker, duplicates included (default 3328: 26 fields of 128 examples)",
    )
    parser.add_argument(
        "--alpha", type=float, default=1.15, help="exponent of the power law the ids are drawn from (default 1.15)"
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per worker after one warm-up (default 20)")
    parser.add_argument("--quick", action="store_true", help="tables of 10^4 and 10^5 rows, 5 steps")
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    parser.add_argument(
        "--plot",
        metavar="PNG",
        help="draw step time, bytes and memory against table size to PNG (needs matplotlib: the bench extra)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dense", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--table", action="store_true", help=argparse.SUPPRESS)


def run_from_args(args: argparse.Namespace) -> dict | int:
    from psgd.config import ConfigError

    if args.child:
        allreduce_child(int(float(args.rows)), args.dim, args.lookups, args.alpha, args.steps, args.dense, args.table)
        return 0
    sizes = [
        int(r)
        for r in comma_list(
            "1e4,1e5" if args.quick else args.rows,
            "--rows",
            kind=float,
            what="table sizes",
            at_least=1,
            error=ConfigError,
        )
    ]
    for name in ("dim", "shards", "workers", "lookups", "steps"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not 1.0 < args.alpha < 3.0:
        raise ConfigError(f"--alpha must lie between 1 and 3, got {args.alpha}")
    if args.plot:
        from psgd.bench.plots import require_matplotlib

        require_matplotlib("psgd bench sparse --plot")
    steps = 5 if args.quick else args.steps

    def say(text: str) -> None:
        print(text, flush=True)

    result: dict[str, Any] = {
        "machine": machine(),
        "dim": args.dim,
        "shards": args.shards,
        "workers": args.workers,
        "lookups": args.lookups,
        "alpha": args.alpha,
        "steps": steps,
        "sizes": [],
    }
    say(f"machine: {result['machine']}")
    say(
        f"rows of {args.dim} float32; {args.shards} shard(s); {args.workers} workers or ranks, each looking up "
        f"{args.lookups} ids a step (power law, exponent {args.alpha})"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            result["sizes"].append(_one_size(n, args, steps, tmp, say))
    result["crossover_rows"] = crossover(result["sizes"])
    say(summary(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, Path(args.plot))
        say(f"plot: {args.plot}")
    return result


def _one_size(n: int, args: argparse.Namespace, steps: int, tmp: str, say) -> dict:
    budget = 0.85 * available_bytes()
    row = {"rows": n, "table_values_bytes": n * args.dim * 4}
    say(f"{n:,} rows ({n * args.dim * 4 / 1e9:.3g} GB of values):")
    need_ps = args.shards * table_bytes(-(-n // args.shards), args.dim)
    if need_ps * 1.5 < budget:  # a table grows by doubling: the old arrays and the new for a moment
        row["ps"] = run_ps(n, args.dim, args.shards, args.workers, args.lookups, args.alpha, steps, tmp, say)
        ps = row["ps"]
        say(
            f"  parameter server: step {ps['step_s'] * 1e3:.2f} ms, {ps['bytes_per_step'] / 1e6:.3f} MB a step "
            f"per worker ({ps['rows_per_step']:,.0f} rows), {ps['rows_per_s_per_shard']:,.0f} rows/s pulled and "
            f"pushed per shard; shards' RSS {', '.join(f'{m:,.0f}' for m in ps['shard_rss_mb'])} MB"
        )
    else:
        row["ps"] = {"skipped": f"needs about {need_ps * 1.5 / 1e9:.1f} GB, {budget / 1e9:.1f} GB available"}
        say(f"  parameter server: not run: {row['ps']['skipped']}")
    need_dense = args.workers * n * args.dim * 4 * 2  # a gradient, and the buffer an all-reduce works in
    need_table = args.workers * table_bytes(n, args.dim)
    dense, table = need_dense < budget, need_table * 1.5 < budget
    if dense or table:
        got = run_allreduce(n, args.dim, args.workers, args.lookups, args.alpha, steps, dense, table)
    if dense:
        row["dense"] = {"step_s": got["dense_step_s"], "bytes_per_step": got["dense_bytes_per_step"]}
        say(
            f"  dense all-reduce: step {got['dense_step_s'] * 1e3:.2f} ms, "
            f"{got['dense_bytes_per_step'] / 1e6:.3f} MB a step per rank"
        )
    else:
        row["dense"] = {"skipped": f"needs about {need_dense / 1e9:.1f} GB, {budget / 1e9:.1f} GB available"}
        say(f"  dense all-reduce: not run: {row['dense']['skipped']}")
    if table:
        row["allreduce"] = {k: got[k] for k in ("step_s", "bytes_per_step", "fill_s", "rank_rss_mb", "table_bytes")}
        say(
            f"  all-reduce (psgd): step {got['step_s'] * 1e3:.2f} ms, {got['bytes_per_step'] / 1e6:.3f} MB a step "
            f"per rank; each rank holds all {n:,} rows: RSS {got['rank_rss_mb']:,.0f} MB"
        )
    else:
        row["allreduce"] = {
            "skipped": f"every rank holds every row: needs about {need_table * 1.5 / 1e9:.1f} GB, "
            f"{budget / 1e9:.1f} GB available"
        }
        say(f"  all-reduce (psgd): not run: {row['allreduce']['skipped']}")
    return row


def crossover(sizes: list[dict]) -> int | None:
    """The smallest table size measured at which the dense all-reduce step takes longer than the parameter
    server's (None: at none measured)."""
    for row in sizes:
        ps, dense = row["ps"].get("step_s"), row["dense"].get("step_s")
        if ps is not None and dense is not None and dense > ps:
            return row["rows"]
    return None


def summary(result: dict) -> str:
    lines = [
        "",
        f"{'rows':>12} {'PS ms':>8} {'PS MB':>8} {'AR ms':>8} {'AR MB':>8} {'dense ms':>9} "
        f"{'dense MB':>9} {'shard RSS':>10} {'rank RSS':>9}",
    ]

    def cell(part: dict, key: str, scale: float, width: int, fmt: str = ".2f") -> str:
        value = part.get(key)
        if value is None:
            return f"{'-':>{width}}"
        if isinstance(value, list):
            value = max(value)
        return f"{value * scale:>{width}{fmt}}"

    for row in result["sizes"]:
        ps, ar, dense = row["ps"], row["allreduce"], row["dense"]
        lines.append(
            f"{row['rows']:>12,} {cell(ps, 'step_s', 1e3, 8)} {cell(ps, 'bytes_per_step', 1e-6, 8, '.3f')} "
            f"{cell(ar, 'step_s', 1e3, 8)} {cell(ar, 'bytes_per_step', 1e-6, 8, '.3f')} "
            f"{cell(dense, 'step_s', 1e3, 9)} {cell(dense, 'bytes_per_step', 1e-6, 9, '.1f')} "
            f"{cell(ps, 'shard_rss_mb', 1, 10, ',.0f')} {cell(ar, 'rank_rss_mb', 1, 9, ',.0f')}"
        )
    cross = result["crossover_rows"]
    lines.append(
        "crossover: "
        + (
            f"from {cross:,} rows the dense all-reduce step takes longer than the parameter server's"
            if cross
            else "the dense all-reduce step was the faster at every size measured"
        )
    )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Step time, bytes a step and memory per process against table size, each mode a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from psgd.bench.plots import DPI, OKABE_ITO

    modes = (
        ("ps", "parameter server (per worker)", "shard_rss_mb"),
        ("allreduce", "all-reduce, rows gathered (per rank)", "rank_rss_mb"),
        ("dense", "all-reduce of a dense table gradient (per rank)", None),
    )
    panels = (
        ("step_s", 1e3, "step (ms)"),
        ("bytes_per_step", 1e-6, "MB moved a step"),
        ("memory", 1, "resident memory (MB), largest process"),
    )
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, scale, label) in zip(axes, panels):
        for colour, (mode, name, rss) in zip(OKABE_ITO, modes):
            xs, ys = [], []
            for row in result["sizes"]:
                part = row[mode]
                value = (
                    max(part[rss])
                    if key == "memory" and rss and isinstance(part.get(rss), list)
                    else part.get(rss)
                    if key == "memory" and rss
                    else part.get(key)
                )
                if value is not None:
                    xs.append(row["rows"])
                    ys.append(value * scale)
            if xs:
                ax.plot(xs, ys, marker="o", color=colour, label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("rows in the table")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"rows of {result['dim']} float32, {result['workers']} workers or ranks, {result['shards']} "
        f"shards, {result['lookups']} lookups a worker a step; {result['machine']}",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """An all-reduce rank's part (``--child``, under mpiexec); users run ``psgd bench sparse``."""
    from psgd.config.parsing import Parser

    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    result = run_from_args(parser.parse_args(argv))
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
