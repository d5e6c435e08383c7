"""The files a run leaves in its folder (logs, metrics lines and rows, its job file, token and data), opened as
psgd's own: never through a symbolic link planted where one of them goes (``O_NOFOLLOW``: a link named
``shard-0.log`` had its target emptied, one named ``worker-0.csv`` had rows appended to its target), never a FIFO
or a device (opened without waiting, then checked to be a regular file), and readable by their user alone where
they hold the job's secrets or data (``private``).  Each refusal is one line naming the file (an InputError).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from psgd.errors import InputError

#: how a file is opened: "w" emptied, then written where it is told (a zip archive goes back to its headers); "a"
#: kept, each write at its end (a child's log is written by the launcher, through the child's stdout, and by the
#: child itself)
HOW = {"w": os.O_TRUNC, "a": os.O_APPEND}


def open_own(
    path: str | os.PathLike, how: str = "w", *, private: bool = False, binary: bool = False, **options: Any
) -> IO:
    """``path`` opened for writing as :data:`HOW` says, as psgd's own file (see the module); ``private``: mode 0600,
    a file that was there included.  ``options`` go to :func:`open` (encoding, newline, buffering)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | HOW[how]
    fd = _opened(path, flags, 0o600 if private else 0o666)
    try:
        if private:
            os.fchmod(fd, 0o600)
        return os.fdopen(fd, how + "b" * binary, **options)
    except BaseException:
        os.close(fd)
        raise


def replace_whole(path: str | os.PathLike, write: Callable[[IO[bytes]], object]) -> None:
    """``path`` replaced whole by what ``write`` writes into a new file beside it (made with a name no one can take
    first), synced, then renamed over it: a reader sees the old file or the new one, never half of it, and a link
    planted at ``path`` is replaced, its target never written.  What is left of the new file on a failure goes; the
    failure (an OSError, or whatever ``write`` raised) is raised."""
    path = Path(path)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def read_own(path: str | os.PathLike) -> str | None:
    """The text of psgd's own file ``path`` (never through a link, never from a FIFO), or None where there is none."""
    try:
        fd = _opened(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, encoding="utf-8") as f:
        return f.read()


def open_regular(path: str | os.PathLike) -> IO[bytes]:
    """``path`` opened for reading, in binary, where it is a regular file (through a link or not: one that someone
    else wrote, read, never written); a FIFO is never waited on and a device never read (InputError)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise InputError(f"{path} cannot be read: {exc.strerror or exc}") from None
    return os.fdopen(_regular(path, fd), "rb")


def _opened(path: str | os.PathLike, flags: int, mode: int) -> int:
    """The descriptor of ``path`` opened with ``flags``, checked to be a regular file and made blocking again."""
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputError(
                f"{path}: a symbolic link where psgd writes its own file; psgd never writes through "
                "one: remove it, or give the run another folder"
            ) from None
        if exc.errno == errno.ENXIO:  # a FIFO opened for writing where none reads it
            raise _not_regular(path) from None
        raise
    return _regular(path, fd)


def _regular(path: str | os.PathLike, fd: int) -> int:
    """``fd`` (``path`` opened without waiting), made blocking again where it is a regular file; else closed and
    refused."""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _not_regular(path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_regular(path: str | os.PathLike) -> InputError:
    return InputError(
        f"{path}: not a regular file (a FIFO, a device or a folder), where a run folder holds plain "
        "files only: remove it, or give the run another folder"
    )
