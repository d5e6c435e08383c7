"""Keeping the trained model: a job's weights joined from its shards, running or checkpointed.

A parameter-server job holds its model in pieces: each shard has some slices
of some variables (see :mod:`psgd.partition`), live in memory and in its
checkpoints (``DIR/<job fingerprint>/shard-K/ckpt-V.npz``, one flat array per
shard in slice-id order).  This module joins the pieces into whole variables:

- :func:`pull_from_servers` reads the current weights of a running cluster,
  and the rows of its embedding tables page by page, as an observer (it
  never joins or waits for a round);
- :func:`join_checkpoints` joins the newest intact checkpoint of every shard
  (or version V of every shard), each checked against its manifest's SHA-256
  as a restoring shard checks it, and refuses checkpoints that do not belong
  together (other plans, other versions) with a message that says what each
  shard has;
and :mod:`psgd.weights` writes the joined variables as a plain ``.npz`` and reads
one back.

Both sources derive the partition plan from the job (model, dtype, shards,
slice size) exactly as shards and workers do, so the job must describe the
model that was trained: a mismatch is refused, never joined into garbage.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from psgd.config import Deadlines, JobConfig
from psgd.job import describe_job, fingerprint, identity
from psgd.model.table import TableSpec, joined_by_id, table_keys
from psgd.partition import PartitionPlan, plan_differences
from psgd.server.state import checkpoint
from psgd.weights import ExportError
from psgd.wire.protocol import OBSERVER
from psgd.wire.tls import NO_TLS, TLSFiles
from psgd.worker.client import PSClient
from psgd.worker.lookups import list_rows

#: What to pass when the job does not describe the model that was trained.
JOB_HINT = (
    "pass the job file or flags the model was trained with (-c job.toml, or --model, --dtype, --shards, "
    "--set model.KEY=VALUE)"
)


#: How many checkpoints of a shard a message lists (newest first).
SHOWN = 5
#: how long an export from running shards takes their weights again while they give different versions
SAME_VERSION_SECONDS = 2.0


@dataclasses.dataclass
class Exported:
    """Whole variables joined from a job's shards, and where they came from."""

    weights: dict[str, np.ndarray]
    versions: list[int]  # the version taken from each shard, in shard order
    source: str  # in words: the cluster's addresses or the checkpoint folder
    files: list[str] = dataclasses.field(default_factory=list)  # the checkpoint files taken (none from servers)
    notes: list[str] = dataclasses.field(default_factory=list)  # e.g. a damaged checkpoint skipped

    @property
    def parameters(self) -> int:
        return sum(int(w.size) for w in self.weights.values())


def job_plan(config: JobConfig) -> PartitionPlan:
    """The partition plan every process of ``job`` derives (builds the model; the data is only described)."""
    return describe_job(config).plan


def _describe_job(config: JobConfig, plan: PartitionPlan) -> str:
    return (
        f"plan {plan.hash}: model {config.model['name']}, {config.train.dtype}, {plan.num_shards} shard(s), "
        f"slices of {plan.slice_bytes} bytes"
    )


