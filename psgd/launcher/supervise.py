"""The launcher's children: started, watched and stopped together, never left behind.

- each child runs in a session of its own and is told by the kernel to stop
  (SIGTERM) when the launcher dies, even by SIGKILL (``PR_SET_PDEATHSIG``, :func:`dying_with_parent`);
- SIGINT, SIGTERM and SIGHUP to the launcher are forwarded to every child
  (:meth:`Children.forwarding_signals`; a parameter-server job's workers get SIGINT: the job pauses), which
  gets ``GRACE`` seconds to leave cleanly before it is killed (:meth:`Children.stop_all`);
- the current folder is first on every child's import path (:func:`child_environment`);
- each child's log is new, but a resumed run's (:class:`Children` ``resumed``): appended to, after a line that
  says the run resumed there;
- :func:`wait_all` and :func:`wait_for_files` wait on children with a deadline
  and fail, with the end of its log, as soon as one of them fails: the error carries a record of each child seen
  failed (:class:`~psgd.launcher.failures.ChildFailure`), and its last lines say them, one line each.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from psgd.errors import ClusterError, Interrupted
from psgd.launcher.failures import ChildFailure, failure
from psgd.observe.files import open_own
from psgd.worker.stop import STOP_SIGNALS

log = logging.getLogger(__name__)

#: Seconds the children get to leave after a forwarded signal (or at the end of the job) before SIGKILL.
GRACE = 10.0
# sets the parent-death signal (prctl PR_SET_PDEATHSIG = 1), sends it at once where the parent is gone already,
# then becomes the command; a command that cannot be started is one line and status 127, as in a shell
_STUB = (
    "import ctypes, os, sys\n"
    "parent, signum, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]\n"
    "ctypes.CDLL(None).prctl(1, signum, 0, 0, 0)\n"
    "if os.getppid() != parent:\n"
    "    os.kill(os.getpid(), signum)\n"
    "try:\n"
    "    os.execvp(argv[0], argv)\n"
    "except OSError as exc:\n"
    "    sys.stderr.write(f'cannot start {argv[0]}: {exc.strerror}\\n')\n"
    "    os._exit(127)\n"
)


class LaunchError(ClusterError):
    """A process of the job failed or ran past the time limit; ``failures``: a record of each child the launch saw
    fail (none where it ran out of time or refused to start)."""

    def __init__(self, message: str, failures: Sequence[ChildFailure] = ()):
        super().__init__(message)
        self.failures = tuple(failures)


class LaunchInterrupted(Interrupted):
    """The launch was stopped by a signal (SIGINT, as Ctrl-C sends it; SIGTERM or SIGHUP) and stopped every process
    it started; a parameter-server job can go on from its shards' checkpoints, as the message says.  A
    KeyboardInterrupt, as Ctrl-C is in Python, and a :class:`~psgd.PsgdError`."""

    def __init__(self, signum: int, children: int):
        self.signum = signum
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name}: forwarded it to {children} process(es); none is left running")


def dying_with_parent(argv: Sequence[str], signum: int = signal.SIGTERM) -> list[str]:
    """``argv`` started so that the kernel sends it ``signum`` when this process dies, however it dies: through
    a small Python stub that sets it and then execs ``argv`` (same pid).  Not a ``preexec_fn``: one makes Popen
    fork where it would vfork, and gRPC's fork handlers can abort a child forked while one of this process's
    channels is active (grpc/grpc#43055), before it reaches exec."""
    return [sys.executable, "-I", "-S", "-c", _STUB, str(os.getpid()), str(int(signum)), *argv]


def child_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: the launcher's, unbuffered, with the current folder first on PYTHONPATH."""
    env = dict(os.environ if environ is None else environ)
    env["PYTHONUNBUFFERED"] = "1"
    paths = [os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != os.getcwd()]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


class Child:
    """One started process, its log file, and how to report and signal it.  Its ``name`` is its role and, where it
    has one, its number: ``shard 0``, ``replica 0``, ``worker 1``, ``rank 1``; ``mpiexec -n 4`` runs every rank."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        show: bool,
        env: Mapping[str, str] = {},
        show_stdout: bool = False,
        resumed: bool = False,
    ):
        self.name, self.log_path = name, log_path
        if not resumed:
            open_own(log_path, "w").close()  # a new log; then appended to, as the child may write to it (--log-file)
        self.log_file = open_own(log_path, "a")
        if resumed and self.log_file.tell():  # the stopped part's lines stay, and say where they end
            self.log_file.write(
                f"---- resumed at {time.strftime('%Y-%m-%d %H:%M:%S')}: the lines above are "
                "from the run's earlier part ----\n"
            )
            self.log_file.flush()
        stderr = None if show else self.log_file
        stdout = None if show and show_stdout else self.log_file  # a script's first copy: its prints shown too
        self.popen = subprocess.Popen(
            dying_with_parent(argv),
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            env={**child_environment(), **env},
            start_new_session=True,
        )

    def failure(self, began: float) -> ChildFailure:
        """The record of this child, ended (``began``: when its launch began, by time.monotonic)."""
        role, _, number = self.name.partition(" ")
        return failure(
            role, int(number) if number.isdigit() else None, self.popen.pid, self.popen.returncode, self.log_path, began
        )

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the child's whole process group (mpiexec's ranks included)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signum)


class Children:
    """The processes of one launch: started, watched, and stopped together, never left behind."""

    def __init__(self, resumed: bool = False) -> None:
        self.procs: list[Child] = []
        self.received: int | None = None
        self.began = time.monotonic()  # the failures' "seconds into the launch" count from here
        self.resumed = resumed  # a resumed run's: each log is appended to, after a line that says so

    def start(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        show: bool = False,
        env: Mapping[str, str] = {},
        show_stdout: bool = False,
    ) -> Child:
        """Start ``argv`` as child ``name`` (``env``: variables on top of :func:`child_environment`); ``show``: its
        stderr (with ``show_stdout``, its stdout too) on the launcher's, else in its log."""
        self.check_signal()
        proc = Child(name, argv, log_path, show, env, show_stdout, self.resumed)
        self.procs.append(proc)
        return proc

    def failed(self, ended: Sequence[Child]) -> LaunchError:
        """The error that ends the launch because the children ``ended`` failed: the end of the first one's log,
        then one line per failure, each with its record."""
        failures = [p.failure(self.began) for p in ended]
        first = failures[0]
        tail = "\n".join("    " + line for line in first.last_lines) or "    (its log is empty)"
        how = f"was killed by {first.signal}" if first.signal else f"exited with status {first.exit_code}"
        return LaunchError(
            f"{first.name} {how}; the end of its log ({first.log}):\n{tail}\n"
            f"the processes that failed:\n" + "\n".join(f.line() for f in failures),
            failures,
        )

    def check_signal(self) -> None:
        if self.received is not None:
            raise LaunchInterrupted(self.received, len(self.procs))

    def wait(self, seconds: float) -> None:
        """Pause up to ``seconds``, returning early when a stop signal arrives."""
        self.check_signal()
        _SIGNALLED.wait(seconds)
        self.check_signal()

    def stop_all(self, signum: int = signal.SIGTERM, grace: float = GRACE, pause_workers: bool = False) -> None:
        """Stop every child within ``grace`` seconds, then kill what is left.

        Workers (and ranks) get ``signum`` first and up to two thirds of the grace to push their
        last step and leave; then the shards get it and write their last checkpoint.  ``pause_workers``
        (a parameter-server job, stopped whole): the workers get SIGINT whatever ``signum`` is, so that none
        tells its shards it left.  Each worker hears its signal at its own moment, and a sync worker may push
        one step more than its peer; a peer that said it left would close that round without its own push,
        and skip that step when the job goes on.  Paused, no round closes short: the shards' last checkpoints
        keep it open, and the job resumes it whole.
        """
        deadline = time.monotonic() + grace
        workers = [p for p in self.procs if not p.name.startswith("shard")]
        shards = [p for p in self.procs if p.name.startswith("shard")]
        self._signal_and_wait(workers, signal.SIGINT if pause_workers else signum, time.monotonic() + grace * 2 / 3)
        self._signal_and_wait(shards, signum, deadline)
        for p in self.procs:
            if p.popen.poll() is None:
                log.warning(
                    "%s did not stop within %.0fs of %s: killing it", p.name, grace, signal.Signals(signum).name
                )
            p.signal_group(signal.SIGKILL)  # whatever is left in its group (e.g. an MPI rank)
            if p.popen.poll() is None:
                p.popen.wait(5)
            p.log_file.close()

    @staticmethod
    def _signal_and_wait(procs: Sequence[Child], signum: int, deadline: float) -> None:
        live = [p for p in procs if p.popen.poll() is None]
        for p in live:
            p.signal_group(signum)
        for p in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(max(0.0, deadline - time.monotonic()))

    @contextlib.contextmanager
    def forwarding_signals(self) -> Iterator[None]:
        """While inside, SIGINT/SIGTERM/SIGHUP are recorded (and end the launch) instead of killing us."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum, frame) -> None:
            if self.received is None:
                self.received = signum
            _SIGNALLED.set()

        _SIGNALLED.clear()
        previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


_SIGNALLED = threading.Event()


def wait_for_files(paths: Sequence[Path], procs: Sequence[Child], children: Children, timeout: float) -> list[str]:
    """The contents of ``paths`` (the shards' port files) once all exist; fail at once when one of ``procs`` exits."""
    deadline = time.monotonic() + timeout
    while True:
        ended = [p for p in procs if p.popen.poll() is not None]
        if ended:
            raise children.failed(ended)
        if all(path.exists() for path in paths):
            return [path.read_text().strip() for path in paths]
        if time.monotonic() > deadline:
            missing = [path.name for path in paths if not path.exists()]
            raise LaunchError(
                f"shards did not start within {timeout:.0f}s (no {', '.join(missing)}); "
                f"see the logs in {paths[0].parent}"
            )
        children.wait(0.05)  # polling for port files with a deadline


def wait_all(
    pending: list[Child],
    watched: Sequence[Child],
    children: Children,
    deadline: float,
    timeout: float,
    run: Path,
    more: Callable[[], list[Child]] | None = None,
) -> None:
    """Wait until every process in ``pending`` exits 0; fail at once when any of ``watched`` fails.  ``more``, asked
    at each look, returns processes started since, which are waited for too (a launch scaled up)."""
    pending = list(pending)
    while pending:
        pending += more() if more is not None else []
        failed = [p for p in watched if p.popen.poll() is not None and p.popen.returncode != 0]
        if failed:
            raise children.failed(failed)
        pending = [p for p in pending if p.popen.poll() is None]
        if time.monotonic() > deadline:
            raise LaunchError(
                f"the job did not finish within {timeout:.0f}s (--timeout); still running: "
                f"{', '.join(p.name for p in pending)}; logs in {run}"
            )
        if pending:
            children.wait(0.1)
