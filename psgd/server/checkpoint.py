"""Crash-safe shard checkpoints: ``.npz`` arrays plus a JSON manifest, never pickle.

A checkpoint of shard K at version V is two files in the shard's folder:

- ``ckpt-V.npz``: the weights (``weights``), the optimizer state (``opt/<key>``)
  and, for sync, the open round's partial sum (``round_sum``);
- ``ckpt-V.json``: the manifest: version, plan hash and description, policy
  state, counters, the open round's base versions, and the npz file's size
  and SHA-256.

Each file is written to a temporary name, flushed and fsynced, then renamed
into place, the manifest last, so a crash at any moment leaves the previous
checkpoint whole.  On start the newest checkpoint whose npz matches its
manifest's checksum (and whose plan matches) is restored; a corrupt or
truncated one is skipped with a warning.  The newest ``keep`` are kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

log = logging.getLogger(__name__)

FORMAT = "psgd-checkpoint-1"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (the previous one is intact) or read."""


@dataclasses.dataclass
class Checkpoint:
    manifest: dict[str, Any]
    arrays: dict[str, np.ndarray]
    path: Path


def shard_dir(root: str | os.PathLike, shard: int) -> Path:
    return Path(root) / f"shard-{shard}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_atomically(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save(folder: str | os.PathLike, version: int, arrays: dict[str, np.ndarray], manifest: dict[str, Any],
         keep: int = 3) -> Path:
    """Write checkpoint ``version`` into ``folder``; returns the manifest's path.

    Raises :class:`CheckpointError` (with the OS's reason, e.g. a full disk)
    if it cannot be written; the previous checkpoints are left as they were.
    """
    folder = Path(folder)
    npz = folder / f"ckpt-{version}.npz"
    meta = folder / f"ckpt-{version}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomically(npz, lambda f: np.savez(f, **arrays))
        manifest = {**manifest, "format": FORMAT, "version": version, "npz": npz.name,
                    "npz_bytes": npz.stat().st_size, "sha256": _sha256(npz), "written_at": time.time()}
        _write_atomically(meta, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        _fsync_dir(folder)
    except OSError as exc:
        if not meta.exists():
            npz.unlink(missing_ok=True)
        raise CheckpointError(f"checkpoint of version {version} in {folder} failed ({exc.strerror or exc}); "
                              "the previous checkpoint is intact") from None
    for old in sorted(_versions(folder))[:-keep] if keep > 0 else []:
        for suffix in (".json", ".npz"):
            (folder / f"ckpt-{old}{suffix}").unlink(missing_ok=True)
    return meta


def _versions(folder: Path) -> list[int]:
    out = []
    for path in folder.glob("ckpt-*.json"):
        stem = path.stem[len("ckpt-"):]
        if stem.isdigit():
            out.append(int(stem))
    return out


def versions(folder: str | os.PathLike) -> list[int]:
    """The versions of the checkpoints in ``folder`` (those with a manifest), newest first."""
    folder = Path(folder)
    return sorted(_versions(folder), reverse=True) if folder.is_dir() else []


def load(folder: str | os.PathLike, version: int, plan_hash: str | None = None,
         arrays: bool | Sequence[str] = True) -> Checkpoint:
    """Checkpoint ``version`` of ``folder``, checked against its manifest's size and SHA-256 (and
    against ``plan_hash`` when given); never unpickles.  ``arrays``: True loads every array, a
    list of names loads those (e.g. ``["weights"]``), False only checks.  Raises
    :class:`CheckpointError` saying what is wrong."""
    folder = Path(folder)
    meta = folder / f"ckpt-{version}.json"
    try:
        manifest = json.loads(meta.read_text())
        if not isinstance(manifest, dict):
            raise CheckpointError("the manifest is not a JSON object")
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"unknown format {manifest.get('format')!r}")
        npz = folder / manifest["npz"]
        if npz.parent != folder or not npz.exists():
            raise CheckpointError(f"{npz.name} is missing")
        if npz.stat().st_size != manifest["npz_bytes"] or _sha256(npz) != manifest["sha256"]:
            raise CheckpointError(f"{npz.name} does not match its checksum (truncated or corrupt)")
        if plan_hash is not None and manifest.get("plan_hash") != plan_hash:
            raise CheckpointError(f"it was written for partition plan {manifest.get('plan_hash')!r}, "
                                  f"this shard has {plan_hash!r}")
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


def load_latest(folder: str | os.PathLike, plan_hash: str) -> Checkpoint | None:
    """The newest intact checkpoint in ``folder`` for ``plan_hash``, or None when there is none."""
    for version in versions(folder):
        try:
            return load(folder, version, plan_hash)
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s: %s; trying the one before", Path(folder) / f"ckpt-{version}.json",
                        exc)
    return None
