"""How the ranks of an NCCL group get rank 0's unique id before they build a communicator.

Rank 0 makes the id (``make_id``) and publishes it; every other rank waits for
it, bounded by ``timeout``.  The id travels as a JSON list of small ints, never
pickled.  Two forms of rendezvous, named by a spec string:

``file:PATH``
    Rank 0 writes ``{"world_size": N, "id": [...]}`` to PATH atomically
    (temporary file, fsync, rename), replacing a stale file left by an earlier
    run.  The other ranks poll for it, then confirm with a small
    ``PATH.ack-R`` file; rank 0 returns once all N-1 ranks have confirmed and
    removes the files.  PATH must be on a filesystem every rank sees: a local
    path such as /tmp works only when all ranks run on one machine.  Use a path
    unique to the job, so two jobs never share it.

``tcp:HOST:PORT``
    Rank 0 listens on HOST:PORT (an address of rank 0's machine that the other
    ranks can reach) and answers each rank's request with a length-prefixed
    JSON message.  The other ranks connect, retrying until rank 0 is up, and
    send their rank and world size first; rank 0 refuses a world size that is
    not its own, a rank out of range, and a rank it has already served.
    Rank 0 returns once all N-1 ranks have the id.

Either way rank 0 returning means every rank holds the same id, so the NCCL
initialisation that follows does not wait on a rank that never came.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from psgd.collective.base import CollectiveError
from psgd.observe.files import replace_whole

log = logging.getLogger(__name__)

FORMS = (
    "file:PATH (a path on a filesystem every rank sees) or tcp:HOST:PORT "
    "(an address of rank 0's machine that every rank can reach)"
)

_FIRST_POLL = 0.01  # seconds between polls, growing by half each time ...
_MAX_POLL = 0.25  # ... up to this
_CONNECTION_TIMEOUT = 5.0  # rank 0 gives one connection at most this long to send its request
_HEADER = struct.Struct("!I")  # message length, big-endian
_MAX_MESSAGE = 1 << 16  # bytes; an NCCL id is 128 small ints
_MAX_ID_LEN = 4096


class RendezvousError(CollectiveError):
    """The ranks could not exchange rank 0's id: nobody came, the ranks disagree, or the spec is wrong."""


