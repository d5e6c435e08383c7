"""The invariants: pure checks on plain data, each returning its problems in words (empty: fine).

No update applied twice (:func:`check_exactly_once`) or lost (:func:`check_no_loss`), a sync job's weights those of
an undisturbed run (:func:`check_same_weights`), counters that add up, restores from the newest checkpoint, finite
weights, the documented exit codes, a pair whose replica follows (:func:`check_follows`), background loops that
never fail (:func:`check_background`), and nothing leaked on disk.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from psgd.policy import POLICIES


def check_exactly_once(policy: str, versions: Mapping[int, int], clocks: Mapping[int, int]) -> list[str]:
    """No update applied twice: every distinct (worker, clock) push makes at most one update.

    ``versions``: shard -> version; ``clocks``: worker -> how many steps it may
    have pushed.  Under sync a round is one update, so a version is at most the
    largest clock; otherwise at most the sum of the clocks.
    """
    if POLICIES[policy].accumulates:
        bound, what = max(clocks.values(), default=0), "the largest worker clock (one update per sync round)"
    else:
        bound, what = sum(clocks.values()), "the sum of the workers' clocks (one update per push)"
    return [
        f"shard {k}: version {v} exceeds {bound}, {what}: an update was applied twice"
        for k, v in sorted(versions.items())
        if v > bound
    ]


def check_no_loss(
    policy: str,
    versions: Mapping[int, int],
    total: int,
    workers: int,
    restarted: Iterable[int],
    worker_kills: int,
    said_lost: Mapping[int, int] | None = None,
) -> list[str]:
    """A finished job's shards that were never killed lost no update (a graceful restart loses none); ``restarted``
    names the others (none where a killed shard loses nothing: sync with cuts, a shard kept twice); ``said_lost``:
    updates a process of a pair said were lost as it stepped down (it had gone on alone: said, not silent).

    Sync: every round of the ``total`` closes once, so the version is ``total``.
    Async: every push is applied, except that a worker killed between its
    pushes to two shards skips that clock on one of them (one per kill).
    """
    restarted = set(restarted)
    out = []
    for k, v in sorted(versions.items()):
        if k in restarted:
            continue
        if POLICIES[policy].accumulates and v != total:
            out.append(
                f"shard {k}: version {v} after a finished sync job of {total} rounds (it was never killed): "
                f"{'rounds were lost' if v < total else 'rounds were applied twice'}"
            )
        elif not POLICIES[policy].accumulates and v < workers * total - worker_kills - (said_lost or {}).get(k, 0):
            out.append(
                f"shard {k}: version {v} after a finished async job of {workers} x {total} pushes with "
                f"{worker_kills} worker kill(s) (it was never killed): {workers * total - worker_kills - v} "
                "update(s) lost"
            )
    return out


def check_same_weights(weights: Mapping[str, np.ndarray], undisturbed: Mapping[str, np.ndarray]) -> list[str]:
    """A sync job with cuts ends with the weights of the same job run without faults, to the bit (float64): a
    shard that restarted cost rounds computed again, never a different result."""
    out = []
    for name, value in sorted(undisturbed.items()):
        mine = weights.get(name)
        if mine is None or mine.shape != value.shape:
            out.append(f"variable {name} is missing or of another shape than in the undisturbed run")
        elif not np.array_equal(mine, value):
            out.append(
                f"variable {name} differs from the undisturbed run's by up to "
                f"{float(np.max(np.abs(mine - value))):.3g} ({int(np.sum(mine != value))} of {value.size} values)"
            )
    return out


def check_counters(policy: str, shard: int, version: int, counters: Mapping[str, Any]) -> list[str]:
    """A shard's counters add up: ``applied`` is its version, and every counted push has one outcome."""
    out = []
    if "applied" in counters and int(counters["applied"]) != version:
        out.append(f"shard {shard}: counters say {counters['applied']} update(s) applied, its version is {version}")
    if "pushes" in counters:
        parts = ["accumulated", "duplicates", "late", "rejected"] + (
            [] if POLICIES[policy].accumulates else ["applied"]
        )
        outcomes = sum(int(counters.get(k, 0)) for k in parts)
        if int(counters["pushes"]) != outcomes:
            out.append(
                f"shard {shard}: {counters['pushes']} push(es) counted but {outcomes} outcome(s) "
                f"({', '.join(f'{k} {counters.get(k, 0)}' for k in parts)})"
            )
    return out


def check_restore(shard: int, newest_before: int | None, restored: int | None, version: int | None) -> list[str]:
    """A restarted shard loses at most the updates since its last checkpoint: it restores the newest one
    there was when it was killed (``newest_before``; None: there was none)."""
    if newest_before is None:
        return []
    if restored is None:
        return [
            f"shard {shard} restarted from its initial weights although checkpoint ckpt-{newest_before} "
            "was there: every update it had applied is lost"
        ]
    out = []
    if restored < newest_before:
        out.append(
            f"shard {shard} restored version {restored}, older than its newest checkpoint "
            f"ckpt-{newest_before} at the kill: {newest_before - restored} update(s) lost"
        )
    if version is not None and version < newest_before:
        out.append(
            f"shard {shard} is at version {version} after its restart, below its newest checkpoint "
            f"ckpt-{newest_before} at the kill"
        )
    return out


