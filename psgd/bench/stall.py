"""The other workers' async steps/s while one worker is stopped in the middle of a pull.

One shard (``psgd-server``) and ``--workers`` workers (``psgd-worker``, default 3) train an MLP
64-W-W-10 (``--width``, default 4096: 17.1 M parameters, 68 MB of float32) on synthetic data under
async, at full speed, on this machine, as a user starts them.  For each transport (``shm``: shared
memory, ``tcp``: the data port):

1. once every worker has stepped, the other workers' steps/s over ``--seconds``, read from their own
   step records (undisturbed);
2. the control: worker 0 stopped (SIGSTOP) at a moment the shard's Status lists no pull of its, and
   the others' steps/s over the same length (a stopped worker no longer takes a core, so on a small
   machine the others speed up);
3. the fault: worker 0 stopped at a moment the shard's Status lists a pull of its still being read
   (stopped, asked, and let go on until it is caught, at most 200 tries), and the others' steps/s
   again.  The figures are 3 over 1 (the goal: at least 0.8) and 3 over 2 (what holding a pull costs
   the others beyond the stop itself: 1 when it costs nothing).

    psgd bench stall                          # about 3 minutes on 2 cores
    psgd bench stall --transport tcp --width 2048 --seconds 5 --json stall.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from psgd.errors import ClusterError

TRANSPORTS = ("shm", "tcp")
CATCH_TRIES = 200
START_BOUND = 120.0  # seconds for the shard to listen and every worker to step


class StallError(ClusterError):
    """The measurement could not be taken (a process failed, nothing was caught)."""


def _job(folder: Path, transport: str, width: int, workers: int, bind: str) -> Path:
    from psgd.config import JobConfig, to_toml

    config = JobConfig()
    config = config.apply_sets(
        [
            "model.name=mlp",
            f"model.hidden=[{width}, {width}]",
            "data.name=synthetic",
            "data.input_dim=64",
            "data.n_train=4096",
            "data.n_test=256",
            "train.epochs=1000",
            "train.threads=1",
            "optimizer.name=sgd",
            "optimizer.lr=0.01",
            "cluster.policy=async",
            "cluster.shards=1",
            f"cluster.workers={workers}",
            f"cluster.transport={transport}",
            "cluster.lease_seconds=120",
        ]
    )
    config = config.override("cluster.servers", [bind])
    path = folder / "job.toml"
    path.write_text(to_toml(config.to_dict()))
    return path


def _status(address: str) -> dict:
    """The counters in the Status of the shard at ``address``."""
    import grpc

    from psgd.ops.reach import Connect, read_status

    try:
        return read_status(address, Connect(timeout=5.0, token=os.environ.get("PSGD_TOKEN", "")))["counters"]
    except grpc.RpcError as exc:
        raise StallError(f"the shard at {address} did not answer Status: {exc.code().name}") from None


def _steps(metrics: Path) -> list[float]:
    """The wall-clock times of a worker's steps so far."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        if line.endswith("}"):
            record = json.loads(line)
            if record.get("event") == "step":
                out.append(float(record["time"]))
    return out


def _rate(metrics: list[Path], start: float, end: float) -> float:
    return sum(1 for m in metrics for t in _steps(m) if start < t <= end) / (end - start)


