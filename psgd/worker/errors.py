"""What a worker's calls to its shards end in, other than an answer: a failure for good (:class:`PSError`), a stop
asked for (:class:`Stopped`), or the job going back to a cut (:class:`ShardWentBack`)."""

from __future__ import annotations

from psgd.errors import ClusterError, Code, PsgdError


class PSError(ClusterError):
    """A call to a shard failed for good; the message names the address and what was tried."""

    def __init__(self, message: str, code: Code | None = None):
        super().__init__(message)
        self.code = code


class Stopped(PSError):
    """The worker was asked to stop (SIGTERM) while it waited for its shards."""


class ShardWentBack(PsgdError):
    """The job goes back to the cut at version ``clock`` (sync with checkpoint_rounds: a shard restarted from it),
    and this worker continues from that clock.  ``cause`` is the restarted shard's incarnation where this worker
    heard of the restart itself and takes every shard back (:func:`psgd.worker.rollback.roll_back`); "" where a
    shard had gone back already."""

    def __init__(self, clock: int, cause: str = ""):
        super().__init__(f"the job goes back to the cut at version {clock}")
        self.clock, self.cause = clock, cause
