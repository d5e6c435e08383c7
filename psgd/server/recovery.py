"""What of a shard goes into its checkpoints and how a shard comes back from them; the files themselves (their
format, their names, writing them so a crash leaves the previous one whole) are :mod:`psgd.server.checkpoint`'s.

:func:`write` takes a checkpoint of a :class:`~psgd.server.core.ShardCore` (weights, optimizer state, the policy,
a sync round in the making, counters, who holds which rank); :func:`restore` puts one back before the shard
serves; :func:`resume` finds the newest intact one of this job, or refuses another job's; :func:`rollback` takes a
serving shard back to a cut (sync with checkpoint_rounds: every shard's checkpoint of one version), and :func:`cuts`
lists the ones it holds.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from psgd.logs import Quieted
from psgd.server import checkpoint
from psgd.server.core import STALENESS_BUCKETS, ShardCore
from psgd.server.errors import ShardError
from psgd.wire.sweep import all_finite

log = logging.getLogger(__name__)


def write(core: ShardCore, folder, keep: int = 3, force: bool = False):
    """Write a checkpoint of ``core`` into ``folder`` (nothing when unchanged since the last one).

    Written under the core's lock, straight from the live arrays: consistent, and
    no second copy of the weights in memory; training pauses meanwhile.
    Raises CheckpointError when the disk refuses (the previous one stays).
    """
    with core.lock:
        core.store.settle()  # no update half made: the policy's clocks and the weights say the same
        return write_held(core, folder, keep, force)


#: the largest version a checkpoint may say (a shard's counters and the wire's int64 hold it)
MAX_VERSION = 2**62
#: A shard goes back for a new cause at most once in this many seconds (a worker asked to wait retries): a shard
#: restarts from a cut in seconds, and a storm of made-up causes cannot hold the job at one version.
ROLLBACK_SPACING = 1.0
#: The longest cause a rollback may give (a shard's incarnation is 12 characters).
MAX_CAUSE = 64
#: seconds between two lines saying that checkpoints go on failing
FAILURES_SAID_EVERY = 60.0


class Failures:
    """How a shard says that its checkpoints fail (a full disk): the first failure at once, then at most one line a
    minute with how many more (the core counts each: checkpoint_failures), and once when one is written again.  A
    cut that fails ([cluster] checkpoint_rounds) stops the job where ``stop`` ([cluster] on_cut_failure = "stop"):
    the shard refuses every call from then on, saying why; else the job goes on, said once, without the guarantee
    that a restarted shard loses nothing."""

    def __init__(self, core: ShardCore, stop: bool = True):
        self.core, self.shard, self.stop = core, core.shard, stop
        self.in_a_row = 0                    # failures since the last checkpoint written
        self._said = Quieted(FAILURES_SAID_EVERY)
        self._went_on = False                # a failed cut was said to be gone on from

    def failed(self, exc: Exception, cut: bool = False) -> None:
        """``cut``: the checkpoint was a cut (a shard that halts refuses the calls that come next)."""
        self.in_a_row += 1
        if cut and self.stop and not self.core.halted:
            self.core.halted = (f"shard {self.shard} could not write its cut at version {self.core.version} ({exc}), "
                                "so the job stops ([cluster] on_cut_failure = \"stop\"): make room and start it again "
                                "(it resumes from the cuts), or set on_cut_failure = \"continue\" to go on without "
                                "them")
            log.error("%s", self.core.halted)
            return
        if cut and not self.stop and not self._went_on:
            self._went_on = True
            log.warning("shard %d: a cut failed and the job goes on ([cluster] on_cut_failure = \"continue\"): a "
                        "shard that restarts now may not find a cut every shard holds, and the rounds since the last "
                        "one would be lost", self.shard)
        unsaid = self._said.due()
        if unsaid is not None:
            more = f" ({unsaid} more failed since the last line)" if unsaid else ""
            log.error("shard %d: %s%s; the failures that follow are said at most once a minute", self.shard, exc,
                      more)

    def written(self, path: object) -> None:
        if self.in_a_row:
            log.warning("shard %d: checkpoints are written again (%s), after %d failed in a row", self.shard,
                        path or "none needed", self.in_a_row)
        self.in_a_row = 0
        self._said.reset()


def write_held(core: ShardCore, folder, keep: int = 3, force: bool = False):
    """:func:`write`, by a caller that holds the core's lock with no update half made (a sync round's cut, as it
    closes)."""
    if not force and core.last_checkpoint and core.last_checkpoint[0] == core.version:
        return None
    arrays, manifest = state(core)
    try:
        path = checkpoint.save(folder, core.version, arrays, manifest, keep)
    except checkpoint.CheckpointError:
        core.counters["checkpoint_failures"] = core.counters.get("checkpoint_failures", 0) + 1
        raise
    core.last_checkpoint = (core.version, time.time())
    return path


def state(core: ShardCore) -> tuple[dict, dict]:
    """What a checkpoint of ``core`` holds (under its lock, no update half made: WeightStore.settle): its arrays
    (views of the live ones) and manifest; also what a primary sends a new replica (psgd.server.replica)."""
    arrays = {"weights": core.flat}
    arrays.update({f"opt/{k}": v for k, v in core.optimizer.state_dict().items()})
    if core.round is not None:  # a round in flight: its sum, and the pushes an ordered one keeps apart, apart
        arrays["round_sum"] = core.round.so_far()
        arrays.update({f"round_push/{w}": a for w, a in core.round.apart.items()})
    arrays.update(core.tables.arrays())
    manifest = {"fingerprint": core.fingerprint, "identity": core.identity, "version": core.version,
                "shard": core.shard, "plan_hash": core.plan.hash, "plan": core.plan.description(),
                "policy": core.policy.state_dict(), "counters": dict(core.counters),
                "staleness_histogram": list(core.staleness_histogram),
                "round_bases": list(core.round.bases) if core.round else [],
                "optimizer": core.optimizer.describe(),
                "holders": core.roster.holders()}
    return arrays, manifest


def check(core: ShardCore, ckpt: checkpoint.Checkpoint) -> None:
    """Whether ``ckpt`` may be given to ``core``: its job and shard, its version (a whole number, the one its file
    is named for), the shapes of its weights, optimizer state and round in flight, and every value finite.  Raises
    :class:`CheckpointError` saying what does not hold (a file edited and hashed again passes every checksum)."""
    m, a = ckpt.manifest, ckpt.arrays
    if m.get("fingerprint", core.fingerprint) != core.fingerprint or m.get("shard", core.shard) != core.shard:
        raise checkpoint.CheckpointError(f"it is shard {m.get('shard')}'s of job {m.get('fingerprint')}, this is "
                                         f"shard {core.shard} of job {core.fingerprint}")
    version = m.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise checkpoint.CheckpointError(f"its version {version!r} is not a whole number from 0 to 2^62")
    if ckpt.path.name != f"ckpt-{version}.json":
        raise checkpoint.CheckpointError(f"its manifest says version {version}, its file is {ckpt.path.name}")
    weights = a.get("weights")
    if weights is None or weights.shape != core.flat.shape or weights.dtype != core.flat.dtype:
        raise checkpoint.CheckpointError(f"its weights do not fit shard {core.shard} ({core.flat.size} values of "
                                         f"{core.flat.dtype})")
    sizes = {s.key: s.size for s in core.slices.values()}
    for name, array in a.items():
        if name.startswith("opt/"):
            key, _, field = name[4:].rpartition("::")
            if key not in sizes or (field != "t" and array.shape != (sizes[key],)):
                raise checkpoint.CheckpointError(f"its optimizer state {name!r} ({array.shape}) does not fit a "
                                                 f"slice of shard {core.shard}")
        elif name == "round_sum" or name.startswith("round_push/"):
            if array.shape != core.flat.shape:
                raise checkpoint.CheckpointError(f"its round in flight {name!r} does not fit shard {core.shard}")
        if array.dtype.kind == "f" and not all_finite(array.reshape(-1)):
            raise checkpoint.CheckpointError(f"its {name!r} holds non-finite values (NaN or infinity)")
    if not all(isinstance(b, int) and 0 <= b <= version for b in m.get("round_bases", [])):
        raise checkpoint.CheckpointError("its round in flight has a base version outside 0 to its version")


def restore(core: ShardCore, ckpt: checkpoint.Checkpoint) -> None:
    """Give ``core`` the state of a checkpoint loaded by :func:`checkpoint.load_latest` (before it serves), once
    :func:`check` passes it."""
    m = ckpt.manifest
    try:
        check(core, ckpt)
    except checkpoint.CheckpointError as exc:
        raise checkpoint.CheckpointError(f"{ckpt.path}: {exc}") from None
    with core.lock:
        adopt(core, ckpt)
        core.restored_version = core.version
        core.last_checkpoint = (core.version, float(m.get("written_at", time.time())))
    log.info("shard %d: restored version %d from %s", core.shard, core.version, ckpt.path)


def adopt(core: ShardCore, ckpt: checkpoint.Checkpoint) -> None:
    """Everything of ``ckpt`` (or of a primary's :func:`state`, on its replica) into ``core``, under its lock: the
    training state (:func:`put_back`), the counters, the staleness histogram, and each rank kept for its holder."""
    m = ckpt.manifest
    put_back(core, ckpt)
    core.counters.update({k: type(core.counters[k])(v) for k, v in m.get("counters", {}).items() if k in core.counters})
    core.staleness_histogram[:] = [int(v) for v in m["staleness_histogram"]][:STALENESS_BUCKETS]
    core.roster.keep_for(m.get("holders", {}))


def put_back(core: ShardCore, ckpt: checkpoint.Checkpoint) -> None:
    """The training state of ``ckpt`` (or of a primary's :func:`state`) into ``core`` (under its lock): weights,
    optimizer, policy, the round in the making, tables, version.  Who holds which rank, the counters and the leases
    stay the caller's."""
    m, a = ckpt.manifest, ckpt.arrays
    weights = a.get("weights")
    if weights is None or weights.shape != core.flat.shape or weights.dtype != core.flat.dtype:
        raise checkpoint.CheckpointError(f"{ckpt.path}: its weights do not fit shard {core.shard}")
    core.store.replace(weights)
    core.optimizer.load_state_dict({k[4:]: v for k, v in a.items() if k.startswith("opt/")})
    core.policy.load_state_dict(m["policy"])
    if core.round is not None:
        core.round.clear()
        if "round_sum" in a:
            core.round.load(a["round_sum"], m.get("round_bases", []),
                            {int(k.split("/")[1]): v for k, v in a.items() if k.startswith("round_push/")})
    if core.tables:
        core.tables.load(a)
    core.version = int(m["version"])


def cuts(core: ShardCore, folder: str | os.PathLike) -> list[int]:
    """The versions ``core`` could go back to: its checkpoints in ``folder`` no later than its version (under
    sync with checkpoint_rounds each is a cut), newest first."""
    return [v for v in checkpoint.versions(folder) if v <= core.version]


def rollback(core: ShardCore, folder: str | os.PathLike, version: int, cause: str, worker: int,
             unproven: Callable[[], str] = lambda: "") -> int:
    """Go back to the cut at ``version`` (this shard's checkpoint of it in ``folder``) because of ``cause`` (the
    incarnation of a shard that restarted from it), once per cause however many workers ask; every worker then
    continues from ``version`` (:func:`rewind_workers`).  Returns the rounds undone; refuses
    (FAILED_PRECONDITION) where ``unproven()`` says why the cause cannot be believed (a new cause is checked, with
    the shard that restarted: :func:`psgd.server.peers.restart_of`), or this shard is behind the cut or holds no
    intact checkpoint of it."""
    if not cause or len(cause) > MAX_CAUSE or not cause.isprintable():
        raise ShardError("INVALID_ARGUMENT", f"a rollback must give its cause, the incarnation of the shard that "
                         f"restarted (at most {MAX_CAUSE} printable characters)")
    with core.lock:
        if cause in core.rollback_causes:
            return 0
    why = unproven()  # outside the lock: it may ask another shard
    if why:
        raise ShardError("FAILED_PRECONDITION", f"shard {core.shard} does not go back to version {version} for a "
                         f"restart it cannot check: {why}")
    with core.lock:
        if cause in core.rollback_causes:
            return 0
        last = max(core.rollback_causes.values(), default=None)
        if last is not None and time.monotonic() - last < ROLLBACK_SPACING:
            raise ShardError("UNAVAILABLE", f"shard {core.shard} went back for another cause "
                             f"{time.monotonic() - last:.2f}s ago; it goes back at most once a {ROLLBACK_SPACING:g}s")
        if core.version < version:
            raise ShardError("FAILED_PRECONDITION", f"shard {core.shard} is at version {core.version}, behind the cut "
                             f"at {version} that worker {worker} asks it to go back to")
        if core.version == version:  # there already (the shard that restarted, or one that never went past it)
            core.rollback_causes[cause] = time.monotonic()
            rewind_workers(core, version)
            core.changed.notify_all()
            return 0
    try:  # read and checked outside the lock: the shard serves meanwhile (under sync nobody can go on)
        ckpt = checkpoint.load(folder, version, core.plan.hash, fingerprint=core.fingerprint)
        check(core, ckpt)
    except checkpoint.CheckpointError as exc:
        raise ShardError("FAILED_PRECONDITION", f"shard {core.shard} cannot go back to the cut at version {version}: "
                         f"{exc}") from None
    with core.lock:
        if cause in core.rollback_causes:
            return 0
        undone = core.version - version
        put_back(core, ckpt)
        core.rollback_causes[cause] = time.monotonic()
        rewind_workers(core, version)
        core.counters["rollbacks"] += 1
        core.counters["rounds_undone"] += undone
        core.counters["applied"] -= undone  # the updates the weights hold: the version
        core.changed.notify_all()
    log.info("shard %d: went back %d round(s) to the cut at version %d, as worker %d asked (a shard restarted "
             "from it, incarnation %s)", core.shard, undone, version, worker, cause)
    return undone


def resume(core: ShardCore, root: str | os.PathLike, fresh: bool = False) -> None:
    """Start shard ``core`` from its newest intact checkpoint under ``root`` (``root/<fingerprint>/shard-K``),
    or from its initial weights when it has none.  When ``root`` holds only this shard's checkpoints of
    other jobs, refuse (:class:`CheckpointError`) unless ``fresh``: resuming them would train another job's
    model, and starting over silently would look like a resume."""
    folder = checkpoint.shard_dir(root, core.shard, core.fingerprint)
    checkpoint.remove_leftovers(folder)
    saved = checkpoint.load_latest(folder, core.plan.hash, core.fingerprint, check=lambda c: check(core, c))
    if saved is not None:
        restore(core, saved)
        return
    mine = checkpoint.owned(folder, core.fingerprint, core.shard)
    if mine and not fresh:
        raise checkpoint.CheckpointError(
            f"shard {core.shard}: none of its {len(mine)} checkpoint(s) in {folder} passed (each said above why): "
            "starting from the initial weights would look like a resume; pass --fresh to start from them (the files "
            "are left alone), or restore an intact checkpoint there")
    if mine:
        log.warning("--fresh: none of the %d checkpoint(s) in %s passed (above): starting from the initial weights",
                    len(mine), folder)
        return
    found = checkpoint.others(root, core.shard, core.fingerprint)
    if found and not fresh:
        theirs = ", ".join(o.describe(core.identity, core.plan.hash) for o in found)
        raise checkpoint.CheckpointError(
            f"shard {core.shard}: {root} holds no checkpoint of this job (fingerprint {core.fingerprint}) but shard "
            f"{core.shard}'s checkpoints of {'another job' if len(found) == 1 else 'other jobs'}: {theirs}; to "
            "resume from them, start this shard with the job they were written for; to start this job from its "
            "initial weights, pass --fresh (their files are left alone) or another --checkpoint-dir")
    if found:
        log.warning("--fresh: starting from the initial weights, into %s; the checkpoints of %s are left alone",
                    folder, ", ".join(f"job {o.fingerprint}" if o.fingerprint else str(o.folder) for o in found))
    else:
        log.info("no checkpoint of this job in %s: starting from the initial weights", folder)


def rewind_workers(core: ShardCore, version: int) -> None:
    """Every worker continues from ``version`` (a cut gone back to): a request with a later clock is refused with
    ROLLED_BACK, naming it, until the worker comes with one no later.  Under the core's lock."""
    core.rewinding = {w: version for w in range(core.num_workers)}
