"""Keeping the trained model: joining shard checkpoints, writing and reading plain .npz files (no network)."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
from helpers import make_job, slice_weights

from psgd import weights as weight_files
from psgd.export import shards as export
from psgd.job import build_job, describe_job, fingerprint, identity
from psgd.partition import PartitionPlan
from psgd.server import build_shard
from psgd.server.durable import recovery
from psgd.server.state import checkpoint
from psgd.server.state.core import ShardCore
from psgd.weights import ExportError

# Small slices, so that every MLP tensor is cut and spread over the 3 shards.
SETS = ("model.hidden=[24]", "cluster.shards=3", "cluster.workers=1", "cluster.policy=async", "cluster.slice_bytes=512")


def job(*extra: str):
    return make_job(*SETS, *extra)


def cores(j) -> list[ShardCore]:
    out = [build_shard(describe_job(j), k) for k in range(j.cluster.shards)]
    for core in out:
        core.register(0, core.plan.hash)
    return out


def step(core: ShardCore, seed: int) -> None:
    """One async push of a random gradient: the shard's version goes up by one."""
    rng = np.random.default_rng(seed)
    grads = {i: rng.standard_normal(s.size).astype(s.dtype) for i, s in core.slices.items()}
    core.push(0, core.version, core.version, grads)


def joined_by_hand(j, shard_cores: list[ShardCore]) -> dict[str, np.ndarray]:
    """What the shards hold, put together slice by slice (independently of psgd.export.shards)."""
    plan = shard_cores[0].plan
    out = {s.name: np.full(s.shape, np.nan, dtype=s.dtype) for s in plan.specs}
    for core in shard_cores:
        for sl, w in slice_weights(core):
            out[sl.var].reshape(-1)[sl.start : sl.stop] = w
    return out


def write(root, shard_cores, keep=3):
    for core in shard_cores:
        recovery.write(core, checkpoint.shard_dir(root, core.shard, core.fingerprint), keep=keep, force=True)


def home(root, j):
    """Where psgd-server --checkpoint-dir ``root`` keeps job ``j``'s checkpoints: root/<its fingerprint>."""
    return root / fingerprint(identity(j, export.job_plan(j).hash))


def test_fresh_checkpoints_join_into_the_initial_weights_exactly(tmp_path):
    j = job()
    write(tmp_path, cores(j))
    plan = PartitionPlan(build_job(j).model.specs(), 3, 512)
    assert len(plan.slices) > 3 * len(plan.specs) and all(plan.slices_for_shard(k) for k in range(3))
    joined = export.join_checkpoints(j, tmp_path)
    weights, versions = joined.weights, joined.versions
    assert versions == [0, 0, 0]
    init = build_job(j).model.init(j.train.seed)
    assert list(weights) == list(init)
    for name, value in init.items():
        assert weights[name].dtype == value.dtype and np.array_equal(weights[name], value)


def test_checkpoints_after_training_join_bitwise_into_what_the_shards_hold(tmp_path):
    j = job()
    shard_cores = cores(j)
    for seed in range(4):
        for core in shard_cores:
            step(core, seed * 10 + core.shard)
    write(tmp_path, shard_cores)
    result = export.join_checkpoints(j, tmp_path)
    assert result.versions == [4, 4, 4] and not result.notes
    assert result.files == [str(home(tmp_path, j) / f"shard-{k}" / "ckpt-4.npz") for k in range(3)]
    assert result.source == f"checkpoints in {home(tmp_path, j)}"
    expected = joined_by_hand(j, shard_cores)
    for name, value in expected.items():
        assert np.array_equal(result.weights[name], value), name
    init = build_job(j).model.init(j.train.seed)
    assert not np.array_equal(result.weights["dense0/W"], init["dense0/W"])  # the pushes moved them


def versions_apart(tmp_path):
    """Shard 0 checkpointed at versions 1 and 2, shards 1 and 2 at 1 and 3 (as under async)."""
    j = job()
    shard_cores = cores(j)

    def step_all(seed, which):
        for c in shard_cores:
            if c.shard in which:
                step(c, seed)

    step_all(1, (0, 1, 2))
    write(tmp_path, shard_cores)
    at_1 = joined_by_hand(j, shard_cores)
    step_all(2, (0, 1, 2))
    write(tmp_path, shard_cores[:1])
    step_all(3, (1, 2))
    write(tmp_path, shard_cores[1:])
    return j, shard_cores, at_1


