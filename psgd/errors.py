"""psgd's errors: one root, :class:`PsgdError`, and the four kinds a caller acts on.

- :class:`InputError`: what the user gave is wrong (a job file, a flag, a model, data, a device that is not
  there): fix it and run again.  The commands exit 2, with the one line.
- :class:`ClusterError`: the cluster refused or failed (a shard, a checkpoint, a launch, a collective): look at
  its processes, then retry or restart.  The commands exit 1, with the one line.
- :class:`TransportError`: a message could not travel whole (a connection, a frame, a shared-memory segment):
  the worker's client retries where a retry is safe, and says so where it gives up.
- :class:`Interrupted`: a stop signal (Ctrl-C's SIGINT, SIGTERM, SIGHUP) ended the work, and what it started is
  stopped: go on where its message says.  The commands exit 128 + the signal's number.

Each module's own errors derive from one of these (ConfigError is an InputError, PSError a ClusterError,
WireError a TransportError ...), so that ``except PsgdError`` catches whatever psgd raises on purpose and
nothing else.  InputError is also a ValueError, ClusterError a RuntimeError and Interrupted a KeyboardInterrupt
(what Ctrl-C raises in Python), as Python's own errors of those kinds are.
"""

from __future__ import annotations

import enum


class PsgdError(Exception):
    """Whatever psgd raises on purpose."""


class InputError(PsgdError, ValueError):
    """What the user gave is wrong: fix it and run again (the commands exit 2)."""


class ConfigError(InputError):
    """A malformed or inconsistent job file or override (psgd.config)."""


class ClusterError(PsgdError, RuntimeError):
    """The cluster refused or failed: look at its processes, retry or restart (the commands exit 1)."""


class TransportError(PsgdError):
    """A message could not travel whole; retried where that is safe."""


class Interrupted(PsgdError, KeyboardInterrupt):
    """A stop signal ended the work, and what it started is stopped: go on where the message says."""


def install_extra(extra: str) -> str:
    """How to install psgd's extra ``extra`` (``mpi``, ``bench``, ...), said one way in every message and page: in
    psgd's folder, editable and held to the tested versions, as the README installs psgd (psgd is on no package
    index)."""
    return f'python3 -m pip install -c requirements.lock -e ".[{extra}]"'


class Code(enum.Enum):
    """Why a call to a shard failed, in psgd's words, whatever carried it: the codes of gRPC's status, with their
    names and numbers (so that a data-path reply carries the number, and the gRPC edge maps them one to one), without
    gRPC itself."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @classmethod
    def of(cls, number: int) -> Code:
        """The code numbered ``number`` (UNKNOWN for a number that is none)."""
        try:
            return cls(number)
        except ValueError:
            return cls.UNKNOWN