def check_finite(weights: Mapping[str, np.ndarray], where: str) -> list[str]:
    """The weights hold no NaN or Inf."""
    out = []
    for name, w in sorted(weights.items()):
        bad = int(np.size(w) - np.count_nonzero(np.isfinite(w)))
        if bad:
            out.append(f"{where}: {name} holds {bad} non-finite value(s) (NaN/Inf)")
    return out


def check_exit(name: str, code: int | None, expected: int, why: str) -> list[str]:
    """A process exits with the documented code (``None``: it had not exited within its bound)."""
    if code is None:
        return [f"{name} had not exited {why}"]
    if code != expected:
        return [f"{name} exited with status {code}, expected {expected} ({why})"]
    return []


def check_follows(
    shard: int, leader: Mapping[str, Any] | None, follower: Mapping[str, Any] | None, address: str
) -> list[str]:
    """Shard ``shard``'s pair is whole: its primary (``leader``, its Status) says that it is followed by its replica at
    ``address``, and that replica (``follower``, its Status) says that it follows; a pair never reports a follower
    it does not have (None: did not answer)."""
    if leader is None or leader.get("role") != "primary":
        return [f"shard {shard}: no primary answered ({leader and leader.get('role')})"]
    out = []
    said = leader.get("follower") or ""
    if not said.startswith(f"{address} ") or leader.get("replica_lag", -1) < 0:
        out.append(
            f"shard {shard}'s primary says it is followed by {said or 'no one'}, not by its replica at "
            f"{address} (lag {leader.get('replica_lag')})"
        )
    if follower is None or follower.get("role") != "replica" or follower.get("replica_lag") != 0:
        out.append(
            f"shard {shard}: its replica at {address} does not follow (role "
            f"{follower and follower.get('role')}, lag {follower and follower.get('replica_lag')})"
        )
    return out


def check_background(name: str, said: str, errors: int) -> list[str]:
    """A shard process's background loops (checkpoints, leases, its replica) never die silently: its log
    (``said``) holds no exception that ended a thread, and it counted no error of theirs (``errors``:
    background_errors, each logged and retried)."""
    out = [
        f"{name} logged an exception that ended a thread: {line.strip()}"
        for line in said.splitlines()
        if line.startswith("Exception in thread")
    ]
    if errors:
        out.append(f"{name} counted {errors} error(s) in its background loops (background_errors)")
    return out


def check_files(
    folder: Path,
    ckpt_root: Path,
    shards: int,
    keep: int,
    port_files: Sequence[Path],
    final_versions: Mapping[int, int] | None = None,
    at_least: Mapping[int, int] | None = None,
) -> list[str]:
    """After a clean stop nothing is leaked: no temporary file anywhere under ``folder``; per shard at most
    ``keep`` checkpoints, each npz with its manifest and matching its checksum; the newest one is the final
    version (``final_versions``) or at least ``at_least``; no port file is left (a stopped shard removes
    its own)."""
    from psgd.server.state import checkpoint

    out = [
        f"temporary file left behind: {p.relative_to(folder)}"
        for p in sorted(folder.rglob("*"))
        if p.is_file() and (p.name.endswith(".tmp") or ".tmp." in p.name)
    ]
    jobs = [p for p in sorted(ckpt_root.iterdir()) if p.is_dir()] if ckpt_root.is_dir() else []
    if len(jobs) > 1:
        out.append(f"{ckpt_root} holds {len(jobs)} job folders ({', '.join(p.name for p in jobs)}), expected one")
    for k in range(shards):
        for where in [j / f"shard-{k}" for j in jobs]:
            held = checkpoint.versions(where)
            if len(held) > keep:
                out.append(f"{where.relative_to(folder)}: {len(held)} checkpoints kept, at most {keep} allowed")
            for npz in sorted(where.glob("ckpt-*.npz")):
                if not npz.with_suffix(".json").exists():
                    out.append(f"{npz.relative_to(folder)} has no manifest (left by an interrupted checkpoint)")
            for v in held:
                try:
                    checkpoint.load(where, v, arrays=False)
                except checkpoint.CheckpointError as exc:
                    out.append(f"{where.relative_to(folder)}/ckpt-{v} is damaged: {exc}")
            newest = held[0] if held else None
            if final_versions is not None and k in final_versions and newest != final_versions[k]:
                out.append(
                    f"shard {k} stopped at version {final_versions[k]} but its newest checkpoint is "
                    f"{'none' if newest is None else f'ckpt-{newest}'}: the last checkpoint was not written"
                )
            if at_least is not None and k in at_least and (newest is None or newest < at_least[k]):
                out.append(
                    f"shard {k} was at version {at_least[k]} before it stopped but its newest checkpoint is "
                    f"{'none' if newest is None else f'ckpt-{newest}'}: the last checkpoint was not written"
                )
    out += [f"port file {path.name} left behind by a shard that stopped" for path in port_files if path.exists()]
    return out
