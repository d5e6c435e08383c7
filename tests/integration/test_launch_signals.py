"""psgd launch owns its children: signals are forwarded, nothing outlives it; processes honour SIGTERM.

Every process is started as a user starts it (the console scripts, the user's
environment) and found afterwards by listing /proc for its run folder.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TOKEN, by_hand_env, free_port, wait_for

from psgd.config import Deadlines, JobConfig
from psgd.job import build_job
from psgd.launcher import GRACE
from psgd.partition import PartitionPlan
from psgd.wire.tls import TLSFiles
from psgd.worker.client import PSClient

pytestmark = pytest.mark.lacks(not Path("/proc/self/cmdline").exists(), reason="needs /proc to list processes")

PSGD = shutil.which("psgd") or "psgd"
SERVER = shutil.which("psgd-server") or "psgd-server"
WORKER = shutil.which("psgd-worker") or "psgd-worker"


def processes_mentioning(text: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
            state = next(
                (line for line in (entry / "status").read_text().splitlines() if line.startswith("State:")), ""
            )
        except OSError:
            continue
        if "zombie" in state:
            continue
        cmdline = raw.replace(b"\0", b" ").decode(errors="replace")
        if text in cmdline:
            found.append((int(entry.name), cmdline))
    return found


def started_training(run: Path) -> bool:
    """Both workers have pushed a step (each has joined)."""
    paths = [run / f"worker-{r}.jsonl" for r in (0, 1)]
    return all(path.exists() and path.stat().st_size > 0 for path in paths)


def start_launch(run: Path, *extra: str) -> subprocess.Popen:
    argv = [PSGD, "launch", "--run-dir", str(run), "--epochs", "400", "--no-progress", *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_leftovers(run: Path) -> None:
    for pid, _ in processes_mentioning(str(run)):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_to_launch_is_forwarded_and_leaves_no_process(tmp_path, signum):
    run = tmp_path / "run"
    launcher = start_launch(run)
    try:
        wait_for(lambda: started_training(run), 60, "the workers' first steps")
        assert len(processes_mentioning(str(run))) == 5  # the launcher, 2 shards, 2 workers
        launcher.send_signal(signum)
        _, err = launcher.communicate(timeout=GRACE + 10)
        assert launcher.returncode == 128 + signum, err
        assert "killing it" not in err, err  # each process left cleanly within the grace, none was killed
        assert f"stopped by {signal.Signals(signum).name}" in err
        assert processes_mentioning(str(run)) == []
        for r in (0, 1):  # each worker left cleanly: asked to stop, then stopped, paused whatever the signal
            log = (run / f"worker-{r}.log").read_text()
            assert f"worker {r}: stopping at step" in log and f"worker {r} stopped at step" in log, log
            assert "paused, the shards not told it left" in log, log
        for k in (0, 1):
            assert "stopped at version" in (run / f"shard-{k}.log").read_text()
    finally:
        launcher.kill()
        launcher.wait(10)
        kill_leftovers(run)


@pytest.mark.slow
def test_children_die_with_a_killed_launcher(tmp_path):
    run = tmp_path / "run"
    launcher = start_launch(run)
    try:
        wait_for(lambda: started_training(run), 60, "the workers' first steps")
        launcher.kill()  # SIGKILL: the launcher cannot forward anything
        launcher.wait(10)
        wait_for(lambda: not processes_mentioning(str(run)), GRACE, "every child to end after the launcher died")
    finally:
        kill_leftovers(run)


@pytest.mark.slow
def test_launch_under_timeout_leaves_nothing(tmp_path):
    run = tmp_path / "run"
    done = subprocess.run(
        ["timeout", "4", PSGD, "launch", "--run-dir", str(run), "--epochs", "400", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=GRACE + 30,
    )
    assert done.returncode == 124, done.stderr  # timeout's status: the launch was cut short by SIGTERM
    assert processes_mentioning(str(run)) == []


def test_a_worker_waiting_for_absent_shards_stops_at_once_on_sigterm(tmp_path):
    servers = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    worker = subprocess.Popen(
        [WORKER, "--rank", "0", "--servers", servers, "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = worker.stderr.readline()  # bounded: the worker logs at start-up, or exits
        while first and "joining 2 shard(s)" not in first:
            first = worker.stderr.readline()
        assert "joining 2 shard(s)" in first, "the worker never said which shards it waits for"
        began = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=10)
        took = time.monotonic() - began
        assert worker.returncode == 0, err
        # it left as asked, not at its join deadline
        assert took < Deadlines().join_timeout / 4, f"took {took:.1f}s"
        assert "asked to stop while waiting for shard(s)" in err
    finally:
        worker.kill()
        worker.wait(10)


@pytest.mark.slow
def test_a_waiting_worker_says_what_it_waits_for(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    done = subprocess.run(
        [
            WORKER,
            "--rank",
            "0",
            "--shards",
            "1",
            "--servers",
            address,
            "--no-progress",
            "--set",
            "cluster.join_timeout=6",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert f"waiting for shard(s) at {address} (5s of 6s)" in done.stderr
    assert f"cannot reach shard(s) at {address} within 6s" in done.stderr


@pytest.mark.slow
def test_shards_and_workers_sigtermed_together_all_exit_0(tmp_path):
    """What ``docker compose down`` does: every process of the job gets SIGTERM at the same moment."""
    job = tmp_path / "job.toml"
    job.write_text("[train]\nepochs = 400\n[cluster]\nshards = 2\nworkers = 2\n")
    procs = []
    try:
        files = [tmp_path / f"shard-{k}.addr" for k in (0, 1)]
        for k in (0, 1):
            procs.append(
                subprocess.Popen(
                    [SERVER, "-c", str(job), "--shard", str(k), "--port-file", str(files[k])],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=by_hand_env(),
                )
            )
        wait_for(lambda: all(f.exists() for f in files), 60, "both shards to serve")
        servers = ",".join(f.read_text().strip() for f in files)
        for r in (0, 1):
            procs.append(
                subprocess.Popen(
                    [
                        WORKER,
                        "-c",
                        str(job),
                        "--rank",
                        str(r),
                        "--servers",
                        servers,
                        "--no-progress",
                        "--metrics",
                        str(tmp_path / f"w{r}.jsonl"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=by_hand_env(),
                )
            )
        wait_for(lambda: all((tmp_path / f"w{r}.jsonl").exists() for r in (0, 1)), 60, "both workers to step")
        began = time.monotonic()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        errors = [p.communicate(timeout=15)[1] for p in procs]
        took = time.monotonic() - began
        assert [p.returncode for p in procs] == [0, 0, 0, 0], "\n".join(e[-2000:] for e in errors)
        assert took < Deadlines().request_timeout / 4, f"took {took:.1f}s"  # none waited out a call's deadline
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


@pytest.mark.slow
def test_launch_divides_the_cores_and_says_so(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "OMP_NUM_THREADS",
            "OPENBLAS_NUM_THREADS",
            "MKL_NUM_THREADS",
            "BLIS_NUM_THREADS",
            "VECLIB_MAXIMUM_THREADS",
        )
    }
    run = tmp_path / "run"
    done = subprocess.run(
        [PSGD, "launch", "--run-dir", str(run), "--epochs", "1", "--no-progress", "--shards", "1", "--workers", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    cores = len(os.sched_getaffinity(0))
    share = max(1, cores // 2)
    assert f"2 process(es) on {cores} core(s): {share} BLAS/OpenMP thread(s) each" in done.stderr
    assert f"threads = {share}" in (run / "job.toml").read_text()
    watch = 1000 if cores >= 2 else 0  # a data connection watches for its answer where each process has a core
    assert f"busy_poll_us = {watch}" in (run / "job.toml").read_text()
    assert ("a data connection watches 1000 µs" if watch else "data connections sleep at once") in done.stderr

    env["OMP_NUM_THREADS"] = "1"
    again = tmp_path / "again"  # a run folder holding a launch's checkpoints is for --resume only
    done = subprocess.run(
        [PSGD, "launch", "--run-dir", str(again), "--epochs", "1", "--no-progress", "--shards", "1", "--workers", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "BLAS/OpenMP threads as OMP_NUM_THREADS=1 says" in done.stderr
    assert "threads = 0" in (again / "job.toml").read_text()


@pytest.mark.lacks(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_child_environment_puts_the_current_folder_first(tmp_path, monkeypatch):
    from psgd.launcher import child_environment

    monkeypatch.chdir(tmp_path)
    env = child_environment({"PYTHONPATH": f"/elsewhere{os.pathsep}{tmp_path}"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/elsewhere"]
    assert env["PYTHONUNBUFFERED"] == "1"


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_a_worker_waiting_in_a_sync_round_stops_without_waiting_out_its_request(tmp_path, transport):
    """A worker whose sync round cannot close (the other worker never came) retried its interrupted pull
    inside the stop grace, and the retry waited out the whole request_timeout: 60 s after SIGTERM."""
    job = tmp_path / "job.toml"
    job.write_text(
        f"[train]\nepochs = 5\n[cluster]\nshards = 1\nworkers = 2\npolicy = \"sync\"\ntransport = \"{transport}\"\n"
    )
    procs = []
    try:
        port_file = tmp_path / "shard.addr"
        procs.append(
            subprocess.Popen(
                [SERVER, "-c", str(job), "--shard", "0", "--port-file", str(port_file)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env=by_hand_env(),
            )
        )
        address = wait_for(lambda: port_file.exists() and port_file.read_text().strip(), 60, "the shard to serve")
        worker = subprocess.Popen(
            [WORKER, "-c", str(job), "--rank", "0", "--servers", address, "--no-progress"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=by_hand_env(),
        )
        procs.append(worker)
        config = JobConfig.load(job)
        plan = PartitionPlan(build_job(config).model.specs(), 1, config.cluster.links.slice_bytes)
        # worker 0 pushed clock 0: it waits for round 0 to close
        with PSClient([address], plan, token=TOKEN) as observer:
            wait_for(lambda: observer.status()[0].workers[0].clock == 1, 60, "worker 0 to push its first step")
        began = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=90)
        took = time.monotonic() - began
        assert worker.returncode == 0, err[-2000:]
        assert took < Deadlines().request_timeout / 4, f"took {took:.1f}s: {err[-2000:]}"
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def test_launch_guards_its_shards_with_a_token_of_its_own(tmp_path):
    """psgd launch ran its shards without a token: any local process could hold their ports or write to
    them. Now it makes one per job and hands it to its children in their environment only."""
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "PSGD_TOKEN"}
    launch = subprocess.Popen(
        [PSGD, "launch", "--run-dir", str(run), "--epochs", "400", "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        wait_for(lambda: started_training(run), 60, "both workers to step")
        address = (run / "shard-0.addr").read_text().strip()
        shard_pid = next(pid for pid, cmd in processes_mentioning(str(run)) if "psgd.cli.server" in cmd)
        environ = dict(
            item.split("=", 1) for item in Path(f"/proc/{shard_pid}/environ").read_text().split("\0") if "=" in item
        )
        token = environ["PSGD_TOKEN"]
        assert len(token) >= 32
        config = JobConfig.load(run / "job.toml")
        plan = PartitionPlan(build_job(config).model.specs(), 2, config.cluster.links.slice_bytes)
        tls = TLSFiles(*(str(run / "tls" / name) for name in ("job.pem", "job.key", "ca.pem")))  # the run's own
        with PSClient(
            [address, config.cluster.servers[1]],
            plan,
            deadlines=Deadlines(request_timeout=5),
            retry_deadline=0,
            tls=tls,
        ) as stranger:  # its certificate, not its token
            with pytest.raises(Exception, match="UNAUTHENTICATED"):
                stranger.status()
        with PSClient(
            config.cluster.servers, plan, deadlines=Deadlines(request_timeout=5), token=token, tls=tls
        ) as insider:
            assert [s.shard for s in insider.status()] == [0, 1]
        launch.send_signal(signal.SIGTERM)
        _, err = launch.communicate(timeout=60)
        written = [(run / "job.toml").read_text(), err] + [p.read_text() for p in run.glob("*.log")]
        assert not any(token in text for text in written)  # never in the job file or a log
    finally:
        launch.kill()
        launch.wait(10)
        kill_leftovers(run)


def test_a_stop_signal_caught_by_another_thread_ends_calls_being_retried(tmp_path):
    """Found by the chaos suite (seed 11, run 1: a sync job over gRPC, SIGTERM to every process): a worker whose
    calls to two shards were being retried on its pool's threads did not stop for 10 s.  A process's signal may be
    caught by any of its threads, but Python runs the handler (which sets the stop) only in the main thread, which
    waited for the pool without a timeout.  Here the signal is sent to a pool thread itself."""
    import threading

    config = JobConfig()
    config = config.apply_sets(["cluster.shards=2"])
    plan = PartitionPlan(build_job(config).model.specs(), 2, config.cluster.links.slice_bytes)
    gone = [f"127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens there: every call fails, and is retried
    stop = threading.Event()
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: stop.set())
    sent: list[float] = []
    try:
        with PSClient(gone, plan, deadlines=Deadlines(request_timeout=20), stop=stop) as client:
            host = {s.name: __import__("numpy").empty(s.shape, dtype=s.dtype) for s in plan.specs}

            def signal_a_pool_thread() -> None:
                threads = wait_for(
                    lambda: [t for t in list(client._pool._threads) if t.ident],
                    10,
                    "the client's pool to run the calls",
                )
                signal.pthread_kill(threads[0].ident, signal.SIGUSR1)
                sent.append(time.monotonic())

            helper = threading.Thread(target=signal_a_pool_thread, daemon=True)
            helper.start()
            with pytest.raises(Exception):
                client.pull(0, host)
            ended = time.monotonic()
            helper.join(10)
        assert sent and stop.is_set()
        assert ended - sent[0] < 1.0, f"the calls went on {ended - sent[0]:.1f}s after the stop signal"
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_worker_stopped_while_it_registers_leaves_as_asked():
    """Seen in test_shards_and_workers_sigtermed_together_all_exit_0: every process got SIGTERM while a worker's
    registration was in flight; the stopping shard answered UNAVAILABLE, and the worker, asked to stop, did not retry
    but exited 1 with an error.  Here the shard holds the registration until the worker is asked to stop and the shard
    is stopping: the worker leaves before it joined, as a stop asked for does."""
    import threading

    from helpers import make_job, shards

    from psgd.worker.exchange import run_worker

    job = make_job("model.name=softmax", "cluster.shards=1", "cluster.workers=1")
    entered, release, stop, ended = threading.Event(), threading.Event(), threading.Event(), {}
    with shards(job) as (job, (server,)):
        register = server.core.register

        def held(*args, **kwargs):
            entered.set()
            release.wait(10)
            return register(*args, **kwargs)

        server.core.register = held

        def work() -> None:
            try:
                ended["result"] = run_worker(job, 0, job.cluster.servers, progress=False, stop=stop)
            except Exception as exc:  # what the test is about
                ended["error"] = exc

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        assert entered.wait(30), "the worker did not register"
        stop.set()
        stopping = threading.Thread(target=server.stop, kwargs={"grace": 0.2}, daemon=True)
        stopping.start()
        worker.join(30)
        release.set()
        stopping.join(30)
    assert not worker.is_alive(), "the worker did not stop"
    assert "error" not in ended, f"a stop asked for ended in an error: {ended['error']}"
    assert ended["result"].steps == 0