# -- from a running cluster -------------------------------------------------------------------
def pull_from_servers(
    config: JobConfig,
    addresses: Sequence[str] | None = None,
    token: str = "",
    tls: TLSFiles = NO_TLS,
    request_timeout: float | None = None,
    rows: bool = True,
    mixed: bool = False,
) -> Exported:
    """The current weights of the running cluster at ``addresses`` (default: the job's servers), and with
    ``rows`` every row its embedding tables hold (``table:NAME:ids``, ``table:NAME:rows``).

    Each shard is first asked for its status, to check that it is the shard
    the list says (order matters) and holds the job's partition plan; then the
    weights are pulled, and the tables listed page by page, as an observer.
    Under async or while a sync round is being applied, shards may be at
    different versions: the weights are pulled again, for up to
    SAME_VERSION_SECONDS, until every shard gives one version; shards that stay
    apart (one restarted, or missed pushes) are an :class:`ExportError` naming
    each version, unless ``mixed``: then they are returned as they are.  A shard
    updated while its rows were listed is named in ``notes``.
    """
    addresses = list(addresses or config.cluster.servers)
    if not addresses:
        raise ExportError(
            "no shard addresses: pass --servers HOST:PORT,... in shard order, or a job file whose "
            "[cluster] lists servers, or --checkpoints DIR to join the shards' checkpoints"
        )
    plan = job_plan(config)
    if len(addresses) != plan.num_shards:
        raise ExportError(
            f"{len(addresses)} shard address(es) given for a job of {plan.num_shards} shard(s): "
            "list every shard's address, or pass --shards"
        )
    if request_timeout is None:
        request_timeout = config.cluster.deadlines.request_timeout
    with PSClient(
        addresses,
        plan,
        OBSERVER,
        deadlines=Deadlines(request_timeout=request_timeout),
        token=token,
        tls=tls,
        recovery=config.cluster.recovery,
    ) as client:
        problems, statuses = [], client.status()
        for k, status in enumerate(statuses):
            if status.shard != k or status.num_shards != plan.num_shards:
                problems.append(
                    f"{addresses[k]} is shard {status.shard} of {status.num_shards}, "
                    f"listed as shard {k} of {plan.num_shards}"
                )
            elif status.plan_hash != plan.hash:
                problems.append(f"shard {k} at {addresses[k]} holds plan {status.plan_hash}")
        theirs = {s.plan_hash for s in statuses}
        if (
            len(problems) == len(statuses) > 1
            and len(theirs) == 1
            and plan.hash not in theirs
            and all(s.shard == k for k, s in enumerate(statuses))
        ):
            problems = [f"every shard holds plan {theirs.pop()}"]
        if problems:
            raise ExportError(
                f"the cluster does not hold the model this job describes ({_describe_job(config, plan)}): "
                f"{'; '.join(problems)}; {JOB_HINT}, and the addresses in shard order"
            )
        weights = {s.name: np.empty(s.shape, dtype=s.dtype) for s in plan.specs}
        deadline = time.monotonic() + SAME_VERSION_SECONDS
        versions = client.pull(0, weights)
        while len(set(versions)) > 1 and not mixed and time.monotonic() < deadline:
            versions = client.pull(0, weights)  # a round or a push between two shards: taken again
        if len(set(versions)) > 1 and not mixed:
            each = ", ".join(f"shard {k}: {v}" for k, v in enumerate(versions))
            raise ExportError(
                f"the running shards are at different versions ({each}) and stayed so for "
                f"{SAME_VERSION_SECONDS:g}s (a shard that restarted from an older checkpoint, or missed "
                "pushes a worker made to the others): their weights would join different moments of "
                "training; export from --checkpoints DIR --version V, or pass --mixed-versions to join "
                "them as they are"
            )
        notes = []
        for table in plan.tables if rows else ():
            ids, values, spans = list_rows(client, table.name)
            weights.update(zip(table_keys(table.name), (ids, values)))
            notes += [
                f"shard {k} was updated while the rows of table {table.name!r} were listed (versions {a} to "
                f"{b}): they may be of different versions, and a row made or evicted meanwhile may be missing"
                for k, (a, b) in enumerate(spans)
                if a != b
            ]
    return Exported(weights, [int(v) for v in versions], f"the cluster at {','.join(addresses)}", notes=notes)


# -- from checkpoints -----------------------------------------------------------------------------
class _ShardFolder:
    """One shard's checkpoint folder: which versions it has, and which of them are intact (checked lazily)."""

    def __init__(self, root: Path, shard: int, tables: Sequence[str] = ()):
        self.shard = shard
        self.arrays = ["weights", *(f"table/{t}/{k}" for t in tables for k in ("ids", "rows"))]
        self.folder = checkpoint.shard_dir(root, shard)
        self.name = f"shard-{shard}"
        self.versions = checkpoint.versions(self.folder)
        self.damaged: dict[int, str] = {}

    def take(self, version: int) -> checkpoint.Checkpoint | None:
        """Checkpoint ``version`` with its weights and its rows of every table, or None when it is damaged (the
        reason is kept)."""
        try:
            return checkpoint.load(self.folder, version, arrays=self.arrays)
        except checkpoint.CheckpointError as exc:
            self.damaged[version] = str(exc)
            return None

    def newest_intact(self) -> checkpoint.Checkpoint | None:
        for version in self.versions:
            taken = self.take(version)
            if taken is not None:
                return taken
        return None

    def inventory(self) -> str:
        if not self.folder.is_dir():
            return f"{self.name}: no folder"
        if not self.versions:
            return f"{self.name}: no checkpoints"
        shown = [f"ckpt-{v}" + (" (damaged)" if v in self.damaged else "") for v in self.versions[:SHOWN]]
        more = len(self.versions) - SHOWN
        return f"{self.name}: " + ", ".join(shown) + (f" and {more} older" if more > 0 else "")


