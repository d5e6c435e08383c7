"""What a shard answers when it refuses a request, whatever link carried it."""

from __future__ import annotations

from collections.abc import Iterable

from psgd.errors import PsgdError


class ShardError(PsgdError):
    """A request the shard refuses: ``code`` names a status code (psgd.errors.Code, gRPC's at the gRPC edge);
    ``reason`` names an
    ``ErrorInfo.Reason`` the client acts on ("" for none), with ``differences`` for JOB_MISMATCH and
    ``rewind_to`` (the clock to continue from) for ROLLED_BACK, ``holder`` (host, pid) for RANK_HELD."""

    def __init__(
        self,
        code: str,
        message: str,
        reason: str = "",
        differences: Iterable[str] = (),
        rewind_to: int = 0,
        holder: tuple[str, int] | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.differences = list(differences)
        self.rewind_to = rewind_to
        self.holder = holder
