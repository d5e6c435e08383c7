"""What of a shard goes into its checkpoints and how a shard comes back from them; the files themselves (their
format, their names, writing them so a crash leaves the previous one whole) are :mod:`psgd.server.state.checkpoint`'s.

:func:`write` takes a checkpoint of a :class:`~psgd.server.state.core.ShardCore` (weights, optimizer state, the policy,
a sync round in the making, counters, who holds which rank); :func:`restore` puts one back before the shard
serves; :func:`resume` finds the newest intact one of this job, or refuses another job's; :func:`rollback` takes a
serving shard back to a cut (sync with checkpoint_rounds: every shard's checkpoint of one version), and :func:`cuts`
lists the ones it holds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from psgd.observe.logs import Quieted
from psgd.server.errors import ShardError
from psgd.server.state import checkpoint
from psgd.server.state.core import ShardCore
from psgd.wire.sweep import all_finite

log = logging.getLogger(__name__)


def write(core: ShardCore, folder, keep: int = 3, force: bool = False, held: bool = False, key: bytes | None = None):
    """Write a checkpoint of ``core`` into ``folder`` (nothing when unchanged since the last one), keeping the
    newest ``keep`` (:meth:`ShardCore.write_checkpoint`: under the core's lock, which ``held`` says the caller holds
    already: a sync round's cut, as it closes), signed with ``key`` (:func:`checkpoint.signing_key`).  Raises
    CheckpointError when the disk refuses (the previous one stays)."""
    return core.write_checkpoint(
        lambda version, arrays, manifest: checkpoint.save(folder, version, arrays, manifest, keep, key),
        held=held,
        force=force,
    )


#: the largest version a checkpoint may say (a shard's counters and the wire's int64 hold it)
MAX_VERSION = 2**62
#: The longest cause a rollback may give (a shard's incarnation is 12 characters).
MAX_CAUSE = 64
#: seconds between two lines saying that checkpoints go on failing
FAILURES_SAID_EVERY = 60.0
#: seconds between two lines saying that rollbacks for restarts nobody proved go on being refused
REFUSALS_SAID_EVERY = 60.0


class Failures:
    """How a shard says that its checkpoints fail (a full disk): the first failure at once, then at most one line a
    minute with how many more (the core counts each: checkpoint_failures), and once when one is written again.  A
    cut that fails ([cluster] checkpoint_rounds) stops the job where ``stop`` ([cluster] on_cut_failure = "stop"):
    the shard refuses every call from then on, saying why; else the job goes on, said once, without the guarantee
    that a restarted shard loses nothing."""

    def __init__(self, core: ShardCore, stop: bool = True):
        self.core, self.shard, self.stop = core, core.shard, stop
        self.in_a_row = 0  # failures since the last checkpoint written
        self._said = Quieted(FAILURES_SAID_EVERY)
        self._went_on = False  # a failed cut was said to be gone on from

    def failed(self, exc: Exception, cut: bool = False) -> None:
        """``cut``: the checkpoint was a cut (a shard that halts refuses the calls that come next)."""
        self.in_a_row += 1
        if cut and self.stop and not self.core.halted:
            self.core.halted = (
                f"shard {self.shard} could not write its cut at version {self.core.version} ({exc}), "
                "so the job stops ([cluster] on_cut_failure = \"stop\"): make room and start it again "
                "(it resumes from the cuts), or set on_cut_failure = \"continue\" to go on without "
                "them"
            )
            log.error("%s", self.core.halted)
            return
        if cut and not self.stop and not self._went_on:
            self._went_on = True
            log.warning(
                "shard %d: a cut failed and the job goes on ([cluster] on_cut_failure = \"continue\"): a "
                "shard that restarts now may not find a cut every shard holds, and the rounds since the last "
                "one would be lost",
                self.shard,
            )
        unsaid = self._said.due()
        if unsaid is not None:
            more = f" ({unsaid} more failed since the last line)" if unsaid else ""
            log.error("shard %d: %s%s; the failures that follow are said at most once a minute", self.shard, exc, more)

    def written(self, path: object) -> None:
        if self.in_a_row:
            log.warning(
                "shard %d: checkpoints are written again (%s), after %d failed in a row",
                self.shard,
                path or "none needed",
                self.in_a_row,
            )
        self.in_a_row = 0
        self._said.reset()


class Refusals:
    """How a shard says that it refused to go back for a restart it could not check (:func:`rollback`): one ERROR
    line naming the worker that asked, where it called from and what it claimed, the first at once, then at most
    one a minute with how many more (the core counts each: rollbacks_refused).  A restart of the job's own proves
    itself (unless the shard that restarted does not answer in time): the worker named made up what it claimed,
    as a storm of them would take the whole job back once a second."""

    def __init__(self, core: ShardCore):
        self.core = core
        self._said = Quieted(REFUSALS_SAID_EVERY)

    def refused(self, worker: int, peer: str, version: int, cause: str, why: str) -> None:
        self.core.count("rollbacks_refused")
        unsaid = self._said.due()
        if unsaid is not None:
            more = f" ({unsaid} more refused since the last line)" if unsaid else ""
            log.error(
                "shard %d: refused worker %d (calling from %s) a rollback to version %d for the restart of "
                "incarnation %r: %s%s; further refusals are said at most once a minute",
                self.core.shard,
                worker,
                peer[:100] or "?",
                version,
                cause[:MAX_CAUSE],
                why,
                more,
            )


def check(core: ShardCore, ckpt: checkpoint.Checkpoint) -> None:
    """Whether ``ckpt`` may be given to ``core``: its job and shard, its version (a whole number, the one its file
    is named for), the shapes of its weights, optimizer state and round in flight, and every value finite.  Raises
    :class:`CheckpointError` saying what does not hold (a file edited and hashed again passes every checksum)."""
    m, a = ckpt.manifest, ckpt.arrays
    if m.get("fingerprint", core.fingerprint) != core.fingerprint or m.get("shard", core.shard) != core.shard:
        raise checkpoint.CheckpointError(
            f"it is shard {m.get('shard')}'s of job {m.get('fingerprint')}, this is "
            f"shard {core.shard} of job {core.fingerprint}"
        )
    version = m.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise checkpoint.CheckpointError(f"its version {version!r} is not a whole number from 0 to 2^62")
    if ckpt.path.name != f"ckpt-{version}.json":
        raise checkpoint.CheckpointError(f"its manifest says version {version}, its file is {ckpt.path.name}")
    weights = a.get("weights")
    if weights is None or weights.shape != core.flat.shape or weights.dtype != core.flat.dtype:
        raise checkpoint.CheckpointError(
            f"its weights do not fit shard {core.shard} ({core.flat.size} values of {core.flat.dtype})"
        )
    sizes = {s.key: s.size for s in core.slices.values()}
    for name, array in a.items():
        if name.startswith("opt/"):
            key, _, field = name[4:].rpartition("::")
            if key not in sizes or (field != "t" and array.shape != (sizes[key],)):
                raise checkpoint.CheckpointError(
                    f"its optimizer state {name!r} ({array.shape}) does not fit a slice of shard {core.shard}"
                )
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
    try:
        check(core, ckpt)
    except checkpoint.CheckpointError as exc:
        raise checkpoint.CheckpointError(f"{ckpt.path}: {exc}") from None
    core.adopt(ckpt, restored=True)
    log.info("shard %d: restored version %d from %s", core.shard, core.version, ckpt.path)


def cuts(core: ShardCore, folder: str | os.PathLike) -> list[int]:
    """The versions ``core`` could go back to: its checkpoints in ``folder`` no later than its version (under
    sync with checkpoint_rounds each is a cut), newest first."""
    return [v for v in checkpoint.versions(folder) if v <= core.version]


def own_restart(core: ShardCore, version: int) -> str:
    """Why ``core`` cannot go back to the cut at ``version`` for its own incarnation ("": it restarted from a cut
    at ``version`` or later)."""
    restored = core.whole.restored_version
    if restored is not None and restored >= version:
        return ""
    return (
        f"the cause is shard {core.shard}'s own incarnation, and it did not restart from a cut at version "
        f"{version} or later (it started from {'none' if restored is None else f'the cut at {restored}'})"
    )


def rollback(
    core: ShardCore,
    folder: str | os.PathLike,
    version: int,
    cause: str,
    worker: int,
    unproven: Callable[[], str] = lambda: "",
    key: bytes | None = None,
    refusals: Refusals | None = None,
    peer: str = "",
) -> int:
    """Go back to the cut at ``version`` (this shard's checkpoint of it in ``folder``) because of ``cause`` (the
    incarnation of a shard that restarted from it), once per cause however many workers ask; every worker then
    continues from ``version`` (:meth:`ShardCore.go_back`).  Returns the rounds undone; refuses
    (FAILED_PRECONDITION) where ``unproven()`` says why the cause cannot be believed (a new cause is checked: this
    shard's own restart, :func:`own_restart`, or another shard's of the job,
    :func:`psgd.server.durable.peers.restart_of`), said by ``refusals`` naming worker ``worker`` calling from ``peer``;
    or where this shard is behind the cut or holds no intact checkpoint of it (signed with ``key``, where given).  An
    incarnation justifies one rollback: it is never gone back for twice."""
    if not cause or len(cause) > MAX_CAUSE or not cause.isprintable():
        raise ShardError(
            "INVALID_ARGUMENT",
            f"a rollback must give its cause, the incarnation of the shard that "
            f"restarted (at most {MAX_CAUSE} printable characters)",
        )
    if core.went_back_for(cause):
        return 0
    why = unproven()  # it may ask the job's other shards
    if why:
        if refusals is not None:
            refusals.refused(worker, peer, version, cause, why)
        raise ShardError(
            "FAILED_PRECONDITION",
            f"shard {core.shard} does not go back to version {version} for a restart it cannot check: {why}",
        )

    def load() -> checkpoint.Checkpoint:
        try:
            ckpt = checkpoint.load(folder, version, core.plan.hash, fingerprint=core.fingerprint, key=key)
            check(core, ckpt)
        except checkpoint.CheckpointError as exc:
            raise ShardError(
                "FAILED_PRECONDITION", f"shard {core.shard} cannot go back to the cut at version {version}: {exc}"
            ) from None
        return ckpt

    undone = core.go_back(version, cause, worker, load)
    if not undone:
        return 0
    log.info(
        "shard %d: went back %d round(s) to the cut at version %d, as worker %d asked (a shard restarted "
        "from it, incarnation %s)",
        core.shard,
        undone,
        version,
        worker,
        cause,
    )
    return undone


def resume(core: ShardCore, root: str | os.PathLike, fresh: bool = False, key: bytes | None = None) -> None:
    """Start shard ``core`` from its newest intact checkpoint under ``root`` (``root/<fingerprint>/shard-K``),
    signed with ``key`` where given (:func:`checkpoint.signing_key`), or from its initial weights when it has
    none.  When ``root`` holds only this shard's checkpoints of
    other jobs, refuse (:class:`CheckpointError`) unless ``fresh``: resuming them would train another job's
    model, and starting over silently would look like a resume."""
    folder = checkpoint.shard_dir(root, core.shard, core.fingerprint)
    checkpoint.remove_leftovers(folder)
    saved = checkpoint.load_latest(folder, core.plan.hash, core.fingerprint, check=lambda c: check(core, c), key=key)
    if saved is not None:
        restore(core, saved)
        return
    mine = checkpoint.owned(folder, core.fingerprint, core.shard)
    if mine and not fresh:
        raise checkpoint.CheckpointError(
            f"shard {core.shard}: none of its {len(mine)} checkpoint(s) in {folder} passed (each said above why): "
            "starting from the initial weights would look like a resume; pass --fresh to start from them (the files "
            "are left alone), or restore an intact checkpoint there"
        )
    if mine:
        log.warning(
            "--fresh: none of the %d checkpoint(s) in %s passed (above): starting from the initial weights",
            len(mine),
            folder,
        )
        return
    found = checkpoint.others(root, core.shard, core.fingerprint)
    if found and not fresh:
        theirs = ", ".join(o.describe(core.identity, core.plan.hash) for o in found)
        raise checkpoint.CheckpointError(
            f"shard {core.shard}: {root} holds no checkpoint of this job (fingerprint {core.fingerprint}) but shard "
            f"{core.shard}'s checkpoints of {'another job' if len(found) == 1 else 'other jobs'}: {theirs}; to "
            "resume from them, start this shard with the job they were written for; to start this job from its "
            "initial weights, pass --fresh (their files are left alone) or another --checkpoint-dir"
        )
    if found:
        log.warning(
            "--fresh: starting from the initial weights, into %s; the checkpoints of %s are left alone",
            folder,
            ", ".join(f"job {o.fingerprint}" if o.fingerprint else str(o.folder) for o in found),
        )
    else:
        log.info("no checkpoint of this job in %s: starting from the initial weights", folder)