def join_checkpoints(
    config: JobConfig, root: str | os.PathLike, version: int | None = None, mixed: bool = False
) -> Exported:
    """Whole variables joined from the job's checkpoints in ``root``/<fingerprint>/shard-K, K = 0..shards-1.

    The fingerprint is the job's (:func:`psgd.job.fingerprint`); a ``root``
    that holds shard-K folders itself is taken as it is (a job's folder named
    directly, or checkpoints written before they were scoped to their job).
    When ``root`` holds only other jobs' checkpoints, the error names them and
    what differs.

    By default the newest intact checkpoint of each shard (a damaged newer one
    is skipped, as a restoring shard skips it, and said in ``notes``); they
    must all be of one version, unless ``mixed``.  With ``version``,
    checkpoint ``version`` of every shard.  Raises :class:`ExportError` when
    they cannot be joined, saying what each shard has.
    """
    root = Path(root)
    if not root.is_dir():
        raise ExportError(
            f"checkpoint folder {root} does not exist (it is psgd-server's --checkpoint-dir, "
            "holding <job fingerprint>/shard-0, shard-1, ...)"
        )
    plan = job_plan(config)
    root = _job_folder(config, plan, root)
    shards = [_ShardFolder(root, k, [t.name for t in plan.tables]) for k in range(plan.num_shards)]

    def inventory() -> str:
        return "; ".join(s.inventory() for s in shards)

    taken: dict[int, checkpoint.Checkpoint] = {}
    notes: list[str] = []
    if version is None:
        for s in shards:
            ckpt = s.newest_intact()
            if ckpt is not None:
                taken[s.shard] = ckpt
                took = ckpt.manifest["version"]
                notes += [
                    f"{s.name}/ckpt-{v} skipped ({s.damaged[v]}), took ckpt-{took}"
                    for v in s.versions
                    if v in s.damaged
                ]
    else:
        missing = [s.name for s in shards if version not in s.versions]
        if missing:
            raise ExportError(
                f"checkpoint version {version} is not in {', '.join(missing)} of {root} "
                f"({inventory()}); {_common_versions(shards)}"
            )
        for s in shards:
            ckpt = s.take(version)
            if ckpt is None:
                raise ExportError(
                    f"{s.folder}/ckpt-{version} is damaged: {s.damaged[version]} ({inventory()}); "
                    f"{_common_versions(shards)}"
                )
            taken[s.shard] = ckpt

    _check_plans(config, plan, root, shards, taken, inventory)
    lacking = [s for s in shards if s.shard not in taken]
    if lacking:
        why = [f"{s.name}/ckpt-{max(s.damaged)}: {s.damaged[max(s.damaged)]}" for s in lacking if s.damaged]
        raise ExportError(
            f"cannot join the checkpoints in {root}: {', '.join(s.name for s in lacking)} "
            f"{'has' if len(lacking) == 1 else 'have'} no intact checkpoint ({inventory()}"
            + (f"; {'; '.join(why)}" if why else "")
            + ")"
        )
    versions = [int(taken[s.shard].manifest["version"]) for s in shards]
    if version is None and len(set(versions)) > 1 and not mixed:
        newest = ", ".join(f"{s.name}: ckpt-{v}" for s, v in zip(shards, versions))
        raise ExportError(
            f"the newest intact checkpoints in {root} are of different versions ({newest}), as "
            "happens when shards checkpoint at different moments of training; pass --version V to "
            f"take checkpoint V of every shard ({_common_versions(shards)}), or --mixed-versions "
            "to join the newest of each shard as it is"
        )

    weights = {spec.name: np.empty(spec.shape, dtype=spec.dtype) for spec in plan.specs}
    for s in shards:
        _place(plan, s, taken[s.shard], weights)
    for spec in plan.tables:
        weights.update(_join_rows(plan, spec, shards, taken))
    files = [str(s.folder / taken[s.shard].manifest["npz"]) for s in shards]
    return Exported(weights, versions, f"checkpoints in {root}", files, notes)


def _join_rows(
    plan: PartitionPlan, spec: TableSpec, shards: Sequence[_ShardFolder], taken: Mapping[int, checkpoint.Checkpoint]
) -> dict[str, np.ndarray]:
    """Every shard's rows of table ``spec``, joined by increasing id (:func:`psgd.model.table.table_keys`)."""
    ids, rows = [], []
    for s in shards:
        a = taken[s.shard].arrays
        mine, values = a.get(f"table/{spec.name}/ids"), a.get(f"table/{spec.name}/rows")
        if (
            mine is None
            or values is None
            or mine.ndim != 1
            or values.shape != (mine.size, spec.dim)
            or (plan.shard_of_ids(spec.name, mine) != s.shard).any()
        ):
            raise ExportError(
                f"{taken[s.shard].path.with_suffix('.npz')} holds no rows of table {spec.name!r} that "
                f"fit the plan (ids of {s.name}'s, rows of {spec.dim} values)"
            )
        ids.append(mine)
        rows.append(values)
    joined, values = joined_by_id(ids, rows, spec.dim)
    key_ids, key_rows = table_keys(spec.name)
    return {key_ids: joined, key_rows: values.astype(spec.dtype)}


