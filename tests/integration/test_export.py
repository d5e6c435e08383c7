"""``psgd export`` and ``psgd eval`` end to end: shards served in this process, the CLI run in-process."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import make_ca, make_cert, make_job, shards

from psgd.cli.main import main
from psgd.config import Deadlines, to_toml
from psgd.job import build_job, describe_job
from psgd.partition import PartitionPlan
from psgd.server import build_shard
from psgd.server.net.service import ShardServer
from psgd.wire.tls import TLSFiles
from psgd.worker.client import PSClient, fetch_weights

SETS = (
    "model.hidden=[24]",
    "cluster.shards=2",
    "cluster.workers=1",
    "cluster.policy=async",
    "cluster.slice_bytes=512",
    "cluster.request_timeout=5",
)


def job(*extra: str):
    return make_job(*SETS, *extra)


def flags(j) -> list[str]:
    """The CLI flags that describe ``j`` (the model, data and cluster layout)."""
    return [
        "--set",
        "model.hidden=[24]",
        "--shards",
        str(j.cluster.shards),
        "--set",
        "cluster.slice_bytes=512",
        "--set",
        "cluster.request_timeout=5",
    ]


def push_steps(j, steps: int) -> None:
    plan = PartitionPlan(build_job(j).model.specs(), j.cluster.shards, j.cluster.links.slice_bytes)
    rng = np.random.default_rng(7)
    with PSClient(j.cluster.servers, plan, 0, deadlines=Deadlines(request_timeout=5), config=j) as client:
        client.register()
        for clock in range(steps):
            client.pull(clock, {s.name: np.empty(s.shape, s.dtype) for s in plan.specs})
            client.push(clock, {s.name: rng.standard_normal(s.shape).astype(s.dtype) for s in plan.specs})


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_export_from_a_running_cluster_gives_its_weights_exactly(tmp_path, capsys):
    j = job()
    out = tmp_path / "model.npz"
    with shards(j) as (j, servers):
        code, text, _ = run(
            capsys,
            "export",
            "--servers",
            ",".join(j.cluster.servers),
            *flags(j)[:2],
            "--set",
            "cluster.slice_bytes=512",
            str(out),
        )
        assert code == 0, text
        init = build_job(j).model.init(j.train.seed)
        with np.load(out, allow_pickle=False) as data:
            assert sorted(data.files) == sorted(init)
            for name, value in init.items():
                assert data[name].dtype == value.dtype and np.array_equal(data[name], value)
        assert text.startswith(
            f"wrote {out}: 4 variables, {sum(v.size for v in init.values())} parameters, "
            f"{out.stat().st_size} bytes; versions shard 0: 0, shard 1: 0; from the cluster at "
        )

        push_steps(j, 3)
        code, text, _ = run(capsys, "export", "--servers", ",".join(j.cluster.servers), *flags(j), "--json", str(out))
        assert code == 0
        summary = json.loads(text)
        assert summary["versions"] == [3, 3] and summary["bytes"] == out.stat().st_size
        assert [s.core.version for s in servers] == [3, 3]
        plan = PartitionPlan(build_job(j).model.specs(), 2, 512)
        observed = fetch_weights(j.cluster.servers, plan)
        with np.load(out, allow_pickle=False) as data:
            for name, value in observed.items():
                assert np.array_equal(data[name], value)
            assert not np.array_equal(data["dense0/W"], init["dense0/W"])


def test_export_refuses_a_job_that_does_not_describe_the_cluster(tmp_path, capsys):
    j = job()
    with shards(j) as (j, _):
        a, b = j.cluster.servers
        code, _, err = run(
            capsys,
            "export",
            "--servers",
            f"{a},{b}",
            "--set",
            "model.hidden=[32]",
            "--set",
            "cluster.slice_bytes=512",
            str(tmp_path / "m.npz"),
        )
        assert code == 2
        assert f"holds plan {build_shard(describe_job(j), 0).plan.hash}" in err and "-c job.toml, or --model" in err
        code, _, err = run(capsys, "export", "--servers", f"{b},{a}", *flags(j), str(tmp_path / "m.npz"))
        assert code == 2 and f"{b} is shard 1 of 2, listed as shard 0 of 2" in err
    assert not (tmp_path / "m.npz").exists()
    code, _, err = run(capsys, "export", *flags(j), str(tmp_path / "m.npz"))
    assert code == 2 and "no shard addresses: pass --servers" in err and err.count("\n") == 1


def test_export_with_a_token(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PSGD_TOKEN", raising=False)
    j = job("cluster.shards=1")
    server = ShardServer(build_shard(describe_job(j), 0), "127.0.0.1:0", token="s3cret-of-this-job").start()
    try:
        argv = ["export", "--servers", server.address, *flags(j), "--timeout", "2", str(tmp_path / "m.npz")]
        code, _, err = run(capsys, *argv)
        assert code == 1 and "UNAUTHENTICATED" in err
        code, text, _ = run(capsys, *argv, "--token", "s3cret-of-this-job")
        assert code == 0 and "versions shard 0: 0" in text
    finally:
        server.stop(grace=1.0)


@pytest.mark.lacks(shutil.which("openssl") is None, reason="openssl is not installed")
def test_export_over_tls(tmp_path, capsys):
    make_ca(tmp_path, "ca")
    make_cert(tmp_path, "shard", "ca", "IP:127.0.0.1")
    j = job("cluster.shards=1")
    tls = TLSFiles(str(tmp_path / "shard.pem"), str(tmp_path / "shard.key"), None)
    server = ShardServer(build_shard(describe_job(j), 0), "127.0.0.1:0", tls=tls).start()
    try:
        code, text, err = run(
            capsys,
            "export",
            "--servers",
            server.address,
            *flags(j),
            "--tls-ca",
            str(tmp_path / "ca.pem"),
            str(tmp_path / "m.npz"),
        )
        assert code == 0, err
        with np.load(tmp_path / "m.npz", allow_pickle=False) as data:
            assert np.array_equal(data["dense0/W"], build_job(j).model.init(0)["dense0/W"])
    finally:
        server.stop(grace=1.0)


def test_export_from_checkpoints_then_eval(tmp_path, capsys):
    j = job()
    ckpt = tmp_path / "ckpt"
    servers = [
        ShardServer(
            build_shard(describe_job(j), k), "127.0.0.1:0", checkpoint_dir=str(ckpt), checkpoint_seconds=3600
        ).start()
        for k in range(2)
    ]
    folder = ckpt / servers[0].core.fingerprint  # DIR/<the job's fingerprint>/shard-K
    try:
        j = j.override("cluster.servers", [s.address for s in servers])
        push_steps(j, 4)
        live = fetch_weights(j.cluster.servers, PartitionPlan(build_job(j).model.specs(), 2, 512))
    finally:
        for s in servers:
            s.stop(grace=1.0)  # writes a last checkpoint
    job_file = tmp_path / "job.toml"
    doc = j.to_dict()
    doc["cluster"]["servers"] = []
    job_file.write_text(to_toml(doc))

    out = tmp_path / "model.npz"
    code, text, err = run(capsys, "export", "-c", str(job_file), "--checkpoints", str(ckpt), str(out))
    assert code == 0, err
    assert text == (
        f"wrote {out}: 4 variables, {sum(v.size for v in live.values())} parameters, "
        f"{out.stat().st_size} bytes; versions shard 0: 4, shard 1: 4; from checkpoints in {folder}\n"
    )
    assert sorted(p.name for p in folder.iterdir()) == ["shard-0", "shard-1"]
    with np.load(out, allow_pickle=False) as data:
        for name, value in live.items():
            assert np.array_equal(data[name], value)

    code, text, _ = run(capsys, "eval", "-c", str(job_file), str(out), "--json")
    result = json.loads(text)
    built = build_job(j)
    from psgd.job import params_to_device
    from psgd.training.evaluation import evaluate

    loss, acc = evaluate(
        built.model,
        params_to_device(live, built.device),
        built.dataset.x_test,
        built.dataset.y_test,
        built.device,
        j.train.eval_batch_size,
    )
    assert code == 0 and result["test_accuracy"] == acc and result["test_loss"] == loss

    code, _, err = run(capsys, "export", "--checkpoints", str(ckpt), str(out))  # the default MLP: another plan
    assert code == 2 and "written for partition plan" in err and "this job describes plan" in err
    assert "no checkpoints of this job (fingerprint" in err and f"only of another job: job {folder.name}" in err
    code, _, err = run(capsys, "export", "--version", "3", str(out))
    assert code == 2 and "use it with --checkpoints DIR" in err


def test_eval_of_a_file_saved_by_train_gives_the_accuracy_train_printed(tmp_path, capsys):
    saved = tmp_path / "w.npz"
    code, text, _ = run(capsys, "train", "--epochs", "2", "--no-progress", "--json", "-q", "--save", str(saved))
    assert code == 0
    trained = json.loads(text)
    code, text, _ = run(capsys, "eval", str(saved), "--json", "-q")
    assert code == 0
    evaluated = json.loads(text)
    assert evaluated["test_accuracy"] == trained["test_accuracy"]
    assert evaluated["test_loss"] == trained["test_loss"]
    assert evaluated["variables"] == 6 and evaluated["examples"] > 0
    code, text, _ = run(capsys, "eval", str(saved), "-q")
    assert text.startswith(
        f"test accuracy: {trained['test_accuracy']:.4f} (loss {trained['test_loss']:.4f}) of {saved}: 6 variables"
    )

    code, _, err = run(capsys, "eval", str(saved), "--model", "softmax")
    assert code == 2 and err.count("\n") == 1
    assert "missing" not in err and "extra dense1/W, dense1/b, dense2/W, dense2/b" in err
    assert "dense0/W has shape (64, 128), the model's is (64, 10)" in err
    code, _, err = run(capsys, "eval", str(saved), "--dtype", "float64")
    assert code == 2 and "every variable is float32, the model's are float64" in err
    with np.load(saved, allow_pickle=False) as data:
        partial = {k: data[k] for k in data.files if k != "dense2/b"}
    np.savez(tmp_path / "partial.npz", **partial)
    code, _, err = run(capsys, "eval", str(tmp_path / "partial.npz"))
    assert code == 2 and "does not fit this job's model: missing dense2/b; pass the job file" in err
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    code, _, err = run(capsys, "eval", str(tmp_path / "junk.npz"))
    assert code == 2 and err.strip().startswith(f"psgd: error: {tmp_path / 'junk.npz'}: not an .npz archive")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_export_from_running_shards_refuses_different_versions_as_from_checkpoints(tmp_path, capsys):
    """A shard a push reached and one it did not (a shard killed and restarted, a worker that died between its
    pushes): export from running shards used to join versions 132 and 130 silently.  It refuses, naming each, and
    joins them only when told to (--mixed-versions), as export from checkpoints does."""
    j = job()
    out = tmp_path / "model.npz"
    with shards(j) as (j, servers):
        plan = PartitionPlan(build_job(j).model.specs(), 2, 512)
        core = servers[0].core  # a push that reached shard 0 only
        core.register(0, plan.hash)
        core.push(0, 0, 0, {i: np.full(s.size, 1e-3, dtype=core.dtype) for i, s in core.slices.items()})
        assert [s.core.version for s in servers] == [1, 0]
        code, _, err = run(capsys, "export", "--servers", ",".join(j.cluster.servers), *flags(j), str(out))
        assert code == 2 and "different versions (shard 0: 1, shard 1: 0)" in err and "--mixed-versions" in err, err
        assert not out.exists()
        code, text, _ = run(
            capsys,
            "export",
            "--servers",
            ",".join(j.cluster.servers),
            *flags(j),
            "--mixed-versions",
            "--json",
            str(out),
        )
        assert code == 0 and json.loads(text)["versions"] == [1, 0]