def exchange(spec: str, rank: int, world_size: int, make_id: Callable[[], Any], timeout: float) -> list[int]:
    """Rank 0's id on every rank: rank 0 calls ``make_id()`` and publishes it, the others wait for it.

    ``make_id`` returns ``bytes`` or a sequence of ints (e.g. the bytes from
    ``cupy.cuda.nccl.get_unique_id()``); the result is that id as a list of
    ints.  Raises :class:`RendezvousError` when the spec is not one of the two
    forms, or when ``timeout`` seconds pass before the exchange is complete.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise RendezvousError(f"rendezvous {spec}: world size must be a positive integer, not {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise RendezvousError(f"rendezvous {spec}: rank must be in 0..{world_size - 1}, not {rank!r}")
    if not timeout > 0:
        raise RendezvousError(f"rendezvous {spec}: timeout must be positive, not {timeout!r}")
    kind, _, rest = str(spec).partition(":")
    deadline = time.monotonic() + timeout
    if kind == "file" and rest:
        path = Path(rest)
        if rank == 0:
            return _file_publish(spec, path, world_size, _as_id(make_id(), spec), deadline, timeout)
        return _file_fetch(spec, path, rank, world_size, deadline, timeout)
    if kind == "tcp":
        host, port = _host_port(spec, rest)
        if rank == 0:
            ident = _as_id(make_id(), spec)
            _tcp_serve(spec, host, port, world_size, ident, deadline, timeout)
            return ident
        return _tcp_fetch(spec, host, port, rank, world_size, deadline, timeout)
    raise RendezvousError(f"unknown rendezvous {spec!r}: use {FORMS}")


# ---------------------------------------------------------------- shared helpers


def _as_id(value: Any, spec: str) -> list[int]:
    """``value`` (bytes or a sequence of ints) as a list of ints, or RendezvousError."""
    if isinstance(value, (bytes, bytearray)):
        return list(value)
    try:
        items = list(value)
    except TypeError:
        items = None
    if not items or len(items) > _MAX_ID_LEN or not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise RendezvousError(
            f"rendezvous {spec}: the id must be bytes or a non-empty list of at most "
            f"{_MAX_ID_LEN} ints, not {type(value).__name__} {str(value)[:80]}"
        )
    return [int(v) for v in items]


def _pause(delay: float, deadline: float) -> float:
    """Sleep ``delay`` (never past ``deadline``); return the next, longer delay."""
    time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
    return min(delay * 1.5, _MAX_POLL)


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def _parse_payload(payload: Any, spec: str) -> tuple[int, list[int]]:
    """(world_size, id) from a ``{"world_size": N, "id": [...]}`` message, or ValueError."""
    if not isinstance(payload, dict):
        raise ValueError(f"expected a JSON object, got {type(payload).__name__}")
    world = payload.get("world_size")
    if isinstance(world, bool) or not isinstance(world, int):
        raise ValueError("no integer world_size in it")
    try:
        ident = _as_id(payload.get("id"), spec)
    except RendezvousError as exc:
        raise ValueError(f"no valid id in it ({exc})") from None
    return world, ident


# ---------------------------------------------------------------- file:PATH


def _write_atomic(path: Path, payload: dict) -> None:
    """Write ``payload`` as JSON to ``path`` so readers see the whole file or none of it."""
    replace_whole(path, lambda f: f.write(json.dumps(payload).encode()))


def _ack_path(path: Path, rank: int) -> Path:
    return path.with_name(f"{path.name}.ack-{rank}")


def _remove_files(path: Path) -> None:
    """Remove the id file and every ack file beside it (whatever world size wrote them)."""
    for name in glob.glob(glob.escape(str(path)) + ".ack-*"):
        with contextlib.suppress(OSError):
            os.unlink(name)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _file_publish(spec: str, path: Path, world: int, ident: list[int], deadline: float, timeout: float) -> list[int]:
    if path.exists():
        log.info("rendezvous %s: replacing a stale %s left by an earlier run", spec, path)
    try:
        _remove_files(path)
        _write_atomic(path, {"world_size": world, "id": ident})
    except OSError as exc:
        raise RendezvousError(
            f"rendezvous {spec}: rank 0 could not write the id to {path} ({exc}); "
            "check that its directory exists and is writable"
        ) from exc
    try:
        waiting = set(range(1, world))
        delay = _FIRST_POLL
        while waiting:
            waiting = {r for r in waiting if not _ack_path(path, r).exists()}
            if not waiting or time.monotonic() >= deadline:
                break
            delay = _pause(delay, deadline)
        if waiting:
            raise RendezvousError(
                f"rendezvous {spec}: rank 0 wrote the id to {path} but rank(s) {_ranks(waiting)} of {world} "
                f"did not confirm reading it within {timeout:g} s; check that they are running with the same "
                f"--rendezvous, that {path} is on a filesystem every rank sees (not a node-local /tmp when "
                "ranks run on different machines), or raise the timeout if they start slowly; a rank that read "
                "a stale file from an earlier run before rank 0 replaced it also ends up here: remove the "
                "file before starting the ranks"
            )
    finally:
        _remove_files(path)
    return ident


def _file_fetch(spec: str, path: Path, rank: int, world: int, deadline: float, timeout: float) -> list[int]:
    problem = "the file does not exist yet"
    mismatch = None
    delay = _FIRST_POLL
    while True:
        try:
            found, ident = _parse_payload(json.loads(path.read_text()), spec)
        except FileNotFoundError:
            problem = "the file does not exist yet"
        except (OSError, ValueError) as exc:  # ValueError covers bad JSON
            problem = f"the file is unreadable: {exc}"
        else:
            if found == world:
                try:
                    _write_atomic(_ack_path(path, rank), {"rank": rank, "world_size": world})
                except OSError as exc:
                    raise RendezvousError(
                        f"rendezvous {spec}: rank {rank} read the id but could not confirm it "
                        f"next to {path} ({exc}); every rank needs write access to that "
                        "directory"
                    ) from exc
                return ident
            # Perhaps a stale file that rank 0 has yet to replace: keep waiting, and explain at the end.
            mismatch = found
            problem = f"it is for a group of {found} ranks"
        if time.monotonic() >= deadline:
            break
        delay = _pause(delay, deadline)
    if mismatch is not None:
        raise RendezvousError(
            f"rendezvous {spec}: {path} is for a group of {mismatch} ranks but rank {rank} belongs to a "
            f"group of {world}, and rank 0 did not replace it within {timeout:g} s: a stale file from another "
            "run? delete it and start all ranks again, and check that every rank was given the same number "
            "of workers"
        )
    raise RendezvousError(
        f"rendezvous {spec}: rank {rank} waited {timeout:g} s for rank 0 to write the id to {path} "
        f"({problem}); check that rank 0 is running with the same --rendezvous, that {path} is on a "
        "filesystem every rank sees (not a node-local /tmp when ranks run on different machines), or "
        "raise the timeout"
    )


# ---------------------------------------------------------------- tcp:HOST:PORT


def _host_port(spec: str, rest: str) -> tuple[str, int]:
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")  # tcp:[::1]:29500
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not host or not 1 <= number <= 65535:
        raise RendezvousError(
            f"bad rendezvous {spec!r}: tcp needs tcp:HOST:PORT with a port in 1..65535, e.g. tcp:10.0.0.5:29500"
        )
    return host, number


def _send(sock: socket.socket, payload: dict) -> None:
    data = json.dumps(payload).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:  # bounded: every pass reads at least one byte or raises (the socket has a timeout)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> dict:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > _MAX_MESSAGE:
        raise ValueError(f"message of {n} bytes is over the {_MAX_MESSAGE}-byte limit (not a psgd rendezvous?)")
    payload = json.loads(_recv_exact(sock, n))
    if not isinstance(payload, dict):
        raise ValueError(f"expected a JSON object, got {type(payload).__name__}")
    return payload


def _listen(spec: str, host: str, port: int, world: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, IndexError) as exc:
        raise RendezvousError(f"rendezvous {spec}: cannot resolve {host!r} ({exc})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(min(max(world, 16), socket.SOMAXCONN))
    except OSError as exc:
        sock.close()
        raise RendezvousError(
            f"rendezvous {spec}: rank 0 cannot listen on {host}:{port} ({exc}); is the port "
            "taken by another job or an earlier run? pick another port, and check that "
            f"{host} is an address of rank 0's machine"
        ) from exc
    return sock


def _check_request(request: dict, world: int, served: set[int]) -> tuple[int | None, str | None]:
    """(rank, None) for a request rank 0 should answer, or (rank or None, why it is refused)."""
    rank, their_world = request.get("rank"), request.get("world_size")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, their_world)):
        return None, f"the request must carry integer rank and world_size, got {request!r:.120}"
    if their_world != world:
        return rank, (
            f"rank {rank} was started for a group of {their_world} ranks but rank 0 for a group of "
            f"{world}: start every rank with the same number of workers"
        )
    if rank == 0:
        return rank, "rank 0 is already serving this rendezvous: two processes were started as rank 0"
    if not 0 < rank < world:
        return rank, f"rank {rank} is out of range: the ranks of this group are 0..{world - 1}"
    if rank in served:
        return rank, f"rank {rank} already has the id: two processes were started as rank {rank}"
    return rank, None


def _tcp_serve(spec: str, host: str, port: int, world: int, ident: list[int], deadline: float, timeout: float) -> None:
    """Answer the other ranks until all have the id; bounded by ``deadline`` and a connection count."""
    waiting = set(range(1, world))
    if not waiting:
        return
    refused: list[str] = []
    max_connections = 4 * world + 16  # every rank may retry a few times; garbage cannot keep rank 0 forever
    connections = 0
    with _listen(spec, host, port, world) as listener:
        while waiting and connections < max_connections:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            listener.settimeout(remaining)
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                break
            except OSError as exc:  # e.g. a connection aborted before accept: not fatal
                log.debug("rendezvous %s: accept failed: %s", spec, exc)
                connections += 1
                continue
            connections += 1
            with conn:
                conn.settimeout(max(0.05, min(_CONNECTION_TIMEOUT, deadline - time.monotonic())))
                try:
                    rank, why = _check_request(_recv(conn), world, set(range(1, world)) - waiting)
                    if why is None:
                        _send(conn, {"world_size": world, "id": ident})
                        waiting.discard(rank)
                    else:
                        _send(conn, {"error": why})
                        refused.append(why)
                        log.warning("rendezvous %s: refused %s: %s", spec, peer[0], why)
                except (OSError, ValueError) as exc:
                    refused.append(f"{peer[0]} sent no valid request ({exc})")
    if waiting:
        stop = f"waited {timeout:g} s" if connections < max_connections else f"stopped after {connections} connections"
        detail = f"; refused: {'; '.join(refused[-5:])}" if refused else ""
        raise RendezvousError(
            f"rendezvous {spec}: rank 0 {stop} but rank(s) {_ranks(waiting)} of {world} never came for the "
            f"id{detail}; check that those ranks are running with --rendezvous {spec}, that {host}:{port} is "
            "reachable from their machines (firewall, the address rank 0 listens on), or raise the timeout"
        )


def _tcp_fetch(spec: str, host: str, port: int, rank: int, world: int, deadline: float, timeout: float) -> list[int]:
    """Ask rank 0 for the id, retrying (rank 0 may not be listening yet) until ``deadline``."""
    problem = "no attempt finished"
    delay = _FIRST_POLL
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=max(0.05, remaining)) as sock:
                sock.settimeout(max(0.05, deadline - time.monotonic()))
                _send(sock, {"rank": rank, "world_size": world})
                reply = _recv(sock)
        except (OSError, ValueError) as exc:  # refused (rank 0 not up yet), reset, timed out, garbage
            problem = f"{type(exc).__name__}: {exc}"
        else:
            if "error" in reply:
                raise RendezvousError(f"rendezvous {spec}: rank 0 refused rank {rank}: {reply['error']}")
            try:
                found, ident = _parse_payload(reply, spec)
            except ValueError as exc:
                raise RendezvousError(
                    f"rendezvous {spec}: rank {rank} got a bad answer from {host}:{port} "
                    f"({exc}); is something other than psgd's rank 0 on that port?"
                ) from None
            if found != world:
                raise RendezvousError(
                    f"rendezvous {spec}: rank 0 is in a group of {found} ranks but rank {rank} "
                    f"in a group of {world}: start every rank with the same number of workers"
                )
            return ident
        delay = _pause(delay, deadline)
    raise RendezvousError(
        f"rendezvous {spec}: rank {rank} could not get the id from rank 0 at {host}:{port} within {timeout:g} s "
        f"(last attempt: {problem}); check that rank 0 is running with the same --rendezvous, that "
        f"{host}:{port} is rank 0's address as seen from this machine (not 127.0.0.1 across machines), that no "
        "firewall blocks the port, or raise the timeout"
    )