def _job_folder(config: JobConfig, plan: PartitionPlan, root: Path) -> Path:
    """Where ``job``'s checkpoints are in ``root``: ``root/<fingerprint>``, or ``root`` itself when it holds
    shard-K folders; refuses, naming them and what differs, when only other jobs' checkpoints are there."""
    mine = identity(config, plan.hash, bool(plan.tables))
    name = fingerprint(mine)
    folder = root / name
    if folder.is_dir():
        return folder
    if any(checkpoint.shard_dir(root, k).is_dir() for k in range(plan.num_shards)):
        return root
    found: dict[str, checkpoint.Other] = {}
    for k in range(plan.num_shards):
        for other in checkpoint.others(root, k, name):
            if other.fingerprint:
                found.setdefault(other.fingerprint, other)
    if not found:
        return folder  # nothing there: said shard by shard ("no folder")
    them = "another job" if len(found) == 1 else "other jobs"
    said = f"no checkpoints of this job (fingerprint {name}) in {root}, only of {them}: " + ", ".join(
        other.describe(mine, plan.hash) for other in found.values()
    )
    same = [f for f, other in found.items() if (other.manifest or {}).get("plan_hash") == plan.hash]
    if same:
        raise ExportError(
            f"{said}; job {same[0]} has this job's partition plan: pass the job file or flags it was "
            f"trained with, or --checkpoints {root / same[0]} to join its checkpoints as they are"
        )
    newest = max(found.values(), key=lambda o: (o.manifest or {}).get("written_at", 0))
    theirs = (newest.manifest or {}).get("plan")
    why = plan_differences(plan.description(), theirs, "job", "checkpoints") if isinstance(theirs, dict) else ""
    raise ExportError(
        f"{said}; job {newest.fingerprint}'s were written for partition plan "
        f"{(newest.manifest or {}).get('plan_hash')}, this job describes {_describe_job(config, plan)}"
        + (f" ({why})" if why else "")
        + f": {JOB_HINT}"
    )


def _common_versions(shards: Sequence[_ShardFolder]) -> str:
    common = set.intersection(*(set(s.versions) - set(s.damaged) for s in shards)) if shards else set()
    if not common:
        return "no version is in every shard"
    newest = sorted(common, reverse=True)
    more = f" and {len(newest) - SHOWN} older" if len(newest) > SHOWN else ""
    return "every shard has " + ", ".join(str(v) for v in newest[:SHOWN]) + more


def _check_plans(
    config: JobConfig,
    plan: PartitionPlan,
    root: Path,
    shards: Sequence[_ShardFolder],
    taken: Mapping[int, checkpoint.Checkpoint],
    inventory,
) -> None:
    """Refuse checkpoints of several plans, or of a plan other than the job's, or in the wrong folder."""
    hashes = {k: c.manifest.get("plan_hash") for k, c in taken.items()}
    if len(set(hashes.values())) > 1:
        each = ", ".join(f"shard-{k}/ckpt-{taken[k].manifest['version']}: plan {h}" for k, h in sorted(hashes.items()))
        raise ExportError(
            f"the checkpoints in {root} were written for different partition plans ({each}; this job "
            f"has plan {plan.hash}): they are not from one job (was the folder reused?); "
            f"pass --version V to pick checkpoints of one job ({inventory()})"
        )
    if hashes and next(iter(hashes.values())) != plan.hash:
        k, ckpt = next(iter(sorted(taken.items())))
        theirs = ckpt.manifest.get("plan")
        why = plan_differences(plan.description(), theirs, "job", "checkpoints") if isinstance(theirs, dict) else ""
        raise ExportError(
            f"the checkpoints in {root} were written for partition plan {hashes[k]}, this job "
            f"describes {_describe_job(config, plan)}" + (f" ({why})" if why else "") + f": {JOB_HINT}"
        )
    for k, ckpt in taken.items():
        if ckpt.manifest.get("shard", k) != k:
            raise ExportError(
                f"{ckpt.path} says it is shard {ckpt.manifest.get('shard')}'s, but it lies in "
                f"{shards[k].folder}: was it copied into the wrong folder?"
            )


def _place(
    plan: PartitionPlan, shard: _ShardFolder, ckpt: checkpoint.Checkpoint, weights: dict[str, np.ndarray]
) -> None:
    """Copy one shard's flat weights (its slices in slice-id order) into the whole variables."""
    slices = plan.slices_for_shard(shard.shard)
    flat = ckpt.arrays.get("weights")
    size = sum(s.size for s in slices)
    dtype = slices[0].dtype if slices else None
    if flat is None or flat.ndim != 1 or flat.size != size or (dtype and flat.dtype != np.dtype(dtype)):
        got = "no weights" if flat is None else f"weights of shape {flat.shape} {flat.dtype}"
        raise ExportError(
            f"{ckpt.path.with_suffix('.npz')} holds {got}; the plan gives {shard.name} {size} values of {dtype}"
        )
    at = 0
    for s in slices:
        weights[s.var].reshape(-1)[s.start : s.stop] = flat[at : at + s.size]
        at += s.size
