"""Crash-safe shard checkpoints: ``.npz`` arrays plus a JSON manifest, never pickle.

A checkpoint of shard K at version V is two files in the shard's folder,
``DIR/<fingerprint>/shard-K`` (the fingerprint names the job, see
:mod:`psgd.job`, so that jobs sharing a checkpoint folder never touch each
other's files):

- ``ckpt-V.npz``: the weights (``weights``), the optimizer state (``opt/<key>``)
  and, for sync, the open round's partial sum (``round_sum``);
- ``ckpt-V.json``: the manifest: version, the job's fingerprint and identity,
  the shard, plan hash and description, policy state, counters, the open
  round's base versions, and the npz file's size and SHA-256; in a job with a
  token, its ``signature``: a keyed hash (HMAC-SHA256, with a key derived from
  the token: :func:`signing_key`) of everything else it says, the npz's checksum
  among it, which a shard of the job checks before it restores it, so that
  whoever can write the folder but does not hold the token cannot have a shard
  resume weights of their making.

Each file is written to a temporary name, flushed and fsynced, then renamed
into place, the manifest last, so a crash at any moment leaves the previous
checkpoint whole; all of it in the folder opened when the checkpoint began (by
its handle), even if a disk is mounted over its path meanwhile.  On start the
newest checkpoint whose npz matches its manifest's checksum (and whose plan
matches) is restored; a corrupt or truncated one is skipped with a warning.
The newest ``keep`` of this job's checkpoints are kept: pruning only ever
removes files whose manifest carries the same fingerprint and shard, and never
the checkpoint just written.  What a crash in the middle of a checkpoint
leaves (temporary files, weights without their manifest) is removed by
:func:`remove_leftovers` at start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from psgd.errors import ClusterError
from psgd.job import differences

log = logging.getLogger(__name__)

FORMAT = "psgd-checkpoint-1"


class CheckpointError(ClusterError):
    """A checkpoint could not be written (the previous one is intact) or read."""


@dataclasses.dataclass
class Checkpoint:
    manifest: dict[str, Any]
    arrays: dict[str, np.ndarray]
    path: Path


def shard_dir(root: str | os.PathLike, shard: int, fingerprint: str | None = None) -> Path:
    """``root/<fingerprint>/shard-K``, where shard K of the job named ``fingerprint`` keeps its checkpoints.

    Without a fingerprint: ``root/shard-K``, the layout of checkpoints written
    before they were scoped to their job (or a job's own folder as ``root``).
    """
    return (Path(root) / fingerprint if fingerprint else Path(root)) / f"shard-{shard}"


def is_fingerprint(name: str) -> bool:
    """True for a job fingerprint (16 hex digits), the name of a job's folder under a checkpoint folder."""
    return re.fullmatch(r"[0-9a-f]{16}", name) is not None


def _sha256(path: str | Path, dir_fd: int | None = None) -> str:
    digest = hashlib.sha256()
    with open(os.open(path, os.O_RDONLY, dir_fd=dir_fd), "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_atomically(dir_fd: int, name: str, write: Callable[[Any], Any]) -> None:
    """``name`` in the folder open as ``dir_fd``, made by ``write(file)`` under a temporary name, flushed, synced
    and renamed into place: all in that folder, whatever its path has come to name meanwhile."""
    tmp = f".{name}.tmp"
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666, dir_fd=dir_fd), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        _remove(tmp, dir_fd)
        raise


def _remove(path: str | Path, dir_fd: int | None = None) -> bool:
    """Delete ``path`` (a name in the folder open as ``dir_fd`` where given) if it is there; False when the OS
    refuses (e.g. a read-only folder)."""
    try:
        os.unlink(path, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest at ``path``, or None when it cannot be read as a JSON object."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def owned(folder: Path, fingerprint: Any, shard: Any) -> list[int]:
    """The versions in ``folder`` whose manifest carries ``fingerprint`` and ``shard``, newest first."""
    return [
        v
        for v in versions(folder)
        if (m := _read_manifest(folder / f"ckpt-{v}.json")) is not None
        and m.get("fingerprint") == fingerprint
        and m.get("shard") == shard
    ]


def signing_key(token: str) -> bytes | None:
    """The key a job's checkpoints are signed with, derived from its token (None without a token: not signed)."""
    if not token:
        return None
    return hmac.new(token.encode("utf-8", "surrogatepass"), b"psgd checkpoint signature", hashlib.sha256).digest()


def _signature(key: bytes, manifest: Mapping[str, Any]) -> str:
    said = json.dumps({k: v for k, v in manifest.items() if k != "signature"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, said.encode(), hashlib.sha256).hexdigest()


def save(
    folder: str | os.PathLike,
    version: int,
    arrays: dict[str, np.ndarray],
    manifest: dict[str, Any],
    keep: int = 3,
    key: bytes | None = None,
) -> Path:
    """Write checkpoint ``version`` into ``folder``; returns the manifest's path.  ``key``: the job's
    :func:`signing_key`, with which the manifest is signed (None: not signed).

    Then the job's older checkpoints beyond the newest ``keep`` are removed:
    only those whose manifest carries the same ``fingerprint`` and ``shard``
    as ``manifest`` (files of other jobs are never touched), and in the job's
    own folder (``shard_dir``) those older still whose manifest cannot be read
    (damaged, skipped at a restore); never the one just written.  Raises :class:`CheckpointError` (with the OS's reason,
    e.g. a full disk) if it cannot be written, saying whether an earlier
    checkpoint is there to fall back on; the previous checkpoints are left as
    they were.
    """
    folder = Path(folder)
    npz, meta = f"ckpt-{version}.npz", f"ckpt-{version}.json"
    job, shard = manifest.get("fingerprint"), manifest.get("shard")
    fd = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # every file of the checkpoint is made, renamed and checked in this folder, by its handle: a disk mounted
        # over its path (or a folder moved aside and made again) meanwhile cannot split the checkpoint between two
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        _write_atomically(fd, npz, lambda f: np.savez(f, **arrays))
        manifest = {
            **manifest,
            "format": FORMAT,
            "version": version,
            "npz": npz,
            "npz_bytes": os.stat(npz, dir_fd=fd).st_size,
            "sha256": _sha256(npz, fd),
            "written_at": time.time(),
        }
        if key is not None:
            manifest["signature"] = _signature(key, manifest)
        _write_atomically(fd, meta, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        with contextlib.suppress(OSError):  # the renames made durable (a file system may not sync a folder)
            os.fsync(fd)
    except OSError as exc:
        if fd is not None and not os.access(meta, os.F_OK, dir_fd=fd):
            _remove(npz, fd)
        raise CheckpointError(
            f"checkpoint of version {version} in {folder} failed ({exc.strerror or exc}); "
            + fallback(folder, job, shard, version)
        ) from None
    finally:
        if fd is not None:
            os.close(fd)
    try:
        _prune(folder, job, shard, version, keep)
    except OSError as exc:  # the checkpoint is written; the old ones go at the next (no descriptor left, say)
        log.warning(
            "checkpoint %s is written, but the older ones could not be looked through to remove those "
            "beyond the newest %d (%s); the next checkpoint tries again",
            folder / meta,
            keep,
            exc.strerror or exc,
        )
    return folder / meta


def _prune(folder: Path, job: Any, shard: Any, version: int, keep: int) -> None:
    """Remove the job's checkpoints in ``folder`` older than the newest ``keep`` (see :func:`save`)."""
    older = [v for v in owned(folder, job, shard) if v != version]
    gone = older[keep - 1 :] if keep > 0 else []
    if gone and folder.parent.name == job:  # the job's own folder: a manifest that cannot be read is its own too
        gone += [v for v in versions(folder) if v < gone[0] and _read_manifest(folder / f"ckpt-{v}.json") is None]
    for old in gone:
        for suffix in (".json", ".npz"):
            if not _remove(folder / f"ckpt-{old}{suffix}"):
                log.warning("could not remove the old checkpoint %s", folder / f"ckpt-{old}{suffix}")


def fallback(folder: str | os.PathLike, fingerprint: Any, shard: Any, failed: int | None = None) -> str:
    """What is left to restore after checkpoint ``failed`` could not be written, in words."""
    try:
        left = [v for v in owned(Path(folder), fingerprint, shard) if v != failed]
    except OSError as exc:  # the reason the checkpoint failed, often (no descriptor left)
        return f"the earlier checkpoints could not be looked through either ({exc.strerror or exc})"
    if not left:
        return "there is no earlier checkpoint to fall back on"
    return f"the previous checkpoint is intact (ckpt-{left[0]})"


_LEFTOVER = re.compile(r"\.ckpt-\d+\.(npz|json)\.tmp|ckpt-(\d+)\.npz")


def remove_leftovers(folder: str | os.PathLike) -> tuple[list[str], int]:
    """Remove what a crash in the middle of a checkpoint left in a job's own ``folder``.

    That is: temporary files (``.ckpt-V.npz.tmp``, ``.ckpt-V.json.tmp``) and
    weights without their manifest (``ckpt-V.npz`` with no ``ckpt-V.json``);
    nothing else.  Call it at start, before the shard writes checkpoints.
    Returns the names removed and their total size in bytes; says so in one
    log line when there were any.
    """
    folder = Path(folder)
    removed: list[str] = []
    size = 0
    if not folder.is_dir():
        return removed, size
    for path in sorted(folder.iterdir()):
        match = _LEFTOVER.fullmatch(path.name)
        if not match or not path.is_file():
            continue
        if match.group(2) and (folder / f"ckpt-{match.group(2)}.json").exists():
            continue  # a checkpoint's weights, with their manifest
        try:
            nbytes = path.stat().st_size
            path.unlink()
        except OSError as exc:
            log.warning("could not remove %s, left by an interrupted checkpoint: %s", path, exc.strerror or exc)
            continue
        removed.append(path.name)
        size += nbytes
    if removed:
        log.info("removed what interrupted checkpoints left in %s: %s (%d bytes)", folder, ", ".join(removed), size)
    return removed, size


def _versions(folder: Path) -> list[int]:
    out = []
    for path in folder.glob("ckpt-*.json"):
        stem = path.stem[len("ckpt-") :]
        if stem.isdigit():
            out.append(int(stem))
    return out


def versions(folder: str | os.PathLike) -> list[int]:
    """The versions of the checkpoints in ``folder`` (those with a manifest), newest first."""
    folder = Path(folder)
    return sorted(_versions(folder), reverse=True) if folder.is_dir() else []


def load(
    folder: str | os.PathLike,
    version: int,
    plan_hash: str | None = None,
    arrays: bool | Sequence[str] = True,
    fingerprint: str | None = None,
    key: bytes | None = None,
) -> Checkpoint:
    """Checkpoint ``version`` of ``folder``, checked against its manifest's size and SHA-256 (and
    against ``plan_hash``, the job's ``fingerprint`` and the manifest's signature with ``key`` when given);
    never unpickles.  ``arrays``: True loads every array, a list of names loads those (e.g. ``["weights"]``),
    False only checks.  Raises :class:`CheckpointError` saying what is wrong."""
    folder = Path(folder)
    meta = folder / f"ckpt-{version}.json"
    try:
        manifest = json.loads(meta.read_text())
        if not isinstance(manifest, dict):
            raise CheckpointError("the manifest is not a JSON object")
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"unknown format {manifest.get('format')!r}")
        if fingerprint is not None and manifest.get("fingerprint") != fingerprint:
            raise CheckpointError(
                f"it was written by job {manifest.get('fingerprint') or '(unnamed)'}, this is job {fingerprint}"
            )
        if key is not None:
            signed = manifest.get("signature")
            if not isinstance(signed, str) or not signed:
                raise CheckpointError(
                    "it is not signed, and this job has a token: it was written by a shard without "
                    "one (--no-token), or not by a shard of this job"
                )
            if not hmac.compare_digest(signed.encode("ascii", "replace"), _signature(key, manifest).encode()):
                raise CheckpointError(
                    "its signature does not match this job's token: it was written under another "
                    "token, or changed since"
                )
        npz = folder / manifest["npz"]
        if npz.parent != folder or not npz.exists():
            raise CheckpointError(f"{npz.name} is missing")
        if npz.stat().st_size != manifest["npz_bytes"] or _sha256(npz) != manifest["sha256"]:
            raise CheckpointError(f"{npz.name} does not match its checksum (truncated or corrupt)")
        if plan_hash is not None and manifest.get("plan_hash") != plan_hash:
            raise CheckpointError(
                f"it was written for partition plan {manifest.get('plan_hash')!r}, this shard has {plan_hash!r}"
            )
        loaded = {}
        if arrays:
            with np.load(npz, allow_pickle=False) as data:
                keys = data.files if arrays is True else [k for k in arrays if k in data.files]
                loaded = {k: data[k] for k in keys}
        return Checkpoint(manifest, loaded, meta)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, EOFError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise CheckpointError(f"{type(exc).__name__}: {reason}") from None


def load_latest(
    folder: str | os.PathLike,
    plan_hash: str,
    fingerprint: str | None = None,
    check: Callable[[Checkpoint], None] | None = None,
    key: bytes | None = None,
) -> Checkpoint | None:
    """The newest intact checkpoint in ``folder`` for ``plan_hash`` (and the job ``fingerprint``, and signed with
    ``key``, when given) that ``check`` passes (it raises :class:`CheckpointError` saying why not), or None when
    there is none."""
    for version in versions(folder):
        try:
            ckpt = load(folder, version, plan_hash, fingerprint=fingerprint, key=key)
            if check is not None:
                check(ckpt)
            return ckpt
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s: %s; trying the one before", Path(folder) / f"ckpt-{version}.json", exc)
    return None


@dataclasses.dataclass
class Other:
    """Checkpoints of one shard index that belong to another job (or to no job: the layout before)."""

    fingerprint: str | None  # None: ``root/shard-K``, written before checkpoints were scoped to a job
    folder: Path
    versions: list[int]  # newest first
    manifest: dict[str, Any] | None  # the newest readable manifest

    def describe(self, mine: Mapping[str, Any] | None, plan_hash: str) -> str:
        """``fingerprint (ckpt-V; differs in field: this job a, checkpoint b; ...)``, one line."""
        m = self.manifest or {}
        theirs = m.get("identity")
        if not m:
            diff = "its manifests cannot be read"
        elif isinstance(theirs, dict) and mine is not None:
            found = differences(mine, theirs, me="this job", them="checkpoint")
            diff = "differs in " + "; ".join(found) if found else "the same identity"
        elif m.get("plan_hash") != plan_hash:
            diff = f"differs in plan: this job {plan_hash}, checkpoint {m.get('plan_hash')}"
        else:
            diff = "the same plan, no identity recorded"
        newest = ", ".join(f"ckpt-{v}" for v in self.versions[:3]) + (" ..." if len(self.versions) > 3 else "")
        if self.fingerprint:
            return f"job {self.fingerprint} ({newest}; {diff})"
        if m.get("fingerprint"):  # a job's own folder given as the checkpoint folder
            return f"job {m['fingerprint']} in {self.folder} ({newest}; {diff})"
        return f"{self.folder} ({newest}, written before checkpoints were scoped to their job; {diff})"


def others(root: str | os.PathLike, shard: int, fingerprint: str) -> list[Other]:
    """Checkpoints of shard index ``shard`` in the checkpoint folder ``root`` that are not job ``fingerprint``'s:
    ``root/<another fingerprint>/shard-K`` and the old layout ``root/shard-K``; empty folders are not counted."""
    root = Path(root)
    if not root.is_dir():
        return []
    folders = [
        (sub.name, shard_dir(root, shard, sub.name))
        for sub in sorted(root.iterdir())
        if sub.name != fingerprint and is_fingerprint(sub.name)
    ]
    found = []
    for name, folder in [*folders, (None, shard_dir(root, shard))]:
        held = versions(folder)
        if held:
            newest = next((m for v in held if (m := _read_manifest(folder / f"ckpt-{v}.json")) is not None), None)
            found.append(Other(name, folder, held, newest))
    return found