def measure(transport: str, width: int, workers: int, seconds: float, folder: Path, say) -> dict:
    """One transport's figures: the others' steps/s undisturbed and with worker 0 stopped mid-pull."""
    from psgd.bench.chaos.processes import command, end_all, free_port_pair, job_token, last_error
    from psgd.launcher.supervise import dying_with_parent

    job_token()  # the job's token, in the environment every process started here inherits
    bind = f"127.0.0.1:{free_port_pair(random.Random())}"
    path = _job(folder, transport, width, workers, bind)
    procs: list[subprocess.Popen] = []
    logs = []

    def start(argv: list[str], name: str) -> subprocess.Popen:
        log = folder / f"{name}.log"
        logs.append(log)
        with open(log, "w") as err:
            proc = subprocess.Popen(
                dying_with_parent(argv, signal.SIGKILL), stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL
            )
        procs.append(proc)
        return proc

    def alive() -> None:
        for proc, log in zip(procs, logs):
            if proc.poll() is not None:
                raise StallError(f"{log.stem} exited with status {proc.returncode}: {last_error(log)}")

    port_file = folder / "shard.addr"
    try:
        start(
            [
                *command("psgd-server", "psgd.cli.server"),
                "-c",
                str(path),
                "--shard",
                "0",
                "--bind",
                bind,
                "--port-file",
                str(port_file),
            ],
            "shard",
        )
        deadline = time.monotonic() + START_BOUND
        while not port_file.exists():
            alive()
            if time.monotonic() > deadline:
                raise StallError(f"the shard did not listen within {START_BOUND:.0f}s")
            time.sleep(0.05)  # polling for the port file, with a deadline
        metrics = [folder / f"worker{r}.jsonl" for r in range(workers)]
        workers_procs = [
            start(
                [
                    *command("psgd-worker", "psgd.cli.worker"),
                    "-c",
                    str(path),
                    "--rank",
                    str(r),
                    "--servers",
                    bind,
                    "--no-progress",
                    "--metrics",
                    str(metrics[r]),
                ],
                f"worker{r}",
            )
            for r in range(workers)
        ]
        while min(len(_steps(m)) for m in metrics) < 3:
            alive()
            if time.monotonic() > deadline:
                raise StallError(f"not every worker stepped 3 times within {START_BOUND:.0f}s")
            time.sleep(0.1)  # polling for the first steps, with a deadline
        others = metrics[1:]
        began = time.time()
        time.sleep(seconds)  # the measurement window
        undisturbed = _rate(others, began, time.time())
        say(f"{transport}: the other {workers - 1} workers, undisturbed: {undisturbed:.2f} steps/s")
        stopped, rng = workers_procs[0], random.Random(1)
        figures = {}
        for phase, holding in (("control", False), ("fault", True)):
            for tries in range(1, CATCH_TRIES + 1):
                alive()
                stopped.send_signal(signal.SIGSTOP)
                if any(r.get("worker") == 0 for r in _status(bind).get("reads", [])) == holding:
                    break
                stopped.send_signal(signal.SIGCONT)
                time.sleep(rng.uniform(0.0, 0.02))  # a different moment of its step for the next try
            else:
                raise StallError(
                    f"worker 0 was not caught {'in' if holding else 'outside'} a pull in {CATCH_TRIES} tries"
                )
            try:
                began = time.time()
                time.sleep(seconds)  # the measurement window, worker 0 stopped
                figures[phase] = _rate(others, began, time.time())
                figures[f"{phase}_tries"] = tries
                held = [r for r in _status(bind).get("reads", []) if r.get("worker") == 0]
            finally:
                stopped.send_signal(signal.SIGCONT)
            if holding and not held:
                raise StallError(
                    "worker 0's pull was no longer held at the end of the window (over TCP, a pull whose "
                    "bytes fit the sockets' buffers is over once they are sent: raise --width)"
                )
            say(
                f"{transport}: worker 0 stopped {'mid-pull' if holding else 'holding no pull'} (caught on try "
                f"{tries}): {figures[phase]:.2f} steps/s, {figures[phase] / undisturbed:.2f}x undisturbed"
            )
        status = _status(bind)
        return {
            "transport": transport,
            "width": width,
            "workers": workers,
            "seconds": seconds,
            "model_bytes": 4 * (64 * width + width + width * width + width + width * 10 + 10),
            "undisturbed_steps_per_s": undisturbed,
            "stopped_elsewhere_steps_per_s": figures["control"],
            "stopped_mid_pull_steps_per_s": figures["fault"],
            "mid_pull_over_undisturbed": figures["fault"] / undisturbed,
            "mid_pull_over_stopped_elsewhere": figures["fault"] / figures["control"],
            "caught_on_try": {"elsewhere": figures["control_tries"], "mid_pull": figures["fault_tries"]},
            "held_seconds_at_end": max(r["held_seconds"] for r in held),
            "copied_updates": status.get("copied_updates"),
            "revoked_reads": status.get("revoked_reads"),
        }
    finally:
        end_all(procs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--transport",
        action="append",
        choices=TRANSPORTS,
        dest="transports",
        help="shm (shared memory) or tcp (the data port); repeat for both (default: both)",
    )
    parser.add_argument(
        "--width",
        type=int,
        default=4096,
        metavar="W",
        help="the MLP's hidden width: 64-W-W-10 (default 4096: 68 MB of float32 weights)",
    )
    parser.add_argument(
        "--workers", type=int, default=3, metavar="N", help="workers, worker 0 the one stopped (default 3)"
    )
    parser.add_argument("--seconds", type=float, default=10.0, metavar="S", help="each measurement window (default 10)")
    parser.add_argument("--json", metavar="FILE", help="write the figures here")


def run_from_args(args: argparse.Namespace) -> int:
    transports = args.transports or list(TRANSPORTS)
    if args.workers < 2 or args.width < 1 or args.seconds <= 0:
        raise SystemExit("psgd bench stall: --workers must be at least 2, --width and --seconds positive")
    results = []
    for transport in transports:
        with tempfile.TemporaryDirectory(prefix=f"psgd-stall-{transport}-") as folder:
            try:
                results.append(measure(transport, args.width, args.workers, args.seconds, Path(folder), print))
            except StallError as exc:
                print(f"{transport}: {exc}")
                results.append({"transport": transport, "error": str(exc)})
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results}, indent=2) + "\n")
    return 1 if any("error" in r for r in results) else 0
