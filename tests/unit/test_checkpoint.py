"""Shard checkpoints: atomic, checksummed, restorable, and safe when the disk is full."""

import errno
import json
import logging
import os

import numpy as np
import pytest
from helpers import skip_or_fail

from psgd.model.base import VarSpec
from psgd.optim import build_optimizer
from psgd.partition import PartitionPlan
from psgd.policy import make_policy
from psgd.server.durable import recovery
from psgd.server.state import checkpoint
from psgd.server.state.core import ShardCore

PLAN = PartitionPlan([VarSpec("w", (12,), "float64"), VarSpec("b", (3,), "float64")], 1, slice_bytes=64)


def make(policy="sync", workers=2, registered=None):
    """A shard core of ``workers`` workers, the first ``registered`` of them (all) registered."""
    values = {s.id: np.arange(s.start, s.stop, dtype=np.float64) for s in PLAN.slices}
    core = ShardCore(
        PLAN, 0, values, build_optimizer("momentum", lr=0.1), make_policy(policy, workers), num_workers=workers
    )
    for w in range(workers if registered is None else registered):
        core.register(w, PLAN.hash)
    return core


def grads(seed):
    rng = np.random.default_rng(seed)
    return {s.id: rng.standard_normal(s.size) for s in PLAN.slices}


def test_restore_continues_exactly_like_an_uninterrupted_shard(tmp_path):
    a = make()
    for clock in range(3):
        a.push(0, clock, a.version, grads(clock))
        a.push(1, clock, a.version, grads(10 + clock))
    a.push(0, 3, a.version, grads(3))  # the open round 3 holds worker 0's gradient
    path = recovery.write(a, tmp_path, keep=3)
    assert path.name == "ckpt-3.json" and recovery.write(a, tmp_path) is None  # unchanged: nothing written

    b = make()
    saved = checkpoint.load_latest(tmp_path, PLAN.hash)
    recovery.restore(b, saved)
    assert b.version == 3 and b.whole.restored_version == 3 and np.array_equal(a.flat, b.flat)
    for core in (a, b):  # worker 0's earlier push is in the restored round: a retry is a duplicate
        assert core.push(0, 3, 3, grads(3)).outcome == "duplicate"
        core.push(1, 3, 3, grads(13))
        core.push(0, 4, 4, grads(4))
        core.push(1, 4, 4, grads(14))
    assert a.version == b.version == 5
    np.testing.assert_array_equal(a.flat, b.flat)  # momentum state and round sum came back exactly
    manifest = json.loads(path.read_text())
    assert manifest["plan_hash"] == PLAN.hash and manifest["policy"]["applied_rounds"] == 3


def test_a_shard_restored_after_its_workers_left_waits_for_each_of_them_again(tmp_path):
    """A stopped job's workers leave before the shards write their last checkpoint, which then names no worker live.
    A shard restored from it (psgd launch --resume, psgd run --resume) closed each sync round with the workers
    that had registered so far: the first to come back trained alone until the other joined, which then skipped
    the rounds between (worker 0 came back at clock 20 after worker 1 at 3).  Like a new shard, it expects them
    all until they register or their join deadline passes."""
    a = make()
    for clock in range(3):
        a.push(0, clock, a.version, grads(clock))
        a.push(1, clock, a.version, grads(10 + clock))
    a.done(0, 3)
    a.done(1, 3)
    recovery.write(a, tmp_path, keep=3)
    b = make(registered=0)
    recovery.restore(b, checkpoint.load_latest(tmp_path, PLAN.hash))
    assert b.register(1, PLAN.hash, clock=3) == 3
    b.push(1, 3, 3, grads(13))
    assert b.version == 3  # round 3 waits for worker 0
    assert b.register(0, PLAN.hash, clock=3) == 3
    b.push(0, 3, 3, grads(3))
    assert b.version == 4


