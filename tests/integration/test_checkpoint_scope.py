"""Checkpoints scoped to their job: DIR/<fingerprint>/shard-K.

A checkpoint folder reused by another job (a compose volume survives
``docker compose down``) must not cost the new job its checkpoints: pruning
touches only this job's files, crash leftovers are removed at start, and a
shard that finds only another job's checkpoints refuses to start unless told
``--fresh``.  In-process where possible; ``psgd-server`` as a user starts it
where the start itself is under test.  Every wait is bounded.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import TOKEN, by_hand_env, make_job, skip_or_fail, wait_for

from psgd.config import to_toml
from psgd.job import describe_job
from psgd.ops.reach import Connect
from psgd.ops.view import collect
from psgd.server import build_shard
from psgd.server.durable import recovery
from psgd.server.net.service import ShardServer
from psgd.server.state import checkpoint
from psgd.server.state.core import ShardCore

SETS = ("model.name=softmax", "cluster.shards=1", "cluster.workers=1", "cluster.policy=async")


def job(*extra: str):
    return make_job(*SETS, *extra)


def shard(j) -> ShardCore:
    core = build_shard(describe_job(j), 0)
    core.register(0, core.plan.hash)
    return core


def step(core: ShardCore, seed: int) -> None:
    """One async push of a random gradient: the shard's version goes up by one."""
    rng = np.random.default_rng(seed)
    core.push(
        0, core.version, core.version, {i: rng.standard_normal(s.size).astype(s.dtype) for i, s in core.slices.items()}
    )


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())} if folder.is_dir() else {}


def untouched(folder: Path, before: dict[str, bytes]) -> bool:
    """True when the files in ``before`` are all still in ``folder``, byte for byte."""
    now = files(folder)
    return {name: now.get(name) for name in before} == before


def plant_other_job(root: Path, where: str, mine: str) -> Path:
    """Another model's ckpt-576/578/580 of shard 0, as a reused folder holds them: in the layout of
    an earlier psgd (``root/shard-0``, manifests without a fingerprint), under the other job's own
    fingerprint, or copied into this job's folder.  Returns their folder."""
    other = shard(job("model.name=mlp", "model.hidden=[8]"))
    folder = {
        "old layout": checkpoint.shard_dir(root, 0),
        "own fingerprint": checkpoint.shard_dir(root, 0, other.fingerprint),
        "this job's folder": checkpoint.shard_dir(root, 0, mine),
    }[where]
    for version in (576, 578, 580):
        other.version = version
        meta = recovery.write(other, folder, keep=3, force=True)
        if where == "old layout":
            manifest = json.loads(meta.read_text())
            del manifest["fingerprint"], manifest["identity"]
            meta.write_text(json.dumps(manifest))
    return folder


@pytest.mark.parametrize("where", ["old layout", "own fingerprint", "this job's folder"])
def test_a_reused_folder_keeps_this_jobs_checkpoints_and_leaves_the_other_jobs_alone(tmp_path, where):
    root = tmp_path / "ckpt"
    core = shard(job())
    theirs = plant_other_job(root, where, core.fingerprint)
    before = files(theirs)
    mine = checkpoint.shard_dir(root, 0, core.fingerprint)
    server = ShardServer(
        core, "127.0.0.1:0", transport="grpc", checkpoint_dir=str(root), checkpoint_seconds=3600, keep_checkpoints=2
    ).start()
    try:
        for seed in range(4):
            step(core, seed)
            server.save_checkpoint()
        ours = {n for n, _ in files(mine).items() if not n.startswith("ckpt-5")}  # 576..580 may share the folder
        assert {"ckpt-3.json", "ckpt-3.npz", "ckpt-4.json", "ckpt-4.npz"} <= ours
        assert not {"ckpt-1.json", "ckpt-2.json"} & ours  # this job's older ones were pruned
        assert untouched(theirs, before)  # the other job's files: byte for byte
        # psgd status reports the checkpoint this job wrote, and it exists
        row = collect([server.address], Connect(timeout=5)).shard_rows()[0]
        assert row["checkpoint_version"] == 4 and (mine / "ckpt-4.json").exists() and (mine / "ckpt-4.npz").exists()
        weights = core.flat.copy()
        # a kill here: a new shard process restores this job's newest, never the other job's ckpt-580
        again = shard(job())
        saved = checkpoint.load_latest(mine, again.plan.hash, again.fingerprint)
        recovery.restore(again, saved)
        assert again.version == 4 and np.array_equal(again.flat, weights)
    finally:
        server.stop(grace=0.5)
    assert untouched(theirs, before)


