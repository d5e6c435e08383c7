"""A launch's run folder: a new one under ``runs/`` unless told (:func:`new_run_folder`), claimed for this run
only where it holds no other run's files unless the run is resumed (:func:`claim`), and the token a single-node
launch keeps there (:func:`made_token`); the commands a launch says continue it and watch it.  Every file of it
is written as psgd's own (:mod:`psgd.observe.files`)."""

from __future__ import annotations

import fnmatch
import os
import secrets
import shlex
import time
from collections.abc import Sequence
from pathlib import Path

from psgd.errors import InputError
from psgd.launcher.supervise import LaunchError
from psgd.observe.files import open_own, read_own
from psgd.wire.channel import read_token
from psgd.wire.tls import TLSFiles

#: where a launch keeps its job file, logs and metrics unless told (--run-dir): as TensorBoard and Hydra keep runs
RUNS = Path("runs")
#: where a launch's shards write their checkpoints, in the run folder (psgd launch --resume reads them)
CHECKPOINTS = "checkpoints"
#: where a launch keeps the trained weights, in the run folder, unless told where (--save)
FINAL = "final.npz"
#: where a single-node launch keeps the token it made for its job, in the run folder
TOKEN_FILE = ".token"
#: what a run leaves in its folder (a name, or a pattern of names), beside its checkpoints: another run's, where
#: a launch finds one (a link or a FIFO planted under such a name included)
RUN_FILES = ("job.toml", TOKEN_FILE, "tls", "*.log", "*.jsonl", "*.csv", "*.addr", "tensorboard", "nccl-id.json")


def new_run_folder(mode: str, now: float | None = None) -> Path:
    """``runs/YYYYmmdd-HHMMSS-MODE`` under the current folder, made (``-2``, ``-3``... where one of that second
    exists already)."""
    stem = time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f"-{mode}"
    for n in range(1, 1000):
        folder = RUNS / (stem if n == 1 else f"{stem}-{n}")
        try:
            folder.mkdir(parents=True)
            return folder
        except FileExistsError:
            continue
    raise LaunchError(f"{RUNS}/{stem}: a thousand runs started in the same second; give --run-dir")


def resume_command(run: Path, script: Sequence[str] = (), flags: Sequence[str] = ()) -> str:
    """The command that continues the run in ``run``, shell-quoted, to be typed again as it is: ``script`` (psgd
    run's: the Python file and its own arguments) and ``flags``, the command's own that the run folder does not
    keep (its job file keeps the job's)."""
    command = ["psgd", "run" if script else "launch", *flags, "--resume", str(run), *script]
    return shlex.join(command)


def status_command(run: Path, tls: TLSFiles, token_kept: bool) -> str:
    """The command that shows the running shards of the launch in ``run``, to be typed as it is: psgd status with
    the run's job file (which names the shards once they serve) and ``tls``, the files its workers show; the
    token from the file the launch keeps it in where ``token_kept``, else from the user's own $PSGD_TOKEN."""
    files = ["--tls-ca", tls.ca, "--tls-cert", tls.cert, "--tls-key", tls.key] if tls.enabled else []
    command = shlex.join(["psgd", "status", "-c", str(run / "job.toml"), *map(str, files)])
    return f"PSGD_TOKEN=$(cat {shlex.quote(str(run / TOKEN_FILE))}) {command}" if token_kept else command


def claim(run: Path, resume: bool, mode: str = "ps", script: Sequence[str] = ()) -> None:
    """Make ``run`` this run's folder: refused where it holds another run's files (:data:`RUN_FILES`, checkpoints)
    unless this run ``resume``s it, as a launch writing there would mix its files with that run's (and reads
    what it finds, such as the token)."""
    if not resume and run.is_dir():
        names = sorted(os.listdir(run))
        held = [n for n in names if any(fnmatch.fnmatch(n, p) for p in RUN_FILES)]
        checkpoints = run / CHECKPOINTS
        if checkpoints.is_dir() and not checkpoints.is_symlink():
            held += [f"{CHECKPOINTS}/{n}" for n in sorted(os.listdir(checkpoints))]
        elif CHECKPOINTS in names:
            held.append(CHECKPOINTS)
        if held:
            instead = f"continue it with {resume_command(run, script)}, or " if mode == "ps" else ""
            raise InputError(f"{run} holds the files of an earlier run ({held[0]}): {instead}give another --run-dir")
    run.mkdir(parents=True, exist_ok=True)


def made_token(run: Path) -> str:
    """The token of the job in ``run`` where the user gave none: the one an earlier launch of it kept there (so
    that ``--resume`` gives the shards the token their checkpoints were signed with), else a new one, kept there
    readable by this user alone."""
    path = run / TOKEN_FILE
    kept = (read_own(path) or "").strip()
    if kept:
        return read_token(kept, source=str(path))
    token = secrets.token_urlsafe(32)
    with open_own(path, "w", private=True) as f:
        f.write(token + "\n")
    return token