def test_only_the_newest_are_kept(tmp_path):
    core = make("async", 1)
    for clock in range(5):
        core.push(0, clock, core.version, grads(clock))
        recovery.write(core, tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-4.json", "ckpt-4.npz", "ckpt-5.json", "ckpt-5.npz"]


def test_a_damaged_manifest_older_than_the_kept_checkpoints_goes_with_them_in_the_jobs_own_folder(tmp_path):
    """Found by the chaos suite (a replica pair, seed 7 run 4 and seed 8 run 9): a checkpoint whose manifest was made
    unreadable, skipped at a restore, was never pruned (pruning removed only manifests that name the job), so the
    folder held one checkpoint more than --keep-checkpoints for ever.  In the job's own folder it goes as the
    checkpoints after it do; in a folder that jobs share, nothing unreadable is touched."""
    own = checkpoint.shard_dir(tmp_path / "ckpt", 0, make("async", 1).fingerprint)
    shared = tmp_path / "shared" / "shard-0"
    for folder in (own, shared):
        core = make("async", 1)
        recovery.write(core, folder, keep=2, force=True)  # version 0, its manifest then damaged
        (folder / "ckpt-0.json").write_text("{not json")
        for clock in range(3):
            core.push(0, clock, core.version, grads(clock))
            recovery.write(core, folder, keep=2)
    assert checkpoint.versions(own) == [3, 2]
    assert checkpoint.versions(shared) == [3, 2, 0]  # another job's, for all it can tell


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path, damage, caplog):
    core = make("async", 1)
    core.push(0, 0, 0, grads(0))
    recovery.write(core, tmp_path)
    good = core.flat.copy()
    core.push(0, 1, 1, grads(1))
    recovery.write(core, tmp_path)
    npz, meta = tmp_path / "ckpt-2.npz", tmp_path / "ckpt-2.json"
    if damage == "truncate":
        npz.write_bytes(npz.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(npz.read_bytes())
        data[len(data) // 2] ^= 0xFF
        npz.write_bytes(bytes(data))
    elif damage == "delete":
        npz.unlink()
    else:
        meta.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="psgd.server.state.checkpoint"):
        saved = checkpoint.load_latest(tmp_path, PLAN.hash)
    assert saved.manifest["version"] == 1 and np.array_equal(saved.arrays["weights"], good)
    assert "skipping checkpoint" in caplog.text and "ckpt-2.json" in caplog.text


def test_a_checkpoint_of_another_plan_is_not_used(tmp_path):
    core = make("async", 1)
    recovery.write(core, tmp_path, force=True)
    assert checkpoint.load_latest(tmp_path, "another-plan") is None
    assert checkpoint.load_latest(tmp_path / "missing", PLAN.hash) is None


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    core = make("async", 1)
    core.push(0, 0, 0, grads(0))
    recovery.write(core, tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    core.push(0, 1, 1, grads(1))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", full)
    with pytest.raises(checkpoint.CheckpointError, match="No space left on device.*previous checkpoint is intact"):
        recovery.write(core, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no partial files left behind
    assert core.counters["checkpoint_failures"] == 1
    assert checkpoint.load_latest(tmp_path, PLAN.hash).manifest["version"] == 1


def test_a_checkpoint_is_written_whole_into_the_folder_it_began_in(tmp_path, monkeypatch):
    """A folder that another comes to stand for while a checkpoint is written (a disk mounted over it, as the chaos
    run's full-disk fault does; a folder moved aside and made again): the checkpoint used to be split between the
    two, its manifest's temporary file and its weights left behind without a manifest in the first, as in one CI
    run.  Each of its files is now written, renamed and checked in the folder it began in."""
    folder, aside = tmp_path / "shard-0", tmp_path / "aside"
    folder.mkdir()
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        real_fsync(fd)
        synced.append(fd)
        if len(synced) == 2:  # the manifest's temporary file written and synced, not yet renamed into place
            folder.rename(aside)
            folder.mkdir()

    monkeypatch.setattr(os, "fsync", fsync)
    checkpoint.save(folder, 7, {"weights": np.arange(4.0)}, {"fingerprint": "0123456789abcdef", "shard": 0})
    assert len(synced) >= 2, "the swap never happened: the test no longer reaches the manifest's rename"
    assert sorted(p.name for p in aside.iterdir()) == ["ckpt-7.json", "ckpt-7.npz"]
    assert list(folder.iterdir()) == []
    np.testing.assert_array_equal(checkpoint.load(aside, 7).arrays["weights"], np.arange(4.0))


def test_a_really_full_filesystem(tmp_path):
    """The same on a real 64 KiB tmpfs, where the kernel itself refuses the write (root only)."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        skip_or_fail(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        big = PartitionPlan([VarSpec("w", (6000,), "float64")], 1)  # 48 KB of weights
        core = ShardCore(
            big, 0, {0: np.zeros(6000)}, build_optimizer("sgd", lr=0.1), make_policy("async", 1), num_workers=1
        )
        core.register(0, big.hash)
        recovery.write(core, mnt)  # fits once
        core.push(0, 0, 0, {0: np.ones(6000)})
        with pytest.raises(checkpoint.CheckpointError, match="previous checkpoint is intact"):
            recovery.write(core, mnt)  # a second copy does not fit
        saved = checkpoint.load_latest(mnt, big.hash)
        assert saved.manifest["version"] == 0 and not saved.arrays["weights"].any()
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def tampered(core, tmp_path, version, change):
    """A checkpoint of ``core``'s state as ``version``, changed by ``change(arrays, manifest)`` and written with its
    hashes made again (what an editor of the files can do); a changed manifest is edited into its file after."""
    _, arrays, manifest = core.hand_over(lambda version: True)  # a copy of its whole state
    manifest = json.loads(json.dumps(manifest))
    edits: dict = {}
    change(arrays, edits)
    path = checkpoint.save(checkpoint.shard_dir(tmp_path, 0, core.fingerprint), version, arrays, manifest, keep=9)
    if edits:
        path.write_text(json.dumps({**json.loads(path.read_text()), **edits}))
    return path


def set_nan(arrays, manifest):
    arrays["weights"][0] = np.nan


def set_version(value):
    def change(arrays, manifest):
        manifest["version"] = value

    return change


def bad_optimizer(arrays, manifest):
    key = next(k for k in arrays if k.startswith("opt/") and not k.endswith("::t"))
    arrays[key] = np.zeros(arrays[key].size + 5)


@pytest.mark.parametrize(
    "change, why",
    [
        (set_nan, "non-finite"),
        (set_version(-5), "version"),
        (set_version(2**70), "version"),
        (bad_optimizer, "optimizer"),
    ],
)
def test_a_checkpoint_that_does_not_pass_is_skipped_for_the_newest_that_does(tmp_path, caplog, change, why):
    """Checkpoints were believed: an edited one (hashes made again) restored NaN weights, version -5 or 2^70, and
    one with a bad optimizer shape was refused without falling back to an older intact one."""
    a = make("async", 1)
    a.push(0, 0, 0, grads(0))
    a.push(0, 1, 1, grads(1))
    recovery.write(a, checkpoint.shard_dir(tmp_path, 0, a.fingerprint))  # intact: version 2
    a.push(0, 2, 2, grads(2))
    tampered(a, tmp_path, 3, change)
    b = make("async", 1)
    with caplog.at_level(logging.WARNING):
        recovery.resume(b, tmp_path)
    assert b.version == 2 and np.isfinite(b.flat).all()
    assert any("ckpt-3" in r.getMessage() and why in r.getMessage() for r in caplog.records), caplog.text


def test_a_shard_whose_checkpoints_all_fail_refuses_to_start_unless_fresh(tmp_path):
    a = make("async", 1)
    a.push(0, 0, 0, grads(0))
    tampered(a, tmp_path, 1, set_nan)
    with pytest.raises(checkpoint.CheckpointError, match="none of its 1 checkpoint.*passed.*--fresh"):
        recovery.resume(make("async", 1), tmp_path)
    fresh = make("async", 1)
    recovery.resume(fresh, tmp_path, fresh=True)
    assert fresh.version == 0


KEY, OTHER_KEY = checkpoint.signing_key("the job's token"), checkpoint.signing_key("another job's token")


def replaced_weights(path):
    """The checkpoint at ``path`` (a manifest) given weights of someone else's making, its npz's size and checksum in
    the manifest made again: what whoever can write the folder can do without the token."""
    manifest = json.loads(path.read_text())
    npz = path.parent / manifest["npz"]
    with np.load(npz) as data:
        arrays = {k: data[k] for k in data.files}
    arrays["weights"][:] = 250.8
    with open(npz, "wb") as f:
        np.savez(f, **arrays)
    manifest.update(npz_bytes=npz.stat().st_size, sha256=checkpoint._sha256(npz))
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("written", ["unsigned", "another token", "weights replaced"])
def test_a_job_with_a_token_restores_only_checkpoints_signed_with_it(tmp_path, caplog, written):
    """The checksums are in the manifest, which anyone who can write the folder can write again: a shard of a job with
    a token restores only a checkpoint whose manifest is signed with a key derived from the token, falling back to
    the newest that is."""
    a = make("async", 1)
    a.push(0, 0, 0, grads(0))
    folder = checkpoint.shard_dir(tmp_path, 0, a.fingerprint)
    recovery.write(a, folder, key=KEY)  # version 1, signed
    a.push(0, 1, 1, grads(1))
    path = recovery.write(a, folder, key={"unsigned": None, "another token": OTHER_KEY}.get(written, KEY))
    if written == "weights replaced":
        replaced_weights(path)
    b = make("async", 1)
    with caplog.at_level(logging.WARNING):
        recovery.resume(b, tmp_path, key=KEY)
    assert b.version == 1 and not (b.flat == 250.8).any()
    why = "not signed" if written == "unsigned" else "signature does not match this job's token"
    assert any("ckpt-2" in r.getMessage() and why in r.getMessage() for r in caplog.records), caplog.text
    unchecked = make("async", 1)  # a job without a token checks no signature: it believes the replaced weights
    recovery.resume(unchecked, tmp_path)
    assert unchecked.version == 2 and (unchecked.flat == 250.8).all() == (written == "weights replaced")


def test_a_signed_checkpoint_is_restored_whole_with_its_key(tmp_path):
    a = make("async", 1)
    a.push(0, 0, 0, grads(0))
    recovery.write(a, checkpoint.shard_dir(tmp_path, 0, a.fingerprint), key=KEY)
    b = make("async", 1)
    recovery.resume(b, tmp_path, key=KEY)
    assert b.version == 1 and np.array_equal(b.flat, a.flat)
    assert checkpoint.signing_key("") is None