def test_pruning_counts_only_this_jobs_checkpoints_and_keeps_the_one_just_written(tmp_path):
    core = shard(job())
    other = shard(job("cluster.workers=2"))  # the same plan, another job
    assert other.plan.hash == core.plan.hash and other.fingerprint != core.fingerprint
    other.version = 100
    recovery.write(other, tmp_path, keep=1, force=True)
    for seed in range(3):
        step(core, seed)
        recovery.write(core, tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-100.json", "ckpt-100.npz", "ckpt-3.json", "ckpt-3.npz"]
    assert checkpoint.load_latest(tmp_path, core.plan.hash, core.fingerprint).manifest["version"] == 3
    manifest = json.loads((tmp_path / "ckpt-3.json").read_text())
    assert manifest["fingerprint"] == core.fingerprint and manifest["identity"] == core.identity
    assert manifest["shard"] == 0
    with pytest.raises(
        checkpoint.CheckpointError,
        match=f"is shard 0's of job {other.fingerprint}, this is shard 0 of job {core.fingerprint}",
    ):
        recovery.restore(core, checkpoint.load(tmp_path, 100))


def leftovers(folder: Path) -> int:
    """What kills in the middle of checkpoints 5 and 6 leave behind; returns their size in bytes."""
    left = {
        "ckpt-5.npz": b"x" * 1000,  # renamed into place; the kill came before its manifest
        ".ckpt-5.json.tmp": b'{"vers',
        ".ckpt-6.npz.tmp": b"y" * 300,
    }
    for name, data in left.items():
        (folder / name).write_bytes(data)
    return sum(len(data) for data in left.values())


def test_crash_leftovers_are_removed_and_nothing_else(tmp_path, caplog):
    core = shard(job())
    folder = checkpoint.shard_dir(tmp_path, 0, core.fingerprint)
    step(core, 0)
    recovery.write(core, folder)
    other = shard(job("cluster.workers=2"))
    other.version = 9
    recovery.write(other, folder, force=True)  # another job's, copied in: not a leftover
    (folder / "notes.txt").write_text("mine")
    kept = files(folder)
    size = leftovers(folder)
    with caplog.at_level(logging.INFO, logger="psgd.server.state.checkpoint"):
        removed, nbytes = checkpoint.remove_leftovers(folder)
    assert sorted(removed) == [".ckpt-5.json.tmp", ".ckpt-6.npz.tmp", "ckpt-5.npz"] and nbytes == size
    assert files(folder) == kept
    lines = [r.getMessage() for r in caplog.records if "interrupted" in r.getMessage()]
    assert lines == [
        f"removed what interrupted checkpoints left in {folder}: .ckpt-5.json.tmp, .ckpt-6.npz.tmp, "
        f"ckpt-5.npz ({size} bytes)"
    ]
    assert checkpoint.remove_leftovers(folder) == ([], 0) and checkpoint.remove_leftovers(tmp_path / "none") == ([], 0)


# -- a checkpoint that cannot be written says what is left ------------------------------------------------
def test_a_folder_that_cannot_be_written_says_there_is_no_earlier_checkpoint(tmp_path):
    core = shard(job())
    (tmp_path / "a-file").write_text("")  # a folder under a file: refused even to root
    with pytest.raises(checkpoint.CheckpointError) as err:
        recovery.write(core, tmp_path / "a-file" / "shard-0")
    assert "no earlier checkpoint to fall back on" in str(err.value) and "intact" not in str(err.value)
    assert core.counters["checkpoint_failures"] == 1


def test_a_failed_checkpoint_names_the_previous_one_when_there_is_one(tmp_path, monkeypatch):
    core = shard(job())
    other = shard(job("cluster.workers=2"))
    other.version = 50
    recovery.write(other, tmp_path, force=True)  # another job's is no fallback for this one
    step(core, 0)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(np, "savez", full)
        with pytest.raises(checkpoint.CheckpointError, match="no earlier checkpoint to fall back on"):
            recovery.write(core, tmp_path)
    recovery.write(core, tmp_path)
    step(core, 1)
    monkeypatch.setattr(np, "savez", full)
    with pytest.raises(checkpoint.CheckpointError, match=r"previous checkpoint is intact \(ckpt-1\)"):
        recovery.write(core, tmp_path)


def test_a_read_only_folder(tmp_path):
    """A folder the shard cannot write into: chmod 500 for a user; for root, who writes into that anyway,
    a read-only tmpfs mounted on it."""
    core = shard(job())
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = False
    try:
        if os.geteuid() != 0:
            folder.chmod(0o500)
        else:
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)], capture_output=True, text=True
            )
            if done.returncode != 0:
                skip_or_fail(f"root cannot mount a tmpfs here: {done.stderr.strip()}")
            mounted = True
        with pytest.raises(checkpoint.CheckpointError) as err:
            recovery.write(core, folder)
        assert "no earlier checkpoint to fall back on" in str(err.value) and "intact" not in str(err.value)
        assert checkpoint.remove_leftovers(folder) == ([], 0)  # nothing to remove, and no error either
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], capture_output=True)
        folder.chmod(0o700)