def test_differing_versions_are_refused_with_what_each_shard_has(tmp_path):
    j, _, _ = versions_apart(tmp_path)
    with pytest.raises(ExportError) as err:
        export.join_checkpoints(j, tmp_path)
    text = str(err.value)
    assert "different versions" in text and "shard-0: ckpt-2" in text and "shard-1: ckpt-3" in text
    assert "--version V" in text and "--mixed-versions" in text and "every shard has 1" in text
    assert "\n" not in text


def test_version_picks_one_checkpoint_of_every_shard(tmp_path):
    j, _, at_1 = versions_apart(tmp_path)
    result = export.join_checkpoints(j, tmp_path, version=1)
    assert result.versions == [1, 1, 1]
    for name, value in at_1.items():
        assert np.array_equal(result.weights[name], value)
    with pytest.raises(ExportError, match=r"version 3 is not in shard-0 .*shard-0: ckpt-2, ckpt-1.*every shard has 1"):
        export.join_checkpoints(j, tmp_path, version=3)


def test_mixed_versions_takes_the_newest_of_each(tmp_path):
    j, shard_cores, _ = versions_apart(tmp_path)
    result = export.join_checkpoints(j, tmp_path, mixed=True)
    assert result.versions == [2, 3, 3]
    for name, value in joined_by_hand(j, shard_cores).items():
        assert np.array_equal(result.weights[name], value)


def test_a_missing_shard_is_refused(tmp_path):
    j = job()
    write(tmp_path, cores(j))
    for p in (home(tmp_path, j) / "shard-1").iterdir():
        p.unlink()
    (home(tmp_path, j) / "shard-1").rmdir()
    with pytest.raises(
        ExportError,
        match=r"shard-1 has no intact checkpoint \(shard-0: ckpt-0; shard-1: no folder; "
        r"shard-2: ckpt-0\)",
    ):
        export.join_checkpoints(j, tmp_path)
    with pytest.raises(ExportError, match="does not exist"):
        export.join_checkpoints(j, tmp_path / "nowhere")


