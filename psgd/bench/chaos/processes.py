"""The processes of a run: how they are started (as users start them, dying with the harness), free ports,
their logs' tails, and a search for processes left behind."""

from __future__ import annotations

import dataclasses
import os
import random
import secrets
import shutil
import socket
import subprocess
from pathlib import Path

from psgd.bench.chaos.settings import PY


def command(script: str, module: str) -> list[str]:
    """How a user starts ``script``: the console script beside this Python (a venv's), else on PATH, else
    ``python -m module``."""
    beside = Path(PY).parent / script
    if beside.exists() and os.access(beside, os.X_OK):
        return [str(beside)]
    found = shutil.which(script)
    return [found] if found else [PY, "-m", module]


def job_token() -> str:
    """The job's token, as a user's shell holds it for every process it starts: ``PSGD_TOKEN``, set in this
    process's environment to a new one where it is not set yet (the processes it starts then inherit it)."""
    token = os.environ.get("PSGD_TOKEN") or secrets.token_urlsafe(32)
    os.environ["PSGD_TOKEN"] = token
    return token


def free_port_pair(
    rng: random.Random | None = None, taken: set[int] | None = None, hosts: tuple[str, ...] = ("127.0.0.1",)
) -> int:
    """A port p with p and p + 1 free on every one of ``hosts``, below the ephemeral range (so that no
    outgoing connection takes it while its shard is down for a restart); ``taken`` (updated) is skipped."""
    rng = rng or random.Random()
    taken = set() if taken is None else taken
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        if port in taken or port + 1 in taken:
            continue
        try:
            for host in hosts:
                with socket.socket() as a, socket.socket() as b:
                    a.bind((host, port))
                    b.bind((host, port + 1))
        except OSError:
            continue
        taken.update((port, port + 1))
        return port
    raise RuntimeError(f"no free pair of ports between 20000 and 32000 on {', '.join(hosts)}")


def tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").rstrip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def last_error(path: Path) -> str:
    """The last line of a log that reports an error, else its last three lines."""
    lines = tail(path, 40).splitlines()
    found = next((line for line in reversed(lines) if "error" in line.lower()), None)
    return found or " | ".join(lines[-3:]) or "(empty log)"


def processes_mentioning(text: str) -> list[int]:
    """Live (not zombie) processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and text in cmdline:
            found.append(int(entry.name))
    return found


@dataclasses.dataclass
class Proc:
    name: str  # shard0, worker1, ...
    incarnation: int
    popen: subprocess.Popen
    log: Path
    metrics: Path | None = None  # a worker's --metrics file


def end_all(procs: list[subprocess.Popen], grace: float = 15.0) -> None:
    """SIGTERM (after SIGCONT, for a stopped one) every process of ``procs``, then wait ``grace`` seconds for each
    and SIGKILL what is left."""
    import contextlib
    import signal

    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
