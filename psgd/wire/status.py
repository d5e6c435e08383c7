"""Structured refusals: the reasons a client acts on travel as gRPC status details, not as prose.

A shard that refuses a call for a reason the client must act on (register
again, or stop: the jobs differ) attaches a :class:`ErrorInfo` message to the
call's status, as a ``google.rpc.Status`` detail (the standard "rich error
model", trailing metadata ``grpc-status-details-bin``).  The client reads the
reason back with :func:`reason_of` (:func:`error_info`: with the clock a ROLLED_BACK refusal
names); the message stays for people.  The data
path carries the same reasons as numbers in its error replies.  A shard's refusal (:func:`refuse`) is cut to
what a client accepts (:func:`fit`).
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import any_pb2
from google.rpc import status_pb2
from grpc_status import rpc_status

from psgd.proto import ps_pb2

REASONS = ("NOT_REGISTERED", "JOB_MISMATCH", "ROLLED_BACK", "NOT_PRIMARY", "RANK_HELD")


def reason_number(reason: str) -> int:
    """The ``ErrorInfo.Reason`` number of ``reason`` ("" or unknown: 0)."""
    return ps_pb2.ErrorInfo.Reason.Value(reason) if reason in REASONS else 0


def reason_name(number: int) -> str:
    """The name of an ``ErrorInfo.Reason`` number ("" for none or an unknown one)."""
    try:
        name = ps_pb2.ErrorInfo.Reason.Name(number)
    except ValueError:
        return ""
    return name if name in REASONS else ""


def abort(
    context: grpc.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    reason: str = "",
    differences: Iterable[str] = (),
    rewind_to: int = 0,
    holder: tuple[str, int] | None = None,
) -> None:
    """End the call with ``code`` and ``message``, and ``reason`` as a detail when there is one (with the clock
    to continue from, for ROLLED_BACK; with the holder's host and pid, for RANK_HELD)."""
    if not reason:
        context.abort(code, message)
    detail = any_pb2.Any()
    host, pid = holder or ("", 0)
    detail.Pack(
        ps_pb2.ErrorInfo(
            reason=reason_number(reason),
            differences=list(differences),
            rewind_to=rewind_to,
            holder_host=host,
            holder_pid=pid,
        )
    )
    context.abort_with_status(
        rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=[detail]))
    )


def error_info(err: grpc.RpcError) -> tuple[str, int, tuple[str, int] | None]:
    """The ``ErrorInfo`` reason a failed call carries ("" when it carries none, or cannot be read), its
    ``rewind_to`` (0 where none) and the rank's holder (host, pid) of a RANK_HELD (None where none)."""
    try:
        status = rpc_status.from_call(err)
    except (ValueError, AttributeError, TypeError):  # a detail that does not match the code or message
        return "", 0, None
    if status is None:
        return "", 0, None
    for detail in status.details:
        info = ps_pb2.ErrorInfo()
        if detail.Is(ps_pb2.ErrorInfo.DESCRIPTOR) and detail.Unpack(info):
            holder = (info.holder_host, int(info.holder_pid)) if info.holder_pid else None
            return reason_name(info.reason), int(info.rewind_to), holder
    return "", 0, None


def reason_of(err: grpc.RpcError) -> str:
    """The ``ErrorInfo`` reason a failed call carries ("" when it carries none, or cannot be read)."""
    return error_info(err)[0]


# Status details travel percent-encoded in a trailer, and clients drop trailers over 8 KiB (at random
# above that, always above 16 KiB) with a RESOURCE_EXHAUSTED that hides the real status: stay well under.
MAX_DETAILS_BYTES = 6000


def fit(message: str, limit: int = MAX_DETAILS_BYTES) -> str:
    """``message`` as a client will accept it: valid UTF-8, cut to MAX_DETAILS_BYTES once encoded.  Messages may echo
    what a request sent (a dtype, a plan description), so their size and characters are the sender's choice."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    size = 0
    for i, ch in enumerate(message):
        size += 1 if " " <= ch <= "~" and ch != "%" else 3 * len(ch.encode("utf-8"))
        if size > limit - 40:
            return f"{message[:i]} ... ({len(message) - i} more characters)"
    return message


def refuse(context: grpc.ServicerContext, err) -> None:
    """End the call with ``err``'s status (a :class:`psgd.server.errors.ShardError`: its code's name, message,
    reason and what comes with it), its message made to fit (:func:`fit`)."""
    code = getattr(grpc.StatusCode, err.code)
    if not err.reason:
        abort(context, code, fit(err.message))
    # A reason travels in a second trailer that repeats the message (base64, a third larger): both must fit
    # under the clients' 8 KiB together, so the message gets less than half and the differences a little.
    differences = [fit(d, 160) for d in err.differences[:12]]
    abort(
        context, code, fit(err.message, MAX_DETAILS_BYTES * 2 // 5), err.reason, differences, err.rewind_to, err.holder
    )