def damage(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before_and_says_so(tmp_path):
    j = job()
    shard_cores = cores(j)
    for c in shard_cores:
        step(c, 1)
    write(tmp_path, shard_cores)
    at_1 = joined_by_hand(j, shard_cores)
    for c in shard_cores:
        step(c, 2)
    write(tmp_path, shard_cores)
    for k in range(3):
        damage(home(tmp_path, j) / f"shard-{k}" / "ckpt-2.npz")
    result = export.join_checkpoints(j, tmp_path)
    assert result.versions == [1, 1, 1]
    assert (
        len(result.notes) == 3
        and "shard-0/ckpt-2 skipped (ckpt-2.npz does not match its checksum" in result.notes[0]
        and result.notes[0].endswith("took ckpt-1")
    )
    for name, value in at_1.items():
        assert np.array_equal(result.weights[name], value)


def test_a_damaged_checkpoint_on_one_shard_is_named(tmp_path):
    j = job()
    shard_cores = cores(j)
    write(tmp_path, shard_cores)
    for c in shard_cores:
        step(c, 2)
    write(tmp_path, shard_cores)
    (home(tmp_path, j) / "shard-2" / "ckpt-1.npz").write_bytes(b"PK truncated")
    with pytest.raises(ExportError, match=r"shard-0: ckpt-1, shard-1: ckpt-1, shard-2: ckpt-0"):
        export.join_checkpoints(j, tmp_path)  # shard 2 fell back to version 0: versions differ
    with pytest.raises(
        ExportError,
        match=r"shard-2/ckpt-1 is damaged: ckpt-1.npz does not match its checksum.*"
        r"shard-2: ckpt-1 \(damaged\), ckpt-0",
    ):
        export.join_checkpoints(j, tmp_path, version=1)
    assert export.join_checkpoints(j, tmp_path, version=0).versions == [0, 0, 0]
    (home(tmp_path, j) / "shard-2" / "ckpt-0.npz").unlink()
    with pytest.raises(
        ExportError,
        match=r"shard-2 has no intact checkpoint .*shard-2/ckpt-1: ckpt-1.npz does not "
        r"match",
    ):
        export.join_checkpoints(j, tmp_path, mixed=True)


def test_checkpoints_of_another_model_are_refused_with_the_jobs_plan(tmp_path):
    write(tmp_path, cores(job()))
    other = job("model.hidden=[32]")
    with pytest.raises(ExportError) as err:
        export.join_checkpoints(other, tmp_path)
    text = str(err.value)
    plan = export.job_plan(other)
    assert f"no checkpoints of this job (fingerprint {home(tmp_path, other).name}) in {tmp_path}" in text
    assert (
        f"only of another job: job {home(tmp_path, job()).name} (ckpt-0; differs in plan: this job "
        f"{plan.hash}, checkpoint {export.job_plan(job()).hash})" in text
    )
    assert f"this job describes plan {plan.hash}: model mlp, float32, 3 shard(s)" in text
    assert "dense0/W: job shape (64, 32) float32 vs checkpoints shape (64, 24) float32" in text
    assert "--model" in text and "-c job.toml" in text
    fewer = job("cluster.shards=2")  # the third folder is not looked at, but the plan says 3 shards
    with pytest.raises(ExportError, match="num_shards: job 2 vs checkpoints 3"):
        export.join_checkpoints(fewer, tmp_path)


def test_checkpoints_of_different_plans_are_refused(tmp_path):
    write(tmp_path, cores(job()))
    for p in (home(tmp_path, job()) / "shard-1").iterdir():
        p.unlink()
    other = cores(job("model.hidden=[32]"))
    recovery.write(other[1], home(tmp_path, job()) / "shard-1", force=True)  # copied into this job's folder
    with pytest.raises(
        ExportError,
        match=r"different partition plans \(shard-0/ckpt-0: plan \w+, shard-1/ckpt-0: "
        r"plan \w+, shard-2/ckpt-0: plan \w+; this job has plan \w+\)",
    ):
        export.join_checkpoints(job(), tmp_path)


def test_a_checkpoint_in_the_wrong_shard_folder_is_refused(tmp_path):
    j = make_job(
        "model.name=softmax", "cluster.shards=2", "cluster.workers=1", "cluster.slice_bytes=64", "cluster.policy=async"
    )
    shard_cores = cores(j)
    recovery.write(shard_cores[0], home(tmp_path, j) / "shard-0", force=True)
    recovery.write(shard_cores[0], home(tmp_path, j) / "shard-1", force=True)
    with pytest.raises(ExportError, match="says it is shard 0's, but it lies in .*shard-1"):
        export.join_checkpoints(j, tmp_path)


def test_a_reused_folder_joins_this_jobs_checkpoints_not_another_jobs_newer_ones(tmp_path):
    j = job()
    other = cores(job("cluster.workers=2"))  # the same plan, trained as another job, to version 580
    for core in other:
        core.version = 580
    write(tmp_path, other)
    mine = cores(j)
    for core in mine:
        step(core, core.shard)
    write(tmp_path, mine)
    result = export.join_checkpoints(j, tmp_path)
    assert result.versions == [1, 1, 1] and result.source == f"checkpoints in {home(tmp_path, j)}"
    for name, value in joined_by_hand(j, mine).items():
        assert np.array_equal(result.weights[name], value), name


def test_checkpoints_of_another_job_with_the_same_plan_are_named_with_what_differs(tmp_path):
    trained = job("cluster.workers=2", "optimizer.lr=0.2")
    write(tmp_path, cores(trained))
    theirs = home(tmp_path, trained)
    with pytest.raises(ExportError) as err:
        export.join_checkpoints(job(), tmp_path)
    text = str(err.value)
    assert (
        f"no checkpoints of this job (fingerprint {home(tmp_path, job()).name}) in {tmp_path}, only of another "
        f"job: job {theirs.name} (ckpt-0; differs in workers: this job 1, checkpoint 2; optimizer: this job "
        "{lr=0.05}, checkpoint {lr=0.2})" in text
    )
    assert f"or --checkpoints {theirs} to join its checkpoints as they are" in text and "\n" not in text
    assert export.join_checkpoints(job(), theirs).versions == [0, 0, 0]  # a job's folder named directly


def test_checkpoints_in_the_layout_before_fingerprints_still_join(tmp_path):
    j = job()
    for core in cores(j):
        recovery.write(
            core, checkpoint.shard_dir(tmp_path, core.shard), force=True
        )  # DIR/shard-K, as psgd wrote before
    result = export.join_checkpoints(j, tmp_path)
    assert result.versions == [0, 0, 0] and result.source == f"checkpoints in {tmp_path}"


def test_saved_weights_load_without_pickle_and_the_write_is_atomic(tmp_path, monkeypatch):
    weights = {"dense0/W": np.arange(6, dtype=np.float32).reshape(2, 3), "file": np.ones(2)}
    path = tmp_path / "w.npz"
    size = weight_files.save_weights(path, weights)
    assert size == path.stat().st_size
    with np.load(path, allow_pickle=False) as data:
        assert sorted(data.files) == ["dense0/W", "file"]
        assert np.array_equal(data["dense0/W"], weights["dense0/W"]) and data["dense0/W"].dtype == np.float32

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np.lib.format, "write_array", full)
    with pytest.raises(ExportError, match=f"cannot write {path}: No space left on device"):
        weight_files.save_weights(path, {"x": np.zeros(3)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.npz"]  # the old file, no temporary left
    with np.load(path, allow_pickle=False) as data:
        assert sorted(data.files) == ["dense0/W", "file"]
    with pytest.raises(ExportError, match="holds Python objects"):
        weight_files.save_weights(tmp_path / "o.npz", {"o": np.array([None], dtype=object)})


def test_load_weights_names_each_difference():
    specs = build_job(make_job("model.hidden=[24]")).model.specs()
    good = {s.name: np.zeros(s.shape, s.dtype) for s in specs}
    assert weight_files.weight_differences(good, specs) == []
    bad = dict(good)
    del bad["dense1/b"]
    bad["extra"] = np.zeros(1, np.float32)
    bad["dense0/W"] = np.zeros((64, 10), np.float32)
    bad["dense0/b"] = np.zeros(24, np.float64)
    assert weight_files.weight_differences(bad, specs) == [
        "missing dense1/b",
        "extra extra",
        "dense0/W has shape (64, 10), the model's is (64, 24)",
        "dense0/b is float64, the model's is float32",
    ]
    doubles = {k: v.astype(np.float64) for k, v in good.items()}
    assert weight_files.weight_differences(doubles, specs) == ["every variable is float64, the model's are float32"]


@pytest.mark.parametrize(
    "kind, message",
    [
        ("text", "not an .npz archive"),
        ("pickle", "is a Python pickle, which psgd never loads"),
        ("object", "array 'a' is an object array; psgd never unpickles data"),
        ("npy", "is a single .npy array, expected an .npz archive"),
        ("truncated", "not a readable .npz archive|array 'a' is corrupt"),
        ("missing", "no such file"),
    ],
)
def test_files_that_are_not_plain_npz_are_refused(tmp_path, kind, message):
    path = tmp_path / "w.npz"
    if kind == "text":
        path.write_text("hello")
    elif kind == "pickle":
        path.write_bytes(pickle.dumps({"a": np.zeros(2)}))
    elif kind == "object":
        with open(path, "wb") as f:
            np.savez(f, a=np.array([{"x": 1}], dtype=object))
    elif kind == "npy":
        with open(path, "wb") as f:
            np.save(f, np.zeros(3))
    elif kind == "truncated":
        weight_files.save_weights(path, {"a": np.zeros(100)})
        path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ExportError, match=message) as err:
        weight_files.read_npz(path)
    assert "\n" not in str(err.value)


def test_checkpoint_load_checks_without_unpickling(tmp_path):
    core = cores(job())[0]
    recovery.write(core, tmp_path, force=True)
    assert checkpoint.versions(tmp_path) == [0] and checkpoint.versions(tmp_path / "none") == []
    light = checkpoint.load(tmp_path, 0, arrays=False)
    assert light.arrays == {} and light.manifest["version"] == 0
    only = checkpoint.load(tmp_path, 0, arrays=["weights"])
    assert list(only.arrays) == ["weights"] and np.array_equal(only.arrays["weights"], core.flat)
    meta = tmp_path / "ckpt-0.json"
    manifest = json.loads(meta.read_text())
    meta.write_text(json.dumps([manifest]))
    with pytest.raises(checkpoint.CheckpointError, match="not a JSON object"):
        checkpoint.load(tmp_path, 0)
    os.unlink(meta)
    with pytest.raises(checkpoint.CheckpointError, match="FileNotFoundError"):
        checkpoint.load(tmp_path, 0)
