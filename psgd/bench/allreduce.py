"""All-reduce against the parameter server, for the same bytes, in one run.

For each gradient size it measures:
  - an all-reduce through psgd's mpi backend (the ``Bucketer`` path the trainer
    uses) and a bare ``mpi4py`` ``Allreduce`` of the same buffer, between R
    ranks, both in one call and in the 4 MiB pieces psgd's backend uses;
  - an all-reduce through the nccl backend, when CuPy and a GPU are present
    (one rank: one GPU cannot host a multi-rank communicator);
  - one worker's pull + push of a model of that size through one psgd-server
    shard (async policy, so the step never waits for other workers);
and, as the machine's own limits, raw loopback TCP and memory-copy bandwidth.

Algorithm bandwidth is size / time.

    python benchmarks/allreduce.py                    # 1 MB .. 400 MB, 2 ranks
    python benchmarks/allreduce.py --sizes-mb 1,16 --repeats 3 --json out.json
    sudo python benchmarks/allreduce.py --network 1gbit,10gbit --sizes-mb 4,40 --ranks 2

With ``--network`` every rank, worker and shard runs on an emulated host of its
own whose link is shaped to the rate (psgd.bench.shaped): the MPI all-reduce of
``--ranks`` ranks against as many workers on as many shards, gradients pushed
as float32 and as bf16, each beside what the link's bytes alone take.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from psgd.bench.limits import machine, memcpy_gbps, tcp_loopback_gbps
from psgd.config.parsing import Parser, comma_list

MB = 1_000_000


def _timed(fn, repeats: int, sync=lambda: None) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


# -- MPI ranks (run under mpiexec) ---------------------------------------------------
def mpi_child(sizes: list[int], repeats: int) -> None:
    from psgd.collective import Bucketer
    from psgd.collective.mpi import MpiCollective

    group = MpiCollective()
    comm, MPI = group.comm, group.MPI
    for size in sizes:
        n = size // 4
        grads = {"g": np.ones(n, dtype=np.float32)}
        bucketer = Bucketer({"g": (n,)}, "float32", np, bucket_bytes=32 << 20)
        buf = np.ones(n, dtype=np.float32)
        step = group.chunk_bytes // 4

        def bare_in_pieces() -> None:
            for start in range(0, n, step):
                comm.Allreduce(MPI.IN_PLACE, buf[start : start + step], op=MPI.SUM)

        psgd_s = _timed(lambda: bucketer.allreduce_mean(group, grads), repeats, comm.Barrier)
        bare_s = _timed(lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), repeats, comm.Barrier)
        pieces_s = _timed(bare_in_pieces, repeats, comm.Barrier)
        worst = [comm.allreduce(t, op=MPI.MAX) for t in (psgd_s, bare_s, pieces_s)]
        if group.rank == 0:
            print(
                json.dumps({"size": size, "psgd_s": worst[0], "bare_s": worst[1], "bare_pieces_s": worst[2]}),
                flush=True,
            )


def run_mpi(sizes: list[int], ranks: int, repeats: int) -> dict[int, dict]:
    from psgd.launcher import find_mpiexec

    argv = [
        find_mpiexec(),
        "-n",
        str(ranks),
        sys.executable,
        "-m",
        "psgd.bench.allreduce",
        "--child",
        "mpi",
        "--sizes-mb",
        ",".join(str(s / MB) for s in sizes),
        "--repeats",
        str(repeats),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"mpi benchmark failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {r["size"]: r for r in rows}


# -- NCCL, one rank ------------------------------------------------------------------
def run_nccl(sizes: list[int], repeats: int, rendezvous_dir: str) -> dict[int, float] | str:
    from psgd.compute import backend

    if not backend.cuda_available():
        return "no CUDA GPU with CuPy here"
    from psgd.collective.nccl import NcclCollective

    device = backend.get_device("cuda:0")
    device.use()
    out = {}
    with NcclCollective(0, 1, device, rendezvous=f"file:{rendezvous_dir}/nccl-id.json") as group:
        for size in sizes:
            buf = device.xp.ones(size // 4, dtype=np.float32)
            out[size] = _timed(lambda: group.allreduce_(buf), repeats, lambda: backend.synchronize(device))
    return out


# -- parameter server -------------------------------------------------------------------
def run_ps(size: int, repeats: int, tmp: str) -> dict:
    """Pull + push of ``size`` bytes through one shard process (see comm.py); medians per step and per half."""
    from psgd.bench.blob import BlobCluster, time_steps

    with BlobCluster(size, tmp=tmp) as cluster:
        return time_steps(cluster, 1, repeats)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", default="1,4,16,64,256,400", help="gradient sizes in MB (10^6 bytes)")
    parser.add_argument("--ranks", type=int, default=2, help="MPI ranks (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure; the median is reported")
    parser.add_argument(
        "--network",
        metavar="LIST",
        help="instead: on emulated links of these rates (e.g. 1gbit,10gbit; root and tc), --ranks "
        "MPI ranks against as many workers on as many shards, gradients as float32 and bf16, "
        "every process on a host of its own, beside what the link's bytes alone take",
    )
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    parser.add_argument("--child", choices=("mpi",), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        sizes = [
            int(mb * MB) // 4 * 4
            for mb in comma_list(args.sizes_mb, "--sizes-mb", kind=float, what="sizes in MB", at_least=4 / MB)
        ]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.child == "mpi":
        mpi_child(sizes, args.repeats)
        return 0

    print(f"machine: {machine()}", flush=True)
    if args.network:
        from psgd.bench import netns, shaped

        try:
            names = shaped.networks_from(args.network)
        except netns.NetworkError as exc:
            parser.error(str(exc))
        with tempfile.TemporaryDirectory() as tmp:
            rows = shaped.ps_against_allreduce_on(
                names, sizes, args.ranks, args.repeats, tmp, lambda text: print(text, flush=True)
            )
        if args.json:
            Path(args.json).write_text(
                json.dumps({"machine": machine(), "ranks": args.ranks, "repeats": args.repeats, "rows": rows}, indent=2)
            )
        return 0
    tcp, copy = tcp_loopback_gbps(), memcpy_gbps()
    print(f"raw loopback TCP {tcp:.2f} GB/s, memory copy {copy:.2f} GB/s", flush=True)
    mpi = run_mpi(sizes, args.ranks, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        nccl = run_nccl(sizes, args.repeats, tmp)
        rows = []
        header = (
            f"{'size MB':>8} {'mpi ms':>8} {'bare ms':>8} {'psgd/bare':>9} {'bare 4MiB':>9} {'algbw GB/s':>10} "
            f"{'nccl ms':>8} {'PS ms':>8} {'pull ms':>8} {'push ms':>8} {'PS GB/s':>8} "
            f"{'PS/mpi':>7} {'PS/TCP':>7}"
        )
        print(header, flush=True)
        for size in sizes:
            ps = run_ps(size, args.repeats, tmp)
            m = mpi[size]
            ps_gbps = 2 * size / ps["step_s"] / 1e9
            row = {
                "size_bytes": size,
                "mpi_allreduce_s": m["psgd_s"],
                "bare_mpi_allreduce_s": m["bare_s"],
                "bare_mpi_allreduce_4mib_pieces_s": m["bare_pieces_s"],
                "mpi_algbw_gbps": size / m["psgd_s"] / 1e9,
                "nccl_allreduce_s": nccl.get(size) if isinstance(nccl, dict) else None,
                "ps_pull_push_s": ps["step_s"],
                "ps_pull_s": ps["pull_s"],
                "ps_push_s": ps["push_s"],
                "ps_gbps": ps_gbps,
                "ps_over_mpi": ps["step_s"] / m["psgd_s"],
                "ps_over_tcp": ps_gbps / tcp,
            }
            rows.append(row)
            nccl_ms = f"{row['nccl_allreduce_s'] * 1e3:8.2f}" if row["nccl_allreduce_s"] else f"{'-':>8}"
            print(
                f"{size / MB:8.0f} {m['psgd_s'] * 1e3:8.2f} {m['bare_s'] * 1e3:8.2f} "
                f"{m['psgd_s'] / m['bare_s']:9.2f} {m['bare_pieces_s'] * 1e3:9.2f} "
                f"{row['mpi_algbw_gbps']:10.2f} {nccl_ms} "
                f"{ps['step_s'] * 1e3:8.1f} {ps['pull_s'] * 1e3:8.1f} {ps['push_s'] * 1e3:8.1f} "
                f"{ps_gbps:8.2f} {row['ps_over_mpi']:7.2f} {row['ps_over_tcp']:7.2f}",
                flush=True,
            )
    if isinstance(nccl, str):
        print(f"nccl: {nccl}")
    result = {
        "machine": machine(),
        "ranks": args.ranks,
        "repeats": args.repeats,
        "tcp_loopback_gbps": tcp,
        "memcpy_gbps": copy,
        "nccl": nccl if isinstance(nccl, str) else "measured",
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