# -- psgd-server on start ----------------------------------------------------------------------------------
class Server:
    """``psgd-server`` started as a user starts it, its log kept; every wait bounded."""

    def __init__(self, tmp: Path, j, root: Path, *extra: str, name: str = "shard"):
        self.tmp, self.log, self.port_file = tmp, tmp / f"{name}.log", tmp / f"{name}.port"
        path = tmp / f"{name}.toml"
        path.write_text(to_toml(j.to_dict()))
        exe = Path(sys.executable).with_name("psgd-server")
        argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "psgd.cli.server"]
        self.proc = subprocess.Popen(
            [
                *argv,
                "-c",
                str(path),
                "--shard",
                "0",
                "--bind",
                "127.0.0.1:0",
                "--port-file",
                str(self.port_file),
                "--checkpoint-dir",
                str(root),
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.log, "w"),
            env=by_hand_env(),
        )

    def text(self) -> str:
        return self.log.read_text()

    def serving(self) -> None:
        wait_for(lambda: self.port_file.exists() or self.proc.poll() is not None, 30, "psgd-server to serve")
        assert self.proc.poll() is None, self.text()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.mark.parametrize("where", ["own fingerprint", "old layout"])
def test_a_shard_refuses_another_jobs_checkpoints_unless_told_fresh(tmp_path, where):
    root = tmp_path / "ckpt"
    mine = job()
    other = shard(job("cluster.workers=2", "optimizer.lr=0.2"))  # the same model, trained as another job
    other.version = 580
    theirs = checkpoint.shard_dir(root, 0, other.fingerprint if where == "own fingerprint" else None)
    meta = recovery.write(other, theirs, force=True)
    if where == "old layout":  # as an earlier psgd wrote it: no fingerprint in the manifest
        manifest = json.loads(meta.read_text())
        del manifest["fingerprint"], manifest["identity"]
        meta.write_text(json.dumps(manifest))
    before = files(theirs)
    fingerprint = shard(mine).fingerprint

    refused = Server(tmp_path, mine, root, name="refused")
    try:
        assert refused.proc.wait(30) == 2, refused.text()
    finally:
        refused.close()
    line = refused.text().strip().splitlines()[-1]
    assert line.startswith("psgd-server: error: shard 0: ") and refused.text().count("error:") == 1
    assert (
        f"holds no checkpoint of this job (fingerprint {fingerprint}) but shard 0's checkpoints of another job: "
        in line
        and "ckpt-580" in line
        and "--fresh" in line
    )
    if where == "own fingerprint":
        assert (
            f"job {other.fingerprint} (ckpt-580; differs in workers: this job 1, checkpoint 2; optimizer: this "
            "job {lr=0.05}, checkpoint {lr=0.2})" in line
        )
    else:
        assert (
            f"{theirs} (ckpt-580, written before checkpoints were scoped to their job; the same plan, no "
            "identity recorded)" in line
        )
    assert not (root / fingerprint).exists() and files(theirs) == before

    fresh = Server(tmp_path, mine, root, "--fresh", name="fresh")
    try:
        fresh.serving()
        assert fresh.stop() == 0, fresh.text()
    finally:
        fresh.close()
    assert "--fresh: starting from the initial weights" in fresh.text()
    assert checkpoint.versions(checkpoint.shard_dir(root, 0, fingerprint)) == [0]  # its last checkpoint, on SIGTERM
    assert files(theirs) == before


def test_psgd_server_removes_leftovers_and_restores_this_jobs_newest_beside_another_jobs(tmp_path):
    """The compose case after a kill: the volume holds an older model's ckpt-576..580 (old layout) and this
    job's checkpoints with what the kill left (signed with the job's token, as its shard wrote them); ``--fresh``
    stays in the command line, as it would in a compose file, and still resumes this job."""
    root = tmp_path / "ckpt"
    theirs = plant_other_job(root, "old layout", "")
    before = files(theirs)
    core = shard(job())
    folder = checkpoint.shard_dir(root, 0, core.fingerprint)
    for seed in range(3):
        step(core, seed)
        recovery.write(core, folder, key=checkpoint.signing_key(TOKEN))
    size = leftovers(folder)
    server = Server(tmp_path, job(), root, "--fresh")
    try:
        server.serving()
        assert server.stop() == 0, server.text()
    finally:
        server.close()
    text = server.text()
    assert (
        f"removed what interrupted checkpoints left in {folder}: .ckpt-5.json.tmp, .ckpt-6.npz.tmp, ckpt-5.npz "
        f"({size} bytes)" in text
    )
    assert f"restored version 3 from {folder / 'ckpt-3.json'}" in text and "--fresh" not in text
    assert sorted(files(folder)) == [
        "ckpt-1.json",
        "ckpt-1.npz",
        "ckpt-2.json",
        "ckpt-2.npz",
        "ckpt-3.json",
        "ckpt-3.npz",
    ]
    assert files(theirs) == before
